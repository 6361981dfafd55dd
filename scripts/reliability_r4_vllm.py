"""Reliability sweep, round four (issue 52): vLLM as a bench engine (bench/vllm/), its bad inputs refused with one
line before any vLLM server starts (so these cases need no .venv-vllm and start nothing).

`cases(h)` returns rows in scripts/reliability_sweep.py's case format (area, name, argv, rc, expect, risk from
reliability_doc.RISKS, optional setup / check / run / during); `h` is the sweep's HELPERS namespace.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any

VENV_ENV = "SPECHEADS_VLLM_VENV"  # bench/vllm/server.py's


@contextlib.contextmanager
def no_venv(ctx):
    """SPECHEADS_VLLM_VENV at a folder that does not exist while the CLI runs; the environment restored after."""
    before = os.environ.get(VENV_ENV)
    os.environ[VENV_ENV] = str(ctx.tmp / "no-vllm-venv")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(VENV_ENV, None)
        else:
            os.environ[VENV_ENV] = before


def no_server(ctx) -> str:
    import subprocess

    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=False).stdout
    assert str(ctx.tmp) not in ps, "a process naming the case's folder is still running"
    assert os.environ.get(VENV_ENV) != str(ctx.tmp / "no-vllm-venv"), "the environment was not restored"
    return "no server left running; the environment restored"


def cases(h) -> list[dict[str, Any]]:
    bench = ["bench", "--target", "{target}", "--dataset", "mt-bench", "--limit", "1", "--max-new-tokens", "2",
             "--warmup-tokens", "0", "--out", "{tmp}/b"]
    return [
        {"area": "vllm", "risk": "unclear", "name": "bench vllm:LABEL naming no --head",
         "setup": h.head, "argv": bench + ["--head", "h={head}", "--methods", "vllm:other"], "rc": 2,
         "expect": "--methods vllm:other: no --head labelled 'other' and no such folder (given: ['h'])"},
        {"area": "vllm", "risk": "silent wrong result", "name": "bench vllm:LABEL with a tree --tree",
         "setup": h.head, "argv": bench + ["--head", "h={head}", "--tree", "2,2,4", "--methods", "vllm:h"], "rc": 2,
         "expect": "vLLM drafts a chain; give that head --tree chain:K"},
        {"area": "vllm", "risk": "traceback", "name": "bench vllm with no vLLM venv",
         "during": no_venv, "argv": bench + ["--methods", "vllm"], "rc": 2,
         "expect": "vllm methods: no vLLM venv at", "check": no_server},
    ]

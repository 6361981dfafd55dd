"""Reliability sweep, round four (issue 50 points 1 and 2): target.device_map values that cannot be honoured, and
a prepare across processes whose ranks do not share one folder.

`cases(h)` returns rows in scripts/reliability_sweep.py's case format (area, name, argv, rc, expect, risk from
reliability_doc.RISKS, optional setup / check / run / during); `h` is the sweep's HELPERS namespace.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _apart(ctx, argv: list[str]):
    """`specheads prepare` under torchrun, 2 processes on gloo, rank 1 given another output_dir (another node's
    local disk). Returns (exit code, "", the ranks' own error lines): torchrun's report of the failed ranks (its
    ChildFailedError traceback) is the launcher's, left out; a specheads frame in it counts as a traceback."""
    wrapper = Path(ctx.vars["tmp"]) / "apart.py"
    wrapper.write_text("import os, sys\n"
                       f"argv = {argv!r}\n"
                       f"if os.environ['RANK'] == '1': argv.append('output_dir={ctx.vars['tmp']}/elsewhere')\n"
                       "from specheads import cli\nraise SystemExit(cli.main(argv))\n")
    torchrun = str(Path(sys.executable).parent / "torchrun")
    p = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", str(wrapper)], capture_output=True,
                       text=True, cwd=ROOT, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT),
                                                              "OMP_NUM_THREADS": "1"})
    text = p.stdout + p.stderr
    frames = [ln for ln in text.splitlines() if ln.strip().startswith("File ") and "/specheads/" in ln]
    errors = [ln for ln in text.splitlines() if "specheads prepare: error: " in ln]
    err = ("TRACEBACK " + frames[-1]) if frames else (errors[-1] if errors else text[-500:])
    return (2 if p.returncode != 0 else 0), "", err


def _nothing_of_run(ctx) -> str:
    assert not (Path(ctx.vars["run"]) / "features").exists(), "features were written before the refusal"
    assert not (Path(ctx.vars["run"]) / "data").exists(), "tokens were written before the refusal"
    return "nothing written"


def cases(h) -> list[dict]:
    return [
        {"area": "dist", "risk": "unclear", "name": "target.device_map not a device",
         "argv": h.PREPARE + ["target.device_map=gpu"], "rc": 2, "expect": "target.device_map: 'gpu' is not one of",
         "check": h.nothing_written},
        {"area": "dist", "risk": "unclear", "name": "target.device_map module on disk",
         "argv": h.PREPARE + ["target.device_map={{model: cpu, lm_head: disk}}"], "rc": 2,
         "expect": "target.device_map.lm_head: 'disk' is not a device", "check": h.nothing_written},
        {"area": "dist", "risk": "traceback", "name": "target.device_map cuda on a machine without CUDA",
         "argv": h.PREPARE + ["target.device_map=cuda"], "rc": 2, "expect": "no CUDA device is visible",
         "check": _nothing_of_run},
        {"area": "dist", "risk": "data loss", "name": "prepare ranks that do not share the output folder",
         "argv": h.PREPARE, "rc": 2, "expect": "does not see", "run": _apart, "check": _nothing_of_run},
    ]

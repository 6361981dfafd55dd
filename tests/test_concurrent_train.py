"""Two `specheads train` processes on one run folder: one trains, the other gets one line naming the holder, and
the folder ends as one uninterrupted run leaves it (the final head's weights equal bit for bit)."""
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# Imports first (the whole train command: the first process holds its lock for about a second of training),
# then (second process only) waits for the first one's lock before running the command.
RUNNER = """
import sys, time, pathlib
from specheads import cli
import specheads.commands.train, specheads.train.trainer  # what `train` imports, before the lock is looked at
lock = pathlib.Path(sys.argv[1])
if sys.argv[2] == "wait":
    (lock.parent / "ready").touch()  # imported: the test starts the first process now
    t = time.time()
    while not lock.exists() and time.time() - t < 120:
        time.sleep(0.01)
sys.exit(cli.main(sys.argv[3:]))
"""


def _sweep():
    spec = importlib.util.spec_from_file_location("reliability_sweep", ROOT / "scripts" / "reliability_sweep.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _env() -> dict:
    """One intra-op thread: a 2-thread reduction may split its work differently on a loaded machine (OpenMP's
    dynamic teams), and the test compares bytes."""
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@pytest.mark.slow
def test_two_concurrent_trains_one_runs_one_line_for_the_other(tmp_path):
    import shutil

    sweep = _sweep()
    sweep.build_fixtures(tmp_path)  # target/, recipe.yaml, prepared/ (data and features, no training yet)
    recipe = str(tmp_path / "recipe.yaml")
    for name in ("ref", "run"):
        shutil.copytree(tmp_path / "prepared", tmp_path / name)
    steps = "train.max_steps=12"
    ref = subprocess.run([sys.executable, "-c", RUNNER, "-", "go", "train", "--config", recipe,
                          f"output_dir={tmp_path / 'ref'}", steps], cwd=ROOT, capture_output=True, text=True,
                         env=_env())
    assert ref.returncode == 0, ref.stderr[-2000:]  # the uninterrupted run, alone, in a process of its own
    run = tmp_path / "run"
    argv = ["train", "--config", recipe, f"output_dir={run}", steps]
    lock = run / ".specheads.lock"
    second = subprocess.Popen([sys.executable, "-c", RUNNER, str(lock), "wait", *argv], cwd=ROOT, env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t = time.time()
    while not (run / "ready").exists() and time.time() - t < 300:  # its imports done, it waits for the lock
        time.sleep(0.05)
    (run / "ready").unlink()
    first = subprocess.Popen([sys.executable, "-c", RUNNER, str(lock), "go", *argv], cwd=ROOT, env=_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out2, err2 = second.communicate(timeout=600)
    out1, err1 = first.communicate(timeout=600)
    assert first.returncode == 0, err1[-2000:]
    assert second.returncode == 2, err2[-2000:]
    lines = [ln for ln in err2.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "in use by pid" in lines[0] and "specheads train" in lines[0], err2
    assert "Traceback" not in err2
    from safetensors.torch import load_file

    # the weights, bit for bit (the file's metadata may differ: it is not compared)
    a, b = load_file(run / "final" / "model.safetensors"), load_file(tmp_path / "ref" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not lock.exists()  # released

"""SIGTERM and SIGINT in `specheads prepare`, `train`, `export`, `eval` and `bench` (issue 49): each command, a real
process on the reliability sweep's tiny target, gets the signal mid-work and ends with exit 128 + signal, one last
stderr line `specheads <cmd>: interrupted (<SIG>)[: what was kept]`, no traceback, no run lock, nothing
half-written (no temporary left, every file a later run reads whole); a rerun (prepare again, train --resume,
export again) completes. The work point is found by polling the file system or the process's log; prepare and
export are held there by a disk whose fsync of the named temporary never returns (scripts/reliability_kill.py's
sitecustomize), so the signal lands mid-write. The signal reaches a process whose SIGINT is Python's default
handler even when this suite runs as a background job (which starts with SIGINT ignored, inherited by children)."""
from __future__ import annotations

import json
import re
import signal
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))

import reliability_kill as kill9  # noqa: E402
import reliability_r4_signals as sigs  # noqa: E402
import reliability_sweep  # noqa: E402

pytestmark = pytest.mark.slow  # ten CLI processes, each importing torch (a minute or more on 2 busy cores)
SIGNALS = ["SIGTERM", "SIGINT"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The sweep's fixtures: target/, recipe.yaml, convs.json, prepared/ (prepare's output), trained/ (a head)."""
    base = tmp_path_factory.mktemp("signals")
    reliability_sweep.build_fixtures(base)
    return base


def _clean_end(o: sigs.Signalled, command: str, signame: str) -> None:
    assert o.problem == "", o.problem
    assert o.rc == 128 + getattr(signal, signame), (o.rc, o.err[-2000:])
    assert "Traceback" not in o.err, o.err[-3000:]
    assert sigs.interrupted_lines(o.err) == [o.last], o.err[-2000:]  # one such line, and it is the last
    assert re.fullmatch(rf"specheads {command}: interrupted \({signame}\)(: .+)?", o.last), o.last
    assert sigs.locks(o.work) == [], "the run lock was left"


@pytest.mark.parametrize("signame", SIGNALS)
def test_prepare_signalled_mid_shard_leaves_nothing_half_written_and_reruns(base, tmp_path, signame):
    o = sigs.signal_prepare(base, tmp_path, getattr(signal, signame))
    _clean_end(o, "prepare", signame)
    run = tmp_path / "run"
    assert kill9.temporaries(run) == [] and kill9.readable_state(run) == []
    assert (run / "features" / "shard-00000.safetensors").exists()  # the shard before it is kept
    rc, _, err = kill9.run_cli(kill9.prepare_argv(base, run), tmp_path)
    assert rc == 0 and "Traceback" not in err, err[-2000:]
    assert "1 done" in err  # resumed: the kept shard is not written again
    assert kill9.temporaries(run) == [] and kill9.readable_state(run) == []
    assert json.loads((run / "features" / "manifest.json").read_text())["shards"]


@pytest.mark.parametrize("signame", SIGNALS)
def test_train_signalled_mid_run_saves_that_step_and_resumes(base, tmp_path, signame):
    o = sigs.signal_train(base, tmp_path, getattr(signal, signame))
    _clean_end(o, "train", signame)
    m = re.search(r"stopped after step (\d+); checkpoint (\S+) saved: continue with `specheads train --config \S+ "
                  r"--resume`$", o.last)
    assert m and Path(m.group(2)).is_dir(), o.last
    run = tmp_path / "run"
    assert kill9.temporaries(run) == [] and kill9.readable_state(run) == []
    rc, _, err = kill9.run_cli(sigs.train_argv(base, run, resume=True), tmp_path)
    assert rc == 0 and "Traceback" not in err, err[-2000:]
    assert (run / "final" / "model.safetensors").exists() and kill9.temporaries(run) == []
    assert json.loads((run / "train_summary.json").read_text())["steps"] == sigs.TRAIN_STEPS


@pytest.mark.parametrize("signame", SIGNALS)
def test_export_signalled_mid_write_leaves_no_out_and_reruns(base, tmp_path, signame):
    o = sigs.signal_export(base, tmp_path, getattr(signal, signame))
    _clean_end(o, "export", signame)
    out = tmp_path / "out"
    assert not out.exists() and kill9.temporaries(out) == []  # no --out, no temporary folder beside it
    rc, _, err = kill9.run_cli(kill9.export_argv(base, out), tmp_path)
    assert rc == 0 and (out / "config.json").exists() and kill9.temporaries(out) == [], err[-2000:]


@pytest.mark.parametrize("signame", SIGNALS)
def test_eval_signalled_while_the_target_answers_ends_in_one_line(base, tmp_path, signame):
    o = sigs.signal_eval(base, tmp_path, getattr(signal, signame))
    _clean_end(o, "eval", signame)
    assert o.out.strip() == ""  # no table of half the prompts


@pytest.mark.parametrize("signame", SIGNALS)
def test_bench_signalled_after_a_prompt_keeps_it_and_exits_128_plus_the_signal(base, tmp_path, signame):
    """bench kept the finished prompts but exited 130 on SIGTERM, with no line saying so."""
    o = sigs.signal_bench(base, tmp_path, getattr(signal, signame))
    _clean_end(o, "bench", signame)
    out = tmp_path / "out"
    assert o.last.endswith(f"the finished prompts are kept in {out / 'results.json'} (complete: false)"), o.last
    res = json.loads((out / "results.json").read_text())
    assert res["complete"] is False and res["interrupted"] is True and res["interrupted_by"] == signame
    assert res["num_prompts"] >= 1 and kill9.temporaries(out) == []


def test_interrupted_lines_reads_a_line_after_a_progress_bar():
    err = "bench:  25%|##  | 1/4\rspecheads bench: interrupted (SIGTERM): kept\n"
    assert sigs.interrupted_lines(err) == ["specheads bench: interrupted (SIGTERM): kept"]
    assert sigs.interrupted_lines("x\nspecheads eval: error: no\n") == []

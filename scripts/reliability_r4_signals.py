"""Reliability sweep, round four (issue 49): SIGTERM / SIGINT in prepare, train, export, eval, bench; batched regeneration killed and resumed.

`cases(h)` returns rows in scripts/reliability_sweep.py's case format (area, name, argv, rc, expect, risk from
reliability_doc.RISKS, optional setup / check / run / during); `h` is the sweep's HELPERS namespace.

Each signal case is the real CLI, `python -m specheads ...`, in a process of its own (scripts/reliability_kill.py's
environment: one thread, and a disk whose fsync of a path holding the case's `slow` fragment never returns, so
that prepare and export are held in the middle of a write), signalled as soon as its work point is seen (a file,
or a line of its log), then waited for: it must end by itself with exit 128 + signal and one last line
`specheads <cmd>: interrupted (<SIG>)[: what was kept]`, leave no run lock and nothing half-written. The child's
SIGINT is Python's default handler even when the sweep runs as a background job (which starts with SIGINT
ignored, and children inherit that). tests/test_signals.py runs the same functions.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import reliability_kill as kill9

TRAIN_STEPS = 40  # checkpoints every 3 steps; the signal lands after the first, long before the end


@dataclass
class Signalled:
    """How a signalled process ended: its exit code, output, last stderr line, and `problem` ("" when it was
    signalled at its point and ended by itself)."""
    work: Path
    rc: int = -1
    out: str = ""
    err: str = ""
    problem: str = ""
    last: str = field(init=False, default="")

    def __post_init__(self):
        self.finish()

    def finish(self) -> None:
        lines = [ln for ln in self.err.strip().splitlines() if ln.strip()]  # \r (a progress bar) ends a line too
        self.last = lines[-1].strip() if lines else ""


def interrupted_lines(err: str) -> list[str]:
    """The lines of `err` that are the CLI's interrupted line."""
    return [ln.strip() for ln in err.splitlines() if re.match(r"\s*specheads \w+: interrupted \(SIG\w+\)", ln)]


def locks(work: Path) -> list[str]:
    """Run locks left anywhere under `work` (inside a run folder, or beside an export's --out)."""
    return sorted(str(p.relative_to(work)) for p in work.rglob("*.specheads.lock"))


def _default_sigint() -> None:  # in the child, before exec: Python then installs its KeyboardInterrupt handler
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def signal_at(argv: list[str], work: Path, signum: int, ready: Callable[[str], bool], slow: str | None = None,
              timeout: float = kill9.TIMEOUT) -> Signalled:
    """Start `python -m specheads ARGV` in `work`, send `signum` once `ready(its stderr so far)` holds, wait for it
    to end by itself (SIGKILL after `timeout` s)."""
    work.mkdir(parents=True, exist_ok=True)
    n = len(list(work.glob("signalled-*.err")))
    err_path, out_path = work / f"signalled-{n}.err", work / f"signalled-{n}.out"
    with open(err_path, "w") as err, open(out_path, "w") as out:
        p = subprocess.Popen([sys.executable, "-m", "specheads", *argv], cwd=kill9.ROOT, env=kill9._env(work, slow),
                             stdin=subprocess.DEVNULL, stdout=out, stderr=err, preexec_fn=_default_sigint)
    o = Signalled(work)
    t = time.monotonic()
    try:
        while not ready(err_path.read_text(errors="replace")):
            if p.poll() is not None:
                o.problem = f"ended (exit {p.returncode}) before its work point"
                break
            if time.monotonic() - t > timeout:
                o.problem = "its work point was not reached in time"
                break
            time.sleep(0.002)
        if not o.problem:
            os.kill(p.pid, signum)
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                o.problem = f"{signal.Signals(signum).name} did not end it"
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait()
    o.rc, o.out, o.err = p.returncode, out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    o.finish()
    return o


def _glob(folder: Path, pattern: str) -> Callable[[str], bool]:
    return lambda err: any(folder.glob(pattern))


def _seen_for(path: Path, seconds: float) -> Callable[[str], bool]:
    """True once `path` has been there for `seconds` (the process is then past the save that wrote it)."""
    seen: list[float] = []

    def ready(err: str) -> bool:
        if not path.exists():
            return False
        seen[:] = seen or [time.monotonic()]
        return time.monotonic() - seen[0] >= seconds
    return ready


# ------------------------------------------------------------------------------------------- the commands

def train_argv(base: Path, run: Path, resume: bool = False) -> list[str]:
    return ["train", "--config", str(base / "recipe.yaml"), f"output_dir={run}", f"train.max_steps={TRAIN_STEPS}",
            "train.save_every=3"] + ["--resume"] * resume


def eval_argv(base: Path) -> list[str]:
    return ["eval", "--head", str(base / "trained" / "final"), "--target", str(base / "target"), "--limit", "2",
            "--max-new-tokens", "200", "--dtype", "float32"]


def bench_argv(base: Path, out: Path) -> list[str]:
    return ["bench", "--target", str(base / "target"), "--methods", "plain", "--limit", "6", "--max-new-tokens",
            "48", "--warmup-tokens", "0", "--dtype", "float32", "--out", str(out)]


def signal_prepare(base: Path, work: Path, signum: int) -> Signalled:
    """prepare held in the fsync of its second feature shard's temporary file."""
    run = work / "run"
    return signal_at(kill9.prepare_argv(base, run), work, signum,
                     _glob(run / "features", ".shard-00001.safetensors.tmp-*"), "/.shard-00001.safetensors.tmp-")


def signal_train(base: Path, work: Path, signum: int) -> Signalled:
    """train on a copy of prepared/, signalled once its first checkpoint (step 3) is saved."""
    import shutil

    run = work / "run"
    shutil.copytree(base / "prepared", run)
    return signal_at(train_argv(base, run), work, signum, _seen_for(run / "checkpoints" / "step-000003", 0.01))


def signal_export(base: Path, work: Path, signum: int) -> Signalled:
    """export held in the fsync of a file of its temporary folder."""
    return signal_at(kill9.export_argv(base, work / "out"), work, signum, _glob(work, ".out.tmp-*/.config.json.tmp*"),
                     "/.out.tmp-")


def signal_eval(base: Path, work: Path, signum: int) -> Signalled:
    """eval signalled while the target writes its answers (its progress bar is up)."""
    return signal_at(eval_argv(base), work, signum, lambda err: "target answers:" in err)


def signal_bench(base: Path, work: Path, signum: int) -> Signalled:
    """bench signalled once its first prompt is in results.json."""
    return signal_at(bench_argv(base, work / "out"), work, signum,
                     lambda err: (work / "out" / "results.json").exists())


# ------------------------------------------------------------------------------- regeneration, batched
REGEN = ["data.regenerate=true", "data.regen_max_new_tokens=6"]  # the sweep's 12 conversations, answered by the target


def regen_argv(base: Path, run: Path, batch_size: int) -> list[str]:
    return kill9.prepare_argv(base, run) + REGEN + [f"data.regen_batch_size={batch_size}"]


def signal_regen(base: Path, work: Path, signum: int, batch_size: int) -> Signalled:
    """prepare regenerating the answers, held in the first fsync of data/regenerated.jsonl (batch_size
    conversations written, or all of them when batch_size is larger: then after the last, before the file is put
    in the source's order)."""
    out = work / "run" / "data" / "regenerated.jsonl"
    return signal_at(regen_argv(base, work / "run", batch_size), work, signum,
                     lambda err: out.is_file() and out.stat().st_size > 0, "/data/regenerated.jsonl")


def regen_resumed_as_one_run(base: Path, work: Path, batch_size: int) -> str:
    """The rerun after the signal, compared with an uninterrupted prepare (its own process): "" or what differs."""
    rc, _, err = kill9.run_cli(regen_argv(base, work / "run", batch_size), work)
    ref = work / "ref"
    rc_ref, _, err_ref = kill9.run_cli(regen_argv(base, ref, batch_size), work)
    if rc or rc_ref:
        return f"the rerun's exit {rc}, the uninterrupted run's {rc_ref}: {(err or err_ref)[-300:]}"
    same = (ref / "data" / "regenerated.jsonl").read_bytes() == (work / "run" / "data" / "regenerated.jsonl").read_bytes()
    differs = [k for k in kill9.differences(ref / "data", work / "run" / "data")]
    return "; ".join(filter(None, ["regenerated.jsonl differs" * (not same), f"data/ differs: {differs}" * bool(differs),
                                   f"left: {kill9.temporaries(work / 'run')}" * bool(kill9.temporaries(work / "run"))]))


# ------------------------------------------------------------------------------------------- the cases

def _problems(o: Signalled) -> list[str]:
    """What every signalled command must leave: one interrupted line (the last), no lock, nothing half-written."""
    run = o.work / "run"
    return [f"{len(interrupted_lines(o.err))} interrupted lines" * (interrupted_lines(o.err) != [o.last]),
            f"locks left: {locks(o.work)}" * bool(locks(o.work)),
            f"temporaries left: {kill9.temporaries(run)}" * bool(run.is_dir() and kill9.temporaries(run)),
            f"half-written: {kill9.readable_state(run)}" * bool(run.is_dir() and kill9.readable_state(run)),
            f"export temporaries: {sorted(p.name for p in o.work.glob('.out.*'))}" * bool(list(o.work.glob(".out.*")))]


def _rerun(command: str, base: Path, work: Path) -> str:
    """The command again (train: --resume) to its end: "" or what went wrong."""
    argv = {"prepare": lambda: kill9.prepare_argv(base, work / "run"),
            "train": lambda: train_argv(base, work / "run", resume=True),
            "export": lambda: kill9.export_argv(base, work / "out")}.get(command)
    if argv is None:
        return ""
    rc, _, err = kill9.run_cli(argv(), work)
    return f"the rerun's exit {rc}: {err.strip().splitlines()[-1:]}" if rc or "Traceback" in err else ""


def _signal_case(command: str, signame: str, fn: Callable, risk: str, argv: list[str]) -> dict:
    signum = getattr(signal, signame)

    def run(ctx, _argv):
        ctx.signalled = o = fn(ctx.base, ctx.tmp, signum)
        if o.problem:
            return -1, o.out, f"{o.err}\nnot signalled at its work point: {o.problem}"
        return o.rc, o.out, o.err

    def check(ctx) -> str:
        o = ctx.signalled
        problems = [*_problems(o), _rerun(command, ctx.base, ctx.tmp)]
        assert not any(problems), "; ".join(filter(None, problems))
        again = {"prepare": "prepare again completed", "train": "train --resume completed",
                 "export": "export again completed"}.get(command, "nothing to keep")
        return f"exit {o.rc}; one line; no lock; nothing half-written; {again}"

    return {"area": "signals", "name": f"{signame} during {command}", "argv": argv, "rc": 128 + signum,
            "expect": f"specheads {command}: interrupted ({signame})", "risk": risk, "run": run, "check": check}


def _regen_case(batch_size: int) -> dict:
    def run(ctx, _argv):
        ctx.signalled = o = signal_regen(ctx.base, ctx.tmp, signal.SIGTERM, batch_size)
        if o.problem:
            return -1, o.out, f"{o.err}\nnot signalled at its work point: {o.problem}"
        return o.rc, o.out, o.err

    def check(ctx) -> str:
        problems = [*_problems(ctx.signalled), regen_resumed_as_one_run(ctx.base, ctx.tmp, batch_size)]
        assert not any(problems), "; ".join(filter(None, problems))
        return "the rerun's regenerated.jsonl and data/ equal an uninterrupted run's byte for byte"

    return {"area": "signals", "name": f"batched regeneration (regen_batch_size {batch_size}) stopped by SIGTERM, "
                                       "rerun", "rc": 143,
            "argv": ["prepare", "--no-progress", "--config", "{recipe}", "output_dir={run}", *REGEN,
                     f"data.regen_batch_size={batch_size}"],
            "expect": "specheads prepare: interrupted (SIGTERM)", "risk": "silent wrong result", "run": run,
            "check": check}


def cases(h) -> list[dict]:
    argvs = {"prepare": ["prepare", "--no-progress", "--config", "{recipe}", "output_dir={run}"],
             "train": ["train", "--config", "{recipe}", "output_dir={run}", f"train.max_steps={TRAIN_STEPS}",
                       "train.save_every=3"],
             "export": ["export", "--head", "{base}/trained/final", "--format", "eagle3", "--out", "{tmp}/out"],
             "eval": ["eval", "--head", "{base}/trained/final", "--target", "{target}", "--limit", "2",
                      "--max-new-tokens", "200", "--dtype", "float32"],
             "bench": ["bench", "--target", "{target}", "--methods", "plain", "--limit", "6", "--max-new-tokens",
                       "48", "--warmup-tokens", "0", "--dtype", "float32", "--out", "{tmp}/out"]}
    fns = {"prepare": signal_prepare, "train": signal_train, "export": signal_export, "eval": signal_eval,
           "bench": signal_bench}
    risks = {"prepare": "data loss", "train": "data loss", "export": "data loss", "eval": "unclear",
             "bench": "unclear"}
    rows = [_signal_case(c, s, fns[c], risks[c], argvs[c]) for c in fns for s in ("SIGTERM", "SIGINT")]
    # regen_batch_size 3 (stopped after 3 conversations) and 13, more rows than the 12 conversations (stopped
    # after all were written, before the file was put in the source's order)
    return rows + [_regen_case(b) for b in (3, 13)]

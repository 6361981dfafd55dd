"""Real kill -9 during prepare, train (mid-step, mid-save) and export, then a rerun or `train --resume`: the outputs
equal an uninterrupted run's, nothing half-written is left where a later run reads, and the rerun prints no
traceback. tests/test_kill9.py runs every kill point; the reliability sweep records them (area `kill`).

Every run is the real CLI, `python -m specheads ...`, in a process of its own on one thread (OMP_NUM_THREADS=1: the
comparison is bit for bit), on the sweep's fixtures (`base`: target/, recipe.yaml, prepared/, trained/). The kill
point is found by polling the file system (a temporary shard, a `.step-NNNNNN.tmp` folder, an export's temporary
folder); SIGKILL follows at once. So that the poll cannot miss a write that lasts microseconds, the killed process
runs on a slow disk: its fsync of a file whose path holds the case's `slow` fragment never returns
(sitecustomize.py, written beside the work folder; nothing in specheads is patched). The uninterrupted runs are one
process, `references(base)`, run once per base. Outputs are compared by `digest`: safetensors files tensor by
tensor (names, dtypes, shapes and bytes; the header's metadata may differ), other files byte for byte, less the
fields that record when and how long (timings) and what only a resumed run writes (its resume history).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
SLOW_ENV = "SPECHEADS_KILL9_SLOW_FSYNC"
# The killed process's slow disk: an fsync of a file whose path holds $SPECHEADS_KILL9_SLOW_FSYNC never returns.
SITECUSTOMIZE = f'''import os, time
_slow = os.environ.get("{SLOW_ENV}")
if _slow:
    _fsync = os.fsync

    def _never_returns(fd):
        try:
            path = os.readlink(f"/proc/self/fd/{{fd}}")
        except OSError:
            path = ""
        while _slow in path:
            time.sleep(1)
        return _fsync(fd)

    os.fsync = _never_returns
'''
TIMEOUT = 600  # seconds any one run may take
STEPS = ["train.max_steps=9", "train.save_every=3"]  # checkpoints at steps 3, 6 and 9
# What two uninterrupted runs write differently: when and how long (train_summary's eval_seconds too: a resumed
# run counts its own evaluations only, 0.0 s or more on a busy machine), and how much this process did (a resumed
# run trains fewer steps itself, a rerun regenerates fewer answers); datasets' fingerprint of the tokens (random per
# process); files' sha256, which covers a safetensors header whose metadata order varies from process to process
# (the tensors themselves are compared).
VOLATILE_KEYS = {"timings", "seconds", "time", "train_seconds", "eval_seconds", "tokens_this_run", "tokens_per_s",
                 "_fingerprint", "sha256", "shard_sha256", "regenerated_new_tokens", "regenerate_tokens_per_s"}
RESUME_ONLY = {"train_config_history.yaml"}  # the resumed segments, written by a resumed run only


# prepare with the target writing the answers (data/regenerated.jsonl, fsynced every 2 conversations)
REGEN = ["data.regenerate=true", "data.regen_batch_size=2", "data.regen_max_new_tokens=6"]


def prepare_argv(base: Path, run: Path, regen: bool = False) -> list[str]:
    return ["prepare", "--no-progress", "--config", str(base / "recipe.yaml"), f"output_dir={run}"] + REGEN * regen


def train_argv(base: Path, run: Path, resume: bool = False) -> list[str]:
    return ["train", "--config", str(base / "recipe.yaml"), f"output_dir={run}", *STEPS] + (["--resume"] * resume)


def export_argv(base: Path, out: Path) -> list[str]:
    return ["export", "--head", str(base / "trained" / "final"), "--format", "eagle3", "--out", str(out)]


# ------------------------------------------------------------------------------------------------ processes

def _env(work: Path, slow: str | None) -> dict:
    shim = work / "slow-disk"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(shim)])}
    env.pop(SLOW_ENV, None)
    if slow:
        env[SLOW_ENV] = slow
    return env


def run_cli(argv: list[str], work: Path) -> tuple[int, str, str]:
    """`python -m specheads ARGV` to its end: (exit code, stdout, stderr)."""
    p = subprocess.run([sys.executable, "-m", "specheads", *argv], cwd=ROOT, env=_env(work, None),
                       capture_output=True, text=True, timeout=TIMEOUT)
    return p.returncode, p.stdout, p.stderr


def kill_at(argv: list[str], work: Path, slow: str | None, point: Callable[[], bool],
            signum: int = signal.SIGKILL) -> str:
    """Start `python -m specheads ARGV` (its fsyncs of `slow` paths never return), send it `signum` (SIGKILL) as
    soon as `point()` holds, reap it. Another signal than SIGKILL is waited for: the process must end by itself,
    with exit 128 + signum. Returns "" or what went wrong (it ended or timed out first, or another exit)."""
    log = work / f"killed-{argv[0]}-{len(list(work.glob('killed-*.log')))}.log"  # one per kill of a chain
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, "-m", "specheads", *argv], cwd=ROOT, env=_env(work, slow),
                             stdout=f, stderr=subprocess.STDOUT)
    t = time.monotonic()
    try:
        while not point():
            if p.poll() is not None:
                return f"ended (exit {p.returncode}) before the kill point: {log.read_text()[-2000:]}"
            if time.monotonic() - t > TIMEOUT:
                return "the kill point was not reached in time"
            time.sleep(0.002)
        if signum != signal.SIGKILL:
            os.kill(p.pid, signum)
            try:
                rc = p.wait(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                return f"{signal.Signals(signum).name} did not end it"
            return "" if rc == 128 + signum else f"exit {rc} after {signal.Signals(signum).name}, not {128 + signum}"
        return ""
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait()  # reaped: a zombie's pid would still look alive to the next run's lock check


# ------------------------------------------------------------------------------------------------ comparing

def safetensors_digest(path: Path) -> str:
    """sha256 of the tensors (names, dtypes, shapes, bytes), the header's __metadata__ left out."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    h = hashlib.sha256()
    for name in sorted(header):
        a, b = header[name]["data_offsets"]
        h.update(json.dumps([name, header[name]["dtype"], header[name]["shape"]]).encode())
        h.update(data[8 + n + a:8 + n + b])
    return h.hexdigest()


def _without(obj, keys: set[str]):
    if isinstance(obj, dict):
        return {k: _without(v, keys) for k, v in obj.items() if k not in keys}
    if isinstance(obj, list):
        return [_without(v, keys) for v in obj]
    return obj


def file_digest(path: Path, root: Path) -> str:
    """The digest `digest` compares; the run folder's own path (`root`) reads as <run>."""
    if path.suffix == ".safetensors":
        return "tensors " + safetensors_digest(path)
    if path.suffix == ".sha256":  # sha256 of files' raw bytes, safetensors metadata included: the names only
        return "lists " + " ".join(sorted(ln.split("  ", 1)[-1] for ln in path.read_text().splitlines()))
    data = path.read_bytes().replace(str(root).encode(), b"<run>")
    if path.suffix == ".json":
        with_paths = json.dumps(_without(json.loads(data), VOLATILE_KEYS), sort_keys=True)
        return hashlib.sha256(with_paths.encode()).hexdigest()
    return hashlib.sha256(data).hexdigest()


def digest(folder: Path) -> dict[str, str]:
    """{relative path: digest} of every file under `folder` (the run lock and the resume history left out)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and not p.name.endswith(".specheads.lock") and rel not in RESUME_ONLY:
            out[rel] = file_digest(p, folder)
    return out


def differences(ref: Path, got: Path) -> list[str]:
    """The files whose digest differs between the two folders, or that only one of them holds."""
    a, b = digest(ref), digest(got)
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def temporaries(folder: Path) -> list[str]:
    """Temporary and stale files or folders under `folder` (and an export's siblings beside it)."""
    names = (".tmp", ".old-", ".stale-", ".specheads.lock")
    found = [p for p in folder.rglob("*") if any(s in p.name for s in names)] if folder.is_dir() else []
    found += [p for p in folder.parent.glob(f".{folder.name}.*")]
    return sorted(str(p.relative_to(folder.parent)) for p in found)


def _checksum_problems(ck: Path) -> list[str]:
    listing = ck / "checksums.sha256"
    if not listing.exists():
        return [f"{ck.name}: no checksums.sha256"]
    bad = []
    for line in listing.read_text().splitlines():
        want, rel = line.split("  ", 1)
        p = ck / rel
        if not p.exists() or hashlib.sha256(p.read_bytes()).hexdigest() != want:
            bad.append(f"{ck.name}/{rel}")
    return bad


def _safetensors_whole(path: Path) -> bool:
    data = path.read_bytes()
    try:
        n = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8:8 + n])
        end = max([t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"], default=0)
    except (struct.error, ValueError, KeyError, TypeError):
        return False
    return len(data) == 8 + n + end


def _listed(folder: Path, entries: list[dict]) -> list[str]:
    bad = []
    for e in entries:
        p = folder / e["file"]
        if not p.exists() or hashlib.sha256(p.read_bytes()).hexdigest() != e["sha256"]:
            bad.append(f"{folder.name}/{e['file']}")
    return bad


def readable_state(run: Path) -> list[str]:
    """What a later run reads must be whole. Files under dot-named (temporary) folders and dot-named files are never
    read; of the others, each features/ shard and target sidecar the manifest lists has its recorded sha256, each
    checkpoint (step-NNNNNN) matches its checksums.sha256, each JSON file parses, each safetensors file is whole."""
    bad = []
    manifest = run / "features" / "manifest.json"
    if manifest.exists():
        shards = json.loads(manifest.read_text())["shards"]
        bad += _listed(run / "features", shards + [s["targets"] for s in shards if s.get("targets")])
    for ck in sorted((run / "checkpoints").glob("step-*")) if (run / "checkpoints").is_dir() else []:
        bad += _checksum_problems(ck)
    for p in sorted(run.rglob("*")):
        rel = p.relative_to(run)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue
        if p.suffix == ".json":
            try:
                json.loads(p.read_text())
            except ValueError:
                bad.append(str(rel))
        elif p.suffix == ".safetensors" and not _safetensors_whole(p):
            bad.append(str(rel))
    return bad


# ------------------------------------------------------------------------------------------------ the cases

def references(base: Path) -> Path:
    """The uninterrupted runs, once per base, in one process: ref/prepare (prepare from nothing), ref/regen (prepare
    with the target writing the answers), ref/train (train on a copy of prepared/), ref/export (export of
    trained/final)."""
    ref = base / "kill9-ref"
    if (ref / "done").exists():
        return ref
    shutil.rmtree(ref, ignore_errors=True)
    ref.mkdir()
    shutil.copytree(base / "prepared", ref / "train")
    script = ("import sys, json\nfrom specheads import cli\n"
              "for argv in json.loads(sys.argv[1]):\n    assert cli.main(argv) == 0, argv\n")
    runs = [prepare_argv(base, ref / "prepare"), prepare_argv(base, ref / "regen", regen=True),
            train_argv(base, ref / "train"), export_argv(base, ref / "export")]
    p = subprocess.run([sys.executable, "-c", script, json.dumps(runs)], cwd=ROOT, env=_env(ref, None),
                       capture_output=True, text=True, timeout=3 * TIMEOUT)
    if p.returncode != 0:
        raise RuntimeError(f"the uninterrupted runs failed ({p.returncode}):\n{p.stderr[-3000:]}")
    shutil.rmtree(ref / "slow-disk")
    (ref / "done").touch()
    return ref


@dataclass
class Kill:
    """One kill point: the command, what the killed process's disk never finishes (`slow`: a path fragment), the
    file-system state at which SIGKILL is sent (`point(work)`), and what the kill must have left (`left(work)`: ""
    or the problem)."""
    name: str
    command: str  # prepare, regen (prepare regenerating the answers), train or export
    slow: str
    point: Callable[[Path], bool]
    left: Callable[[Path], str] = lambda work: ""
    signum: int = signal.SIGKILL  # SIGTERM: the process is asked to stop, and must end cleanly by itself


@dataclass
class Outcome:
    """What a chain of kills and the rerun after them gave; `ok` when all is as an uninterrupted run leaves it."""
    kills: list[str] = field(default_factory=list)  # per kill: "" or what was wrong at it
    rc: int = -1
    out: str = ""
    err: str = ""
    differs: list[str] = field(default_factory=list)  # outputs that differ from the uninterrupted run's
    temporaries: list[str] = field(default_factory=list)  # left after the rerun
    damaged: list[str] = field(default_factory=list)  # after the rerun: files that do not match their record

    @property
    def ok(self) -> bool:
        return (not any(self.kills) and self.rc == 0 and not self.differs and not self.temporaries
                and not self.damaged and "Traceback" not in self.err)

    def note(self) -> str:
        if self.ok:
            return "killed there; the rerun's outputs equal the uninterrupted run's; no temporary or lock left"
        parts = [*self.kills, f"the rerun's exit {self.rc}" * (self.rc != 0),
                 "a traceback" * ("Traceback" in self.err), f"differ: {self.differs}" * bool(self.differs),
                 f"left: {self.temporaries}" * bool(self.temporaries),
                 f"damaged: {self.damaged}" * bool(self.damaged)]
        return "; ".join(filter(None, parts))


def target_of(command: str, work: Path) -> Path:
    """The folder the command writes: the run folder, or the export's --out."""
    return work / ("out" if command == "export" else "run")


def argvs(command: str, base: Path, target: Path) -> tuple[list[str], list[str]]:
    """The command's first run and its rerun after a kill (train: --resume)."""
    return {"prepare": (prepare_argv(base, target), prepare_argv(base, target)),
            "regen": (prepare_argv(base, target, regen=True), prepare_argv(base, target, regen=True)),
            "train": (train_argv(base, target), train_argv(base, target, resume=True)),
            "export": (export_argv(base, target), export_argv(base, target))}[command]


def _kill_once(k: Kill, argv: list[str], work: Path, target: Path) -> str:
    if k.point(work):
        return f"{k.name}: the kill point held before the run started"
    problem = kill_at(argv, work, k.slow, lambda: k.point(work), k.signum)
    if problem:
        return f"{k.name}: not killed there: {problem[:300]}"
    bad = readable_state(target) if target.is_dir() else []
    problems = [k.left(work), f"half-written where a later run reads: {bad}" * bool(bad)]
    return "; ".join(f"{k.name}: {p}" for p in problems if p)


def run_kills(kills: list[Kill], base: Path, work: Path, earlier: bool = False) -> Outcome:
    """Run the command of `kills` in `work`, killed at each point in turn (every run after the first is the rerun:
    train --resume), then once more to its end; compare with the uninterrupted run. `earlier`: --out holds an
    earlier export of the same head first (the uninterrupted run's)."""
    ref = references(base)
    command = kills[0].command
    target = target_of(command, work)
    work.mkdir(parents=True, exist_ok=True)
    if command == "train":
        shutil.copytree(base / "prepared", target)
    if earlier:
        for to in (target, work / "earlier"):  # --out, and the copy it is compared with after the kill
            shutil.copytree(ref / "export", to)
    first, again = argvs(command, base, target)
    o = Outcome()
    for i, k in enumerate(kills):
        o.kills.append(_kill_once(k, first if i == 0 else again, work, target))
    o.rc, o.out, o.err = run_cli(again, work)
    o.differs, o.temporaries = differences(ref / command, target), temporaries(target)
    o.damaged = readable_state(target) if target.is_dir() else [f"{target.name}: missing"]
    return o


def _seen_for(rel: str, seconds: float) -> Callable[[Path], bool]:
    """True once `rel` has been there for `seconds` (the process is then past the save that wrote it)."""
    seen: list[float] = []

    def point(work: Path) -> bool:
        if not (work / rel).exists():
            seen.clear()  # the check before each run starts the clock afresh
            return False
        seen[:] = seen or [time.monotonic()]
        return time.monotonic() - seen[0] >= seconds
    return point


def _glob(pattern: str) -> Callable[[Path], bool]:
    return lambda work: any(work.glob(pattern))


def _written(rel: str) -> Callable[[Path], bool]:
    """True once `rel` holds something (regeneration's first answers, flushed before the fsync that hangs)."""
    return lambda work: (work / rel).is_file() and (work / rel).stat().st_size > 0


def _exists(rel: str) -> Callable[[Path], str]:
    return lambda work: "" if (work / rel).exists() else f"{rel} was not there at the kill"


def _absent(rel: str) -> Callable[[Path], str]:
    return lambda work: f"{rel} was there at the kill" if (work / rel).exists() else ""


def _stopped_cleanly(work: Path) -> str:
    """After SIGTERM: its last line says where it stopped and the checkpoint it saved, and no lock is left."""
    log = sorted(work.glob("killed-train-*.log"))[-1].read_text().strip().splitlines()
    last = log[-1] if log else ""
    m = re.fullmatch(r"specheads train: interrupted \(SIGTERM\): stopped after step (\d+); checkpoint (\S+) saved: "
                     r"continue with `specheads train --config \S+ --resume`", last)
    problems = [f"its last line: {last[-300:]!r}" * (m is None),
                "the lock was left" * (work / "run" / ".specheads.lock").exists(),
                f"no {m.group(2)}" * bool(m and not Path(m.group(2)).is_dir())]
    return "; ".join(filter(None, problems))


def _earlier_export_kept(work: Path) -> str:
    return "the earlier export changed at the kill" if differences(work / "earlier", work / "out") else ""


SAVE6 = "run/checkpoints/.step-000006.tmp"
KILLS = {k.name: k for k in [
    Kill("prepare killed while writing feature shard 1", "prepare", "/.shard-00001.safetensors.tmp-",
         _glob("run/features/.shard-00001.safetensors.tmp-*"), _exists("run/features/shard-00000.safetensors")),
    Kill("prepare killed while writing its manifest", "prepare", "/features/.manifest.json.tmp-",
         _glob("run/features/.manifest.json.tmp-*")),
    Kill("prepare killed while writing the target sidecars", "prepare", "/.targets-00001.safetensors.tmp-",
         _glob("run/features/.targets-00001.safetensors.tmp-*")),
    Kill("prepare killed while the target writes the answers", "regen", "/data/regenerated.jsonl",
         _written("run/data/regenerated.jsonl"), _absent("run/data/tokens")),
    Kill("train killed mid-step (after checkpoint 3)", "train", "/.step-000006.tmp/",
         _seen_for("run/checkpoints/step-000003", 0.01), _absent(SAVE6)),
    Kill("train killed as its checkpoint folder appears", "train", "/.step-000006.tmp/",
         lambda w: (w / SAVE6).is_dir()),
    Kill("train killed mid-save, before the checksums", "train", "/.step-000006.tmp/.checksums.sha256.tmp",
         lambda w: (w / SAVE6 / "trainer_state.json").exists()),
    Kill("train killed while writing final/", "train", "/.final.tmp-", _glob("run/.final.tmp-*")),
    Kill("train stopped by SIGTERM mid-run (after checkpoint 3)", "train", "",
         _seen_for("run/checkpoints/step-000003", 0.01), _stopped_cleanly, signal.SIGTERM),
    Kill("export killed while writing", "export", "/.out.tmp-", _glob(".out.tmp-*/.config.json.tmp*"),
         _absent("out")),
    Kill("export killed while writing over an earlier export", "export", "/.out.tmp-",
         _glob(".out.tmp-*/.config.json.tmp*"), _earlier_export_kept),
    Kill("export killed while recording its source", "export", "/.export_info.json.tmp",
         _glob(".out.tmp-*/.export_info.json.tmp*"), _absent("out")),
]}
# Known defects a kill shows, by kill name: why (tests/test_kill9.py marks each xfail strict; the sweep marks its
# row open). None today.
OPEN: dict[str, str] = {}

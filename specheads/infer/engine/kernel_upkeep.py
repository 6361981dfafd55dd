"""The kernel cache's upkeep (kernel_cache.py builds and loads; this keeps its folder in order): the build lock,
the record of a failed build, and the pruning of old builds.

    <cache>/kernels/<name>-<key16>.lock          the fcntl lock of the process building (or pruning) that key
    <cache>/kernels/<name>-<key16>.failed.json   that key's build failed here: {reason, compiler, missing_tools, time}

A failed build (the compiler's first error line, a crash importing the result, no compiler or ninja) is recorded
atomically beside the key's folder; later runs with the same key skip the build with one info line naming the
record, while the compiler ($CXX) is the same and, where tools were missing, the same ones still are.
SPECHEADS_KERNELS_RETRY=1, deleting the record or a new key (other sources, torch, flags) builds again; a
successful build removes it. A compile past kernel_cache.COMPILE_TIMEOUT_S is recorded (it would take as long
again); a failure from outside (the compile's process killed, SIGTERM) is not, nor is one where the cache cannot be
written (the record is then a debug line: the next run tries again).

Pruning runs after a successful build into the cache, and only then: the other keys' folders of the same name
(and their .log and .failed.json) whose last use (the folder's mtime, which a load refreshes at most once per
TOUCH_S) is PRUNE_AGE_S or more before the new build are removed, each key under its lock, a key whose lock a
process holds skipped. The current key is never touched, nor any lock file (a few bytes; a process may be waiting
on one), nor a build a second torch or Python sharing the cache used in the last PRUNE_AGE_S. A removal that fails
is a debug line.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

from specheads.utils import SpecheadsError, atomic_write_json

log = logging.getLogger("specheads.infer.engine.kernel_cache")  # kernel_cache's: one logger for the cache's lines

RETRY_ENV = "SPECHEADS_KERNELS_RETRY"  # 1 / on / yes: build a key again although its build failed here before
PRUNE_AGE_S = 7 * 86400  # another key's build not loaded for this long before a new build is removed by it
TOUCH_S = 86400  # a load refreshes its build folder's mtime (its last use, for pruning) at most this often
POLL_S = 0.25  # seconds between two tries of a lock another process holds
RECORD_LAYOUT = 1  # of a .failed.json
MAX_RECORD_BYTES = 1 << 16  # a record is ~300 bytes; a larger file is not one of ours
_KEYED = re.compile(r"^(?P<name>.+)-(?P<key>[0-9a-f]{16})(?:\.log|\.failed\.json)?$")  # a key's folder, log, record


def first_line(e: BaseException | str) -> str:
    text = str(e).strip()
    return (text.splitlines()[0][:200] if text else type(e).__name__)


class Lock:
    """An fcntl lock on `path` (created if need be), held while this process builds. The OS releases it when the
    process ends however it ends, so a build killed midway never blocks the next run (torch's own lock file,
    a plain file, stayed behind and made the next run wait forever)."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def __enter__(self) -> "Lock":
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)  # releases the lock

    def try_take(self) -> bool:
        import fcntl  # POSIX only: imported where a build runs, so that importing this module works anywhere

        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def take(self, label: str, what: Path, wait_s: float) -> bool:
        """Hold the lock, after one line and a wait where another process holds it; False after wait_s."""
        if not self.try_take():
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "?"
            log.info("%s: another process (pid %s) is compiling %s; waiting for it", label, holder, what)
            deadline = time.monotonic() + wait_s
            while not self.try_take():
                if time.monotonic() > deadline:
                    return False
                time.sleep(POLL_S)
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)  # for the waiting line of the next process
        return True


# ----------------------------------------------------------------------------------------- failed builds

def record_path(final: Path) -> Path:
    """Where the failure of the build that belongs in `final` is recorded."""
    return final.with_name(f"{final.name}.failed.json")


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def record_failure(final: Path, key: str, reason: str, missing_tools: bool) -> None:
    """Record that `key`'s build failed here (atomically); where the cache cannot be written, a debug line: the next
    run tries again, as it did before records."""
    record = {"layout": RECORD_LAYOUT, "key": key, "reason": first_line(reason), "compiler": _compiler(),
              "missing_tools": missing_tools, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        atomic_write_json(record_path(final), record)
    except (OSError, SpecheadsError) as e:
        log.debug("the failed build of %s is not recorded (%s)", final.name, first_line(e))


def failed_before(label: str, fallback: str, final: Path, key: str, tools: str) -> bool:
    """True, after one info line, where this key's build failed here before and nothing it depended on has changed:
    the same compiler ($CXX), the same tools missing (`tools`, missing_tools()'s answer now; or none then and now),
    and no SPECHEADS_KERNELS_RETRY."""
    if os.environ.get(RETRY_ENV, "").strip().lower() not in ("", "0", "off", "no"):
        return False
    path = record_path(final)
    try:
        with open(path, "rb") as f:
            record = json.loads(f.read(MAX_RECORD_BYTES + 1))
    except (OSError, ValueError):  # none, or not one of ours: built (and recorded anew should it fail)
        return False
    if (not isinstance(record, dict) or record.get("key") != key or record.get("layout") != RECORD_LAYOUT
            or record.get("compiler") != _compiler() or bool(record.get("missing_tools")) != bool(tools)
            or (tools and record.get("reason") != first_line(tools))):
        return False
    log.info("%s: not compiled: its build failed here before (%s; recorded in %s); %s. To try again: %s=1, or "
             "delete that file", label, record.get("reason"), path, fallback, RETRY_ENV)
    return True


# ----------------------------------------------------------------------------------------------- pruning

def mark_used(final: Path) -> None:
    """Refresh the build folder's mtime, its last use for `prune`, where it is over TOUCH_S old (a read-only cache:
    nothing)."""
    try:
        if time.time() - final.stat().st_mtime > TOUCH_S:
            os.utime(final)
    except OSError:
        pass


def remove(path: Path) -> bool:
    """Remove a file or folder (a symlink itself, not what it names) -> whether it was there and is gone; a
    failure is a debug line."""
    try:
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        log.debug("%s: not removed (%s)", path, e.strerror or e)
        return False


def prune(root: Path, name: str, current: Path) -> None:
    """Remove the other keys' folders, logs and failure records of `name` in `root` last used (mtime) PRUNE_AGE_S
    or more before `current`, a fresh build; each key under its lock, one a process holds skipped. The current key
    and every lock file stay."""
    try:
        cutoff = current.stat().st_mtime - PRUNE_AGE_S
        entries = list(root.iterdir())
    except OSError as e:
        log.debug("old builds in %s not pruned (%s)", root, e.strerror or e)
        return
    by_key: dict[str, list[Path]] = {}
    for p in entries:
        m = _KEYED.match(p.name)
        if m and m["name"] == name and f"{name}-{m['key']}" != current.name:
            by_key.setdefault(m["key"], []).append(p)
    for key, paths in sorted(by_key.items()):
        try:
            old = [p for p in paths if p.lstat().st_mtime < cutoff]
            if not old:
                continue
            with Lock(root / f"{name}-{key}.lock") as lock:
                if not lock.try_take():
                    log.debug("%s-%s: a process holds its lock; not pruned", name, key)
                    continue
                for p in old:
                    if remove(p):
                        log.debug("pruned %s (another key's build, unused since before %s)", p, time.ctime(cutoff))
        except OSError as e:
            log.debug("%s-%s: not pruned (%s)", name, key, e.strerror or e)

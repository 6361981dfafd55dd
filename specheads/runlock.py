"""One writer per run folder: `specheads prepare`, `train` and `export` hold a lock on the folder they write.

    with run_lock(recipe.output_dir, "train"):
        ...

The lock is `<folder>/.specheads.lock` (`beside=True`: `<parent>/.<name>.specheads.lock`, for folders such as an
export's --out that are replaced whole), a JSON file {pid, command, host, started, pid_start} created atomically
(written to a temporary name, then hard-linked into place, which fails when the lock exists). A second process gets
one SpecheadsError naming the holder's pid and command; a lock left by a process that is no longer running on this
host (or whose pid now belongs to another process) is taken over with a warning. The lock is removed on exit,
exceptions included, and so are the folders the lock itself had to create when they are still empty. Under
`accelerate launch` only rank 0 (RANK, else LOCAL_RANK, 0 or unset) takes it; the other ranks write under rank 0's.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Iterator

from specheads.utils import SpecheadsError

log = logging.getLogger(__name__)

LOCK_NAME = ".specheads.lock"


def lock_path(folder: str | os.PathLike, beside: bool = False) -> Path:
    folder = Path(folder)
    return folder.parent / f".{folder.name}{LOCK_NAME}" if beside else folder / LOCK_NAME


def is_rank0() -> bool:
    """True for a single process and for rank 0 of a distributed launch (RANK, else LOCAL_RANK)."""
    rank = os.environ.get("RANK") or os.environ.get("LOCAL_RANK") or "0"
    try:
        return int(rank) == 0
    except ValueError:
        return True


@contextlib.contextmanager
def run_lock(folder: str | os.PathLike, command: str, beside: bool = False) -> Iterator[Path | None]:
    """Hold the lock of `folder` for `command` (e.g. "train") while the block runs; yields the lock file (None on
    ranks other than 0, which take no lock)."""
    if not is_rank0():
        yield None
        return
    path = lock_path(folder, beside)
    created = _make_parents(path.parent)
    try:
        info = _acquire(path, command, Path(folder))
    except BaseException:
        _remove_empty(created)
        raise
    try:
        yield path
    finally:
        _release(path, info)
        _remove_empty(created)


def read_lock(path: Path) -> dict | None:
    """The holder recorded in a lock file; None when the file is gone or unreadable."""
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return info if isinstance(info, dict) and isinstance(info.get("pid"), int) else None


def holder_alive(info: dict) -> bool:
    """Whether the process a lock names still runs. A lock of another host is taken as alive (it cannot be
    checked from here); a pid that now belongs to a process started at another time is not."""
    if info.get("host") != socket.gethostname():
        return True
    pid = info["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    except (OverflowError, ValueError):
        return False
    start = _process_start(pid)
    return info.get("pid_start") is None or start is None or start == info["pid_start"]


def _acquire(path: Path, command: str, folder: Path) -> dict:
    info = {"pid": os.getpid(), "command": f"specheads {command}", "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid_start": _process_start(os.getpid())}
    for _ in range(5):  # a few rounds: a stale lock taken over, or one released while we looked
        if _create(path, info):
            return info
        held = read_lock(path)
        if held is not None and holder_alive(held):
            where = f" on {held.get('host')}" if held.get("host") != info["host"] else ""
            raise SpecheadsError(
                f"{folder}: in use by pid {held['pid']}{where} ({held.get('command', '?')}, started "
                f"{held.get('started', '?')}; lock {path}); wait for it to finish, or use another folder")
        _take_over(path, held)
    raise SpecheadsError(f"{path}: could not take the lock (other processes keep taking it); try again")


def _create(path: Path, info: dict) -> bool:
    """Write the lock whole under a temporary name, then link it into place; False when a lock is there."""
    fd, tmp = tempfile.mkstemp(prefix=f"{path.name}.tmp-{os.getpid()}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(info, f)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError:  # a file system without hard links: exclusive create (a reader may see it half-written)
            try:
                lfd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(lfd, "w") as f:
                json.dump(info, f)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _take_over(path: Path, stale: dict | None) -> None:
    """Remove a stale lock: moved aside first, and put back if what was moved is not the lock found stale (another
    process took it over in between)."""
    aside = path.with_name(f"{path.name}.stale-{os.getpid()}")
    try:
        os.replace(path, aside)
    except FileNotFoundError:
        return  # released, or taken over by another process: try again
    moved = read_lock(aside)
    if moved != stale:
        with contextlib.suppress(OSError):
            os.link(aside, path)
        aside.unlink(missing_ok=True)
        return
    aside.unlink(missing_ok=True)
    if stale is None:
        log.warning("%s: unreadable lock file, taken over", path)
    else:
        log.warning("%s: stale lock of pid %s (%s, started %s) that is no longer running: taken over", path,
                    stale["pid"], stale.get("command", "?"), stale.get("started", "?"))


def _release(path: Path, info: dict) -> None:
    held = read_lock(path)
    if held is not None and held.get("pid") == info["pid"] and held.get("started") == info["started"]:
        path.unlink(missing_ok=True)
    else:
        log.warning("%s: the lock was removed or replaced while this process held it", path)


def _process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux /proc); None elsewhere."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _make_parents(folder: Path) -> list[Path]:
    """mkdir -p `folder`; returns the folders created, deepest first."""
    missing = []
    p = folder
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    folder.mkdir(parents=True, exist_ok=True)
    return missing


def _remove_empty(created: list[Path]) -> None:
    for p in created:
        try:
            p.rmdir()
        except OSError:
            return  # not empty (the command wrote there) or gone

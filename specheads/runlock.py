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

A folder has two lock places, and every writer honours both: a command that writes inside a run folder (prepare,
train) is refused while another process holds the lock beside it (an export replacing it), and a command that
replaces a folder whole (export) is refused while a process holds the lock inside it or in any folder below it (a
train running there): utils.refuse_held, which atomic_dir also checks before it writes and again at its rename.
A beside lock of a symlinked folder lies beside the folder the link names (every spelling of a folder, one lock).
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

from specheads.utils import (LOCK_NAME, SpecheadsError, WriteError, errno_text, holder_alive,  # noqa: F401
                             live_locks, os_error_of, process_start, read_lock)

log = logging.getLogger(__name__)


def lock_path(folder: str | os.PathLike, beside: bool = False) -> Path:
    folder = Path(folder)
    if beside and folder.is_symlink():  # the folder the link names: one lock however the folder is spelled
        folder = Path(os.path.realpath(folder))
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
        _refuse_other_place(Path(folder), beside)
    except BaseException:
        _release(path, info)
        _remove_empty(created)
        raise
    try:
        yield path
    finally:
        _release(path, info)
        _remove_empty(created)


def _in_use(folder: Path, held: dict, lock: Path) -> SpecheadsError:
    where = f" on {held.get('host')}" if held.get("host") != socket.gethostname() else ""
    return SpecheadsError(f"{folder}: in use by pid {held['pid']}{where} ({held.get('command', '?')}, started "
                          f"{held.get('started', '?')}; lock {lock}); wait for it to finish, or use another folder")


def _refuse_other_place(folder: Path, beside: bool) -> None:
    """With this command's lock taken: the folder's other lock place is not held by a live process either (the
    lock beside a run folder that prepare / train write into; the locks inside and below a folder that an export
    replaces whole)."""
    if beside:
        held = live_locks(folder)
    else:
        other = lock_path(folder, beside=True)
        info = read_lock(other)
        held = [(other, info)] if info is not None and holder_alive(info) else []
    for lock, info in held:
        run = lock.parent if lock.name == LOCK_NAME else folder
        raise _in_use(run, info, lock)


def _acquire(path: Path, command: str, folder: Path) -> dict:
    info = {"pid": os.getpid(), "command": f"specheads {command}", "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid_start": process_start(os.getpid())}
    for _ in range(5):  # a few rounds: a stale lock taken over, or one released while we looked
        if _create(path, info):
            return info
        held = read_lock(path)
        if held is not None and holder_alive(held):
            raise _in_use(folder, held, path)
        _take_over(path, held)
    raise SpecheadsError(f"{path}: could not take the lock (other processes keep taking it); try again")


def _create(path: Path, info: dict) -> bool:
    """Write the lock whole under a temporary name, then link it into place; False when a lock is there."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f"{path.name}.tmp-{os.getpid()}-", dir=path.parent)
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
    except OSError as e:  # a full disk or a read-only folder at the very first write: name the lock file
        oe = os_error_of(e)
        if oe is None:
            raise
        raise WriteError(path, errno_text(oe), "the command did not start (nothing was written)") from None
    finally:
        if tmp is not None:
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

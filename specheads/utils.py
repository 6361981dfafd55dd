"""Small shared helpers: logging, atomic writes, errors users can read."""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger("specheads")


class SpecheadsError(Exception):
    """An error caused by the user's input (file, field or flag). The CLI prints it as one line, no traceback."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the command (`signum`); `detail` says what was kept. A KeyboardInterrupt, so that
    whatever keeps its work on Ctrl-C (bench's finished prompts, training's checkpoint) does so on SIGTERM too; the
    CLI prints one line and exits 128 + signum."""

    def __init__(self, signum: int, detail: str = ""):
        super().__init__(detail)
        self.signum, self.detail = int(signum), detail


# What the OS answers when a write cannot happen here (full disk or quota, read-only, permissions, `ulimit -f`, a
# file where a folder should be): one line naming the path, never a traceback.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG,
                          errno.ENOTDIR})


class WriteError(SpecheadsError):
    """A write the OS refused: `path` (the file or folder we were writing), `reason` (errno text and name) and `kept`
    (what is still there; temporary files and folders are removed before this is raised)."""

    def __init__(self, path: str | os.PathLike, reason: str, kept: str):
        self.path, self.reason, self.kept = Path(path), reason, kept
        super().__init__(f"{path}: cannot write: {reason}; {kept}")


def os_error_of(e: BaseException) -> OSError | None:
    """The OS error behind a failed write: `e` itself, or the one safetensors' writer reports in its message
    ('I/O error: No space left on device (os error 28)'); None for anything else, or an errno outside
    WRITE_ERRNOS (a bug, not the machine's refusal: it keeps its traceback)."""
    import re

    if isinstance(e, OSError):
        return e if e.errno in WRITE_ERRNOS else None
    m = re.search(r"\(os error (\d+)\)", str(e)) if type(e).__name__ == "SafetensorError" else None
    if m and int(m.group(1)) in WRITE_ERRNOS:
        return OSError(int(m.group(1)), os.strerror(int(m.group(1))))
    return None


def errno_text(e: OSError) -> str:
    """'No space left on device [ENOSPC]'."""
    return f"{e.strerror or os.strerror(e.errno)} [{errno.errorcode.get(e.errno, e.errno)}]"


def as_write_error(e: BaseException, path: str | os.PathLike, kept: str,
                   tmp: str | os.PathLike | None = None) -> WriteError | None:
    """`e` as one WriteError naming what was written (a WriteError raised deeper keeps its file, e.g. a JSON file
    inside a folder being written; names under the temporary folder `tmp` are given under `path`, where they were
    going); None when `e` is not the OS refusing a write (re-raise it)."""
    if isinstance(e, WriteError):
        where, reason = e.path, e.reason
    else:
        oe = os_error_of(e)
        if oe is None:
            return None
        where, reason = Path(oe.filename or path), errno_text(oe)
    if tmp is not None and Path(where).is_relative_to(tmp):
        where = Path(path) / Path(where).relative_to(tmp)
    return WriteError(where, reason, kept)


def remove_quietly(*paths: str | os.PathLike) -> None:
    """Delete temporary files or folders (never raises: it runs while another error is on its way out)."""
    for p in paths:
        p = Path(p)
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                p.unlink()


# ------------------------------------------------------------------- run locks as files (runlock.py takes them)
# Every folder a command writes is guarded by a lock file: `<folder>/.specheads.lock` (prepare, train) or
# `<parent>/.<name>.specheads.lock` (export --out, replaced whole). Reading them lives here, below runlock, so that
# atomic_dir can refuse to replace a folder another live process holds.
LOCK_NAME = ".specheads.lock"


def read_lock(path: Path) -> dict | None:
    """The holder recorded in a lock file; None when the file is gone or unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            info = json.loads(f.read(1 << 16))  # ours are ~200 bytes; a huge file is not a lock we wrote
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return info if isinstance(info, dict) and isinstance(info.get("pid"), int) else None


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux /proc); None elsewhere."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


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
    start = process_start(pid)
    return info.get("pid_start") is None or start is None or start == info["pid_start"]


def live_locks(folder: str | os.PathLike) -> list[tuple[Path, dict]]:
    """The run locks of live processes that replacing `folder` would delete or orphan: the one beside it (unless
    this process holds it: an export writing its own --out), the one inside it and any below it (a run folder
    somewhere under it). [(lock file, holder)]."""
    folder = Path(os.path.realpath(folder)) if Path(folder).is_symlink() else Path(folder)
    beside = folder.parent / f".{folder.name}{LOCK_NAME}"
    found = [beside]
    if folder.is_dir():
        found += list(folder.rglob(f"*{LOCK_NAME}"))  # run locks and beside locks (not their .tmp- / .stale-)
    held = [(p, read_lock(p)) for p in found if p.is_file()]
    return [(p, info) for p, info in held if info is not None and holder_alive(info)
            and not (p == beside and info["pid"] == os.getpid())]


def refuse_held(folder: str | os.PathLike, what: str = "") -> None:
    """One SpecheadsError when a live process holds `folder` or a folder below it (`live_locks`): replacing it would
    delete that run's files. `what` names the flag or path in the message (default the folder)."""
    for lock, info in live_locks(folder):
        where = f" on {info.get('host')}" if info.get("host") != socket.gethostname() else ""
        run = lock.parent if lock.name == LOCK_NAME else lock.parent / lock.name[1:-len(LOCK_NAME)]
        below = "" if run in (Path(folder), Path(os.path.realpath(folder))) else f"{run}, below it, is "
        raise SpecheadsError(f"{what or folder}: {below}in use by pid {info['pid']}{where} "
                             f"({info.get('command', '?')}, started {info.get('started', '?')}; lock {lock}); "
                             f"replacing it would delete that run's files: wait for it to finish, or choose "
                             f"another folder")


# ------------------------------------------------------------------------------------- reads with a size bound
MAX_TEXT_BYTES = 64 << 20  # a recipe, a JSON file we read whole, one row of a dataset: larger is not an input of ours


def read_bytes_bounded(path: str | os.PathLike, what: str = "", limit: int | None = None) -> bytes:
    """A file read whole, at most `limit` bytes: a device or pipe that never ends, or a file far larger than any
    input of ours, is one SpecheadsError naming it (`what`, default the path), and memory stays bounded. `limit`
    defaults to MAX_TEXT_BYTES."""
    path, limit = Path(path), MAX_TEXT_BYTES if limit is None else limit
    if path.is_dir():
        raise SpecheadsError(f"{what or path}: is a folder, not a file")
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise SpecheadsError(f"{what or path}: more than {limit >> 20} MiB (read no further; an endless device or "
                             f"pipe, or not the file meant?)")
    return data


def read_text_bounded(path: str | os.PathLike, what: str = "", limit: int | None = None) -> str:
    """`read_bytes_bounded` as UTF-8 text; bytes that are not UTF-8 are one SpecheadsError naming file and line."""
    data = read_bytes_bounded(path, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise SpecheadsError(f"{what or Path(path)}: not UTF-8 text: line {line} has byte 0x{data[e.start]:02x} "
                             f"({e.reason})") from None


def bounded_lines(f, path: str | os.PathLike, limit: int | None = None) -> Iterator[tuple[int, str]]:
    """(line number, line) of the open text file `f`, each line read with at most `limit` characters (default
    MAX_TEXT_BYTES): a line that does not end by then (one endless line) is one SpecheadsError naming the file and
    line."""
    limit, n = MAX_TEXT_BYTES if limit is None else limit, 0
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        n += 1
        if len(line) > limit:
            raise SpecheadsError(f"{path}: line {n} is longer than {limit >> 20} Mi characters (read no further; "
                                 f"one endless line, or not a JSONL file?)")
        yield n, line


CHAT_KWARGS_ATTR = "specheads_chat_template_kwargs"  # data.chat_template_kwargs, set on a tokenizer by
# train/data.chat_tokenizer and read wherever the data's conversations are rendered


def template_kwargs(tokenizer) -> dict:
    """data.chat_template_kwargs as a tokenizer carries them (train/data.chat_tokenizer), {} when none."""
    return dict(getattr(tokenizer, CHAT_KWARGS_ATTR, None) or {})


def check_values(section: str, obj: Any, rules: dict[str, str]) -> None:
    """Range checks of a config dataclass, one SpecheadsError naming `section.field`. Rules: ">=N", ">N",
    "[a,b)" (a <= v < b), "(a,b]"; "|None" appended allows None. Numbers must be finite (no nan / inf)."""
    import math

    for name, rule in rules.items():
        v = getattr(obj, name)
        rule, _, none_ok = rule.partition("|")
        if v is None and none_ok:
            continue
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if ok and rule.startswith((">=", ">")):
            bound = float(rule.lstrip(">="))
            ok = v >= bound if rule.startswith(">=") else v > bound
        elif ok:
            lo, hi = (float(x) for x in rule[1:-1].split(","))
            ok = (lo <= v if rule[0] == "[" else lo < v) and (v < hi if rule[-1] == ")" else v <= hi)
        if not ok:
            want = (">= " + rule[2:] if rule.startswith(">=") else "> " + rule[1:] if rule.startswith(">")
                    else "in " + rule) + (" or null" if none_ok else "")
            raise SpecheadsError(f"{section}.{name}: must be {want}, got {v!r}")


# third-party log lines that say nothing our own lines do not: {logger name: message prefixes}. DeepSpeed's
# "Setting accelerator to CPU" comes once per process that imports it (prepare and train each: twice in `make demo`);
# the trainer's own line names the device
THIRD_PARTY_NOISE = {"DeepSpeed": ("Setting accelerator to CPU",)}


class _DropNoise(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def setup_logging(level: int = logging.INFO) -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("specheads").setLevel(level)
    for name, prefixes in THIRD_PARTY_NOISE.items():  # a logger's filters outlive its library's own setup
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise(prefixes))


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temporary folder beside `final`; on success rename it to `final` (a half-written folder is never seen).

    The temporary name carries the writer's pid (`.<name>.tmp-<pid>-<random>`): leftovers of a killed writer (its
    pid gone) are removed the next time `final` is written. Callers that replace a folder the user named check
    first with `refuse_replacing`. A `final` that a live process holds (a run lock in it, beside it or in a folder
    below it: `refuse_held`) is never replaced, checked before writing and again at the rename; a `final` that is a
    symlink is written through (the folder it names is replaced, the link kept). A `final` that is itself an empty temporary folder of this process (an outer
    atomic_dir, e.g. an export staged with its record) is written in place: the outer rename publishes it."""
    final = Path(final)
    if _staged_here(final):
        yield final
        return
    if final.is_symlink():  # written through the link: the folder it names is replaced, the link stays
        final = Path(os.path.realpath(final))
    refuse_held(final)  # another live command's run folder (or one below `final`): never replaced
    existed, tmp = final.exists(), None
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=final.parent))
        yield tmp
        if final.exists():
            refuse_held(final)  # again at the rename: a run may have started there meanwhile
            if not overwrite:
                raise FileExistsError(final)
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException as e:
        if tmp is not None:
            remove_quietly(tmp)
        kept = f"{final} was left as it was" if existed else f"nothing was written at {final}"
        err = as_write_error(e, final, kept + (" (its temporary folder removed)" if tmp is not None else ""), tmp)
        if err is None:
            raise
        raise err from None


def _staged_here(folder: Path) -> bool:
    """An empty `.<name>.tmp-<this pid>-*` folder: made by an outer atomic_dir of this process."""
    return (folder.name.startswith(".") and f".tmp-{os.getpid()}-" in folder.name and folder.is_dir()
            and not any(folder.iterdir()))


def _remove_stale(final: Path) -> None:
    """Delete `.<name>.tmp-*` / `.<name>.old-*` siblings whose writer is no longer running."""
    for p in list(final.parent.glob(f".{final.name}.tmp-*")) + list(final.parent.glob(f".{final.name}.old-*")):
        tail = p.name.split(".tmp-", 1)[-1] if ".tmp-" in p.name else p.name.split(".old-", 1)[-1]
        pid = tail.split("-", 1)[0]
        if pid.isdigit() and (int(pid) == os.getpid() or _alive(int(pid))):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def path_relation(out, src) -> str | None:
    """How folder `out` relates to `src`: "is", "contains", "is inside" or None (apart)."""
    target, s = Path(out).resolve(), Path(src).resolve()
    return ("is" if target == s else "contains" if s.is_relative_to(target) else
            "is inside" if target.is_relative_to(s) else None)


def refuse_replacing(out: str | os.PathLike, sources: list[str | os.PathLike], is_ours, what: str, force: bool,
                     flag: str = "--out") -> None:
    """Check a user-named output folder before it is replaced. Never: `out` is, contains or lies inside a source
    folder (replacing it would delete the source), or a live process holds it or a folder below it (`refuse_held`:
    a train running there). Without `force`: `out` is a file, or a non-empty folder that `is_ours(out)` does not
    recognise as an earlier output of the same kind (`what`, e.g. "eagle3 export")."""
    out = Path(out)
    target = out.resolve()
    for src in sources:
        rel = path_relation(target, src)
        if rel:
            raise SpecheadsError(f"{flag} {out}: {rel} the source folder {src}; writing there would delete or mix "
                                 f"into it: choose another folder")
    cwd = Path.cwd().resolve()
    if cwd.is_relative_to(target) or not target.name:  # `.`, `..`, `/`: replaced whole, with the shell inside it
        rel = "is the current folder" if cwd == target else "holds the current folder"
        raise SpecheadsError(f"{flag} {out}: {rel} ({cwd}); the output is replaced whole, so it must be a folder of "
                             f"its own: name a new sub-folder, e.g. {flag} ./out")
    blocked = next((p for p in out.parents if p.exists() or p.is_symlink()), None)
    if blocked is not None and not blocked.is_dir():
        raise SpecheadsError(f"{flag} {out}: {blocked} is a file, not a folder, so nothing can be written below it: "
                             f"choose another folder")
    if not out.exists():  # absent, or a link to nothing yet (atomic_dir writes through it)
        return
    if not out.is_dir():
        if force:
            return
        raise SpecheadsError(f"{flag} {out}: is a file, not a folder; pass --force to replace it")
    refuse_held(out, f"{flag} {out}")  # a live run in it or below it: never replaced, --force or not
    entries = sorted(p.name for p in out.iterdir())
    if not entries or is_ours(out) or force:
        return
    shown = ", ".join(entries[:4]) + (f", ... ({len(entries)} entries)" if len(entries) > 4 else "")
    raise SpecheadsError(f"{flag} {out}: not empty and not an earlier {what} ({shown}); its contents would be "
                         f"deleted: pass --force to replace it, or choose another folder")


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to a temporary file beside `path` (`.<name>.tmp-<pid>-<random>`), fsync, rename: `path` is whole
    or as it was; a killed writer's temporary file is removed by the next write of `path`. An OS refusal (full disk,
    read-only, ...) is one WriteError naming `path`; the temporary file is removed."""
    path = Path(path)
    existed, tmp = path.exists(), None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(path)  # a killed writer's temporary file (its pid gone)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            remove_quietly(tmp)
        err = as_write_error(e, path, "its previous content is kept" if existed else "it was not written")
        if err is None:
            raise
        raise WriteError(path, err.reason, err.kept) from None


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16"}  # every dtype spelling a flag or recipe takes -> torch's name


def sha256_file(path: str | os.PathLike) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):  # 16 MiB reads
            h.update(chunk)
    return h.hexdigest()


def read_json(path: str | os.PathLike) -> Any:
    path = Path(path)
    try:
        return json.loads(read_text_bounded(path))
    except FileNotFoundError:
        raise SpecheadsError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise SpecheadsError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None


def cache_root() -> Path:
    """$SPECHEADS_CACHE, default ~/.cache/specheads: converted targets and machine profiles live here."""
    return Path(os.environ.get("SPECHEADS_CACHE", Path.home() / ".cache" / "specheads"))

"""Small shared helpers: logging, atomic writes, errors users can read."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger("specheads")


class SpecheadsError(Exception):
    """An error caused by the user's input (file, field or flag). The CLI prints it as one line, no traceback."""


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


def setup_logging(level: int = logging.INFO) -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("specheads").setLevel(level)


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temporary folder beside `final`; on success rename it to `final` (a half-written folder is never seen).

    The temporary name carries the writer's pid (`.<name>.tmp-<pid>-<random>`): leftovers of a killed writer (its
    pid gone) are removed the next time `final` is written. Callers that replace a folder the user named check
    first with `refuse_replacing`."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            if not overwrite:
                raise FileExistsError(final)
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _remove_stale(final: Path) -> None:
    """Delete `.<name>.tmp-*` / `.<name>.old-*` siblings whose writer is no longer running."""
    for p in list(final.parent.glob(f".{final.name}.tmp-*")) + list(final.parent.glob(f".{final.name}.old-*")):
        tail = p.name.split(".tmp-", 1)[-1] if ".tmp-" in p.name else p.name.split(".old-", 1)[-1]
        pid = tail.split("-", 1)[0]
        if pid.isdigit() and (int(pid) == os.getpid() or _alive(int(pid))):
            continue
        if p.is_dir():
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


def refuse_replacing(out: str | os.PathLike, sources: list[str | os.PathLike], is_ours, what: str, force: bool,
                     flag: str = "--out") -> None:
    """Check a user-named output folder before it is replaced. Never: `out` is, contains or lies inside a source
    folder (replacing it would delete the source). Without `force`: `out` is a file, or a non-empty folder that
    `is_ours(out)` does not recognise as an earlier output of the same kind (`what`, e.g. "eagle3 export")."""
    out = Path(out)
    target = out.resolve()
    for src in sources:
        s = Path(src).resolve()
        rel = ("is" if target == s else "contains" if s.is_relative_to(target) else
               "is inside" if target.is_relative_to(s) else None)
        if rel:
            raise SpecheadsError(f"{flag} {out}: {rel} the source folder {src}; writing there would delete or mix "
                                 f"into it: choose another folder")
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        if force:
            return
        raise SpecheadsError(f"{flag} {out}: is a file, not a folder; pass --force to replace it")
    entries = sorted(p.name for p in out.iterdir())
    if not entries or is_ours(out) or force:
        return
    shown = ", ".join(entries[:4]) + (f", ... ({len(entries)} entries)" if len(entries) > 4 else "")
    raise SpecheadsError(f"{flag} {out}: not empty and not an earlier {what} ({shown}); its contents would be "
                         f"deleted: pass --force to replace it, or choose another folder")


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


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
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SpecheadsError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise SpecheadsError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None


def cache_root() -> Path:
    """$SPECHEADS_CACHE, default ~/.cache/specheads: converted targets and machine profiles live here."""
    return Path(os.environ.get("SPECHEADS_CACHE", Path.home() / ".cache" / "specheads"))

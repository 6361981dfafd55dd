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


def setup_logging(level: int = logging.INFO) -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("specheads").setLevel(level)


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temporary folder beside `final`; on success rename it to `final` (a half-written folder is never seen)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
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

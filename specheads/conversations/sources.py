"""Raw rows from a data source: a JSON array (streamed), JSONL, a hub dataset id, a `datasets.Dataset` or the
alias `sharegpt`. Rows that cannot be used are counted in `LoadStats` (the first few reasons kept), not fatal; a
file that is not JSON is one SpecheadsError naming the file, line and column.
"""
from __future__ import annotations

import collections
import gzip
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from specheads.assets import sharegpt_json
from specheads import utils
from specheads.utils import SpecheadsError, bounded_lines, check_values

SHOW_REASONS = 5  # malformed rows whose reason is logged verbatim; the rest are only counted


@dataclass
class SourceSpec:
    """One entry of `data.sources` (train/mix.py mixes them): where the rows come from and how much of them."""
    source: str = ""  # a file, hub dataset id or the alias sharegpt (what data.source takes)
    weight: float = 1.0  # share of this source's conversations in the mix: 0.5 = a seeded half, 2.0 = each twice
    limit: int | None = None  # read at most this many valid conversations of it (None = all)
    split: str | None = None  # hub datasets: the split (None = train)
    subset: str | None = None  # hub datasets: the configuration name (load_dataset's `name`)
    data_files: str | None = None  # hub datasets: one file (or glob) of the repository, e.g. ShareGPT_V4.3_...json
    name: str | None = None  # the prefix of its conversation ids (None = from the source: file stem, hub id's tail)

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source.strip():
            raise SpecheadsError(f"data.sources: an entry without a source (got {self.source!r})")
        check_values(f"data.sources[{self.source}]", self, {"weight": ">0", "limit": ">=1|None"})
        if self.name is not None and (not self.name.strip() or ":" in self.name):
            raise SpecheadsError(f"data.sources[{self.source}].name: {self.name!r} must be a non-empty name "
                                 f"without ':'")


class Malformed(ValueError):
    """One row that cannot be used (the reason is counted and the row skipped)."""


@dataclass
class LoadStats:
    source: str = ""
    rows_read: int = 0  # rows parsed from the source (valid or not)
    kept: int = 0  # conversations kept
    skipped: int = 0  # malformed rows skipped
    reasons: collections.Counter = field(default_factory=collections.Counter)  # reason kind -> count
    examples: list[str] = field(default_factory=list)  # the first few full reasons
    truncated_tail: bool = False  # the file ended inside a row (that row is dropped)
    stopped_early: bool = False  # max_conversations reached before the end of the source
    empty_turns: int = 0  # assistant turns with no text, skipped with the user turn they answer

    def skip(self, where: str, reason: str) -> None:
        self.skipped += 1
        self.reasons[reason.split(":")[0]] += 1
        if len(self.examples) < SHOW_REASONS:
            self.examples.append(f"{where}: {reason}")



def open_text(path: Path):
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def iter_json_array(path: Path, stats: LoadStats, chunk_chars: int = 1 << 22,
                    max_chars: int | None = None) -> Iterator[Any]:
    """Yield the elements of a top-level JSON array, read in chunks of `chunk_chars` characters (4 Mi: a few large
    conversations per chunk). A file cut inside its last element (the packaged ShareGPT file) yields every complete
    element, then sets `stats.truncated_tail`; a file broken elsewhere raises SpecheadsError with line and column.
    Memory is bounded: consumed text is dropped before each read, and an element (or a run of whitespace) longer
    than `max_chars` (default utils.MAX_TEXT_BYTES) is one SpecheadsError, not a buffer that grows forever."""
    dec = json.JSONDecoder()
    max_chars = utils.MAX_TEXT_BYTES if max_chars is None else max_chars
    f = open_text(path)
    try:
        buf = f.read(chunk_chars)
        eof = len(buf) < chunk_chars
        base_newlines = 0  # newlines in text already dropped from buf
        base_col = 0  # characters since the last dropped newline (column of buf[0] minus 1)

        def fail(pos: int, msg: str):
            nl = buf.count("\n", 0, pos)
            line = base_newlines + nl + 1
            col = pos - buf.rfind("\n", 0, pos) if nl else base_col + pos + 1
            raise SpecheadsError(f"{path}: not valid JSON at line {line}, column {col}: {msg}")

        def refill(pos: int) -> int:
            """Drop the text before `pos`, read one more chunk; returns the new position (0)."""
            nonlocal buf, eof, base_newlines, base_col
            dropped = buf[:pos]
            nl = dropped.count("\n")
            base_col = len(dropped) - dropped.rfind("\n") - 1 if nl else base_col + len(dropped)
            base_newlines += nl
            buf = buf[pos:]
            if len(buf) > max_chars:
                fail(0, f"an element longer than {max_chars >> 20} Mi characters (read no further; one endless "
                        f"value, or not a dataset?)")
            more = f.read(chunk_chars)
            eof = len(more) < chunk_chars
            buf += more
            return 0

        pos = len(buf) - len(buf.lstrip())  # leading whitespace
        if pos >= len(buf) or buf[pos] != "[":
            fail(pos, "expected '[' (a JSON array of conversations)")
        pos += 1
        expect_comma = False
        while True:
            while True:  # skip whitespace and the separator, refilling as needed
                while pos < len(buf) and buf[pos].isspace():
                    pos += 1
                if pos < len(buf) or eof:
                    break
                pos = refill(pos)
            if pos >= len(buf):  # EOF between elements
                stats.truncated_tail = True
                return
            if buf[pos] == "]":
                return
            if expect_comma:
                if buf[pos] != ",":
                    fail(pos, "expected ',' or ']' between conversations")
                pos, expect_comma = pos + 1, False
                continue
            try:
                obj, end = dec.raw_decode(buf, pos)
            except json.JSONDecodeError as e:
                # Input that merely ran out fails inside an unterminated string or at (nearly) the buffer's end;
                # anything else is a broken file. Mid-file the tolerance is loose (a chunk may end in an escape or
                # a literal), then re-checked strictly once the whole file is in.
                end = len(buf.rstrip())
                slack = (4 if e.msg.startswith("Expecting value") else 6 if "escape" in e.msg else 2) if eof else 8
                if not (e.msg.startswith("Unterminated string") or e.pos >= end - slack):
                    fail(e.pos, e.msg)
                if eof:
                    stats.truncated_tail = True
                    return
                pos = refill(pos)
                continue
            yield obj
            pos = end
            expect_comma = True
    finally:
        f.close()


def iter_jsonl(path: Path, stats: LoadStats) -> Iterator[Any]:
    """Yield one object per non-empty line. A first line that is not JSON -> SpecheadsError (the file is not JSONL);
    a later bad line is skipped and counted; a bad last line is reported as a cut tail. A line longer than
    utils.MAX_TEXT_BYTES characters is one SpecheadsError naming it (reads are bounded)."""
    with open_text(path) as f:
        parsed_any = False
        pending_err: tuple[int, str] | None = None
        for lineno, line in bounded_lines(f, path):  # one endless line: one error, not a buffer growing forever
            if not line.strip():
                continue
            if pending_err is not None:
                stats.rows_read += 1
                stats.skip(f"{path}:{pending_err[0]}", f"not JSON: {pending_err[1]}")
                pending_err = None
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                if not parsed_any:
                    raise SpecheadsError(f"{path}: not valid JSON at line {lineno}, column {e.colno}: {e.msg}") from None
                pending_err = (lineno, e.msg)
                continue
            parsed_any = True
            yield obj
        if pending_err is not None:
            stats.truncated_tail = True


def rows_from_source(source: Any, stats: LoadStats, split: str | None = None, subset: str | None = None,
                     data_files: str | None = None) -> tuple[Iterable[Any], str]:
    """Iterable of raw rows and a short name used for generated ids. `split`, `subset` (a configuration name) and
    `data_files` select within a hub dataset; given for a file or a Dataset they are one error."""
    hub_only = [k for k, v in (("split", split), ("subset", subset), ("data_files", data_files)) if v is not None]
    if hub_only and (not isinstance(source, (str, Path)) or str(source) == "sharegpt" or Path(source).exists()):
        raise SpecheadsError(f"data.sources[{source if isinstance(source, (str, Path)) else type(source).__name__}]."
                             f"{hub_only[0]}: selects within a hub dataset; this source is a file or a Dataset")
    if not isinstance(source, (str, Path)):  # a datasets.Dataset / DatasetDict / list of dicts
        stats.source = type(source).__name__
        if type(source).__name__ in ("DatasetDict", "IterableDatasetDict"):  # its train split
            if "train" not in source:
                raise SpecheadsError(f"data.source: the DatasetDict has no 'train' split (splits {list(source)})")
            source = source["train"]
        return iter(source), "row"
    if str(source) == "sharegpt":
        source = sharegpt_json()
    path = Path(source)
    stats.source = str(path)
    if path.exists():
        if path.is_dir():
            raise SpecheadsError(f"{path}: is a folder; expected a .json/.jsonl file")
        name = path.name.removesuffix(".gz")
        if name.endswith(".jsonl"):
            return iter_jsonl(path, stats), path.stem
        with open_text(path) as f:  # .json (or anything else): sniff the first character
            head = f.read(4096).lstrip()
        if head.startswith("["):
            return iter_json_array(path, stats), path.stem
        if head.startswith("{"):
            return iter_jsonl(path, stats), path.stem
        raise SpecheadsError(f"{path}: not valid JSON at line 1, column 1: expected '[' or '{{'")
    if str(source).endswith((".json", ".jsonl", ".gz")) or str(source).startswith((".", "/")):
        raise SpecheadsError(f"data.source {str(source)!r}: file not found")
    try:  # a hub dataset id
        import datasets

        ds = datasets.load_dataset(str(source), name=subset, split=split or "train", data_files=data_files)
    except Exception as e:  # noqa: BLE001 - any hub/offline failure becomes one readable line
        raise SpecheadsError(f"data.source {str(source)!r}: not a file and cannot load it as a hub dataset "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    return iter(ds), str(source).replace("/", "_")

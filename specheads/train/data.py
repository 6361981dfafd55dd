"""Conversations -> chat-templated token ids with assistant-only loss masks.

Sources (`DataConfig.source`): the alias `sharegpt` (the packaged ShareGPT V3 file), a ShareGPT JSON array or JSONL
file (`conversations: [{from, value}]`), an OpenAI-style JSONL file (`messages: [{role, content}]`), a hub dataset id,
or a `datasets.Dataset` passed to `load_conversations` directly.

Normalised conversations are a `datasets.Dataset` with columns `conversation_id: str` and
`messages: list[{role, content}]` (roles `system | user | assistant`).

Loss mask: 1 on the assistant's content tokens **and on the template's end-of-turn token** that closes each
assistant turn (`<|im_end|>` for ChatML templates such as SmolLM2's): the head must learn to predict the end of a
turn, since the target emits it. Everything else (system prompt, user turns, the `<|im_start|>assistant\\n` header,
the newline after `<|im_end|>`) is 0.

How the mask is found without `{% generation %}` tags: the template is rendered prefix by prefix. For assistant
message i, `render(messages[:i], add_generation_prompt=True)` is a prefix of `render(messages[:i+1])`; the difference
holds the content (located with `str.find`) followed by the turn's suffix, whose leading special token (if any) is the
end-of-turn token. Each text segment is tokenised on its own and the ids are concatenated, which is how the target
sees an answer it generated itself (the prompt is tokenised, the answer arrives as tokens); decoding the masked ids
therefore gives back exactly the assistant texts plus the end-of-turn token.
"""
from __future__ import annotations

import collections
import gzip
import hashlib
import io
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from specheads.utils import SpecheadsError

log = logging.getLogger(__name__)


@dataclass
class DataConfig:
    source: str = "sharegpt"  # alias, ShareGPT JSON/JSONL, OpenAI messages JSONL, or a hub dataset id
    max_conversations: int | None = None  # None = all; reading stops once this many valid conversations are kept
    max_length: int = 2048  # tokens per sample (truncated)
    val_fraction: float = 0.02  # held-out share for evaluation (chosen by a hash of the conversation id)
    regenerate: bool = False  # replace assistant turns with the target's own answers (self-distillation)
    regen_max_new_tokens: int = 512  # tokens per regenerated answer (cap; also bounded by max_length)
    regen_batch_size: int = 32  # rows decoding together (refilled with waiting prompts as rows finish)
    regen_temperature: float = 0.0  # 0 = greedy (the default: the head learns the target's argmax)
    regen_top_p: float = 1.0  # nucleus cut when sampling (1.0 = off)
    regen_max_turns: int | None = None  # regenerate (and keep) only the first N exchanges; None = all (a next turn
    # joins the refilled batch as soon as its previous answer is done)
    regen_conversations: int | None = None  # regenerate only the first N kept conversations; the rest keep the
    # source's replies (None = all). Mixes cheap extra data in: extraction ~1,100 tok/s vs regeneration ~250 on 2 cores
    regen_dtype: str | None = None  # target dtype for regeneration (None = target.dtype). Which is faster depends
    # on the CPU and library versions (measured both ways round on one 2-core AVX-512 CPU): time both on yours

    def __post_init__(self) -> None:
        from specheads.utils import check_values

        check_values("data", self, {"max_conversations": ">=1|None", "max_length": ">=2", "val_fraction": "[0,1)",
                                    "regen_max_new_tokens": ">=1", "regen_batch_size": ">=1",
                                    "regen_temperature": ">=0", "regen_top_p": "(0,1]", "regen_max_turns": ">=1|None",
                                    "regen_conversations": ">=1|None"})
        if not isinstance(self.source, str) or not self.source.strip():
            raise SpecheadsError(f"data.source: expected a file, hub id or alias, got {self.source!r}")
        if self.regen_conversations is not None and not self.regenerate:
            raise SpecheadsError("data.regen_conversations: set, but data.regenerate is false (nothing to regenerate)")
        if self.regen_dtype is not None and self.regen_dtype not in REGEN_DTYPES:
            raise SpecheadsError(f"data.regen_dtype: {self.regen_dtype!r} is not one of {list(REGEN_DTYPES)} or null")


REGEN_DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")  # target.DTYPES


ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
            "system": "system"}
SHOW_REASONS = 5  # malformed rows whose reason is logged verbatim; the rest are only counted


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

    def as_dict(self) -> dict:
        return {"source": self.source, "rows_read": self.rows_read, "kept": self.kept, "skipped": self.skipped,
                "skip_reasons": dict(self.reasons), "skip_examples": list(self.examples),
                "truncated_tail": self.truncated_tail, "stopped_early": self.stopped_early,
                "empty_turns": self.empty_turns}


# ----------------------------------------------------------------------------------------------------------- reading

def _open_text(path: Path):
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def iter_json_array(path: Path, stats: LoadStats, chunk_chars: int = 1 << 22) -> Iterator[Any]:
    """Yield the elements of a top-level JSON array, read in chunks of `chunk_chars` characters (4 Mi: a few large
    conversations per chunk). A file cut inside its last element (the packaged ShareGPT file) yields every complete
    element, then sets `stats.truncated_tail`; a file broken elsewhere raises SpecheadsError with line and column."""
    dec = json.JSONDecoder()
    f = _open_text(path)
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

        pos = 0
        while pos < len(buf) and buf[pos].isspace():
            pos += 1
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
                more = f.read(chunk_chars)
                eof = len(more) < chunk_chars
                buf += more
            if pos >= len(buf):  # EOF between elements
                stats.truncated_tail = True
                return
            if buf[pos] == "]":
                return
            if expect_comma:
                if buf[pos] != ",":
                    fail(pos, "expected ',' or ']' between conversations")
                pos += 1
                expect_comma = False
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
                more = f.read(chunk_chars)
                eof = len(more) < chunk_chars
                buf += more
                continue
            yield obj
            pos = end
            expect_comma = True
            if pos > chunk_chars:  # drop consumed text (keeps slicing cost bounded)
                dropped = buf[:pos]
                nl = dropped.count("\n")
                base_col = len(dropped) - dropped.rfind("\n") - 1 if nl else base_col + len(dropped)
                base_newlines += nl
                buf = buf[pos:]
                pos = 0
    finally:
        f.close()


def iter_jsonl(path: Path, stats: LoadStats) -> Iterator[Any]:
    """Yield one object per non-empty line. A first line that is not JSON -> SpecheadsError (the file is not JSONL);
    a later bad line is skipped and counted; a bad last line is reported as a cut tail."""
    with _open_text(path) as f:
        lines = iter(f)
        parsed_any = False
        pending_err: tuple[int, str] | None = None
        for lineno, line in enumerate(lines, 1):
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


def normalize_row(row: Any) -> tuple[str | None, list[dict]]:
    """(id or None, messages[{role, content}]) from a ShareGPT or OpenAI row; raises Malformed(reason)."""
    if not isinstance(row, dict):
        raise Malformed(f"not an object: row is a {type(row).__name__}")
    if "conversations" in row:
        turns, rk, ck = row["conversations"], "from", "value"
    elif "messages" in row:
        turns, rk, ck = row["messages"], "role", "content"
    else:
        raise Malformed(f"missing field: no 'conversations' or 'messages' (keys {sorted(row)[:6]})")
    if not isinstance(turns, list):
        raise Malformed(f"not a list: turns are a {type(turns).__name__}")
    if not turns:
        raise Malformed("empty conversation")
    messages = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise Malformed(f"not an object: turn {i} is a {type(t).__name__}")
        if rk not in t or ck not in t:
            raise Malformed(f"missing field: turn {i} lacks {rk!r} or {ck!r}")
        role, content = t[rk], t[ck]
        if not isinstance(role, str) or role.lower() not in ROLE_MAP:
            raise Malformed(f"unknown role: turn {i} has {rk}={role!r}")
        if not isinstance(content, str):
            raise Malformed(f"non-string value: turn {i} {ck} is a {type(content).__name__}")
        messages.append({"role": ROLE_MAP[role.lower()], "content": content})
    # FastChat/Medusa convention: a conversation that opens with the assistant starts at the first user turn.
    start = 0
    while start < len(messages) and messages[start]["role"] == "assistant":
        start += 1
    messages = messages[start:]
    if not any(m["role"] == "assistant" for m in messages):
        raise Malformed("no assistant turn")
    rid = row.get("id", row.get("conversation_id"))
    return (None if rid is None else str(rid)), messages


def drop_empty_answers(messages: list[dict]) -> tuple[list[dict], int]:
    """Skip each assistant turn whose text is empty or whitespace, with the user turn(s) it answers: kept, it
    would train the head on a sample whose only loss token is the end-of-turn token. -> (messages, skipped)."""
    out: list[dict] = []
    pending: list[dict] = []  # user turns since the last kept answer
    skipped = 0
    for m in messages:
        if m["role"] == "assistant" and not m["content"].strip():
            pending, skipped = [], skipped + 1
        elif m["role"] == "assistant":
            out += pending + [m]
            pending = []
        elif m["role"] == "system" and not out and not pending:
            out.append(m)
        else:
            pending.append(m)
    return out + pending, skipped


def _rows_from_source(source: Any, stats: LoadStats) -> tuple[Iterable[Any], str]:
    """Iterable of raw rows and a short name used for generated ids."""
    from specheads.assets import sharegpt_json

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
        with _open_text(path) as f:  # .json (or anything else): sniff the first character
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

        ds = datasets.load_dataset(str(source), split="train")
    except Exception as e:  # noqa: BLE001 - any hub/offline failure becomes one readable line
        raise SpecheadsError(f"data.source {str(source)!r}: not a file and cannot load it as a hub dataset "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    return iter(ds), str(source).replace("/", "_")


def load_conversations(source: Any = "sharegpt", max_conversations: int | None = None):
    """Read and normalise conversations; returns (datasets.Dataset[conversation_id, messages], LoadStats).

    Reading stops as soon as `max_conversations` valid ones are kept (the 125 MB ShareGPT file is not parsed past
    that). Malformed rows are skipped and counted; the first few reasons are logged."""
    import datasets

    stats = LoadStats()
    rows, stem = _rows_from_source(source, stats)
    ids: list[str] = []
    msgs: list[list[dict]] = []
    seen: dict[str, int] = {}
    for i, row in enumerate(rows):
        if max_conversations is not None and stats.kept >= max_conversations:
            stats.stopped_early = True
            break
        stats.rows_read += 1
        try:
            rid, messages = normalize_row(row)
            messages, empty = drop_empty_answers(messages)
            stats.empty_turns += empty
            if not any(m["role"] == "assistant" for m in messages):
                raise Malformed("empty answers: every assistant turn is empty or whitespace")
        except Malformed as e:
            stats.skip(f"row {i}", str(e))
            continue
        rid = rid if rid is not None else f"{stem}-{i}"
        if rid in seen:  # ids must be unique: resumable regeneration and the val split key on them
            seen[rid] += 1
            rid = f"{rid}~{seen[rid]}"
        else:
            seen[rid] = 0
        ids.append(rid)
        msgs.append(messages)
        stats.kept += 1
    log.info("read %d conversations from %s (%d kept, %d skipped)%s", stats.rows_read, stats.source, stats.kept,
             stats.skipped, "; stopped at max_conversations" if stats.stopped_early else "")
    if stats.truncated_tail:
        log.warning("%s: the file ends inside a row (tail cut); read the %d complete rows before it", stats.source,
                    stats.rows_read)
    if stats.skipped:
        log.warning("skipped %d malformed rows %s; first reasons: %s", stats.skipped, dict(stats.reasons),
                    "; ".join(stats.examples))
    if stats.empty_turns:
        log.warning("skipped %d empty assistant turns (with the user turns they answer)", stats.empty_turns)
    ds = datasets.Dataset.from_dict({"conversation_id": ids, "messages": msgs},
                                    features=_conversation_features())
    return ds, stats


def _conversation_features():
    import datasets

    return datasets.Features({"conversation_id": datasets.Value("string"),
                              "messages": datasets.List({"role": datasets.Value("string"),
                                                         "content": datasets.Value("string")})})


def is_val(conversation_id: str, val_fraction: float) -> bool:
    """Held-out membership from a hash of the id: stable across runs, orders and regeneration."""
    if val_fraction <= 0:
        return False
    h = int.from_bytes(hashlib.sha256(conversation_id.encode()).digest()[:8], "big") / 2.0 ** 64
    return h < val_fraction


# -------------------------------------------------------------------------------------------------------- templates

def _render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _special_tokens(tokenizer) -> list[str]:
    toks = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for t in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(t, "special", False):
            toks.add(str(t.content if hasattr(t, "content") else t))
    return sorted((t for t in toks if t), key=len, reverse=True)


def render_segments(tokenizer, messages: list[dict], specials: list[str] | None = None) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, trained) segments; trained = assistant content + end-of-turn token.
    Raises Malformed when the template does not render prefix-consistently for this conversation."""
    specials = _special_tokens(tokenizer) if specials is None else specials
    segs: list[tuple[str, bool]] = []
    done = ""  # text covered so far
    for i, m in enumerate(messages):
        full = _render(tokenizer, messages[: i + 1])
        if m["role"] != "assistant":
            continue
        gen = _render(tokenizer, messages[:i], add_generation_prompt=True)
        if not gen.startswith(done) or not full.startswith(gen):
            raise Malformed("template not prefix-consistent: cannot locate the assistant turn")
        region = full[len(gen):]
        content = m["content"]
        idx = region.find(content) if content else 0
        if idx < 0 and content.strip():
            content = content.strip()  # templates that trim the message
            idx = region.find(content)
        if idx < 0:
            raise Malformed("template not prefix-consistent: assistant text not found in the rendering")
        suffix = region[idx + len(content):]
        eot = next((s for s in specials if suffix.startswith(s)), "")
        segs.append((gen[len(done):] + region[:idx], False))
        segs.append((content + eot, True))
        done = gen + region[: idx + len(content) + len(eot)]
    tail = _render(tokenizer, messages)
    if not tail.startswith(done):
        raise Malformed("template not prefix-consistent: full rendering differs from its prefixes")
    if len(tail) > len(done):
        segs.append((tail[len(done):], False))
    return [(t, m) for t, m in segs if t]


def tokenize_conversations(conversations, tokenizer, max_length: int, batch_size: int = 64, desc: str = "tokenize"):
    """Conversations -> Dataset[input_ids, loss_mask, conversation_id] (+ stats dict).

    Samples longer than `max_length` are cut; samples whose mask is empty (e.g. the assistant turn starts after the
    cut) are dropped and counted."""
    import datasets

    specials = _special_tokens(tokenizer)
    bad: list[str] = []

    def fn(batch):
        out = {"input_ids": [], "loss_mask": [], "conversation_id": [], "_status": []}
        pieces: list[str] = []
        plan: list[list[tuple[int, bool]] | None] = []
        for cid, msgs in zip(batch["conversation_id"], batch["messages"]):
            try:
                segs = render_segments(tokenizer, msgs, specials)
            except Malformed as e:
                plan.append(None)
                if len(bad) < SHOW_REASONS:
                    bad.append(f"{cid}: {e}")
                continue
            plan.append([(len(pieces) + k, m) for k, (_, m) in enumerate(segs)])
            pieces.extend(t for t, _ in segs)
        enc = tokenizer(pieces, add_special_tokens=False)["input_ids"] if pieces else []
        for cid, p in zip(batch["conversation_id"], plan):
            ids: list[int] = []
            mask: list[int] = []
            if p is not None:
                for k, m in p:
                    ids.extend(enc[k])
                    mask.extend([int(m)] * len(enc[k]))
            status = "template" if p is None else ("ok" if len(ids) <= max_length else "cut")
            ids, mask = ids[:max_length], mask[:max_length]
            if p is not None and not any(mask):
                status = "empty_mask"
            out["input_ids"].append(ids)
            out["loss_mask"].append(mask)
            out["conversation_id"].append(cid)
            out["_status"].append(status)
        return out

    feats = datasets.Features({"input_ids": datasets.List(datasets.Value("int32")),
                               "loss_mask": datasets.List(datasets.Value("int8")),
                               "conversation_id": datasets.Value("string"),
                               "_status": datasets.Value("string")})
    tok = conversations.map(fn, batched=True, batch_size=batch_size, remove_columns=conversations.column_names,
                            features=feats, desc=desc)
    status = collections.Counter(tok["_status"])
    tok = tok.filter(lambda s: s in ("ok", "cut"), input_columns="_status", desc="drop empty").remove_columns("_status")
    lengths = [len(x) for x in tok["input_ids"]]
    masked = sum(sum(m) for m in tok["loss_mask"])
    stats = {"samples": len(tok), "truncated": status["cut"], "dropped_empty_mask": status["empty_mask"],
             "dropped_template": status["template"], "tokens": sum(lengths), "masked_tokens": masked,
             "max_length": max_length}
    if status["empty_mask"]:
        log.info("dropped %d samples whose loss mask was empty after truncation to %d tokens", status["empty_mask"],
                 max_length)
    if bad:
        log.warning("dropped %d conversations the chat template could not split: %s", status["template"],
                    "; ".join(bad))
    return tok, stats


def prepare_tokens(cfg: DataConfig, tokenizer, source: Any = None):
    """load_conversations + tokenize_conversations for a DataConfig; returns (tokens, conversations, stats)."""
    convs, lstats = load_conversations(cfg.source if source is None else source, cfg.max_conversations)
    tok, tstats = tokenize_conversations(convs, tokenizer, cfg.max_length)
    return tok, convs, {"read": lstats.as_dict(), "tokenize": tstats}

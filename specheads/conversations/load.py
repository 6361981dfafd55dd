"""Data sources read into normalised rows: conversations (`load_conversations`) and plain texts (`load_texts`).

What reads a source (sources.py: JSON array, JSONL, hub id, `datasets.Dataset`, the alias `sharegpt`) and turns each
row into a conversation (messages.py: roles, tool calls, reasoning, documents), with nothing of a target or its chat
template: train/data.py tokenises what this returns, prompts.py takes ShareGPT's first user turns from it. Malformed
rows are skipped and counted (`LoadStats`), never fatal; a file that cannot be read is one SpecheadsError naming it.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from specheads.conversations.messages import (CONTEXT_FIELDS, conversation_features, has_answer, parse_turn,
                                              row_context, stored)
from specheads.conversations.sources import LoadStats, Malformed, open_text, rows_from_source
from specheads.utils import SpecheadsError

# the data's lines keep the name they had before this module left train/data.py: a prepare log reads as it did
log = logging.getLogger("specheads.train.data")
MAX_CORPUS_CHARS = 1 << 30  # a data.mode text .txt file is one row read whole: bounded (an endless one is refused)


def normalize_row(row: Any) -> tuple[str | None, list[dict], dict]:
    """(id or None, messages[{role, content, extras}], context {tools?, documents?}) from a ShareGPT or OpenAI row
    (tool and reasoning fields: messages.py); raises Malformed(reason)."""
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
    context = row_context(row)
    messages = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise Malformed(f"not an object: turn {i} is a {type(t).__name__}")
        messages.append(parse_turn(t, i, rk, ck))
        ids = t.get("token_ids")  # a regenerated answer: the target's own tokens (regenerate.py)
        if ids is not None and messages[-1]["role"] == "assistant":
            if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
                raise Malformed(f"bad token_ids: turn {i} token_ids is not a list of integers")
            messages[-1]["token_ids"] = ids
    # FastChat/Medusa convention: a conversation that opens with the assistant starts at the first user turn.
    start = 0
    while start < len(messages) and messages[start]["role"] == "assistant":
        start += 1
    messages = messages[start:]
    if not any(m["role"] == "assistant" for m in messages):
        raise Malformed("no assistant turn")
    rid = row.get("id", row.get("conversation_id"))
    return (None if rid is None else str(rid)), messages, context


def drop_empty_answers(messages: list[dict]) -> tuple[list[dict], int]:
    """Skip each assistant turn whose text is empty or whitespace (and that calls no tool and holds no reasoning),
    with the user turn(s) it answers: kept, it would train the head on a sample whose only loss token is the
    end-of-turn token. -> (messages, skipped)."""
    out: list[dict] = []
    pending: list[dict] = []  # user turns since the last kept answer
    skipped = 0
    for m in messages:
        if m["role"] == "assistant" and not has_answer(m):
            pending, skipped = [], skipped + 1
        elif m["role"] == "assistant":
            out += pending + [m]
            pending = []
        elif m["role"] == "system" and not out and not pending:
            out.append(m)
        else:
            pending.append(m)
    return out + pending, skipped


def load_conversations(source: Any = "sharegpt", max_conversations: int | None = None, **select):
    """Read and normalise conversations; returns (datasets.Dataset[conversation_id, messages, tools?, documents?],
    LoadStats). `select`: split / subset / data_files of a hub dataset (rows_from_source).

    Reading stops as soon as `max_conversations` valid ones are kept (the 125 MB ShareGPT file is not parsed past
    that). Malformed rows are skipped and counted; the first few reasons are logged."""
    import datasets

    stats = LoadStats()
    rows, stem = rows_from_source(source, stats, **select)
    ids: list[str] = []
    msgs: list[list[dict]] = []
    ctxs: list[dict] = []
    seen: dict[str, int] = {}
    for i, row in enumerate(rows):
        if max_conversations is not None and stats.kept >= max_conversations:
            stats.stopped_early = True
            break
        stats.rows_read += 1
        try:
            rid, messages, context = normalize_row(row)
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
        ctxs.append(context)
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
    # the extras some message has (token_ids of regenerated answers, tool calls...) become fields of every message
    msg_fields = {k for ms in msgs for m in ms for k in m} - {"role", "content"}
    ctx_fields = {k for c in ctxs for k in c}
    rows = [stored(ms, cx, msg_fields, ctx_fields) for ms, cx in zip(msgs, ctxs)]
    data = {"conversation_id": ids, "messages": [r[0] for r in rows]}
    data.update({k: [r[1][k] for r in rows] for k in CONTEXT_FIELDS if k in ctx_fields})
    return datasets.Dataset.from_dict(data, features=conversation_features(msg_fields, ctx_fields)), stats

# ------------------------------------------------------------------------------------------------- plain text

def normalize_text_row(row: Any) -> tuple[str | None, str]:
    """(id or None, text) from a row `{"text": ...}`; raises Malformed(reason)."""
    if not isinstance(row, dict):
        raise Malformed(f"not an object: row is a {type(row).__name__}")
    if "text" not in row:
        raise Malformed(f"missing field: no 'text' (keys {sorted(row)[:6]})")
    if not isinstance(row["text"], str):
        raise Malformed(f"non-string value: 'text' is a {type(row['text']).__name__}")
    if not row["text"].strip():
        raise Malformed("empty text")
    rid = row.get("id")
    return (None if rid is None else str(rid)), row["text"]


def load_texts(source: Any, max_texts: int | None = None, **select):
    """Plain texts -> (datasets.Dataset[conversation_id, text], LoadStats). `source`: a .txt file (one text, named
    after the file), JSONL / JSON rows {"text": ..., "id"?}, a hub dataset id or a Dataset with a 'text' column.
    Malformed rows are skipped and counted, as for conversations."""
    import datasets

    stats = LoadStats()
    path = Path(str(source)) if isinstance(source, (str, Path)) else None
    if path is not None and path.name.removesuffix(".gz").endswith(".txt"):
        if select:
            raise SpecheadsError(f"data.sources[{source}].{next(iter(select))}: selects within a hub dataset; this "
                                 f"source is a file")
        if not path.is_file():
            raise SpecheadsError(f"data.source {str(source)!r}: file not found")
        with open_text(path) as f:  # one row, read bounded (a larger corpus: JSONL rows {"text": ...})
            text = f.read(MAX_CORPUS_CHARS + 1)
        if len(text) > MAX_CORPUS_CHARS:
            raise SpecheadsError(f"{path}: more than {MAX_CORPUS_CHARS >> 20} Mi characters in one .txt file (read "
                                 f"no further); split it, or give JSONL rows {{\"text\": ...}}")
        rows, stem = iter([{"id": path.name.removesuffix(".gz").removesuffix(".txt"), "text": text}]), ""
        stats.source = str(path)
    else:
        rows, stem = rows_from_source(source, stats, **select)
    ids: list[str] = []
    texts: list[str] = []
    seen: set[str] = set()
    for i, row in enumerate(rows):
        if max_texts is not None and stats.kept >= max_texts:
            stats.stopped_early = True
            break
        stats.rows_read += 1
        try:
            rid, text = normalize_text_row(row)
        except Malformed as e:
            stats.skip(f"row {i}", str(e))
            continue
        rid = rid if rid is not None else f"{stem}-{i}"
        if rid in seen:  # unique ids: the held-out split and resumable regeneration key on them
            rid = f"{rid}~{i}"
        seen.add(rid)
        ids.append(rid)
        texts.append(text)
        stats.kept += 1
    log.info("read %d texts from %s (%d kept, %d skipped)", stats.rows_read, stats.source, stats.kept, stats.skipped)
    if stats.skipped:
        log.warning("skipped %d malformed rows %s; first reasons: %s", stats.skipped, dict(stats.reasons),
                    "; ".join(stats.examples))
    features = datasets.Features({"conversation_id": datasets.Value("string"), "text": datasets.Value("string")})
    return datasets.Dataset.from_dict({"conversation_id": ids, "text": texts}, features=features), stats

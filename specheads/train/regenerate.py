"""Self-distillation: replace assistant turns with the target's own answers.

`regenerate(target, conversations, out_jsonl, ...)` feeds every conversation's next prompt (its history with the
answers already regenerated) to one continuously refilled decoding batch (`generate_stream`); a conversation is
appended to the JSONL output (one line `{"id", "messages"}`, flushed and fsynced every `batch_size` conversations)
once all its turns are done, so a killed run keeps every finished conversation and a rerun skips their ids (a cut
last line is ignored and rewritten). Each regenerated answer keeps its text (to read) and the ids the target
generated (`token_ids`): tokenisation trains on those ids, since decoding then re-encoding changes tokens (measured:
28 of 190 capped answers came back longer), and a conversation's next prompt is built from them the same way
(`history_prompt_ids`), so the tokens trained on are the tokens the target saw and wrote. `read_regenerated` reads
the file back for prepare (a file written before ids were stored is re-encoded from its text, as before).
A call that appended answers leaves the file in the source's order at its end (`canonical_order`, one atomic
rewrite): conversations finish in an order that depends on the batch, which differs after a kill and a rerun, and
the file's order is the tokens', shards' and so the trained head's order. Sampling (temperature > 0) draws each
answer from a generator of its own, seeded by (seed, conversation id, turn): a resumed run samples what the
uninterrupted one sampled. So a regeneration killed and rerun ends as one uninterrupted run, order included.

Efficiency on CPU: a decode step has a large fixed cost (measured when this loop was written: 63 ms for 8 rows,
187 ms for 64, SmolLM2 bf16, 2 cores), so the batch is kept full: when fewer than `REFILL_BELOW` x batch_size rows
are still decoding, the next waiting prompts are prefilled (one left-padded forward, last position's logits only)
and merged into the live batch, whose cache is left-padded to the longer of the two (RoPE is applied before caching
and positions are given per row, so moving a row's entries right changes nothing). Finished rows are decoded along,
ignored, until `COMPACT_AT` of the batch has finished, then dropped in one copy (cache, mask, positions, and the
cache columns no live row uses).
Cache layers write each step in place (specheads/kvcache.py BufferedLayer). Prompts wait in order of their length
(length bucketing).
Measured once, when it was written: 245 tokens/s against 216 for the chunked loop before it (192 ShareGPT first
turns, bf16, 64 rows; docs/architecture.md).
A conversation stops at the first turn whose prompt already fills `max_length` (what follows would be truncated
away by tokenisation).
Plain text (data.mode text): `regenerate_texts` continues the first data.regen_prefix_tokens tokens of each window
in the same refilled batch and stores token ids (`read_regenerated_texts` reads them back).
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator, Sequence

import torch

from specheads.kvcache import buffered_cache, merge_caches, select_rows
from specheads.target import chat_prompt_ids
from specheads.train.data import (chat_tokenizer, conversation_features, load_conversations, render_segments,
                                  special_tokens, tokenize_texts)
from specheads.train.sources import Malformed
from specheads.utils import SpecheadsError, atomic_write_text, bounded_lines

log = logging.getLogger(__name__)

# Refill the batch when fewer rows than this fraction of batch_size are decoding: a quarter of the batch at a time
# is prefilled beside the live rows (a prefill token costs ~1/5 of a decode token here, so refills are cheap).
REFILL_BELOW = 0.75


@dataclass
class _Batch:
    """The rows decoding together. b rows, L cache columns (left-padded). A finished row stays (key None, its
    tokens ignored) until `compact` drops the finished rows in one copy of the cache."""

    cache: Any  # transformers DynamicCache, [b, heads, L, head_dim] per layer
    mask: torch.Tensor  # [b,L] 1 where the column holds the row's token
    pos: torch.Tensor  # [b] position of the token fed next
    tok: torch.Tensor  # [b] token fed next (already part of its row's answer)
    keys: list  # the work key of each row; None once it has finished

    @property
    def live(self) -> int:
        return sum(k is not None for k in self.keys)

    def compact(self) -> None:
        """Keep the live rows, then cut the leading columns that no kept row uses."""
        rows = [r for r, k in enumerate(self.keys) if k is not None]
        sel = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        self.mask, self.pos, self.tok = self.mask[sel], self.pos[sel], self.tok[sel]
        self.keys = [self.keys[r] for r in rows]
        first = int(self.mask.any(0).int().argmax())  # first column some row uses
        self.mask = self.mask[:, first:]
        select_rows(self.cache, rows, start=first)

    def merge(self, other: "_Batch") -> None:
        """Append other's live rows after dropping both batches' finished ones; the shorter cache is left-padded to
        the longer one's length."""
        for batch in (self, other):
            if batch.live < len(batch.keys):
                batch.compact()
        L = max(self.mask.shape[1], other.mask.shape[1])  # the caches' columns

        def lpad(x: torch.Tensor) -> torch.Tensor:
            return x if x.shape[1] == L else torch.cat([x.new_zeros(x.shape[0], L - x.shape[1]), x], dim=1)

        merge_caches(self.cache, other.cache, len(self.keys), len(other.keys), left_padded=True)
        self.mask = torch.cat([lpad(self.mask), lpad(other.mask)], dim=0)
        self.pos = torch.cat([self.pos, other.pos])
        self.tok = torch.cat([self.tok, other.tok])
        self.keys = self.keys + other.keys


# Drop finished rows (one copy of the cache) once this fraction of the batch has finished: until then they are
# decoded along and ignored (a row adds ~2-3 ms to a ~200 ms step of 64 rows here; a copy costs ~16 ms a layer).
COMPACT_AT = 0.125


@torch.no_grad()
def generate_stream(target, work: deque, batch_size: int, temperature: float = 0.0, top_p: float = 1.0,
                    generator: torch.Generator | None = None, refill_below: float = REFILL_BELOW,
                    seeds: Callable[[Hashable], int] | None = None) -> Iterator[tuple[Hashable, list[int]]]:
    """Continue prompts from `work` (a deque of (key, prompt token ids, max new tokens)) and yield (key, new tokens)
    as each answer ends (an end-of-sequence token, not included, or its cap). At most `batch_size` rows decode
    together; the caller may append to `work` while iterating (e.g. a conversation's next turn). Greedy when
    temperature == 0. refill_below=0 fills the batch only when it is empty (plain batched generation). Sampling
    draws from `generator`, or with `seeds` from one generator per answer seeded `seeds(key)` when it starts (its
    tokens then do not depend on which rows share its batch)."""
    model, dev = target.model, target.device
    eos = set(target.eos_token_ids)
    answers: dict[Hashable, list[int]] = {}
    caps: dict[Hashable, int] = {}
    gens: dict[Hashable, torch.Generator] = {}  # per answer, with `seeds` when sampling
    live: _Batch | None = None
    can_merge = True  # False for sliding-window caches (see kvcache.buffered_cache)

    def advance(batch: _Batch, logits: torch.Tensor) -> list[tuple[Hashable, list[int]]]:
        """Pick each row's next token; rows that end are returned (and compacted away in bulk, see COMPACT_AT)."""
        rows = [gens.get(k) for k in batch.keys] if gens else None
        tok = _pick(logits, temperature, top_p, generator, rows)  # [b]
        done = []
        for r, key in enumerate(batch.keys):
            if key is None:
                continue
            t = int(tok[r])
            if t not in eos:
                answers[key].append(t)
            if t in eos or len(answers[key]) >= caps[key]:
                done.append((key, answers.pop(key)))
                gens.pop(key, None)
                batch.keys[r] = None
        batch.tok = tok
        finished = len(batch.keys) - batch.live
        if finished and (finished >= COMPACT_AT * len(batch.keys) or not batch.live):
            batch.compact()
        return done

    while True:
        b = 0 if live is None else live.live
        if work and (b == 0 or (can_merge and b < refill_below * batch_size)):
            new = [work.popleft() for _ in range(min(batch_size - b, len(work)))]
            T = max(len(p) for _, p, _ in new)
            ids = torch.zeros(len(new), T, dtype=torch.long)
            mask = torch.zeros(len(new), T, dtype=torch.long)
            for r, (key, p, cap) in enumerate(new):  # left padding: every row's next token lands in one column
                ids[r, T - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
                mask[r, T - len(p):] = 1
                answers[key], caps[key] = [], int(cap)
                if seeds is not None and temperature > 0:
                    gens[key] = torch.Generator().manual_seed(seeds(key))
            ids, mask = ids.to(dev), mask.to(dev)
            pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [n,T]
            cache, mergeable = buffered_cache(model)
            can_merge = can_merge and mergeable
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                        logits_to_keep=1)
            fresh = _Batch(cache, mask, pos[:, -1] + 1, pos.new_zeros(len(new)), [k for k, _, _ in new])
            yield from advance(fresh, out.logits[:, -1].float())
            if fresh.live:
                if b == 0:
                    live = fresh
                else:
                    live.merge(fresh)
            continue
        if b == 0:
            return
        live.mask = torch.cat([live.mask, live.mask.new_ones(len(live.keys), 1)], dim=1)
        out = model(input_ids=live.tok[:, None], attention_mask=live.mask, position_ids=live.pos[:, None],
                    cache=live.cache, use_cache=True)
        live.pos = live.pos + 1
        yield from advance(live, out.logits[:, -1].float())


def regenerate_batch(target, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int] | int,
                     temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None
                     ) -> list[list[int]]:
    """Continue each prompt (token ids), all in one batch, until an end-of-sequence token or its own
    `max_new_tokens`. Returns the new tokens per prompt, without the end token. Greedy when temperature == 0.
    (Regeneration's decoder, plain batched; the speculative one is infer/engine/batch.generate_batch.)"""
    B = len(prompts)
    caps = [int(max_new_tokens)] * B if isinstance(max_new_tokens, int) else [int(c) for c in max_new_tokens]
    work = deque((i, p, c) for i, (p, c) in enumerate(zip(prompts, caps)))
    got = dict(generate_stream(target, work, max(B, 1), temperature, top_p, generator, refill_below=0.0))
    return [got[i] for i in range(B)]


def _pick(logits: torch.Tensor, temperature: float, top_p: float, generator, rows=None) -> torch.Tensor:
    """[B] next tokens: argmax, or a sample; `rows`: one generator per row (None for a finished row), each row
    sampled on the CPU from its own."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)  # [B,V]
    if top_p < 1.0:
        sp, si = probs.sort(dim=-1, descending=True)
        cut = sp.cumsum(-1) - sp > top_p
        sp = sp.masked_fill(cut, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, si, sp)
    if rows is None:
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    host = probs.float().cpu()
    picked = [torch.multinomial(host[r], 1, generator=g)[0] if g is not None else host.new_zeros((), dtype=torch.long)
              for r, g in enumerate(rows)]
    return torch.stack(picked).to(logits.device)


def answer_seed(seed: int, key: str, turn: int) -> int:
    """The seed of one sampled answer: (run seed, conversation id, turn), the same in every run and process."""
    import hashlib

    return int.from_bytes(hashlib.sha256(f"{seed}|{key}|{turn}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def canonical_order(path: Path, ids: Sequence[str]) -> None:
    """Rewrite the JSONL `path` (atomically) in the order of `ids` (then any other rows, in file order), when it is
    not in that order: where a kill and a rerun leave the answers in another order than one run does."""
    rows: dict[str, str] = {}
    other: list[str] = []
    with open(path, encoding="utf-8") as f:
        for _, line in bounded_lines(f, path):
            try:
                key = str(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError, TypeError):
                other.append(line)
                continue
            rows.setdefault(key, line)
    ordered = [rows.pop(i) for i in ids if i in rows]
    lines = ordered + list(rows.values()) + other
    if "".join(lines) != path.read_text(encoding="utf-8"):
        atomic_write_text(path, "".join(lines))


def read_done_ids(path: Path) -> set[str]:
    """Ids already in the output JSONL (a cut last line, left by a kill, is ignored)."""
    done: set[str] = set()
    if not path.exists():
        return done
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                done.add(str(json.loads(line)["id"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return done


def _drop_partial_tail(path: Path) -> None:
    """Cut a last line without a newline (a kill mid-write) so that appended rows start on a fresh line."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return
        f.truncate(data.rfind(b"\n") + 1)


class _Answers:
    """The conversations still to answer, their regenerated histories so far, and the JSONL they are written to
    (flushed and fsynced every `sync_every` conversations, so a kill loses at most that many)."""

    def __init__(self, todo: list[dict], tok, f, max_length: int, max_new_tokens: int, max_turns: int | None,
                 sync_every: int, on_done):
        self.todo, self.tok, self.f = todo, tok, f
        self.max_length, self.max_new_tokens, self.max_turns = max_length, max_new_tokens, max_turns
        self.hist: list[list[dict]] = [[] for _ in todo]  # regenerated conversation so far
        self.specials = special_tokens(tok)  # for history_prompt_ids, found once
        self.cursor = [0] * len(todo)  # next source message index to copy
        self.sync_every, self.unsynced, self.on_done = sync_every, 0, on_done

    def queue_next_turn(self, j: int, work: deque) -> bool:
        """Copy the prompts before conversation j's next answer into its history and queue that answer;
        False when the conversation is complete (no more answers, max_turns reached, or no room left)."""
        msgs, hist = self.todo[j]["messages"], self.hist[j]
        while self.cursor[j] < len(msgs) and msgs[self.cursor[j]]["role"] != "assistant":
            m = msgs[self.cursor[j]]
            hist.append({"role": m["role"], "content": m["content"]})
            self.cursor[j] += 1
        if self.cursor[j] >= len(msgs):
            return False
        if self.max_turns is not None and sum(m["role"] == "assistant" for m in hist) >= self.max_turns:
            while hist and hist[-1]["role"] != "assistant":  # drop the unanswered prompt
                hist.pop()
            return False
        ids = history_prompt_ids(self.tok, hist, self.specials)
        room = min(self.max_new_tokens, self.max_length - len(ids))
        if room <= 0:  # the prompt alone fills max_length: later turns would be cut anyway
            return False
        work.append((j, ids, room))
        return True

    def answered(self, j: int, answer: list[int]) -> None:
        self.hist[j].append({"role": "assistant", "content": self.tok.decode(answer, skip_special_tokens=True),
                             "token_ids": [int(t) for t in answer]})
        self.cursor[j] += 1

    def finish(self, j: int) -> None:
        if any(m["role"] == "assistant" for m in self.hist[j]):
            self.f.write(json.dumps({"id": self.todo[j]["conversation_id"], "messages": self.hist[j]},
                                    ensure_ascii=False) + "\n")
            self.unsynced += 1
        self.hist[j] = []  # written: free it
        self.on_done()
        if self.unsynced >= self.sync_every:
            self.sync()

    def sync(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.unsynced = 0


def history_prompt_ids(tok, hist: list[dict], specials: list[str]) -> list[int]:
    """The prompt for the answer after `hist` (which ends with a user turn): the segments tokenize_conversations
    trains on (earlier answers as the ids the target generated), then the generation prompt, so the prompt equals
    the training tokens before this answer. The first turn is chat_prompt_ids; so is a template that cannot be split
    (tokenisation drops such a conversation anyway)."""
    if not any(m["role"] == "assistant" for m in hist):
        return chat_prompt_ids(tok, hist)
    try:
        segs = render_segments(tok, hist, specials, add_generation_prompt=True)
    except Malformed:
        return chat_prompt_ids(tok, hist)
    ids: list[int] = []
    for t, _ in segs:
        ids += t if isinstance(t, list) else tok(t, add_special_tokens=False)["input_ids"]
    return [int(i) for i in ids]


def read_regenerated(path: str | os.PathLike, wanted: set[str], keep=None):
    """The conversations `wanted` from a `regenerate` file, then `keep` (conversations that keep the source's
    replies) -> (Dataset[conversation_id, messages], LoadStats of the file). Answers without token_ids (a file
    written before they were stored) are re-encoded from their text at tokenisation; one log line counts them."""
    import datasets

    regen, stats = load_conversations(str(path))
    regen = regen.filter(lambda c: c in wanted, input_columns="conversation_id", desc="select regenerated")
    answers = [m for ms in regen["messages"] for m in ms if m["role"] == "assistant"]
    old = sum(m.get("token_ids") is None for m in answers)
    if old:
        log.info("%s: %d of %d regenerated answers carry no token ids (written by an older version): their text is "
                 "re-encoded, which can change their tokens", path, old, len(answers))
    if keep is None:
        return regen, stats
    parts = [regen, keep]
    if regen.features != keep.features:  # one side carries token_ids: give the other None ids
        parts = [p if "token_ids" in p.features["messages"].feature else _with_no_ids(p) for p in parts]
    return datasets.concatenate_datasets(parts), stats


def _with_no_ids(convs):
    return convs.map(lambda ms: {"messages": [dict(m, token_ids=None) for m in ms]}, input_columns="messages",
                     features=conversation_features(with_ids=True), desc="align columns")


def _first_prompt_chars(row: dict) -> int:
    """Characters before the first answer (they approximate tokens well enough to sort by length)."""
    msgs = row["messages"]
    i = next((k for k, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs))
    return sum(len(m["content"]) for m in msgs[:i])


def regenerate(target, conversations, out_path: str | os.PathLike, max_length: int = 2048,
               max_new_tokens: int = 512, batch_size: int = 32, temperature: float = 0.0, top_p: float = 1.0,
               seed: int = 0, progress: bool = True, max_turns: int | None = None) -> dict:
    """Regenerate every conversation's assistant turns into `out_path` (JSONL); resumable by conversation id.
    `conversations`: Dataset/list with conversation_id and messages. `max_turns`: keep only the first N exchanges
    (1 = single-turn samples). Returns stats (tokens generated, tokens/s)."""
    from tqdm.auto import tqdm

    tok = chat_tokenizer(target.tokenizer, None, target.name)  # one clear error when there is no template
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    _drop_partial_tail(out_path)
    done = read_done_ids(out_path)
    rows = [{"conversation_id": c["conversation_id"], "messages": c["messages"]} for c in conversations]
    todo = sorted((r for r in rows if r["conversation_id"] not in done), key=_first_prompt_chars)  # length buckets
    stats = {"conversations": len(rows), "already_done": len(rows) - len(todo), "regenerated": 0,
             "new_tokens": 0, "seconds": 0.0}
    log.info("regenerate: %d conversations (%d already in %s), %s, max %d new tokens per answer, %d rows decoding",
             len(rows), stats["already_done"], out_path, "greedy" if temperature <= 0 else f"T={temperature}",
             max_new_tokens, batch_size)
    bar = tqdm(total=len(todo), unit="conv", desc="regenerate", disable=not progress)
    t0, work = time.perf_counter(), deque()
    with open(out_path, "a", encoding="utf-8") as f:
        answers = _Answers(todo, tok, f, max_length, max_new_tokens, max_turns, batch_size, lambda: bar.update(1))
        for j in range(len(todo)):
            if not answers.queue_next_turn(j, work):
                answers.finish(j)
        def seeds(j: int) -> int:  # this answer's own stream: its conversation and turn
            turn = sum(m["role"] == "assistant" for m in answers.hist[j])
            return answer_seed(seed, str(todo[j]["conversation_id"]), turn)

        for j, answer in generate_stream(target, work, batch_size, temperature, top_p, seeds=seeds):
            answers.answered(j, answer)
            stats["new_tokens"] += len(answer)
            if not answers.queue_next_turn(j, work):
                answers.finish(j)
        answers.sync()
    bar.close()
    if todo:  # answers were appended in the batch's order: put the file in the source's, as one run leaves it
        canonical_order(out_path, [str(r["conversation_id"]) for r in rows])
    stats["regenerated"] = len(todo)
    stats["seconds"] = round(time.perf_counter() - t0, 3)
    stats["tokens_per_s"] = round(stats["new_tokens"] / stats["seconds"], 1) if stats["seconds"] > 0 else 0.0
    log.info("regenerate: %d new tokens in %.1f s (%.0f tokens/s)", stats["new_tokens"], stats["seconds"],
             stats["tokens_per_s"])
    return stats


# ------------------------------------------------------------------------------------------------- plain text

def regenerate_texts(target, samples, out_path: str | os.PathLike, prefix_tokens: int, max_length: int = 2048,
                     max_new_tokens: int = 512, batch_size: int = 32, temperature: float = 0.0, top_p: float = 1.0,
                     seed: int = 0, progress: bool = True) -> dict:
    """data.mode text: keep the first `prefix_tokens` tokens of each sample (Dataset[conversation_id, input_ids])
    as the prompt and let the target continue it, up to max_length tokens in all, in one refilled batch
    (`generate_stream`). Appends `{"id", "input_ids" (prompt + continuation), "prompt_tokens", "text"}` lines to
    `out_path`, fsynced every `batch_size` samples; resumable by id. The end-of-sequence token that stops an answer
    is not kept (generate_stream drops it). Returns the same stats as `regenerate`."""
    from tqdm.auto import tqdm

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    _drop_partial_tail(out_path)
    done = read_done_ids(out_path)
    rows = [(c, list(ids)[:prefix_tokens]) for c, ids in zip(samples["conversation_id"], samples["input_ids"])]
    todo = [r for r in rows if r[0] not in done]
    todo.sort(key=lambda r: len(r[1]))  # equal prompt lengths batch together (little left padding)
    work = deque((j, p, min(max_new_tokens, max_length - len(p))) for j, (_, p) in enumerate(todo))
    stats = {"conversations": len(rows), "already_done": len(rows) - len(todo), "regenerated": 0, "new_tokens": 0,
             "seconds": 0.0}
    log.info("regenerate text: %d samples (%d already in %s), prompts of %d tokens, %s", len(rows),
             stats["already_done"], out_path, prefix_tokens, "greedy" if temperature <= 0 else f"T={temperature}")
    bar = tqdm(total=len(todo), unit="sample", desc="regenerate", disable=not progress)
    t0 = time.perf_counter()
    with open(out_path, "a", encoding="utf-8") as f:
        for j, answer in generate_stream(target, work, batch_size, temperature, top_p,
                                         seeds=lambda j: answer_seed(seed, str(todo[j][0]), 0)):
            cid, prompt = todo[j]
            ids = prompt + [int(t) for t in answer]
            f.write(json.dumps({"id": cid, "input_ids": ids, "prompt_tokens": len(prompt),
                                "text": target.tokenizer.decode(ids)}, ensure_ascii=False) + "\n")
            stats["regenerated"] += 1
            stats["new_tokens"] += len(answer)
            bar.update(1)
            if stats["regenerated"] % batch_size == 0:
                f.flush()
                os.fsync(f.fileno())
        f.flush()
        os.fsync(f.fileno())
    bar.close()
    if todo:  # as regenerate: the source's order, whatever order the batch finished in
        canonical_order(out_path, [str(c) for c, _ in rows])
    stats["seconds"] = round(time.perf_counter() - t0, 3)
    stats["tokens_per_s"] = round(stats["new_tokens"] / stats["seconds"], 1) if stats["seconds"] > 0 else 0.0
    return stats


def read_regenerated_texts(path: str | os.PathLike, ids: Sequence[str]):
    """The samples `ids` (in that order) from a regenerate_texts file -> Dataset[input_ids, loss_mask (all 1),
    conversation_id]. A cut or malformed line is skipped; a missing id is an error (the run did not finish)."""
    import datasets

    got: dict[str, list[int]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
                got[str(row["id"])] = [int(t) for t in row["input_ids"]]
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
    missing = [i for i in ids if i not in got]
    if missing:
        raise SpecheadsError(f"{path}: no regenerated sample for {len(missing)} ids (first {missing[0]!r}); rerun "
                             "prepare to finish the regeneration")
    feats = datasets.Features({"input_ids": datasets.List(datasets.Value("int32")),
                               "loss_mask": datasets.List(datasets.Value("int8")),
                               "conversation_id": datasets.Value("string")})
    return datasets.Dataset.from_dict({"input_ids": [got[i] for i in ids],
                                       "loss_mask": [[1] * len(got[i]) for i in ids],
                                       "conversation_id": list(ids)}, features=feats)


def text_tokens(cfg, target, texts, data_dir: Path, max_length: int, seed: int = 0,
                progress: bool = True, regen_target=None):
    """data.mode text: windows of the texts, and with data.regenerate the target's own continuation of each
    window's first data.regen_prefix_tokens tokens (the first data.regen_conversations windows when set; the rest
    keep the source). `regen_target()`: the target that regenerates (data.regen_dtype), called only when some
    window is not yet in the output. Returns (tokens Dataset, tokenize stats, summary fields of the regeneration)."""
    import datasets

    tokens, stats = tokenize_texts(texts, target.tokenizer, max_length)
    if not cfg.regenerate:
        return tokens, stats, {}

    n = len(tokens) if cfg.regen_conversations is None else min(cfg.regen_conversations, len(tokens))
    todo = tokens.select(range(n))
    keep = tokens.select(range(n, len(tokens))) if n < len(tokens) else None
    path = Path(data_dir) / "regenerated-text.jsonl"
    missing = set(todo["conversation_id"]) - read_done_ids(path)
    gen = regen_target() if missing and regen_target is not None else target
    rstats = regenerate_texts(gen, todo, path, prefix_tokens=cfg.regen_prefix_tokens, max_length=max_length,
                              max_new_tokens=cfg.regen_max_new_tokens, batch_size=cfg.regen_batch_size,
                              temperature=cfg.regen_temperature, top_p=cfg.regen_top_p, seed=seed, progress=progress)
    regen = read_regenerated_texts(path, todo["conversation_id"])
    tokens = regen if keep is None else datasets.concatenate_datasets([regen, keep])
    n_tokens = sum(len(x) for x in tokens["input_ids"])
    stats = dict(stats, samples=len(tokens), tokens=n_tokens, masked_tokens=n_tokens)
    return tokens, stats, {"regenerated_conversations": n, "source_reply_conversations": len(tokens) - n,
                           "regenerated_new_tokens": rstats["new_tokens"],
                           "regenerate_tokens_per_s": rstats["tokens_per_s"]}

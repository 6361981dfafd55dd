"""Self-distillation: replace assistant turns with the target's own answers.

`regenerate(target, conversations, out_jsonl, ...)` has the target answer every conversation's turns through the
engine's own plain decoding (`decode_answers`: the drafter that drafts nothing, `build_drafter(target, "plain")`):
- batch_size 1, or a target with sliding-window layers: the one-row loop (infer/engine/generate.generate), which
  runs the target's own forward path (engine/runner.runner_for: the owned forward where the architecture is
  supported, compiled on a bf16 CPU target or a CUDA one; the HF forward otherwise); each answer ends on its own;
- batch_size > 1: the batched loop (infer/engine/batch.generate_batch, the HF forward) with batch_size rows; a
  finished row leaves and the next waiting prompt joins.
Greedy output equals HF generate's greedy output in fp32 on either path (tests/test_regenerate.py).
Conversations go to the engine in groups (`GROUP_ROWS` x batch_size, in order of their first prompt's length:
length bucketing); a group's answers are decoded in waves, one turn of every conversation still open a wave (a
conversation's next prompt is its history with the answers already regenerated). A conversation is appended to the
JSONL output (one line `{"id", "messages"}`, flushed and fsynced every `batch_size` conversations) once all its
turns are done, so a killed run keeps every finished conversation and a rerun skips their ids (a cut last line is
ignored and rewritten); a kill loses at most the group being decoded. Each regenerated answer keeps its text (to
read) and the ids the target generated (`token_ids`): tokenisation trains on those ids, since decoding then
re-encoding changes tokens (measured: 28 of 190 capped answers came back longer), and a conversation's next prompt
is built from them the same way (`history_prompt_ids`), so the tokens trained on are the tokens the target saw and
wrote. `read_regenerated` reads the file back for prepare (a file written before ids were stored is re-encoded from
its text, as before).
A call that appended answers leaves the file in the source's order at its end (`canonical_order`, one atomic
rewrite): conversations finish in an order that depends on the batch, which differs after a kill and a rerun, and
the file's order is the tokens', shards' and so the trained head's order. Sampling (temperature > 0, top_p as HF
generate applies it: infer/verify.target_probs) draws each answer from a generator of its own, seeded by
(seed, conversation id, turn) (`answer_seed`): its tokens do not depend on the rows it shares a batch with, so a
resumed run samples what the uninterrupted one sampled. So a regeneration killed and rerun ends as one
uninterrupted run, order included.
The end-of-sequence token that stops an answer is not kept; an answer is capped at max_new_tokens and at what is
left of max_length after its prompt. A conversation stops at the first turn whose prompt already fills
`max_length` (what follows would be truncated away by tokenisation), or that the template cannot render.
Agentic data: only assistant text turns are rewritten (`regenerated_turn`); a tool-call turn is kept as the source
wrote it (its tool results answer that call), and tool results, `loss: false` turns, the conversation's `tools` and
`documents` stay as context, rendered with data.chat_template_kwargs (the tokenizer carries them).
A serving engine (data.regen_endpoint: train/regen_endpoint.py) can answer instead of the engine: the same file,
seeds and order, the conversations sent in source order and written in it (`_Answers` writes in todo's order).
Plain text (data.mode text): `regenerate_texts` continues the first data.regen_prefix_tokens tokens of each window
the same way and stores token ids (`read_regenerated_texts` reads them back).
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Callable, Hashable, Iterator, Sequence

from specheads.conversations.load import load_conversations
from specheads.conversations.messages import align, context_kwargs, row_message
from specheads.conversations.sources import Malformed
from specheads.infer.drafters.build import build_drafter
from specheads.infer.engine.batch import generate_batch
from specheads.infer.engine.generate import generate
from specheads.kvcache import buffered_cache
from specheads.train.data import chat_tokenizer, render_segments, render_text, special_tokens, tokenize_texts
from specheads.train.regen_endpoint import EndpointDecoder, EndpointSettings
from specheads.utils import SpecheadsError, atomic_write_text, bounded_lines

log = logging.getLogger(__name__)

# Conversations per engine call, in multiples of batch_size: the batched loop refills its rows from the group's
# waiting prompts and drains at the group's end; a kill loses at most the group being decoded.
GROUP_ROWS = 8

Work = tuple[Hashable, list[int], int, int]  # (key, prompt token ids, max new tokens, sampling seed)


def one_row(target, batch_size: int) -> bool:
    """Whether regeneration decodes one row at a time (the engine's one-row loop): batch_size 1, or a target with
    sliding-window layers (the batched loop cannot share columns between rows of different lengths)."""
    return batch_size <= 1 or not buffered_cache(target.model)[1]


def decoding_path(target, batch_size: int) -> str:
    """What the log line says runs."""
    if one_row(target, batch_size):
        why = "" if batch_size <= 1 else f" (sliding-window layers: batch_size {batch_size} not used)"
        return f"the engine's one-row loop, the target's own forward path{why}"
    return f"the engine's batched loop, {batch_size} rows, HF forward"


def decode_answers(target, work: Sequence[Work], batch_size: int, temperature: float = 0.0, top_p: float = 1.0
                   ) -> Iterator[tuple[Hashable, list[int]]]:
    """Continue every (key, prompt ids, max new tokens, seed) of `work` by the target's plain decoding through the
    engine and yield (key, new tokens without the end-of-sequence token that stopped them). Greedy at temperature
    0; sampling draws each answer from a generator seeded with its own seed. One-row loop (`one_row`): each answer
    is yielded as it ends; batched loop: batch_size rows, the answers in work's order once all have ended."""
    eos = set(target.eos_token_ids)
    plain = lambda: build_drafter(target, "plain")  # noqa: E731 (one drafter per row)

    def stripped(ids: list[int], reason: str) -> list[int]:
        return ids[:-1] if reason == "eos" and ids and ids[-1] in eos else list(ids)

    if one_row(target, batch_size):
        for key, prompt, cap, seed in work:
            res = generate(target, plain(), input_ids=list(prompt), max_new_tokens=int(cap),
                           temperature=temperature, top_p=top_p, seed=seed)
            yield key, stripped(res.ids, res.stats.stop_reason)
        return
    if not work:
        return
    res = generate_batch(target, plain, [list(p) for _, p, _, _ in work], [int(c) for _, _, c, _ in work],
                         batch_size=batch_size, temperature=temperature, top_p=top_p, seed=[s for *_, s in work])
    for (key, *_), row in zip(work, res.rows):
        yield key, stripped(row.ids, row.stats.stop_reason)


def answer_in_groups(target, n: int, begin: Callable[[int, list], None],
                     answered: Callable[[int, list[int], list], None], batch_size: int, temperature: float = 0.0,
                     top_p: float = 1.0, decode=None) -> None:
    """Answer items 0..n-1 in groups of GROUP_ROWS x batch_size: `begin(j, work)` appends item j's first Work (or
    nothing: it is already complete); `answered(j, answer, work)` takes its answer and may append its next Work (a
    conversation's next turn), decoded in the group's next wave. `decode(wave, temperature, top_p)`: who answers
    (None: our engine, decode_answers; an endpoint: train/regen_endpoint.EndpointDecoder)."""
    if decode is None:
        decode = lambda wave, t, p: decode_answers(target, wave, batch_size, t, p)  # noqa: E731
    size = GROUP_ROWS * max(batch_size, 1)
    for lo in range(0, n, size):
        work: list[Work] = []
        for j in range(lo, min(lo + size, n)):
            begin(j, work)
        while work:
            wave, work = work, []
            for j, answer in decode(wave, temperature, top_p):
                answered(j, answer, work)


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
    (flushed and fsynced every `sync_every` conversations, so a kill loses at most that many). `begin` and
    `answered` are answer_in_groups' callbacks; `seed` seeds each sampled answer (answer_seed). Conversations are
    written in todo's order (one that finishes early waits for those before it, at most a group: they all finish
    by its end); `meta(j)`: fields recorded in conversation j's row (an endpoint's regenerated_by)."""

    def __init__(self, todo: list[dict], tok, f, max_length: int, max_new_tokens: int, max_turns: int | None,
                 sync_every: int, on_done, seed: int = 0, meta: Callable[[int], dict] | None = None):
        self.todo, self.tok, self.f, self.seed = todo, tok, f, seed
        self.max_length, self.max_new_tokens, self.max_turns = max_length, max_new_tokens, max_turns
        self.hist: list[list[dict]] = [[] for _ in todo]  # regenerated conversation so far
        self.specials = special_tokens(tok)  # for history_prompt_ids, found once
        self.cursor = [0] * len(todo)  # next source message index to copy
        self.sync_every, self.unsynced, self.on_done = sync_every, 0, on_done
        self.meta, self.waiting, self.next_out = meta, {}, 0  # finished rows not yet written; next index to write

    def begin(self, j: int, work: list) -> None:
        """Queue conversation j's first answer, or write it out when it has none to give."""
        if not self.queue_next_turn(j, work):
            self.finish(j)

    def answered(self, j: int, answer: list[int], work: list) -> None:
        """Keep conversation j's answer, then queue its next turn or write it out."""
        self.hist[j].append({"role": "assistant", "content": self.tok.decode(answer, skip_special_tokens=True),
                             "token_ids": [int(t) for t in answer]})
        self.cursor[j] += 1
        self.begin(j, work)

    def queue_next_turn(self, j: int, work: list) -> bool:
        """Copy the prompts before conversation j's next answer into its history and queue that answer;
        False when the conversation is complete (no more answers, max_turns reached, or no room left)."""
        msgs, hist = self.todo[j]["messages"], self.hist[j]
        while self.cursor[j] < len(msgs) and not regenerated_turn(msgs[self.cursor[j]]):
            hist.append(source_message(msgs[self.cursor[j]]))  # a prompt, tool result or kept tool call
            self.cursor[j] += 1
        if self.cursor[j] >= len(msgs):
            return False
        if self.max_turns is not None and sum(m["role"] == "assistant" for m in hist) >= self.max_turns:
            while hist and hist[-1]["role"] != "assistant":  # drop the unanswered prompt
                hist.pop()
            return False
        ids = history_prompt_ids(self.tok, hist, self.specials, self.todo[j]["context"])
        room = 0 if ids is None else min(self.max_new_tokens, self.max_length - len(ids))
        if room <= 0:  # the prompt alone fills max_length (later turns would be cut anyway), or cannot be rendered
            return False
        turn = sum(m["role"] == "assistant" for m in hist)  # this answer's own stream: its conversation and turn
        work.append((j, ids, room, answer_seed(self.seed, str(self.todo[j]["conversation_id"]), turn)))
        return True

    def finish(self, j: int) -> None:
        line = None
        if any(m["role"] == "assistant" for m in self.hist[j]):
            extra = {"regenerated_by": self.meta(j)} if self.meta else {}
            line = json.dumps({"id": self.todo[j]["conversation_id"], "messages": self.hist[j],
                               **self.todo[j]["context"], **extra}, ensure_ascii=False) + "\n"
        self.hist[j] = []  # kept as its line: free it
        self.waiting[j] = line
        while self.next_out in self.waiting:  # todo's order
            line = self.waiting.pop(self.next_out)
            self.next_out += 1
            if line is not None:
                self.f.write(line)
                self.unsynced += 1
        self.on_done()
        if self.unsynced >= self.sync_every:
            self.sync()

    def sync(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.unsynced = 0


def regenerated_turn(m: dict) -> bool:
    """Whether the target rewrites this source turn: an assistant text turn. A tool-call turn is kept as the source
    wrote it (the tool results after it answer that call; a different call would not match them), and so is a turn
    flagged `loss: false` (context); tool results, user and system turns are always kept."""
    return m["role"] == "assistant" and not m.get("tool_calls") and m.get("loss") is not False


def source_message(m: dict) -> dict:
    """A source turn copied into a regenerated conversation (row form: what normalize_row reads back)."""
    out = row_message(m)
    out.pop("token_ids", None)
    return out


def history_prompt_ids(tok, hist: list[dict], specials: list[str], context: dict | None = None) -> list[int] | None:
    """The prompt for the answer after `hist` (which ends with a user turn or a tool result): the segments
    tokenize_conversations trains on (earlier answers as the ids the target generated), then the generation
    prompt, so the prompt equals the training tokens before this answer; `context`: the conversation's tools= /
    documents=. A first turn, or a template that cannot be split (tokenisation drops such a conversation anyway), is
    the template's plain text tokenised (as target.chat_prompt_ids); None when the template cannot render it."""
    try:
        if not any(m["role"] == "assistant" for m in hist):
            segs = [(render_text(tok, hist, True, context), False)]
        else:
            try:
                segs = render_segments(tok, hist, specials, add_generation_prompt=True, context=context)
            except Malformed:
                segs = [(render_text(tok, hist, True, context), False)]
    except Malformed:
        return None
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
    return datasets.concatenate_datasets(align([regen, keep])), stats  # one side may lack token_ids, tool fields


def stop_ids(target, tok) -> list[int]:
    """The ids that end an answer on a server: the target's end-of-sequence ids and the tokenizer's special ones
    (a server may stop on an end-of-turn token its GGUF marks end-of-generation)."""
    return sorted(set(int(t) for t in target.eos_token_ids) | set(int(t) for t in (tok.all_special_ids or [])))


def _first_prompt_chars(row: dict) -> int:
    """Characters before the first answer (they approximate tokens well enough to sort by length)."""
    msgs = row["messages"]
    i = next((k for k, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs))
    return sum(len(m["content"]) for m in msgs[:i])


def regenerate(target, conversations, out_path: str | os.PathLike, max_length: int = 2048,
               max_new_tokens: int = 512, batch_size: int = 32, temperature: float = 0.0, top_p: float = 1.0,
               seed: int = 0, progress: bool = True, max_turns: int | None = None, endpoint=None) -> dict:
    """Regenerate every conversation's assistant turns into `out_path` (JSONL); resumable by conversation id.
    `conversations`: Dataset/list with conversation_id and messages. `max_turns`: keep only the first N exchanges
    (1 = single-turn samples). `batch_size`: the batched loop's rows (1 = the one-row loop; see the module
    docstring) and the conversations between two fsyncs. `endpoint` (regen_endpoint.EndpointSettings): a serving
    engine answers instead (conversations in source order, no length buckets: the server batches them itself);
    `target` then only lends its tokenizer and end-of-sequence ids. Returns stats (tokens generated, tokens/s)."""
    from tqdm.auto import tqdm

    tok = chat_tokenizer(target.tokenizer, None, target.name)  # one clear error when there is no template (the
    # tokenizer prepare gives it carries data.chat_template and data.chat_template_kwargs already)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    _drop_partial_tail(out_path)
    done = read_done_ids(out_path)
    rows = [{"conversation_id": c["conversation_id"], "messages": c["messages"], "context": context_kwargs(c)}
            for c in conversations]
    todo = [r for r in rows if r["conversation_id"] not in done]
    if endpoint is None:
        todo.sort(key=_first_prompt_chars)  # length buckets for our batched loop
    stats = {"conversations": len(rows), "already_done": len(rows) - len(todo), "regenerated": 0,
             "new_tokens": 0, "seconds": 0.0}
    log.info("regenerate: %d conversations (%d already in %s), %s, max %d new tokens per answer, %s",
             len(rows), stats["already_done"], out_path, "greedy" if temperature <= 0 else f"T={temperature}",
             max_new_tokens, endpoint.describe() if endpoint else decoding_path(target, batch_size))
    bar = tqdm(total=len(todo), unit="conv", desc="regenerate", disable=not progress)
    t0 = time.perf_counter()
    with open(out_path, "a", encoding="utf-8") as f:
        answers = _Answers(todo, tok, f, max_length, max_new_tokens, max_turns, batch_size, lambda: bar.update(1),
                           seed)
        decode = None
        if endpoint is not None:
            decode = EndpointDecoder(endpoint, tok, stop_ids(target, tok), lambda j: answers.hist[j],
                                     lambda j: todo[j]["context"])
            answers.meta = decode.row_meta

        def answered(j: int, answer: list[int], work: list) -> None:
            stats["new_tokens"] += len(answer)
            answers.answered(j, answer, work)

        answer_in_groups(target, len(todo), answers.begin, answered, batch_size, temperature, top_p, decode)
        answers.sync()
    bar.close()
    # answers were appended in the batch's order: put the file in the source's, as one run leaves it; also when
    # this call appended nothing (a run stopped between its last append and this rewrite left the batch's order)
    canonical_order(out_path, [str(r["conversation_id"]) for r in rows])
    stats["regenerated"] = len(todo)
    stats["seconds"] = round(time.perf_counter() - t0, 3)
    stats["tokens_per_s"] = round(stats["new_tokens"] / stats["seconds"], 1) if stats["seconds"] > 0 else 0.0
    log.info("regenerate: %d new tokens in %.1f s (%.0f tokens/s)", stats["new_tokens"], stats["seconds"],
             stats["tokens_per_s"])
    return stats


# ------------------------------------------------------------------------------------------- several processes

def part_path(out_path: Path, rank: int) -> Path:
    """Rank `rank`'s own answers file beside `out_path` (several processes: ranks.py)."""
    return out_path.with_name(f"{out_path.name}.part-{rank}")


def merge_regenerated_parts(out_path: Path, ids: Sequence[str]) -> None:
    """Rank 0: the whole lines of every `<out>.part-R` file (a cut last line, left by a kill, is skipped) whose id
    `out_path` lacks are appended to it, the file is put in `ids`' order (canonical_order, as one process leaves
    it), then the part files are removed. Parts of a run with another number of processes merge the same way."""
    parts = sorted(out_path.parent.glob(f"{out_path.name}.part-*"))
    if not parts:
        return
    _drop_partial_tail(out_path)
    done, lines = read_done_ids(out_path), []
    for p in parts:
        with open(p, encoding="utf-8") as f:
            for _, line in bounded_lines(f, p):
                try:
                    key = str(json.loads(line)["id"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue
                if line.endswith("\n") and key not in done:
                    done.add(key)
                    lines.append(line)
    with open(out_path, "a", encoding="utf-8") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
    canonical_order(out_path, ids)
    for p in parts:
        p.unlink(missing_ok=True)


def regenerate_ranked(fn: Callable, ranks, target, rows, out_path: str | os.PathLike, **kw) -> dict:
    """`fn` (regenerate or regenerate_texts) over `rows` (a Dataset with conversation_id) into `out_path`; with
    several processes (`ranks`, ranks.py) rank r answers the rows i % world == r not yet in `out_path` into its
    part file, and rank 0 merges them in source order after a barrier (the file one process writes). Returns the
    stats, new tokens summed over ranks."""
    out_path = Path(out_path)
    ids = [str(c) for c in rows["conversation_id"]]
    if ranks.main:  # what a killed run of any number of processes left
        merge_regenerated_parts(out_path, ids)
    ranks.barrier()
    if not ranks.multi:
        return fn(target, rows, out_path, **kw)
    done = read_done_ids(out_path)
    mine = [i for i in ranks.mine(len(ids)) if ids[i] not in done]
    stats = fn(target, rows.select(mine), part_path(out_path, ranks.rank), **kw)
    ranks.barrier()
    if ranks.main:
        merge_regenerated_parts(out_path, ids)
    every = ranks.gather(stats)
    total = dict(stats, new_tokens=sum(s["new_tokens"] for s in every),
                 regenerated=sum(s["regenerated"] for s in every), seconds=max(s["seconds"] for s in every))
    total["tokens_per_s"] = round(total["new_tokens"] / total["seconds"], 1) if total["seconds"] > 0 else 0.0
    return total


# ------------------------------------------------------------------------------------------------- plain text

def regenerate_texts(target, samples, out_path: str | os.PathLike, prefix_tokens: int, max_length: int = 2048,
                     max_new_tokens: int = 512, batch_size: int = 32, temperature: float = 0.0, top_p: float = 1.0,
                     seed: int = 0, progress: bool = True, endpoint=None) -> dict:
    """data.mode text: keep the first `prefix_tokens` tokens of each sample (Dataset[conversation_id, input_ids])
    as the prompt and let the target continue it, up to max_length tokens in all, through the engine as
    `regenerate` does (`answer_in_groups`, `batch_size` rows). Appends `{"id", "input_ids" (prompt + continuation),
    "prompt_tokens", "text"}` lines to `out_path`, fsynced every `batch_size` samples; resumable by id. The
    end-of-sequence token that stops an answer is not kept. `endpoint`: a server's completions api continues the
    prompts instead (rows add regenerated_by). Returns the same stats as `regenerate`."""
    from tqdm.auto import tqdm

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    _drop_partial_tail(out_path)
    done = read_done_ids(out_path)
    rows = [(c, list(ids)[:prefix_tokens]) for c, ids in zip(samples["conversation_id"], samples["input_ids"])]
    todo = [r for r in rows if r[0] not in done]
    decode = None
    if endpoint is None:
        todo.sort(key=lambda r: len(r[1]))  # equal prompt lengths batch together (little padding)
    else:
        decode = EndpointDecoder(endpoint, target.tokenizer, stop_ids(target, target.tokenizer))
    stats = {"conversations": len(rows), "already_done": len(rows) - len(todo), "regenerated": 0, "new_tokens": 0,
             "seconds": 0.0}
    log.info("regenerate text: %d samples (%d already in %s), prompts of %d tokens, %s, %s", len(rows),
             stats["already_done"], out_path, prefix_tokens, "greedy" if temperature <= 0 else f"T={temperature}",
             endpoint.describe() if endpoint else decoding_path(target, batch_size))
    bar = tqdm(total=len(todo), unit="sample", desc="regenerate", disable=not progress)
    t0 = time.perf_counter()
    with open(out_path, "a", encoding="utf-8") as f:
        def begin(j: int, work: list) -> None:
            cid, prompt = todo[j]
            work.append((j, prompt, min(max_new_tokens, max_length - len(prompt)), answer_seed(seed, str(cid), 0)))

        def answered(j: int, answer: list[int], work: list) -> None:
            cid, prompt = todo[j]
            ids = prompt + [int(t) for t in answer]
            extra = {"regenerated_by": decode.row_meta(j)} if decode else {}
            f.write(json.dumps({"id": cid, "input_ids": ids, "prompt_tokens": len(prompt),
                                "text": target.tokenizer.decode(ids), **extra}, ensure_ascii=False) + "\n")
            stats["regenerated"] += 1
            stats["new_tokens"] += len(answer)
            bar.update(1)
            if stats["regenerated"] % batch_size == 0:
                f.flush()
                os.fsync(f.fileno())

        answer_in_groups(target, len(todo), begin, answered, batch_size, temperature, top_p, decode)
        f.flush()
        os.fsync(f.fileno())
    bar.close()
    canonical_order(out_path, [str(c) for c, _ in rows])  # as regenerate: the source's order, whatever order the
    # batch finished in (also when this call appended nothing: a run stopped before this rewrite left the batch's)
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
                progress: bool = True, regen_target=None, ranks=None):
    """data.mode text: windows of the texts, and with data.regenerate the target's own continuation of each
    window's first data.regen_prefix_tokens tokens (the first data.regen_conversations windows when set; the rest
    keep the source). `regen_target()`: the target that regenerates (data.regen_dtype), called only when some
    window is not yet in the output. `ranks`: several processes share the windows (regenerate_ranked). Returns (tokens Dataset, tokenize stats, summary fields of the regeneration)."""
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
    from specheads.train.ranks import Ranks

    rstats = regenerate_ranked(regenerate_texts, ranks or Ranks(), gen, todo, path,
                              prefix_tokens=cfg.regen_prefix_tokens, max_length=max_length,
                              max_new_tokens=cfg.regen_max_new_tokens, batch_size=cfg.regen_batch_size,
                              temperature=cfg.regen_temperature, top_p=cfg.regen_top_p, seed=seed, progress=progress,
                              endpoint=EndpointSettings.from_data(cfg) if cfg.regen_endpoint else None)
    regen = read_regenerated_texts(path, todo["conversation_id"])
    tokens = regen if keep is None else datasets.concatenate_datasets([regen, keep])
    n_tokens = sum(len(x) for x in tokens["input_ids"])
    stats = dict(stats, samples=len(tokens), tokens=n_tokens, masked_tokens=n_tokens)
    return tokens, stats, {"regenerated_conversations": n, "source_reply_conversations": len(tokens) - n,
                           "regenerated_new_tokens": rstats["new_tokens"],
                           "regenerate_tokens_per_s": rstats["tokens_per_s"]}

"""Self-distillation: replace assistant turns with the target's own answers.

`regenerate(target, conversations, out_jsonl, ...)` walks the conversations in chunks of `batch_size`; inside a chunk
the k-th assistant turn of every conversation is generated in one left-padded batch (round k), with the history
holding the answers already regenerated. A conversation is appended to the JSONL output (one line
`{"id", "messages"}`, flushed and fsynced per chunk) once all its turns are done, so a killed run keeps every
finished conversation and a rerun skips their ids (a cut last line is ignored and rewritten).

Efficiency on CPU (measured in scripts/bench_features.py): conversations are sorted by their first prompt's length
so a chunk pads little (length bucketing); the decode loop is our own greedy/sampling loop over a DynamicCache that
removes finished rows from the batch (cache, mask and positions) instead of computing padding to the end, and asks
the model for the last position's logits only. A conversation stops at the first turn whose prompt already fills
`max_length` (what follows would be truncated away by tokenisation).
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from specheads.target import chat_prompt_ids
from specheads.utils import SpecheadsError

log = logging.getLogger(__name__)


@torch.no_grad()
def generate_batch(target, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int] | int,
                   temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None
                   ) -> list[list[int]]:
    """Continue each prompt (token ids) until an end-of-sequence token or its own `max_new_tokens`.
    Returns the new tokens per prompt, without the end token. Greedy when temperature == 0."""
    from transformers import DynamicCache

    model = target.model
    dev = target.device
    B = len(prompts)
    caps = [int(max_new_tokens)] * B if isinstance(max_new_tokens, int) else [int(c) for c in max_new_tokens]
    eos = set(target.eos_token_ids)
    results: list[list[int]] = [[] for _ in range(B)]
    if B == 0:
        return results
    T = max(len(p) for p in prompts)
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, p in enumerate(prompts):  # left padding: every row's next token lands in the same column
        ids[b, T - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        mask[b, T - len(p):] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [B,T]
    cache = DynamicCache(config=model.config)
    ck = _cache_kw(model)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, **{ck: cache}, use_cache=True,
                logits_to_keep=1)
    logits = out.logits[:, -1].float()  # [B,V]
    next_pos = pos[:, -1] + 1  # [B]
    active = list(range(B))  # original row of each live batch row
    while True:
        tok = _pick(logits, temperature, top_p, generator)  # [b]
        keep = []
        for r, row in enumerate(active):
            t = int(tok[r])
            if t in eos:
                continue
            results[row].append(t)
            if len(results[row]) < caps[row]:
                keep.append(r)
        if not keep:
            break
        if len(keep) < len(active):  # drop finished rows from the batch
            sel = torch.tensor(keep, device=dev)
            cache.reorder_cache(sel)
            mask, tok, next_pos = mask[sel], tok[sel], next_pos[sel]
            active = [active[r] for r in keep]
        mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                    **{ck: cache}, use_cache=True)
        logits = out.logits[:, -1].float()
        next_pos = next_pos + 1
    return results


def _cache_kw(model) -> str:
    """transformers >= 5.24 names the cache argument `cache` (`past_key_values` is deprecated)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _pick(logits: torch.Tensor, temperature: float, top_p: float, generator) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)  # [B,V]
    if top_p < 1.0:
        sp, si = probs.sort(dim=-1, descending=True)
        cut = sp.cumsum(-1) - sp > top_p
        sp = sp.masked_fill(cut, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, si, sp)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


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


def regenerate(target, conversations, out_path: str | os.PathLike, max_length: int = 2048,
               max_new_tokens: int = 512, batch_size: int = 32, temperature: float = 0.0, top_p: float = 1.0,
               seed: int = 0, progress: bool = True, max_turns: int | None = None) -> dict:
    """Regenerate every conversation's assistant turns into `out_path` (JSONL); resumable by conversation id.
    `conversations`: Dataset/list with conversation_id and messages. `max_turns`: keep only the first N exchanges
    (1 = single-turn samples: one full batch round per chunk instead of several shrinking ones).
    Returns stats (tokens generated, tokens/s)."""
    from tqdm.auto import tqdm

    tok = target.tokenizer
    if tok is None or getattr(tok, "chat_template", None) is None:
        raise SpecheadsError(f"target {target.name}: regenerate needs a tokenizer with a chat template")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    _drop_partial_tail(out_path)
    done = read_done_ids(out_path)
    rows = [{"conversation_id": c["conversation_id"], "messages": c["messages"]} for c in conversations]
    todo = [r for r in rows if r["conversation_id"] not in done]
    gen = torch.Generator().manual_seed(seed)

    def first_prompt_len(r):
        i = next((k for k, m in enumerate(r["messages"]) if m["role"] == "assistant"), len(r["messages"]))
        return sum(len(m["content"]) for m in r["messages"][:i])

    todo.sort(key=first_prompt_len)  # length bucketing (characters approximate tokens well enough to sort)
    stats = {"conversations": len(rows), "already_done": len(rows) - len(todo), "regenerated": 0,
             "new_tokens": 0, "seconds": 0.0}
    log.info("regenerate: %d conversations (%d already in %s), %s, max %d new tokens per answer",
             len(rows), stats["already_done"], out_path, "greedy" if temperature <= 0 else f"T={temperature}",
             max_new_tokens)
    bar = tqdm(total=len(todo), unit="conv", desc="regenerate", disable=not progress)
    t0 = time.perf_counter()
    with open(out_path, "a", encoding="utf-8") as f:
        for c0 in range(0, len(todo), batch_size):
            chunk = todo[c0: c0 + batch_size]
            hist: list[list[dict]] = [[] for _ in chunk]  # regenerated conversation so far
            cursor = [0] * len(chunk)  # next message index to copy
            live = list(range(len(chunk)))
            while live:
                prompts, caps, who = [], [], []
                for j in live:
                    msgs = chunk[j]["messages"]
                    while cursor[j] < len(msgs) and msgs[cursor[j]]["role"] != "assistant":
                        hist[j].append(dict(msgs[cursor[j]]))
                        cursor[j] += 1
                    if cursor[j] >= len(msgs):
                        continue
                    if max_turns is not None and sum(m["role"] == "assistant" for m in hist[j]) >= max_turns:
                        while hist[j] and hist[j][-1]["role"] != "assistant":  # drop the unanswered prompt
                            hist[j].pop()
                        cursor[j] = len(msgs)
                        continue
                    ids = chat_prompt_ids(tok, hist[j])
                    room = min(max_new_tokens, max_length - len(ids))
                    if room <= 0:  # the prompt alone fills max_length: later turns would be cut anyway
                        cursor[j] = len(msgs)
                        continue
                    prompts.append(ids)
                    caps.append(room)
                    who.append(j)
                if not who:
                    break
                order = sorted(range(len(who)), key=lambda k: len(prompts[k]))  # bucket within the round
                answers = generate_batch(target, [prompts[k] for k in order], [caps[k] for k in order],
                                         temperature, top_p, gen)
                for k, a in zip(order, answers):
                    j = who[k]
                    hist[j].append({"role": "assistant", "content": tok.decode(a, skip_special_tokens=True)})
                    cursor[j] += 1
                    stats["new_tokens"] += len(a)
                live = who
            for j, c in enumerate(chunk):
                if any(m["role"] == "assistant" for m in hist[j]):
                    f.write(json.dumps({"id": c["conversation_id"], "messages": hist[j]}, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
            stats["regenerated"] += len(chunk)
            bar.update(len(chunk))
    bar.close()
    stats["seconds"] = round(time.perf_counter() - t0, 3)
    stats["tokens_per_s"] = round(stats["new_tokens"] / stats["seconds"], 1) if stats["seconds"] > 0 else 0.0
    log.info("regenerate: %d new tokens in %.1f s (%.0f tokens/s)", stats["new_tokens"], stats["seconds"],
             stats["tokens_per_s"])
    return stats

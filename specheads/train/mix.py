"""`data.sources`: several sources mixed into one set of conversations (or texts), deterministically.

Each entry (sources.SourceSpec) is read on its own: at most `limit` valid conversations; `split`, `subset` (a
configuration name) and `data_files` select within a hub dataset. Its conversation ids are prefixed with its name
(`name:id`; the name is the entry's `name`, else the file's stem or the hub id's last part, `-2`... when two
entries would share one), so ids are unique across sources and stay the same when the list is reordered (the
held-out split and the regeneration cache key on them). Then its weight w: every conversation floor(w) times and a
seeded share w - floor(w) of them once more (0.5 = a seeded half, 2.0 = each twice); a repeat's id ends `~repK`
and is held out with its original (data.is_val), never trained on while its original is evaluated. The union is
shuffled with the recipe's seed and data.max_conversations cuts it. `load_mixed` also returns one summary row per
source, which prepare records in prepare_summary.json under "sources".
"""
from __future__ import annotations

import logging
import math
import random
from pathlib import Path
from typing import Callable

from specheads.conversations.messages import align
from specheads.conversations.sources import SHOW_REASONS, LoadStats, SourceSpec

log = logging.getLogger(__name__)


def source_name(spec: SourceSpec, taken: set[str]) -> str:
    """The id prefix of one entry: its `name`, else from its source (and subset / split), unique among `taken`."""
    if spec.name:
        base = spec.name
    else:
        base = Path(spec.source).name.removesuffix(".gz")
        for ext in (".jsonl", ".json", ".txt"):
            base = base.removesuffix(ext)
        base += "".join(f"-{v}" for v in (spec.subset, spec.split) if v)
        base = base.replace(":", "_") or "source"
    name, k = base, 1
    while name in taken:
        k += 1
        name = f"{base}-{k}"
    return name


def weighted(n: int, weight: float, seed: int, name: str) -> list[tuple[int, int]]:
    """(row, repeat) pairs for `n` rows at `weight`: each row floor(weight) times, a seeded share of the fraction
    once more (rows in their source order within each repeat)."""
    whole = math.floor(weight)
    extra = round((weight - whole) * n)
    picks = sorted(random.Random(f"{seed}|{name}").sample(range(n), min(extra, n)))
    return [(i, r) for r in range(whole) for i in range(n)] + [(i, whole) for i in picks]


def load_mixed(specs: list[SourceSpec], loader: Callable, seed: int, max_total: int | None = None):
    """Read every entry with `loader` (conversations.load_conversations or load_texts), weight, prefix, shuffle and
    cut -> (Dataset, LoadStats of them all, [summary row per source])."""
    import datasets

    parts, rows, names = [], [], set()
    total = LoadStats(source=" + ".join(s.source for s in specs))
    for spec in specs:
        name = source_name(spec, names)
        names.add(name)
        select = {k: getattr(spec, k) for k in ("split", "subset", "data_files") if getattr(spec, k) is not None}
        ds, st = loader(spec.source, spec.limit, **select)
        picks = weighted(len(ds), spec.weight, seed, name)
        ds = ds.select([i for i, _ in picks])
        reps = [r for _, r in picks]
        ds = ds.map(lambda cid, k: {"conversation_id": f"{name}:{cid}" + (f"~rep{reps[k]}" if reps[k] else "")},
                    input_columns="conversation_id", with_indices=True, desc=f"ids of {name}")
        parts.append(ds)
        _merge(total, st, name)
        rows.append({"name": name, "source": st.source, "weight": spec.weight, "limit": spec.limit, **select,
                     "read": st.rows_read, "kept": st.kept, "skipped": st.skipped, "taken": len(ds),
                     "tail_cut": st.truncated_tail})
    if "messages" in parts[0].column_names:
        parts = align(parts)  # one source with tool calls or token ids: the others get those fields as None
    mixed = datasets.concatenate_datasets(parts)
    mixed = mixed.select(random.Random(seed).sample(range(len(mixed)), len(mixed)))
    if max_total is not None and len(mixed) > max_total:
        mixed, total.stopped_early = mixed.select(range(max_total)), True
    total.kept = len(mixed)
    counts: dict[str, int] = {}
    for cid in mixed["conversation_id"]:
        counts[cid.split(":", 1)[0]] = counts.get(cid.split(":", 1)[0], 0) + 1
    for r in rows:
        r["in_mix"] = counts.get(r["name"], 0)
    log.info("data.sources: %s", ", ".join(f"{r['name']} {r['in_mix']} (weight {r['weight']})" for r in rows))
    return mixed, total, rows


def _merge(total: LoadStats, st: LoadStats, name: str) -> None:
    total.rows_read += st.rows_read
    total.skipped += st.skipped
    total.reasons.update(st.reasons)
    total.examples += [f"{name}: {e}" for e in st.examples][: SHOW_REASONS - len(total.examples)]
    total.truncated_tail |= st.truncated_tail
    total.stopped_early |= st.stopped_early
    total.empty_turns += st.empty_turns

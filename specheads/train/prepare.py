"""`specheads prepare`: conversations -> (optional regenerate) -> tokens + assistant masks -> target features.

Writes under `recipe.output_dir`:
    data/regenerated.jsonl   the target's own answers (data.regenerate: true), resumable by conversation id
    data/regenerated-text.jsonl  data.mode text: the target's continuations of each window's prefix (token ids)
    data/tokens/             datasets.Dataset (input_ids, loss_mask, conversation_id), saved atomically
    features/                offline shards + manifest.json (features.mode: offline), resumable
    prepare_config.yaml      the resolved recipe
    prepare_summary.json     counts, sizes and timings (also printed as a table)
Every step is resumable or cheap to redo: rerunning after a kill continues the features where they stopped.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

from specheads.utils import SpecheadsError, atomic_dir, atomic_write_json

log = logging.getLogger(__name__)


def _du(path: Path) -> int:
    if not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def feature_layers_for(recipe, num_layers: int) -> list[int]:
    """features.layers if set, else head.feature_layers, else the head kind's default; layer L always added."""
    from specheads.train.features import resolve_layers

    layers = recipe.features.layers if recipe.features.layers is not None else recipe.head.feature_layers
    return resolve_layers(num_layers, layers, recipe.head.kind)


def features_dir(recipe) -> Path:
    """Where the offline features are: features.dir, or <output_dir>/features."""
    return Path(recipe.features.dir) if recipe.features.dir else Path(recipe.output_dir) / "features"


def _prepare_shared(recipe, target=None) -> dict:
    """features.dir names another recipe's finished features: check them, extract nothing (data is theirs)."""
    from specheads.config import save_config
    from specheads.target import load_target
    from specheads.train.features import check_shared_features

    out = Path(recipe.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_config(recipe, out / "prepare_config.yaml")
    if target is None:
        target = load_target(recipe.target.name, dtype=recipe.target.dtype,
                             trust_remote_code=recipe.target.trust_remote_code)
    layers = feature_layers_for(recipe, target.num_layers)
    m = check_shared_features(recipe.features.dir, target, layers)
    log.info("features: reusing %s (layers %s; this head reads %s); data.* is that recipe's", recipe.features.dir,
             m["layers"], layers)
    summary = {"output_dir": str(out), "target": target.name, "feature_mode": "offline",
               "features_dir": str(recipe.features.dir), "feature_layers": layers, "shared_layers": m["layers"],
               "shards": len(m["shards"]), "features_complete": True, "features_bytes": m.get("bytes", 0),
               "samples": m.get("num_samples"), "tokens": m.get("num_tokens"),
               "masked_tokens": m.get("num_masked_tokens")}
    atomic_write_json(out / "prepare_summary.json", summary)
    return summary


def prepare(recipe, target=None, progress: bool = True, after_shard=None) -> dict:
    """Run the whole preparation for a Recipe; returns the summary (also written to prepare_summary.json)."""
    import datasets

    from specheads.config import save_config
    from specheads.target import load_target
    from specheads.train.data import (check_mode_settings, chat_tokenizer, load_conversations, load_texts, text_tokens,
                                      tokenize_conversations)
    from specheads.train.features import write_features

    t_start = time.perf_counter()
    if not progress:
        datasets.disable_progress_bars()
    out = Path(recipe.output_dir)
    data_dir, feat_dir = out / "data", features_dir(recipe)
    dc = recipe.data
    if recipe.features.dir and recipe.features.mode == "offline":
        return _prepare_shared(recipe, target)
    if dc.max_length < 2:
        raise SpecheadsError(f"data.max_length: must be at least 2, got {dc.max_length}")
    if dc.max_conversations is not None and dc.max_conversations < 1:
        raise SpecheadsError(f"data.max_conversations: must be >= 1 or null, got {dc.max_conversations}")
    if dc.regen_conversations is not None and dc.regen_conversations < 1:
        raise SpecheadsError(f"data.regen_conversations: must be >= 1 or null, got {dc.regen_conversations}")
    if dc.regen_conversations is not None and not dc.regenerate:
        raise SpecheadsError("data.regen_conversations: set, but data.regenerate is false (nothing to regenerate)")
    if not 0.0 <= dc.val_fraction < 1.0:
        raise SpecheadsError(f"data.val_fraction: must be in [0, 1), got {dc.val_fraction}")
    check_mode_settings(dc)
    timings: dict[str, float] = {}
    data_dir.mkdir(parents=True, exist_ok=True)
    save_config(recipe, out / "prepare_config.yaml")

    t = time.perf_counter()  # data first: a bad source fails before the target is loaded
    text = dc.mode == "text"
    convs, lstats = (load_texts if text else load_conversations)(dc.source, dc.max_conversations)
    timings["read_s"] = time.perf_counter() - t
    if len(convs) == 0:
        hint = "" if text else "; plain-text rows {\"text\": ...} need data.mode=text"
        raise SpecheadsError(f"data.source {dc.source!r}: no usable {'text' if text else 'conversation'} "
                             f"({lstats.skipped} malformed rows; first reasons: {'; '.join(lstats.examples) or 'none'}"
                             f"){hint}")

    t = time.perf_counter()
    if target is None:
        target = load_target(recipe.target.name, dtype=recipe.target.dtype,
                             trust_remote_code=recipe.target.trust_remote_code)
    if target.tokenizer is None:
        raise SpecheadsError(f"target {target.name}: has no tokenizer (needed to tokenize data.source)")
    tokenizer = target.tokenizer if text else chat_tokenizer(target.tokenizer, dc.chat_template, target.name)
    timings["load_target_s"] = time.perf_counter() - t
    max_length = dc.max_length
    if target.max_positions and max_length > target.max_positions:
        log.warning("data.max_length %d > the target's %d positions; using %d", max_length, target.max_positions,
                    target.max_positions)
        max_length = target.max_positions

    summary: dict[str, Any] = {"output_dir": str(out), "target": target.name, "source": lstats.source,
                               "conversations_read": lstats.rows_read, "conversations_skipped": lstats.skipped,
                               "conversations_kept": lstats.kept, "skip_reasons": dict(lstats.reasons),
                               "source_tail_cut": lstats.truncated_tail}

    if dc.regenerate and not text:
        from specheads.train.regenerate import read_done_ids, regenerate

        t = time.perf_counter()
        regen_path = data_dir / "regenerated.jsonl"
        keep = None  # conversations past data.regen_conversations keep the source's replies
        if dc.regen_conversations is not None and dc.regen_conversations < len(convs):
            keep = convs.select(range(dc.regen_conversations, len(convs)))
            convs = convs.select(range(dc.regen_conversations))
        gen_target = target
        # a copy in data.regen_dtype only when some answer is still missing (a finished rerun skips the load)
        todo = set(convs["conversation_id"]) - read_done_ids(regen_path)
        if todo and dc.regen_dtype and dc.regen_dtype != recipe.target.dtype:
            gen_target = load_target(recipe.target.name, dtype=dc.regen_dtype,
                                     trust_remote_code=recipe.target.trust_remote_code)
        gen_target = dataclasses.replace(gen_target, tokenizer=tokenizer)  # with data.chat_template if given
        rstats = regenerate(gen_target, convs, regen_path, max_length=max_length, max_new_tokens=dc.regen_max_new_tokens,
                            batch_size=dc.regen_batch_size, temperature=dc.regen_temperature, top_p=dc.regen_top_p,
                            seed=recipe.seed, progress=progress, max_turns=dc.regen_max_turns)
        del gen_target
        wanted = set(convs["conversation_id"])
        regen, _ = load_conversations(str(regen_path))
        convs = regen.filter(lambda c: c in wanted, input_columns="conversation_id", desc="select regenerated")
        if keep is not None:
            convs = datasets.concatenate_datasets([convs, keep])  # same columns: both from load_conversations
        timings["regenerate_s"] = time.perf_counter() - t
        summary.update({"regenerated_conversations": len(wanted),
                        "source_reply_conversations": 0 if keep is None else len(keep),
                        "regenerated_new_tokens": rstats["new_tokens"],
                        "regenerate_tokens_per_s": rstats["tokens_per_s"]})

    t = time.perf_counter()
    if text:  # windows of the texts (and their regeneration); timings["regenerate_s"] is inside tokenize_s here
        def regen_target():
            if dc.regen_dtype and dc.regen_dtype != recipe.target.dtype:
                return load_target(recipe.target.name, dtype=dc.regen_dtype,
                                   trust_remote_code=recipe.target.trust_remote_code)
            return target

        tokens, tstats, rsummary = text_tokens(dc, target, convs, data_dir, max_length, recipe.seed, progress,
                                               regen_target)
        summary.update(rsummary)
    else:
        tokens, tstats = tokenize_conversations(convs, tokenizer, max_length)
    with atomic_dir(data_dir / "tokens") as tmp:
        tokens.save_to_disk(str(tmp))
    tokens = datasets.load_from_disk(str(data_dir / "tokens"))
    timings["tokenize_s"] = time.perf_counter() - t
    summary.update({"samples": tstats["samples"], "samples_truncated": tstats["truncated"],
                    "dropped_empty_mask": tstats["dropped_empty_mask"], "dropped_template": tstats["dropped_template"],
                    "tokens": tstats["tokens"], "masked_tokens": tstats["masked_tokens"], "max_length": max_length})
    if tstats["samples"] == 0:
        raise SpecheadsError(f"data: every sample was dropped (empty loss mask after truncation to {max_length} "
                             f"tokens); raise data.max_length")

    layers = feature_layers_for(recipe, target.num_layers)
    summary["feature_layers"] = layers
    summary["feature_mode"] = recipe.features.mode
    if recipe.features.mode == "offline":
        t = time.perf_counter()
        manifest = write_features(target, tokens, feat_dir, layers, recipe.features, val_fraction=dc.val_fraction,
                                  progress=progress, after_shard=after_shard)
        timings["features_s"] = time.perf_counter() - t
        summary.update({"shards": len(manifest["shards"]), "features_complete": manifest["complete"],
                        "features_bytes": manifest.get("bytes", 0)})
    summary["disk_bytes"] = _du(data_dir) + _du(feat_dir)
    timings["total_s"] = time.perf_counter() - t_start
    summary["timings"] = {k: round(v, 2) for k, v in timings.items()}
    atomic_write_json(out / "prepare_summary.json", summary)
    return summary


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_summary(s: dict) -> str:
    if "features_dir" in s:  # features.dir: another recipe's extraction, nothing prepared here
        return _box([("features", f"shared from {s['features_dir']}"), ("samples", s["samples"]),
                     ("tokens", s["tokens"]), ("feature layers", f"{s['feature_layers']} of {s['shared_layers']}"),
                     ("output", s["output_dir"])])
    rows = [("conversations read", s["conversations_read"]),
            ("conversations skipped", f"{s['conversations_skipped']} {s.get('skip_reasons') or ''}".strip()),
            ("source tail cut", "yes" if s.get("source_tail_cut") else "no")]
    if "regenerated_new_tokens" in s:
        rows += [("regenerated tokens", s["regenerated_new_tokens"]),
                 ("regenerate tokens/s", s["regenerate_tokens_per_s"])]
    rows += [("samples", s["samples"]), ("samples truncated", s["samples_truncated"]),
             ("dropped (empty mask)", s["dropped_empty_mask"]), ("tokens", s["tokens"]),
             ("masked tokens", f"{s['masked_tokens']} ({100 * s['masked_tokens'] / max(1, s['tokens']):.1f}%)"),
             ("feature layers", f"{s['feature_layers']} ({s['feature_mode']})")]
    if "shards" in s:
        rows.append(("shards", f"{s['shards']}{'' if s['features_complete'] else ' (incomplete)'}"))
    rows += [("disk used", _human_bytes(s["disk_bytes"])), ("wall time", f"{s['timings']['total_s']:.1f} s"),
             ("output", s["output_dir"])]
    return _box(rows)


def _box(rows: list[tuple[str, object]]) -> str:
    """Two aligned columns between dashed lines."""
    w = max(len(k) for k, _ in rows)
    line = "-" * (w + 2 + max(len(str(v)) for _, v in rows))
    return "\n".join([line] + [f"{k:<{w}}  {v}" for k, v in rows] + [line])

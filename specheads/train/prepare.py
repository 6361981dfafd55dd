"""`specheads prepare`: conversations -> (optional regenerate) -> tokens + assistant masks -> target features.

Writes under `recipe.output_dir`:
    data/regenerated.jsonl   the target's own answers (data.regenerate: true; text and token ids), resumable by id
    data/regenerated-text.jsonl  data.mode text: the target's continuations of each window's prefix (token ids)
    data/tokens/             datasets.Dataset (input_ids, loss_mask, conversation_id), saved atomically
    features/                offline shards + manifest.json (features.mode: offline), resumable, then the
                             target sidecars (targets-NNNNN.safetensors: greedy token + full-vocab logsumexp per
                             token, from the stored layer-L states; also added to a folder that lacks them)
    prepare_config.yaml      the resolved recipe
    prepare_summary.json     counts, sizes and timings (also printed as a table)
Every step is resumable or cheap to redo: rerunning after a kill continues the features where they stopped.
With features.dir (another recipe's folder) prepare checks it and adds the target sidecars it lacks there.
"""
from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import datasets

from specheads.config import save_config
from specheads.conversations.load import load_conversations, load_texts
from specheads.train.checkpoint import CKPT_DIR, FINISHED
from specheads.train.data import chat_tokenizer, tokenize_conversations
from specheads.train.features import plan_features, write_features
from specheads.train.mix import load_mixed
from specheads.train.layout import OVERWRITE_HINT, check_split, feature_layers_for, features_dir
from specheads.target import where_target_runs
from specheads.train.regen_endpoint import EndpointSettings
from specheads.train.ranks import Ranks, check_shared_folder, ranks_from_env
from specheads.train.regenerate import read_done_ids, read_regenerated, regenerate, regenerate_ranked, text_tokens
from specheads.train.shards import check_features_folder, check_shared_features, verify_features
from specheads.target_parts import write_features_record
from specheads.train.teacher import write_target_sidecars
from specheads.utils import SpecheadsError, atomic_dir, atomic_write_json

log = logging.getLogger(__name__)


def _du(path: Path) -> int:
    if not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _load_target(recipe, target=None, dtype: str | None = None, ranks: Ranks | None = None):
    """The recipe's target (target.device_map and dtype; with several processes each rank's own device)."""
    from specheads.target import load_target

    if target is not None:
        return target
    ranks = ranks or Ranks()
    return load_target(recipe.target.name, dtype=dtype or recipe.target.dtype,
                       trust_remote_code=recipe.target.trust_remote_code, device_map=recipe.target.device_map,
                       rank=(ranks.local_rank, ranks.local_world) if ranks.multi else None)


def _prepare_shared(recipe, target=None, verify: bool = False, progress: bool = True, ranks: Ranks | None = None
                    ) -> dict:
    """features.dir names another recipe's finished features: check them, extract nothing (data is theirs)."""
    out, ranks = Path(recipe.output_dir), ranks or Ranks()
    target = _load_target(recipe, target, ranks=ranks)
    layers = feature_layers_for(recipe, target.num_layers)
    m = check_shared_features(recipe.features.dir, target, layers)  # checked before anything is written
    t = time.perf_counter()
    m = write_target_sidecars(target, recipe.features.dir, progress=progress, verify=verify, ranks=ranks)
    targets_s = time.perf_counter() - t
    if ranks.main:
        write_features_record(target, Path(recipe.features.dir))
    bad = verify_features(recipe.features.dir) if verify and ranks.main else []
    if bad:
        raise SpecheadsError(f"features.dir {recipe.features.dir}: {bad} differ from the manifest's sha256; run "
                             f"`specheads prepare --verify` on the recipe that writes that folder")
    log.info("features: reusing %s (layers %s; this head reads %s); data.* is that recipe's", recipe.features.dir,
             m["layers"], layers)
    if not ranks.main:
        return {}
    out.mkdir(parents=True, exist_ok=True)
    save_config(recipe, out / "prepare_config.yaml")
    summary = {"output_dir": str(out), "target": target.name, "feature_mode": "offline",
               "features_dir": str(recipe.features.dir), "feature_layers": layers, "shared_layers": m["layers"],
               "shards": len(m["shards"]), "features_complete": True, "features_bytes": m.get("bytes", 0),
               "samples": m.get("num_samples"), "tokens": m.get("num_tokens"),
               "masked_tokens": m.get("num_masked_tokens"), "target_sidecars": _sidecar_count(m),
               "timings": {"targets_s": round(targets_s, 2)}}
    atomic_write_json(out / "prepare_summary.json", summary)
    return summary


def _sidecar_count(manifest: dict) -> int:
    return sum(1 for s in manifest["shards"] if (s.get("targets") or {}).get("shard_sha256") == s["sha256"])


def prepare(recipe, target=None, progress: bool = True, after_shard=None, verify: bool = False,
            overwrite: bool = False, ranks: Ranks | None = None) -> dict:
    """Run the whole preparation for a Recipe; returns the summary (also written to prepare_summary.json).

    Checks come first: a refused run (bad source, features of other data, another split, target or layers, tokens
    of other data) leaves the run folder as it was. Only the regeneration cache (data/regenerated.jsonl, keyed by
    conversation id) grows before the final check, which needs the regenerated answers. `verify`: re-hash listed
    shards (--verify). `overwrite` (--overwrite): remove what an earlier prepare wrote here first (never in a folder
    holding a trained run).

    Under torchrun / accelerate launch (`ranks`, default from the environment: ranks.py) every rank reads and
    tokenises the same data, regenerates and extracts its own share (round-robin by conversation and by shard) and
    rank 0 alone writes the tokens, manifests and summary, after barriers; the folder is what one process writes
    (docs/training.md, "Several processes, GPUs and machines"). Ranks on other rank's summaries return {}."""
    if not progress:
        datasets.disable_progress_bars()
    ranks = ranks or ranks_from_env()
    check_shared_folder(ranks, Path(recipe.output_dir))  # before any rank reads or writes there
    if recipe.features.dir and recipe.features.mode == "offline":
        return _prepare_shared(recipe, target, verify, progress, ranks)
    t_start = time.perf_counter()
    out, dc = Path(recipe.output_dir), recipe.data
    data_dir, feat_dir = out / "data", features_dir(recipe)
    timings: dict[str, float] = {}
    convs, summary = _read_source(recipe, timings)  # data first: a bad source fails before the target is loaded
    t = time.perf_counter()
    target = _load_target(recipe, target, ranks=ranks)
    if target.tokenizer is None:
        raise SpecheadsError(f"target {target.name}: has no tokenizer (needed to tokenize data.source)")
    if dc.mode == "chat":  # data.chat_template, or one clear error for a target without a template
        target = dataclasses.replace(target, tokenizer=chat_tokenizer(target.tokenizer, dc.chat_template,
                                                                       target.name, dc.chat_template_kwargs))
    timings["load_target_s"] = time.perf_counter() - t
    offline = recipe.features.mode == "offline"
    if overwrite and ranks.main:
        remove_prepared(out)
    ranks.barrier()
    if offline:
        check_features_folder(feat_dir, target=target)  # another target's features: refused before regenerating
        check_split(feat_dir, dc.val_fraction)
    max_length = dc.max_length
    if target.max_positions and max_length > target.max_positions:
        log.warning("data.max_length %d > the target's %d positions; using %d", max_length, target.max_positions,
                    target.max_positions)
        max_length = target.max_positions
    summary.update(output_dir=str(out), target=target.name)
    if dc.regenerate and dc.mode == "chat":
        convs = _regenerate(recipe, target, convs, data_dir / "regenerated.jsonl", max_length, summary, timings,
                            progress, ranks)
    tokens = _tokenize(recipe, convs, target, max_length, summary, timings, progress, ranks)
    layers = feature_layers_for(recipe, target.num_layers)
    if offline:  # features of other data or layers in the folder: refused before anything is replaced
        check_features_folder(feat_dir, plan_features(target, tokens, layers, recipe.features).plan_key)
    else:
        check_same_tokens(data_dir / "tokens", tokens)
    tokens = _write_tokens(recipe, tokens, data_dir, ranks)
    summary.update(feature_layers=layers, feature_mode=recipe.features.mode)
    if offline:
        t = time.perf_counter()
        log.info("features: extracting %s", where_target_runs(target))
        manifest = write_features(target, tokens, feat_dir, layers, recipe.features, val_fraction=dc.val_fraction,
                                  progress=progress, after_shard=after_shard, verify=verify, ranks=ranks)
        timings["features_s"] = time.perf_counter() - t
        if manifest["complete"]:  # one full-vocabulary lm_head pass per token, saved for every training run
            t = time.perf_counter()
            manifest = write_target_sidecars(target, feat_dir, progress=progress, verify=verify, ranks=ranks)
            timings["targets_s"] = time.perf_counter() - t
            if ranks.main:
                write_features_record(target, feat_dir)  # training without the decoder records this target
        summary.update({"shards": len(manifest["shards"]), "features_complete": manifest["complete"],
                        "features_bytes": manifest.get("bytes", 0), "target_sidecars": _sidecar_count(manifest)})
    summary["disk_bytes"] = _du(data_dir) + _du(feat_dir)
    timings["total_s"] = time.perf_counter() - t_start
    summary["timings"] = {k: round(v, 2) for k, v in timings.items()}
    if ranks.multi:
        summary["processes"] = ranks.world
    if not ranks.main:
        return {}
    atomic_write_json(out / "prepare_summary.json", summary)
    return summary


def check_same_tokens(tok_dir: Path, tokens) -> None:
    """Online features: data/tokens is the run's only data; tokens of other data are refused, not replaced."""
    if not tok_dir.exists():
        return
    old = datasets.load_from_disk(str(tok_dir))
    columns = ("conversation_id", "input_ids", "loss_mask")
    if len(old) != len(tokens) or any(list(old[c]) != list(tokens[c]) for c in columns):
        raise SpecheadsError(f"{tok_dir}: holds tokens of other data (another data.source, length or template); "
                             f"{OVERWRITE_HINT}")


def remove_prepared(out: Path) -> None:
    """--overwrite: delete what prepare wrote under `out` (features/, data/, prepare_config.yaml and summary), one log
    line naming them. A folder holding a trained run is refused: its checkpoints and heads were trained on that data."""
    trained = [n for n in (CKPT_DIR, *FINISHED) if (out / n).exists()]
    if trained:
        raise SpecheadsError(f"--overwrite: {out} holds a trained run ({', '.join(trained)}) whose data it would "
                             f"replace: choose another output_dir")
    gone = [out / n for n in ("features", "data", "prepare_config.yaml", "prepare_summary.json") if (out / n).exists()]
    if not gone:
        return
    log.warning("--overwrite: removing %s", ", ".join(str(p) for p in gone))
    for p in gone:
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def _read_source(recipe, timings: dict):
    dc = recipe.data
    text = dc.mode == "text"
    t = time.perf_counter()
    loader = load_texts if text else load_conversations
    mix = None
    if dc.sources is not None:  # several sources, weighted and shuffled with the recipe's seed
        convs, lstats, mix = load_mixed(dc.sources, loader, recipe.seed, dc.max_conversations)
    else:
        convs, lstats = loader(dc.source, dc.max_conversations)
    timings["read_s"] = time.perf_counter() - t
    if len(convs) == 0:
        hint = "" if text else "; plain-text rows {\"text\": ...} need data.mode=text"
        what = f"data.source {dc.source!r}" if mix is None else f"data.sources ({lstats.source})"
        raise SpecheadsError(f"{what}: no usable {'text' if text else 'conversation'} "
                             f"({lstats.skipped} malformed rows; first reasons: {'; '.join(lstats.examples) or 'none'}"
                             f"){hint}")
    summary: dict[str, Any] = {"source": lstats.source, "conversations_read": lstats.rows_read,
                               "conversations_skipped": lstats.skipped, "conversations_kept": lstats.kept,
                               "skip_reasons": dict(lstats.reasons), "source_tail_cut": lstats.truncated_tail,
                               "empty_assistant_turns": lstats.empty_turns}
    if mix is not None:
        summary["sources"] = mix  # the mix: each source's name, weight, rows read / kept / taken / in the mix
    return convs, summary


def _regenerate(recipe, target, convs, regen_path: Path, max_length: int, summary: dict, timings: dict, progress,
                ranks: Ranks):
    """The target answers the conversations (resumable by id); returns the conversations to tokenise."""
    dc = recipe.data
    t = time.perf_counter()
    regen_path.parent.mkdir(parents=True, exist_ok=True)
    keep = None  # conversations past data.regen_conversations keep the source's replies
    if dc.regen_conversations is not None and dc.regen_conversations < len(convs):
        keep = convs.select(range(dc.regen_conversations, len(convs)))
        convs = convs.select(range(dc.regen_conversations))
    gen_target = target
    # a copy in data.regen_dtype only when some answer is still missing (a finished rerun skips the load)
    todo = set(convs["conversation_id"]) - read_done_ids(regen_path)
    endpoint = EndpointSettings.from_data(dc) if dc.regen_endpoint else None  # a server answers instead
    if endpoint is not None and dc.regen_dtype:
        log.warning("data.regen_dtype %s: not used, the server at data.regen_endpoint decides its dtype",
                    dc.regen_dtype)
    elif todo and dc.regen_dtype and dc.regen_dtype != recipe.target.dtype:
        gen_target = _load_target(recipe, dtype=dc.regen_dtype, ranks=ranks)
        gen_target = dataclasses.replace(gen_target, tokenizer=target.tokenizer)  # with data.chat_template if given
    log.info("regenerate: %s", f"through {dc.regen_endpoint}" if endpoint else where_target_runs(gen_target))
    rstats = regenerate_ranked(regenerate, ranks, gen_target, convs, regen_path, max_length=max_length,
                               max_new_tokens=dc.regen_max_new_tokens, batch_size=dc.regen_batch_size,
                               temperature=dc.regen_temperature, top_p=dc.regen_top_p, seed=recipe.seed,
                               progress=progress, max_turns=dc.regen_max_turns, endpoint=endpoint)
    del gen_target
    wanted = set(convs["conversation_id"])
    convs, rl = read_regenerated(regen_path, wanted, keep)  # answers with the ids the target generated
    timings["regenerate_s"] = time.perf_counter() - t
    summary.update({"regenerated_conversations": len(wanted),
                    "source_reply_conversations": 0 if keep is None else len(keep),
                    "regenerated_new_tokens": rstats["new_tokens"],
                    "regenerate_tokens_per_s": rstats["tokens_per_s"],
                    "empty_regenerated_turns": rl.empty_turns})
    if endpoint is not None:
        summary["regenerate_endpoint"] = {"url": endpoint.url, "api": endpoint.api, "concurrency": endpoint.concurrency}
    return convs


def _tokenize(recipe, convs, target, max_length: int, summary: dict, timings: dict, progress: bool, ranks: Ranks):
    """Chat: the template's tokens and assistant masks. Text: max_length windows, loss on every token, and with
    data.regenerate the target's continuation of each window's prefix (its time is inside tokenize_s)."""
    dc = recipe.data
    t = time.perf_counter()
    if dc.mode == "text":
        other = dc.regen_dtype and dc.regen_dtype != recipe.target.dtype
        regen_target = lambda: _load_target(recipe, dtype=dc.regen_dtype, ranks=ranks) if other else target  # noqa
        tokens, tstats, rsummary = text_tokens(dc, target, convs, Path(recipe.output_dir) / "data", max_length,
                                               recipe.seed, progress, regen_target, ranks)
        summary.update(rsummary)
    else:
        tokens, tstats = tokenize_conversations(convs, target.tokenizer, max_length)
    timings["tokenize_s"] = time.perf_counter() - t
    summary.update({"samples": tstats["samples"], "samples_truncated": tstats["truncated"],
                    "dropped_empty_mask": tstats["dropped_empty_mask"], "dropped_template": tstats["dropped_template"],
                    "tokens": tstats["tokens"], "masked_tokens": tstats["masked_tokens"], "max_length": max_length})
    if tstats["samples"] == 0:
        raise SpecheadsError(f"data: every sample was dropped (empty loss mask after truncation to {max_length} "
                             f"tokens); raise data.max_length")
    return tokens


def _write_tokens(recipe, tokens, data_dir: Path, ranks: Ranks):
    """prepare_config.yaml and data/tokens (atomically, by rank 0); returns the tokens as read back from disk."""
    if ranks.main:
        data_dir.mkdir(parents=True, exist_ok=True)
        save_config(recipe, Path(recipe.output_dir) / "prepare_config.yaml")
        with atomic_dir(data_dir / "tokens") as tmp:
            tokens.save_to_disk(str(tmp))
    ranks.barrier()
    return datasets.load_from_disk(str(data_dir / "tokens"))


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
                     ("target sidecars", f"{s.get('target_sidecars', 0)} of {s['shards']} shards"),
                     ("output", s["output_dir"])])
    rows = [("conversations read", s["conversations_read"]),
            ("conversations skipped", f"{s['conversations_skipped']} {s.get('skip_reasons') or ''}".strip()),
            ("source tail cut", "yes" if s.get("source_tail_cut") else "no")]
    if "regenerated_new_tokens" in s:
        rows += [("regenerated tokens", s["regenerated_new_tokens"]),
                 ("regenerate tokens/s", s["regenerate_tokens_per_s"])]
    if s.get("empty_assistant_turns") or s.get("empty_regenerated_turns"):
        rows.append(("empty answers skipped", s.get("empty_assistant_turns", 0) + s.get("empty_regenerated_turns", 0)))
    rows += [("samples", s["samples"]), ("samples truncated", s["samples_truncated"]),
             ("dropped (empty mask)", s["dropped_empty_mask"]), ("tokens", s["tokens"]),
             ("masked tokens", f"{s['masked_tokens']} ({100 * s['masked_tokens'] / max(1, s['tokens']):.1f}%)"),
             ("feature layers", f"{s['feature_layers']} ({s['feature_mode']})")]
    if "shards" in s:
        rows.append(("shards", f"{s['shards']}{'' if s['features_complete'] else ' (incomplete)'}"))
        rows.append(("target sidecars", f"{s.get('target_sidecars', 0)} of {s['shards']} shards"))
    rows += [("disk used", _human_bytes(s["disk_bytes"])), ("wall time", f"{s['timings']['total_s']:.1f} s"),
             ("output", s["output_dir"])]
    return _box(rows)


def _box(rows: list[tuple[str, object]]) -> str:
    """Two aligned columns between dashed lines."""
    w = max(len(k) for k, _ in rows)
    line = "-" * (w + 2 + max(len(str(v)) for _, v in rows))
    return "\n".join([line] + [f"{k:<{w}}  {v}" for k, v in rows] + [line])

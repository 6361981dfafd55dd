"""`specheads bench --batch-sizes B,B,...`: the batched sweep (infer/bench/batch.py), reached from commands/bench.py."""
from __future__ import annotations

import argparse
import sys

import specheads.target
from specheads.commands import args as shared
from specheads.infer.bench.batch import (BatchBenchSettings, batch_markdown, build_batch_methods, check_batch_sizes,
                                         run_batch_bench)
from specheads.infer.bench.names import check_batch_methods, default_batch_methods, head_entries
from specheads.infer.bench.runner import interrupted_exit
from specheads.prompts import calibration_ids, first_turn_ids, load_prompts
from specheads.utils import SpecheadsError

BATCH_WARMUP_TOKENS = 8  # at most this many untimed warm-up tokens per method and batch size


def parse_batch_sizes(text: str) -> list[int]:
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise SpecheadsError(f"--batch-sizes {text}: expected comma-separated whole numbers >= 1, e.g. 1,2,4,8,16")
    return check_batch_sizes([int(p) for p in parts])


def check_sizes_fit(sizes: list[int], n_prompts: int, dataset: str) -> None:
    """A batch size above the prompt count would run as a smaller batch under its label: refused (one line)."""
    over = [b for b in sizes if b > n_prompts]
    if over:
        raise SpecheadsError(f"--batch-sizes {','.join(map(str, sizes))}: {','.join(map(str, over))} above the "
                             f"{n_prompts} prompts of --dataset {dataset} (a batch never holds more rows than there "
                             f"are prompts): use sizes up to {n_prompts}, or more prompts (--limit, --dataset)")


def run(args: argparse.Namespace, options) -> int:
    """The flags as plain values (`options`: bench.MethodOptions, from commands/bench.py), checked before the target
    loads; then the sweep."""
    sizes = parse_batch_sizes(args.batch_sizes)
    shared.check_max_new_tokens(args.max_new_tokens)
    if args.both_turns:
        raise SpecheadsError("--both-turns: the batch sweep decodes first turns only (drop --both-turns)")
    names = ([m.strip() for m in args.methods.split(",") if m.strip()] if args.methods
             else default_batch_methods(head_entries(args.head)))
    check_batch_methods(names)
    if any(n.startswith("head") for n in names) and not args.head:
        raise SpecheadsError("--methods head: needs --head DIR (a head folder written by `specheads train`)")
    shared.set_threads(args.threads)
    prompts = load_prompts(args.dataset, args.limit)
    check_sizes_fit(sizes, len(prompts), args.dataset)
    dtype = shared.dtype_name(args.dtype)
    target = shared.allow_other_target(specheads.target.load_target(args.target, dtype=dtype, device=args.device),
                                       args)
    # a prompt that does not fit the context window: refused by its id before any method runs (as bench does)
    encoded = [(p.id, ids) for p, ids in zip(prompts, first_turn_ids(target, prompts, args.dataset))]
    methods, extra = build_batch_methods(names, target, options, calib_ids=calibration_ids(target.tokenizer, prompts))
    extra["target_source"] = target.describe()  # the file it decodes: results.md's header says it
    settings = BatchBenchSettings(target=args.target, dataset=args.dataset, dtype=dtype, batch_sizes=sizes,
                                  temperature=args.temperature, max_new_tokens=args.max_new_tokens, limit=args.limit,
                                  seed=args.seed, warmup_tokens=min(args.warmup_tokens, BATCH_WARMUP_TOKENS))
    results = run_batch_bench(encoded, methods, settings, out_dir=args.out, extra=extra)
    print(batch_markdown(results))
    window_note(results.get("stopped_at_window", 0), "rows", target)
    print(f"wrote {args.out}/results.json, results.md, {', '.join(results.get('plots', []))}")
    return interrupted_exit(results, args.out, "chunks")  # after a signal: exit 128 + it, one line


def window_note(stopped: int, what: str, target) -> None:
    """One line when outputs stopped at the target's context window (shorter than --max-new-tokens; every
    method stops there, HF generate's included, so the outputs still compare token for token)."""
    if stopped:
        print(f"{stopped} {what} stopped at the context window of {target.max_positions} positions of target "
              f"{target.name}, before --max-new-tokens (stop_reason context_window)", file=sys.stderr)

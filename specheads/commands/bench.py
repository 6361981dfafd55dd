"""`specheads bench`: tokens/s, τ and speedup against plain decoding and peers, in one run."""
from __future__ import annotations

import argparse
import logging

from specheads.utils import SpecheadsError

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2-135m", help="hub id, local folder, .gguf file or alias (default: smollm2-135m)")
    p.add_argument("--head", action="append", default=None, metavar="[LABEL=]DIR",
                   help="head folder for the `head` method; repeat to compare heads in one run (methods "
                        "head:LABEL, LABEL defaulting to the head kind, e.g. head:eagle3, head:dspark)")
    p.add_argument("--draft-model", default=None, help="small draft model for the `draft-model` method")
    p.add_argument("--draft-tokens", type=int, default=4, help="draft-model: chain length per step (default 4 tokens)")
    p.add_argument("--dataset", default="mt-bench",
                   help="mt-bench | humaneval | sharegpt:START | FILE.jsonl (\"prompt\" or \"turns\" per line)")
    p.add_argument("--methods", default=None,
                   help="comma-separated: vanilla,prompt-lookup,head,draft-model,plain,prompt-lookup-ours,combo,"
                        "recycling,lookup+recycling,combo+recycling; "
                        "head:LABEL picks one --head; +lookup after a head method (head+lookup, head:LABEL+lookup) "
                        "puts the head and a prompt-lookup chain under one per-step scheduler, greedy only; combo: "
                        "every --head and the lookup chain under one scheduler, greedy only; recycling: Token "
                        "Recycling (training-free); lookup+recycling / combo+recycling: it as one more "
                        "scheduled source "
                        "(default: vanilla,prompt-lookup plus head / draft-model when given)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default; outputs checked against vanilla)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens per turn (default 256)")
    p.add_argument("--limit", type=int, default=None, help="first N prompts (MT-bench: categories interleaved)")
    p.add_argument("--both-turns", action="store_true",
                   help="MT-bench: also the second turn, conditioned on the method's own first answer (FastChat)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "bfloat16", "float32"],
                   help="target dtype (default bf16; use fp32 for the identical-output check)")
    p.add_argument("--tree", default="auto",
                   help="the heads' tree, as `specheads generate --tree`: auto (default: EAGLE / Medusa heads: profile "
                        "this machine, choose size and depth; DSpark heads: the per-step scheduler); EAGLE heads: "
                        "DEPTH,TOP_K,TOTAL (e.g. 4,4,16); Medusa heads: chain:K, JSON rank paths or default; DSpark "
                        "heads: K or chain:K draft tokens per step")
    p.add_argument("--head-lookup", type=int, default=None, metavar="N",
                   help="chain length of the +lookup and combo methods: up to N prompt-lookup tokens offered to the "
                        "scheduler each step (default 10, HF prompt lookup's candidate tokens per step)")
    p.add_argument("--refresh-profile", action="store_true", help="re-measure the cached hardware profile")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (the same for every method)")
    p.add_argument("--warmup-tokens", type=int, default=16, help="untimed warm-up tokens per method (default 16)")
    p.add_argument("--llamacpp-target", default=None, metavar="GGUF",
                   help="llama.cpp methods: the target GGUF (default: the target converted in the run's dtype, cached)")
    p.add_argument("--llamacpp-draft-max", type=int, default=None, metavar="N",
                   help="llama.cpp:LABEL: drafted tokens per step (--spec-draft-n-max; default: a DSpark head's "
                        "block, llama.cpp's 3 otherwise)")
    p.add_argument("--llamacpp-p-min", type=float, default=None, metavar="P",
                   help="llama.cpp:LABEL with a DSpark head: --spec-draft-p-min (default: chosen from the head's "
                        "confidences on calibration prompts and llama.cpp's measured verify-cost curve)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; 1 is steadier on a machine shared with other jobs)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: where the target loads)")
    p.add_argument("--batch-sizes", default=None, metavar="B,B,...",  # the batched sweep: commands/batchbench.py
                   help="batched sweep, e.g. 1,2,4,8,16: vanilla (HF generate, left-padded), plain, prompt-lookup and "
                        "each head at each batch size, +sched methods with the batch verify budget")
    p.add_argument("--out", required=True, help="output folder: results.json, results.md, PNG plots, outputs.jsonl")


def method_names(args: argparse.Namespace) -> list[str]:
    if args.methods:
        return [m.strip() for m in args.methods.split(",") if m.strip()]
    return ["vanilla", "prompt-lookup"] + (["head"] if args.head else []) + (["draft-model"] if args.draft_model else [])


def split_head(value: str) -> tuple[str, str]:
    """One --head value as (label, folder): a value that is itself a folder is taken whole, even when its path holds
    '='; else LABEL=DIR at the first '=' whose DIR is a folder. Neither: one error with the hint."""
    from pathlib import Path

    if "=" not in value or Path(value).is_dir():
        return "", value
    for i, ch in enumerate(value):
        if ch == "=" and Path(value[i + 1:]).is_dir():
            return value[:i], value[i + 1:]
    label, _, folder = value.partition("=")
    raise SpecheadsError(f"--head {value}: no such folder, and read as LABEL=DIR (label {label!r}) {folder!r} is not "
                         f"one either; a folder whose own path holds '=' is used whole when it exists")


def parse_heads(values: list[str]) -> dict[str, str]:
    """--head values holding '=' -> {method name: folder}, as infer/bench.head_entries names them (one unlabelled
    head is `head`; otherwise head:LABEL, LABEL defaulting to the folder's head kind)."""
    from pathlib import Path

    from specheads.heads.base import read_head_config

    pairs = [split_head(v) for v in values]
    if len(pairs) == 1 and not pairs[0][0]:
        return {"head": pairs[0][1]}
    out: dict[str, str] = {}
    for value, (label, folder) in zip(values, pairs):
        name = f"head:{label or read_head_config(Path(folder)).kind}"
        if name in out:
            raise SpecheadsError(f"--head {value}: label {name[5:]!r} used twice; name them as LABEL=DIR")
        out[name] = folder
    return out


def method_options(args: argparse.Namespace):
    """The flags as plain values for the library (bench.MethodOptions), every tree spec checked against its head's
    folder before any model loads."""
    from pathlib import Path

    from specheads.heads.base import read_head_config
    from specheads.infer.bench import HEAD_LOOKUP_TOKENS, MethodOptions, head_entries
    from specheads.infer.drafters import parse_tree
    from specheads.infer.verify import SamplingParams

    SamplingParams(temperature=args.temperature)
    if args.llamacpp_p_min is not None and not 0.0 <= args.llamacpp_p_min <= 1.0:
        raise SpecheadsError(f"--llamacpp-p-min {args.llamacpp_p_min}: expected a confidence in [0, 1]")
    heads = head_entries(args.head) if not any("=" in h for h in args.head or []) else parse_heads(args.head)
    for head_dir in heads.values():
        config = read_head_config(Path(head_dir))
        parse_tree(args.tree, config.kind, config)
    return MethodOptions(temperature=args.temperature, heads=heads, tree=args.tree,
                         refresh_profile=args.refresh_profile,
                         head_lookup=HEAD_LOOKUP_TOKENS if args.head_lookup is None else args.head_lookup,
                         draft_model=args.draft_model, draft_tokens=args.draft_tokens, threads=args.threads,
                         llamacpp_target=args.llamacpp_target, llamacpp_draft_max=args.llamacpp_draft_max,
                         llamacpp_p_min=args.llamacpp_p_min)


def run(args: argparse.Namespace) -> int:
    from specheads.infer.autotree import calibration_ids
    from specheads.infer.bench import (BenchSettings, build_methods, check_method_names, is_head_method,
                                       markdown_table, run_bench)
    from specheads.infer.prompts import load_prompts
    from specheads.target import load_target

    if args.batch_sizes:  # the batched sweep (infer/batchbench.py)
        from specheads.commands import batchbench

        return batchbench.run(args, method_options(args))
    if args.max_new_tokens < 1:
        raise SpecheadsError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
    names = method_names(args)
    if args.threads is not None:
        if args.threads < 1:
            raise SpecheadsError(f"--threads {args.threads}: must be at least 1")
        import torch

        torch.set_num_threads(args.threads)
    check_method_names(names)  # before the target loads
    if any(is_head_method(n) or n in ("combo", "combo+recycling") for n in names) and not args.head:
        raise SpecheadsError("--methods head: needs --head DIR (a head folder written by `specheads train`)")
    if "draft-model" in names and not args.draft_model:
        raise SpecheadsError("--methods draft-model: needs --draft-model NAME (or truncated:N)")
    options = method_options(args)
    prompts = load_prompts(args.dataset, args.limit, args.both_turns)
    dtype = {"bf16": "bfloat16", "fp32": "float32"}.get(args.dtype, args.dtype)
    target = load_target(args.target, dtype=dtype, device=args.device)
    methods, extra = build_methods(names, target, options, calib_ids=calibration_ids(target.tokenizer, prompts))
    settings = BenchSettings(target=args.target, dataset=args.dataset, dtype=dtype, temperature=args.temperature,
                             max_new_tokens=args.max_new_tokens, limit=args.limit, both_turns=args.both_turns,
                             seed=args.seed, warmup_tokens=args.warmup_tokens)
    results = run_bench(prompts, methods, settings, target.tokenizer, out_dir=args.out, extra=extra)
    print(markdown_table(results))
    print(f"wrote {args.out}/results.json, results.md, {', '.join(results.get('plots', []))}")
    return 130 if results.get("interrupted") else 0

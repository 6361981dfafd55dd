"""`specheads bench`: tokens/s, τ and speedup against plain decoding and peers, in one run (with --batch-sizes the
batched sweep: commands/batchbench.py)."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

import specheads.target
from specheads.commands import args as shared
from specheads.commands import batchbench
from specheads.heads.base import read_head_config
from specheads.infer.bench import BenchSettings, MethodOptions, build_methods, markdown_table, run_bench
from specheads.infer.bench.methods import check_lookup_tokens
from specheads.infer.bench.runner import interrupted_exit
from specheads.infer.bench.names import (HEAD_LOOKUP_TOKENS, KNOWN_METHODS, LLAMACPP_NGRAM, LLAMACPP_PLAIN,
                                         LLAMACPP_PREFIX, VLLM_PLAIN, VLLM_PREFIX, check_method_names,
                                         default_methods, head_entries, head_trees, needs_heads)
from specheads.infer.drafters import parse_tree
from specheads.infer.drafters.plugins import load_plugins
from specheads.infer.engine.runner import runner_for
from specheads.infer.verify import SamplingParams
from specheads.prompts import calibration_ids, check_later_turns, first_turn_ids, load_prompts
from specheads.utils import SpecheadsError

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    shared.add_target(p)
    p.add_argument("--head", action="append", default=None, metavar="[LABEL=]DIR",
                   help="head folder (or hub id org/name[@revision]) for the `head` method; repeat to compare heads in one run (methods "
                        "head:LABEL, LABEL defaulting to the head kind, e.g. head:eagle3, head:dspark)")
    shared.add_draft_model(p, "the `draft-model` method's draft: a small model sharing the target's vocabulary, or "
                              "truncated:N (the target's first N layers)")
    shared.add_draft_tokens_alias(p)
    shared.add_skip_layers(p)
    p.add_argument("--dataset", default="mt-bench",
                   help="mt-bench | humaneval | sharegpt:START | FILE.jsonl (\"prompt\" or \"turns\" per line)")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated: {','.join(KNOWN_METHODS)}; the peers {LLAMACPP_PLAIN}, {LLAMACPP_NGRAM}, "
                        f"{LLAMACPP_PREFIX}LABEL (llama-server, our head LABEL as its draft), {VLLM_PLAIN} and "
                        f"{VLLM_PREFIX}LABEL (vLLM's CPU build, our head LABEL "
                        "as its speculator); head:LABEL picks one --head; +lookup after a head method (head+lookup, head:LABEL+lookup) "
                        "puts the head and a prompt-lookup chain under one per-step scheduler, greedy only; combo: "
                        "every --head and the lookup chain under one scheduler, greedy only; recycling: Token "
                        "Recycling (training-free); lookup+recycling / combo+recycling: it as one more "
                        "scheduled source; layer-skip: the target drafting for itself with --skip-layers left out "
                        "(self-speculative), layer-skip+lookup / combo+layer-skip: it under one scheduler with "
                        "lookup (and every --head), greedy only; drafter:NAME: our loop with a registered "
                        "training-free drafter (a --plugin's own included) "
                        "(default: vanilla,prompt-lookup plus head / draft-model when given)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default; outputs checked against vanilla)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens per turn (default 256)")
    p.add_argument("--limit", type=int, default=None, help="first N prompts (MT-bench: categories interleaved)")
    p.add_argument("--both-turns", action="store_true",
                   help="MT-bench: also the second turn, conditioned on the method's own first answer (FastChat)")
    shared.add_dtype(p)
    shared.add_engine(p)
    p.add_argument("--tree", action="append", default=None, metavar="[LABEL=]SPEC",
                   help="the heads' tree, as `specheads generate --tree`; LABEL=SPEC for the head head:LABEL only "
                        "(repeat the flag: e.g. --tree eagle3=2,2,6 --tree dspark=7): auto (default: EAGLE / Medusa heads: profile "
                        "this machine, choose size and depth; DSpark heads: the per-step scheduler); EAGLE heads: "
                        "DEPTH,TOP_K,TOTAL (e.g. 4,4,16); Medusa heads: chain:K, JSON rank paths or default; DSpark "
                        "heads: K or chain:K draft tokens per step; draft-model=N: the draft-model method's chain "
                        "(default 4 tokens, as generate --drafter draft-model --tree N)")
    shared.add_lookup(p, HEAD_LOOKUP_TOKENS,
                      f"chain length of the +lookup and combo methods: up to N prompt-lookup tokens offered to the "
                      f"scheduler each step (default {HEAD_LOOKUP_TOKENS}, HF prompt lookup's candidate tokens per "
                      "step)")
    p.add_argument("--refresh-profile", action="store_true", help="re-measure the cached hardware profile")
    shared.add_pricing(p)
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
    p.add_argument("--vllm-eager", action="store_true",
                   help="vllm methods: start vLLM with --enforce-eager (no torch.compile: a start of ~1 min instead of "
                        "several on 2 cores; slower decoding)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads and llama-server's -t / -tb (default: torch's choice; llama.cpp: the cores "
                        "this process may run on; 1 is steadier on a machine shared with other jobs)")
    shared.add_device(p)
    shared.add_allow_other_target(p)
    shared.add_plugin(p)
    p.add_argument("--batch-sizes", default=None, metavar="B,B,...",  # the batched sweep: commands/batchbench.py
                   help="batched sweep, e.g. 1,2,4,8,16: vanilla (HF generate, left-padded), plain, prompt-lookup and "
                        "each head at each batch size, +sched methods with the batch verify budget")
    p.add_argument("--out", required=True, help="output folder: results.json, results.md, PNG plots, outputs.jsonl")


def method_names(args: argparse.Namespace) -> list[str]:
    if args.methods:
        return [m.strip() for m in args.methods.split(",") if m.strip()]
    return default_methods(bool(args.head), bool(args.draft_model))


def method_options(args: argparse.Namespace) -> MethodOptions:
    """The flags as plain values for the library (bench.MethodOptions), every tree spec checked against its head's
    folder before any model loads."""
    SamplingParams(temperature=args.temperature)
    if args.llamacpp_p_min is not None and not 0.0 <= args.llamacpp_p_min <= 1.0:
        raise SpecheadsError(f"--llamacpp-p-min {args.llamacpp_p_min}: expected a confidence in [0, 1]")
    heads = head_entries(args.head)
    draft_tokens, tree_values = draft_model_chain(args.tree)
    trees = head_trees(tree_values, heads)
    for head_dir in heads.values():
        config = read_head_config(Path(head_dir))
        parse_tree(trees[head_dir], config.kind, config)
    check_lookup_tokens(args.lookup, flag=shared.spelled(args, "lookup", "--lookup")[0])
    return MethodOptions(temperature=args.temperature, heads=heads, tree=trees,
                         refresh_profile=args.refresh_profile, pricing=args.pricing, lookup=args.lookup,
                         draft_model=args.draft_model, draft_tokens=draft_tokens, threads=args.threads,
                         llamacpp_target=args.llamacpp_target, llamacpp_draft_max=args.llamacpp_draft_max,
                         llamacpp_p_min=args.llamacpp_p_min, skip_layers=args.skip_layers,
                         vllm_eager=args.vllm_eager)


def draft_model_chain(values: list[str] | None) -> tuple[int, list[str] | None]:
    """--tree values -> (the draft-model method's chain, `--tree draft-model=N`, default 4; the heads' values)."""
    ours = [v for v in values or [] if str(v).partition("=")[0] == shared.DRAFT_MODEL_LABEL]
    if len(ours) > 1:
        raise SpecheadsError(f"--tree {ours[1]}: the draft model has a chain already ({ours[0]})")
    rest = [v for v in values or [] if v not in ours]
    chain = ours[0].partition("=")[2].strip() if ours else "4"
    return parse_tree(chain, "draft-model", flag=f"--tree {shared.DRAFT_MODEL_LABEL}").num_tokens, rest or None


def run(args: argparse.Namespace) -> int:
    load_plugins(args.plugin)
    if args.batch_sizes:  # the batched sweep (infer/bench/batch.py)
        return batchbench.run(args, method_options(args))
    shared.check_max_new_tokens(args.max_new_tokens)
    names = method_names(args)
    shared.set_threads(args.threads)
    check_method_names(names)  # before the target loads
    if needs_heads(names) and not args.head:
        raise SpecheadsError("--methods head: needs --head DIR (a head folder written by `specheads train`)")
    if "draft-model" in names and not args.draft_model:
        raise SpecheadsError("--methods draft-model: needs --draft-model NAME (or truncated:N)")
    options = method_options(args)
    prompts = load_prompts(args.dataset, args.limit, args.both_turns)
    dtype = shared.dtype_name(args.dtype)
    target = specheads.target.load_target(args.target, dtype=dtype, device=args.device)
    target.engine, target.compile = args.engine, args.compile
    shared.allow_other_target(target, args)
    first_turn_ids(target, prompts, args.dataset)  # a prompt longer than the context window: refused before any run
    check_later_turns(target, prompts, args.dataset, args.max_new_tokens)  # --both-turns: the second turns too
    methods, extra = build_methods(names, target, options, calib_ids=calibration_ids(target.tokenizer, prompts))
    extra["target_source"] = target.describe()  # the file it decodes: results.md's header says it
    settings = BenchSettings(target=args.target, dataset=args.dataset, dtype=dtype, temperature=args.temperature,
                             max_new_tokens=args.max_new_tokens, limit=args.limit, both_turns=args.both_turns,
                             seed=args.seed, warmup_tokens=args.warmup_tokens, engine=runner_for(target).name)
    results = run_bench(prompts, methods, settings, target.tokenizer, out_dir=args.out, extra=extra)
    print(markdown_table(results))
    batchbench.window_note(results.get("stopped_at_window", 0), "turns", target)
    print(f"wrote {args.out}/results.json, results.md, {', '.join(results.get('plots', []))}")
    return interrupted_exit(results, args.out, "prompts")  # after a signal: exit 128 + it, one line


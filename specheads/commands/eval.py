"""`specheads eval`: teacher-forced top-k and simulated τ of a head on the target's answers to a dataset's prompts."""
from __future__ import annotations

import argparse
import json
import logging

from specheads.commands import args as shared
from specheads.utils import SpecheadsError

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--head", required=True, help="native head folder (or hub id org/name[@revision]), any kind")
    shared.add_target(p, default=None, what="; heldout:RUN: the run's")
    p.add_argument("--dataset", default="mt-bench",
                   help="mt-bench | humaneval | sharegpt:START (first user turns from conversation START on: past the "
                        "recipe's data.max_conversations they are unseen) | sharegpt-dev (the training dev set's "
                        "prompts) | FILE.jsonl | heldout:RUN (the held-out split a `specheads train` run folder "
                        "evaluated, with its settings: reproduces its training-time figures)")
    p.add_argument("--limit", type=int, default=8, help="prompts (MT-bench: categories interleaved; default 8)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens of each target answer (default 64)")
    shared.add_dtype(p, default=None, why="default bfloat16, as the recipes extract features; heldout:RUN: the run's")
    shared.add_eval_tree(p)
    shared.add_device(p)
    shared.add_allow_other_target(p)
    p.add_argument("--block-tree-nodes", type=int, default=16,
                   help="block heads: draft nodes of the best-first tree over the block scored beside the chain "
                        "(tau_blocktree, tau_blocktree_walk: what `--tree tree:N` serves; default 16, 0 = off)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def run(args: argparse.Namespace) -> int:
    from specheads.heads.base import load_head
    from specheads.prompts import load_prompts
    from specheads.target import load_target, where_target_runs
    from specheads.train.head_eval import evaluate_head_on_prompts

    shared.check_max_new_tokens(args.max_new_tokens)
    tree_depth, tree_width = shared.eval_tree(args)
    if args.block_tree_nodes < 0:
        raise SpecheadsError(f"--block-tree-nodes {args.block_tree_nodes}: must be at least 0 (0 = off)")
    if args.dataset.startswith("heldout:"):
        from specheads.train.heldout import evaluate_head_on_heldout, heldout_recipe

        recipe = heldout_recipe(args.dataset.split(":", 1)[1])
        dtype = shared.dtype_name(args.dtype) if args.dtype else recipe.target.dtype
        target = load_target(args.target or recipe.target.name, dtype=dtype, device=args.device,
                             trust_remote_code=recipe.target.trust_remote_code, device_map=recipe.target.device_map)
        head = load_head(args.head, shared.allow_other_target(target, args)).eval()
        log.info("eval: %s", where_target_runs(target))
        figures = evaluate_head_on_heldout(target, head, recipe)
        args.max_new_tokens = None  # the stored answers, as the run wrote them
    else:
        prompts = load_prompts(args.dataset, args.limit)
        dtype = shared.dtype_name(args.dtype or "bfloat16")
        target = load_target(args.target or "smollm2-135m", dtype=dtype, device=args.device)
        head = load_head(args.head, shared.allow_other_target(target, args)).eval()
        log.info("eval: %s", where_target_runs(target))
        figures = evaluate_head_on_prompts(target, head, prompts, args.max_new_tokens, tree_width, tree_depth,
                                           dataset=args.dataset, block_tree_nodes=args.block_tree_nodes)
    result = {"head": args.head, "kind": head.config.kind, "dataset": args.dataset,
              "max_new_tokens": args.max_new_tokens, **figures}
    print(json.dumps(result) if args.json else table(result))
    return 0


def table(result: dict) -> str:
    lines = [f"# specheads eval: {result['head']} ({result['kind']}) on {result['dataset']}", "",
             f"{result['prompts']} prompts, {result['answer_tokens']} answer tokens ("
             + ("the run's held-out answers" if result["max_new_tokens"] is None else
                f"the target's greedy answers, up to {result['max_new_tokens']} tokens each") + "), teacher-forced", "", "| metric | value |", "|---|---:|"]
    skip = {"head", "kind", "dataset", "max_new_tokens", "prompts", "answer_tokens"}
    lines += [f"| {k} | {v} |" for k, v in result.items() if k not in skip]
    return "\n".join(lines)

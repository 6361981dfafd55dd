"""Evaluation that predicts acceptance: per-head (Medusa) / per-step (EAGLE) top-1 and top-k accuracy against the
target's GREEDY token (what verification accepts), and a simulated accepted length τ (teacher-forced):

- chain τ at a start row t = 1 (the target's own token) + the number of consecutive draft steps whose top-1 equals
  the target's greedy token; averaged over start rows inside assistant answers.
- tree τ: the same with "the target's token is in the draft's top-`tree_width`" over at most `tree_depth` steps:
  the τ of a full `tree_width`-ary tree of that depth (width 2, depth 5: 62 nodes, about EAGLE-2's 60-token budget).

Teacher forcing: the draft reads the data's tokens and (EAGLE-3 TTT) its own predicted features, which is what it
sees in serving whenever the earlier steps were accepted. With regenerated data the data's tokens are the target's
own, so this tracks the τ that `specheads bench` measures; on human-written data it reads the target on text it
would not have written.

Block heads (DSpark / DFlash) with a confidence head add the confidence metrics of confidence.py; their
calibration after training is calibrate.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specheads.train.blocktree_eval import BlockTreeAccumulator
from specheads.train.confidence import BlockEvalAccumulator
from specheads.train.losses import accepted_lengths, step_correct
from specheads.train.steps import draft_outputs
from specheads.train.walk import RATIO_FIELDS, ratio_and_se, ratio_sums, walk_batch
from specheads.utils import SpecheadsError, check_values


@dataclass
class EvalConfig:
    every_steps: int = 200  # optimizer steps between evaluations (0 = only at the end)
    # held-out samples per evaluation (all processes together): None = every one; N = a random subset drawn once
    # with the recipe's seed (the same samples at every evaluation). Never the first N: feature shards hold
    # samples sorted by length, so the first N are the shortest answers.
    max_samples: int | None = None
    batch_size: int = 4  # samples per process per forward
    topk: int = 5  # top-k accuracy reported beside top-1
    tree_width: int = 2  # simulated full tree: branching per depth
    tree_depth: int = 5  # simulated full tree: depth (2^1+...+2^5 = 62 nodes)
    eagle_steps: int = 5  # EAGLE-1 unroll depth used for the chain τ
    # metric that picks the best checkpoint: tau_tree | tau_chain (per position), tau_tree_walk | tau_chain_walk
    # (the serving walk), each on the held-out split or, prefixed dev_, on the serving-true dev set
    select: str = "tau_tree"
    at_start: bool = True  # evaluate the untrained head first (the baseline τ the training must beat)
    # The serving-true dev set (train/devset.py): prompts answered by the target as `specheads bench` answers them
    dev_prompts: int = 0  # prompts (0 = off; 32 = 4 of each MT-bench kind of request)
    dev_dataset: str = "sharegpt-dev"  # sharegpt-dev | sharegpt:START | FILE.jsonl (never a benchmark we report)
    dev_max_new_tokens: int = 256  # tokens per answer: `specheads bench`'s default --max-new-tokens
    # DSpark: cut the block where the calibrated survival prod c_i falls below each threshold (a probability)
    conf_threshold: float | list[float] = field(default_factory=lambda: [0.3, 0.5, 0.7])
    # block heads: draft nodes of the best-first tree over the block scored beside the chain (tau_blocktree,
    # tau_blocktree_walk; train/blocktree_eval.py, served as `--tree tree:N`); 0 = off
    block_tree_nodes: int = 16

    def __post_init__(self) -> None:
        check_values("eval", self, {"every_steps": ">=0", "max_samples": ">=1|None", "batch_size": ">=1", "topk": ">=1",
                                    "tree_width": ">=1", "tree_depth": ">=1", "eagle_steps": ">=1",
                                    "dev_prompts": ">=0", "dev_max_new_tokens": ">=1", "block_tree_nodes": ">=0"})
        names = [f"{d}{m}" for d in ("", "dev_") for m in EvalAccumulator.RATIOS]
        if self.select not in names:
            raise SpecheadsError(f"eval.select: {self.select!r} is not one of {names}")
        if self.select.startswith("dev_") and not self.dev_prompts:
            raise SpecheadsError(f"eval.select: {self.select} needs the dev set; set eval.dev_prompts (e.g. 32)")
        if not isinstance(self.conf_threshold, list):
            self.conf_threshold = [self.conf_threshold]
        bad = [t for t in self.conf_threshold if not 0.0 < float(t) < 1.0]
        if bad:
            raise SpecheadsError(f"eval.conf_threshold: {bad[0]!r} is not a probability in (0, 1)")


class EvalAccumulator:
    """Sums over batches (and processes, via `reduce`) -> metrics dict. One batch row is one sample: the τ figures
    carry the samples' standard error (walk.ratio_and_se), and the serving walk (walk.py) is taken per sample."""

    RATIOS = ("tau_chain", "tau_tree", "tau_chain_walk", "tau_tree_walk")

    def __init__(self, num_steps: int):
        self.K = num_steps
        # valid, top1, topk per step; per ratio its RATIO_FIELDS sums; then rows, samples
        self.sums = torch.zeros(3 * num_steps + RATIO_FIELDS * len(self.RATIOS) + 2, dtype=torch.float64)

    def add(self, step_logits, target_argmax, loss_mask, d2t, cfg: EvalConfig) -> None:
        valid, top1, topk = step_correct(step_logits, target_argmax, loss_mask, d2t, topk=cfg.topk)
        _, _, tree = step_correct(step_logits, target_argmax, loss_mask, d2t, topk=cfg.tree_width)
        start = valid[0]  # [B,T] drafting starts at every row whose next drafted token is an assistant token
        K, s = self.K, self.sums
        s[:K] += valid.flatten(1).sum(1).double().cpu()
        s[K:2 * K] += top1.flatten(1).sum(1).double().cpu()
        s[2 * K:3 * K] += topk.flatten(1).sum(1).double().cpu()
        chain, full = accepted_lengths(top1), accepted_lengths(tree, depth=cfg.tree_depth)  # [B,T]
        rows = start.sum(1)  # [B]
        parts = [(torch.where(start, chain, 0).sum(1), rows), (torch.where(start, full, 0).sum(1), rows),
                 walk_batch(chain, start), walk_batch(full, start)]
        off = 3 * K
        for y, n in parts:
            s[off:off + RATIO_FIELDS] += ratio_sums(y, n)
            off += RATIO_FIELDS
        s[off] += float(rows.sum())
        s[off + 1] += float((rows > 0).sum())

    def metrics(self, cfg: EvalConfig) -> dict[str, float]:
        K, s = self.K, self.sums
        out: dict[str, float] = {}
        for k in range(K):
            n = max(1.0, float(s[k]))
            out[f"top1_{k}"] = float(s[K + k]) / n
            out[f"top{cfg.topk}_{k}"] = float(s[2 * K + k]) / n
        off, samples = 3 * K + RATIO_FIELDS * len(self.RATIOS), float(s[-1])
        for i, name in enumerate(self.RATIOS):
            r, se = ratio_and_se(s[3 * K + RATIO_FIELDS * i:3 * K + RATIO_FIELDS * (i + 1)], samples)
            out[name] = r
            if math.isfinite(se):  # two samples at least
                out[f"{name}_se"] = se
        out["eval_rows"], out["eval_samples"] = float(s[off]), samples
        return out


def eval_summary(metrics: dict[str, float]) -> str:
    """One log line: first-draft top-1 and the τ figures (± their standard error) of each evaluated set."""
    parts = []
    for pre, name in (("", "held-out"), ("dev_", "dev")):
        if f"{pre}tau_chain" not in metrics:
            continue
        fig = [f"top1_0={metrics.get(pre + 'top1_0', float('nan')):.3f}"]
        for m in EvalAccumulator.RATIOS:
            se = metrics.get(f"{pre}{m}_se", float("nan"))
            fig.append(f"{m}={metrics[pre + m]:.3f}" + ("" if se != se else f"±{se:.3f}"))
        parts.append(f"{name} [{int(metrics[pre + 'eval_samples'])} samples] " + " ".join(fig))
    return "; ".join(parts)


@torch.no_grad()
def evaluate(kind: str, head, batches, target, layers, head_layers, cfg: EvalConfig, reduce=None,
             get_hidden=None) -> dict[str, float]:
    """Run the head over `batches` (an iterable of collated dicts) and return the metrics.

    reduce: callable summing a tensor over processes (accelerator.reduce(..., "sum")); get_hidden: callable
    batch -> batch with `hidden` filled (online features); both optional.
    """
    was_training = head.training
    head.eval()
    acc = blk = tree = None
    block_head = hasattr(getattr(head, "module", head), "draft_blocks") and cfg.block_tree_nodes > 0
    try:
        for batch in batches:
            if get_hidden is not None:
                batch = get_hidden(batch)
            d = draft_outputs(kind, head, batch, target, layers, head_layers, eagle_steps=cfg.eagle_steps)
            if acc is None:
                acc = EvalAccumulator(len(d.steps))
            acc.add(d.steps, d.target_greedy, batch["loss_mask"], d.d2t, cfg)
            if block_head:  # the best-first tree over the block, as the drafter builds it
                tree = tree or BlockTreeAccumulator(cfg.block_tree_nodes)
                tree.add(d.steps, d.confidence, d.target_greedy, batch["loss_mask"], d.d2t)
            if d.confidence is not None:  # per-draft acceptance against the calibrated confidences
                blk = blk or BlockEvalAccumulator(len(d.steps), cfg.conf_threshold)
                valid, top1, _ = step_correct(d.steps, d.target_greedy, batch["loss_mask"], d.d2t, topk=1)
                blk.add(top1, valid, valid[0], d.confidence)
    finally:
        head.train(was_training)
    if acc is None:
        return {}
    if reduce is not None:
        acc.sums = reduce(acc.sums.to(torch.float64)).cpu()
        if blk is not None:
            blk.sums = reduce(blk.sums.to(torch.float64)).cpu()
        if tree is not None:
            tree.sums = reduce(tree.sums.to(torch.float64)).cpu()
    return {**acc.metrics(cfg), **(blk.metrics() if blk is not None else {}),
            **(tree.metrics() if tree is not None else {})}

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
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specheads.train.losses import simulated_tau, step_correct


@dataclass
class EvalConfig:
    every_steps: int = 200  # optimizer steps between evaluations (0 = only at the end)
    max_samples: int = 64  # held-out samples per evaluation (all processes together)
    batch_size: int = 4  # samples per process per forward
    topk: int = 5  # top-k accuracy reported beside top-1
    tree_width: int = 2  # simulated full tree: branching per depth
    tree_depth: int = 5  # simulated full tree: depth (2^1+...+2^5 = 62 nodes)
    eagle_steps: int = 5  # EAGLE-1 unroll depth used for the chain τ
    select: str = "tau_tree"  # metric that picks the best checkpoint: tau_tree | tau_chain
    at_start: bool = True  # evaluate the untrained head first (the baseline τ the training must beat)

    def __post_init__(self) -> None:
        from specheads.utils import SpecheadsError, check_values

        check_values("eval", self, {"every_steps": ">=0", "max_samples": ">=1", "batch_size": ">=1", "topk": ">=1",
                                    "tree_width": ">=1", "tree_depth": ">=1", "eagle_steps": ">=1"})
        if self.select not in ("tau_tree", "tau_chain"):
            raise SpecheadsError(f"eval.select: {self.select!r} is not one of ['tau_tree', 'tau_chain']")


class EvalAccumulator:
    """Sums over batches (and processes, via `reduce`) -> metrics dict."""

    def __init__(self, num_steps: int):
        self.K = num_steps
        # rows: valid, top1, topk per step; then tau_chain sum, tau_tree sum, start count
        self.sums = torch.zeros(3 * num_steps + 3, dtype=torch.float64)

    def add(self, step_logits, target_argmax, loss_mask, d2t, cfg: EvalConfig) -> None:
        valid, top1, topk = step_correct(step_logits, target_argmax, loss_mask, d2t, topk=cfg.topk)
        _, _, tree = step_correct(step_logits, target_argmax, loss_mask, d2t, topk=cfg.tree_width)
        start = valid[0]  # drafting starts at every row whose next drafted token is an assistant token
        K = self.K
        s = self.sums
        s[:K] += valid.flatten(1).sum(1).double().cpu()
        s[K:2 * K] += top1.flatten(1).sum(1).double().cpu()
        s[2 * K:3 * K] += topk.flatten(1).sum(1).double().cpu()
        s[3 * K] += simulated_tau(top1, start).sum().double().cpu()
        s[3 * K + 1] += simulated_tau(tree, start, depth=cfg.tree_depth).sum().double().cpu()
        s[3 * K + 2] += start.sum().double().cpu()

    def metrics(self, cfg: EvalConfig) -> dict[str, float]:
        K, s = self.K, self.sums
        out: dict[str, float] = {}
        for k in range(K):
            n = max(1.0, float(s[k]))
            out[f"top1_{k}"] = float(s[K + k]) / n
            out[f"top{cfg.topk}_{k}"] = float(s[2 * K + k]) / n
        n = max(1.0, float(s[3 * K + 2]))
        out["tau_chain"] = float(s[3 * K]) / n
        out["tau_tree"] = float(s[3 * K + 1]) / n
        out["eval_rows"] = float(s[3 * K + 2])
        return out


@torch.no_grad()
def evaluate(kind: str, head, batches, target, layers, head_layers, cfg: EvalConfig, reduce=None,
             get_hidden=None) -> dict[str, float]:
    """Run the head over `batches` (an iterable of collated dicts) and return the metrics.

    reduce: callable summing a tensor over processes (accelerator.reduce(..., "sum")); get_hidden: callable
    batch -> batch with `hidden` filled (online features); both optional.
    """
    from specheads.train.steps import draft_step_logits

    was_training = head.training
    head.eval()
    acc = None
    try:
        for batch in batches:
            if get_hidden is not None:
                batch = get_hidden(batch)
            steps, d2t, targ = draft_step_logits(kind, head, batch, target, layers, head_layers,
                                                 eagle_steps=cfg.eagle_steps)
            if acc is None:
                acc = EvalAccumulator(len(steps))
            acc.add(steps, targ, batch["loss_mask"], d2t, cfg)
    finally:
        head.train(was_training)
    if acc is None:
        return {}
    if reduce is not None:
        acc.sums = reduce(acc.sums.to(torch.float64)).cpu()
    return acc.metrics(cfg)

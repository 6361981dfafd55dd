"""From a head folder and `--tree` to what build_drafter needs: the head loaded, its tree spec resolved (a tree
head's `auto` probed by autotree.choose_tree_for_head, a block head's `auto` left to its per-step scheduler, or the
whole block for the batched sweep), the tree's record for results.json and the probe's acceptance prior. One
resolver serves `specheads generate`, the single bench and the batched bench; within one run each head folder is
loaded once and probed once, and every scheduler of the run is priced by one cost profile.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from specheads.heads.base import load_head
from specheads.infer.drafters import drafter_kind, parse_tree
from specheads.infer import autotree
from specheads.infer.engine import kernels
from specheads.infer.scheduling.costs import t1_seconds
from specheads.infer.scheduling.profile import load_or_profile
from specheads.infer.scheduling.step import RULE as SCHEDULER_RULE
from specheads.infer.scheduling.step import Scheduler, check_pricing
from specheads.infer.treespec import TreeSpec

BLOCK_AUTO = ("scheduler", "block")  # what `--tree auto` means for a block head (ResolvedHead.spec)


@dataclass
class ResolvedHead:
    """A loaded head and its resolved tree."""

    head: Any  # the DraftHead, eval mode
    spec: TreeSpec  # for build_drafter: a block head's `auto` stays auto (its per-step scheduler)
    tree: dict[str, Any]  # results.json's record: mode, kind, family, reason, summary (+ the probe's fields)
    family: str  # the drafter family of the head's kind (tree heads: static / dynamic; block)

    @property
    def acceptance(self) -> dict[str, Any] | None:
        """A tree head's `--tree auto` probe acceptance (per depth and rank, with counts): its rates' prior under a
        scheduler; None without a probe."""
        acc = self.tree.get("acceptance")
        return {"acc": acc["acc_monotone"], "counts": acc["counts"]} if acc else None


def serve_head(head, target):
    """A loaded head set up for serving: beside a bf16 target on a CPU it runs in bf16 too, as vLLM and SGLang serve
    a draft in the target's dtype (half the bytes its pass streams; its drafts are verified all the same), and its
    own projections and the frozen target projection it reads run on the compiled kernel where it runs
    (engine/kernels.py). fp32 targets keep the head as saved."""
    cpu = all(p.device.type == "cpu" for p in head.parameters())
    if target.dtype == torch.bfloat16 and cpu:
        head = head.to(torch.bfloat16)
        kernels.serve_linears(head)
        head.linear = kernels.linear
    return head


class HeadResolver:
    """One run's heads and trees. `tree`: the `--tree` text every head takes, or {head folder: text}
    (names.head_trees; a folder not in it takes auto); `calib_ids`: the prompts (token ids)
    of a tree head's `auto` probe, or a function returning them, called at the first probe; `refresh`: measure the
    cost profile again before the probe; `pricing`: the run's schedulers' (step.PRICINGS)."""

    def __init__(self, target, tree: str | None | dict[str, str] = "auto",
                 calib_ids: list[list[int]] | Callable[[], list[list[int]]] = (), refresh: bool = False,
                 pricing: str = "measured"):
        self.target, self.tree, self.refresh = target, tree, refresh
        self.pricing = check_pricing(pricing)
        self._calib_ids = calib_ids
        self._heads: dict[str, dict[str, Any]] = {}  # head folder -> {"head", and once probed "spec", "tree"}
        self.costs: dict[str, Any] | None = None  # the cost profile this run's schedulers are priced by

    def calib_ids(self) -> list[list[int]]:
        if callable(self._calib_ids):
            self._calib_ids = self._calib_ids()
        return list(self._calib_ids)

    def resolve(self, head_dir: str, block_auto: str = "scheduler") -> ResolvedHead:
        """The head of `head_dir` and its tree. A block head's `auto`: "scheduler" (the per-step scheduler over its
        block; build_drafter takes spec auto) or "block" (the whole block every step: the batched sweep, whose
        budget cuts it per row)."""
        entry = self._heads.setdefault(str(head_dir), {})
        if "head" not in entry:
            entry["head"] = serve_head(load_head(head_dir, self.target).eval(), self.target)
        head = entry["head"]
        kind = head.config.kind
        family = drafter_kind(kind, head=True).family
        text = self.tree.get(str(head_dir), "auto") if isinstance(self.tree, dict) else self.tree
        spec = parse_tree(text, kind, head)
        if spec.mode == "auto" and family == "block" and block_auto == "block":
            spec = TreeSpec.tokens(head.num_drafts)
            tree = {**given_tree_record(kind, family, spec), "mode": "auto",
                    "reason": "a block head's auto in the batch sweep: every row drafts its whole block each step, "
                              "the +sched budget chooses the prefix each row verifies",
                    "summary": f"the block of {head.num_drafts} drafts every step (+sched: the batch budget cuts it)"}
        elif spec.mode == "auto" and family == "block":
            tree = {"mode": "auto", "kind": kind, "family": family, "reason": SCHEDULER_RULE,
                    "summary": f"per-step scheduler over the block of {head.num_drafts} drafts (prefix that pays)"}
        elif spec.mode == "auto":
            if "spec" not in entry:
                entry["spec"], entry["tree"] = autotree.choose_tree_for_head(self.target, head, self.calib_ids(),
                                                                             refresh=self.refresh)
            spec, tree = entry["spec"], dict(entry["tree"])
            if self.costs is None:  # the profile the probe settled on prices the run's schedulers
                self.costs = tree["profile"]
        else:
            tree = given_tree_record(kind, family, spec)
        return ResolvedHead(head, spec, tree, family)

    def scheduler(self) -> Scheduler:
        """A fresh per-step scheduler priced by the run's cost profile: the one a `--tree auto` probe of this run
        settled on, else read (or measured) once per run."""
        if self.costs is None:
            prof = load_or_profile(self.target, refresh=self.refresh)
            self.costs = {"verify_relative": prof["verify"]["relative"], "t1_s": t1_seconds(prof),
                          **{k: prof.get(k) for k in ("path", "cached", "noisy", "measured_at")}}
        return Scheduler(self.costs["verify_relative"], self.costs["t1_s"], profile=self.costs, pricing=self.pricing)


def given_tree_record(kind: str, family: str, spec: TreeSpec) -> dict[str, Any]:
    """results.json's record of a tree given with --tree."""
    tree: dict[str, Any] = {"mode": spec.text, "kind": kind, "family": family, "reason": "given with --tree",
                            "summary": f"{spec.summary()} (given)"}
    if spec.mode == "dynamic":
        tree.update(total_tokens=spec.total_tokens, depth=spec.depth, top_k=spec.top_k)
    elif spec.mode == "static":
        tree.update(choices=[list(c) for c in spec.choices], total_tokens=len(spec.choices))
    elif spec.mode == "blocktree" and spec.total_tokens:  # a fixed tree over the block (tree:N)
        tree.update(total_tokens=spec.total_tokens)
    return tree

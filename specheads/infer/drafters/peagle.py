"""P-EAGLE heads (heads/peagle.py): served as block drafters. One head pass per step drafts the K tokens after the
root as a chain (the new true rows plus K-1 mask rows); the scheduler chooses the prefix to verify (`--tree auto`)
or a fixed number of drafts is sent. The DSpark drafter's proposal, scheduling and learning are reused; this one
only tells the head's cache the sequence so far, since a true row t pairs the target feature f_t with x_{t+1}."""
from __future__ import annotations

from specheads.infer.drafters.dspark import DSparkDrafter, block_drafter
from specheads.infer.drafters.registry import DrafterKind, register_drafter
from specheads.infer.engine.protocol import DraftContext, Drafter
from specheads.infer.scheduling.acceptance import Candidates
from specheads.infer.scheduling.step import Scheduler
from specheads.infer.tree import DraftTree
from specheads.infer.treespec import TreeSpec


class PEagleDrafter(DSparkDrafter):
    """DSparkDrafter over a P-EAGLE head: the head has no confidence head, so each depth's acceptance is learned per
    request (DSparkDrafter.depth_rates); sampling draws each draft from its own row's warped distribution (those
    rows are the tree's q, so verify_sampling stays lossless)."""
    name = "peagle"

    def candidates(self, ctx: DraftContext) -> Candidates:
        if self.cache is not None:
            self.cache.ids = ctx.ids  # the tokens the pending rows pair with (root last)
        return super().candidates(ctx)

    @staticmethod
    def propose_many(drafters: list["PEagleDrafter"], ctxs: list[DraftContext]) -> list[DraftTree]:
        for d, c in zip(drafters, ctxs):
            if d.cache is not None:
                d.cache.ids = c.ids
        return DSparkDrafter.propose_many(drafters, ctxs)


def _peagle(target, head, spec: TreeSpec, scheduler: Scheduler | None = None) -> Drafter:
    return block_drafter(PEagleDrafter, head, spec, scheduler)


register_drafter(DrafterKind("peagle", "block", "a P-EAGLE head", _peagle, default_tree="auto", head=True))

"""P-EAGLE heads (heads/peagle.py): served as block drafters by the block drafter (drafters/dspark.py), composed, not
subclassed. One head pass per step drafts the K tokens after the root as a chain (the new true rows plus K-1 mask
rows); the scheduler chooses the prefix to verify (`--tree auto`) or a fixed number of drafts is sent. The head
has no confidence head, so each depth's acceptance is learned per request; sampling draws each draft from its own
row's warped distribution (those rows are the tree's q, so verify_sampling stays lossless). The drafter tells the
head's cache the sequence so far (cache.ids) before each draft, since a true row t pairs f_t with x_{t+1}."""
from __future__ import annotations

from specheads.infer.drafters.dspark import DSparkDrafter, block_drafter
from specheads.infer.drafters.registry import DrafterKind, register_drafter
from specheads.infer.scheduling.step import Scheduler
from specheads.infer.treespec import TreeSpec


def PEagleDrafter(head, scheduler: Scheduler | None = None,  # noqa: N802 (the name the class had)
                  num_tokens: int | None = None, tree_nodes: int | None = None) -> DSparkDrafter:
    """The block drafter over a P-EAGLE head (its proposals report the source peagle)."""
    return DSparkDrafter(head, scheduler=scheduler, num_tokens=num_tokens, tree_nodes=tree_nodes, name="peagle")


def _peagle(target, head, spec: TreeSpec, scheduler: Scheduler | None = None) -> DSparkDrafter:
    return block_drafter(PEagleDrafter, head, spec, scheduler)


KIND = register_drafter(DrafterKind("peagle", "block", "a P-EAGLE head", _peagle, default_tree="auto", head=True))

"""Plain decoding through the speculative loop: the drafter that drafts nothing (τ = 1.00)."""
from __future__ import annotations

from specheads.infer.drafters.registry import DrafterKind, register_drafter
from specheads.infer.engine.protocol import Drafter
from specheads.infer.treespec import TreeSpec


class NoDrafter(Drafter):
    """Plain decoding through the same loop (τ = 1.00): the baseline every drafter is compared with."""
    name = "plain"


def _plain(target, head, spec: TreeSpec) -> Drafter:
    return NoDrafter()


register_drafter(DrafterKind("plain", "none", "plain decoding", _plain))

"""Set-up shared by several test modules (imported as `helpers`: tests/ is on the path, as for `test_generate`)."""
from __future__ import annotations

import torch

from specheads.heads import build_head
from specheads.heads.base import HeadSpec
from specheads.heads.kinds import kind_spec
from specheads.infer.drafters import Drafter


class Recording(Drafter):
    """Wraps a drafter and records every tree it proposes (tokens, parents). clear_on_reset: each generation starts
    an empty log (False: the log gathers every generation the drafter serves, e.g. a sampling loop)."""

    def __init__(self, inner, log, clear_on_reset: bool = True):
        self.inner, self.log, self.feature_layers = inner, log, inner.feature_layers
        self.clear_on_reset = clear_on_reset

    def reset(self, prompt_ids, features):
        if self.clear_on_reset:
            self.log.clear()
        self.inner.reset(prompt_ids, features)

    def propose(self, ctx):
        tree = self.inner.propose(ctx)
        self.log.append((tree.tokens.tolist(), tree.parents.tolist()))
        return tree

    def observe(self, tree, accepted, features):
        self.inner.observe(tree, accepted, features)


def make_head(target, kind: str, seed: int = 3, scale: float = 0.1, **overrides):
    """The kind's example head (KindSpec.example, then `overrides` of its HeadSpec fields) on `target`, moved far
    from its initialisation by `scale` (so that every part matters; 0: as built); a draft vocabulary is the
    highest target ids."""
    spec = HeadSpec(kind=kind, **{**kind_spec(kind).example, **overrides})
    counts = torch.arange(target.vocab_size) if spec.draft_vocab_size else None
    head = build_head(spec, target, token_counts=counts)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(scale * torch.randn_like(p))
    return head

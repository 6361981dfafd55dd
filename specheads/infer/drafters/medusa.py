"""Medusa heads (Cai et al. 2024, arXiv 2401.10774): K heads over the target's last hidden state each predict one
more token ahead; their top-k tokens fill a static tree of rank paths ("choices")."""
from __future__ import annotations

import torch

from specheads.infer.drafters.registry import DrafterKind, register_drafter
from specheads.infer.engine.protocol import DraftContext, Drafter
from specheads.infer.tree import DEFAULT_MEDUSA_CHOICES, DraftTree, chain_tree, normalize_choices, tree_from_choices
from specheads.infer.treespec import TreeSpec, name_static_tree


class MedusaDrafter(Drafter):
    """Medusa heads over the target's last (post-norm) hidden state at the last cached position. head k predicts
    the token k+2 after that position, i.e. depth k+1 below the root. Static tree from rank `choices`."""
    name = "medusa"

    def __init__(self, head, choices=None):
        self.head = head
        self.num_heads = int(head.num_heads)  # K
        choices = normalize_choices(choices or DEFAULT_MEDUSA_CHOICES)
        self.choices = [c for c in choices if len(c) <= self.num_heads]  # never deeper than the heads
        self.ranks = 1 + max(max(c) for c in self.choices)  # top-k per head: only as many ranks as the tree uses
        self.depth = max(len(c) for c in self.choices)  # heads the tree reaches
        self.feature_layers = list(head.config.feature_layers)
        self.last: torch.Tensor | None = None  # [D] target feature at the last cached position

    def reset(self, prompt_ids, features) -> None:
        self.last = None if features is None or features.shape[0] == 0 else features[-1]

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftTree:
        if self.last is None or ctx.max_depth <= 0:
            return chain_tree(ctx.ids[-1], [])
        p = next(self.head.parameters())
        depth = min(self.depth, ctx.max_depth)  # run only the heads the tree reaches (e.g. 1 of 3 for one node)
        logits = self.head(self.last[None, None].to(p.device, p.dtype), heads=depth)[:, 0, 0]  # [depth, V']
        topk = self.head.to_target_ids(logits.topk(self.ranks, dim=-1).indices).cpu()  # [depth, R] target ids
        return tree_from_choices(ctx.ids[-1], topk, self.choices)  # choices deeper than `depth` are left out

    def observe(self, tree, accepted, features) -> None:
        self.last = features[-1]


def _medusa(target, head, spec: TreeSpec) -> Drafter:
    return MedusaDrafter(head, choices=[list(c) for c in spec.choices])


KIND = register_drafter(DrafterKind("medusa", "static", "a Medusa head", _medusa, default_tree="default", head=True))
name_static_tree(KIND.name, DEFAULT_MEDUSA_CHOICES)  # --tree medusa: the Medusa paper's tree, as --tree default

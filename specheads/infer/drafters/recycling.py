"""Token Recycling (Luo et al., ACL 2025, arXiv 2408.08696): a training-free drafter that reads its tree off an
adjacency table of the target's own top-k next tokens, filled from every target forward."""
from __future__ import annotations

import torch

from specheads.infer.drafters.registry import DrafterKind, register_drafter
from specheads.infer.engine.protocol import DraftContext, Drafter
from specheads.infer.tree import DEFAULT_MEDUSA_CHOICES, DraftTree, tree_from_paths
from specheads.infer.treespec import TreeSpec


class TokenRecyclingDrafter(Drafter):
    """Token Recycling (Luo et al., ACL 2025, arXiv 2408.08696): a training-free drafter built from the candidates
    each target forward computes and plain decoding throws away.

    An adjacency table M [V, k] holds, for every token x, the target's top-k next tokens the last time x was fed to
    it, at any node of a verified tree (accepted or not) or of the prompt:
        after each forward over tokens x_1..x_N with logits l_1..l_N:   M[x_i] = topk(l_i, k)
    Each step the draft tree is read off M from the root by breadth-first search over a static template of rank paths
    (Medusa's default tree here, 25 nodes, depth 4): path c + [r] gets token M[token(c), r]; a path whose parent is
    missing or whose entry is still empty is left out. The table outlives `reset` (the paper's hot start: what one
    request taught serves the next); SmolLM2's 49,152 x 8 int32 entries take 1.5 MB.
    Verification never depends on it: the tree's tokens are deterministic guesses checked exactly (greedy) or as
    one-hot drafts (sampling). Shapes: N tree nodes, V vocab."""
    name = "recycling"
    reads_logits = True

    def __init__(self, vocab_size: int, choices: list[list[int]] | None = None, k: int = 8):
        choices = [list(c) for c in (choices or DEFAULT_MEDUSA_CHOICES)]
        self.choices = sorted(choices, key=len)  # breadth first: every parent before its children
        self.k = max(int(k), 1 + max(max(c) for c in self.choices))  # candidates kept per token (the paper: 8)
        self.table = torch.full((int(vocab_size), self.k), -1, dtype=torch.int32)  # -1: not seen yet

    def recycle(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """tokens [N], logits [N, V]: the target's output after each token; later rows win for repeated tokens."""
        if tokens.numel():
            top = logits.topk(self.k, dim=-1).indices.to("cpu", torch.int32)  # [N, k]
            self.table[tokens.to("cpu", torch.long)] = top

    def propose(self, ctx: DraftContext) -> DraftTree:
        def token(path: tuple[int, ...], parent_token: int) -> int | None:
            if len(path) > ctx.max_depth:
                return None
            t = int(self.table[parent_token, path[-1]])
            return t if t >= 0 else None  # -1: the parent token's entry is still empty

        return tree_from_paths(int(ctx.ids[-1]), self.choices, token)


def _recycling(target, head, spec: TreeSpec) -> Drafter:
    """Token Recycling over the given static tree's rank paths."""
    return TokenRecyclingDrafter(target.vocab_size, choices=[list(c) for c in spec.choices])


register_drafter(DrafterKind("recycling", "static", "token recycling", _recycling, default_tree="default"))

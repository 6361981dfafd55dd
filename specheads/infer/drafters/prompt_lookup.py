"""Prompt lookup decoding (Saxena 2023): the tokens that followed the latest earlier occurrence of the context's
last n-gram, proposed as a chain. No model, no training."""
from __future__ import annotations

import torch

from specheads.infer.drafters.registry import DrafterKind, register_drafter
from specheads.infer.engine.protocol import DraftContext, Drafter
from specheads.infer.scheduling.acceptance import MATCH_CAP
from specheads.infer.tree import DraftTree, chain_tree
from specheads.infer.treespec import TreeSpec


class PromptLookupDrafter(Drafter):
    """Prompt lookup decoding: find the latest earlier occurrence of the context's last n-gram (n from max_ngram
    down to min_ngram) and propose the k tokens that followed it, as a chain. No model, no training."""
    name = "prompt-lookup"

    def __init__(self, num_tokens: int = 8, max_ngram: int = 3, min_ngram: int = 1):
        self.k, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram  # k: draft tokens per step

    def propose(self, ctx: DraftContext) -> DraftTree:
        return chain_tree(ctx.ids[-1], self.find(ctx.ids, min(self.k, ctx.max_depth))[0])

    def find(self, ids: list[int], k: int) -> tuple[list[int], int]:
        """(up to k continuation tokens, match length: context tokens before the continuation equal to the
        context's last ones, counted up to acceptance.MATCH_CAP); ([], 0) without a match."""
        t = torch.tensor(ids)
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            if n <= 0 or k <= 0:
                break
            windows = t.unfold(0, n, 1)[:-1]  # [T-n, n] every earlier n-gram (the last one is the query itself)
            hits = (windows == t[-n:]).all(-1).nonzero().flatten()
            if hits.numel():
                start = int(hits[-1]) + n  # latest match
                cont = ids[start:start + k]
                if cont:
                    match = n
                    while match < MATCH_CAP and start - 1 - match >= 0 and ids[start - 1 - match] == ids[-1 - match]:
                        match += 1
                    return cont, match
        return [], 0


def _prompt_lookup(target, head, spec: TreeSpec, max_ngram: int = 3) -> Drafter:
    return PromptLookupDrafter(num_tokens=spec.num_tokens, max_ngram=max_ngram)


register_drafter(DrafterKind("prompt-lookup", "tokens", "prompt-lookup", _prompt_lookup, default_tree="8"))

"""Teacher-forced τ of a block head's best-first tree (infer/drafters/blocktree.py, `--tree tree:N`), scored as the
drafter builds it, so the held-out / dev walk predicts the served τ of the tree as it does the chain's.

At a start row t the block's K positions give each rank r of position j the factor the drafter uses
(blocktree.rank_factors: rank 0 the calibrated confidence c_j, or without a confidence head the batch's rate of
first-rank hits at depth j, what the drafter's learned per-depth rate settles on; ranks >= 1 the rest of the mass
as the head's distribution shares it); the tree is the `nodes` best-first rank paths; the accepted length is 1 +
the depth of the deepest tree path whose ranks are the target's greedy tokens' ranks. Teacher forcing reads each
position's distribution after the TRUE tokens, which is serving's own block on every path through the chain (the
block's Markov bias reads the chain's drafts, which the target then emitted); after an accepted off-chain rank
serving reads the chain's draft there instead (one block pass), the one difference.
Shapes: K drafts per block, B rows, T positions, V' draft vocabulary, R ranks per position.
"""
from __future__ import annotations

import torch

from specheads.infer.drafters.blocktree import BRANCH, best_first, rank_factors
from specheads.train.losses import shift_rows, step_mask
from specheads.train.walk import RATIO_FIELDS, ratio_and_se, ratio_sums, walk_batch

DEFAULT_NODES = 16  # draft nodes of the scored tree (`--tree tree:16`)


@torch.no_grad()
def block_tree_lengths(steps: list[torch.Tensor], conf: torch.Tensor | None, target_argmax: torch.Tensor,
                       loss_mask: torch.Tensor, d2t: torch.Tensor | None, nodes: int = DEFAULT_NODES
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted length [B,T] of the `nodes`-node best-first tree started at each row, start rows [B,T] bool).
    steps: K [B,T,V'] logits (step k row t predicts token t+2+k); conf [K,B,T] calibrated or None."""
    K = len(steps)
    ranks, probs, valid = [], [], []
    for k, lg in enumerate(steps):
        m = step_mask(loss_mask, k)  # [B,T]
        want = shift_rows(target_argmax, 1 + k)
        top_p, top_i = torch.softmax(lg.float(), -1).topk(min(BRANCH, lg.shape[-1]), dim=-1)  # [B,T,R]
        if d2t is not None:
            top_i = d2t.to(top_i.device)[top_i]
        hit = (top_i == want.unsqueeze(-1)) & m.unsqueeze(-1)  # [B,T,R]
        ranks.append(torch.where(hit.any(-1), hit.float().argmax(-1), -1))  # [B,T] the true token's rank, -1: none
        probs.append(top_p)
        valid.append(m)
    start = valid[0]
    if conf is None:  # the batch's first-rank hit rate per depth, given the drafts before were right
        chain = torch.cumprod(torch.stack([r == 0 for r in ranks]).long(), 0)  # [K,B,T]
        before = torch.cat([start[None].long(), chain[:-1]])
        rate = [(float(chain[k].sum()) + 1.0) / (float(before[k].sum()) + 2.0) for k in range(K)]
        conf = torch.tensor(rate).view(K, 1, 1).expand(K, *start.shape)
    rk = torch.stack(ranks).cpu().tolist()  # [K][B][T]
    pr = torch.stack(probs).cpu().tolist()  # [K][B][T][R]
    cf = conf.float().cpu().tolist()
    out = torch.ones(start.shape, dtype=torch.long)
    for b, t in start.nonzero().tolist():
        tree = {p for p, _ in best_first([rank_factors(cf[k][b][t], pr[k][b][t]) for k in range(K)], nodes)}
        depth, path = 0, ()
        while depth < K and rk[depth][b][t] >= 0 and path + (rk[depth][b][t],) in tree:
            path += (rk[depth][b][t],)
            depth += 1
        out[b, t] = 1 + depth
    return out, start.cpu()


class BlockTreeAccumulator:
    """tau_blocktree (per start row) and tau_blocktree_walk (the serving walk) of a block head's best-first tree,
    summed over batches and processes as the EvalAccumulator's ratios."""

    RATIOS = ("tau_blocktree", "tau_blocktree_walk")

    def __init__(self, nodes: int = DEFAULT_NODES):
        self.nodes = nodes
        self.sums = torch.zeros(RATIO_FIELDS * len(self.RATIOS) + 1, dtype=torch.float64)  # ratios, then samples

    def add(self, steps, conf, target_argmax, loss_mask, d2t) -> None:
        acc, start = block_tree_lengths(steps, conf, target_argmax, loss_mask, d2t, self.nodes)
        rows = start.sum(1)  # [B]
        parts = [(torch.where(start, acc, 0).sum(1), rows), walk_batch(acc, start)]
        for i, (y, n) in enumerate(parts):
            self.sums[RATIO_FIELDS * i:RATIO_FIELDS * (i + 1)] += ratio_sums(y, n)
        self.sums[-1] += float((rows > 0).sum())

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {"blocktree_nodes": float(self.nodes)}
        for i, name in enumerate(self.RATIOS):
            r, se = ratio_and_se(self.sums[RATIO_FIELDS * i:RATIO_FIELDS * (i + 1)], float(self.sums[-1]))
            out[name] = r
            if se == se:
                out[f"{name}_se"] = se
        return out

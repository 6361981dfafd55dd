"""P-EAGLE (heads/peagle.py): every depth of the drafter trained in one forward, the chains sampled with COD
(conditional drop; speculators models/peagle/data.py generate_cod_sample_indices, its PEagleArgs
down_sample_ratio 0.7 / down_sample_ratio_min 0.2 = our train.peagle.cod_ratio / cod_ratio_min).

COD, per sequence, with n the rows whose depth-0 prediction counts (loss_mask[t+2] = 1, "valid" rows) and the pool
P_1 = those rows as positions p (a chain (a, d) sits at position p = a + d):

    keep_d = floor( max(0, n - d) · max(r^d, r_min) )                    d = 1 .. K-1; stop at keep_d = 0
    S_d    = keep_d positions drawn uniformly from P_d (all of P_d when it holds fewer), ascending; anchors S_d - d
             (P_1 only positions p >= 1: an anchor row must exist)
    P_{d+1} = { p + 1 : p in S_d, row p + 1 valid }                        so every chain (a, d) has its (a, d-1)

Depth 0 runs on every row (later depths attend it). The loss is speculators' compute_metrics: one mean of the
distillation loss (train.loss; default KL, speculators' kl_div) over every counted row of every depth pooled, each
row against the target's distribution of the token it predicts (chain (a, d) predicts x_{a+2+d}: the target's
row a+1+d); with a draft vocabulary, rows whose target argmax lies outside it are left out (as EAGLE-3).
The alignment is ours (docs/architecture.md "One alignment"); speculators' shifted batch counts a row by its input
token's mask instead of its predicted token's, one position apart.
Evaluation drafts every depth at every row (no COD): K steps [B,T,V'], step d at row t predicts x_{t+2+d}.
"""
from __future__ import annotations

import torch

from specheads.train.kinds import eagle3
from specheads.train.kinds.base import HeadKind, States, at_rows, draft_vocab, noisy_features, unwrap
from specheads.train.losses import (BLOCK_WEIGHTINGS, DPACE_ALPHA, LossOutput, distill_loss, dpace_position_weights,
                                    per_counted, shift_rows, step_mask, target_token_prob)
from specheads.train.teacher import target_rows


def cod_keep(n: int, d: int, ratio: float, ratio_min: float) -> int:
    """keep_d: the chains COD keeps at depth d of a sequence with n valid rows (before the pool bound)."""
    return int(max(0, n - d) * max(ratio ** d, ratio_min))


def cod_chains(loss_mask: torch.Tensor, num_depths: int, ratio: float, ratio_min: float,
               generator: torch.Generator | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """loss_mask [B,T] -> per depth d = 1, 2, ... (anchors [B,M_d] long ascending, valid [B,M_d] bool; padding
    anchors 0 and invalid), M_d the most kept of a row; depths no row keeps are left off. Draws come from
    `generator` (on its own device) or torch's global RNG."""
    valid0 = step_mask(loss_mask, 0).cpu()  # [B,T] rows whose x_{t+2} counts
    B, T = valid0.shape
    dev = generator.device if generator is not None else torch.device("cpu")
    kept: list[list[torch.Tensor]] = [[] for _ in range(num_depths - 1)]
    for b in range(B):
        ok = valid0[b]
        pool = ok.nonzero().flatten()
        n = int(pool.numel())
        for d in range(1, num_depths):
            pool = pool[pool >= d]
            size = cod_keep(n, d, ratio, ratio_min)
            if size <= 0 or not pool.numel():
                break
            if pool.numel() > size:
                draw = torch.randperm(int(pool.numel()), generator=generator, device=dev)[:size].cpu()
                pool = pool[draw].sort().values
            kept[d - 1].append(pool - d)
            nxt = pool + 1
            nxt = nxt[nxt < T]
            pool = nxt[ok[nxt]]
    out = []
    for rows in kept:
        M = max((int(r.numel()) for r in rows), default=0)
        if M == 0:
            break
        anchors = torch.zeros(B, M, dtype=torch.long)
        valid = torch.zeros(B, M, dtype=torch.bool)
        for b, r in enumerate(rows):  # rows of sequences that stopped earlier stay padding
            anchors[b, :r.numel()], valid[b, :r.numel()] = r, True
        out.append((anchors.to(loss_mask.device), valid.to(loss_mask.device)))
    return out


def _depth_rows(d: int, loss_mask: torch.Tensor, chains):
    """The rows depth d's logits hold: (b, j) into logits[d], the chain's anchor a and the target row it predicts
    (chain (a, d) predicts x_{a+2+d}: the target's row a+1+d). Depth 0 is the chain (t, 0) of every valid row t."""
    if d == 0:
        bi, ti = step_mask(loss_mask, 0).nonzero(as_tuple=True)
        return bi, ti, ti, ti + 1
    anchors, valid = chains[d - 1]
    bi, j = valid.nonzero(as_tuple=True)
    a = anchors[bi, j]
    return bi, j, a, a + 1 + d


def chain_dpace_weights(q: list[torch.Tensor], where: list[tuple], shape: tuple[int, int],
                        alpha: float) -> list[torch.Tensor]:
    """D-PACE over P-EAGLE's chains: each anchor's drafts at depths 0..K-1 form one block (the K drafts one pass
    gives at inference), so draft (a, d) is weighted as a block drafter's draft d (losses.dpace_position_weights)
    with the depths COD left out counting as not drafted. q[d] [N_d] the draft's probability of the target's token
    (0 where it lies outside V'), where[d] = (b, a) of those rows, shape (B, T) -> per depth the weights [N_d]."""
    K = len(q)
    Q = torch.zeros(*shape, K, device=q[0].device)
    V = torch.zeros(*shape, K, dtype=torch.bool, device=q[0].device)
    for d, (qd, (bi, a)) in enumerate(zip(q, where)):
        Q[bi, a, d], V[bi, a, d] = qd.float(), True
    w = dpace_position_weights(Q.view(-1, K), V.view(-1, K), alpha).view(*shape, K)
    return [w[bi, a, d] for d, (bi, a) in enumerate(where)]


def peagle_loss(logits: list[torch.Tensor], chains, rows, loss_mask: torch.Tensor, d2t, loss,
                weighting: str = "exp", dpace_alpha: float = DPACE_ALPHA) -> LossOutput:
    """The pooled loss over depth 0 (logits[0] [B,T,V'], rows t with loss_mask[t+2]) and the sampled chains
    (logits[d] [B,M_d,V'] for chains[d-1]); rows: teacher.TargetRows; per-depth accuracy metrics acc_d.
    weighting (train.block.weighting): "exp" = speculators' pooled mean (P-EAGLE has no position decay; gamma is
    unread), "dpace" = each row's ℓ weighted by chain_dpace_weights and, as dspark_loss reduces D-PACE, summed
    over the number of counted rows: Σ w ℓ / Σ 1."""
    picked, metrics, q, where = [], {}, [], []
    for d, lg in enumerate(logits):
        bi, j, a, trow = _depth_rows(d, loss_mask, chains)
        tk, lse = rows.at(bi, trow)
        lk = lg[bi, j]
        keep = rows.in_vocab[bi, trow] if d2t is not None else torch.ones_like(bi, dtype=torch.bool)
        if weighting == "dpace":  # a target token outside V' is never accepted: q = 0 there
            q.append(target_token_prob(lk, tk) * keep.float())
            where.append((bi, a))
        picked.append((lk[keep], tk[keep], None if lse is None else lse[keep], keep))
        if keep.any():
            metrics[f"acc_{d}"] = (lk[keep].argmax(-1) == tk[keep].argmax(-1)).float().mean().detach()
    lse = None if picked[0][2] is None else torch.cat([p[2] for p in picked])
    weights = None
    if weighting == "dpace":
        ws = chain_dpace_weights(q, where, tuple(loss_mask.shape), dpace_alpha)
        weights = torch.cat([w[p[3]] for w, p in zip(ws, picked)])
    elif weighting != "exp":
        raise ValueError(f"block weighting {weighting!r}: expected one of {BLOCK_WEIGHTINGS}")
    total, parts = distill_loss(torch.cat([p[0] for p in picked]), torch.cat([p[1] for p in picked]), loss, lse,
                                weights=weights)
    if weights is not None:  # D-PACE: Σ w ℓ / the counted rows
        total, parts = per_counted(total, parts, weights, weights.numel())
    metrics.update(parts)
    return LossOutput(total, metrics)


def loss(head, batch: dict, h_in: torch.Tensor, h_last: torch.Tensor, target, settings) -> LossOutput:
    """COD-sampled chains, one forward over every depth, the pooled distillation loss."""
    ids, lmask = batch["input_ids"], batch["loss_mask"]
    inner = unwrap(head)
    d2t, dist, cfg = draft_vocab(inner), settings.distill("peagle"), settings.peagle
    rows = target_rows(target, h_last, lmask, d2t, batch, need_greedy=d2t is not None, need_lse=dist.needs_lse)
    chains = cod_chains(lmask, inner.num_drafts, cfg.cod_ratio, cfg.cod_ratio_min, settings.generator)
    out = head(noisy_features(h_in, settings), shift_rows(ids, 1), batch["attention_mask"], chains)
    return peagle_loss(list(out), chains, rows, lmask, d2t, dist, settings.block.weighting,
                       settings.block.dpace_alpha)


def states(head, batch: dict, h_in: torch.Tensor, visited: States) -> torch.Tensor:
    """On-policy replay: every depth at every row (the forward without chains, the K drafts one pass gives at
    inference, no depth reading a drafted token) -> [S,V'] at the visited states."""
    out = head(h_in.float(), shift_rows(batch["input_ids"], 1), batch["attention_mask"])
    return at_rows(list(out), visited)


# evaluation: every depth at every row (the K drafts one pass gives at inference), teacher-forced on the features,
# the same call as EAGLE-3's TTT steps (the head's forward without chains)
KIND = HeadKind("peagle", loss, eagle3.drafts, states)

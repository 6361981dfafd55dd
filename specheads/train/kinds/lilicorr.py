"""LiLiCorr block drafters (heads/lilicorr.py): the block kind's step (kinds/block.py: anchors, the target's rows
p+j, teacher forcing) with ModelOpt's objective (hf_lilicorr.py `_compute_loss`, `_compute_lilicorr_loss`,
`_distractor_penalty`), its weights absolute (no outer multiplier):

    L = L_block(U) + w_ce · L_ce + w_margin · L_margin + w_pen · L_pen

    z_j     = S_j along the data's chain: z_0 = start, z_j = pair_{j-1}(r*_{j-1}, ·)    r*_j the rank of y_j in C_j
    L_ce    = Σ_{j ∈ M} -log softmax(z_j)[r*_j] / |M|
    L_margin= Σ_{j ∈ M} relu(m - (z_j[r*_j] - max_{r ≠ r*_j} z_j[r])) / |M|
    L_pen   = Σ_{j ∈ M} Σ_r softmax(z_j)[r] · relu(T_j(y_j) - T_j(C_j[r])) / |M|

y_j = x_{p+1+j} the data's token (ModelOpt's ground truth is the sequence's token, not the target's argmax), T_j the
target's logits at row p+j (detached; the logsumexp cancels in the difference), m = train.block.lilicorr_margin.
M = the supervised drafts: the block's every draft is valid (ModelOpt trains a block only when all its slots are
supervised) and y_0 .. y_j all lie in their lattices (the forced prefix: the chain can only be walked while the
data's tokens are candidates; nothing is injected). L_block is losses.dspark_loss on U (train.loss, exp or D-PACE
weights, train.block); the lattice terms reach the backbone through ℓ (U) and h. Evaluation drafts with the lattice's
logits (kinds/block.py's drafts through LiLiCorrHead.heads, teacher-forced). Shapes: N blocks, K' drafts,
k candidates.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specheads.train.kinds import block
from specheads.train.kinds.base import HeadKind, unwrap
from specheads.train.losses import LossOutput, dspark_loss
from specheads.train.teacher import has_sidecar


def chain_scores(start: torch.Tensor, pair: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """z_j along the data's chain: start [N,k], pair [N,K'-1,k,k], ranks [N,K'] (r*_j, any value where y_j is not a
    candidate: those drafts leave the loss) -> z [N,K',k]."""
    rows = [start]
    for j in range(pair.shape[1]):
        r = ranks[:, j].view(-1, 1, 1).expand(-1, 1, pair.shape[-1])
        rows.append(pair[:, j].gather(1, r).squeeze(1))
    return torch.stack(rows, 1)


def lattice_loss(start, pair, cand, y, valid, tgt, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    """The three lattice terms of the module docstring: start [N,k], pair [N,K'-1,k,k], cand [N,K',k], y [N,K'] the
    data's tokens, valid [N,K'] bool, tgt [N,K',V] the target's logits, cfg train.block -> (weighted sum, metrics)."""
    hits = cand == y.unsqueeze(-1)  # [N,K',k]
    ranks = hits.long().argmax(-1)  # r*_j (0 where missing: masked below)
    forced = hits.any(-1).long().cumprod(-1).bool()  # y_0 .. y_j all in their lattices
    sup = (forced & valid.all(-1, keepdim=True)).float()  # [N,K']
    denom = sup.sum().clamp_min(1.0)
    z = chain_scores(start.float(), pair.float(), ranks)  # [N,K',k]
    logq = F.log_softmax(z, -1)
    ce = -logq.gather(-1, ranks.unsqueeze(-1)).squeeze(-1)  # [N,K']
    l_ce = (ce * sup).sum() / denom
    total = cfg.lilicorr_w_ce * l_ce
    z_gt = z.gather(-1, ranks.unsqueeze(-1)).squeeze(-1)
    rival = z.scatter(-1, ranks.unsqueeze(-1), float("-inf")).amax(-1) if z.shape[-1] > 1 else z_gt
    gap = z_gt - rival
    l_margin = (torch.relu(cfg.lilicorr_margin - gap) * sup).sum() / denom
    if cfg.lilicorr_w_margin > 0 and z.shape[-1] > 1:  # k = 1: no rival, no hinge (ModelOpt)
        total = total + cfg.lilicorr_w_margin * l_margin
    with torch.no_grad():
        t = tgt.gather(-1, cand).float()  # [N,K',k] T_j at the candidates
        w = (t.gather(-1, ranks.unsqueeze(-1)) - t).clamp_min(0.0)  # relu(T_j(y_j) - T_j(C_j[r]))
    l_pen = ((logq.exp() * w).sum(-1) * sup).sum() / denom
    if cfg.lilicorr_w_pen > 0:
        total = total + cfg.lilicorr_w_pen * l_pen
    with torch.no_grad():
        n = sup.sum().clamp_min(1.0)
        metrics = {"lat_ce": float(l_ce), "lat_margin": float(l_margin), "lat_pen": float(l_pen),
                   "lat_acc": float(((z.argmax(-1) == ranks).float() * sup).sum() / n),
                   "lat_recall": float((hits.any(-1).float() * valid).sum() / valid.float().sum().clamp_min(1.0)),
                   "lat_supervised": float(sup.sum())}
    return total, metrics


def loss(head, batch: dict, h_in: torch.Tensor, h_last: torch.Tensor, target, settings) -> LossOutput:
    """Sampled blocks, teacher-forced: the unary logits against the target's distributions, plus the lattice."""
    ids, lmask = batch["input_ids"], batch["loss_mask"]
    inner, cfg = unwrap(head), settings.block
    anchors, avalid = block.sample_anchors(lmask, cfg.max_anchors, settings.generator)
    K = inner.num_drafts
    valid = block.block_valid(lmask, anchors, K) & avalid[..., None]
    side = (batch["target_greedy"], batch["target_lse"]) if has_sidecar(batch) else None
    tgt, lse, ok = block.block_targets(inner, target, h_last, anchors, valid, cfg.full_vocab, side)
    unary, cand, start, pair = head(h_in.float(), ids, anchors, batch["attention_mask"])
    T = ids.shape[1]
    idx = (anchors[..., None] + 1 + torch.arange(K, device=anchors.device)).clamp(max=T - 1)
    y = ids.gather(1, idx.flatten(1)).view(idx.shape)  # [B,A,K']: x_{p+1+j}
    keep = avalid  # [B,A]: padding blocks leave the loss entirely
    un = dspark_loss(unary[keep], None, tgt[keep], lse[keep], ok[keep], valid[keep], gamma=cfg.gamma,
                     loss=settings.distill("lilicorr"), weighting=cfg.weighting, dpace_alpha=cfg.dpace_alpha)
    lat, metrics = lattice_loss(start[keep], pair[keep], cand[keep], y[keep], valid[keep], tgt[keep], cfg)
    metrics.update(un.metrics)
    return LossOutput(un.loss + lat, metrics)


KIND = HeadKind("lilicorr", loss, block.drafts)

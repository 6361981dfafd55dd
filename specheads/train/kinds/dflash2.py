"""DFlash2 block drafters (heads/dflash2.py): the block kind's step (kinds/block.py: anchors, the target's rows p+j,
teacher forcing) with two terms (speculators models/dflash2 core.py forward and metrics.py compute_metrics):

    L = L_block(U) + α_sel · L_sel
    L_sel = Σ_j w_j · CE_j / Σ_j w_j,   CE_j = -log softmax_{c ∈ C'_j}( S_j(c) )[y_j]

L_block is losses.dspark_loss on the unary logits U (the distillation family of train.loss, exp or D-PACE position
weights, train.block); y_j the target's greedy token at draft j; C'_j the unary top-k with y_j put at rank k-1 where
the top-k misses it (speculators `selector_training_candidates`); S_j the selector's scores with the data's
predecessors; w_j the position weights of the unary term (exp(-j / gamma), or D-PACE with q_j = exp(-CE_j), divided
by the counted drafts as speculators' loss_function divides). α_sel = train.block.selector_alpha (speculators
selector_loss_alpha 1). The selector CE reaches the backbone through U(c) and h_j as in speculators. Evaluation
drafts with the selector's logits (kinds/block.py's drafts, through DFlash2Head.heads, teacher-forced).
Shapes: N blocks, K' drafts, k candidates.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specheads.train.kinds import block
from specheads.train.kinds.base import HeadKind, unwrap
from specheads.train.losses import LossOutput, block_position_weights, dpace_position_weights, dspark_loss
from specheads.train.teacher import has_sidecar


def selector_loss(scores: torch.Tensor, cand: torch.Tensor, want: torch.Tensor, valid: torch.Tensor, gamma: float,
                  weighting: str = "exp", dpace_alpha: float = 0.5) -> tuple[torch.Tensor, dict[str, float]]:
    """L_sel of the module docstring: scores [N,K',k] the selector's S on the candidates cand [N,K',k] (want put in
    where missing), want [N,K'] the target's greedy tokens, valid [N,K'] bool -> (loss, metrics)."""
    N, K, k = scores.shape
    pos = (cand == want.unsqueeze(-1)).long().argmax(-1)  # [N,K']: y_j's rank among C'_j
    ce = F.cross_entropy(scores.reshape(-1, k).float(), pos.reshape(-1), reduction="none").view(N, K)
    v = valid.float()
    if weighting == "dpace":
        w = dpace_position_weights(torch.exp(-ce.detach()), valid, dpace_alpha)
        total = (ce * w).sum() / v.sum().clamp_min(1.0)
    else:
        w = block_position_weights(K, gamma, scores.device) * v
        total = (ce * w).sum() / w.sum().clamp_min(1e-6)  # an empty selection gives 0 and keeps the graph
    metrics = {"sel_ce": float(total.detach())}
    with torch.no_grad():
        picked = scores.argmax(-1) == pos
        for j in range(K):
            if valid[:, j].any():
                metrics[f"sel_acc_{j}"] = float(picked[:, j][valid[:, j]].float().mean())
    return total, metrics


def loss(head, batch: dict, h_in: torch.Tensor, h_last: torch.Tensor, target, settings) -> LossOutput:
    """Sampled blocks, teacher-forced: the unary logits against the target's distributions, plus the selector."""
    ids, lmask = batch["input_ids"], batch["loss_mask"]
    inner, cfg = unwrap(head), settings.block
    anchors, avalid = block.sample_anchors(lmask, cfg.max_anchors, settings.generator)
    valid = block.block_valid(lmask, anchors, inner.num_drafts) & avalid[..., None]
    side = (batch["target_greedy"], batch["target_lse"]) if has_sidecar(batch) else None
    tgt, lse, ok = block.block_targets(inner, target, h_last, anchors, valid, cfg.full_vocab, side)
    want = tgt.argmax(-1)  # [B,A,K'] the target's greedy token (full vocabulary: target ids)
    unary, cand, scores, hit = head(h_in.float(), ids, anchors, batch["attention_mask"], want)
    keep = avalid  # [B,A]: padding blocks leave the loss entirely
    un = dspark_loss(unary[keep], None, tgt[keep], lse[keep], ok[keep], valid[keep], gamma=cfg.gamma,
                     loss=settings.distill("dflash2"), weighting=cfg.weighting, dpace_alpha=cfg.dpace_alpha)
    sel, metrics = selector_loss(scores[keep], cand[keep], want[keep], valid[keep], cfg.gamma, cfg.weighting,
                                 cfg.dpace_alpha)
    metrics.update(un.metrics)
    with torch.no_grad():
        m = valid[keep]
        metrics["sel_recall"] = float(hit[keep][m].float().mean()) if m.any() else 0.0  # y_j in the unary top-k
    return LossOutput(un.loss + cfg.selector_alpha * sel, metrics)


KIND = HeadKind("dflash2", loss, block.drafts)

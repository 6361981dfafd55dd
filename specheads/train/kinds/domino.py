"""Domino block drafters (heads/domino.py): the block kind's step (kinds/block.py: anchors, the target's rows p+j,
teacher forcing) with the loss on both logits of the head, blended by a schedule over the run (SpecForge
`OnlineDominoModel.forward` and `training/strategies/base.py` domino lambda):

    L = (1 - λ) · L_block(corrected logits) + λ · L_block(base logits)
    λ = clamp(λ_0 · (1 - step / max(1, ⌊ratio · steps⌋)), 0, 1)

L_block is losses.dspark_loss (the distillation family with exp or D-PACE position weights, train.block); the
confidence BCE, if the head has a confidence head, reads the corrected logits' acceptance only (counted once).
SpecForge's terms are hard-label CE with exp(-j / gamma) weights; here they are whatever train.loss /
train.block set, as for DSpark. Evaluation drafts with the corrected logits (kinds/block.py's drafts, through
DominoHead.heads).
"""
from __future__ import annotations

import torch

from specheads.train.kinds import block
from specheads.train.kinds.base import HeadKind, States, unwrap
from specheads.train.losses import LossOutput, dspark_loss
from specheads.train.teacher import has_sidecar


def base_weight(step: int, total_steps: int, start: float, ratio: float) -> float:
    """λ of the blend at optimizer step `step` of `total_steps` (SpecForge's domino lambda schedule)."""
    decay_steps = max(1, int(total_steps * ratio))
    return max(0.0, min(1.0, start * (1.0 - min(step, decay_steps) / decay_steps)))


def loss(head, batch: dict, h_in: torch.Tensor, h_last: torch.Tensor, target, settings) -> LossOutput:
    """Sampled blocks, teacher-forced, both logits against the target's distributions, blended by λ."""
    ids, lmask = batch["input_ids"], batch["loss_mask"]
    inner = unwrap(head)
    cfg = settings.block
    anchors, avalid = block.sample_anchors(lmask, cfg.max_anchors, settings.generator)
    base, final, conf = head(h_in.float(), ids, anchors, batch["attention_mask"])  # [B,A,K',V'] x2, [B,A,K']
    valid = block.block_valid(lmask, anchors, inner.num_drafts) & avalid[..., None]
    side = (batch["target_greedy"], batch["target_lse"]) if has_sidecar(batch) else None
    tgt, lse, ok = block.block_targets(inner, target, h_last, anchors, valid, cfg.full_vocab, side)
    keep = avalid
    args = dict(gamma=cfg.gamma, alpha=cfg.confidence_alpha, loss=settings.distill("domino"),
                weighting=cfg.weighting, dpace_alpha=cfg.dpace_alpha)
    fin = dspark_loss(final[keep], None if conf is None else conf[keep], tgt[keep], lse[keep], ok[keep],
                      valid[keep], **args)
    bas = dspark_loss(base[keep], None, tgt[keep], lse[keep], ok[keep], valid[keep], **args)
    lam = base_weight(settings.step, settings.total_steps, cfg.domino_lambda_start, cfg.domino_lambda_decay_ratio)
    metrics = dict(fin.metrics)
    metrics.update({f"base_{k}": v for k, v in bas.metrics.items() if k.startswith("acc_")})
    metrics["lambda_base"] = lam
    return LossOutput((1.0 - lam) * fin.loss + lam * bas.loss, metrics)


def states(head, batch: dict, h_in: torch.Tensor, visited: States) -> torch.Tensor:
    """On-policy replay (kinds/block.states) with the corrected logits, the ones Domino serves."""
    anchors, slot = block.state_anchors(visited, batch["input_ids"].shape[0])
    _, final, _ = head(h_in.float(), batch["input_ids"], anchors, batch["attention_mask"])  # [B,A,K',V']
    return final[visited.b, slot, visited.depth]


KIND = HeadKind("domino", loss, block.drafts, states)

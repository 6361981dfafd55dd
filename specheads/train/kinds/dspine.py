"""DSpine block drafters (heads/dspine.py): the block kind's step (kinds/block.py: sampled anchors, the target's
rows p+j, teacher forcing) with SpecForge's DSpine objective (specforge/algorithms/dspine/model.py
OnlineDSpineModel._objective_terms and forward; DSpineConfig.schedule). Per drafting slot k (draft j = k-1, its
label y = x_{p+k}, its predecessor a = x_{p+k-1}) with position weights w_j (train.block):

    L_backbone = the block loss of the base logits U (losses.dspark_loss: w_ce · CE + w_l1 · L1 by default)
    L_refine   = Σ w_j (w_ce · CE_j + w_l1 · L1_j) / Σ w_j over the top-k candidates c of U_j, scores s_j(a, c):
                 CE_j = -log softmax(s_j)[y] if y ∈ c else 0,
                 L1_j = ||softmax(s_j) - p_j|_c / p_j(c)||_1 if p_j(c) > τ else 0   (p_j: the target's distribution)
    L_align    = Σ_i Σ w_j (1 - cos(f(z^i)_k, C[y])) / Σ w_j       every layer's post-injection feature vs y's code
    L = L_backbone + L_refine + β · ce · L_align,   ce = the backbone's hard CE on y (detached), a scale

    β = dspine_alignment_weight · min(1, step / dspine_alignment_warmup)
    P(replace a block) = dspine_replace_prob · clamp((e - step / steps) / (e - h), 0, 1)   h, e = hold, end ratios

A replaced block's layers < dspine_replace_layers read the codes of the data's tokens as predecessors instead of the
predicted features (SpecForge's scheduled replacement). Differences from SpecForge, where its step reads hard labels:
its backbone CE is the data token's; here the backbone term is the block family's (soft CE against the target by
default, train.loss / train.block.weighting apply as for DSpark); the refinement and alignment terms take the data's
tokens as SpecForge's do, weighted exp(-j / gamma) (SpecForge gamma 7: set train.block.gamma), and ce is this
batch's, not the optimizer window's. Evaluation drafts with the refined candidate scores (kinds/block.py's drafts
through DSpineHead.heads). Shapes: B batch, T sequence, A anchors, K' drafts, V' draft vocab, k candidates.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specheads.train.kinds import block
from specheads.train.kinds.base import HeadKind, unwrap
from specheads.train.losses import LossOutput, block_position_weights, dspark_loss
from specheads.train.teacher import has_sidecar


def schedule(step: int, total_steps: int, cfg) -> tuple[float, float]:
    """(β, the replacement probability) at optimizer step `step` of `total_steps` (cfg: train.block)."""
    warm = cfg.dspine_alignment_warmup
    beta = cfg.dspine_alignment_weight * (min(max(step, 0) / warm, 1.0) if warm else 1.0)
    if total_steps <= 0:
        return beta, 0.0
    frac = (cfg.dspine_replace_end - max(step, 0) / total_steps) / (cfg.dspine_replace_end - cfg.dspine_replace_hold)
    return beta, cfg.dspine_replace_prob * min(max(frac, 0.0), 1.0)


def _draft_index(head, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target ids [...] -> (their draft ids, whether they are in the draft vocab) (identity without one)."""
    d2t = getattr(head, "d2t", None)
    if d2t is None:
        return labels, torch.ones_like(labels, dtype=torch.bool)
    idx = torch.searchsorted(d2t, labels).clamp(max=d2t.numel() - 1)
    return idx, d2t[idx] == labels


def refine_loss(head, scores: torch.Tensor, cand: torch.Tensor, labels: torch.Tensor, tgt: torch.Tensor,
                tgt_lse: torch.Tensor, w: torch.Tensor, w_ce: float, w_l1: float, threshold: float):
    """L_refine (module docstring): scores [N,K',k], cand [N,K',k] draft ids, labels [N,K'] target ids, tgt [N,K',V']
    target logits at the draft-vocab columns with their logsumexp tgt_lse [N,K'], w [N,K'] -> (loss, coverage:
    the share of counted drafts whose label is a candidate)."""
    logq = scores.float().log_softmax(-1)  # [N,K',k]
    covered = head.to_target_ids(cand) == labels[..., None]
    ce = -(logq * covered).sum(-1)
    t = tgt.float().gather(-1, cand)  # [N,K',k]
    mass = (t.logsumexp(-1) - tgt_lse.float()).exp()
    l1 = (logq.exp() - t.softmax(-1)).abs().sum(-1) * (mass > threshold)
    den = w.sum().clamp_min(1e-6)
    cover = (covered.any(-1).float() * (w > 0)).sum() / (w > 0).sum().clamp_min(1)
    return ((w_ce * ce + w_l1 * l1) * w).sum() / den, cover


def align_loss(features: torch.Tensor, codes: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """L_align: features [n,N,K',r] (every layer), codes [N,K',r] of the labels, w [N,K'] -> Σ_i weighted mean."""
    a = 1.0 - F.cosine_similarity(features.float(), codes.float().unsqueeze(0), dim=-1)  # [n,N,K']
    return (a * w).sum() / w.sum().clamp_min(1e-6)


def loss(head, batch: dict, h_in: torch.Tensor, h_last: torch.Tensor, target, settings) -> LossOutput:
    """Sampled blocks, teacher-forced, the shallow layers' predecessors replaced in a scheduled share of them."""
    ids, lmask = batch["input_ids"], batch["loss_mask"]
    inner, cfg = unwrap(head), settings.block
    K = inner.num_drafts
    anchors, avalid = block.sample_anchors(lmask, cfg.max_anchors, settings.generator)
    beta, prob = schedule(settings.step, settings.total_steps, cfg)
    replace = None
    if prob > 0 and cfg.dspine_replace_layers > 0:
        dev = settings.generator.device if settings.generator is not None else torch.device("cpu")
        draw = torch.rand(anchors.shape, generator=settings.generator, device=dev).to(anchors.device)
        replace = ((draw < prob) & avalid, cfg.dspine_replace_layers)
    out = head(h_in.float(), ids, anchors, batch["attention_mask"], replace)
    valid = block.block_valid(lmask, anchors, K) & avalid[..., None]
    side = (batch["target_greedy"], batch["target_lse"]) if has_sidecar(batch) else None
    tgt, lse, ok = block.block_targets(inner, target, h_last, anchors, valid, cfg.full_vocab, side)
    keep = avalid  # [B,A]: padding blocks leave the loss entirely
    bb = dspark_loss(out.base[keep], None, tgt[keep], lse[keep], ok[keep], valid[keep], gamma=cfg.gamma,
                     loss=settings.distill("dspine"), weighting=cfg.weighting, dpace_alpha=cfg.dpace_alpha)
    T = ids.shape[1]
    lab_idx = (anchors[..., None] + 1 + torch.arange(K, device=ids.device)).clamp(max=T - 1)
    labels = ids.gather(1, lab_idx.flatten(1)).view(lab_idx.shape)[keep]  # [N,K'] y = x_{p+1+j}
    w = block_position_weights(K, cfg.gamma, ids.device) * valid[keep].float()  # [N,K']
    ref, cover = refine_loss(inner, out.scores[keep], out.candidates[keep], labels, tgt[keep], lse[keep], w,
                             cfg.w_ce, cfg.w_l1, cfg.dspine_mass_threshold)
    align = align_loss(out.features[:, keep], inner.code(labels), w)
    with torch.no_grad():  # the alignment's scale: the backbone's hard CE on the data's tokens (SpecForge)
        di, inside = _draft_index(inner, labels)
        hard = -out.base[keep].float().log_softmax(-1).gather(-1, di[..., None]).squeeze(-1)
        wi = w * inside.float()
        ce = (hard * wi).sum() / wi.sum().clamp_min(1e-6)
    metrics = dict(bb.metrics)
    metrics.update(refine_loss=float(ref.detach()), align_loss=float(align.detach()), candidate_coverage=float(cover),
                   align_beta=beta, replace_prob=prob)
    return LossOutput(bb.loss + ref + beta * ce * align, metrics)


KIND = HeadKind("dspine", loss, block.drafts)

"""Losses per head kind, plus the per-step correctness that evaluation turns into a simulated τ.

One alignment for every kind (docs/architecture.md): draft step k (0-based; Medusa head k, EAGLE TTT step k) at row t
predicts token t+2+k. The target's own next-token distribution at row j is `target_logits[:, j]` (the frozen lm_head
applied to the stored layer-L state, predicting token j+1), so the target's distribution for the token step k
predicts at row t is `target_logits[:, t+1+k]`.

Shapes: B batch, T sequence, K heads / TTT steps, D hidden, V target vocab, V' draft vocab.
A row counts only when the token it predicts is inside the sequence and carries loss_mask == 1 (assistant token).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

DECAY = 0.8  # per-head / per-step weight 0.8^k (Medusa paper λ_k; EAGLE-3 TTT step weight)
EAGLE_W_REG = 1.0  # EAGLE-1 paper: SmoothL1 feature regression weight
EAGLE_W_CE = 0.1  # EAGLE-1 paper: classification (soft CE) weight


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # detached scalars (per-step acc, parts); the
    # trainer turns them into floats only when it logs them (each float() is a host sync)


def step_mask(loss_mask: torch.Tensor, k: int) -> torch.Tensor:
    """[B,T] bool: rows t whose step-k prediction (token t+2+k) exists and is an assistant token."""
    B, T = loss_mask.shape
    out = torch.zeros(B, T, dtype=torch.bool, device=loss_mask.device)
    s = 2 + k
    if s < T:
        out[:, : T - s] = loss_mask[:, s:].bool()
    return out


def shift_rows(x: torch.Tensor, s: int) -> torch.Tensor:
    """x[:, t+s] placed at row t (rows past the end are zero; they are always masked). x: [B,T,...]."""
    if s == 0:
        return x
    out = torch.zeros_like(x)
    if s < x.shape[1]:
        out[:, : x.shape[1] - s] = x[:, s:]
    return out


def soft_ce(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """[N,V] x [N,V] -> [N]: cross-entropy of the draft against the target's softmax (fp32)."""
    p = torch.softmax(target_logits.float(), dim=-1)
    return -(p * torch.log_softmax(logits.float(), dim=-1)).sum(-1)


def _mean(x: torch.Tensor) -> torch.Tensor:
    # an empty selection contributes 0 while keeping the graph (every rank must run backward under DDP)
    return x.sum() / max(1, x.numel())


def medusa_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                target_logits: torch.Tensor | None = None, decay: float = DECAY,
                d2t: torch.Tensor | None = None, target_in_draft_vocab: bool = False) -> LossOutput:
    """Σ_k decay^k CE_k. logits [K,B,T,V']; head k at row t predicts token t+2+k.

    Hard labels (the data's tokens) when target_logits is None, else soft CE against the target's distribution
    target_logits [B,T,V] (row j predicts token j+1). With a draft vocab (d2t [V'] target ids), hard labels are
    mapped to draft ids (labels outside it are masked) and soft targets restricted to it and renormalised
    (target_in_draft_vocab: target_logits already holds only the draft vocab's columns, [B,T,V']).
    """
    K = logits.shape[0]
    total = logits.new_zeros((), dtype=torch.float32)
    metrics: dict[str, torch.Tensor] = {}
    ids = input_ids
    if d2t is not None:
        d2t = d2t.to(input_ids.device)
        to_draft = torch.full((max(int(input_ids.max()), int(d2t.max())) + 1,), -1, dtype=torch.long,
                              device=input_ids.device)
        to_draft[d2t] = torch.arange(len(d2t), device=input_ids.device)
        ids = to_draft[input_ids]  # [B,T] draft ids, -1 outside the draft vocab
        if target_logits is not None and not target_in_draft_vocab:
            target_logits = target_logits[..., d2t]
    for k in range(K):
        m = step_mask(loss_mask, k)  # [B,T]
        if d2t is not None and target_logits is None:
            m = m & (shift_rows(ids, 2 + k) >= 0)
        lk = logits[k][m]  # [N,V']
        labels = shift_rows(ids, 2 + k)[m]  # [N]
        if target_logits is None:
            ce = F.cross_entropy(lk.float(), labels, reduction="none")
        else:
            tk = shift_rows(target_logits, 1 + k)[m]  # [N,V'] the target's distribution for token t+2+k
            ce = soft_ce(lk, tk)
            labels = tk.argmax(-1)  # accuracy against the target's choice, as the soft loss trains for
        ce_k = _mean(ce)
        total = total + (decay ** k) * ce_k
        metrics[f"ce_{k}"] = ce_k.detach()
        if lk.shape[0]:
            metrics[f"acc_{k}"] = (lk.argmax(-1) == labels).float().mean().detach()
    return LossOutput(total, metrics)


def in_draft_vocab(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] bool: True for the target ids in the draft vocabulary d2t [V']."""
    m = torch.zeros(vocab_size, dtype=torch.bool, device=d2t.device)
    m[d2t] = True
    return m


def eagle_loss(pred_hidden: torch.Tensor, logits: torch.Tensor, target_hidden: torch.Tensor,
               target_logits: torch.Tensor, loss_mask: torch.Tensor, w_reg: float = EAGLE_W_REG,
               w_ce: float = EAGLE_W_CE, d2t: torch.Tensor | None = None) -> LossOutput:
    """EAGLE-1: w_reg SmoothL1(f̂_{t+1}, f_{t+1}) + w_ce soft-CE(draft, target) for token t+2.

    pred_hidden [B,T,D] (row t predicts f_{t+1}), logits [B,T,V'] (row t predicts x_{t+2}),
    target_hidden [B,T,D] = the stored layer-L states, target_logits [B,T,V] = lm_head(target_hidden).
    With a draft vocabulary (d2t [V']) the CE term is taken as in EAGLE-3: the target's logits restricted to the
    draft vocabulary, rows whose target argmax lies outside it left out; the regression term keeps every row.
    """
    m = step_mask(loss_mask, 0)
    tgt_h = shift_rows(target_hidden, 1)[m].float()  # [N,D]
    reg = _mean(F.smooth_l1_loss(pred_hidden[m].float(), tgt_h, reduction="none").mean(-1))
    tl = shift_rows(target_logits, 1)[m]  # [N,V]
    lk = logits[m]
    if d2t is not None:
        d2t = d2t.to(tl.device)
        keep = in_draft_vocab(d2t, tl.shape[-1])[tl.argmax(-1)]  # [N]
        tl, lk = tl[keep][:, d2t], lk[keep]  # [N',V']
    ce = _mean(soft_ce(lk, tl))
    metrics = {"reg": reg.detach(), "ce_0": ce.detach()}
    if lk.shape[0]:
        metrics["acc_0"] = (lk.argmax(-1) == tl.argmax(-1)).float().mean().detach()
    return LossOutput(w_reg * reg + w_ce * ce, metrics)


def eagle3_loss(step_logits: list[torch.Tensor], target_logits: torch.Tensor, loss_mask: torch.Tensor,
                d2t: torch.Tensor | None, decay: float = DECAY) -> LossOutput:
    """EAGLE-3 training-time test: Σ_i decay^i soft-CE over the draft vocabulary, no feature regression.

    step_logits: list of n tensors [B,T,V'] (step i row t predicts x_{t+2+i}); target_logits [B,T,V];
    d2t [V'] long (draft id -> target id) or None (draft vocab = target vocab). The target distribution is its
    logits restricted to the draft vocabulary and renormalised; rows whose target argmax lies outside the draft
    vocabulary are masked (EAGLE-3 repo).
    """
    V = target_logits.shape[-1]
    ok = torch.ones(target_logits.shape[:2], dtype=torch.bool, device=target_logits.device)  # [B,T]
    if d2t is not None:
        d2t = d2t.to(target_logits.device)
        ok = in_draft_vocab(d2t, V)[target_logits.argmax(-1)]  # row j: the target's token j+1 lies in the draft vocab
        target_logits = target_logits[..., d2t]  # [B,T,V'], sliced once for all steps
    total = target_logits.new_zeros((), dtype=torch.float32)
    metrics: dict[str, torch.Tensor] = {}
    for i, lg in enumerate(step_logits):
        tl = shift_rows(target_logits, 1 + i)  # [B,T,V']
        m = step_mask(loss_mask, i) & shift_rows(ok, 1 + i)
        lk, tk = lg[m], tl[m]
        ce = _mean(soft_ce(lk, tk))
        total = total + (decay ** i) * ce
        metrics[f"ce_{i}"] = ce.detach()
        if lk.shape[0]:
            metrics[f"acc_{i}"] = (lk.argmax(-1) == tk.argmax(-1)).float().mean().detach()
    return LossOutput(total, metrics)


def step_correct(step_logits: list[torch.Tensor] | torch.Tensor, target_argmax: torch.Tensor,
                 loss_mask: torch.Tensor, d2t: torch.Tensor | None = None, topk: int = 5):
    """Teacher-forced correctness of each draft step against the target's greedy token.

    step_logits: K tensors [B,T,V'] (step k row t predicts token t+2+k); target_argmax [B,T] (row j: the target's
    greedy token j+1). Returns (valid, top1, topk) as [K,B,T] bool; a step outside the sequence or on a
    non-assistant token is invalid (and not correct).
    """
    valid, top1, topkc = [], [], []
    for k, lg in enumerate(step_logits):
        m = step_mask(loss_mask, k)
        want = shift_rows(target_argmax, 1 + k)  # [B,T]
        kk = min(topk, lg.shape[-1])
        idx = lg.topk(kk, dim=-1).indices  # [B,T,k]
        if d2t is not None:
            idx = d2t.to(idx.device)[idx]
        hit = idx == want.unsqueeze(-1)
        valid.append(m)
        top1.append(hit[..., 0] & m)
        topkc.append(hit.any(-1) & m)
    return torch.stack(valid), torch.stack(top1), torch.stack(topkc)


def simulated_tau(correct: torch.Tensor, start: torch.Tensor, depth: int | None = None) -> torch.Tensor:
    """[K,B,T] bool -> [N] accepted length per start row: 1 (the target's own token) + consecutive correct steps.

    `start` [B,T] bool selects the rows where drafting starts; depth caps the steps counted (tree depth).
    """
    c = correct if depth is None else correct[:depth]
    run = torch.cumprod(c.long(), dim=0).sum(0)  # [B,T] consecutive correct from step 0
    return (1 + run)[start].float()


# --------------------------------------------------------------------------------------- DSpark / DFlash blocks
BLOCK_GAMMA = 4.0  # position weight exp(-j / gamma) (DeepSpec loss_decay_gamma 4.0; speculators dflash_decay_gamma 4.0)
BLOCK_W_CE = 0.1  # soft CE against the target (DeepSpec ce_loss_alpha 0.1, there on hard labels)
BLOCK_W_L1 = 0.9  # ||p_draft - p_target||_1 = 2 TV (DeepSpec l1_loss_alpha 0.9)
CONFIDENCE_ALPHA = 1.0  # confidence BCE weight (DeepSpec / speculators confidence_head_alpha 1.0)


def block_position_weights(num_drafts: int, gamma: float, device=None) -> torch.Tensor:
    """[K'] weight of draft j: exp(-j / gamma) (DeepSpec _build_loss_weight_mask; speculators' fixed-exp-decay with
    sample_from_anchor, where draft j is slot j; without it slot j+1, weighted exp(-j / gamma) alike)."""
    return torch.exp(-torch.arange(num_drafts, device=device, dtype=torch.float32) / gamma)


@torch.no_grad()
def acceptance_rate(logits: torch.Tensor, target_logits: torch.Tensor, target_lse: torch.Tensor) -> torch.Tensor:
    """The analytic acceptance of a draft that proposes only draft-vocab tokens: sum_v min(q_v, p_v) =
    1 - 0.5 * ||q - p||_1 over the full vocabulary (q = 0 outside it). logits [..., V'] (draft), target_logits
    [..., V'] (the target's logits at the draft-vocab columns), target_lse [...] (their full-vocab logsumexp).
    Without a draft vocabulary it is DeepSpec's / speculators' 1 - TV(q, p). No gradient (a BCE target)."""
    q = torch.softmax(logits.float(), dim=-1)
    p = torch.exp(target_logits.float() - target_lse.float().unsqueeze(-1))
    return torch.minimum(q, p).sum(-1).clamp(0.0, 1.0)


def _wmean(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x * w).sum() / w.sum().clamp_min(1e-6)  # an empty selection gives 0 and keeps the graph (DDP)


def dspark_loss(logits: torch.Tensor, conf_logits: torch.Tensor | None, target_logits: torch.Tensor,
                target_lse: torch.Tensor, in_vocab: torch.Tensor, valid: torch.Tensor, gamma: float = BLOCK_GAMMA,
                w_ce: float = BLOCK_W_CE, w_l1: float = BLOCK_W_L1, alpha: float = CONFIDENCE_ALPHA) -> LossOutput:
    """DSpark / DFlash block loss over N blocks of K' drafts (DeepSpec deepspec/modeling/dspark/loss.py):

        L = w_ce · CE + w_l1 · L1 + alpha · BCE, each a mean over drafts weighted by w_j = exp(-j / gamma),
        CE_j = soft CE of the draft against the target restricted to the draft vocab and renormalised,
        L1_j = ||q_j - p_j||_1 over that restricted target (2 TV),
        BCE_j = BCE(c_j, a_j) with a_j = acceptance_rate(...), detached: the confidence loss never reaches the
        logits (it trains the confidence head and, through h_k, the backbone).

    logits [N,K',V'] (Markov-corrected), conf_logits [N,K'] or None, target_logits [N,K',V'] (target logits at
    the draft-vocab columns), target_lse [N,K'] (their logsumexp: over the full vocabulary, the acceptance is the
    exact one of a V'-draft; over V' alone, that of the renormalised target, as speculators computes it),
    in_vocab [N,K'] (the target's argmax lies in the draft vocab: CE and L1 skip the others, as eagle3_loss does;
    the BCE keeps them, their acceptance is low), valid [N,K'] bool (a contiguous prefix of assistant tokens
    inside the sequence).
    """
    K = logits.shape[1]
    w = block_position_weights(K, gamma, logits.device) * valid.float()  # [N,K']
    wd = w * in_vocab.float()
    lq = torch.log_softmax(logits.float(), dim=-1)
    p = torch.softmax(target_logits.float(), dim=-1)
    ce = _wmean(-(p * lq).sum(-1), wd)
    l1 = _wmean((lq.exp() - p).abs().sum(-1), wd)
    total = w_ce * ce + w_l1 * l1
    metrics: dict[str, float] = {"ce": float(ce.detach()), "l1": float(l1.detach())}
    acc_rate = acceptance_rate(logits.detach(), target_logits, target_lse)  # [N,K']
    if conf_logits is not None:
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), acc_rate, reduction="none")
        conf_loss = _wmean(bce, w)
        total = total + alpha * conf_loss
        metrics["conf_bce"] = float(conf_loss.detach())
    with torch.no_grad():
        hit = logits.argmax(-1) == target_logits.argmax(-1)
        for j in range(K):
            m = valid[:, j]
            if m.any():
                metrics[f"accept_{j}"] = float(acc_rate[:, j][m].mean())  # analytic (sampling) acceptance
                metrics[f"acc_{j}"] = float((hit[:, j] & in_vocab[:, j])[m].float().mean())  # greedy agreement
                if conf_logits is not None:
                    metrics[f"conf_{j}"] = float(torch.sigmoid(conf_logits[:, j][m].float()).mean())
    return LossOutput(total, metrics)

"""Losses per head kind, plus the per-step correctness that evaluation turns into a simulated τ.

One alignment for every kind (docs/architecture.md): draft step k (0-based; Medusa head k, EAGLE TTT step k) at row t
predicts token t+2+k. The target's own next-token distribution at row j is `target_logits[:, j]` (the frozen lm_head
applied to the stored layer-L state, predicting token j+1), so the target's distribution for the token step k
predicts at row t is `target_logits[:, t+1+k]`.

The distillation objective is one family for every kind (`train.loss`, docs/training.md "The loss family"): with q
the draft's distribution over the draft vocabulary V', p the target's over the full vocabulary V, m = p(V') its mass
inside V' and p' = p restricted to V' and renormalised (p'_v = p_v / m):

    soft_ce    -Σ_v p'_v log q_v                  forward KL(p' ‖ q) up to the constant H(p')
    kl         Σ_v p'_v log(p'_v / q_v)            the same gradient, reported as the true KL
    tv         ½ Σ_v |q_v − p'_v|                  total variation = 1 − Σ_v min(q_v, p'_v)
    l1         Σ_v |q_v − p'_v|                    2 TV (DeepSpec's L1)
    lk_alpha   −log α,  α = Σ_{v∈V'} min(q_v, p_v)  LK^α of arXiv 2602.23881: α is the acceptance rate of a
                                                  V'-draft under sampling verification, mass outside V' included
    lk_lambda  λ KL(p' ‖ q) + (1 − λ)(1 − α)       LK^λ, λ = exp(−η · sg(ᾱ)), ᾱ = mean α over the step's rows

Mixtures are weighted sums (`soft_ce:0.1,tv:0.9`). The divergences (soft_ce, kl, tv, l1) compare q with p', the
target conditioned on the next token lying in V' (what a V'-draft can match; the mass outside V' is dropped); the LK
losses use the exact p (its full-vocabulary log-normaliser `target_lse`), so α <= m: a token outside V' can never be
accepted. Rows whose target argmax lies outside V' are masked for EAGLE-1/3 (and DSpark with train.block.full_vocab).

Shapes: B batch, T sequence, K heads / TTT steps, D hidden, V target vocab, V' draft vocab, N rows.
A row counts only when the token it predicts is inside the sequence and carries loss_mask == 1 (assistant token).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specheads.heads.kinds import kind_spec, kinds
from specheads.train.teacher import TargetRows

DECAY = 0.8  # per-head / per-step weight 0.8^k (Medusa paper λ_k; EAGLE-3 TTT step weight)
EAGLE_W_REG = 1.0  # EAGLE-1 paper: SmoothL1 feature regression weight
EAGLE_W_CE = 0.1  # EAGLE-1 paper: classification (soft CE) weight
LK_ETA = 3.0  # LK^λ decay η of λ = exp(-η ᾱ) (arXiv 2602.23881's best setting; SpecForge --kl-decay 3.0)
LK_EPS = 1e-5  # floor of α inside -log α (speculators' neg_log_acceptance_loss): finite at zero overlap
BLOCK_GAMMA = 4.0  # position weight exp(-j / gamma) (DeepSpec loss_decay_gamma 4.0; speculators dflash_decay_gamma 4.0)
BLOCK_W_CE = 0.1  # soft CE against the target (DeepSpec ce_loss_alpha 0.1, there on hard labels)
BLOCK_W_L1 = 0.9  # ||p_draft - p_target||_1 = 2 TV (DeepSpec l1_loss_alpha 0.9)
CONFIDENCE_ALPHA = 1.0  # confidence BCE weight (DeepSpec / speculators confidence_head_alpha 1.0)
BLOCK_WEIGHTINGS = ("exp", "dpace")  # block position weighting: exp(-j / gamma), or D-PACE (dpace_position_weights)
DPACE_ALPHA = 0.5  # D-PACE confidence smoothing α in (0, 1] (speculators dpace_alpha default 0.5)

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



# ---------------------------------------------------------------------- the distillation family (train.loss)
LOSS_TERMS = ("soft_ce", "kl", "tv", "l1", "lk_alpha", "lk_lambda")  # the formulas: module docstring
METRIC_NAMES = {"soft_ce": "ce"}  # a term's metric name (the others keep their own): ce_0, tv_0, lk_alpha_0, ...
LOSS_SYNTAX = "NAME or NAME:WEIGHT,NAME:WEIGHT,... (e.g. tv, or soft_ce:0.1,tv:0.9)"

def parse_loss(text: str, allow_zero: bool = False) -> tuple[tuple[str, float], ...]:
    """'tv' | 'soft_ce:0.1,tv:0.9' -> (('soft_ce', 0.1), ('tv', 0.9)). A term without a weight weighs 1.
    Raises ValueError naming what is wrong (unknown term, bad or negative weight, repeated term, all weights 0)."""
    terms: list[tuple[str, float]] = []
    for part in str(text).split(","):
        name, sep, w = (x.strip() for x in part.partition(":"))
        if name not in LOSS_TERMS:
            raise ValueError(f"{name!r} is not one of {list(LOSS_TERMS)}")
        try:
            weight = float(w) if sep else 1.0
        except ValueError:
            raise ValueError(f"weight {w!r} of {name} is not a number") from None
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"weight {w!r} of {name} is not a finite number >= 0")
        if name in (n for n, _ in terms):
            raise ValueError(f"{name} appears twice")
        terms.append((name, weight))
    if not allow_zero and not any(w > 0 for _, w in terms):
        raise ValueError("every weight is 0")
    return tuple(terms)


@dataclass(frozen=True)
class DistillLoss:
    """A weighted sum of LOSS_TERMS; eta is LK^λ's η."""

    terms: tuple[tuple[str, float], ...] = (("soft_ce", 1.0),)
    eta: float = LK_ETA

    @property
    def names(self) -> set[str]:
        return {n for n, _ in self.terms}

    @property
    def needs_lse(self) -> bool:
        """The LK terms read the exact target probabilities: they need the full-vocabulary logsumexp."""
        return bool(self.names & {"lk_alpha", "lk_lambda"})

    def __str__(self) -> str:
        return ",".join(f"{n}:{w:g}" for n, w in self.terms)


@functools.lru_cache(maxsize=64)
def resolve_loss(kind: str, loss: str | None = None, eta: float = LK_ETA, w_ce: float = BLOCK_W_CE,
                 w_l1: float = BLOCK_W_L1) -> DistillLoss:
    """train.loss, or the kind's default (its KindSpec.default_loss, from its paper / reference code; the block
    kinds' from train.block.w_ce / w_l1)."""
    if loss is not None:
        return DistillLoss(parse_loss(loss), eta)
    text = kind_spec(kind).default_loss.format(w_ce=w_ce, w_l1=w_l1)
    return DistillLoss(parse_loss(text, allow_zero=True), eta)


def _reduce(x: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    return _mean(x) if weights is None else _wmean(x, weights)


def _row_mean(x: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Mean over dim 0 (the rows of one draft step), weighted; 0 where no row counts."""
    if weights is None:
        return x.sum(0) / max(1, x.shape[0])
    return (x * weights).sum(0) / weights.sum(0).clamp_min(1e-6)


def distill_loss(logits: torch.Tensor, target_logits: torch.Tensor, loss: DistillLoss,
                 target_lse: torch.Tensor | None = None, weights: torch.Tensor | None = None):
    """The weighted family of terms between the draft and the target at N rows (formulas: module docstring).

    logits, target_logits [N,...,V'] (the target's logits at the draft-vocab columns), target_lse [N,...] their
    logsumexp over the full vocabulary (needed by the LK terms), weights [N,...] (None: a plain mean over the
    rows; DSpark: position weights). Returns (loss scalar, {metric: detached scalar}); metric `accept` is ᾱ,
    the exact acceptance, when the LK terms computed it. λ of LK^λ uses ᾱ over dim 0 (each TTT step / draft
    position its own), detached."""
    names = loss.names
    lq = torch.log_softmax(logits.float(), dim=-1)
    tl = target_logits.float()
    p = torch.softmax(tl, dim=-1)  # p', the target renormalised over V'
    q = lq.exp() if names & {"tv", "l1", "lk_alpha", "lk_lambda"} else None
    rows: dict[str, torch.Tensor] = {}
    if "soft_ce" in names:
        rows["soft_ce"] = -(p * lq).sum(-1)
    if names & {"kl", "lk_lambda"}:
        lp = torch.log_softmax(tl, dim=-1)
        rows["kl"] = torch.where(p > 0, p * (lp - lq), torch.zeros_like(p)).sum(-1)
    if names & {"tv", "l1"}:
        rows["l1"] = (q - p).abs().sum(-1)
        rows["tv"] = 0.5 * rows["l1"]
    alpha = None
    if loss.needs_lse:
        if target_lse is None:
            raise ValueError("the LK losses need the target's full-vocabulary logsumexp (target_lse)")
        exact = torch.exp(tl - target_lse.float().unsqueeze(-1))  # p_v at the V' columns, not renormalised
        alpha = torch.minimum(q, exact).sum(-1)
        rows["lk_alpha"] = -torch.log(alpha.clamp_min(LK_EPS))
        if "lk_lambda" in names:
            lam = torch.exp(-loss.eta * _row_mean(alpha.detach(), weights))
            rows["lk_lambda"] = lam * rows["kl"] + (1.0 - lam) * (1.0 - alpha)
    total = logits.new_zeros((), dtype=torch.float32)
    metrics: dict[str, torch.Tensor] = {}
    for name, w in loss.terms:
        part = _reduce(rows[name], weights)
        total = total + w * part
        metrics[METRIC_NAMES.get(name, name)] = part.detach()
    if alpha is not None:
        metrics["accept"] = _reduce(alpha.detach(), weights)
    return total, metrics


def medusa_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                target_logits: torch.Tensor | None = None, decay: float = DECAY,
                d2t: torch.Tensor | None = None, target_in_draft_vocab: bool = False,
                loss: DistillLoss | None = None, target_lse: torch.Tensor | None = None) -> LossOutput:
    """Σ_k decay^k L_k. logits [K,B,T,V']; head k at row t predicts token t+2+k.

    Hard labels (CE on the data's tokens) when target_logits is None, else the distillation `loss` (default soft
    CE) against the target's distribution target_logits [B,T,V] (row j predicts token j+1; target_lse [B,T] its
    full-vocabulary logsumexp, for the LK terms). With a draft vocab (d2t [V'] target ids), hard labels are mapped
    to draft ids (labels outside it are masked) and soft targets restricted to it and renormalised
    (target_in_draft_vocab: target_logits already holds only the draft vocab's columns, [B,T,V']); rows are not
    masked by the target's argmax (as Medusa-2's self-distillation).
    """
    K = logits.shape[0]
    loss = loss or DistillLoss()
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
            part = _mean(F.cross_entropy(lk.float(), labels, reduction="none"))
            parts = {"ce": part.detach()}
        else:
            bi, ti = m.nonzero(as_tuple=True)
            tk = target_logits[bi, ti + 1 + k]  # [N,V'] the target's distribution for token t+2+k
            lse = None if target_lse is None else target_lse[bi, ti + 1 + k]
            part, parts = distill_loss(lk, tk, loss, lse)
            labels = tk.argmax(-1)  # accuracy against the target's choice, as the soft loss trains for
        total = total + (decay ** k) * part
        metrics.update({f"{n}_{k}": v for n, v in parts.items()})
        if lk.shape[0]:
            metrics[f"acc_{k}"] = (lk.argmax(-1) == labels).float().mean().detach()
    return LossOutput(total, metrics)


def _as_rows(target: TargetRows | torch.Tensor, d2t: torch.Tensor | None, loss: DistillLoss) -> TargetRows:
    """The target's full-vocabulary logits [B,T,V] become TargetRows (the callers that hold them: tests, old code)."""
    if isinstance(target, TargetRows):
        return target
    return TargetRows.from_full(target, d2t, with_lse=loss.needs_lse)


def eagle_loss(pred_hidden: torch.Tensor, logits: torch.Tensor, target_hidden: torch.Tensor,
               target: TargetRows | torch.Tensor, loss_mask: torch.Tensor, w_reg: float = EAGLE_W_REG,
               w_ce: float = EAGLE_W_CE, d2t: torch.Tensor | None = None,
               loss: DistillLoss | None = None) -> LossOutput:
    """EAGLE-1: w_reg SmoothL1(f̂_{t+1}, f_{t+1}) + w_ce L(draft, target) for token t+2 (L = `loss`, soft CE).

    pred_hidden [B,T,D] (row t predicts f_{t+1}), logits [B,T,V'] (row t predicts x_{t+2}), target_hidden [B,T,D]
    = the stored layer-L states, target = TargetRows (or lm_head(target_hidden) [B,T,V]). With a draft vocabulary
    (d2t [V']) the distillation term is taken as in EAGLE-3: the target restricted to it, rows whose target argmax
    lies outside it left out; the regression term keeps every row.
    """
    loss = loss or DistillLoss()
    rows = _as_rows(target, d2t, loss)
    m = step_mask(loss_mask, 0)
    tgt_h = shift_rows(target_hidden, 1)[m].float()  # [N,D]
    reg = _mean(F.smooth_l1_loss(pred_hidden[m].float(), tgt_h, reduction="none").mean(-1))
    if d2t is not None:
        m = m & shift_rows(rows.in_vocab, 1)
    bi, ti = m.nonzero(as_tuple=True)
    tl, lse = rows.at(bi, ti + 1)  # [N,V'], [N]
    lk = logits[m]
    dist, parts = distill_loss(lk, tl, loss, lse)
    metrics = {"reg": reg.detach(), **{f"{n}_0": v for n, v in parts.items()}}
    if lk.shape[0]:
        metrics["acc_0"] = (lk.argmax(-1) == tl.argmax(-1)).float().mean().detach()
    return LossOutput(w_reg * reg + w_ce * dist, metrics)


def eagle3_loss(step_logits: list[torch.Tensor], target: TargetRows | torch.Tensor, loss_mask: torch.Tensor,
                d2t: torch.Tensor | None, decay: float = DECAY, loss: DistillLoss | None = None) -> LossOutput:
    """EAGLE-3 training-time test: Σ_i decay^i L_i over the draft vocabulary (L = `loss`, default soft CE), no
    feature regression.

    step_logits: list of n tensors [B,T,V'] (step i row t predicts x_{t+2+i}); target: TargetRows (or the target's
    full logits [B,T,V]); d2t [V'] long (draft id -> target id) or None (draft vocab = target vocab). The target
    distribution is its logits restricted to the draft vocabulary; rows whose target argmax lies outside the draft
    vocabulary are masked (EAGLE-3 repo).
    """
    loss = loss or DistillLoss()
    rows = _as_rows(target, d2t, loss)
    total = rows.logits.new_zeros((), dtype=torch.float32)
    metrics: dict[str, torch.Tensor] = {}
    for i, lg in enumerate(step_logits):
        m = step_mask(loss_mask, i)
        if d2t is not None:
            m = m & shift_rows(rows.in_vocab, 1 + i)  # row t reads the target's row t+1+i
        bi, ti = m.nonzero(as_tuple=True)
        tk, lse = rows.at(bi, ti + 1 + i)  # [N,V'], [N]
        lk = lg[m]
        part, parts = distill_loss(lk, tk, loss, lse)
        total = total + (decay ** i) * part
        metrics.update({f"{n}_{i}": v for n, v in parts.items()})
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


def accepted_lengths(correct: torch.Tensor, depth: int | None = None) -> torch.Tensor:
    """[K,B,T] bool -> [B,T] accepted length if drafting started at row t: 1 (the target's own token) + the
    consecutive correct steps from step 0; depth caps the steps counted (tree depth)."""
    c = correct if depth is None else correct[:depth]
    return 1 + torch.cumprod(c.long(), dim=0).sum(0)


# --------------------------------------------------------------------------------------- DSpark / DFlash blocks


@torch.no_grad()
def dpace_position_weights(q: torch.Tensor, valid: torch.Tensor, alpha: float = DPACE_ALPHA) -> torch.Tensor:
    """D-PACE weights of a block's drafts from the drafter's own confidence (speculators losses/utils.py
    `dpace_loss_decay`, the default per-position weight of its DFlash trainer):

        s_j = (1 - α) q_j + α   (s_j = 1 where draft j does not count),   P_j = Π_{i<=j} s_i
        w_j = valid_j · Σ_{i>=j} valid_i P_i

    q [N,K'] the draft's probability of the target's token at draft j (speculators: exp(-CE) with CE against the
    target's argmax), valid [N,K'] bool -> w [N,K'], no gradient (speculators computes it under no_grad). P_j
    estimates the chance that drafts 0..j are all accepted, so w_j is the expected number of accepted drafts that
    a correct draft j makes possible: early drafts weigh most, and a block the drafter already gets wrong early
    hands little weight to its later drafts. α keeps P_j > 0 while the drafter is still poor (α = 1: w_j = the
    number of counted drafts from j on)."""
    v = valid.float()
    s = torch.where(valid, (1.0 - alpha) * q.float() + alpha, torch.ones_like(v))
    prefix = torch.cumprod(s, dim=-1)
    return (prefix * v).flip(-1).cumsum(-1).flip(-1) * v


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


@torch.no_grad()
def target_token_prob(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """[N,K'] the draft's probability of the target's argmax token (over V'), detached."""
    tok = target_logits.argmax(-1, keepdim=True)
    return torch.softmax(logits.float(), dim=-1).gather(-1, tok).squeeze(-1)


def per_counted(total: torch.Tensor, parts: dict, weights: torch.Tensor, count) -> tuple[torch.Tensor, dict]:
    """distill_loss's weighted mean Σ w ℓ / Σ w -> D-PACE's reduction Σ w ℓ / `count` (the counted drafts, as
    speculators' loss_function divides), for the loss and each of its parts."""
    scale = weights.sum() / torch.as_tensor(count, device=weights.device).clamp_min(1)
    return total * scale, {k: v * scale for k, v in parts.items()}


def _wmean(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x * w).sum() / w.sum().clamp_min(1e-6)  # an empty selection gives 0 and keeps the graph (DDP)


def dspark_loss(logits: torch.Tensor, conf_logits: torch.Tensor | None, target_logits: torch.Tensor,
                target_lse: torch.Tensor, in_vocab: torch.Tensor, valid: torch.Tensor, gamma: float = BLOCK_GAMMA,
                w_ce: float = BLOCK_W_CE, w_l1: float = BLOCK_W_L1, alpha: float = CONFIDENCE_ALPHA,
                loss: DistillLoss | None = None, weighting: str = "exp",
                dpace_alpha: float = DPACE_ALPHA) -> LossOutput:
    """DSpark / DFlash block loss over N blocks of K' drafts (DeepSpec deepspec/modeling/dspark/loss.py):

        L = w_ce · CE + w_l1 · L1 + alpha · BCE, each a mean over drafts weighted by w_j = exp(-j / gamma),
        CE_j = soft CE of the draft against the target restricted to the draft vocab and renormalised,
        L1_j = ||q_j - p_j||_1 over that restricted target (2 TV),
        BCE_j = BCE(c_j, a_j) with a_j = acceptance_rate(...), detached: the confidence loss never reaches the
        logits (it trains the confidence head and, through h_k, the backbone).
    `loss` (train.loss) replaces w_ce · CE + w_l1 · L1 by another member of the family, weighted the same way
    (its LK terms read target_lse: the exact acceptance with the full-vocabulary one).

    weighting (train.block.weighting): "exp" as above, or "dpace": the distillation terms weighted by
    w_j = dpace_position_weights(q, valid, dpace_alpha) with q_j = softmax(logits_j)[argmax of the target at
    draft j] (detached; 0 where that argmax lies outside V') and, as speculators' loss_function reduces it,
    summed and divided by the NUMBER of counted drafts, not by Σ w: L = Σ_j w_j ℓ_j / Σ_j 1. speculators asks
    for its hard-label CE under D-PACE (q = exp(-CE)); here q is that same probability computed beside whatever
    `loss` is, so D-PACE combines with every member of the family. The confidence BCE keeps exp(-j / gamma), as
    speculators' DSpark loss does ("D-PACE expects token CE").

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
    loss = loss or DistillLoss(parse_loss(f"soft_ce:{w_ce},l1:{w_l1}", allow_zero=True))
    if weighting == "dpace":
        # a draft whose target token lies outside V' is never accepted: q = 0 lowers the drafts after it, and
        # its own ℓ stays out (as with exp)
        wd = dpace_position_weights(target_token_prob(logits, target_logits) * in_vocab.float(), valid,
                                    dpace_alpha) * in_vocab.float()
    elif weighting != "exp":
        raise ValueError(f"block weighting {weighting!r}: expected one of {BLOCK_WEIGHTINGS}")
    total, parts = distill_loss(logits, target_logits, loss, target_lse, weights=wd)
    if weighting == "dpace":  # Σ w ℓ / Σ w (distill_loss's weighted mean) -> Σ w ℓ / the counted drafts
        total, parts = per_counted(total, parts, wd, (valid & in_vocab).sum())
    metrics: dict[str, float] = {k: float(v) for k, v in parts.items() if k != "accept"}
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


def __getattr__(name: str):
    """DEFAULT_LOSS: kind name -> its train.loss default (KindSpec.default_loss), a view kept for importers."""
    if name == "DEFAULT_LOSS":
        return {k: s.default_loss for k, s in kinds().items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

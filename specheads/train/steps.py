"""One forward per head kind: a collated batch -> loss (training) or per-step draft logits (evaluation).

A batch is `collate`'s dict: input_ids [B,T], loss_mask [B,T], attention_mask [B,T], hidden [B,T,F,D] where the F
feature layers are `layers` (hidden_states tuple ids, always including L = the final post-norm state), and from
offline folders with target sidecars target_greedy [B,T] / target_lse [B,T] (features.py).
The target's next-token logits are recomputed from the layer-L state through the frozen lm_head (never stored), and
only what the losses read: the rows predicting an assistant token, at the draft vocabulary's columns when the
greedy token and the full-vocabulary logsumexp come from the sidecar; without one (online mode, older folders) at
every column, from which both are taken (`target_rows`).
Shapes: B batch, T sequence, F feature layers, D hidden, K heads / TTT steps, V vocab, V' draft vocab.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specheads.train.features import greedy_and_lse, lm_head_logits
from specheads.train.losses import (BLOCK_GAMMA, BLOCK_W_CE, BLOCK_W_L1, CONFIDENCE_ALPHA, LK_ETA, DistillLoss,
                                    LossOutput, TargetRows, dspark_loss, eagle3_loss, eagle_loss, in_draft_vocab,
                                    medusa_loss, resolve_loss, shift_rows)
from specheads.utils import SpecheadsError

KINDS = ["medusa", "eagle", "eagle3", "dspark"]


@dataclass
class LossSettings:
    soft_labels: bool = False  # Medusa: soft CE against the target instead of the data's tokens
    decay: float = 0.8  # 0.8^k per head / TTT step
    noise: float = 0.2  # EAGLE(-3): width w of the uniform noise U(-w/2, w/2) added to input features
    w_reg: float = 1.0  # EAGLE-1 SmoothL1 weight
    w_ce: float = 0.1  # EAGLE-1 soft CE weight
    block_gamma: float = BLOCK_GAMMA  # DSpark / DFlash: draft j weighted exp(-j / gamma)
    block_w_ce: float = BLOCK_W_CE  # DSpark / DFlash: soft CE weight
    block_w_l1: float = BLOCK_W_L1  # DSpark / DFlash: ||q - p||_1 weight
    confidence_alpha: float = CONFIDENCE_ALPHA  # DSpark: confidence BCE weight
    max_anchors: int = 512  # DSpark / DFlash: blocks sampled per sequence (DeepSpec num_anchors 512 at 4k tokens)
    block_full_vocab: bool = False  # DSpark / DFlash: the target over every column, not only the draft vocab's
    loss: str | None = None  # train.loss: the distillation family (losses.py); None = the kind's default
    lk_eta: float = LK_ETA  # LK^λ's η
    # the step's random draws (EAGLE feature noise, DSpark anchors): the trainer's own, saved in checkpoints;
    # None = torch's global RNG
    generator: torch.Generator | None = None

    def distill(self, kind: str) -> DistillLoss:
        """The resolved distillation loss of `kind` (losses.DEFAULT_LOSS when train.loss is unset)."""
        return resolve_loss(kind, self.loss, self.lk_eta, self.block_w_ce, self.block_w_l1)


def split_features(hidden: torch.Tensor, layers: list[int], head_layers: list[int], final_layer: int):
    """hidden [B,T,F,D] -> (head input [B,T,F'*D] for the head's own feature layers, final state h_L [B,T,D])."""
    missing = [i for i in list(head_layers) + [final_layer] if i not in layers]
    if missing:
        raise SpecheadsError(f"features: layers {missing} are not in the stored/extracted layers {layers}")
    h_in = torch.cat([hidden[:, :, layers.index(i)] for i in head_layers], dim=-1)  # [B,T,F'*D]
    return h_in, hidden[:, :, layers.index(final_layer)]


def need_rows(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B,T] bool: rows j whose next token j+1 is an assistant token, the only rows a loss or evaluation reads."""
    need = torch.zeros(loss_mask.shape, dtype=torch.bool, device=loss_mask.device)
    need[:, :-1] = loss_mask[:, 1:].bool()
    return need


@torch.no_grad()
def target_logits(target, h_last: torch.Tensor, loss_mask: torch.Tensor | None = None,
                  vocab: torch.Tensor | None = None) -> torch.Tensor:
    """The target's next-token logits [B,T,V] from its final post-norm state (frozen lm_head, target dtype).

    With loss_mask, only rows predicting an assistant token (loss_mask[j+1] == 1) are computed; the others are 0 and
    never read by the losses (they mask the same rows). The lm_head is the largest matmul of a step on small heads.
    With vocab (target ids [V']) only those columns are computed: [B,T,V'].
    """
    if loss_mask is None:
        return lm_head_logits(target, h_last, vocab)
    need = need_rows(loss_mask)
    cols = target.lm_head.weight.shape[0] if vocab is None else len(vocab)
    out = h_last.new_zeros(*h_last.shape[:2], cols, dtype=target.lm_head.weight.dtype)
    out[need] = lm_head_logits(target, h_last[need], vocab)
    return out


def has_sidecar(batch: dict) -> bool:
    return "target_greedy" in batch and "target_lse" in batch


@torch.no_grad()
def target_rows(target, h_last: torch.Tensor, loss_mask: torch.Tensor, d2t: torch.Tensor | None, batch: dict,
                need_greedy: bool = True, need_lse: bool = False) -> TargetRows:
    """What the losses read of the target, computed once per batch at the rows predicting an assistant token.

    With the batch's sidecar (target_greedy, target_lse): only the draft vocabulary's V' columns (576 x 8,192
    multiply-adds per row for SmolLM2's recipes instead of 576 x 49,152). Without one: every column, then the
    greedy token (argmax over V) and the logsumexp over V from them (`need_lse`), as before the sidecars existed.
    Without a draft vocabulary V' = V: the full logits either way. `need_greedy` False (Medusa's soft labels,
    which mask no row) with neither a sidecar nor need_lse: the V' columns alone, greedy and lse left None."""
    side = has_sidecar(batch)
    if d2t is not None and not side and (need_greedy or need_lse):
        return TargetRows.from_full(target_logits(target, h_last, loss_mask), d2t, with_lse=need_lse)
    logits = target_logits(target, h_last, loss_mask, vocab=d2t)  # [B,T,V']
    greedy = lse = None
    if side:
        greedy, lse = batch["target_greedy"].to(logits.device).long(), batch["target_lse"].to(logits.device).float()
    elif need_greedy or need_lse:  # no draft vocabulary: these are the full logits
        need = need_rows(loss_mask)
        greedy = logits.argmax(-1)
        if need_lse:
            lse = torch.zeros(need.shape, dtype=torch.float32, device=logits.device)
            lse[need] = greedy_and_lse(logits[need])[1]
    in_vocab = None
    if greedy is not None:
        in_vocab = torch.ones_like(greedy, dtype=torch.bool) if d2t is None else \
            in_draft_vocab(d2t.to(greedy.device), target.lm_head.weight.shape[0])[greedy.clamp(min=0)] & (greedy >= 0)
    return TargetRows(logits, in_vocab, greedy, lse)


def _d2t(head) -> torch.Tensor | None:
    return getattr(head, "d2t", None)


def train_loss(kind: str, head, batch: dict, target, layers: list[int], head_layers: list[int],
               settings: LossSettings) -> LossOutput:
    """Forward the (possibly wrapped) head on one batch and return its loss. `head` may be DDP/DeepSpeed-wrapped."""
    h_in, h_last = split_features(batch["hidden"], layers, head_layers, target.num_layers)
    ids, lmask, amask = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
    if kind == "dspark":
        return _dspark_train_loss(head, h_in, h_last, batch, target, settings)
    d2t, dist = _d2t(_unwrap(head)), settings.distill(kind)
    if kind == "medusa":
        # soft labels: the draft vocab's columns only (Medusa masks no row by the target's argmax)
        rows = target_rows(target, h_last, lmask, d2t, batch, need_greedy=False, need_lse=dist.needs_lse) \
            if settings.soft_labels else None
        logits = head(h_in.float())  # [K,B,T,V']
        return medusa_loss(logits, ids, lmask, target_logits=None if rows is None else rows.logits,
                           decay=settings.decay, d2t=d2t, target_in_draft_vocab=True, loss=dist,
                           target_lse=None if rows is None else rows.lse)
    rows = target_rows(target, h_last, lmask, d2t, batch, need_greedy=d2t is not None, need_lse=dist.needs_lse)
    feats = h_in.float()
    if settings.noise > 0:
        u = torch.rand(feats.shape, generator=settings.generator, device=feats.device, dtype=feats.dtype)
        feats = feats + (u - 0.5) * settings.noise  # uniform noise (EAGLE §4.2)
    next_tokens = shift_rows(ids, 1)  # row t pairs f_t with x_{t+1}
    if kind == "eagle":
        pred, logits = head(feats, next_tokens, amask)
        return eagle_loss(pred, logits, h_last, rows, lmask, w_reg=settings.w_reg, w_ce=settings.w_ce, d2t=d2t,
                          loss=dist)
    if kind == "eagle3":
        steps = head(feats, next_tokens, amask)  # list of [B,T,V'], step i row t predicts x_{t+2+i}
        return eagle3_loss(list(steps), rows, lmask, d2t, decay=settings.decay, loss=dist)
    raise SpecheadsError(f"head.kind: {kind!r} is not one of {KINDS}")


def _unwrap(m):
    return getattr(m, "module", m)


@torch.no_grad()
def draft_step_logits(kind: str, head, batch: dict, target, layers: list[int], head_layers: list[int],
                      eagle_steps: int = 5):
    """Teacher-forced draft logits per step for evaluation -> (list of K [B,T,V'], d2t or None, target argmax [B,T]).

    Step k at row t predicts token t+2+k. EAGLE-1 has no training-time unroll, so steps beyond the first feed the
    head's own predicted features back for every row (row j reads f̂_j): a slight underestimate of serving, where
    rows before the drafting point keep the target's true features.
    """
    h_in, h_last = split_features(batch["hidden"], layers, head_layers, target.num_layers)
    ids, amask = batch["input_ids"], batch["attention_mask"]
    inner = _unwrap(head)
    if kind == "dspark":
        steps, _, targ = block_draft_outputs(head, batch, target, layers, head_layers)
        return steps, _d2t(inner), targ
    targ = target_greedy(target, h_last, batch)  # [B,T] greedy token j+1 at row j
    if kind == "medusa":
        return list(head(h_in.float()).unbind(0)), _d2t(inner), targ
    next_tokens = shift_rows(ids, 1)
    if kind == "eagle3":
        return list(head(h_in.float(), next_tokens, amask)), _d2t(inner), targ
    if kind == "eagle":
        feats = h_in.float()
        out = []
        for k in range(eagle_steps):
            pred, logits = head(feats, next_tokens, amask)  # row j predicts f_{j+1}, x_{j+2}
            out.append(shift_rows(logits, k))  # row j of unroll k starts drafting at row t = j - k
            feats = torch.cat([h_in[:, :1].float(), pred[:, :-1]], dim=1)  # row j reads f̂_j
        return out, _d2t(inner), targ
    raise SpecheadsError(f"head.kind: {kind!r} is not one of {KINDS}")


# --------------------------------------------------------------------------------------- DSpark / DFlash blocks
def sample_anchors(loss_mask: torch.Tensor, max_anchors: int, generator: torch.Generator | None = None):
    """Block anchors per sequence, uniformly without replacement among the positions p whose first drafted token
    x_{p+1} is an assistant token (DeepSpec sample_anchor_positions; it also asks loss_mask[p], which differs
    only at the turn's first answer token), at most max_anchors each, ascending.

    loss_mask [B,T] -> (anchors [B,A] long, valid [B,A] bool) on loss_mask's device, A = min(max_anchors, the
    most candidates of a row); padding anchors are 0 and invalid. The draws come from `generator` (on its own
    device) or torch's global RNG: a trainer that checkpoints its generator resumes with the same anchors.
    """
    B, T = loss_mask.shape
    dev = generator.device if generator is not None else torch.device("cpu")
    cand = torch.zeros(B, T, dtype=torch.bool, device=dev)
    cand[:, 1:T - 1] = loss_mask[:, 2:].bool().to(dev)  # p >= 1 (a context row exists) and x_{p+1} assistant
    A = max(1, min(int(max_anchors), int(cand.sum(1).max())))
    score = torch.rand(B, T, generator=generator, device=dev).masked_fill(~cand, 2.0)  # candidates first, shuffled
    pick = score.argsort(dim=1)[:, :A]
    valid = cand.gather(1, pick)
    anchors = torch.where(valid, pick, torch.full_like(pick, T + 1)).sort(dim=1).values  # valid ones first
    valid = anchors <= T
    anchors = torch.where(valid, anchors, torch.zeros_like(anchors))
    return anchors.to(loss_mask.device), valid.to(loss_mask.device)


def block_valid(loss_mask: torch.Tensor, anchors: torch.Tensor, num_drafts: int) -> torch.Tensor:
    """[B,A,K'] bool: draft j of the block at p predicts x_{p+1+j} inside the sequence and an assistant token, and
    so do drafts < j (DeepSpec build_eval_mask: a contiguous prefix)."""
    T = loss_mask.shape[1]
    idx = anchors[..., None] + 1 + torch.arange(num_drafts, device=anchors.device)  # [B,A,K']
    ok = (idx < T) & loss_mask.bool().gather(1, idx.clamp(max=T - 1).flatten(1)).view(idx.shape)
    return ok.long().cumprod(-1).bool()


@torch.no_grad()
def block_targets(head, target, h_last: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
                  full_vocab: bool = False, sidecar: tuple[torch.Tensor, torch.Tensor] | None = None):
    """The target's distribution for draft j of the block at p is its next-token distribution at row p+j: the
    frozen lm_head on h_L[p+j], computed once per distinct row the valid drafts read. h_last [B,T,D], anchors
    [B,A], valid [B,A,K'] -> (logits at the draft-vocab columns [B,A,K',V'], their logsumexp [B,A,K'], target
    argmax in the draft vocab [B,A,K'] bool); entries of invalid drafts are those of a valid one (masked).

    With a draft vocabulary, by default only its V' columns are computed and the target is renormalised over them
    (speculators' verifier_lm_head holds exactly those rows): the lm_head over the full vocabulary is the largest
    matmul of a step (49,152 columns for SmolLM2 against 4-8k). full_vocab: the logsumexp is the full one (the
    confidence target becomes the exact acceptance of a V'-draft, and drafts whose target argmax lies outside V'
    leave the CE / L1, as in eagle3_loss): from the batch's `sidecar` (target_greedy, target_lse [B,T]) at the V'
    columns' cost, else from every column."""
    B, T = h_last.shape[:2]
    rows = (anchors[..., None] + torch.arange(valid.shape[-1], device=anchors.device)).clamp(max=T - 1)  # [B,A,K']
    need = torch.zeros(B, T, dtype=torch.bool, device=h_last.device)
    need[torch.arange(B, device=rows.device)[:, None, None].expand_as(rows)[valid], rows[valid]] = True
    where = need.flatten().cumsum(0).view(B, T) - 1  # row -> its index among the computed ones
    d2t = _d2t(head)
    if d2t is None or (full_vocab and sidecar is None):
        logits = lm_head_logits(target, h_last[need]).float()  # [R,V]
    else:
        logits = head.target_lm_logits(h_last[need]).float()  # [R,V'] (the head caches these lm_head rows)
    lse = logits.logsumexp(-1)
    ok = torch.ones_like(lse, dtype=torch.bool)
    if d2t is not None and full_vocab:
        d2t = d2t.to(logits.device)
        if sidecar is None:
            greedy = logits.argmax(-1)
            logits = logits[:, d2t]
        else:
            greedy, lse = sidecar[0].to(need.device)[need].long(), sidecar[1].to(need.device)[need].float()
        ok = in_draft_vocab(d2t, target.lm_head.weight.shape[0])[greedy.clamp(min=0)] & (greedy >= 0)
    if logits.shape[0] == 0:  # no valid draft in the batch
        logits, lse, ok = logits.new_zeros(1, logits.shape[1]), lse.new_zeros(1), ok.new_ones(1)
    idx = where.gather(1, rows.flatten(1)).view(rows.shape).clamp(min=0) * valid
    return logits[idx], lse[idx], ok[idx]


@torch.no_grad()
def target_argmax(target, h_last: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[B,T] the target's greedy token j+1 at row j, computed only where token j+1 is an assistant token (the
    only rows evaluation reads; 0 elsewhere)."""
    need = need_rows(loss_mask)
    out = torch.zeros(need.shape, dtype=torch.long, device=h_last.device)
    out[need] = lm_head_logits(target, h_last[need]).argmax(-1)
    return out


def target_greedy(target, h_last: torch.Tensor, batch: dict) -> torch.Tensor:
    """[B,T] the target's greedy tokens for evaluation: the batch's sidecar, else computed (target_argmax)."""
    if has_sidecar(batch):
        return batch["target_greedy"].to(h_last.device).long()
    return target_argmax(target, h_last, batch["loss_mask"])


def _dspark_train_loss(head, h_in, h_last, batch, target, settings: LossSettings) -> LossOutput:
    """Sampled blocks, teacher-forced (previous tokens = the data's), against the target's distributions."""
    ids, lmask = batch["input_ids"], batch["loss_mask"]
    inner = _unwrap(head)
    K = inner.num_drafts
    anchors, avalid = sample_anchors(lmask, settings.max_anchors, settings.generator)
    logits, conf = head(h_in.float(), ids, anchors, batch["attention_mask"])  # [B,A,K',V'], [B,A,K']
    valid = block_valid(lmask, anchors, K) & avalid[..., None]
    side = (batch["target_greedy"], batch["target_lse"]) if has_sidecar(batch) else None
    tgt, lse, ok = block_targets(inner, target, h_last, anchors, valid, settings.block_full_vocab, side)
    keep = avalid  # [B,A]: padding blocks leave the loss entirely
    return dspark_loss(logits[keep], None if conf is None else conf[keep], tgt[keep], lse[keep], ok[keep],
                       valid[keep], gamma=settings.block_gamma, alpha=settings.confidence_alpha,
                       loss=settings.distill("dspark"))


@torch.no_grad()
def block_draft_outputs(head, batch: dict, target, layers: list[int], head_layers: list[int],
                        targ: torch.Tensor | None = None, chunk: int = 64):
    """Teacher-forced blocks at EVERY start row for evaluation -> (list of K' [B,T,V'] logits, confidence logits
    [K',B,T] (raw, before the head's temperatures) or None, target argmax [B,T]).

    Row t holds the block anchored at p = t+1 (context rows 0..t, anchor x_{t+1}): draft j predicts token t+2+j,
    the alignment every kind's evaluation uses. Only rows whose first draft is an assistant token are computed
    (the rest stay 0, as evaluation never starts there); blocks go `chunk` anchors at a time per sequence.
    """
    inner = _unwrap(head)
    h_in, h_last = split_features(batch["hidden"], layers, head_layers, target.num_layers)
    ids, lmask, amask = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
    if targ is None:
        targ = target_greedy(target, h_last, batch)
    B, T = ids.shape
    K, V = inner.num_drafts, inner.config.out_vocab
    anchors, avalid = _all_anchors(lmask)
    ctx = inner.context_kv(h_in.float())
    steps = [torch.zeros(B, T, V, dtype=inner.head_dtype, device=ids.device) for _ in range(K)]
    conf = torch.zeros(K, B, T, device=ids.device) if inner.confidence_head is not None else None
    pos = torch.arange(T, device=ids.device)
    for c in range(0, anchors.shape[1], chunk):
        a, v = anchors[:, c:c + chunk], avalid[:, c:c + chunk]
        allowed = (pos < a[..., None]) & amask.bool()[:, None, :]
        h = inner.blocks(ctx, allowed, ids.gather(1, a), a)
        prev = ids.gather(1, (a[..., None] + torch.arange(K, device=a.device)).clamp(max=T - 1).flatten(1))
        lg, cf = inner.heads(h, prev.view(*a.shape, K))
        bi, ai = v.nonzero(as_tuple=True)
        rows = a[bi, ai] - 1  # the block at p sits on row p-1
        for j in range(K):
            steps[j][bi, rows] = lg[bi, ai, j]
            if conf is not None:
                conf[j, bi, rows] = cf[bi, ai, j].float()
    return steps, conf, targ


def _all_anchors(loss_mask: torch.Tensor):
    """Every anchor p whose first draft x_{p+1} is an assistant token -> (anchors [B,A], valid [B,A])."""
    cand = torch.zeros_like(loss_mask, dtype=torch.bool)
    cand[:, 1:-1] = loss_mask[:, 2:].bool()
    A = max(1, int(cand.sum(1).max()))
    order = torch.where(cand, torch.arange(cand.shape[1], device=cand.device), cand.shape[1]).sort(1).values[:, :A]
    valid = order < cand.shape[1]
    return torch.where(valid, order, torch.zeros_like(order)), valid

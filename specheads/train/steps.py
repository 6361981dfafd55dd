"""One forward per head kind: a collated batch -> loss (training) or per-step draft logits (evaluation).

A batch is `collate`'s dict: input_ids [B,T], loss_mask [B,T], attention_mask [B,T], hidden [B,T,F,D] where the F
feature layers are `layers` (hidden_states tuple ids, always including L = the final post-norm state).
The target's next-token logits are recomputed from the layer-L state through the frozen lm_head (never stored).
Shapes: B batch, T sequence, F feature layers, D hidden, K heads / TTT steps, V vocab, V' draft vocab.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specheads.train.losses import LossOutput, eagle3_loss, eagle_loss, medusa_loss, shift_rows
from specheads.utils import SpecheadsError


@dataclass
class LossSettings:
    soft_labels: bool = False  # Medusa: soft CE against the target instead of the data's tokens
    decay: float = 0.8  # 0.8^k per head / TTT step
    noise: float = 0.2  # EAGLE(-3): width w of the uniform noise U(-w/2, w/2) added to input features
    w_reg: float = 1.0  # EAGLE-1 SmoothL1 weight
    w_ce: float = 0.1  # EAGLE-1 soft CE weight
    generator: torch.Generator | None = None  # draws the noise (the trainer's own, saved in checkpoints); None = global


def split_features(hidden: torch.Tensor, layers: list[int], head_layers: list[int], final_layer: int):
    """hidden [B,T,F,D] -> (head input [B,T,F'*D] for the head's own feature layers, final state h_L [B,T,D])."""
    missing = [i for i in list(head_layers) + [final_layer] if i not in layers]
    if missing:
        raise SpecheadsError(f"features: layers {missing} are not in the stored/extracted layers {layers}")
    h_in = torch.cat([hidden[:, :, layers.index(i)] for i in head_layers], dim=-1)  # [B,T,F'*D]
    return h_in, hidden[:, :, layers.index(final_layer)]


@torch.no_grad()
def target_logits(target, h_last: torch.Tensor, loss_mask: torch.Tensor | None = None,
                  vocab: torch.Tensor | None = None) -> torch.Tensor:
    """The target's next-token logits [B,T,V] from its final post-norm state (frozen lm_head, target dtype).

    With loss_mask, only rows predicting an assistant token (loss_mask[j+1] == 1) are computed; the others are 0 and
    never read by the losses (they mask the same rows). The lm_head is the largest matmul of a step on small heads.
    With vocab (target ids [V']) only those columns are computed: [B,T,V'] (Medusa's soft labels over a draft vocab).
    """
    lm = target.lm_head
    h = h_last.to(lm.weight.dtype)
    w = lm.weight if vocab is None else lm.weight[vocab.to(lm.weight.device)]
    b = getattr(lm, "bias", None)
    if b is not None and vocab is not None:
        b = b[vocab.to(b.device)]
    if loss_mask is None:
        return F.linear(h, w, b)
    need = torch.zeros(loss_mask.shape, dtype=torch.bool, device=loss_mask.device)
    need[:, :-1] = loss_mask[:, 1:].bool()
    out = h.new_zeros(*h.shape[:2], w.shape[0])
    out[need] = F.linear(h[need], w, b)
    return out


def _d2t(head) -> torch.Tensor | None:
    return getattr(head, "d2t", None)


def train_loss(kind: str, head, batch: dict, target, layers: list[int], head_layers: list[int],
               settings: LossSettings) -> LossOutput:
    """Forward the (possibly wrapped) head on one batch and return its loss. `head` may be DDP/DeepSpeed-wrapped."""
    h_in, h_last = split_features(batch["hidden"], layers, head_layers, target.num_layers)
    ids, lmask, amask = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
    if kind == "medusa":
        d2t = _d2t(_unwrap(head))
        # soft labels over the draft vocab only need those lm_head rows: [B,T,V'] (6x fewer at 8k of 49k)
        tl = target_logits(target, h_last, lmask, vocab=d2t) if settings.soft_labels else None
        logits = head(h_in.float())  # [K,B,T,V']
        return medusa_loss(logits, ids, lmask, target_logits=tl, decay=settings.decay, d2t=d2t,
                           target_in_draft_vocab=True)
    tl = target_logits(target, h_last, lmask)  # [B,T,V]
    feats = h_in.float()
    if settings.noise > 0:
        u = torch.rand(feats.shape, generator=settings.generator, device=feats.device, dtype=feats.dtype)
        feats = feats + (u - 0.5) * settings.noise  # uniform noise (EAGLE §4.2)
    next_tokens = shift_rows(ids, 1)  # row t pairs f_t with x_{t+1}
    if kind == "eagle":
        pred, logits = head(feats, next_tokens, amask)
        return eagle_loss(pred, logits, h_last, tl, lmask, w_reg=settings.w_reg, w_ce=settings.w_ce,
                          d2t=_d2t(_unwrap(head)))
    if kind == "eagle3":
        steps = head(feats, next_tokens, amask)  # list of [B,T,V'], step i row t predicts x_{t+2+i}
        return eagle3_loss(list(steps), tl, lmask, _d2t(_unwrap(head)), decay=settings.decay)
    raise SpecheadsError(f"head.kind: {kind!r} is not one of ['medusa', 'eagle', 'eagle3']")


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
    targ = target_logits(target, h_last, batch["loss_mask"]).argmax(-1)  # [B,T] greedy token j+1 at row j
    inner = _unwrap(head)
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
    raise SpecheadsError(f"head.kind: {kind!r} is not one of ['medusa', 'eagle', 'eagle3']")

"""EAGLE-1/2: one autoregressive layer on h_L predicting the next feature and token (row t pairs f_t with x_{t+1})."""
from __future__ import annotations

import torch

from specheads.train.kinds.base import Drafts, HeadKind, draft_vocab, noisy_features, unwrap
from specheads.train.losses import LossOutput, eagle_loss, shift_rows
from specheads.train.teacher import target_greedy, target_rows


def loss(head, batch: dict, h_in: torch.Tensor, h_last: torch.Tensor, target, settings) -> LossOutput:
    """SmoothL1 on the predicted feature + the distillation loss on its token (EAGLE-1 paper's weights)."""
    ids, lmask = batch["input_ids"], batch["loss_mask"]
    d2t, dist = draft_vocab(unwrap(head)), settings.distill("eagle")
    rows = target_rows(target, h_last, lmask, d2t, batch, need_greedy=d2t is not None, need_lse=dist.needs_lse)
    feats = noisy_features(h_in, settings)
    pred, logits = head(feats, shift_rows(ids, 1), batch["attention_mask"])
    return eagle_loss(pred, logits, h_last, rows, lmask, w_reg=settings.eagle.w_reg, w_ce=settings.eagle.w_ce, d2t=d2t,
                      loss=dist)


@torch.no_grad()
def drafts(head, batch: dict, h_in: torch.Tensor, h_last: torch.Tensor, target, eagle_steps: int) -> Drafts:
    """EAGLE-1 has no training-time unroll, so steps beyond the first feed the head's own predicted features back
    for every row (row j reads f̂_j): a slight underestimate of serving, where rows before the drafting point keep
    the target's true features."""
    targ = target_greedy(target, h_last, batch)
    next_tokens, amask = shift_rows(batch["input_ids"], 1), batch["attention_mask"]
    feats = h_in.float()
    out = []
    for k in range(eagle_steps):
        pred, logits = head(feats, next_tokens, amask)  # row j predicts f_{j+1}, x_{j+2}
        out.append(shift_rows(logits, k))  # row j of unroll k starts drafting at row t = j - k
        feats = torch.cat([h_in[:, :1].float(), pred[:, :-1]], dim=1)  # row j reads f̂_j
    return Drafts(out, draft_vocab(unwrap(head)), targ)


KIND = HeadKind("eagle", loss, drafts)

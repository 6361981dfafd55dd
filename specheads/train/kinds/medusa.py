"""Medusa: K heads on h_L, head k at row t predicts token t+2+k (hard labels, or soft ones against the target)."""
from __future__ import annotations

import torch

from specheads.train.kinds.base import Drafts, HeadKind, States, at_rows, draft_vocab, unwrap
from specheads.train.losses import LossOutput, medusa_loss
from specheads.train.teacher import target_greedy, target_rows
from specheads.utils import SpecheadsError


def loss(head, batch: dict, h_in: torch.Tensor, h_last: torch.Tensor, target, settings) -> LossOutput:
    """CE on the data's tokens, or with train.medusa.soft_labels the distillation loss against the target at the draft
    vocabulary's columns only (Medusa masks no row by the target's argmax)."""
    ids, lmask = batch["input_ids"], batch["loss_mask"]
    d2t, dist = draft_vocab(unwrap(head)), settings.distill("medusa")
    rows = target_rows(target, h_last, lmask, d2t, batch, need_greedy=False, need_lse=dist.needs_lse) \
        if settings.medusa.soft_labels else None
    logits = head(h_in.float())  # [K,B,T,V']
    return medusa_loss(logits, ids, lmask, target_logits=None if rows is None else rows.logits,
                       decay=settings.decay, d2t=d2t, target_in_draft_vocab=True, loss=dist,
                       target_lse=None if rows is None else rows.lse)


@torch.no_grad()
def drafts(head, batch: dict, h_in: torch.Tensor, h_last: torch.Tensor, target, eagle_steps: int) -> Drafts:
    targ = target_greedy(target, h_last, batch)  # [B,T] greedy token j+1 at row j
    return Drafts(list(head(h_in.float()).unbind(0)), draft_vocab(unwrap(head)), targ)


def check(cfg) -> None:
    """train.loss against Medusa: its hard labels (and Medusa-2) train CE on the data's tokens, not a distillation."""
    if cfg.loss is None:
        return
    lora = cfg.lora.enabled
    if lora or not cfg.medusa.soft_labels:
        what = ("Medusa-2 (train.lora.enabled) trains" if lora
                else "Medusa with train.medusa.soft_labels false trains")
        raise SpecheadsError(f"train.loss: {what} CE on the data's tokens, not a distillation loss; set "
                             f"train.medusa.soft_labels=true{' and train.lora.enabled=false' if lora else ''} "
                             f"or drop train.loss")


def states(head, batch: dict, h_in: torch.Tensor, visited: States) -> torch.Tensor:
    """On-policy replay: head k of the root's previous row drafts depth k (no head reads a drafted token)."""
    logits = head(h_in.float(), heads=int(visited.depth.max()) + 1)  # [K,B,T,V']
    return at_rows(list(logits.unbind(0)), visited)


KIND = HeadKind("medusa", loss, drafts, states, check=check)

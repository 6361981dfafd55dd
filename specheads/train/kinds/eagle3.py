"""EAGLE-3: three fused feature layers, trained with test-time training (TTT) steps on its own predicted features."""
from __future__ import annotations

import torch

from specheads.train.kinds.base import Drafts, HeadKind, States, at_rows, draft_vocab, noisy_features, unwrap
from specheads.train.losses import LossOutput, eagle3_loss, shift_rows
from specheads.train.teacher import target_greedy, target_rows


def loss(head, batch: dict, h_in: torch.Tensor, h_last: torch.Tensor, target, settings) -> LossOutput:
    """The distillation loss per TTT step, weighted decay^k."""
    ids, lmask = batch["input_ids"], batch["loss_mask"]
    d2t, dist = draft_vocab(unwrap(head)), settings.distill("eagle3")
    rows = target_rows(target, h_last, lmask, d2t, batch, need_greedy=d2t is not None, need_lse=dist.needs_lse)
    feats = noisy_features(h_in, settings)
    steps = head(feats, shift_rows(ids, 1), batch["attention_mask"])  # K [B,T,V'], step k row t predicts x_{t+2+k}
    return eagle3_loss(list(steps), rows, lmask, d2t, decay=settings.decay, loss=dist)


@torch.no_grad()
def drafts(head, batch: dict, h_in: torch.Tensor, h_last: torch.Tensor, target, eagle_steps: int) -> Drafts:
    targ = target_greedy(target, h_last, batch)
    steps = head(h_in.float(), shift_rows(batch["input_ids"], 1), batch["attention_mask"])
    return Drafts(list(steps), draft_vocab(unwrap(head)), targ)


def states(head, batch: dict, h_in: torch.Tensor, visited: States) -> torch.Tensor:
    """On-policy replay: the TTT unroll as deep as the deepest visited draft (the unroll is the serving drafter's
    computation along a chain, any depth: step k of row t reads the head's own outputs of steps < k of that row)
    -> [S,V'] at the visited states. No feature noise: these are the states serving meets."""
    depth = int(visited.depth.max()) + 1
    steps = head(h_in.float(), shift_rows(batch["input_ids"], 1), batch["attention_mask"], steps=depth)
    return at_rows(list(steps), visited)


KIND = HeadKind("eagle3", loss, drafts, states)

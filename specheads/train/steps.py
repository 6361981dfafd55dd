"""One training step or one evaluation step of a head, whatever its kind: the batch's features are split into the
head's input and h_L, then the kind's own step (kinds/: one file per kind) runs.

A batch is `dataset.collate`'s dict: input_ids [B,T], loss_mask [B,T], attention_mask [B,T], hidden [B,T,F,D] where
the F feature layers are `layers` (hidden_states tuple ids, always including L = the final post-norm state), and
from offline folders with target sidecars target_greedy [B,T] / target_lse [B,T]. What the steps read of the
target comes from teacher.py (its logits recomputed from h_L through the frozen lm_head, never stored).
Shapes: B batch, T sequence, F feature layers, D hidden, K heads / TTT steps, V vocab, V' draft vocab.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specheads.train.kinds import head_kind
from specheads.train.kinds.base import Drafts, split_features
from specheads.train.losses import (BLOCK_GAMMA, BLOCK_W_CE, BLOCK_W_L1, CONFIDENCE_ALPHA, LK_ETA, DistillLoss,
                                    LossOutput, resolve_loss)


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

    @classmethod
    def from_config(cls, cfg, generator: torch.Generator | None = None) -> "LossSettings":
        """The settings of the recipe's train: section (settings.TrainConfig)."""
        return cls(soft_labels=cfg.soft_labels, decay=cfg.loss_decay, noise=cfg.noise, w_reg=cfg.eagle_w_reg,
                   w_ce=cfg.eagle_w_ce, block_gamma=cfg.block_gamma, block_w_ce=cfg.block_w_ce,
                   block_w_l1=cfg.block_w_l1, confidence_alpha=cfg.confidence_alpha, max_anchors=cfg.max_anchors,
                   block_full_vocab=cfg.block_full_vocab, loss=cfg.loss, lk_eta=cfg.lk_eta, generator=generator)

    def distill(self, kind: str) -> DistillLoss:
        """The resolved distillation loss of `kind` (losses.DEFAULT_LOSS when train.loss is unset)."""
        return resolve_loss(kind, self.loss, self.lk_eta, self.block_w_ce, self.block_w_l1)


def train_loss(kind: str, head, batch: dict, target, layers: list[int], head_layers: list[int],
               settings: LossSettings) -> LossOutput:
    """Forward the (possibly wrapped) head on one batch and return its loss. `head` may be DDP/DeepSpeed-wrapped."""
    h_in, h_last = split_features(batch["hidden"], layers, head_layers, target.num_layers)
    return head_kind(kind).loss(head, batch, h_in, h_last, target, settings)


@torch.no_grad()
def draft_outputs(kind: str, head, batch: dict, target, layers: list[int], head_layers: list[int],
                  eagle_steps: int = 5) -> Drafts:
    """Teacher-forced draft logits per step for evaluation (kinds.base.Drafts): step k at row t predicts token
    t+2+k; block heads add their calibrated confidences."""
    h_in, h_last = split_features(batch["hidden"], layers, head_layers, target.num_layers)
    return head_kind(kind).drafts(head, batch, h_in, h_last, target, eagle_steps)


def draft_step_logits(kind: str, head, batch: dict, target, layers: list[int], head_layers: list[int],
                      eagle_steps: int = 5):
    """draft_outputs as (list of K [B,T,V'], d2t or None, target argmax [B,T])."""
    d = draft_outputs(kind, head, batch, target, layers, head_layers, eagle_steps)
    return d.steps, d.d2t, d.target_greedy

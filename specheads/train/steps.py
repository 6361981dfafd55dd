"""One training step or one evaluation step of a head, whatever its kind: the batch's features are split into the
head's input and h_L, then the kind's own step (kinds/: one file per kind) runs.

A batch is `dataset.collate`'s dict: input_ids [B,T], loss_mask [B,T], attention_mask [B,T], hidden [B,T,F,D] where
the F feature layers are `layers` (hidden_states tuple ids, always including L = the final post-norm state), and
from offline folders with target sidecars target_greedy [B,T] / target_lse [B,T]. What the steps read of the
target comes from teacher.py (its logits recomputed from h_L through the frozen lm_head, never stored).
Shapes: B batch, T sequence, F feature layers, D hidden, K heads / TTT steps, V vocab, V' draft vocab.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specheads.train.kinds import head_kind
from specheads.train.kinds.base import Drafts, split_features
from specheads.train.losses import LK_ETA, DistillLoss, LossOutput, resolve_loss
from specheads.train.settings import BlockTrainConfig, EagleTrainConfig, MedusaTrainConfig, PEagleTrainConfig


@dataclass
class LossSettings:
    decay: float = 0.8  # 0.8^k per head / TTT step
    noise: float = 0.2  # EAGLE(-3): width w of the uniform noise U(-w/2, w/2) added to input features
    loss: str | None = None  # train.loss: the distillation family (losses.py); None = the kind's default
    lk_eta: float = LK_ETA  # LK^λ's η
    # each kind's own settings: the recipe's train.eagle / medusa / block / peagle sections (settings.py)
    eagle: EagleTrainConfig = field(default_factory=EagleTrainConfig)
    medusa: MedusaTrainConfig = field(default_factory=MedusaTrainConfig)
    block: BlockTrainConfig = field(default_factory=BlockTrainConfig)
    peagle: PEagleTrainConfig = field(default_factory=PEagleTrainConfig)
    # the step's random draws (EAGLE feature noise, DSpark anchors, P-EAGLE's COD): the trainer's own, saved in
    # checkpoints; None = torch's global RNG
    generator: torch.Generator | None = None
    # the optimizer step the loss is for and the run's steps (trainer-set; Domino's base-loss weight schedule)
    step: int = 0
    total_steps: int = 1

    @classmethod
    def from_config(cls, cfg, generator: torch.Generator | None = None) -> "LossSettings":
        """The settings of the recipe's train: section (settings.TrainConfig)."""
        return cls(decay=cfg.loss_decay, noise=cfg.noise, loss=cfg.loss, lk_eta=cfg.lk_eta, eagle=cfg.eagle,
                   medusa=cfg.medusa, block=cfg.block, peagle=cfg.peagle, generator=generator)

    def distill(self, kind: str) -> DistillLoss:
        """The resolved distillation loss of `kind` (its KindSpec.default_loss when train.loss is unset)."""
        return resolve_loss(kind, self.loss, self.lk_eta, self.block.w_ce, self.block.w_l1)


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

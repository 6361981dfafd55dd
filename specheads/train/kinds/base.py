"""What one head kind supplies to training and evaluation (a `HeadKind`, registered in kinds/__init__.py).

Every kind reads the same batch: input_ids [B,T], loss_mask [B,T], attention_mask [B,T], hidden [B,T,F,D] (the
F feature layers `layers`, always including L = the final post-norm state), and from offline folders with target
sidecars target_greedy [B,T] / target_lse [B,T]. `split_features` cuts it into the head's input and h_L.
One alignment for every kind: draft step k at row t predicts token t+2+k.
Shapes: B batch, T sequence, F feature layers, D hidden, K heads / steps / block drafts, V' draft vocab.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specheads.utils import SpecheadsError


@dataclass
class Drafts:
    """Teacher-forced draft outputs of one batch, for evaluation."""

    steps: list[torch.Tensor]  # K [B,T,V'] logits; step k at row t predicts token t+2+k
    d2t: torch.Tensor | None  # [V'] target ids of the draft vocabulary (None: the full vocabulary)
    target_greedy: torch.Tensor  # [B,T] the target's greedy token j+1 at row j
    confidence: torch.Tensor | None = None  # [K,B,T] calibrated probabilities (block heads with a confidence head)


@dataclass
class States:
    """Draft states a rollout visited (train/opd.py): state s is the draft at depth[s] of the step whose root (the
    last emitted token, position root[s] of batch row b[s]) started it; it predicts token root[s] + 1 + depth[s].
    On the accepted path every earlier draft of that step equals the sequence's token, so a kind's teacher-forced
    forward on the rolled-out sequence reproduces the served draft distribution there."""

    b: torch.Tensor  # [S] long
    root: torch.Tensor  # [S] long, >= 1 (a context row exists)
    depth: torch.Tensor  # [S] long

    def __len__(self) -> int:
        return int(self.b.numel())


@dataclass(frozen=True)
class HeadKind:
    """The training step and the evaluation step of one head kind, and (optional) its on-policy replay.

    loss(head, batch, h_in [B,T,F'*D], h_last [B,T,D], target, settings: steps.LossSettings) -> LossOutput
    drafts(head, batch, h_in, h_last, target, eagle_steps: int) -> Drafts
    states(head, batch, h_in, states: States) -> logits [S,V'] with gradients: the draft distribution the kind
        serves at each visited state, from its teacher-forced forward on the rolled-out sequences (train.stage
        opd); None = the kind cannot replay its drafts exactly, and the opd stage refuses it
    `head` may be DDP / DeepSpeed-wrapped (`unwrap` reaches the head itself)."""

    name: str
    loss: Callable
    drafts: Callable
    states: Callable | None = None
    check: Callable | None = None  # (TrainConfig) -> None or SpecheadsError: the kind's own checks of train:


def at_rows(steps: list[torch.Tensor], states: States) -> torch.Tensor:
    """Per-row step logits (step k at row t predicts token t+2+k: steps K [B,T,V']) at the visited states: the
    step-`depth` logits of row root - 1 -> [S,V'] in the states' order."""
    parts, order = [], []
    for d in states.depth.unique().tolist():
        idx = (states.depth == d).nonzero().flatten()
        parts.append(steps[d][states.b[idx], states.root[idx] - 1])
        order.append(idx)
    return torch.cat(parts)[torch.cat(order).argsort()]


def split_features(hidden: torch.Tensor, layers: list[int], head_layers: list[int], final_layer: int):
    """hidden [B,T,F,D] -> (head input [B,T,F'*D] for the head's own feature layers, final state h_L [B,T,D])."""
    missing = [i for i in list(head_layers) + [final_layer] if i not in layers]
    if missing:
        raise SpecheadsError(f"features: layers {missing} are not in the stored/extracted layers {layers}")
    h_in = torch.cat([hidden[:, :, layers.index(i)] for i in head_layers], dim=-1)  # [B,T,F'*D]
    return h_in, hidden[:, :, layers.index(final_layer)]


def unwrap(m):
    """The head inside a DDP / DeepSpeed wrapper (the head itself when not wrapped)."""
    return getattr(m, "module", m)


def draft_vocab(head) -> torch.Tensor | None:
    """The head's draft vocabulary d2t [V'] (target ids), or None for the full vocabulary."""
    return getattr(head, "d2t", None)


def noisy_features(h_in: torch.Tensor, settings) -> torch.Tensor:
    """EAGLE(-3) input features in fp32 with uniform noise U(-w/2, w/2), w = settings.noise (EAGLE §4.2), drawn
    from the trainer's own generator."""
    feats = h_in.float()
    if settings.noise > 0:
        u = torch.rand(feats.shape, generator=settings.generator, device=feats.device, dtype=feats.dtype)
        feats = feats + (u - 0.5) * settings.noise
    return feats

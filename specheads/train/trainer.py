"""Training on accelerate. (Owner: train helper; stub.)"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainConfig:
    lr: float = 3e-4
    epochs: int = 1
    max_steps: int | None = None
    batch_size: int = 4
    grad_accum: int = 1
    warmup_steps: int = 50
    max_grad_norm: float = 0.5
    save_every: int = 500
    keep_last: int = 2
    mixed_precision: str = "no"
    tracker: str = "wandb"

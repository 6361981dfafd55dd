"""Evaluation that predicts acceptance: per-head / per-step top-k accuracy and simulated τ. (Owner: train helper; stub.)"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EvalConfig:
    every_steps: int = 200  # optimizer steps between evaluations
    max_samples: int = 64  # held-out samples per evaluation
    topk: int = 5

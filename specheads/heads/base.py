"""Common base for draft heads. (Owner: heads helper; stub.)"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class HeadSpec:
    kind: str = "eagle3"  # medusa | eagle | eagle3
    num_heads: int = 4  # Medusa: K heads (Medusa paper default 4 in the repo's training script)
    num_layers: int = 1  # residual blocks per Medusa head; decoder layers for EAGLE
    draft_vocab_size: int | None = None  # reduced draft vocabulary (EAGLE-3 d2t/t2d); None = target vocab
    feature_layers: list[int] | None = None  # None = the kind's default (docs/architecture.md)

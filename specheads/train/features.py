"""Target hidden states for the heads: offline shards or online per batch. (Owner: data helper; stub.)"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FeatureConfig:
    mode: str = "offline"  # offline: sharded safetensors on disk; online: computed inside training
    layers: list[int] | None = None  # None = what the head kind needs (see docs/architecture.md)
    shard_tokens: int = 262144  # tokens per shard (about 300 MB at hidden 576 bf16 and 1 layer)
    batch_tokens: int = 8192  # tokens per target forward during extraction

"""Conversations -> chat-templated token ids with assistant-only loss masks. (Owner: data helper; stub.)"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DataConfig:
    source: str = "sharegpt"  # alias, ShareGPT JSON/JSONL, OpenAI messages JSONL, or a hub dataset id
    max_conversations: int | None = None  # None = all
    max_length: int = 2048  # tokens per sample (truncated)
    val_fraction: float = 0.02  # held-out share for evaluation
    regenerate: bool = False  # replace assistant turns with the target's own answers (self-distillation)

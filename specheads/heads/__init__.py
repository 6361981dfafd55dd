"""Draft heads (Medusa, EAGLE-1/2, EAGLE-3): one file per kind over a common base. See docs/architecture.md."""
from specheads.heads.base import (  # noqa: F401
    DraftHead, HeadConfig, HeadSpec, build_draft_vocab, build_head, default_feature_layers, load_head,
)

"""Draft heads of every registered kind (dflash2, domino, dspark, dspine, eagle, eagle3, lilicorr, medusa, peagle: the
registry, kinds.py, holds the list, and tests/test_derived_lists.py checks this one against it; a DFlash head is a
dspark head without its Markov and confidence heads): one file per kind over a common base (base.py), exports in
export/ and gguf.py. See docs/architecture.md."""
from specheads.heads.base import (  # noqa: F401
    DraftHead, HeadConfig, HeadSpec, build_draft_vocab, build_head, default_feature_layers, load_head,
)

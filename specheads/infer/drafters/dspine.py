"""DSpine heads (heads/dspine.py): served by the DSpark drafter (drafters/dspark.py) as a block chain; the head's
draft_block re-scores each draft's top-k candidates with the last layer's injection redone on the token chosen
before it (the argmax, or when sampling the drawn token of draft j, is draft j+1's predecessor), inside the block
pass. The drafts' distributions are those re-scored candidates (0 elsewhere), so sampling stays lossless."""
from __future__ import annotations

from specheads.infer.drafters.dspark import _dspark
from specheads.infer.drafters.registry import DrafterKind, register_drafter

KIND = register_drafter(DrafterKind("dspine", "block", "a DSpine head", _dspark, default_tree="auto", head=True))

"""DFlash2 heads (heads/dflash2.py): served by the DSpark drafter (drafters/dspark.py) as a block chain; the head's
draft_block walks its candidate selector along the block inside the one pass (draft j's predecessor is the argmax,
or when sampling the drawn token, of draft j-1), and its logits are the selector's scores on the unary top-k,
-inf elsewhere: the chain's argmax is the walk, and a sampled draft's q is the distribution it was drawn from."""
from __future__ import annotations

from specheads.infer.drafters.dspark import _dspark
from specheads.infer.drafters.registry import DrafterKind, register_drafter

KIND = register_drafter(DrafterKind("dflash2", "block", "a DFlash2 head", _dspark, default_tree="auto", head=True))

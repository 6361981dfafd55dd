"""Domino heads (heads/domino.py): served by the DSpark drafter (drafters/dspark.py) as a block chain; the head's
draft_block runs the GRU correction over the drafted prefix inside the block pass (the argmax, or when sampling the
drawn token of draft j, feeds draft j+1's GRU step)."""
from __future__ import annotations

from specheads.infer.drafters.dspark import _dspark
from specheads.infer.drafters.registry import DrafterKind, register_drafter

KIND = register_drafter(DrafterKind("domino", "block", "a Domino head", _dspark, default_tree="auto", head=True))

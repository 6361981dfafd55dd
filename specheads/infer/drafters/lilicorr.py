"""LiLiCorr heads (heads/lilicorr.py): served by the DSpark drafter (drafters/dspark.py) as a block chain; the head's
draft_block walks its candidate lattice along the block inside the one pass (draft j+1's row is the pair score
leaving the token chosen for draft j: its argmax, or when sampling the drawn token), and its logits are the
lattice's scores on the backbone's top-k, -inf elsewhere: the chain's argmax is the walk, and a sampled draft's q
is the distribution it was drawn from."""
from __future__ import annotations

from specheads.infer.drafters.dspark import _dspark
from specheads.infer.drafters.registry import DrafterKind, register_drafter

KIND = register_drafter(DrafterKind("lilicorr", "block", "a LiLiCorr head", _dspark, default_tree="auto", head=True))

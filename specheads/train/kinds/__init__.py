"""The head kinds training knows, one file each: its training step (loss) and its evaluation step (drafts).

Adding a kind: a module defining `KIND = HeadKind(name, loss, drafts)` (kinds/base.py) and one line below.
"""
from __future__ import annotations

from specheads.train.kinds import block, domino, eagle, eagle3, medusa, peagle
from specheads.train.kinds.base import HeadKind
from specheads.utils import SpecheadsError

KINDS: dict[str, HeadKind] = {k.name: k for k in (medusa.KIND, eagle.KIND, eagle3.KIND, block.KIND,
                                                 domino.KIND, peagle.KIND)}


def head_kind(name: str) -> HeadKind:
    """The registered kind `name` (head.kind), or one SpecheadsError naming the known ones."""
    if name not in KINDS:
        raise SpecheadsError(f"head.kind: {name!r} is not one of {list(KINDS)}")
    return KINDS[name]

"""The head kinds' training steps, one file each: its training step (loss) and its evaluation step (drafts), as a
`HeadKind` (kinds/base.py). A head kind's KindSpec (heads/kinds.py) names its step ("module:KIND"); `head_kind`
looks it up there, so adding a kind edits nothing here.
"""
from __future__ import annotations

from specheads.heads.kinds import kind_spec, kinds, resolve
from specheads.train.kinds.base import HeadKind


def head_kind(name: str) -> HeadKind:
    """The training step of the registered kind `name` (head.kind), or one SpecheadsError naming the known ones."""
    return resolve(kind_spec(name).train_step)


def __getattr__(name: str):
    """KINDS: kind name -> HeadKind, a view of the registry (kept for importers)."""
    if name == "KINDS":
        return {k: resolve(s.train_step) for k, s in kinds().items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

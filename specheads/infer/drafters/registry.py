"""The drafter registry: one entry per head kind (config.kind) or training-free drafter (--drafter), naming its
family once (treespec.FAMILIES: which --tree forms it takes, whether --tree auto applies) and how to build it.
Each drafter's module registers itself with register_drafter; a head kind's KindSpec (heads/kinds.py) names the
one it serves with; build.build_drafter is the one constructor."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from specheads.heads.kinds import kinds, resolve
from specheads.infer.engine.protocol import Drafter
from specheads.infer.treespec import FAMILIES, MAX_TREE_DEPTH, TreeLimits, TreeSpec, parse_tree_spec
from specheads.utils import SpecheadsError


@dataclass(frozen=True)
class DrafterKind:
    name: str  # head kind (config.kind) or training-free drafter name
    family: str  # treespec.FAMILIES key: dynamic | static | block | tokens | none
    label: str  # how messages name it ("an EAGLE-3 head", "prompt-lookup")
    build: Callable[..., Drafter]  # build(target, head | None, spec: TreeSpec, **options) -> Drafter
    default_tree: str | None = None  # --tree when none is given (None: the family takes none)
    head: bool = False  # built from a trained head, else training-free
    check: Callable[..., object] | None = None  # check(target): refuses a target it cannot draft for, before
    # build_drafter measures anything (a scheduler's cost profile)


DRAFTERS: dict[str, DrafterKind] = {}


def register_drafter(kind: DrafterKind) -> DrafterKind:
    if kind.family not in FAMILIES:
        raise ValueError(f"register_drafter {kind.name}: family {kind.family!r} is not one of {list(FAMILIES)}")
    DRAFTERS[kind.name] = kind
    return kind


def drafter_kind(name: str, head: bool = False) -> DrafterKind:
    """The registry entry of a head kind (head=True) or a training-free drafter (--drafter NAME)."""
    if head:  # a head kind serves with the drafter its KindSpec names
        ks = kinds().get(name)
        if ks is None:
            raise SpecheadsError(f"head kind {name!r} has no drafter (head kinds: {', '.join(kinds())})")
        return resolve(ks.drafter)
    kind = DRAFTERS.get(name)
    if kind is None or kind.head:
        free = [k for k, v in DRAFTERS.items() if not v.head]
        raise SpecheadsError(f"--drafter {name}: expected {', '.join(free)} (or --head DIR for a trained head)")
    return kind


def tree_limits(head=None) -> TreeLimits:
    """Bounds of a tree spec for a head (a DraftHead or its HeadConfig): ranks within its draft vocabulary; a block
    head's draft tokens within its block's drafts."""
    cfg = getattr(head, "config", head)
    if cfg is None:
        return TreeLimits()
    kind = kinds().get(getattr(cfg, "kind", None))
    if kind is not None and kind.family == "block":
        return TreeLimits(max_rank=int(cfg.draft_vocab_size or cfg.vocab_size), max_depth=int(cfg.head_spec.num_drafts))
    return TreeLimits(max_rank=int(cfg.draft_vocab_size or cfg.vocab_size))


def parse_tree(text: str | None, name: str, head=None, flag: str = "--tree") -> TreeSpec:
    """`--tree TEXT` for the drafter `name` (a head kind when `head`, a DraftHead or HeadConfig, is given):
    treespec.parse_tree_spec with the drafter's family, label and limits; None = the drafter's default tree."""
    kind = drafter_kind(name, head=head is not None)
    text = kind.default_tree if text is None else text
    if text is None:
        return TreeSpec.none()
    return parse_tree_spec(text, kind.family, drafter=kind.label, limits=tree_limits(head), flag=flag)


def check_lookup(lookup: int) -> None:
    """The prompt-lookup chain scheduled with a head: 0 (off) .. MAX_TREE_DEPTH tokens."""
    if isinstance(lookup, bool) or not isinstance(lookup, int) or not 0 <= lookup <= MAX_TREE_DEPTH:
        raise SpecheadsError(f"--lookup {lookup}: must be 0 (off) .. {MAX_TREE_DEPTH} prompt-lookup tokens")

"""The head-kind registry: one frozen `KindSpec` per head kind, declared in the kind's own module and registered with
`register_kind` (the kinds of this package: `specheads/heads/<kind>.py`; a user's kind: any module of theirs that
calls `register_kind`, imported before use, e.g. with `--plugin`). Everything that differs between kinds is a field
here; the rest of the package asks the registry (`kind_spec(name)`, `kind_names()`, `kinds_where(...)`) instead of
naming kinds.

Discovery: the first lookup imports every public module of `specheads.heads` (a module registers when imported),
so adding a kind of this package is one new module and no central edit. Lookups never run at import time of a
package module (the registry is filled lazily, so a kind module may import the package freely).

References across layers are "module:attribute" strings resolved on use (`resolve`): a head module sits below
train/ and infer/, so it names its training step and its drafter without importing them.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Protocol, runtime_checkable

import torch

from specheads.utils import SpecheadsError

Family = Literal["tree", "block"]


@runtime_checkable
class TreeHead(Protocol):
    """A tree-family head (Medusa, EAGLE, EAGLE-3): each pass gives per-step logits over the draft vocab V', from
    which its drafter grows a token tree (infer/drafters). B batch, T sequence, D hidden, V' draft vocab."""

    kind: str
    config: Any  # heads.base.HeadConfig
    d2t: torch.Tensor | None  # [V'] target ids of the draft vocab, None = the target vocab

    def bind(self, target) -> Any: ...  # shares the target's embedding / lm_head / norm by reference

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor: ...  # draft ids [...] -> target ids [...]

    def save_pretrained(self, out_dir) -> Any: ...

    def forward(self, *args, **kwargs) -> Any: ...  # teacher-forced logits (train/kinds/<kind>.py reads them)


@runtime_checkable
class BlockHead(TreeHead, Protocol):
    """A block-family head (DSpark / DFlash, Domino, P-EAGLE): one pass drafts K = num_drafts tokens after the
    anchor from a per-request cache of the target's features (infer/drafters/dspark.py serves it)."""

    num_drafts: int

    def new_cache(self) -> Any: ...

    def extend_context(self, cache, features: torch.Tensor) -> None: ...  # features [1,T,F*D] of new rows

    def draft_block(self, cache, anchor_token, pick=None) -> tuple[torch.Tensor, torch.Tensor | None]: ...
    # -> logits [K,V'], confidence [K] or None

    def draft_blocks(self, caches: list, anchor_tokens: list[int], pick=None) -> Any: ...  # batched draft_block


PROTOCOLS = {"tree": TreeHead, "block": BlockHead}


@dataclass(frozen=True)
class KindSpec:
    """Everything that distinguishes one head kind. Strings "module:attr" name objects of higher layers (train/,
    infer/, heads/gguf.py), resolved when first needed; a user's module may give the objects themselves."""

    name: str  # head.kind in recipes, `kind` in config.json
    head: type  # the DraftHead subclass
    family: Family  # tree: per-token steps (EAGLE-style tree drafting); block: K drafts per pass
    label: str  # how messages name it ("an EAGLE-3 head")
    feature_layers: Callable[[int], list[int]]  # L (target layers) -> default hidden_states ids
    train_step: str  # "module:attr" of its train.kinds.base.HeadKind (loss step and evaluation step)
    drafter: str  # "module:attr" of its infer.drafters.registry.DrafterKind
    final_state_only: bool = False  # reads only h_L (feature_layers must be [L])
    bias: bool = True  # fc / ResBlock bias when head.bias is null
    default_loss: str = "soft_ce"  # train.loss when unset ({w_ce} / {w_l1}: train.block weights)
    num_drafts: Callable[[Any], int] | None = None  # HeadSpec -> drafts per pass (None: the block's K slots)
    confidence: bool = False  # head.<kind>.confidence_head applies (a per-draft acceptance predictor, calibrated)
    lora: bool = False  # trains LoRA adapters on the target beside the head (Medusa-2: train.lora.enabled)
    mask_token: bool = False  # embeds a mask token (head.mask_token_id resolved against the tokenizer)
    block_positions: bool = False  # a block of head.<kind>.block_size slots must fit the target's positions
    options: type | None = None  # the dataclass of its own head: settings, the recipe's head.<name> section and
    # HeadSpec.options (heads/headspec.py); None: it has none. A variant's extends its parent's (DominoOptions)
    check: Callable[[Any], None] | None = None  # HeadSpec -> None or SpecheadsError: the kind's own spec checks
    formats: tuple[str, ...] = ()  # export formats it writes and reads (besides native)
    unread_by: Mapping[str, str] = field(default_factory=dict)  # "format/consumer" -> why that consumer of one of
    # its formats cannot read this kind (heads/export/consumers.py refuses it, naming the reason)
    needs_target: Callable[[str, Any], bool] | None = None  # (format, HeadConfig) -> the export writes target tensors
    refused: Mapping[str, str] = field(default_factory=dict)  # format -> why this kind is not exported in it
    writers: Mapping[str, str] = field(default_factory=dict)  # format -> "module:attr" of this kind's writer in
    # it, the signature of export/formats.py Format.writer (a format missing here: the format's writer)
    exporter: str | None = None  # "module:attr" of a whole export of its own (cfg, sd, fmt, out_dir, where,
    # verifier) -> Path, for all its formats (the DSpark / DFlash block layouts); None: writers / the format's writer
    gguf: str | None = None  # "module:attr" of its heads.gguf.DraftKind (llama.cpp drafts with it)
    not_drafted: str = ""  # why llama.cpp cannot draft with it (the --format gguf refusal says it)
    default: bool = False  # the kind a head: section without `kind` builds (exactly one registered kind says so)
    example: Mapping[str, Any] = field(default_factory=dict)  # head: keys of a small valid head of this kind on a
    # 4-layer target, its own under its name ({"mask_token_id": 5, "dspark": {"block_size": 4}});
    # tests/test_kind_contract.py builds every registered kind from it
    example_train: Mapping[str, Any] = field(default_factory=dict)  # train: keys its one-step contract check
    # needs (e.g. Domino's λ below 1 at step 0, so that its GRU correction trains in the first step)

    def __post_init__(self) -> None:
        if self.family not in ("tree", "block"):
            raise ValueError(f"KindSpec {self.name}: family {self.family!r} is not tree or block")

    @property
    def protocol(self) -> type:
        """The interface its heads provide: TreeHead or BlockHead."""
        return PROTOCOLS[self.family]

    def drafts(self, spec) -> int:
        """Drafted tokens per head pass: num_drafts(spec), else the block's K slots less the anchor slot unless it
        samples."""
        if self.num_drafts is not None:
            return self.num_drafts(spec)
        return spec.options.block_size - (0 if spec.options.sample_from_anchor else 1)


_KINDS: dict[str, KindSpec] = {}
_IMPORTED: set[str] = set()  # packages whose modules import_modules has imported


def register_kind(spec: KindSpec) -> KindSpec:
    """Register a head kind (call it at the bottom of the kind's module). Registering the same name again replaces
    the entry only when it comes from the same module (a re-import); another module's kind of that name is an
    error."""
    old = _KINDS.get(spec.name)
    if old is not None and old.head.__module__ != spec.head.__module__:
        raise ValueError(f"register_kind {spec.name}: already registered by {old.head.__module__}")
    _KINDS[spec.name] = spec
    return spec


def unregister_kind(name: str) -> None:
    """Remove a registered kind (tests that add one of their own)."""
    _KINDS.pop(name, None)


def import_modules(pkg) -> None:
    """Import every public module (not subpackage) of package `pkg` once: modules that register on import (kinds
    here, export formats in heads/export/formats.py) are found without a list of them. The package is marked first,
    so a module that looks the registry up while it is imported does not start the import again."""
    if pkg.__name__ in _IMPORTED:
        return
    _IMPORTED.add(pkg.__name__)
    for info in pkgutil.iter_modules(pkg.__path__):
        if not info.name.startswith("_") and not info.ispkg:
            importlib.import_module(f"{pkg.__name__}.{info.name}")


def _discover() -> None:
    """Every kind module of specheads.heads imported (each registers its KindSpec)."""
    import specheads.heads as pkg

    import_modules(pkg)


def kinds() -> dict[str, KindSpec]:
    """Every registered kind, by name, in name order (messages list them so)."""
    _discover()
    return dict(sorted(_KINDS.items()))


def kind_names() -> tuple[str, ...]:
    return tuple(kinds())


def kind_spec(name: str) -> KindSpec:
    """The registered kind `name`, or one SpecheadsError naming the known ones."""
    known = kinds()
    if name not in known:
        raise SpecheadsError(f"head.kind: {name!r} is not one of {list(known)}")
    return known[name]


def default_kind() -> str:
    """The kind a head: section builds when it names none (the one KindSpec with default=True)."""
    named = kinds_where(default=True)
    if len(named) != 1:
        raise SpecheadsError(f"head kinds: exactly one must be the default (KindSpec.default), found {list(named)}")
    return named[0]


def kinds_where(**want) -> tuple[str, ...]:
    """Names of the kinds whose fields equal `want` (e.g. family="block")."""
    return tuple(k for k, s in kinds().items() if all(getattr(s, f) == v for f, v in want.items()))


def kind_title(name: str) -> str:
    """How prose names kind `name`: its label without the article and "head" ("an EAGLE-3 head" -> "EAGLE-3"); the
    package description and the docs' lists are checked against these (tests/test_derived_lists.py)."""
    label = kind_spec(name).label
    for article in ("a ", "an "):
        label = label.removeprefix(article)
    return label.removesuffix(" head")


def resolve(ref: str | Any) -> Any:
    """A "module:attr" reference's object (anything else is returned as is)."""
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)

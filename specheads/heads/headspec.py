"""The `head:` section of a recipe (`HeadSpec`): what every kind shares at its top level (kind, num_layers,
draft_vocab_size, feature_layers, bias, mask_token_id), and the kind's own settings in a section named after the
kind, whose dataclass the kind declares in its own module (its `KindSpec.options`):

    head: {kind: dflash2, num_layers: 2, dflash2: {block_size: 7, conv_kernel_size: 2}}

In Python the kind's settings are `spec.options` (an instance of that dataclass, None for a kind without own
settings: `spec.options.block_size`). A variant's options inherit its parent's (heads/domino.py DominoOptions
extends heads/dspark.py BlockOptions). Adding a kind adds its options class in its own module; nothing here.

Old flat spellings. Before the kind sections every setting sat at head:'s top level (`head.block_size`,
`head.domino_gru_hidden`), and head folders wrote their config.json "spec" and runs their train_config.yaml so.
Such a key is still read: a key of head.kind's options goes to its section (`flat_keys`: the field's name, or the
old name its class's FLAT_KEYS gives, e.g. domino_gru_hidden -> gru_hidden; config.load_config warns once,
old -> new, through `section_renames`). A flat key that only another kind has was never read: a recipe or Python
drops it at its default (every written recipe held all of them, whatever its kind) and refuses another value (a
setting the head would not have); a head folder drops it whatever its value (`drop_unread`). The same flat keyword
arguments build a spec in Python (`HeadSpec(kind="dspark", block_size=3)`), without the warning.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

from specheads.heads.kinds import default_kind, kind_names, kind_spec, kinds
from specheads.utils import SpecheadsError, check_values

SHARED = ("kind", "num_layers", "draft_vocab_size", "feature_layers", "bias", "mask_token_id")


@dataclass(init=False)
class HeadSpec:
    """The `head:` section of a recipe: what to build. Resolved against a target into a `HeadConfig`."""

    kind: str | None = None  # a registered kind (heads/kinds.py); None = the default kind (KindSpec.default: EAGLE-3)
    num_layers: int = 1  # residual blocks per Medusa head; decoder layers for EAGLE (EAGLE-1/3 use 1), P-EAGLE and
    # the block drafters
    draft_vocab_size: int | None = None  # reduced draft vocabulary (EAGLE-3 d2t/t2d); None = target vocab
    feature_layers: list[int] | None = None  # None = the kind's default (docs/architecture.md)
    bias: bool | None = None  # fc / ResBlock bias; None = the kind default (Medusa, EAGLE: on; EAGLE-3, P-EAGLE: off)
    mask_token_id: int | None = None  # token embedded at the block's mask slots (P-EAGLE: at depths >= 1); None =
    # the tokenizer's mask / pad / eos / unk token (kinds with KindSpec.mask_token)
    options: Any = None  # the kind's own settings: an instance of its KindSpec.options (head.<kind> in a recipe)
    SELECTOR: ClassVar[str] = "kind"  # the key that picks the section's other keys (config.py applies it first)

    def __init__(self, kind: str | None = None, num_layers: int = 1, draft_vocab_size: int | None = None,
                 feature_layers: list[int] | None = None, bias: bool | None = None, mask_token_id: int | None = None,
                 options: Any = None, **keys: Any) -> None:
        """`keys`: the kind's section under its name (`dspark={...}` or an options instance), or old flat keys."""
        self.kind, self.num_layers, self.draft_vocab_size = kind or default_kind(), num_layers, draft_vocab_size
        self.feature_layers, self.bias, self.mask_token_id = feature_layers, bias, mask_token_id
        self.options = _options(kind_spec(self.kind), options, keys)
        self.__post_init__()

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise SpecheadsError(f"head.num_layers: must be >= 1, got {self.num_layers}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise SpecheadsError(f"head.draft_vocab_size: must be >= 1 or null, got {self.draft_vocab_size}")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise SpecheadsError(f"head.mask_token_id: must be a token id >= 0 or null, got {self.mask_token_id}")
        check_options(self)
        ks = kind_spec(self.kind)
        if ks.check is not None:
            ks.check(self)

    def key(self, name: str) -> str:
        """How a recipe spells the kind's own setting `name` (messages name it so): head.<kind>.<name>."""
        return f"head.{self.kind}.{name}"

    @property
    def num_drafts(self) -> int:
        """Drafted tokens per head pass (KindSpec.drafts: P-EAGLE's K depths; DSpark / DFlash: the K slots, less
        the anchor slot unless it samples)."""
        return kind_spec(self.kind).drafts(self)

    def resolved_bias(self) -> bool:
        return self.bias if self.bias is not None else kind_spec(self.kind).bias

    def to_section(self) -> dict:
        """The section as a recipe and config.json write it: the shared keys, then the kind's under its name."""
        out = {name: copy.deepcopy(getattr(self, name)) for name in SHARED}
        if self.options is not None:
            out[self.kind] = dataclasses.asdict(self.options)
        return out

    # ----- config.py's hooks for a section whose keys depend on its contents -----
    @classmethod
    def section_keys(cls, data: dict) -> dict[str, Any]:
        """{key: type} a head: section may hold: the shared keys, every kind's section (one of another kind than
        head.kind is refused when built, naming it), and the old flat keys."""
        hints = typing.get_type_hints(cls)
        out = {name: hints[name] for name in SHARED}
        out.update({name: ks.options for name, ks in kinds().items() if ks.options is not None})
        for old, (tp, _, _) in all_flat_keys().items():
            out.setdefault(old, tp)
        return out

    @classmethod
    def section_renames(cls, data: dict) -> dict[str, str]:
        """{old flat key: its key now} for a head: section of this data's kind (head.kind's own settings only)."""
        kind = data.get("kind") or default_kind()
        if not isinstance(kind, str) or kind not in kind_names():
            return {}
        return {old: f"{kind}.{new}" for old, new in flat_keys(kind_spec(kind).options).items()}

    @classmethod
    def drop_unread(cls, data: dict) -> dict:
        """A head folder's "spec" without the old flat keys that only other kinds have (never read, whatever their
        value; an old folder held every kind's)."""
        own = cls.section_renames(data)
        return {k: v for k, v in data.items() if k in own or k not in all_flat_keys()}


def option_limits(options: type | None) -> dict[str, str]:
    """{field: range} an options class declares in its LIMITS ClassVar (utils.check_values rules: ">=1", "(0,0.5)"),
    merged over its parents (a variant's extend its parent's: DominoOptions over BlockOptions)."""
    out: dict[str, str] = {}
    for c in reversed(options.__mro__ if options is not None else ()):
        out.update(vars(c).get("LIMITS", {}))
    return out


def check_options(spec: HeadSpec) -> None:
    """The kind's own settings (spec.options) against their annotated types and their class's LIMITS, one
    SpecheadsError naming head.<kind>.<field> and what it must be. A recipe or config.json has been coerced to the
    types already (config.py); this also holds for a spec built in Python. Ranges across fields or against the
    target stay in the kind's own check (KindSpec.check, its head's constructor)."""
    o = spec.options
    if o is None:
        return
    hints = typing.get_type_hints(type(o))
    for f in dataclasses.fields(o):
        _check_type(spec.key(f.name), getattr(o, f.name), hints[f.name])
    check_values(f"head.{spec.kind}", o, option_limits(type(o)))


def _check_type(key: str, v: Any, tp: Any) -> None:
    """One setting's value against its annotation (int, float, bool, str, Literal; others unchecked)."""
    if typing.get_origin(tp) is typing.Literal:
        ok, want = v in typing.get_args(tp), f"one of {list(typing.get_args(tp))}"
    elif tp is bool:
        ok, want = isinstance(v, bool), "true or false"
    elif tp is int:
        ok, want = isinstance(v, int) and not isinstance(v, bool), "an integer"
    elif tp is float:
        ok, want = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), "a finite number"
    elif tp is str:
        ok, want = isinstance(v, str), "a string"
    else:
        return
    if not ok:
        raise SpecheadsError(f"{key}: expected {want}, got {v!r}")


def at_least_one(spec: HeadSpec, *names: str) -> None:
    """The kind's own counts `names` are >= 1 (one error naming the first that is not)."""
    for name in names:
        if getattr(spec.options, name) < 1:
            raise SpecheadsError(f"{spec.key(name)}: must be >= 1, got {getattr(spec.options, name)}")


def flat_keys(options: type | None) -> dict[str, str]:
    """{old flat head: key: field} of an options class: each field under its own name, but a field that its class
    (or a parent) renamed in FLAT_KEYS ({old: field}) under that old name only."""
    if options is None:
        return {}
    renamed: dict[str, str] = {}
    for c in reversed(options.__mro__):
        renamed.update(vars(c).get("FLAT_KEYS", {}))
    out = {f.name: f.name for f in dataclasses.fields(options) if f.name not in renamed.values()}
    return {**out, **renamed}


def all_flat_keys() -> dict[str, tuple[Any, Any, list[str]]]:
    """{old flat key: (type, default, the kinds that have it)} over every registered kind."""
    out: dict[str, tuple[Any, Any, list[str]]] = {}
    for name, ks in kinds().items():
        if ks.options is None:
            continue
        hints = typing.get_type_hints(ks.options)
        fields = {f.name: f for f in dataclasses.fields(ks.options)}
        for old, new in flat_keys(ks.options).items():
            f = fields[new]
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out.setdefault(old, (hints[new], default, []))[2].append(name)
    return out


def _options(ks, options: Any, keys: dict[str, Any]) -> Any:
    """The kind's options from `options` (an instance), its section under its name (a mapping or an instance) and
    old flat keys; a section of another kind, an unknown key or another kind's setting changed: one error."""
    kind, cls = ks.name, ks.options
    own = flat_keys(cls)
    section, moved = None, {}
    for k, v in keys.items():
        if k == kind:
            section = v
        elif k in kind_names():
            raise SpecheadsError(f"head.{k}: the section of kind {k}, and head.kind is {kind!r}; move its keys to "
                                 f"head.{kind}, or remove it")
        elif k in own:
            moved[own[k]] = v
        elif k in (legacy := all_flat_keys()):
            _, default, owners = legacy[k]
            if v != default:
                raise SpecheadsError(f"head.{k}: a setting of {', '.join(owners)} heads, not of {ks.label} "
                                     f"(head.kind {kind!r}); remove it")
        else:
            raise SpecheadsError(f"head.{k}: unknown key; known keys: {sorted([*SHARED, kind])}")
    if cls is None:
        if section is not None or moved or options is not None:
            raise SpecheadsError(f"head.{kind}: {ks.label} has no settings of its own")
        return None
    if section is not None and options is not None:
        raise SpecheadsError(f"head.{kind}: given both as options= and under its name; give one")
    base = section if section is not None else options
    if base is None:
        base = cls()
    elif isinstance(base, dict):
        try:
            base = cls(**base)
        except TypeError as e:
            raise SpecheadsError(f"head.{kind}: {e}") from None
    if type(base) is not cls:
        raise SpecheadsError(f"head.{kind}: expected its settings as {cls.__name__}, got {type(base).__name__}")
    both = [k for k in moved if section is not None and (not isinstance(section, dict) or k in section)]
    if both:
        raise SpecheadsError(f"head.{next(o for o, n in own.items() if n == both[0])} and head.{kind}.{both[0]}: "
                             f"the same setting under its old and its new name; keep only head.{kind}.{both[0]}")
    return dataclasses.replace(base, **moved) if moved else base

"""The export formats' registry: each format family module (export/<family>.py, or a user's module) declares the
formats it writes and reads as a `Format` and registers it with `register_format`; a layout that dispatches on a
model type inside its config (speculators' speculators_model_type, SpecForge's dflash_config.projector_type) takes
the readers of its variants from `register_variant`, called by the module of the kind that writes that variant. The
shared modules (registry.py, consumers.py, speculators.py) look formats and variants up here instead of naming
formats or head kinds.

Discovery: the first lookup imports every public module of `specheads.heads.export` (a module registers when
imported), as the kind registry does (heads/kinds.py): a new format is one new module, and no central edit.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from specheads.heads.kinds import import_modules
from specheads.utils import SpecheadsError


@dataclass(frozen=True)
class Format:
    """One layout a head folder is written in or read from (besides native and gguf)."""

    name: str  # --format / --from-format value, and specheads_export in the written safetensors
    rank: int  # place among the --format choices (FORMATS lists the written formats by rank)
    writer: Callable | None = None  # (cfg, sd, expected, **ctx) -> (config, tensors, required keys): the writer of
    # the kinds that have none of their own (KindSpec.writers / exporter); None: every kind writing it has its own
    reader: Callable | None = None  # (config, sd, target, config path, weights path) -> (HeadSpec, native sd)
    detect: Callable[[dict], bool] | None = None  # config.json -> whether a folder has this layout
    detect_rank: int = 0  # detection order: the more specific layouts first (eagle, the plainest, last)
    loaders: Mapping[str, str] = field(default_factory=dict)  # consumer (--consumer) -> its loader as messages
    # name it, in the order `consumers_of` lists them
    opt_in: tuple[str, ...] = ()  # consumers checked only when named (--consumer)
    problems: Callable | None = None  # (format, consumer, HeadConfig) -> why that consumer cannot read the head
    repo_rope: bool = False  # a layout the original research repos save: import_rope reads its RoPE base
    written: bool = True  # False: read only (an import layout, not a --format choice)


_FORMATS: dict[str, Format] = {}
_VARIANTS: dict[str, dict[str, Callable]] = {}


def register_format(fmt: Format) -> Format:
    """Register an export format (call it at the bottom of the family's module); a re-import replaces it."""
    _FORMATS[fmt.name] = fmt
    return fmt


def register_variant(fmt: str, model_type: str, reader: Callable) -> Callable:
    """Register the reader of `fmt` folders whose model type (the key `fmt`'s reader dispatches on) is
    `model_type`; the reader has a Format.reader's signature."""
    _VARIANTS.setdefault(fmt, {})[model_type] = reader
    return reader


def _discover() -> None:
    """Every module of specheads.heads.export imported (each family module registers its formats)."""
    import specheads.heads.export as pkg

    import_modules(pkg)


def formats() -> dict[str, Format]:
    """Every registered format, by name, in rank order."""
    _discover()
    return dict(sorted(_FORMATS.items(), key=lambda kv: (kv[1].rank, kv[0])))


def format_spec(name: str) -> Format | None:
    """The registered format `name`, None when there is none."""
    return formats().get(name)


def variants(fmt: str) -> dict[str, Callable]:
    """model type -> reader of `fmt`'s variants (register_variant, called by each kind's export module), in name
    order."""
    _discover()
    out = _VARIANTS.get(fmt, {})
    return {t: out[t] for t in sorted(out)}


def written_formats() -> tuple[str, ...]:
    """The formats `--format` writes through export/ (native and gguf aside), in rank order."""
    return tuple(n for n, f in formats().items() if f.written)


def read_only_formats() -> tuple[str, ...]:
    """The layouts only imported (`--from-format`), in rank order."""
    return tuple(n for n, f in formats().items() if not f.written)


def writer_of(fmt: str) -> Callable:
    """The format's own writer, or one SpecheadsError when it has none (every kind writing it brings its own)."""
    f = format_spec(fmt)
    if f is None or f.writer is None:
        raise SpecheadsError(f"--format {fmt}: no writer of its own; the head's kind must declare one "
                             "(KindSpec.writers or KindSpec.exporter)")
    return f.writer

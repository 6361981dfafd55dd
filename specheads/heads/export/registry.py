"""The dispatch over the formats: `export_head` writes a native head folder in a format (the kind's own writer, else
the format's: each family module, export/<family>.py, registers its `Format` with export/formats.py),
`import_head` detects a folder's layout and reads it back (the registered format's reader). Consumer:
`specheads export` (commands/export.py); the native format is our own (heads/base.py save_pretrained /
load_head: HeadConfig and our state dict).

Writers: (cfg, sd, expected keys, **ctx) -> (config dict, tensors, keys the consumer needs). Readers: (config,
state dict, target, config path, weights path) -> (HeadSpec, native state dict).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from specheads.heads.base import (
    CONFIG_NAME, WEIGHTS_NAME, DraftHead, HeadConfig, head_class, load_head, load_state_checked, read_head_config,
    write_safetensors,
)
from specheads.heads.export.common import SPECULATIVE_TOKENS, check_keys, resolve_verifier
from specheads.heads.export.consumers import check_consumers
from specheads.heads.export.formats import format_spec, formats, read_only_formats, writer_of, written_formats
from specheads.heads.export.repos import import_rope
from specheads.heads.kinds import kind_spec, kinds, resolve
from specheads.heads.locate import head_folder, read_weights
from specheads.utils import SpecheadsError, atomic_dir, atomic_write_json, read_json

log = logging.getLogger(__package__)  # the package's one logger, specheads.heads.export

NATIVE, GGUF = "native", "gguf"  # our own format (heads/base.py); llama.cpp's (heads/gguf.py, on an export from here)
BLOCK_FORMATS = ("speculators", "specforge")  # the formats a dspark head exports to (speculators: dspark / dflash)
_SKIP_ON_IMPORT = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")  # target's, not ours


def all_formats() -> tuple[str, ...]:
    """The --format choices: native, the registered formats written through export/ in rank order, gguf."""
    return (NATIVE, *written_formats(), GGUF)


def export_head(head_dir: str | Path, fmt: str, out_dir: str | Path, target=None,
                verifier_name_or_path: str | None = None, speculative_tokens: int = SPECULATIVE_TOKENS,
                consumers: list[str] | None = None) -> Path:
    """Write the native head folder `head_dir` in layout `fmt` to `out_dir` (atomically).

    `target` (checked against the head's fingerprint) is needed where the export writes the target's tensors
    (`needs_target`): speculators for EAGLE-3 / P-EAGLE heads (the token embedding speculators reads from the
    checkpoint) and medusa-vllm with the shared lm_head (vLLM wants one projection per head).
    `verifier_name_or_path`: the verifier model written into the export (default: the head's target, our aliases
    as their hub id). `consumers`: the readers to check the head against (default: the format's engines,
    `consumers_of(fmt, default_only=True)`); one that cannot read it is an error naming it and the reason.
    """
    if fmt not in all_formats():
        raise SpecheadsError(f"--format: {fmt!r} is not one of {list(all_formats())}")
    if fmt == GGUF:  # heads/gguf.py builds on this package: it runs llama.cpp's converter on an eagle3 export
        raise SpecheadsError("--format gguf: written by specheads.heads.gguf.export_gguf (llama.cpp's converter), "
                             "as `specheads export --format gguf` does")
    head_dir = head_folder(head_dir)  # a folder or a hub id (heads/locate.py)
    cfg = read_head_config(head_dir)
    sd, wpath = read_weights(head_dir)  # model.safetensors or the shards of its index
    where = str(wpath)
    ks = kind_spec(cfg.kind)
    if fmt != NATIVE and fmt not in ks.formats:  # the kind's KindSpec says the formats it is written in
        if fmt in ks.refused:
            raise SpecheadsError(f"--format {fmt}: {ks.refused[fmt]}")
        raise SpecheadsError(f"--format {fmt}: needs a {' or '.join(kinds_of_format(fmt))} head, {head_dir} holds "
                             f"a {cfg.kind} head (exported as {', '.join((NATIVE, *ks.formats))}"
                             f"{', gguf' if ks.gguf else ''})")
    if fmt != NATIVE and ks.exporter is not None:  # the kind writes its formats itself (DSpark / DFlash blocks)
        return resolve(ks.exporter)(cfg, sd, fmt, out_dir, where, verifier_name_or_path)
    # Every key our own head would have must be present (a truncated export is worse than none).
    expected = list(head_class(cfg.kind)(cfg).state_dict())  # built on CPU: small next to the checkpoint itself
    check_keys(sd, expected, where)

    if fmt == NATIVE:
        config, tensors = cfg.to_dict(), sd
    else:
        chosen = check_consumers(fmt, cfg, consumers, str(head_dir))
        verifier, note = resolve_verifier(cfg, verifier_name_or_path)
        writer = resolve(ks.writers[fmt]) if fmt in ks.writers else writer_of(fmt)  # the kind's own, or the format's
        config, tensors, required = writer(cfg, sd, expected, target=target, where=str(head_dir), verifier=verifier,
                                           speculative_tokens=speculative_tokens)
        check_keys(tensors, required, f"export {fmt}")
        config["specheads"] = {"format": fmt, "consumers": chosen, "head_target": cfg.target_name,
                               "verifier": verifier, "feature_layers": sorted(cfg.feature_layers)}
        if note:
            config["specheads"]["verifier_note"] = note
            log.warning("%s", note)
    with atomic_dir(out_dir) as tmp:
        atomic_write_json(tmp / CONFIG_NAME, config)
        write_safetensors(tensors, tmp / WEIGHTS_NAME, metadata={"format": "pt", "specheads_export": fmt})
    log.info("exported %s head %s as %s to %s (%d tensors)", cfg.kind, head_dir, fmt, out_dir, len(tensors))
    return Path(out_dir)


def needs_target(head_dir: str | Path, fmt: str) -> bool:
    """Whether exporting `head_dir` as `fmt` writes tensors of the target: its token embedding in speculators'
    EAGLE-3 / P-EAGLE layout (export/common.py target_embedding), its lm_head rows for a Medusa head that shares it
    (export/medusa.py): the kind's KindSpec.needs_target. `specheads export` then loads the head's own target when
    --target is not given."""
    cfg = read_head_config(Path(head_dir))
    ks = kind_spec(cfg.kind)
    return fmt in ks.formats and ks.needs_target is not None and ks.needs_target(fmt, cfg)


def kinds_of_format(fmt: str) -> tuple[str, ...]:
    """The head kinds written in `fmt` (their KindSpec.formats name it)."""
    return tuple(k for k, s in kinds().items() if fmt in s.formats)


def __getattr__(name: str):
    """FORMATS (the --format choices) and KIND_OF_FORMAT (format -> the kinds written in it): views of the format
    and kind registries, built on first use (the registries fill lazily)."""
    if name == "FORMATS":
        return all_formats()
    if name == "KIND_OF_FORMAT":
        return {fmt: kinds_of_format(fmt) for fmt in all_formats() if kinds_of_format(fmt)}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def detect_format(src: Path, config: dict) -> str:
    """The layout of a folder from its config.json: native, else the first registered format (by detect_rank,
    the more specific first) whose detect accepts it."""
    if "format_version" in config and "fingerprint" in config:
        return NATIVE
    for f in sorted(formats().values(), key=lambda f: f.detect_rank):
        if f.detect is not None and f.detect(config):
            return f.name
    raise SpecheadsError(f"{src / CONFIG_NAME}: cannot tell the checkpoint format (no known keys)")


def import_head(src_dir: str | Path, target, fmt: str | None = None, rope_theta=None) -> DraftHead:
    """Load a head in any supported layout (auto-detected from config.json unless `fmt` is given) from a folder or a
    hub id, its weights in one safetensors file or in shards under an index, against `target`.
    Returns a bound head; `.save_pretrained` writes it natively. `rope_theta` ("checkpoint", "target", a base, or
    None: refuse a mismatch) decides the RoPE base of an EAGLE repo layout whose base is not the target's
    (export/repos.py import_rope)."""
    src = head_folder(src_dir, "folder")  # a folder or a hub id (heads/locate.py)
    cpath = src / CONFIG_NAME
    config = read_json(cpath)
    if not isinstance(config, dict):
        raise SpecheadsError(f"{cpath}: expected a JSON object")
    fmt = fmt or detect_format(src, config)
    if fmt == NATIVE:
        return load_head(src, target)
    layout = format_spec(fmt)
    if layout is None or layout.reader is None:
        raise SpecheadsError(f"--format: {fmt!r} is not one of {list(all_formats()) + list(read_only_formats())}")
    sd, wpath = read_weights(src, (WEIGHTS_NAME, "medusa_lm_head.safetensors"), any_file=True)  # shards too
    sd = {k: v for k, v in sd.items() if k not in _SKIP_ON_IMPORT}
    spec, tensors = layout.reader(config, sd, target, str(cpath), str(wpath))
    cfg = HeadConfig.from_target(spec, target)
    if layout.repo_rope:  # a layout the EAGLE repos save: their RoPE base may not be the target's
        cfg = import_rope(cfg, config, rope_theta, str(cpath))
    head = head_class(spec.kind)(cfg)
    load_state_checked(head, tensors, wpath)
    dtype = next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)
    log.info("imported %s checkpoint %s as a %s head", fmt, src, spec.kind)
    return head.to(device=target.device, dtype=dtype).bind(target)

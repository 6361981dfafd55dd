"""`specheads export`: write a head folder in another layout, or import a foreign checkpoint as a native folder.

    specheads export --head runs/x/head --format speculators --out runs/x/speculators
    specheads export --head runs/x/head --format gguf --out runs/x/gguf --target-gguf   (llama.cpp; make llamacpp)
    specheads export --import path/to/EAGLE3-checkpoint --target smollm2-135m --out runs/imported
    specheads export --import path/to/EAGLE-checkpoint --target smollm2-135m --rope-theta checkpoint --out runs/imp
    specheads export --import org/published-eagle3-head --target smollm2-135m --out runs/imported   (a hub id)

--head and --import take a folder or a hub id (org/name[@revision], resolved through the hub cache, HF_HUB_OFFLINE
honoured: heads/locate.py), whose weights may be one safetensors file or shards under an index.

An EAGLE repo checkpoint whose RoPE base (its rope_theta, 10000 when absent) is not the target's is refused unless
--rope-theta says which base the head runs at (heads/export/repos.py import_rope); an export that writes the
target's tensors loads the head's recorded target when --target is not given (heads/export/registry.py needs_target).

`--out` is replaced atomically, and only when that loses nothing: it must be absent, empty, or an earlier output of
the same kind from the same source (recognised by the format recorded in its model.safetensors metadata and the
source named in its export_info.json, and holding only the files we write), unless `--force`; it may never be,
contain or lie inside a folder the command reads (--head, the --import source, a --target folder), --force or not,
nor hold a live run (a train's lock in it or below it: utils.refuse_held); a symlinked --out is written through.
A --head whose weights differ from their recorded sha256 is refused; --import warns when the head's config names
another target than --target (heads/export_guards.py). A --head exported with a target loaded (--target, the one
a format needs, the one llama.cpp's converter reads) is checked against the target it was trained on (heads/base.py
check_target; --allow-other-target); every export but native carries that record in specheads_target.json.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from specheads.commands import args as shared
from specheads.utils import SpecheadsError, atomic_dir

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specheads.heads.export import FORMATS, SPECULATIVE_TOKENS

    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--head", help="native head folder (or hub id org/name[@revision]) to export")
    src.add_argument("--import", dest="import_dir",
                     help="foreign checkpoint folder or hub id (org/name[@revision]; weights in one safetensors file "
                          "or shards with an index) to import (eagle, eagle3, speculators, medusa-vllm, "
                          "FasterDecoding Medusa; auto-detected) into a native folder; needs --target (a head whose "
                          "config names another target is bound to --target with a warning naming both)")
    p.add_argument("--format", choices=FORMATS, default=None, help="export layout (required with --head)")
    p.add_argument("--from-format", default=None,
                   help="with --import: the layout, when auto-detection from config.json is not wanted")
    p.add_argument("--out", required=True,
                   help="output folder (written atomically; absent, empty, or an earlier export of the same head in the "
                        "same format)")
    p.add_argument("--force", action="store_true",
                   help="replace --out even when it holds other files or another head's export (never a folder the "
                        "command reads)")
    p.add_argument("--target", default=None,
                   help="target (alias, folder, hub id or .gguf): required with --import; an export that writes the "
                        "target's tensors (speculators for EAGLE-3 / P-EAGLE: its token embedding; medusa-vllm for a "
                        "head sharing its lm_head) loads the head's recorded target when not given")
    p.add_argument("--rope-theta", default=None, metavar="checkpoint|target|N",
                   help="with --import of an EAGLE repo layout (eagle, eagle3) whose RoPE base (its rope_theta; the "
                        "repo's default 10000 when absent) is not the target's: 'checkpoint' runs the head at its "
                        "own base as the EAGLE repo does, 'target' rebuilds it at the target's, N at base N "
                        "(default: such a mismatch is refused)")
    shared.add_dtype(p, why="when --target is loaded; default float32")
    shared.add_allow_other_target(p)
    p.add_argument("--verifier", default=None,
                   help="the verifier model the export names (every format; speculators also in its "
                        "speculators_config): default the head's target, our aliases as their hub id")
    p.add_argument("--consumer", action="append", default=None,
                   help="check the export against this consumer only (repeatable; default: every engine that reads "
                        "the format; docs/exports.md lists them)")
    p.add_argument("--target-gguf", action="store_true",
                   help="gguf: also write the target as target.gguf (from --target or the head's recorded target)")
    p.add_argument("--gguf-type", default="bf16", help="gguf: converter --outtype (f32, f16, bf16, q8_0; default bf16)")
    p.add_argument("--speculative-tokens", type=int, default=SPECULATIVE_TOKENS,
                   help=f"speculators: greedy proposal length (default {SPECULATIVE_TOKENS}, speculators' own default)")


def check_out(out: str, fmt: str, source: str, force: bool, reads: dict[str, str | None] | None = None) -> None:
    """--out never is, holds or lies inside a folder the command reads (`source`, `reads`), --force or not; without
    --force it is absent, empty, or an earlier `fmt` export of the same source (export_guards)."""
    from specheads.heads.export_guards import check_read_folders, is_same_export
    from specheads.utils import refuse_replacing

    check_read_folders(out, reads or {})
    refuse_replacing(out, [source], lambda d: is_same_export(d, fmt, source), f"{fmt} export of {source}", force)


def run(args: argparse.Namespace) -> int:
    from specheads.runlock import run_lock

    if args.head and args.format is None:
        raise SpecheadsError("--format: required with --head")
    if args.rope_theta is not None and not args.import_dir:
        raise SpecheadsError("--rope-theta: only with --import (the RoPE base of an imported EAGLE repo checkpoint)")
    from specheads.heads.export.repos import parse_rope_choice

    parse_rope_choice(args.rope_theta)  # a bad value is one line before anything is loaded
    from specheads.heads.locate import head_folder

    # a hub id (org/name[@revision]) becomes its snapshot folder in the hub cache: what is read, guarded, recorded
    if args.head:
        args.head = str(head_folder(args.head))
    if args.import_dir:
        args.import_dir = str(head_folder(args.import_dir, "folder"))
    fmt, source = ("native" if args.import_dir else args.format), args.import_dir or args.head
    reads = {"--target": args.target}
    check_out(args.out, fmt, source, args.force, reads)  # before the lock: never a lock file inside the source
    # --out is replaced whole, so its lock lies beside it (<parent>/.<name>.specheads.lock)
    with run_lock(args.out, "export", beside=True):
        check_out(args.out, fmt, source, args.force, reads)  # again, now that no other export can write there
        from specheads.heads.export_guards import write_export_info

        # the export and its record (what a later export may replace without --force) appear in one rename: a
        # kill leaves --out as it was, and the rerun of the same command is taken
        with atomic_dir(args.out) as staged:
            rc = _export(args, staged)
            write_export_info(staged, source, fmt)
    return rc


def _export(args: argparse.Namespace, out) -> int:
    """Write the export (or the import) into `out`, the staged folder that becomes --out."""
    from specheads.heads.base import read_head_config
    from specheads.heads.export import export_head, import_head, needs_target
    from specheads.heads.export_guards import verify_head, warn_other_target, write_target_sidecar

    if args.head:
        verify_head(args.head)  # a damaged head (sha256 differs) is never copied into an export
    if args.head and args.format == "gguf":  # the converter reads folders: the target is loaded for the check only
        from specheads.heads.gguf import export_gguf

        cfg = read_head_config(Path(args.head))
        if cfg.target_record is not None:  # an older head: the converter's own embedding / lm_head check
            _checked_target(args, args.target or cfg.target_name)
        export_gguf(args.head, out, target=args.target, with_target=args.target_gguf, outtype=args.gguf_type,
                    allow_other_target=args.allow_other_target)
        write_target_sidecar(out, args.head)
        print(f"exported {args.head} as gguf -> {args.out}")
        return 0
    target = _checked_target(args, args.target) if args.target else None
    if args.head and target is None and needs_target(args.head, args.format):
        name = read_head_config(Path(args.head)).target_name
        log.info("loading the head's target %r: --format %s writes its tensors (give --target to name another "
                 "copy of it)", name, args.format)
        target = _checked_target(args, name)
    if args.import_dir:
        if target is None:
            raise SpecheadsError("--import: needs --target (the head is checked against it and bound to it)")
        warn_other_target(args.import_dir, args.target)
        from specheads.heads.export.repos import parse_rope_choice

        head = import_head(args.import_dir, target, fmt=args.from_format,
                           rope_theta=parse_rope_choice(args.rope_theta))
        head.save_pretrained(out)
        print(f"imported {args.import_dir} as a {head.kind} head -> {args.out}")
        return 0
    if args.speculative_tokens < 1:
        raise SpecheadsError(f"--speculative-tokens {args.speculative_tokens}: must be >= 1")
    export_head(args.head, args.format, out, target=target, verifier_name_or_path=args.verifier,
                speculative_tokens=args.speculative_tokens, consumers=args.consumer)
    if args.format != "native":  # native: its config.json is the head's, target_record included
        write_target_sidecar(out, args.head)
    print(f"exported {args.head} as {args.format} -> {args.out}")
    return 0


def _checked_target(args: argparse.Namespace, name: str):
    """Load the target `name` (--dtype) and, exporting a --head, check the head against it (heads/base.py
    check_target: refused when it is not the target the head was trained on, unless --allow-other-target)."""
    from specheads.heads.base import check_target, read_head_config
    from specheads.target import load_target

    target = shared.allow_other_target(load_target(name, dtype=args.dtype), args)
    if args.head:
        check_target(read_head_config(Path(args.head)), target, str(Path(args.head)))
    return target

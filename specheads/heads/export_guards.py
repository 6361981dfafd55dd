"""What `specheads export` checks before it writes --out (commands/export.py calls these).

    export_info.json   written into every export and import: the format and the source folder (resolved path, and
                       the sha256 of its model.safetensors when it has one)
    specheads_target.json  beside every export other than native (whose config.json carries it): the target the
                       head was trained on, its `fingerprint` and `target_record` (specheads/target_record.py), kept
                       out of the formats' own config.json so that no consumer's loader meets a key it does not know

- `--out` is replaced without --force only when it is absent, empty, or an earlier export of the same format OF THE
  SAME SOURCE (its export_info.json names the folder this command reads). A head folder written by training (best/,
  final/), an export of another head, or an export made before export_info.json existed needs --force.
- A folder the command reads (--head, the --import source, a --target folder) is never replaced, never contains
  --out and never lies inside it: --force or not.
- A folder a live process holds (a run lock inside --out, beside it or in a folder below it: a train running there)
  is never replaced either, --force or not (utils.refuse_held, through refuse_replacing, run_lock and atomic_dir);
  a --out that is a symlink is written through, the link kept.
- `--head`: model.safetensors is checked against the model.safetensors.sha256 training wrote beside it first (a
  damaged head is never copied into an export).
- `--import`: a head whose config names another target than --target is imported with a warning naming both
  (shapes and, for native heads, the target fingerprint are checked by the import itself; the names alone may differ
  for good reasons: a local copy of the hub model, a fine-tune of the same base).
"""
from __future__ import annotations

import logging
from pathlib import Path

from safetensors import safe_open

from specheads.heads.base import check_checksum
from specheads.heads.export import HUB_IDS
from specheads.utils import SpecheadsError, atomic_write_json, path_relation, read_json, sha256_file

log = logging.getLogger(__name__)

INFO_NAME = "export_info.json"
TARGET_SIDECAR = "specheads_target.json"  # the head's target record beside a non-native export
OWN_FILES = {"config.json", "model.safetensors", "model.safetensors.sha256", INFO_NAME, TARGET_SIDECAR}
GGUF_FILES = {"draft.gguf", "target.gguf", "gguf_export.json", INFO_NAME, TARGET_SIDECAR}  # `--format gguf`'s


def written_format(folder: Path) -> str | None:
    """The format of an earlier `specheads export` (or of a native head folder) in `folder`, from the metadata of its
    model.safetensors; None when the folder holds anything else."""
    names = {p.name for p in folder.iterdir()}
    if names and names <= GGUF_FILES and "gguf_export.json" in names:
        return "gguf"
    if not names <= OWN_FILES or not (folder / "model.safetensors").is_file():
        return None
    try:
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception:  # noqa: BLE001 - unreadable: not recognisably ours
        return None
    return meta.get("specheads_export") or ("native" if "kind" in meta else None)


def _resolved(path) -> str:
    return str(Path(path).resolve())


def export_of(folder: Path) -> dict | None:
    """export_info.json of `folder` (None when absent or unreadable)."""
    path = Path(folder) / INFO_NAME
    if not path.is_file():
        return None
    try:
        info = read_json(path)
    except (SpecheadsError, OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def is_same_export(folder: Path, fmt: str, source) -> bool:
    """`folder` is an earlier export in `fmt` of the folder `source` (so replacing it loses nothing)."""
    info = export_of(folder)
    return (written_format(folder) == fmt and info is not None and info.get("format") == fmt
            and info.get("source") == _resolved(source))


def write_export_info(out, source, fmt: str) -> None:
    """Record where the export in `out` came from (after it was written)."""
    weights = Path(source) / "model.safetensors"
    atomic_write_json(Path(out) / INFO_NAME, {"format": fmt, "source": _resolved(source),
                                             "source_sha256": sha256_file(weights) if weights.is_file() else None})


def write_target_sidecar(out, head_dir) -> None:
    """specheads_target.json in `out`: the target `head_dir` was trained on, as its config.json records it."""
    from specheads.heads.base import read_head_config

    cfg = read_head_config(Path(head_dir))
    atomic_write_json(Path(out) / TARGET_SIDECAR, {
        "head": _resolved(head_dir), "target_name": cfg.target_name, "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size, "fingerprint": cfg.fingerprint, "target_record": cfg.target_record})


def check_read_folders(out, reads: dict[str, str | None]) -> None:
    """`reads`: {flag: path} of what the command reads besides the source (e.g. {"--target": ...}); a path that is not
    a local folder or file (an alias, a hub id) is skipped. --out is, contains or lies inside one: refused, --force
    or not."""
    for flag, path in reads.items():
        if not path or not Path(path).exists():
            continue
        rel = path_relation(out, path)
        if rel:
            raise SpecheadsError(f"--out {out}: {rel} the folder {flag} {path} that this command reads; it is never "
                                 f"replaced (--force or not): choose another folder")


def verify_head(head_dir) -> None:
    """--head: its model.safetensors against the recorded sha256 (heads/base.check_checksum), before any export."""
    head_dir = Path(head_dir)
    if (head_dir / "model.safetensors").is_file():
        check_checksum(head_dir)


def named_target(src: Path) -> str | None:
    """The target a head folder's config.json names: native target_name, our exports' specheads.head_target,
    speculators' verifier, the Medusa / PEFT base_model_name_or_path, or base_model; None when it names none."""
    try:
        config = read_json(Path(src) / "config.json")
    except (SpecheadsError, OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    ours = config.get("specheads") if isinstance(config.get("specheads"), dict) else {}
    spec = config.get("speculators_config") if isinstance(config.get("speculators_config"), dict) else {}
    verifier = spec.get("verifier") if isinstance(spec.get("verifier"), dict) else {}
    for name in (config.get("target_name"), ours.get("head_target"), verifier.get("name_or_path"),
                 config.get("base_model_name_or_path"), config.get("base_model")):
        if isinstance(name, str) and name:
            return name
    return None


def _same_name(a: str, b: str) -> bool:
    def norm(n: str) -> str:
        n = HUB_IDS.get(n, n)
        return _resolved(n) if Path(n).exists() else n.rstrip("/").lower()

    return norm(a) == norm(b)


def warn_other_target(src, target_arg: str) -> str | None:
    """--import: a warning naming both when the head's config names another target than --target; returns it."""
    named = named_target(Path(src))
    if named is None or _same_name(named, target_arg):
        return None
    msg = (f"--import {src}: its config.json names the target {named!r}, but it is bound to --target {target_arg!r} "
           f"(the shapes fit); check that this is the target the head was trained for")
    log.warning("%s", msg)
    return msg

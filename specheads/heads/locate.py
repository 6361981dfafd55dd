"""Where a head's files are. A head is named by a local folder or by a hub id (`org/name`, `org/name@revision`: a
branch, tag or commit), which huggingface_hub resolves to a snapshot folder of its cache; its weights are one
safetensors file or shards named by a `model.safetensors.index.json` (the layout transformers' save_pretrained
writes past its max_shard_size). Consumers: heads/base.py (read_head_config, load_head), heads/export/registry.py
(export_head, import_head), the commands' --head / --init-head / --import.

Hub ids: only the files a head is read from are fetched (HUB_PATTERNS: JSON, safetensors, sha256 sidecars,
tokenizer files; never .bin / .pt / .pth pickles, which are never unpickled either); with HF_HUB_OFFLINE=1 nothing
is downloaded (local_files_only) and the cache alone answers; an unreachable network falls back to the cache too
(huggingface_hub's own fallback). The cache is HF_HUB_CACHE, else HF_HOME/hub, else huggingface_hub's default, read
at each call (huggingface_hub reads its constants once at import). A local folder always wins over a hub id of the
same spelling.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch

from specheads.utils import SpecheadsError, read_json

log = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"  # {"metadata": {...}, "weight_map": {tensor name: shard file name}}
HUB_PATTERNS = ("*.json", "*.safetensors", "*.sha256", "*.model", "merges.txt", "vocab.txt")  # never pickles
PICKLES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
# a hub repo id (huggingface_hub's validate_repo_id: [\w.-], no leading '-' or '.', one '/') and an optional @revision
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9_][\w.-]{0,95}/[A-Za-z0-9_][\w.-]{0,95})(?:@(?P<rev>[^\s@]+))?")


def parse_hub_id(value: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `value` is spelled as a hub id, else None ('--' and '..' are never ids)."""
    m = _HUB_ID.fullmatch(str(value))
    if m is None or "--" in m["repo"] or ".." in m["repo"] or m["repo"].endswith("."):
        return None
    return m["repo"], m["rev"]


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as set now; huggingface_hub's own reading when neither is set."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    if value is not None:
        return value.strip().lower() in ("1", "on", "yes", "true")
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_cache() -> Path:
    """The hub cache folder as the environment names it now (HF_HUB_CACHE, else HF_HOME/hub, else the default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def head_folder(value: str | Path, what: str = "head folder") -> Path:
    """A local folder as it is; a hub id (`org/name[@revision]`, when no such folder exists) as its snapshot folder
    in the hub cache, fetched (head files only) unless offline. Neither: one SpecheadsError naming `value`, and for
    a hub id the cache and whether downloads were off."""
    path = Path(value)
    if path.is_dir():
        return path
    parsed = None if path.exists() else parse_hub_id(str(value))
    if parsed is None:
        raise SpecheadsError(f"{value}: {what} not found")
    return _snapshot(*parsed, str(value), what)


def _snapshot(repo: str, revision: str | None, value: str, what: str) -> Path:
    from huggingface_hub import snapshot_download

    offline, cache = hub_offline(), hub_cache()
    log.debug("%s: not a local folder; resolving it as the hub id %s%s (%s)", value, repo,
             f" at {revision}" if revision else "", "offline: the cache only" if offline else "online")
    try:
        folder = snapshot_download(repo, revision=revision, cache_dir=str(cache), local_files_only=offline,
                                   allow_patterns=list(HUB_PATTERNS))
    except Exception as e:  # noqa: BLE001 - huggingface_hub / its HTTP client raise many kinds; each becomes one line
        at = f" at revision {revision!r}" if revision else ""
        if offline:
            why = "HF_HUB_OFFLINE=1: nothing is downloaded; fetch it once online, or set HF_HUB_CACHE to the cache " \
                  "that holds it"
        else:
            why = f"nor could the hub give it: {type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0][:200]
        raise SpecheadsError(f"{value}: {what} not found, and the hub id {repo!r}{at} is not in the hub cache {cache} "
                             f"({why})") from None
    return Path(folder)


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Load a safetensors file; any corruption is one SpecheadsError naming the file. Never unpickles."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise SpecheadsError(f"{path}: file not found")
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own SafetensorError / OSError / ValueError on bad bytes
        raise SpecheadsError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def read_sharded(index: Path) -> dict[str, torch.Tensor]:
    """Every shard an index names, each read once; every tensor of the weight_map read from the shard it names and
    from no other (a missing shard, a tensor in a shard that the map sends elsewhere, or one the map names but its
    shard lacks: one SpecheadsError naming the file)."""
    index = Path(index)
    data = read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise SpecheadsError(f"{index}: expected a JSON object with a non-empty 'weight_map' (tensor -> shard file)")
    for key, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard or not shard.endswith(".safetensors"):
            raise SpecheadsError(f"{index}: weight_map[{key!r}] is {shard!r}, not a .safetensors file name beside "
                                 f"the index")
    shards = list(dict.fromkeys(weight_map.values()))  # in the map's order
    missing = [s for s in shards if not (index.parent / s).is_file()]
    if missing:
        raise SpecheadsError(f"{index}: names the shard {missing[0]!r}, which is not in {index.parent} "
                             f"({len(missing)} of {len(shards)} shards missing)")
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        for key, tensor in read_safetensors(index.parent / shard).items():
            if weight_map.get(key) != shard:
                raise SpecheadsError(f"{index.parent / shard}: holds tensor {key!r}, which {index.name} maps to "
                                     f"{weight_map.get(key)!r} (each tensor is read from one shard)")
            tensors[key] = tensor
    lost = [k for k in weight_map if k not in tensors]
    if lost:
        raise SpecheadsError(f"{index}: maps tensor {lost[0]!r} to {weight_map[lost[0]]!r}, which does not hold it")
    return tensors


def read_weights(folder: Path, names: tuple[str, ...] = (WEIGHTS_NAME,), any_file: bool = False
                 ) -> tuple[dict[str, torch.Tensor], Path]:
    """A head folder's tensors and the file named in messages: the first of `names` present, else the shards of
    model.safetensors.index.json; with `any_file` (foreign checkpoints) else the one *.safetensors file or the one
    *.safetensors.index.json. Pickled weights alone are refused by name (never unpickled)."""
    folder = Path(folder)
    for name in names:
        if (folder / name).is_file():
            return read_safetensors(folder / name), folder / name
    if (folder / INDEX_NAME).is_file():
        return read_sharded(folder / INDEX_NAME), folder / INDEX_NAME
    if any_file:
        indexes = sorted(folder.glob("*.safetensors.index.json"))
        if len(indexes) == 1:
            return read_sharded(indexes[0]), indexes[0]
        found = sorted(folder.glob("*.safetensors"))
        if len(found) == 1 and not indexes:
            return read_safetensors(found[0]), found[0]
        if found or indexes:
            raise SpecheadsError(f"{folder}: several weight files ({[p.name for p in found + indexes][:6]}) and no "
                                 f"{INDEX_NAME} saying which tensor is where")
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLES) if folder.is_dir() else []
    if pickles:
        raise SpecheadsError(f"{folder}: no safetensors weights, only pickles ({', '.join(pickles[:3])}): convert "
                             f"them to safetensors first; pickles are never loaded (unpickling can run code)")
    raise SpecheadsError(f"{folder / names[0]}: file not found (nor a {INDEX_NAME} of shards)")

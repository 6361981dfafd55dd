"""A Hugging Face hub cache laid out as huggingface_hub lays it (its file_download.py / _snapshot_download.py), for
tests and reliability cases that name heads by hub id with no network:

    <cache>/models--<org>--<name>/blobs/<etag>                  the files' bytes, one blob per content
                                  /refs/<ref>                   the commit the ref points at (no newline)
                                  /snapshots/<commit>/<file>    a relative symlink ../../blobs/<etag>

An etag is the git blob sha1 of a small file and the sha256 of an LFS one (weights), as the hub reports them.
huggingface_hub's own try_to_load_from_cache and snapshot_download(local_files_only=True) read this layout.
hub_repo needs the standard library only, shard safetensors (imported when called); scripts/reliability_r4_hub.py
imports the module as tests.hubcache.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")  # stored through git LFS on the hub


def etag(name: str, data: bytes) -> str:
    if name.endswith(LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id


def repo_folder(cache: Path, repo_id: str) -> Path:
    return Path(cache) / ("models--" + repo_id.replace("/", "--"))


def hub_repo(cache: Path, repo_id: str, files: dict[str, bytes] | Path, ref: str | None = "main",
             commit: str | None = None) -> tuple[Path, str]:
    """Lay `files` ({name: bytes}, or every file of a folder) into the cache as one commit of `repo_id`, `ref`
    pointing at it (None: no ref, reachable by commit only) -> (its snapshot folder, the commit hash)."""
    if isinstance(files, (str, Path)):
        files = {p.name: p.read_bytes() for p in sorted(Path(files).iterdir()) if p.is_file()}
    tags = {name: etag(name, data) for name, data in files.items()}
    commit = commit or hashlib.sha1(json.dumps(sorted(tags.items())).encode()).hexdigest()
    repo = repo_folder(cache, repo_id)
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        blob = repo / "blobs" / tags[name]
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / name
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(os.path.relpath(blob, link.parent), link)
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot, commit


def shard(folder: Path, name: str = "model.safetensors", parts: int = 2) -> list[str]:
    """Split `folder`/`name` into `parts` safetensors shards plus model.safetensors.index.json (weight_map), as
    transformers' save_pretrained writes past max_shard_size, and remove the single file -> the shard names."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src = Path(folder) / name
    with safe_open(str(src), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    keys = sorted(tensors)
    names = [f"model-{i + 1:05d}-of-{parts:05d}.safetensors" for i in range(parts)]
    weight_map, size = {}, 0
    for i, shard_name in enumerate(names):
        part = {k: tensors[k] for k in keys[i::parts]}
        save_file(part, str(Path(folder) / shard_name), metadata=meta)
        weight_map.update({k: shard_name for k in part})
        size += sum(t.numel() * t.element_size() for t in part.values())
    index = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
    (Path(folder) / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    src.unlink()
    sidecar = Path(folder) / (name + ".sha256")
    if sidecar.exists():
        sidecar.unlink()  # it is about the single file
    return names

"""The offline features folder on disk: its manifest, shard and target-sidecar files, and the checks that tie
each listed file to the manifest (size always, sha256 when asked).

    manifest.json              format, plan_key, target, fingerprint, layers, hidden_size, dtype, counts, shards[]
                               (+ "targets": {format, dtype} and per shard "targets": {file, bytes, sha256,
                               shard_sha256} once the sidecars exist)
    shard-00000.safetensors    input_ids [Ts] int32, loss_mask [Ts] uint8, offsets [n+1] int64, hidden [Ts,F,D] bf16
                               (features.dtype float8_e4m3fn: hidden [Ts,F,D] e4m3 + hidden_scale [Ts,F] float32,
                               one scale per token row and layer, as speculators stores them; `read_hidden`)
    targets-00000.safetensors  the target sidecar: greedy [Ts] int32, lse [Ts] float32

Every file is written through `commit_file` (temporary name, sha256 read back, fsync, rename) and only then listed
in the manifest (itself replaced atomically): a killed run leaves only whole, listed files.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import torch

from specheads.utils import SpecheadsError, as_write_error, read_text_bounded, remove_quietly, sha256_file

FORMAT = "specheads-features/1"  # sidecars are optional keys: older readers ignore them, so the version stays
TARGETS_FORMAT = "specheads-targets/1"
MANIFEST = "manifest.json"
HIDDEN_DTYPES = ("bfloat16", "float8_e4m3fn")  # how a shard stores hidden states (the manifest's "dtype")
FP8_MAX = 448.0  # largest finite e4m3 value: each row is scaled so that its largest |x| lands there


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def targets_name(k: int) -> str:
    return f"targets-{k:05d}.safetensors"


def read_manifest(folder: Path) -> dict:
    p = folder / MANIFEST
    if not p.exists():
        raise SpecheadsError(f"{folder}: no {MANIFEST} (run `specheads prepare` first)")
    try:
        m = json.loads(read_text_bounded(p))
    except json.JSONDecodeError as e:
        raise SpecheadsError(f"{p}: not valid JSON ({e.msg})") from None
    if m.get("format") != FORMAT:
        raise SpecheadsError(f"{p}: format {m.get('format')!r}, expected {FORMAT!r}")
    return m


def check_features_folder(folder: str | os.PathLike, plan_key: str | None = None, target=None) -> dict | None:
    """The manifest already in `folder` (None if there is none), refused when it holds other features: another
    plan (data, target, layers) or, with `target`, another target. Reads only; call it before writing anything."""
    mpath = Path(folder) / MANIFEST
    if not mpath.exists():
        return None
    try:
        manifest = json.loads(read_text_bounded(mpath))
    except json.JSONDecodeError:
        raise SpecheadsError(f"{mpath}: not valid JSON; remove {folder} to start over") from None
    if target is not None and manifest.get("fingerprint") != target.fingerprint():
        raise SpecheadsError(f"{folder}: holds features of target {manifest.get('target')!r}, not of {target.name!r} "
                             f"(fingerprints differ); remove it or choose another output_dir")
    if plan_key is not None and manifest.get("plan_key") != plan_key:
        raise SpecheadsError(f"{folder}: holds features of other data, target or layers (plan_key "
                             f"{manifest.get('plan_key')} != {plan_key}); remove it or choose another output_dir")
    return manifest


def check_shared_features(folder: str | os.PathLike, target, layers: Sequence[int]) -> dict:
    """`features.dir` set to another recipe's folder: it must be complete, hold `layers` and come from this target.
    Returns its manifest."""
    folder = Path(folder)
    if not (folder / MANIFEST).exists():
        raise SpecheadsError(f"features.dir {folder}: no {MANIFEST}; run `specheads prepare` on the recipe that "
                             f"writes it first")
    m = read_manifest(folder)
    if not m.get("complete"):
        raise SpecheadsError(f"features.dir {folder}: incomplete ({len(m['shards'])}/{m['planned_shards']} shards); "
                             f"finish the `specheads prepare` that writes it")
    missing = [i for i in layers if i not in m["layers"]]
    if missing:
        raise SpecheadsError(f"features.dir {folder}: holds layers {m['layers']}, this head needs {list(layers)} "
                             f"(missing {missing})")
    if m.get("fingerprint") != target.fingerprint():
        raise SpecheadsError(f"features.dir {folder}: extracted from target {m.get('target')!r}, not from "
                             f"{target.name!r} (fingerprints differ)")
    return m


def encode_hidden(h: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """h [Ts,F,D] -> the shard's tensors: {"hidden": bf16} or, for float8_e4m3fn, {"hidden": e4m3 [Ts,F,D],
    "hidden_scale": float32 [Ts,F]} with hidden ~= e4m3 * scale (per token row and layer; lossy: 3 mantissa bits)."""
    if dtype == "bfloat16":
        return {"hidden": h.to(torch.bfloat16).contiguous()}
    x = h.float()
    scale = (x.abs().amax(dim=-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)  # [Ts,F]
    return {"hidden": (x / scale[..., None]).to(torch.float8_e4m3fn).contiguous(), "hidden_scale": scale.contiguous()}


def read_hidden(handle, a: int, b: int) -> torch.Tensor:
    """Rows a:b of a shard's hidden states [b-a,F,D] in bf16, whatever the shard stores (`encode_hidden`)."""
    h = handle.get_slice("hidden")[a:b]
    if h.dtype == torch.bfloat16:
        return h
    scale = handle.get_slice("hidden_scale")[a:b]  # [b-a,F]
    return (h.float() * scale[..., None]).to(torch.bfloat16)


def hidden_bytes(dtype: str) -> float:
    """Bytes per stored hidden value (the per-row fp32 scale of fp8 shards is counted per layer row by callers)."""
    return 2.0 if dtype == "bfloat16" else 1.0


def commit_file(write, final: Path) -> tuple[str, int]:
    """`write(tmp)` to a temporary name beside `final`, sha256 it back (from the page cache: what is on disk, not in
    memory), fsync, rename onto `final`; returns (sha256, bytes). Whatever fails, the temporary file is removed."""
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        write(str(tmp))
        digest, size = sha256_file(tmp), tmp.stat().st_size
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        remove_quietly(tmp)
        raise
    return digest, size


def save_safetensors(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    """safetensors' save_file, then its header's `__metadata__` keys put in sorted order: safetensors writes that
    map (a Rust HashMap) in a random order per call, so two writes of the same tensors differed in a few header
    bytes (the tensors, hence the hidden states, were bit for bit equal). Sorted, one shard's bytes depend only on
    its contents: any rank, any run writes the same file. The header keeps its length (same keys, same values)."""
    import struct

    from safetensors.torch import save_file

    save_file(tensors, path, metadata=metadata)
    with open(path, "rb+") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        raw = f.read(n)
        header = json.loads(raw)
        meta = header.get("__metadata__")
        if not meta:
            return
        header["__metadata__"] = dict(sorted(meta.items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) > n:  # never longer in practice; leave the file as safetensors wrote it rather than break it
            return
        f.seek(8)
        f.write(text + b" " * (n - len(text)))  # safetensors pads its header with spaces


def raise_write_error(e: BaseException, path: Path, kept: str):
    """Re-raise `e`: as one WriteError naming `path` and what was kept when it is the OS refusing the write."""
    err = as_write_error(e, path, kept)
    if err is None:
        raise e
    raise err from None


_VERIFIED: set[tuple[str, int, int]] = set()  # (path, size, mtime) of shards whose sha256 this process checked


def check_shard(path: Path, entry: dict, full: bool = True) -> None:
    """A listed shard is the file the manifest describes: its size always, its sha256 with `full` (once per file
    and process). A mismatch is one SpecheadsError naming the file."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise SpecheadsError(f"{path}: listed in the manifest but missing; rerun `specheads prepare` to rewrite "
                             f"it") from None
    if st.st_size != entry["bytes"]:
        raise SpecheadsError(f"{path}: {st.st_size} bytes, the manifest lists {entry['bytes']}; rerun `specheads "
                             f"prepare` to rewrite it")
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if not full or key in _VERIFIED:
        return
    if sha256_file(path) != entry["sha256"]:
        raise SpecheadsError(f"{path}: sha256 differs from the manifest's (the file is damaged); rerun `specheads "
                             f"prepare --verify` to rewrite it")
    _VERIFIED.add(key)


def verify_once(folder: Path, manifest: dict, sidecars: bool, main: bool, wait) -> None:
    """Several training processes reading one features folder: the main process checks every listed shard's (and,
    with `sidecars`, sidecar's) sha256 once (check_shard), the others wait at `wait()` (a barrier) and then take
    the files as checked (their size is still checked on open). A mismatch fails the main process with one line
    naming the file; the launcher stops the rest. Without it every rank re-hashed the whole folder."""
    folder = Path(folder)
    files = [(folder / s["file"], s) for s in manifest["shards"]]
    if sidecars:
        files += [(folder / s["targets"]["file"], s["targets"]) for s in manifest["shards"] if s.get("targets")]
    if main:
        for path, entry in files:
            check_shard(path, entry, full=True)
    wait()
    if not main:
        for path, entry in files:
            st = path.stat()
            if st.st_size == entry["bytes"]:
                _VERIFIED.add((str(path.resolve()), st.st_size, st.st_mtime_ns))


def sidecar_ok(folder: Path, entry: dict, verify: bool) -> bool:
    """Shard `entry`'s sidecar is listed, belongs to this shard (its sha256) and has its size (and sha256)."""
    t = entry.get("targets")
    if not t or t.get("shard_sha256") != entry["sha256"]:
        return False
    p = folder / t["file"]
    return p.exists() and p.stat().st_size == t["bytes"] and (not verify or sha256_file(p) == t["sha256"])


def sidecars_usable(manifest: dict, dtype: str | None = None) -> str | None:
    """None when every listed shard has its sidecar (in `dtype`, if given), else why not (for the warning)."""
    info = manifest.get("targets")
    if not info:
        return "no target sidecars"
    if dtype is not None and info.get("dtype") != dtype:
        return f"target sidecars computed in {info.get('dtype')}, the target runs in {dtype}"
    missing = [s["file"] for s in manifest["shards"] if (s.get("targets") or {}).get("shard_sha256") != s["sha256"]]
    if missing:
        return f"{len(missing)} of {len(manifest['shards'])} shards without their target sidecar"
    return None


def verify_features(folder: str | os.PathLike) -> list[str]:
    """Recompute every shard's (and listed target sidecar's) sha256; returns the files that do not match the
    manifest (empty = all good)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    bad = []
    for s in manifest["shards"]:
        try:
            digest = sha256_file(folder / s["file"])
        except FileNotFoundError:
            bad.append(s["file"])
            continue
        if digest != s["sha256"]:
            bad.append(s["file"])
        t = s.get("targets")
        if t and t.get("shard_sha256") == s["sha256"] and not sidecar_ok(folder, s, verify=True):
            bad.append(t["file"])
    return bad

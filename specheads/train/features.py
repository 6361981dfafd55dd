"""Target hidden states for the heads: extracted online per batch, or written once into offline shards.

Feature layers (layout.py): Medusa / EAGLE-1/2 `[L]`, EAGLE-3 `[2, L//2, L-3]`, and offline shards always store layer
L too: the target's next-token distribution is **not stored**; it is recomputed from the layer-L state through the
frozen lm_head (teacher.py; exact, and far smaller than top-k logits).

Offline (`<output_dir>/features`, the files: shards.py): samples are sorted by length and cut into shards of about
`shard_tokens` tokens (plan fixed before the first shard, so a restarted run rebuilds the same plan). A shard is
written to a temporary name, fsynced and renamed; only then is it added to the manifest (itself replaced
atomically), with its sha256. A killed run therefore leaves only whole, listed shards; a restart skips them and
never reads a partial file. `specheads prepare` then adds the target sidecars (teacher.write_target_sidecars).
Training reads the folder through dataset.FeatureDataset.

Online mode: `extract_features(target, input_ids, attention_mask, layers)` on a collated batch (no grad) gives
`hidden` [B,T,F,D], for data too big to cache; the trainer calls it per batch on the tokenised dataset
(`<output_dir>/data/tokens`) collated with `dataset.collate`.
Shapes: B batch, T sequence, F feature layers, D hidden.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from specheads.train.ranks import Ranks, clear_parts, read_parts, write_part
from specheads.train.shards import (FORMAT, HIDDEN_DTYPES, MANIFEST, check_features_folder, commit_file, encode_hidden,
                                    hidden_bytes, raise_write_error, read_manifest, save_safetensors, shard_name)
from specheads.utils import SpecheadsError, atomic_write_json, check_values, sha256_file

log = logging.getLogger(__name__)

DISK_MARGIN = 1.05  # extra share of the estimate required free (safetensors headers, filesystem slack)
DISK_RESERVE = 256 << 20  # bytes always left free besides the estimate (256 MiB: logs, temp files of others)


@dataclass
class FeatureConfig:
    mode: str = "offline"  # offline: sharded safetensors on disk; online: computed inside training
    layers: list[int] | None = None  # None = what the head kind needs (see docs/architecture.md)
    shard_tokens: int = 262144  # tokens per shard (about 300 MB at hidden 576 bf16 and 1 layer)
    batch_tokens: int = 8192  # tokens per target forward during extraction (padded B*T)
    dir: str | None = None  # offline features folder; None = <output_dir>/features. Another recipe's folder shares
    # one extraction between heads: every folder stores layer L, all Medusa / EAGLE-1 read (EAGLE-3's also has 3 more)
    dtype: str = "bfloat16"  # how shards store hidden states: bfloat16, or float8_e4m3fn (alias fp8): half the disk,
    # one fp32 scale per token row and layer (speculators' layout; lossy: 3 mantissa bits), read back as bf16
    verify: bool = True  # training checks each shard's sha256 against the manifest when it first opens it (one
    # extra read of each shard per process; sha256 runs at about 0.5 GB/s per core); false = size only

    def __post_init__(self):
        if self.mode not in ("offline", "online"):
            raise SpecheadsError(f"features.mode: {self.mode!r} is not one of ['offline', 'online']")
        check_values("features", self, {"shard_tokens": ">=1", "batch_tokens": ">=1"})
        self.dtype = {"fp8": "float8_e4m3fn", "bf16": "bfloat16"}.get(self.dtype, self.dtype)
        if self.dtype not in HIDDEN_DTYPES:
            raise SpecheadsError(f"features.dtype: {self.dtype!r} is not one of {list(HIDDEN_DTYPES)} (or fp8, bf16)")
        for i in self.layers or []:
            if not isinstance(i, int) or i < 0:
                raise SpecheadsError(f"features.layers: {i!r} is not a layer id (0 = embeddings, L = final state)")


# -------------------------------------------------------------------------------------------------------- extraction

def _hidden_state_selection() -> bool:
    """transformers >= 5.2x lets `output_hidden_states` be a list of indices: only those are kept by its capture
    hooks (the last one still tied to the post-norm state). Older versions take a flag and return all L+1."""
    try:
        from transformers.utils.output_capturing import selected_hidden_states  # noqa: F401
    except ImportError:
        return False
    return True


_SELECTS_LAYERS = _hidden_state_selection()


@torch.no_grad()
def extract_features(target, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                     layers: Sequence[int]) -> torch.Tensor:
    """Hidden states [B,T,F,D] of the given layer ids (target dtype), from one call of the decoder stack without
    the lm_head. Layer L is the post-norm state (HF's last `hidden_states` entry). Inputs go to the embedding's
    device; a target split across devices (target.device_map) gives layers on several devices: they are gathered
    on the CPU (prepare stores them there anyway), else they stay where the target computed them."""
    if attention_mask is not None and bool(attention_mask.all()):
        attention_mask = None  # no padding: the causal fast path (samples cut at max_length often share a length)
    dev = target.embed_tokens.weight.device
    out = target.base(input_ids=input_ids.to(dev),
                      attention_mask=None if attention_mask is None else attention_mask.to(dev),
                      output_hidden_states=list(layers) if _SELECTS_LAYERS else True, use_cache=False,
                      return_dict=True)
    hs = [out.hidden_states[i] for i in layers]  # L+1 [B,T,D] (None where not selected) -> the F asked for
    if len({h.device for h in hs}) > 1:
        hs = [h.to("cpu") for h in hs]
    return torch.stack(hs, dim=2)  # [B,T,F,D]


def length_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Index batches with padded size B*max(T) <= batch_tokens, over indices sorted by length (least padding)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1) * max(lengths[i], lengths[cur[-1]]) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def _pad(seqs: Sequence[Sequence[int]] | Sequence[torch.Tensor], value: int = 0) -> torch.Tensor:
    T = max(len(s) for s in seqs)
    out = torch.full((len(seqs), T), value, dtype=torch.long)
    for b, s in enumerate(seqs):
        out[b, : len(s)] = torch.as_tensor(s, dtype=torch.long)
    return out


# ------------------------------------------------------------------------------------------------------ offline write

def bytes_per_token(num_layers_stored: int, hidden_size: int, dtype: str = "bfloat16") -> int:
    scale = 0 if dtype == "bfloat16" else 4 * num_layers_stored  # fp8: one fp32 scale per token row and layer
    return int(num_layers_stored * hidden_size * hidden_bytes(dtype)) + scale + 4 + 1  # hidden + int32 id + uint8 mask


def _plan(lengths: Sequence[int], shard_tokens: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    shards: list[list[int]] = []
    cur: list[int] = []
    n = 0
    for i in order:
        cur.append(i)
        n += lengths[i]
        if n >= shard_tokens:
            shards.append(cur)
            cur, n = [], 0
    if cur:
        shards.append(cur)
    return shards


def _data_hash(input_ids: Sequence[Sequence[int]], loss_mask: Sequence[Sequence[int]]) -> str:
    import numpy as np

    h = hashlib.sha256()
    for ids, m in zip(input_ids, loss_mask):
        h.update(np.asarray(ids, dtype=np.int32).tobytes())
        h.update(np.asarray(m, dtype=np.uint8).tobytes())
        h.update(b"|")
    return h.hexdigest()


@dataclass
class FeaturePlan:
    """What an offline extraction will write: samples, their shard assignment, and the key that names them."""

    input_ids: list
    loss_mask: list
    conversation_ids: list[str]
    lengths: list[int]
    shards: list[list[int]]  # sample indices per shard
    layers: list[int]
    plan_key: str  # sha256 of (data, layers, target fingerprint, shard size, format)


def plan_features(target, tokens, layers: Sequence[int], cfg: FeatureConfig) -> FeaturePlan:
    """The shard plan for `tokens` (Dataset or list of dicts with input_ids, loss_mask, conversation_id)."""
    layers = list(layers)
    as_list = isinstance(tokens, list)
    input_ids = [t["input_ids"] for t in tokens] if as_list else list(tokens["input_ids"])
    loss_mask = [t["loss_mask"] for t in tokens] if as_list else list(tokens["loss_mask"])
    conv_ids = [t["conversation_id"] for t in tokens] if as_list else list(tokens["conversation_id"])
    lengths = [len(x) for x in input_ids]
    if not lengths:
        raise SpecheadsError("features: no samples to extract (all conversations were dropped)")
    key = {"data": _data_hash(input_ids, loss_mask), "layers": layers, "fingerprint": target.fingerprint(),
           "shard_tokens": cfg.shard_tokens, "format": FORMAT}
    if cfg.dtype != "bfloat16":  # bf16 folders keep the plan keys they were written under
        key["dtype"] = cfg.dtype
    key_src = json.dumps(key, sort_keys=True)
    return FeaturePlan(input_ids, loss_mask, conv_ids, lengths, _plan(lengths, cfg.shard_tokens), layers,
                       hashlib.sha256(key_src.encode()).hexdigest()[:32])


def write_features(target, tokens, folder: str | os.PathLike, layers: Sequence[int], cfg: FeatureConfig,
                   val_fraction: float = 0.0, progress: bool = True, after_shard=None, verify: bool = False,
                   ranks: Ranks | None = None) -> dict:
    """Offline extraction of `tokens` (Dataset or list of dicts with input_ids, loss_mask, conversation_id) into
    `folder`. Resumable; refuses to start when free disk is short. Returns the manifest.

    Listed shards of the wrong size are rewritten; with `verify` (prepare --verify) so are those whose sha256 no
    longer matches the manifest. `after_shard(k)` is called after shard k is committed (tests simulate a kill).
    `ranks` (several processes, ranks.py): rank r extracts the missing shards k with k % world == r and records
    each in a part file; rank 0 alone checks the folder first and writes the manifest, from the parts, after a
    barrier. A shard's bytes depend only on its own samples (its batches are cut from them alone), so any rank
    writes what one process writes, and a rerun with any number of processes redoes only the missing shards."""
    from tqdm.auto import tqdm

    ranks = ranks or Ranks()
    folder = Path(folder)
    plan = plan_features(target, tokens, layers, cfg)
    manifest = check_features_folder(folder, plan.plan_key)
    if ranks.main:  # the folder's checks and checksums: once, on rank 0
        manifest = _start_manifest(target, plan, folder, cfg, val_fraction, manifest, verify)
    ranks.barrier()
    if not ranks.main:
        manifest = read_manifest(folder)
    done = {s["index"] for s in manifest["shards"]}
    todo = [k for k in range(len(plan.shards)) if k not in done and k % ranks.world == ranks.rank]
    mpath = folder / MANIFEST
    bar = tqdm(total=sum(plan.lengths[i] for k in todo for i in plan.shards[k]), unit="tok", desc="features",
               disable=not progress or not ranks.main)
    for k in todo:
        before = len(manifest["shards"])
        try:
            entry = _write_shard(target, plan, k, folder, cfg, bar)
            if ranks.multi:
                write_part(folder, shard_name(k), entry)
            else:
                manifest["shards"].append(entry)
                manifest["shards"].sort(key=lambda s: s["index"])
                atomic_write_json(mpath, manifest)
        except BaseException as e:
            kept = f"the {before} shard(s) written before are kept (listed in {MANIFEST})" if before else \
                "no shard was written before it"
            raise_write_error(e, folder / shard_name(k), kept + ": free space, then rerun `specheads prepare` to "
                                                                  "continue")
        if after_shard is not None:
            after_shard(k)
    bar.close()
    ranks.barrier()
    if ranks.main:
        _merge_shard_parts(folder, manifest)
        manifest["complete"] = len(manifest["shards"]) == len(plan.shards)
        manifest["bytes"] = sum(s["bytes"] for s in manifest["shards"])
        atomic_write_json(mpath, manifest)
    ranks.barrier()
    return manifest if ranks.main else read_manifest(folder)


def _start_manifest(target, plan: FeaturePlan, folder: Path, cfg: FeatureConfig, val_fraction: float,
                    manifest: dict | None, verify: bool) -> dict:
    """Rank 0 (or the one process) before extraction: the folder, its manifest with the shards a killed run of any
    number of processes left whole (its part files merged), the listed shards checked (size; sha256 with
    `verify`), the disk check and the plan's log line. Returns the manifest, written."""
    folder.mkdir(parents=True, exist_ok=True)
    for stray in folder.glob(".shard-*.tmp*"):  # partial shards of a killed run: never read, removed
        stray.unlink(missing_ok=True)
    if manifest is None:
        manifest = {"format": FORMAT, "plan_key": plan.plan_key, "target": target.name,
                    "fingerprint": target.fingerprint(), "layers": plan.layers, "hidden_size": target.hidden_size,
                    "dtype": cfg.dtype, "val_fraction": val_fraction, "num_samples": len(plan.lengths),
                    "num_tokens": sum(plan.lengths), "num_masked_tokens": int(sum(sum(m) for m in plan.loss_mask)),
                    "planned_shards": len(plan.shards), "complete": False, "shards": []}
    _merge_shard_parts(folder, manifest)
    done: dict[int, dict] = {}
    for s in manifest["shards"]:
        p = folder / s["file"]
        if p.exists() and p.stat().st_size == s["bytes"] and (not verify or sha256_file(p) == s["sha256"]):
            done[s["index"]] = s
        else:
            log.warning("%s: listed shard %s missing, wrong size or damaged; it will be rewritten", folder, s["file"])
    manifest["shards"] = [done[k] for k in sorted(done)]
    todo = [k for k in range(len(plan.shards)) if k not in done]
    todo_tokens = sum(plan.lengths[i] for k in todo for i in plan.shards[k])
    bpt = bytes_per_token(len(plan.layers), target.hidden_size, cfg.dtype)
    _check_disk(folder, todo_tokens, bpt, len(todo), len(plan.layers), target.hidden_size)
    log.info("features: %d samples, %d tokens, layers %s -> %d shards (%d done, %d to write, ~%.1f MiB)",
             len(plan.lengths), sum(plan.lengths), plan.layers, len(plan.shards), len(done), len(todo),
             todo_tokens * bpt / 2**20)
    atomic_write_json(folder / MANIFEST, manifest)
    return manifest


def _merge_shard_parts(folder: Path, manifest: dict) -> None:
    """Add the shards that ranks recorded in part files (a whole file of the entry's size) to `manifest`, in index
    order, and remove the part files. The manifest is written by the caller."""
    parts = read_parts(folder, "shard-")
    have = {s["index"] for s in manifest["shards"]}
    for entry in parts.values():
        p = folder / entry.get("file", "")
        if entry.get("index") not in have and p.is_file() and p.stat().st_size == entry.get("bytes"):
            manifest["shards"].append(entry)
            have.add(entry["index"])
    manifest["shards"].sort(key=lambda s: s["index"])
    if parts:
        atomic_write_json(folder / MANIFEST, manifest)  # listed before their part files go
    clear_parts(folder, "shard-")


def _check_disk(folder: Path, tokens: int, bpt: int, shards: int, layers: int, hidden: int) -> None:
    need = int(tokens * bpt * DISK_MARGIN) + DISK_RESERVE
    free = shutil.disk_usage(folder).free
    if shards and free < need:
        raise SpecheadsError(f"{folder}: not enough free disk for features: need about {need / 2**30:.2f} GiB "
                             f"({shards} shards, {layers} layers x hidden {hidden}), {free / 2**30:.2f} GiB "
                             f"free; use features.mode=online, fewer conversations or a smaller data.max_length")


def _write_shard(target, plan: FeaturePlan, k: int, folder: Path, cfg: FeatureConfig, bar) -> dict:
    """Extract shard k, write it to a temporary name, fsync, rename; returns its manifest entry (with sha256)."""
    idx, lengths = plan.shards[k], plan.lengths
    hidden: dict[int, torch.Tensor] = {}
    for b in length_batches([lengths[i] for i in idx], cfg.batch_tokens):
        rows = [idx[j] for j in b]
        ids = _pad([plan.input_ids[i] for i in rows])
        am = _pad([[1] * lengths[i] for i in rows])
        h = extract_features(target, ids, am, plan.layers).to("cpu", torch.bfloat16)  # [B,T,F,D]
        for r, i in enumerate(rows):
            hidden[i] = h[r, : lengths[i]]
        bar.update(sum(lengths[i] for i in rows))
    offsets = [0]
    for i in idx:
        offsets.append(offsets[-1] + lengths[i])
    tensors = {"input_ids": torch.tensor([t for i in idx for t in plan.input_ids[i]], dtype=torch.int32),
               "loss_mask": torch.tensor([t for i in idx for t in plan.loss_mask[i]], dtype=torch.uint8),
               "offsets": torch.tensor(offsets, dtype=torch.int64),
               **encode_hidden(torch.cat([hidden[i] for i in idx], 0), cfg.dtype)}  # hidden [Ts,F,D]
    name = shard_name(k)
    meta = {"format": FORMAT, "layers": json.dumps(plan.layers)}
    digest, size = commit_file(lambda tmp: save_safetensors(tensors, tmp, meta), folder / name)
    del tensors, hidden
    return {"index": k, "file": name, "num_samples": len(idx), "num_tokens": offsets[-1], "bytes": size,
            "sha256": digest, "conversation_ids": [plan.conversation_ids[i] for i in idx]}

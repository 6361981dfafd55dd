"""Target hidden states for the heads: offline shards or online per batch.

Feature layer ids index HF's `output_hidden_states` tuple (0 = embeddings, i = output of decoder layer i-1,
L = num_layers = the final post-norm state, the lm_head input). Defaults: Medusa / EAGLE-1/2 `[L]`; EAGLE-3
`[2, L//2, L-3]`. Offline shards always store layer L too: the target's next-token distribution is **not stored**;
it is recomputed from the layer-L state through the frozen lm_head (exact, and far smaller than top-k logits).

Offline layout (`<output_dir>/features`):
    manifest.json              format, plan_key, target, fingerprint, layers, hidden_size, dtype, counts, shards[]
                               (+ "targets": {format, dtype} and per shard "targets": {file, bytes, sha256,
                               shard_sha256} once the sidecars exist)
    shard-00000.safetensors    input_ids [Ts] int32, loss_mask [Ts] uint8, offsets [n+1] int64, hidden [Ts,F,D] bf16
    targets-00000.safetensors  the target sidecar: greedy [Ts] int32, lse [Ts] float32
Samples are sorted by length and cut into shards of about `shard_tokens` tokens (plan fixed before the first shard,
so a restarted run rebuilds the same plan). A shard is written to a temporary name, fsynced and renamed; only then
is it added to the manifest (itself replaced atomically), with its sha256. A killed run therefore leaves only whole,
listed shards; a restart skips them and never reads a partial file.

The target sidecar (`write_target_sidecars`, run by `specheads prepare` after the shards, also on a folder that
exists already): per token j the target's greedy token (argmax over all V columns) and the full-vocabulary
logsumexp of lm_head(h_L[j]), computed once from the STORED bf16 layer-L state in the target's dtype, exactly as
training computes them from the same state; -1 / 0 at the rows no loss reads (token j+1 not an assistant token).
With them a step needs only the draft vocabulary's lm_head columns (steps.target_rows). A sidecar is bound to
its shard by the shard's sha256; written atomically, resumable shard by shard. Manifests without sidecars (older
folders) still load: training then computes the full logits itself, with one warning.

Online mode: `OnlineFeatures(target, layers)(batch)` adds `batch["hidden"] [B,T,F,D]` computed by
`extract_features` on the batch (no grad), for data too big to cache; the trainer calls it per batch on the
tokenised dataset (`<output_dir>/data/tokens`) collated with `collate`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from specheads.heads.base import default_feature_layers
from specheads.utils import SpecheadsError, as_write_error, atomic_write_json, remove_quietly

log = logging.getLogger(__name__)

FORMAT = "specheads-features/1"  # sidecars are optional keys: older readers ignore them, so the version stays
TARGETS_FORMAT = "specheads-targets/1"
MANIFEST = "manifest.json"
TARGET_ROWS_CHUNK = 1024  # rows per lm_head call of the sidecar pass (1024 x 49,152 fp32 = 200 MB transient)
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
    verify: bool = True  # training checks each shard's sha256 against the manifest when it first opens it (one
    # extra read of each shard per process; sha256 runs at about 0.5 GB/s per core); false = size only

    def __post_init__(self):
        from specheads.utils import check_values

        if self.mode not in ("offline", "online"):
            raise SpecheadsError(f"features.mode: {self.mode!r} is not one of ['offline', 'online']")
        check_values("features", self, {"shard_tokens": ">=1", "batch_tokens": ">=1"})
        for i in self.layers or []:
            if not isinstance(i, int) or i < 0:
                raise SpecheadsError(f"features.layers: {i!r} is not a layer id (0 = embeddings, L = final state)")


# ------------------------------------------------------------------------------------------------------------ layers

def resolve_layers(num_layers: int, layers: Sequence[int] | None = None, kind: str | None = None) -> list[int]:
    """Layers to store: explicit `layers` or the kind's default, plus L (always stored), sorted, unique."""
    L = num_layers
    wanted = list(layers) if layers is not None else default_feature_layers(kind or "eagle", L)
    for i in wanted:
        if not isinstance(i, int) or not 0 <= i <= L:
            raise SpecheadsError(f"features.layers: {i!r} is out of range 0..{L} (0 = embeddings, {L} = final "
                                 f"post-norm state)")
    return sorted(set(wanted) | {L})


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
    the lm_head. Layer L is the post-norm state (HF's last `hidden_states` entry)."""
    if attention_mask is not None and bool(attention_mask.all()):
        attention_mask = None  # no padding: the causal fast path (samples cut at max_length often share a length)
    out = target.base(input_ids=input_ids.to(target.device),
                      attention_mask=None if attention_mask is None else attention_mask.to(target.device),
                      output_hidden_states=list(layers) if _SELECTS_LAYERS else True, use_cache=False,
                      return_dict=True)
    hs = out.hidden_states  # tuple of L+1 [B,T,D] (None where not selected)
    return torch.stack([hs[i] for i in layers], dim=2)  # [B,T,F,D]


class OnlineFeatures:
    """Online mode: `batch = OnlineFeatures(target, layers)(batch)` adds `hidden` [B,T,F,D] (no grad, target dtype)
    to a collated batch (`input_ids`, `attention_mask`). Same contract as a FeatureDataset batch."""

    def __init__(self, target, layers: Sequence[int]):
        self.target = target
        self.layers = list(layers)

    def __call__(self, batch: dict) -> dict:
        batch = dict(batch)
        batch["hidden"] = extract_features(self.target, batch["input_ids"], batch.get("attention_mask"), self.layers)
        return batch


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

def bytes_per_token(num_layers_stored: int, hidden_size: int) -> int:
    return num_layers_stored * hidden_size * 2 + 4 + 1  # bf16 hidden + int32 id + uint8 mask


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


def _shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


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
    key_src = json.dumps({"data": _data_hash(input_ids, loss_mask), "layers": layers,
                          "fingerprint": target.fingerprint(), "shard_tokens": cfg.shard_tokens, "format": FORMAT},
                         sort_keys=True)
    return FeaturePlan(input_ids, loss_mask, conv_ids, lengths, _plan(lengths, cfg.shard_tokens), layers,
                       hashlib.sha256(key_src.encode()).hexdigest()[:32])


def check_features_folder(folder: str | os.PathLike, plan_key: str | None = None, target=None) -> dict | None:
    """The manifest already in `folder` (None if there is none), refused when it holds other features: another
    plan (data, target, layers) or, with `target`, another target. Reads only; call it before writing anything."""
    mpath = Path(folder) / MANIFEST
    if not mpath.exists():
        return None
    try:
        manifest = json.loads(mpath.read_text())
    except json.JSONDecodeError:
        raise SpecheadsError(f"{mpath}: not valid JSON; remove {folder} to start over") from None
    if target is not None and manifest.get("fingerprint") != target.fingerprint():
        raise SpecheadsError(f"{folder}: holds features of target {manifest.get('target')!r}, not of {target.name!r} "
                             f"(fingerprints differ); remove it or choose another output_dir")
    if plan_key is not None and manifest.get("plan_key") != plan_key:
        raise SpecheadsError(f"{folder}: holds features of other data, target or layers (plan_key "
                             f"{manifest.get('plan_key')} != {plan_key}); remove it or choose another output_dir")
    return manifest


def write_features(target, tokens, folder: str | os.PathLike, layers: Sequence[int], cfg: FeatureConfig,
                   val_fraction: float = 0.0, progress: bool = True, after_shard=None, verify: bool = False) -> dict:
    """Offline extraction of `tokens` (Dataset or list of dicts with input_ids, loss_mask, conversation_id) into
    `folder`. Resumable; refuses to start when free disk is short. Returns the manifest.

    Listed shards of the wrong size are rewritten; with `verify` (prepare --verify) so are those whose sha256 no
    longer matches the manifest. `after_shard(k)` is called after shard k is committed (tests simulate a kill)."""
    from tqdm.auto import tqdm

    folder = Path(folder)
    plan = plan_features(target, tokens, layers, cfg)
    manifest = check_features_folder(folder, plan.plan_key)
    folder.mkdir(parents=True, exist_ok=True)
    for stray in folder.glob(".shard-*.tmp*"):  # partial shards of a killed run: never read, removed
        stray.unlink(missing_ok=True)
    if manifest is None:
        manifest = {"format": FORMAT, "plan_key": plan.plan_key, "target": target.name,
                    "fingerprint": target.fingerprint(), "layers": plan.layers, "hidden_size": target.hidden_size,
                    "dtype": "bfloat16", "val_fraction": val_fraction, "num_samples": len(plan.lengths),
                    "num_tokens": sum(plan.lengths), "num_masked_tokens": int(sum(sum(m) for m in plan.loss_mask)),
                    "planned_shards": len(plan.shards), "complete": False, "shards": []}
    done: dict[int, dict] = {}
    for s in manifest["shards"]:
        p = folder / s["file"]
        if p.exists() and p.stat().st_size == s["bytes"] and (not verify or _sha256_file(p)[0] == s["sha256"]):
            done[s["index"]] = s
        else:
            log.warning("%s: listed shard %s missing, wrong size or damaged; it will be rewritten", folder, s["file"])
    manifest["shards"] = [done[k] for k in sorted(done)]
    todo = [k for k in range(len(plan.shards)) if k not in done]
    todo_tokens = sum(plan.lengths[i] for k in todo for i in plan.shards[k])
    _check_disk(folder, todo_tokens, bytes_per_token(len(plan.layers), target.hidden_size), len(todo),
                len(plan.layers), target.hidden_size)
    log.info("features: %d samples, %d tokens, layers %s -> %d shards (%d done, %d to write, ~%.1f MiB)",
             len(plan.lengths), sum(plan.lengths), plan.layers, len(plan.shards), len(done), len(todo),
             todo_tokens * bytes_per_token(len(plan.layers), target.hidden_size) / 2**20)
    mpath = folder / MANIFEST
    atomic_write_json(mpath, manifest)
    bar = tqdm(total=todo_tokens, unit="tok", desc="features", disable=not progress)
    for k in todo:
        before = len(manifest["shards"])
        try:
            manifest["shards"].append(_write_shard(target, plan, k, folder, cfg, bar))
            manifest["shards"].sort(key=lambda s: s["index"])
            atomic_write_json(mpath, manifest)
        except BaseException as e:
            kept = f"the {before} shard(s) written before are kept (listed in {MANIFEST})" if before else \
                "no shard was written before it"
            _raise_write_error(e, folder / _shard_name(k), kept + ": free space, then rerun `specheads prepare` to "
                                                                  "continue")
        if after_shard is not None:
            after_shard(k)
    bar.close()
    manifest["complete"] = len(manifest["shards"]) == len(plan.shards)
    manifest["bytes"] = sum(s["bytes"] for s in manifest["shards"])
    atomic_write_json(mpath, manifest)
    return manifest


def _check_disk(folder: Path, tokens: int, bpt: int, shards: int, layers: int, hidden: int) -> None:
    need = int(tokens * bpt * DISK_MARGIN) + DISK_RESERVE
    free = shutil.disk_usage(folder).free
    if shards and free < need:
        raise SpecheadsError(f"{folder}: not enough free disk for features: need about {need / 2**30:.2f} GiB "
                             f"({shards} shards, {layers} layers x hidden {hidden} bf16), {free / 2**30:.2f} GiB "
                             f"free; use features.mode=online, fewer conversations or a smaller data.max_length")


def _write_shard(target, plan: FeaturePlan, k: int, folder: Path, cfg: FeatureConfig, bar) -> dict:
    """Extract shard k, write it to a temporary name, fsync, rename; returns its manifest entry (with sha256)."""
    from safetensors.torch import save_file as st_save_file

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
               "hidden": torch.cat([hidden[i] for i in idx], 0).contiguous()}  # [Ts,F,D]
    name = _shard_name(k)
    meta = {"format": FORMAT, "layers": json.dumps(plan.layers)}
    digest, size = _commit(lambda tmp: st_save_file(tensors, tmp, metadata=meta), folder / name)
    del tensors, hidden
    return {"index": k, "file": name, "num_samples": len(idx), "num_tokens": offsets[-1], "bytes": size,
            "sha256": digest, "conversation_ids": [plan.conversation_ids[i] for i in idx]}


def _commit(write, final: Path) -> tuple[str, int]:
    """`write(tmp)` to a temporary name beside `final`, sha256 it back (from the page cache: what is on disk, not in
    memory), fsync, rename onto `final`; returns (sha256, bytes). Whatever fails, the temporary file is removed."""
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        write(str(tmp))
        digest, size = _sha256_file(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        remove_quietly(tmp)
        raise
    return digest, size


def _raise_write_error(e: BaseException, path: Path, kept: str):
    """Re-raise `e`: as one WriteError naming `path` and what was kept when it is the OS refusing the write."""
    err = as_write_error(e, path, kept)
    if err is None:
        raise e
    raise err from None


def _sha256_file(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):  # 16 MiB reads
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


def verify_features(folder: str | os.PathLike) -> list[str]:
    """Recompute every shard's (and listed target sidecar's) sha256; returns the files that do not match the
    manifest (empty = all good)."""
    folder = Path(folder)
    manifest = _read_manifest(folder)
    bad = []
    for s in manifest["shards"]:
        try:
            digest, _ = _sha256_file(folder / s["file"])
        except FileNotFoundError:
            bad.append(s["file"])
            continue
        if digest != s["sha256"]:
            bad.append(s["file"])
        t = s.get("targets")
        if t and t.get("shard_sha256") == s["sha256"] and not _sidecar_ok(folder, s, verify=True):
            bad.append(t["file"])
    return bad


# ----------------------------------------------------------------------------------------------- target sidecars

def _targets_name(k: int) -> str:
    return f"targets-{k:05d}.safetensors"


def lm_head_logits(target, h: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
    """The frozen lm_head on final post-norm states h [..., D], in the target's dtype -> [..., V], or [..., V'] at
    the target ids `vocab`. One function for the sidecar pass and for training, so both compute the same logits."""
    import torch.nn.functional as F

    lm = target.lm_head
    w = lm.weight if vocab is None else lm.weight[vocab.to(lm.weight.device)]
    b = getattr(lm, "bias", None)
    if b is not None and vocab is not None:
        b = b[vocab.to(b.device)]
    return F.linear(h.to(device=w.device, dtype=w.dtype), w, b)


def greedy_and_lse(logits: torch.Tensor, chunk: int = TARGET_ROWS_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] -> (argmax [...] long, logsumexp [...] float32); the fp32 copy is taken `chunk` rows at a
    time (a [B*T, V] fp32 copy of a whole batch would be 400 MB at SmolLM2's vocabulary)."""
    flat = logits.reshape(-1, logits.shape[-1])
    lse = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    for a in range(0, flat.shape[0], chunk):
        lse[a:a + chunk] = flat[a:a + chunk].float().logsumexp(-1)
    return flat.argmax(-1).view(logits.shape[:-1]), lse.view(logits.shape[:-1])


def needed_rows(loss_mask: torch.Tensor, offsets: Sequence[int]) -> torch.Tensor:
    """[Ts] bool over a shard's concatenated samples: rows j whose next token j+1 is an assistant token of the same
    sample, the only rows any loss or evaluation reads (steps.need_rows on a padded batch)."""
    need = torch.zeros(loss_mask.shape[0], dtype=torch.bool)
    need[:-1] = loss_mask[1:].bool()
    for end in offsets[1:]:
        need[end - 1] = False  # a sample's last row predicts past its end
    return need


@torch.no_grad()
def _target_sidecar(target, path: Path, layer_index: int) -> dict[str, torch.Tensor]:
    """greedy [Ts] int32 and lse [Ts] float32 of one shard, from its stored layer-L states."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        offsets = f.get_tensor("offsets").tolist()
        need = needed_rows(f.get_tensor("loss_mask"), offsets)
        greedy = torch.full(need.shape, -1, dtype=torch.int32)
        lse = torch.zeros(need.shape, dtype=torch.float32)
        hidden = f.get_slice("hidden")
        for a in range(0, need.shape[0], TARGET_ROWS_CHUNK):
            rows = need[a:a + TARGET_ROWS_CHUNK].nonzero().flatten()
            if rows.numel():
                h = hidden[a:a + TARGET_ROWS_CHUNK][:, layer_index][rows]  # [R,D] bf16, as training reads it
                g, z = greedy_and_lse(lm_head_logits(target, h))
                greedy[a + rows], lse[a + rows] = g.to("cpu", torch.int32), z.cpu()
    return {"greedy": greedy, "lse": lse}


def _sidecar_ok(folder: Path, entry: dict, verify: bool) -> bool:
    """Shard `entry`'s sidecar is listed, belongs to this shard (its sha256) and has its size (and sha256)."""
    t = entry.get("targets")
    if not t or t.get("shard_sha256") != entry["sha256"]:
        return False
    p = folder / t["file"]
    return p.exists() and p.stat().st_size == t["bytes"] and (not verify or _sha256_file(p)[0] == t["sha256"])


def _write_sidecar(target, folder: Path, entry: dict, layer_index: int, dtype: str) -> dict:
    from safetensors.torch import save_file as st_save_file

    check_shard(folder / entry["file"], entry, full=False)
    tensors = _target_sidecar(target, folder / entry["file"], layer_index)
    name = _targets_name(entry["index"])
    meta = {"format": TARGETS_FORMAT, "dtype": dtype, "shard_sha256": entry["sha256"]}
    digest, size = _commit(lambda tmp: st_save_file(tensors, tmp, metadata=meta), folder / name)
    return {"file": name, "bytes": size, "sha256": digest, "shard_sha256": entry["sha256"]}


def target_dtype_name(target) -> str:
    return str(target.lm_head.weight.dtype).removeprefix("torch.")


def write_target_sidecars(target, folder: str | os.PathLike, progress: bool = True, verify: bool = False,
                          after_shard=None) -> dict:
    """Add the target sidecar of every listed shard that lacks a valid one (missing, of an older shard, wrong
    size, or with `verify` a sha256 that differs). Reads only the stored layer-L states: no re-extraction.
    Resumable: each sidecar is committed to the manifest as soon as it is written. A folder whose sidecars were
    computed in another dtype keeps them (a warning says so). Returns the manifest."""
    from tqdm.auto import tqdm

    folder = Path(folder)
    manifest = _read_manifest(folder)
    if manifest.get("fingerprint") != target.fingerprint():
        raise SpecheadsError(f"{folder}: holds features of target {manifest.get('target')!r}, not of {target.name!r}"
                             f" (fingerprints differ); its target sidecars cannot be computed with this target")
    dtype = target_dtype_name(target)
    have = (manifest.get("targets") or {}).get("dtype")
    if have is not None and have != dtype:
        log.warning("%s: target sidecars were computed in %s; this target runs in %s: they stay, and training in %s "
                    "computes the target's logits itself", folder, have, dtype, dtype)
        return manifest
    for stray in folder.glob(".targets-*.tmp*"):
        stray.unlink(missing_ok=True)
    todo = [s for s in manifest["shards"] if not _sidecar_ok(folder, s, verify)]
    manifest["targets"] = {"format": TARGETS_FORMAT, "dtype": dtype}
    layer_index = manifest["layers"].index(target.num_layers)
    bar = tqdm(total=sum(s["num_tokens"] for s in todo), unit="tok", desc="target sidecars", disable=not progress)
    for n, entry in enumerate(todo):
        try:
            entry["targets"] = _write_sidecar(target, folder, entry, layer_index, dtype)
            atomic_write_json(folder / MANIFEST, manifest)
        except BaseException as e:
            entry.pop("targets", None)
            _raise_write_error(e, folder / _targets_name(entry["index"]),
                               f"the shards and the {n} target sidecar(s) written before are kept (listed in "
                               f"{MANIFEST}): free space, then rerun `specheads prepare` to continue")
        bar.update(entry["num_tokens"])
        if after_shard is not None:
            after_shard(entry["index"])
    bar.close()
    atomic_write_json(folder / MANIFEST, manifest)
    return manifest


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


# ------------------------------------------------------------------------------------------------------- offline read

def _read_manifest(folder: Path) -> dict:
    p = folder / MANIFEST
    if not p.exists():
        raise SpecheadsError(f"{folder}: no {MANIFEST} (run `specheads prepare` first)")
    try:
        m = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise SpecheadsError(f"{p}: not valid JSON ({e.msg})") from None
    if m.get("format") != FORMAT:
        raise SpecheadsError(f"{p}: format {m.get('format')!r}, expected {FORMAT!r}")
    return m


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
    if _sha256_file(path)[0] != entry["sha256"]:
        raise SpecheadsError(f"{path}: sha256 differs from the manifest's (the file is damaged); rerun `specheads "
                             f"prepare --verify` to rewrite it")
    _VERIFIED.add(key)


_WARNED: set[str] = set()  # folders whose missing sidecars this process has warned about


class FeatureDataset(torch.utils.data.Dataset):
    """Offline features: sample = {input_ids [T] long, loss_mask [T] long, hidden [T,F,D] bf16, conversation_id},
    plus target_greedy [T] long and target_lse [T] float32 from the target sidecars when the folder has them.

    `split`: None = all samples, "train" / "val" = by `data.is_val(conversation_id, manifest val_fraction)`.
    Shards are opened lazily (memory-mapped by safetensors), one handle per shard per process; `verify` checks a
    shard's (and its sidecar's) sha256 against the manifest when it is first opened (features.verify), else its
    size only. `targets_dtype`: read the sidecars only when computed in this dtype (the training target's);
    `targets=False` never reads them. Without usable sidecars one warning says training computes the logits."""

    def __init__(self, folder: str | os.PathLike, split: str | None = None, verify: bool = True,
                 targets: bool = True, targets_dtype: str | None = None):
        from specheads.train.data import is_val

        self.verify = verify
        self.folder = Path(folder)
        self.manifest = _read_manifest(self.folder)
        why = sidecars_usable(self.manifest, targets_dtype) if targets else "not asked for"
        self.has_targets = why is None
        if targets and why is not None and str(self.folder) not in _WARNED:
            _WARNED.add(str(self.folder))
            log.warning("%s: %s; training computes the target's full-vocabulary logits every step (slower). Rerun "
                        "`specheads prepare --config <recipe>` to add them (no re-extraction)", self.folder, why)
        if not self.manifest.get("complete"):
            raise SpecheadsError(f"{self.folder}: features are incomplete ({len(self.manifest['shards'])}/"
                                 f"{self.manifest['planned_shards']} shards); rerun `specheads prepare` to finish")
        if split not in (None, "train", "val"):
            raise SpecheadsError(f"split {split!r}: expected None, 'train' or 'val'")
        self.layers: list[int] = list(self.manifest["layers"])
        vf = float(self.manifest.get("val_fraction", 0.0))
        self.index: list[tuple[int, int, str]] = []
        for si, s in enumerate(self.manifest["shards"]):
            for j, cid in enumerate(s["conversation_ids"]):
                if split is None or (split == "val") == is_val(cid, vf):
                    self.index.append((si, j, cid))
        self._handles: dict[int, Any] = {}
        self._targets: dict[int, Any] = {}  # sidecar handles
        self._offsets: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.index)

    def _handle(self, si: int):
        h = self._handles.get(si)
        if h is None:
            from safetensors import safe_open

            entry = self.manifest["shards"][si]
            check_shard(self.folder / entry["file"], entry, self.verify)
            h = safe_open(str(self.folder / entry["file"]), framework="pt")
            self._handles[si] = h
            self._offsets[si] = h.get_tensor("offsets").tolist()
            if self.has_targets:
                t = entry["targets"]
                check_shard(self.folder / t["file"], t, self.verify)
                self._targets[si] = safe_open(str(self.folder / t["file"]), framework="pt")
        return h

    def __getitem__(self, i: int) -> dict:
        si, j, cid = self.index[i]
        h = self._handle(si)
        a, b = self._offsets[si][j], self._offsets[si][j + 1]
        out = {"input_ids": h.get_slice("input_ids")[a:b].long(), "loss_mask": h.get_slice("loss_mask")[a:b].long(),
               "hidden": h.get_slice("hidden")[a:b], "conversation_id": cid}
        if self.has_targets:
            t = self._targets[si]
            out["target_greedy"], out["target_lse"] = t.get_slice("greedy")[a:b].long(), t.get_slice("lse")[a:b]
        return out

    def lengths(self) -> list[int]:
        """Sample lengths (tokens) without reading the hidden states (for length-grouped batching)."""
        out = []
        for si, j, _ in self.index:
            self._handle(si)
            out.append(self._offsets[si][j + 1] - self._offsets[si][j])
        return out

    def __getstate__(self):  # DataLoader workers reopen shards themselves
        d = dict(self.__dict__)
        d["_handles"], d["_targets"] = {}, {}
        return d


def collate(samples: Sequence[dict]) -> dict:
    """Right-pad samples -> {input_ids [B,T], loss_mask [B,T], attention_mask [B,T], hidden [B,T,F,D] (if present),
    target_greedy [B,T] (-1 padded) and target_lse [B,T] (if present)}. Works for FeatureDataset samples and for
    tokenised rows (lists) used with OnlineFeatures."""
    ids = [torch.as_tensor(s["input_ids"], dtype=torch.long) for s in samples]
    T = max(len(x) for x in ids)
    B = len(samples)
    out = {"input_ids": torch.zeros(B, T, dtype=torch.long), "loss_mask": torch.zeros(B, T, dtype=torch.long),
           "attention_mask": torch.zeros(B, T, dtype=torch.long)}
    for b, s in enumerate(samples):
        n = len(ids[b])
        out["input_ids"][b, :n] = ids[b]
        out["loss_mask"][b, :n] = torch.as_tensor(s["loss_mask"], dtype=torch.long)
        out["attention_mask"][b, :n] = 1
    if "hidden" in samples[0]:
        h0 = samples[0]["hidden"]
        hid = torch.zeros(B, T, *h0.shape[1:], dtype=h0.dtype)
        for b, s in enumerate(samples):
            hid[b, : len(ids[b])] = s["hidden"]
        out["hidden"] = hid
    if "target_greedy" in samples[0]:
        out["target_greedy"] = torch.full((B, T), -1, dtype=torch.long)
        out["target_lse"] = torch.zeros(B, T, dtype=torch.float32)
        for b, s in enumerate(samples):
            out["target_greedy"][b, : len(ids[b])] = s["target_greedy"]
            out["target_lse"][b, : len(ids[b])] = s["target_lse"]
    return out


def check_shared_features(folder: str | os.PathLike, target, layers: Sequence[int]) -> dict:
    """`features.dir` set to another recipe's folder: it must be complete, hold `layers` and come from this target.
    Returns its manifest."""
    folder = Path(folder)
    if not (folder / MANIFEST).exists():
        raise SpecheadsError(f"features.dir {folder}: no {MANIFEST}; run `specheads prepare` on the recipe that "
                             f"writes it first")
    m = _read_manifest(folder)
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


def masked_token_counts(ds: "FeatureDataset", vocab_size: int) -> torch.Tensor:
    """[V] counts of loss-masked tokens in offline features (ids and masks only; hidden states are not read)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for si, j, _ in ds.index:
        h = ds._handle(si)
        a, b = ds._offsets[si][j], ds._offsets[si][j + 1]
        ids = h.get_slice("input_ids")[a:b].long()
        lm = h.get_slice("loss_mask")[a:b].bool()
        counts += torch.bincount(ids[lm], minlength=vocab_size)
    return counts

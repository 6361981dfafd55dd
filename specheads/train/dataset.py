"""What training and evaluation iterate over: torch datasets of samples and the one collate that batches them.

- `FeatureDataset(folder, split)`: offline features (shards.py's folder), sample = {input_ids [T] long, loss_mask
  [T] long, hidden [T,F,D] bf16, conversation_id} (+ target_greedy [T] long, target_lse [T] float32 from the target
  sidecars).
- `TokenDataset(ds)`: tokenised rows (online mode: the trainer extracts `hidden` per batch).
- `collate(samples)`: right-padded batch dict for both.
- `split_batches`, `eval_indices`: the held-out batches an evaluation or a calibration pass reads.
Shapes: B batch, T sequence, F feature layers, D hidden, V vocab.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from specheads.train.data import is_val
from specheads.train.shards import check_shard, read_hidden, read_manifest, sidecars_usable, verify_once
from specheads.utils import SpecheadsError

log = logging.getLogger("specheads.train.features")  # the features folder's lines under one name

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
        self.verify = verify
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
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

    def verify_once(self, main: bool, wait) -> None:
        """Several processes: the folder's checksums checked by the main process alone (shards.verify_once)."""
        if self.verify:
            verify_once(self.folder, self.manifest, self.has_targets, main, wait)

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
               "hidden": read_hidden(h, a, b), "conversation_id": cid}
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


class TokenDataset(torch.utils.data.Dataset):
    """A datasets.Dataset (input_ids, loss_mask) as torch samples (online mode: features computed per batch)."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict:
        row = self.ds[int(i)]
        return {"input_ids": torch.as_tensor(row["input_ids"], dtype=torch.long),
                "loss_mask": torch.as_tensor(row["loss_mask"], dtype=torch.long)}


def collate(samples: Sequence[dict]) -> dict:
    """Right-pad samples -> {input_ids [B,T], loss_mask [B,T], attention_mask [B,T], hidden [B,T,F,D] (if present),
    target_greedy [B,T] (-1 padded) and target_lse [B,T] (if present)}. Works for FeatureDataset samples and for
    tokenised rows (lists) whose hidden states are extracted online (features.extract_features)."""
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


def assistant_token_counts(tokens, vocab_size: int) -> torch.Tensor:
    """[V] counts of loss-masked (assistant) tokens in a tokenised dataset: what the draft vocab is chosen from."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for batch in tokens.iter(batch_size=1024):
        for ids, lm in zip(batch["input_ids"], batch["loss_mask"]):
            ids_t = torch.as_tensor(ids, dtype=torch.long)
            counts += torch.bincount(ids_t[torch.as_tensor(lm, dtype=torch.bool)], minlength=vocab_size)
    return counts


def eval_indices(n: int, max_samples: int | None, seed: int) -> list[int]:
    """The held-out samples an evaluation scores: all n, or `max_samples` drawn at random with `seed` (ascending)."""
    if max_samples is None or max_samples >= n:
        return list(range(n))
    g = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(n, generator=g)[:max_samples].tolist())


def split_batches(ds, batch_size: int, collate_fn, target, layers, extract_fn=None, indices=None):
    """Batches of a held-out split (or its samples `indices`) on the target's device, with `hidden` extracted
    online when the split holds no features (extract_fn)."""
    if indices is not None:
        ds = torch.utils.data.Subset(ds, indices)
    for b in torch.utils.data.DataLoader(ds, batch_size=batch_size, collate_fn=collate_fn):
        b = {k: (t.to(target.device) if isinstance(t, torch.Tensor) else t) for k, t in b.items()}
        if "hidden" not in b and extract_fn is not None:
            b["hidden"] = extract_fn(target, b["input_ids"], b["attention_mask"], layers)
        yield b

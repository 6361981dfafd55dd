"""The frozen target as teacher: its next-token logits from the final post-norm state h_L (never stored, always
recomputed through the frozen lm_head), and the target sidecar that stores per token what needs all V columns.

- `lm_head_logits`, `greedy_and_lse`: one computation for the sidecar pass and for training, so both give the same
  figures. `target_rows(...) -> TargetRows` is what the losses read of a batch: the rows predicting an assistant
  token, at the draft vocabulary's V' columns when the batch carries the sidecar (target_greedy, target_lse), else
  at every column, from which the greedy token and the logsumexp are taken. `target_greedy` is evaluation's.
- The sidecar (`write_target_sidecars`, run by `specheads prepare` after the shards, also on a folder that exists
  already): per token j the target's greedy token (argmax over all V columns) and the full-vocabulary logsumexp
  of lm_head(h_L[j]), computed once from the STORED bf16 layer-L state in the target's dtype, exactly as training
  computes them from the same state; -1 / 0 at the rows no loss reads (token j+1 not an assistant token). A
  sidecar is bound to its shard by the shard's sha256 (shards.py); written atomically, resumable shard by shard.
  Manifests without sidecars (older folders) still load: training then computes the full logits itself.
Shapes: B batch, T sequence, D hidden, V vocab, V' draft vocab, R rows.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from specheads.train.ranks import Ranks, clear_parts, read_parts, write_part
from specheads.train.shards import (MANIFEST, TARGETS_FORMAT, check_shard, commit_file, read_hidden, raise_write_error,
                                    read_manifest, save_safetensors, sidecar_ok, targets_name)
from specheads.utils import SpecheadsError, atomic_write_json

log = logging.getLogger("specheads.train.features")  # the features folder's lines under one name

TARGET_ROWS_CHUNK = 1024  # rows per lm_head call of the sidecar pass (1024 x 49,152 fp32 = 200 MB transient)


# -------------------------------------------------------------------------------------------- the logits

def lm_head_logits(target, h: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
    """The frozen lm_head on final post-norm states h [..., D], in the target's dtype -> [..., V], or [..., V'] at
    the target ids `vocab`. One function for the sidecar pass and for training, so both compute the same logits."""
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


def in_draft_vocab(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] bool: True for the target ids in the draft vocabulary d2t [V']."""
    m = torch.zeros(vocab_size, dtype=torch.bool, device=d2t.device)
    m[d2t] = True
    return m


@dataclass
class TargetRows:
    """What the losses read of the target's next-token distribution, per row j (predicting token j+1): its
    logits at the draft-vocab columns, whether its greedy token lies in the draft vocab, the greedy token and the
    full-vocabulary logsumexp (None when not computed). Rows no loss reads may hold anything."""

    logits: torch.Tensor  # [B,T,V'] (V' = V without a draft vocab)
    in_vocab: torch.Tensor | None = None  # [B,T] bool
    greedy: torch.Tensor | None = None  # [B,T] long target ids
    lse: torch.Tensor | None = None  # [B,T] float32, logsumexp over all V columns

    @classmethod
    def from_full(cls, full: torch.Tensor, d2t: torch.Tensor | None, with_lse: bool = True) -> "TargetRows":
        """From the target's logits over the full vocabulary [B,T,V] (the path without a sidecar)."""
        greedy, lse = greedy_and_lse(full) if with_lse else (full.argmax(-1), None)
        if d2t is None:
            return cls(full, torch.ones_like(greedy, dtype=torch.bool), greedy, lse)
        d2t = d2t.to(full.device)
        return cls(full[..., d2t], in_draft_vocab(d2t, full.shape[-1])[greedy], greedy, lse)

    def at(self, bi: torch.Tensor, ti: torch.Tensor):
        """The rows (bi, ti) -> (logits [N,V'], lse [N] or None)."""
        return self.logits[bi, ti], None if self.lse is None else self.lse[bi, ti]


def need_rows(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B,T] bool: rows j whose next token j+1 is an assistant token, the only rows a loss or evaluation reads."""
    need = torch.zeros(loss_mask.shape, dtype=torch.bool, device=loss_mask.device)
    need[:, :-1] = loss_mask[:, 1:].bool()
    return need


@torch.no_grad()
def target_logits(target, h_last: torch.Tensor, loss_mask: torch.Tensor | None = None,
                  vocab: torch.Tensor | None = None) -> torch.Tensor:
    """The target's next-token logits [B,T,V] from its final post-norm state (frozen lm_head, target dtype).

    With loss_mask, only rows predicting an assistant token (loss_mask[j+1] == 1) are computed; the others are 0 and
    never read by the losses (they mask the same rows). The lm_head is the largest matmul of a step on small heads.
    With vocab (target ids [V']) only those columns are computed: [B,T,V'].
    """
    if loss_mask is None:
        return lm_head_logits(target, h_last, vocab)
    need = need_rows(loss_mask)
    cols = target.lm_head.weight.shape[0] if vocab is None else len(vocab)
    out = h_last.new_zeros(*h_last.shape[:2], cols, dtype=target.lm_head.weight.dtype)
    out[need] = lm_head_logits(target, h_last[need], vocab)
    return out


def has_sidecar(batch: dict) -> bool:
    return "target_greedy" in batch and "target_lse" in batch


@torch.no_grad()
def target_rows(target, h_last: torch.Tensor, loss_mask: torch.Tensor, d2t: torch.Tensor | None, batch: dict,
                need_greedy: bool = True, need_lse: bool = False) -> TargetRows:
    """What the losses read of the target, computed once per batch at the rows predicting an assistant token.

    With the batch's sidecar (target_greedy, target_lse): only the draft vocabulary's V' columns (576 x 8,192
    multiply-adds per row for SmolLM2's recipes instead of 576 x 49,152). Without one: every column, then the
    greedy token (argmax over V) and the logsumexp over V from them (`need_lse`), as before the sidecars existed.
    Without a draft vocabulary V' = V: the full logits either way. `need_greedy` False (Medusa's soft labels,
    which mask no row) with neither a sidecar nor need_lse: the V' columns alone, greedy and lse left None."""
    side = has_sidecar(batch)
    if d2t is not None and not side and (need_greedy or need_lse):
        return TargetRows.from_full(target_logits(target, h_last, loss_mask), d2t, with_lse=need_lse)
    logits = target_logits(target, h_last, loss_mask, vocab=d2t)  # [B,T,V']
    greedy = lse = None
    if side:
        greedy, lse = batch["target_greedy"].to(logits.device).long(), batch["target_lse"].to(logits.device).float()
    elif need_greedy or need_lse:  # no draft vocabulary: these are the full logits
        need = need_rows(loss_mask)
        greedy = logits.argmax(-1)
        if need_lse:
            lse = torch.zeros(need.shape, dtype=torch.float32, device=logits.device)
            lse[need] = greedy_and_lse(logits[need])[1]
    in_vocab = None
    if greedy is not None:
        in_vocab = torch.ones_like(greedy, dtype=torch.bool) if d2t is None else \
            in_draft_vocab(d2t.to(greedy.device), target.lm_head.weight.shape[0])[greedy.clamp(min=0)] & (greedy >= 0)
    return TargetRows(logits, in_vocab, greedy, lse)


@torch.no_grad()
def target_argmax(target, h_last: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[B,T] the target's greedy token j+1 at row j, computed only where token j+1 is an assistant token (the
    only rows evaluation reads; 0 elsewhere)."""
    need = need_rows(loss_mask)
    out = torch.zeros(need.shape, dtype=torch.long, device=h_last.device)
    out[need] = lm_head_logits(target, h_last[need]).argmax(-1)
    return out


def target_greedy(target, h_last: torch.Tensor, batch: dict) -> torch.Tensor:
    """[B,T] the target's greedy tokens for evaluation: the batch's sidecar, else computed (target_argmax)."""
    if has_sidecar(batch):
        return batch["target_greedy"].to(h_last.device).long()
    return target_argmax(target, h_last, batch["loss_mask"])


# ----------------------------------------------------------------------------------------- the sidecars

def needed_rows(loss_mask: torch.Tensor, offsets: Sequence[int]) -> torch.Tensor:
    """[Ts] bool over a shard's concatenated samples: rows j whose next token j+1 is an assistant token of the same
    sample, the only rows any loss or evaluation reads (teacher.need_rows on a padded batch)."""
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
        for a in range(0, need.shape[0], TARGET_ROWS_CHUNK):
            rows = need[a:a + TARGET_ROWS_CHUNK].nonzero().flatten()
            if rows.numel():
                h = read_hidden(f, a, a + TARGET_ROWS_CHUNK)[:, layer_index][rows]  # [R,D] bf16, as training reads it
                g, z = greedy_and_lse(lm_head_logits(target, h))
                greedy[a + rows], lse[a + rows] = g.to("cpu", torch.int32), z.cpu()
    return {"greedy": greedy, "lse": lse}


def _write_sidecar(target, folder: Path, entry: dict, layer_index: int, dtype: str) -> dict:
    check_shard(folder / entry["file"], entry, full=False)
    tensors = _target_sidecar(target, folder / entry["file"], layer_index)
    name = targets_name(entry["index"])
    meta = {"format": TARGETS_FORMAT, "dtype": dtype, "shard_sha256": entry["sha256"]}
    digest, size = commit_file(lambda tmp: save_safetensors(tensors, tmp, meta), folder / name)
    return {"file": name, "bytes": size, "sha256": digest, "shard_sha256": entry["sha256"]}


def target_dtype_name(target) -> str:
    return str(target.lm_head.weight.dtype).removeprefix("torch.")


def write_target_sidecars(target, folder: str | os.PathLike, progress: bool = True, verify: bool = False,
                          after_shard=None, ranks: Ranks | None = None) -> dict:
    """Add the target sidecar of every listed shard that lacks a valid one (missing, of an older shard, wrong
    size, or with `verify` a sha256 that differs). Reads only the stored layer-L states: no re-extraction.
    Resumable: each sidecar is committed to the manifest as soon as it is written. A folder whose sidecars were
    computed in another dtype keeps them (a warning says so). Returns the manifest.
    `ranks` (several processes): rank 0 checks the folder; rank r computes the sidecars of shards with index %
    world == r, each recorded in a part file; rank 0 lists them in the manifest after a barrier."""
    from tqdm.auto import tqdm

    ranks = ranks or Ranks()
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest.get("fingerprint") != target.fingerprint():
        raise SpecheadsError(f"{folder}: holds features of target {manifest.get('target')!r}, not of {target.name!r}"
                             f" (fingerprints differ); its target sidecars cannot be computed with this target")
    dtype = target_dtype_name(target)
    have = (manifest.get("targets") or {}).get("dtype")
    if have is not None and have != dtype:
        log.warning("%s: target sidecars were computed in %s; this target runs in %s: they stay, and training in %s "
                    "computes the target's logits itself", folder, have, dtype, dtype)
        return manifest
    todo_idx = None
    if ranks.main:
        for stray in folder.glob(".targets-*.tmp*"):
            stray.unlink(missing_ok=True)
        _merge_sidecar_parts(folder, manifest, dtype)
        todo_idx = [s["index"] for s in manifest["shards"] if not sidecar_ok(folder, s, verify)]
    todo_idx = set(ranks.broadcast(todo_idx))
    todo = [s for s in manifest["shards"] if s["index"] in todo_idx and s["index"] % ranks.world == ranks.rank]
    manifest["targets"] = {"format": TARGETS_FORMAT, "dtype": dtype}
    layer_index = manifest["layers"].index(target.num_layers)
    bar = tqdm(total=sum(s["num_tokens"] for s in todo), unit="tok", desc="target sidecars",
               disable=not progress or not ranks.main)
    for n, entry in enumerate(todo):
        try:
            entry["targets"] = _write_sidecar(target, folder, entry, layer_index, dtype)
            if ranks.multi:
                write_part(folder, targets_name(entry["index"]), entry["targets"])
            else:
                atomic_write_json(folder / MANIFEST, manifest)
        except BaseException as e:
            entry.pop("targets", None)
            raise_write_error(e, folder / targets_name(entry["index"]),
                               f"the shards and the {n} target sidecar(s) written before are kept (listed in "
                               f"{MANIFEST}): free space, then rerun `specheads prepare` to continue")
        bar.update(entry["num_tokens"])
        if after_shard is not None:
            after_shard(entry["index"])
    bar.close()
    ranks.barrier()
    if ranks.main:
        _merge_sidecar_parts(folder, manifest, dtype)
        atomic_write_json(folder / MANIFEST, manifest)
    ranks.barrier()
    return manifest if ranks.main else read_manifest(folder)


def _merge_sidecar_parts(folder: Path, manifest: dict, dtype: str) -> None:
    """List the sidecars ranks recorded in part files (of this shard's sha256, a whole file) in `manifest`, then
    remove the part files. With parts, the manifest is written before they go."""
    parts = read_parts(folder, "targets-")
    for entry in manifest["shards"]:
        t = parts.get(targets_name(entry["index"]))
        p = folder / (t or {}).get("file", "-")
        if t and t.get("shard_sha256") == entry["sha256"] and p.is_file() and p.stat().st_size == t.get("bytes"):
            entry["targets"] = t
    if parts:
        manifest["targets"] = {"format": TARGETS_FORMAT, "dtype": dtype}
        atomic_write_json(folder / MANIFEST, manifest)
    clear_parts(folder, "targets-")

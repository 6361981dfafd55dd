"""Medusa heads in the `medusa-vllm` layout, written and read back. Consumer: vLLM's Medusa, vLLM 0.x-0.32 (0.33
removed it): vllm/model_executor/models/medusa.py, config from vllm/transformers_utils/configs/medusa.py.

model_type medusa, num_heads, num_hidden_layers, truncated_vocab_size, medusa_fc_bias, original_lm_head;
blocks.{h}.layers.{l}.weight / bias, lm_heads.{h}.weight [, token_map: absolute ids].

A draft vocabulary (truncated_vocab_size V' < V, token_map = the V' target ids). vLLM <= 0.11 built every lm_head
with V' rows; 0.12-0.32 build each `lm_heads.{h}` with the FULL vocabulary (ParallelLMHead(config.vocab_size), whose
weight_loader asserts the rows equal the vocabulary) and read a draft vocabulary only with `original_lm_head: true`:
one `lm_head` of V' rows shared by every head, loaded from `lm_heads.0.weight`, sliced to `token_map`'s rows when the
file has more rows (both versions do that slicing). So a head sharing the target's lm_head over a draft vocabulary
is written as original_lm_head true with the target's full lm_head in `lm_heads.0.weight`: read right by every
version. A head with its own projection per head over a draft vocabulary fits no 0.12-0.32 layout and is refused
(export/consumers.py). FasterDecoding Medusa checkpoints are read by export/repos.py.
"""
from __future__ import annotations

import torch

from specheads.heads.base import HeadConfig, HeadSpec, check_target
from specheads.heads.export.common import check_dims, check_keys, need, t2d_of
from specheads.heads.export.formats import Format, register_format
from specheads.utils import SpecheadsError


def write_medusa_vllm(cfg: HeadConfig, sd: dict, expected: list[str], target=None, where: str = "",
                      **_) -> tuple[dict, dict, list[str]]:
    spec = cfg.head_spec
    K, n = spec.options.num_heads, spec.num_layers
    one_head = spec.options.lm_head == "shared" and bool(cfg.draft_vocab_size)  # vLLM's original_lm_head
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "num_heads": K, "num_hidden_layers": n,
              "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "truncated_vocab_size": cfg.out_vocab,
              "medusa_fc_bias": spec.resolved_bias(), "original_lm_head": one_head}
    tensors = {k: v for k, v in sd.items() if k.startswith("blocks.")}
    if spec.options.lm_head == "shared":
        if target is None:
            raise SpecheadsError("--format medusa-vllm: this head shares the target lm_head; give --target so "
                                 "its rows can be written as the projections vLLM reads")
        check_target(cfg, target, where)
        w = target.lm_head.weight.detach().cpu()
        for h in range(1 if one_head else K):  # full rows: vLLM slices them to token_map itself
            tensors[f"lm_heads.{h}.weight"] = w.clone()
    else:
        tensors.update({k: v for k, v in sd.items() if k.startswith("lm_heads.")})
    if cfg.draft_vocab_size:
        tensors["token_map"] = sd["d2t"].to(torch.int64)  # absolute ids (vLLM scatters logits into them)
    required = [f"blocks.{h}.layers.{l}.{p}" for h in range(K) for l in range(n)
                for p in (("weight", "bias") if spec.resolved_bias() else ("weight",))] + \
        [f"lm_heads.{h}.weight" for h in range(1 if one_head else K)]
    return config, tensors, required


def _lm_heads(config: dict, sd: dict, K: int, token_map, target, w: str) -> tuple[str, dict]:
    """(medusa_lm_head, our lm_heads tensors) of a vLLM Medusa folder. original_lm_head: one projection for every
    head, `lm_heads.0.weight`, full rows sliced to token_map as vLLM slices them; equal to the target's lm_head it
    is a head sharing it (nothing stored), else each head gets the same projection."""
    if not config.get("original_lm_head", False):
        check_keys(sd, [f"lm_heads.{h}.weight" for h in range(K)], w)
        return "per_head", {k: v for k, v in sd.items() if k.startswith("lm_heads.")}
    check_keys(sd, ["lm_heads.0.weight"], w)
    lm = sd["lm_heads.0.weight"]
    if lm.shape == target.lm_head.weight.shape and torch.equal(lm, target.lm_head.weight.detach().to(lm)):
        return "shared", {}
    if token_map is not None and lm.shape[0] > token_map.numel():
        lm = lm[token_map]
    return "per_head", {f"lm_heads.{h}.weight": lm.clone() for h in range(K)}


def read_medusa_vllm(config: dict, sd: dict, target, where: str, w: str) -> tuple[HeadSpec, dict]:
    check_dims(config, target, where)
    K, n = int(need(config, "num_heads", where)), int(need(config, "num_hidden_layers", where))
    dv = int(config.get("truncated_vocab_size") or target.vocab_size)
    token_map = None
    if dv < target.vocab_size:
        check_keys(sd, ["token_map"], w)
        token_map = sd["token_map"].to(torch.long)
    lm_mode, heads = _lm_heads(config, sd, K, token_map, target, w)
    spec = HeadSpec(kind="medusa", num_heads=K, num_layers=n, medusa_lm_head=lm_mode,
                    bias="blocks.0.layers.0.bias" in sd, draft_vocab_size=dv if dv < target.vocab_size else None)
    tensors = {k: v for k, v in sd.items() if k != "token_map" and not k.startswith("lm_heads.")}
    tensors.update(heads)
    if token_map is not None:
        tensors["d2t"] = token_map
        tensors["t2d"] = t2d_of(token_map, target.vocab_size)
    return spec, tensors


def medusa_vllm_problems(fmt: str, consumer: str, cfg: HeadConfig) -> list[str]:
    """vLLM 0.12-0.32 (0.33 removed Medusa) build each head's lm_head over the full vocabulary and read a draft
    vocabulary only as one lm_head shared by every head (original_lm_head, write_medusa_vllm)."""
    spec = cfg.head_spec
    if not cfg.draft_vocab_size or spec.options.lm_head != "per_head":
        return []
    return [f"vLLM 0.12-0.32 build each head's lm_heads.{{h}} over the full vocabulary (ParallelLMHead(vocab_size), "
            f"its weight_loader asserts the rows) and read a draft vocabulary only as one lm_head shared by every "
            f"head (original_lm_head), and this head has its own projection per head (head.medusa.lm_head per_head) "
            f"over a {cfg.draft_vocab_size}-token draft vocabulary, which no full-vocabulary rows reproduce "
            f"(vLLM <= 0.11 read it; 0.33 removed Medusa)"]


def _is_medusa_vllm(config: dict) -> bool:
    return config.get("model_type") == "medusa" or "num_heads" in config and "truncated_vocab_size" in config


MEDUSA_VLLM = register_format(Format(
    "medusa-vllm", rank=50, writer=write_medusa_vllm, reader=read_medusa_vllm, detect=_is_medusa_vllm,
    detect_rank=30, loaders={"vllm": "vLLM's Medusa"}, problems=medusa_vllm_problems))

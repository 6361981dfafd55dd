"""Medusa heads in the `medusa-vllm` layout, written and read back. Consumer: vLLM's Medusa
(vllm/model_executor/models/medusa.py, config from vllm/transformers_utils/configs/medusa.py).

model_type medusa, num_heads, num_hidden_layers, truncated_vocab_size, medusa_fc_bias; blocks.{h}.layers.{l}.weight
/ bias, lm_heads.{h}.weight [, token_map: absolute ids]. FasterDecoding Medusa checkpoints are read by
export/repos.py.
"""
from __future__ import annotations

import torch

from specheads.heads.base import HeadConfig, HeadSpec, check_target
from specheads.heads.export.common import check_dims, check_keys, need, t2d_of
from specheads.utils import SpecheadsError


def write_medusa_vllm(cfg: HeadConfig, sd: dict, expected: list[str], target=None, where: str = "",
                      **_) -> tuple[dict, dict, list[str]]:
    spec = cfg.head_spec
    K, n = spec.num_heads, spec.num_layers
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "num_heads": K, "num_hidden_layers": n,
              "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "truncated_vocab_size": cfg.out_vocab,
              "medusa_fc_bias": spec.resolved_bias(), "original_lm_head": False}
    tensors = {k: v for k, v in sd.items() if k.startswith("blocks.")}
    if spec.medusa_lm_head == "shared":
        if target is None:
            raise SpecheadsError("--format medusa-vllm: this head shares the target lm_head; give --target so "
                                 "its rows can be written as the per-head projections vLLM reads")
        check_target(cfg, target, where)
        w = target.lm_head.weight.detach().cpu()
        if cfg.draft_vocab_size:
            w = w[sd["d2t"]]
        for h in range(K):
            tensors[f"lm_heads.{h}.weight"] = w.clone()
    else:
        tensors.update({k: v for k, v in sd.items() if k.startswith("lm_heads.")})
    if cfg.draft_vocab_size:
        tensors["token_map"] = sd["d2t"].to(torch.int64)  # absolute ids (vLLM scatters logits into them)
    required = [f"blocks.{h}.layers.{l}.{p}" for h in range(K) for l in range(n)
                for p in (("weight", "bias") if spec.resolved_bias() else ("weight",))] + \
        [f"lm_heads.{h}.weight" for h in range(K)]
    return config, tensors, required


def read_medusa_vllm(config: dict, sd: dict, target, where: str, w: str) -> tuple[HeadSpec, dict]:
    check_dims(config, target, where)
    K, n = int(need(config, "num_heads", where)), int(need(config, "num_hidden_layers", where))
    dv = int(config.get("truncated_vocab_size") or target.vocab_size)
    spec = HeadSpec(kind="medusa", num_heads=K, num_layers=n, medusa_lm_head="per_head",
                    bias="blocks.0.layers.0.bias" in sd, draft_vocab_size=dv if dv < target.vocab_size else None)
    tensors = {k: v for k, v in sd.items() if k != "token_map"}
    if spec.draft_vocab_size:
        check_keys(sd, ["token_map"], w)
        tensors["d2t"] = sd["token_map"].to(torch.long)
        tensors["t2d"] = t2d_of(tensors["d2t"], target.vocab_size)
    return spec, tensors

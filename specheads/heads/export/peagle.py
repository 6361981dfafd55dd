"""P-EAGLE heads (heads/peagle.py) in the `speculators` layout, written and read back. Consumer: speculators 0.9's
PEagleDraftModel (models/peagle/config.py PEagleSpeculatorConfig over Eagle3SpeculatorConfig, core.py; loaded by
SpeculatorModel.from_pretrained), whose config vLLM reads on its speculators path (PR 32887).

speculators_model_type peagle, architectures [PEagleSpeculator], transformer_layer_config (a Llama config with
num_hidden_layers = head.num_layers), eagle_aux_hidden_state_layer_ids ascending, mask_token_id,
embed_requires_grad false (our embedding is the target's, frozen), speculators_config {algorithm peagle, greedy
proposal of speculative_tokens = head.peagle.num_depths, verifier}; tensors fc.weight, layers.0.* (our midlayer.*),
layers.{i}.*, norm.weight, lm_head.weight, mask_hidden [1, 1, F·D], embed_tokens.weight (the target's, mask token
row included: speculators reads the checkpoint's and never fills it from the verifier, export/common.py
target_embedding) [, d2t offsets, t2d when V' < V]. fc's column blocks and mask_hidden's blocks follow the
ascending layer order the engines concatenate the aux states in. GGUF: refused (KindSpec.not_drafted,
heads/peagle.py; llama.cpp's pinned converter has no P-EAGLE).
"""
from __future__ import annotations

import torch

from specheads.heads.base import HeadConfig, HeadSpec
from specheads.heads.eagle3 import eagle31_switches
from specheads.heads.peagle import PEagleOptions
from specheads.heads.export.common import (native_name, need, speculators_section, speculators_tensors,
                                           target_embedding)
from specheads.heads.export.eagle3 import _ascending, ascending_fc, eagle3_llama_dict, read_eagle3_layer
from specheads.heads.export.formats import register_variant
from specheads.utils import SpecheadsError


def ascending_mask_hidden(cfg: HeadConfig, sd: dict) -> torch.Tensor:
    """mask_hidden [1,1,F·D] with its per-layer blocks in ascending layer order (as ascending_fc reorders fc)."""
    m, D = sd["mask_hidden"], cfg.hidden_size
    return torch.cat([m[..., j * D:(j + 1) * D] for j in _ascending(cfg)], dim=-1)


def write_peagle(cfg: HeadConfig, sd: dict, expected: list[str], verifier: str = "", target=None,
                 where: str = "the head", **_) -> tuple[dict, dict, list[str]]:
    """The speculators writer of a P-EAGLE head (its KindSpec.writers; drafts per pass: head.peagle.num_depths), with
    the target's token embedding (export/common.py target_embedding)."""
    embed = target_embedding(cfg, sd, target, "speculators", where)
    spec = cfg.head_spec
    layer = eagle3_llama_dict(cfg)
    layer.pop("architectures", None)
    layer["num_hidden_layers"] = int(spec.num_layers)
    ids, fc = ascending_fc(cfg, sd)
    config = {
        "architectures": ["PEagleSpeculator"], "speculators_model_type": "peagle",
        "transformer_layer_config": layer, "draft_vocab_size": cfg.out_vocab, "norm_before_residual": False,
        "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": ids,
        "mask_token_id": int(spec.mask_token_id), "embed_requires_grad": False,
        "speculators_config": speculators_section("peagle", spec.options.num_depths, verifier, cfg.target_config),
    }
    tensors, required = speculators_tensors(cfg, sd, expected, fc, embed)
    tensors["mask_hidden"] = ascending_mask_hidden(cfg, sd)
    return config, tensors, required + ["mask_hidden"]


def read_peagle(config: dict, sd: dict, target, where: str, w: str) -> tuple[HeadSpec, dict]:
    """A speculators peagle folder -> (HeadSpec, native state dict): layer 0 and the fused input through the
    EAGLE-3 reader, then layers 1..n-1, mask_hidden, mask_token_id and the depths."""
    layer = dict(need(config, "transformer_layer_config", where))
    n = int(layer.get("num_hidden_layers", 1))
    if "mask_hidden" not in sd:
        raise SpecheadsError(f"{w}: missing key 'mask_hidden' (a P-EAGLE export carries its learned mask state)")
    rest = {k: v for k, v in sd.items() if k.startswith("layers.") and not k.startswith("layers.0.")}
    first = {native_name(k): v for k, v in sd.items() if k not in rest and k != "mask_hidden"}
    spec, tensors = read_eagle3_layer(config, {**layer, "num_hidden_layers": 1}, first, target, where, w)
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    depths = int(methods[0].get("speculative_tokens", PEagleOptions.num_depths))
    if eagle31_switches(spec):
        raise SpecheadsError(f"{where}: {', '.join(eagle31_switches(spec))}: EAGLE-3.1 switches, which P-EAGLE "
                             "heads do not build")
    spec = HeadSpec(kind="peagle", num_layers=n, draft_vocab_size=spec.draft_vocab_size,
                    feature_layers=spec.feature_layers, bias=spec.bias, mask_token_id=config.get("mask_token_id"),
                    options=PEagleOptions(num_depths=depths))
    tensors.update(rest)
    tensors["mask_hidden"] = sd["mask_hidden"]
    return spec, tensors


register_variant("speculators", "peagle", read_peagle)  # export/speculators.py dispatches on speculators_model_type

"""DFlash2 heads (heads/dflash2.py) in the `speculators` layout, written and read back. Consumer: speculators 0.9's
DFlash2DraftModel (speculators models/dflash2/config.py DFlash2SpeculatorConfig over DFlashSpeculatorConfig,
core.py, model_definitions.py; loaded by SpeculatorModel.from_pretrained, which reloads the embedding and the
full-vocabulary lm_head from the verifier).

speculators_model_type dflash2, architectures [DFlash2DraftModel], transformer_layer_config (Qwen3, the target's
sizes and vocab_size, num_hidden_layers = head.num_layers), draft_vocab_size = the full vocabulary (DFlash2 refuses
any other), block_size, aux_hidden_state_layer_ids (hidden_states ids: ours unchanged), mask_token_id,
sample_from_anchor, sliding_window_non_causal (true, DFlash2's default; our layers are all full attention, which
never reads it), conv_kernel_size, conv_group_size, selector_rank, selector_top_k, speculators_config {algorithm
dflash2, greedy proposal of K' drafts, verifier}; tensors fc, hidden_norm, layers.{i}.* with attention_conv.* and
mlp_conv.*, norm, candidate_selector.* (our names are its names). The calibration buffers (conf_temperature,
conf_bias: unused by DFlash2) stay in the native folder. SpecForge: the KindSpec's refusal (heads/dflash2.py);
GGUF: this layout is the converter's input, its config.json rewritten flat (heads/dflash2_gguf.py).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from specheads.heads.base import CONFIG_NAME, WEIGHTS_NAME, HeadConfig, HeadSpec, head_class, write_safetensors
from specheads.heads.dflash2 import DFlash2Options
from specheads.heads.export.common import HUB_IDS, check_dims, check_keys, need, speculators_section
from specheads.heads.export.dspark import block_layer_dict, check_block_exportable
from specheads.heads.export.formats import register_variant
from specheads.utils import SpecheadsError, atomic_dir, atomic_write_json

log = logging.getLogger(__package__)

LOADER = "speculators' DFlash2DraftModel"
OWN_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # HeadSpec = speculators keys
NATIVE_ONLY = ("conf_temperature", "conf_bias")  # buffers of the DSpark base class that DFlash2 never reads


def speculators_config(cfg: HeadConfig, verifier: str | None) -> dict:
    """DFlash2SpeculatorConfig's fields for the head `cfg`."""
    spec = cfg.head_spec
    return {
        "architectures": ["DFlash2DraftModel"], "speculators_model_type": "dflash2",
        "transformer_layer_config": block_layer_dict(cfg), "draft_vocab_size": cfg.vocab_size,
        "block_size": spec.options.block_size, "target_hidden_size": None,
        "aux_hidden_state_layer_ids": list(cfg.feature_layers), "mask_token_id": spec.mask_token_id,
        "sliding_window_non_causal": True, "sample_from_anchor": spec.options.sample_from_anchor,
        **{k: int(getattr(spec.options, k)) for k in OWN_KEYS},
        "speculators_config": speculators_section("dflash2", spec.num_drafts,
                                                  verifier or HUB_IDS.get(cfg.target_name, cfg.target_name),
                                                  cfg.target_config),
    }


def export_dflash2(cfg: HeadConfig, sd: dict, fmt: str, out_dir, where: str, verifier: str | None) -> Path:
    """The KindSpec.exporter of dflash2 heads: the speculators layout (the only format it is written in)."""
    if fmt != "speculators":  # export_head lets only the KindSpec's formats through
        raise SpecheadsError(f"--format {fmt}: a DFlash2 head is written as speculators or native")
    check_block_exportable(cfg, f"--format {fmt}", LOADER, where)
    check_keys(sd, list(head_class(cfg.kind)(cfg).state_dict()), where)
    tensors = {k: v for k, v in sd.items() if k not in NATIVE_ONLY}
    config = speculators_config(cfg, verifier)
    with atomic_dir(out_dir) as tmp:
        atomic_write_json(tmp / CONFIG_NAME, config)
        write_safetensors(tensors, tmp / WEIGHTS_NAME, metadata={"format": "pt", "specheads_export": fmt})
    log.info("exported dflash2 head %s as speculators (dflash2) to %s", where, out_dir)
    return Path(out_dir)


def read_dflash2(config: dict, sd: dict, target, where: str, w: str) -> tuple[HeadSpec, dict]:
    """A speculators dflash2 folder -> (HeadSpec, native state dict); speculators' defaults where a key is absent
    (sample_from_anchor false, conv 2 / 16, selector 256 / 16)."""
    layer = need(config, "transformer_layer_config", where)
    check_dims(layer, target, where)
    dv = config.get("draft_vocab_size")
    if dv is not None and int(dv) != target.vocab_size:
        raise SpecheadsError(f"{where}: draft_vocab_size {dv}: a DFlash2 head drafts over the full vocabulary "
                             f"({target.vocab_size})")
    own = {k: int(config.get(k, getattr(DFlash2Options, k))) for k in OWN_KEYS}
    spec = HeadSpec(kind="dflash2", num_layers=int(need(layer, "num_hidden_layers", where)),
                    feature_layers=list(need(config, "aux_hidden_state_layer_ids", where)),
                    block_size=int(need(config, "block_size", where)), markov_rank=0, confidence_head=False,
                    sample_from_anchor=bool(config.get("sample_from_anchor", False)),
                    mask_token_id=config.get("mask_token_id"), **own)
    check_keys(sd, ["fc.weight", "hidden_norm.weight", "norm.weight", "candidate_selector.predecessor_codebook",
                    "candidate_selector.successor_codebook", "candidate_selector.hidden_projection.weight",
                    "layers.0.attention_conv.base_kernel", "layers.0.mlp_conv.kernel_projection.weight"], w)
    tensors = {k: v for k, v in sd.items() if k not in ("d2t", "t2d", "lm_head.weight")}  # lm_head: the verifier's
    tensors["conf_temperature"] = torch.ones(spec.num_drafts)
    tensors["conf_bias"] = torch.zeros(spec.num_drafts)
    return spec, tensors


register_variant("speculators", "dflash2", read_dflash2)  # export/speculators.py dispatches on speculators_model_type

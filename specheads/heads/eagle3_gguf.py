"""EAGLE-3 heads (heads/eagle3.py) as llama.cpp drafts: the DraftKind of the eagle3 KindSpec (heads/gguf.py runs
the export: our eagle3 layout, heads/export/eagle3.py, its config.json completed here, the pinned converter, the
checks below). What the pinned converter and runtime read of it (detection, aux layer ids, target_hidden_size,
norm_before_residual / norm_before_fc, d2t offsets, RoPE base) is listed in heads/gguf.py's docstring.

    specheads export --head runs/x/final --format gguf --out runs/x/gguf
    llama-server -m target.gguf -md draft.gguf --spec-type draft-eagle3 --spec-draft-n-max 3
"""
from __future__ import annotations

from pathlib import Path

from specheads.heads.base import HeadConfig
from specheads.heads.eagle3 import eagle31_switches
from specheads.heads.gguf import DraftKind, _expect, _rope_theta
from specheads.utils import SpecheadsError

LAYOUT = ARCH = "eagle3"  # the export format the converter reads; general.architecture of the converted draft


def check_head(cfg: HeadConfig, head_dir: Path) -> None:
    """What llama.cpp's EAGLE-3 graph cannot run (3 feature layers below L, no fc bias, no EAGLE-3.1 switch),
    refused with the reason."""
    L = int(cfg.target_config["num_hidden_layers"])
    if len(cfg.feature_layers) != 3:
        raise SpecheadsError(f"--format gguf: {head_dir} reads {len(cfg.feature_layers)} feature layers; llama.cpp's "
                             "EAGLE-3 reads exactly 3")
    if max(cfg.feature_layers) >= L:
        raise SpecheadsError(f"--format gguf: {head_dir} reads feature layer {L} (the final post-norm state); "
                             "llama.cpp feeds the pre-norm state for that id, so the draft would read other features")
    if cfg.head_spec.resolved_bias():
        raise SpecheadsError(f"--format gguf: {head_dir} has an fc bias; llama.cpp's EAGLE-3 fc has none")
    on = eagle31_switches(cfg.head_spec)
    if on:
        raise SpecheadsError(f"--format gguf: {head_dir} is an EAGLE-3.1 head ({', '.join('head.' + n for n in on)}); "
                             "llama.cpp's EAGLE-3 has no per-layer fc norms (its converter maps no fc_norm.* tensor, "
                             "src/models/eagle3.cpp has only the one norm_before_fc) and feeds its pre-norm state "
                             "to the next step (src/models/eagle3.cpp:286)")


def converter_config(cfg: HeadConfig, config: dict) -> dict:
    """The eagle3 export's config.json with every key the converter reads set explicitly."""
    config = dict(config)
    config.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, draft_vocab_size=cfg.out_vocab,
                  eagle_aux_hidden_state_layer_ids=list(cfg.feature_layers),  # hidden-states ids: ours
                  target_hidden_size=cfg.hidden_size, norm_before_residual=False, norm_before_fc=False)
    return config


def check_gguf(cfg: HeadConfig, meta: dict, tensors: dict, path: Path) -> None:
    """The converted draft: the eagle3 conventions and the tensors llama.cpp loads."""
    _expect(meta, "general.architecture", ARCH, path)
    _expect(meta, "eagle3.target_layers", list(cfg.feature_layers), path)
    _expect(meta, "eagle3.target_hidden_size", cfg.hidden_size, path)
    _expect(meta, "eagle3.rope.freq_base", _rope_theta(cfg), path, close=True)
    _expect(meta, "eagle3.attention.layer_norm_rms_epsilon", float(cfg.target_config["rms_norm_eps"]), path,
            close=True)
    _expect(meta, "eagle3.norm_before_residual", False, path)
    for name in ("fc.weight", "output.weight", "blk.0.attn_norm_2.weight", "d2t"):
        if name not in tensors:
            raise SpecheadsError(f"{path}: tensor {name!r} missing from the converted draft")
    if int(tensors["output.weight"].shape[-1]) != cfg.out_vocab:
        raise SpecheadsError(f"{path}: output.weight has {tensors['output.weight'].shape[-1]} rows, the head's "
                             f"draft vocabulary {cfg.out_vocab}")


EAGLE3_DRAFT = DraftKind(LAYOUT, "draft-eagle3", ARCH, check_head, converter_config, check_gguf)

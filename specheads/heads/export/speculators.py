"""EAGLE-3 heads in the `speculators` layout, written and read back. Consumers: speculators' Eagle3DraftModel
(speculators models/eagle3/config.py and core.py: Eagle3SpeculatorConfig, loaded by SpeculatorModel.from_pretrained)
and vLLM, which serves it through its speculators-config path (vllm/transformers_utils/configs/speculators/algos.py
update_eagle3, then vllm/model_executor/models/llama_eagle3.py).

speculators_model_type eagle3, transformer_layer_config, speculators_config {verifier, proposal_methods};
fc.weight, layers.0.*, norm.weight, lm_head.weight, embed_tokens.weight (the target's: speculators reads the
checkpoint's, export/common.py target_embedding) [, d2t, t2d when V' < V]. EAGLE-3.1 heads add the config keys
`fc_norm` / `norm_output` (true; absent when off, speculators' default false) and the tensors `fc_norm.{i}.weight`,
i in ascending layer order (models/eagle3/core.py: one RMSNorm per aux state, chunked from the concatenation; the
post-norm state fed to the next TTT step). The format's reader dispatches on speculators_model_type to the
reader each kind's export module registers (export/formats.py register_variant): a dspark / dflash folder is read
by export/dspark.py, a P-EAGLE one (written by export/peagle.py, the kind's KindSpec.writers) by export/peagle.py,
a DFlash2 one by export/dflash2.py.
"""
from __future__ import annotations

from specheads.heads.base import HeadConfig, HeadSpec
from specheads.heads.export.common import (
    SPECULATIVE_TOKENS, native_name, need, speculators_section, speculators_tensors, target_embedding,
)
from specheads.heads.export.eagle3 import (
    SPECULATORS_TYPE, ascending_fc, ascending_fc_norm, eagle3_llama_dict, eagle3_problems, eagle31_config,
    read_eagle3_layer,
)
from specheads.heads.export.formats import Format, register_format, register_variant, variants
from specheads.utils import SpecheadsError


def write_speculators(cfg: HeadConfig, sd: dict, expected: list[str], verifier: str = "",
                      speculative_tokens: int = SPECULATIVE_TOKENS, target=None, where: str = "the head",
                      **_) -> tuple[dict, dict, list[str]]:
    embed = target_embedding(cfg, sd, target, "speculators", where)
    layer = eagle3_llama_dict(cfg)
    layer.pop("architectures", None)
    ids, fc = ascending_fc(cfg, sd)
    config = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": SPECULATORS_TYPE,
        "transformer_layer_config": layer, "draft_vocab_size": cfg.out_vocab, "norm_before_residual": False,
        "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": ids,
        "speculators_config": speculators_section(SPECULATORS_TYPE, speculative_tokens, verifier, cfg.target_config),
        **eagle31_config(cfg),  # EAGLE-3.1: fc_norm / norm_output true where the head has them
    }
    tensors, required = speculators_tensors(cfg, sd, expected, fc, embed)
    norms = ascending_fc_norm(cfg, sd)  # speculators' fc_norm ModuleList chunks the aux states in layer order
    tensors.update(norms)
    required += list(norms)
    return config, tensors, required


def read_speculators(config: dict, sd: dict, target, where: str, w: str) -> tuple[HeadSpec, dict]:
    """A speculators folder, read by the reader its speculators_model_type registered (export/formats.py
    variants: EAGLE-3 here, P-EAGLE in export/peagle.py, dspark / dflash in export/dspark.py, DFlash2 in
    export/dflash2.py)."""
    own, model_type = variants("speculators"), need(config, "speculators_model_type", where)
    if model_type not in own:
        raise SpecheadsError(f"{where}: speculators_model_type {model_type!r}: only {list(own)} speculators are "
                             "imported")
    return own[model_type](config, sd, target, where, w)


def read_eagle3_speculators(config: dict, sd: dict, target, where: str, w: str) -> tuple[HeadSpec, dict]:
    """An EAGLE-3 speculators folder (layers.0. read as our midlayer.)."""
    layer = need(config, "transformer_layer_config", where)
    sd = {native_name(k): v for k, v in sd.items()}
    if any(k.startswith("layers.") for k in sd):
        raise SpecheadsError(f"{w}: more than one decoder layer; specheads EAGLE-3 heads have one")
    return read_eagle3_layer(config, layer, sd, target, where, w)


register_variant("speculators", SPECULATORS_TYPE, read_eagle3_speculators)
SPECULATORS = register_format(Format(
    "speculators", rank=40, writer=write_speculators, reader=read_speculators,
    detect=lambda config: "speculators_model_type" in config, detect_rank=10,
    loaders={"speculators": "speculators' Eagle3DraftModel",
             "vllm": "vLLM's speculators path (Eagle3LlamaForCausalLM)"},
    problems=eagle3_problems))

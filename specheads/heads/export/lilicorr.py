"""LiLiCorr heads (heads/lilicorr.py) in the `modelopt` layout, written and read back: the DFlash draft checkpoint
NVIDIA Model-Optimizer exports for a LiLiCorr drafter (its DFlashExporter with projector_type lilicorr), which vLLM,
SGLang and TensorRT-LLM load as a DFlash drafter whose `architectures` is [LiLiCorrDraftModel].

The loaders read (checked in the public index, commits as stored there):
- vLLM vllm/model_executor/models/lilicorr.py @ 08f95fe5616661c4f8547a46ebdaa1ed22736edb (LiLiCorr over
  DFlashQwen3Model, LiLiCorrForCausalLM.load_weights): dflash_config.lilicorr_{hidden_size, candidate_topk (a power
  of two <= 16), num_heads, mlp_ratio, factor_dim, vector_eps, logit_scale, num_layers} read as config[...] (no
  defaults), lilicorr_enabled (default true), block_size (dflash_config's, else the top level; 1 <=
  num_speculative_tokens < block_size), conv_kernel_size / conv_group_size (default 0: no DFlash2 convolutions),
  rms_norm_eps (the lattice norms), has_own_lm_head (default false: the target's lm_head), no draft vocabulary
  (draft_id_to_target_id must be None). Tensors: `lilicorr.` stripped and loaded by the head's own parameter names
  (AutoWeightsLoader), every one required: feature_norm (LayerNorm(5)), feature_mlp.up_proj / down_proj and
  layers.{i}.mlp.up_proj / down_proj (NemotronHMLP, bias), the rest as ModelOpt names them.
- SGLang python/sglang/srt/models/lilicorr.py @ 085551a8ab14ae3bc807c5104c92436b1845f04d (LiLiCorrDraftModel over
  DFlashDraftModel) with srt/speculative/lilicorr_components/lilicorr_config.py (parse_lilicorr_draft_config):
  every lilicorr_* key required, candidate_topk a power of two <= MAX_FUSED_CANDIDATE_TOPK (16), lilicorr_enabled
  false = no head; load_weights renames ModelOpt's nn.Sequential indices (feature_mlp.0 -> feature_norm,
  feature_mlp.1 / .3 -> up_proj / down_proj, mlp.0 / .2 -> up_proj / down_proj) and refuses a missing or an
  unexpected lilicorr.* tensor (check_head_weight_coverage).
- TensorRT-LLM tensorrt_llm/_torch/models/modeling_lilicorr.py (index commit 8d62b3e5f164c4b5e36732d8b1a40340d6487ea2,
  LiLiCorrForCausalLM over DFlashForCausalLM): the same eight lilicorr_* keys required, block_size required, a
  causal draft refused; _normalize_lilicorr_weights reads the Sequential and the named-MLP spellings alike.
- ModelOpt modelopt/torch/speculative/plugins/modeling_lilicorr.py @ 33d8c76daa5c64021256c49ba2c855e2f54375a1 (the
  head, the names ours follow) and tests/unit/.../test_hf_lilicorr.py (TestLiLiCorrExporter: architectures
  [LiLiCorrDraftModel], dflash_config {projector_type lilicorr, lilicorr_enabled true, the eight lilicorr_* keys,
  mask_token_id, target_layer_ids}, the head under `lilicorr.*`, the DFlash backbone unprefixed).

Written: the DFlash config of export/dspark.py's SpecForge layout (model_type qwen3, the target's sizes,
num_hidden_layers, block_size, num_target_layers, dflash_config.target_layer_ids in z-lab's convention = ours - 1,
mask_token_id) with architectures [LiLiCorrDraftModel], dflash_config.projector_type lilicorr, lilicorr_enabled true
and the eight lilicorr_* keys (lilicorr_hidden_size resolved: H, as ModelOpt writes it); tensors: ours, the
backbone unchanged, the lattice MLPs in the named spelling every engine above reads (vLLM's reads no other), shapes
unchanged ([out, in] Linear weights with biases, slot_embedding [1,1,K-1,1,H], rank_embedding [1,1,1,k,H],
relative_slot_bias [heads, 2K-1], attn.in_proj_weight [3H,H]). Not written: conf_temperature / conf_bias (the
DSpark base class's calibration, which LiLiCorr's draft logits never read). What our head has that the engines
cannot carry is refused by check_lilicorr already (a draft vocabulary, Markov / confidence heads, anchor features,
sample_from_anchor true); a candidate_topk other than a power of two <= 16 is refused here for vLLM and SGLang.
"""
from __future__ import annotations

import re

from specheads.heads.base import HeadConfig, HeadSpec
from specheads.heads.export.common import check_dims, need
from specheads.heads.export.dspark import block_tensors, dflash_config
from specheads.heads.export.formats import Format, register_format
from specheads.heads.lilicorr import LiLiCorrOptions
from specheads.utils import SpecheadsError

ARCHITECTURE = "LiLiCorrDraftModel"  # the engines' router: DFlashDraftModel would load the backbone alone
PROJECTOR = "lilicorr"  # dflash_config.projector_type (ModelOpt's, TensorRT-LLM routes on it too)
GEOMETRY = ("candidate_topk", "hidden_size", "num_layers", "num_heads", "mlp_ratio", "factor_dim", "vector_eps",
            "logit_scale")  # dflash_config.lilicorr_<name>: every engine requires all eight
MAX_TOPK = 16  # vLLM's LiLiCorr head and SGLang's MAX_FUSED_CANDIDATE_TOPK: powers of two up to 16
NATIVE_ONLY = ("conf_temperature", "conf_bias")
# ours (ModelOpt's nn.Sequential indices) -> the engines' named MLPs; applied to names under `lilicorr.`
_TO_ENGINE = ((r"^lilicorr\.feature_mlp\.0\.", "lilicorr.feature_norm."),
              (r"^lilicorr\.feature_mlp\.1\.", "lilicorr.feature_mlp.up_proj."),
              (r"^lilicorr\.feature_mlp\.3\.", "lilicorr.feature_mlp.down_proj."),
              (r"^(lilicorr\.layers\.\d+)\.mlp\.0\.", r"\1.mlp.up_proj."),
              (r"^(lilicorr\.layers\.\d+)\.mlp\.2\.", r"\1.mlp.down_proj."))
_TO_OURS = ((r"^lilicorr\.feature_norm\.", "lilicorr.feature_mlp.0."),
            (r"^lilicorr\.feature_mlp\.up_proj\.", "lilicorr.feature_mlp.1."),
            (r"^lilicorr\.feature_mlp\.down_proj\.", "lilicorr.feature_mlp.3."),
            (r"^(lilicorr\.layers\.\d+)\.mlp\.up_proj\.", r"\1.mlp.0."),
            (r"^(lilicorr\.layers\.\d+)\.mlp\.down_proj\.", r"\1.mlp.2."))
LOADERS = {"vllm": "vLLM's LiLiCorrForCausalLM", "sglang": "SGLang's LiLiCorrDraftModel",
           "tensorrt-llm": "TensorRT-LLM's LiLiCorrForCausalLM"}


def _rename(name: str, rules) -> str:
    for pattern, repl in rules:
        name, n = re.subn(pattern, repl, name)
        if n:
            break
    return name


def engine_name(name: str) -> str:
    """Our tensor name -> the one the engines load (the lattice MLPs named; everything else unchanged)."""
    return _rename(name, _TO_ENGINE)


def native_name(name: str) -> str:
    """An engine's tensor name (named or ModelOpt's Sequential spelling) -> ours."""
    return _rename(name, _TO_OURS)


def modelopt_config(cfg: HeadConfig) -> dict:
    """config.json: ModelOpt's DFlash export of a LiLiCorr drafter (module docstring)."""
    o = cfg.head_spec.options
    lattice = {f"lilicorr_{k}": getattr(o, k) for k in GEOMETRY}
    lattice["lilicorr_hidden_size"] = o.hidden_size or cfg.hidden_size
    config = dflash_config(cfg, ARCHITECTURE)
    config["dflash_config"].update(projector_type=PROJECTOR, lilicorr_enabled=True, **lattice)
    return config


def write_modelopt(cfg: HeadConfig, sd: dict, expected: list[str], **_) -> tuple[dict, dict, list[str]]:
    """The modelopt writer of a LiLiCorr head (its KindSpec.writers): the config above, our tensors with the
    lattice MLPs under the engines' names, the calibration left out."""
    tensors = {engine_name(k): v for k, v in sd.items() if k not in NATIVE_ONLY}
    required = [engine_name(k) for k in expected if k not in NATIVE_ONLY]
    return modelopt_config(cfg), tensors, required


def modelopt_problems(fmt: str, consumer: str, cfg: HeadConfig) -> list[str]:
    """Why `consumer` cannot serve this LiLiCorr head: vLLM and SGLang take powers of two up to 16 candidates."""
    k = cfg.head_spec.options.candidate_topk
    if consumer in ("vllm", "sglang") and (k > MAX_TOPK or k & (k - 1)):
        return [f"{cfg.head_spec.key('candidate_topk')} {k}: its LiLiCorr head takes a power of two up to "
                f"{MAX_TOPK} candidates"]
    return []


def modelopt_spec(config: dict, target, where: str) -> HeadSpec:
    """A ModelOpt LiLiCorr config -> a lilicorr HeadSpec; every lilicorr_* key required (as the engines do)."""
    dfc = need(config, "dflash_config", where)
    check_dims(config, target, where)
    if not dfc.get("lilicorr_enabled", True):
        raise SpecheadsError(f"{where}: dflash_config.lilicorr_enabled false: a DFlash drafter without its "
                             "LiLiCorr head, which specheads does not import")
    missing = [f"lilicorr_{k}" for k in GEOMETRY if f"lilicorr_{k}" not in dfc]
    if missing:
        raise SpecheadsError(f"{where}: dflash_config lacks {', '.join(missing)} (every LiLiCorr loader needs them)")
    for key in ("conv_kernel_size", "conv_group_size"):
        if dfc.get(key):
            raise SpecheadsError(f"{where}: dflash_config.{key} {dfc[key]}: ModelOpt's DFlash2 convolutions, "
                                 "which specheads' LiLiCorr head does not build")
    lattice = {k: type(getattr(LiLiCorrOptions, k))(dfc[f"lilicorr_{k}"]) for k in GEOMETRY}
    if lattice["hidden_size"] == target.hidden_size:
        lattice["hidden_size"] = 0  # ours: 0 = the target's width (no token_proj either way)
    options = LiLiCorrOptions(block_size=int(need(config, "block_size", where)), markov_rank=0,
                              confidence_head=False, sample_from_anchor=False,
                              **lattice)
    return HeadSpec(kind=PROJECTOR, num_layers=int(need(config, "num_hidden_layers", where)),
                    feature_layers=[i + 1 for i in need(dfc, "target_layer_ids", where)],
                    mask_token_id=dfc.get("mask_token_id"), options=options)


def read_modelopt(config: dict, sd: dict, target, where: str, w: str) -> tuple[HeadSpec, dict]:
    """A ModelOpt LiLiCorr folder -> (HeadSpec, native state dict); either MLP spelling is read."""
    spec = modelopt_spec(config, target, where)
    return block_tensors(spec, {native_name(k): v for k, v in sd.items()}, target, w,
                         ("lilicorr.slot_embedding", "lilicorr.out_head.weight"))


def _is_modelopt(config: dict) -> bool:
    return ARCHITECTURE in (config.get("architectures") or []) or \
        (config.get("dflash_config") or {}).get("projector_type") == PROJECTOR


MODELOPT = register_format(Format(
    "modelopt", rank=65, reader=read_modelopt, detect=_is_modelopt, detect_rank=15, loaders=LOADERS,
    problems=modelopt_problems))  # written by the LiLiCorr kind's writer (KindSpec.writers)

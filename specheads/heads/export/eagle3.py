"""EAGLE-3 heads in the `eagle3` layout, written and read back. Consumers: SGLang's LlamaForCausalLMEagle3
(python/sglang/srt/models/llama_eagle3.py), vLLM's Eagle3LlamaForCausalLM (vllm/model_executor/models/
llama_eagle3.py), llama.cpp's EAGLE-3 converter (convert_hf_to_gguf.py; heads/gguf.py runs it) and, opt-in, the
EAGLE-3 repo's model (SafeAILab/EAGLE eagle/model/cnets.py).

Llama config + draft_vocab_size; aux layer ids both top level (`eagle_aux_hidden_state_layer_ids`, our
hidden-states index: vLLM and llama.cpp) and nested (`eagle_config`, ours minus one: SGLang); fc.weight,
midlayer.*, norm.weight, lm_head.weight, d2t (offsets), t2d. The fc and layer helpers here serve the speculators
EAGLE-3 layout too (export/speculators.py). EAGLE-3.1's `fc_norm` / `norm_output` are written and read at the top
level (as speculators, SGLang >= 0.5.23 and vLLM >= 0.34 name them), fc_norm.{i}.weight in ascending layer order;
llama.cpp and the EAGLE-3 repo build neither and are refused for such a head (eagle31_problems).
"""
from __future__ import annotations

import torch

from specheads.heads.base import HeadConfig, HeadSpec
from specheads.heads.eagle3 import EAGLE31_SWITCHES, eagle31_switches, eagle3_layer_config
from specheads.heads.export.common import (
    absolute_d2t, check_dims, check_keys, d2t_offsets, drop_zero_attention_biases, legacy_rope_keys, t2d_of,
    zero_attention_biases,
)
from specheads.heads.export.formats import Format, register_format
from specheads.utils import SpecheadsError

SPECULATORS_TYPE = "eagle3"  # speculators_model_type of an EAGLE-3 head (export/speculators.py)


def eagle3_llama_dict(cfg: HeadConfig) -> dict:
    """The head's one-layer Llama config as a plain dict, legacy RoPE keys added."""
    d = eagle3_layer_config(cfg.target_config, cfg.vocab_size).to_dict()
    for k in ("transformers_version", "_name_or_path", "output_hidden_states", "return_dict", "id2label", "label2id"):
        d.pop(k, None)
    return legacy_rope_keys(d)


def _vocab_maps(cfg: HeadConfig, sd: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t offsets [V'], t2d [V] bool) for EAGLE-3 layouts; identity maps without a draft vocab."""
    if cfg.draft_vocab_size:
        return d2t_offsets(sd["d2t"]), sd["t2d"].to(torch.bool)
    return torch.zeros(cfg.vocab_size, dtype=torch.int64), torch.ones(cfg.vocab_size, dtype=torch.bool)


def _ascending(cfg: HeadConfig) -> list[int]:
    """Positions of the feature layers in config order, sorted by layer id (the consumers' order)."""
    ids = list(cfg.feature_layers)
    return sorted(range(len(ids)), key=lambda j: ids[j])


def ascending_fc(cfg: HeadConfig, sd: dict) -> tuple[list[int], torch.Tensor]:
    """Consumers concatenate the aux states in layer order; our fc [D, F*D] (F feature layers) reads them in
    config order. Returns (ids ascending, fc.weight with its column blocks in that order): the same function of the
    same states."""
    order, w, D = _ascending(cfg), sd["fc.weight"], cfg.hidden_size
    return [cfg.feature_layers[j] for j in order], torch.cat([w[:, j * D:(j + 1) * D] for j in order], dim=1)


def ascending_fc_norm(cfg: HeadConfig, sd: dict) -> dict:
    """EAGLE-3.1's per-layer norms `fc_norm.{i}.weight` [D] renumbered in the consumers' ascending layer order (as
    ascending_fc reorders fc's blocks); empty without fc_norm."""
    if not cfg.head_spec.options.fc_norm:
        return {}
    return {f"fc_norm.{i}.weight": sd[f"fc_norm.{j}.weight"] for i, j in enumerate(_ascending(cfg))}


def eagle31_config(cfg: HeadConfig) -> dict:
    """The EAGLE-3.1 keys of speculators' Eagle3SpeculatorConfig, only those turned on (a plain EAGLE-3 export
    stays as it was)."""
    return {name: True for name in eagle31_switches(cfg.head_spec)}


def eagle31_problems(fmt: str, consumer: str, cfg: HeadConfig) -> list[str]:
    """Why `consumer` of `fmt` cannot read an EAGLE-3.1 head (empty for plain EAGLE-3). speculators' Eagle3DraftModel
    builds both switches; so do SGLang >= 0.5.23 (llama_eagle3.py: fc_norm / norm_output read from the config, one
    RMSNorm per captured state, the post-norm state handed on) and vLLM >= 0.34 (llama_eagle3.py the same, and
    speculators/algos.py update_eagle3 passes both keys on); llama.cpp's converter and the EAGLE-3 repo build
    neither."""
    on = eagle31_switches(cfg.head_spec)
    if not on or consumer in ("speculators", "sglang", "vllm"):
        return []
    why = {"llama.cpp": "llama.cpp's converter and eagle3 graph (0c1e570) have neither",
           "eagle-repo": "the EAGLE-3 repo's model (cnets.py) builds neither"}
    return [f"this head is EAGLE-3.1 ({', '.join('head.' + n for n in on)}): "
            + why.get(consumer, "its model is plain EAGLE-3")]


def write_eagle3(cfg: HeadConfig, sd: dict, expected: list[str], where: str = "the head",
                 **_) -> tuple[dict, dict, list[str]]:
    """SGLang (llama_eagle3.py: fc bias and o_proj bias from `bias`, aux ids nested, ours minus one), vLLM and
    llama.cpp (top-level aux ids, ours), the EAGLE-3 repo (hardcoded layers). No target_hidden_size: the EAGLE-3
    repo loads the target's embedding only without it (cnets.py). EAGLE-3.1: the top-level keys fc_norm /
    norm_output and fc_norm.{i}.weight in ascending layer order, as SGLang >= 0.5.23 and vLLM >= 0.34 read them
    (export/consumers.py refuses the consumers that cannot)."""
    b = cfg.head_spec.resolved_bias()
    ids, fc = ascending_fc(cfg, sd)
    config = eagle3_llama_dict(cfg)
    config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=cfg.out_vocab, bias=b,
                  attention_bias=False, eagle_aux_hidden_state_layer_ids=ids,
                  eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids], "use_aux_hidden_state": True},
                  **eagle31_config(cfg))
    d2t, t2d = _vocab_maps(cfg, sd)
    tensors = {k: v for k, v in sd.items() if k not in ("d2t", "t2d") and not k.startswith("fc_norm.")}
    tensors.update({"fc.weight": fc, "d2t": d2t, "t2d": t2d})
    norms = ascending_fc_norm(cfg, sd)
    tensors.update(norms)
    if b:  # SGLang reads `bias` as the o_proj bias too (qkv is rebuilt without one)
        tensors.update(zero_attention_biases(sd, "midlayer.", ("o",)))
    required = ["fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"] + list(norms) + \
        [k for k in expected if k.startswith("midlayer.")]
    return config, tensors, required


def _eagle3_ids(config: dict, L: int, where: str) -> list[int]:
    """Aux ids in our convention: top level (vLLM / llama.cpp: ours), else eagle_config (SGLang: ours - 1), else
    the engines' default [2, L // 2, L - 3]."""
    top = config.get("eagle_aux_hidden_state_layer_ids")
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if top and nested and [i + 1 for i in nested] != list(top):
        raise SpecheadsError(f"{where}: eagle_aux_hidden_state_layer_ids {top} and "
                             f"eagle_config.eagle_aux_hidden_state_layer_ids {nested} (SGLang's ids, ours minus one) "
                             "name different layers")
    if top:
        return list(top)
    return [i + 1 for i in nested] if nested else [2, L // 2, L - 3]


def read_eagle3_layer(config: dict, layer: dict, sd: dict, target, where: str, w: str) -> tuple[HeadSpec, dict]:
    """(HeadSpec, native state dict) of an EAGLE-3 folder: `layer` is the config holding the midlayer's sizes
    (the top level for `eagle3`, transformer_layer_config for speculators), `sd` named with `midlayer.`."""
    check_dims(layer, target, where)
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise SpecheadsError(f"{where}: num_hidden_layers {layer['num_hidden_layers']}: one midlayer supported")
    ids = _eagle3_ids(config, target.num_layers, where)
    sd = drop_zero_attention_biases(sd, w)
    dv = int(config.get("draft_vocab_size") or target.vocab_size)
    switches = {name: bool(config.get(name, False)) for name in EAGLE31_SWITCHES}  # speculators' keys, EAGLE-3.1
    spec = HeadSpec(kind="eagle3", feature_layers=ids, bias="fc.bias" in sd,
                    draft_vocab_size=dv if dv < target.vocab_size else None, **switches)
    check_keys(sd, ["fc.weight", "norm.weight", "lm_head.weight"], w)
    tensors = {k: v for k, v in sd.items() if k not in ("d2t", "t2d")}
    if dv < target.vocab_size:
        check_keys(sd, ["d2t"], w)
        tensors["d2t"] = absolute_d2t(sd["d2t"], sd.get("t2d"), w)
        tensors["t2d"] = t2d_of(tensors["d2t"], target.vocab_size)
    return spec, tensors


def read_eagle3(config: dict, sd: dict, target, where: str, w: str) -> tuple[HeadSpec, dict]:
    return read_eagle3_layer(config, config, sd, target, where, w)


def eagle3_problems(fmt: str, consumer: str, cfg: HeadConfig) -> list[str]:
    """Why `consumer` cannot read an EAGLE-3 head exported as `fmt` (eagle3, or the EAGLE-3 speculators layout):
    the EAGLE-3.1 switches it does not build, an fc bias (SGLang's fc alone has one), feature layers it cannot
    feed."""
    out = eagle31_problems(fmt, consumer, cfg)  # llama.cpp and the EAGLE-3 repo build no EAGLE-3.1 switch
    if cfg.head_spec.resolved_bias() and consumer != "sglang":
        out.append("its fc has no bias and this head was trained with one (head.bias true)")
    return out + _layer_problems(consumer, list(cfg.feature_layers), int(cfg.target_config["num_hidden_layers"]))


def _layer_problems(consumer: str, ids: list[int], L: int) -> list[str]:
    """EAGLE-3 feature layers a consumer cannot feed. Engines capture the input of decoder layer i (residual
    included) for each configured i, in layer order: ascending, once per layer. Unsorted ids are fine (export
    reorders fc's blocks to the ascending order); the rest is not."""
    out = []
    if len(set(ids)) < len(ids):
        out.append(f"it captures each target layer once, so the repeated feature layers {ids} cannot be fed")
    if consumer != "speculators" and len(ids) != 3:
        out.append(f"it builds fc for exactly 3 feature layers and this head reads {len(ids)} ({ids})")
    if L in ids:
        out.append(f"layer id {L} is our final post-norm state, which "
                   + ("speculators reads as the last layer's pre-norm output" if consumer == "speculators"
                      else "it never captures (it captures the inputs of layers 0..L-1)"))
    if consumer in ("sglang", "vllm") and 0 in ids:
        out.append("layer id 0 (the embeddings) is not captured: it adds the residual, which layer 0 has not got")
    if consumer == "eagle-repo" and sorted(set(ids)) != sorted({2, L // 2, L - 3}):
        out.append(f"it captures the hardcoded layers 2, L // 2, L - 3 = {sorted({2, L // 2, L - 3})} of the "
                   f"target, not {ids}")
    return out


def _is_eagle3(config: dict) -> bool:
    archs = config.get("architectures") or []
    return "Eagle3" in " ".join(archs) or "draft_vocab_size" in config or "eagle_config" in config


EAGLE3 = register_format(Format(
    "eagle3", rank=30, writer=write_eagle3, reader=read_eagle3, detect=_is_eagle3, detect_rank=60,
    loaders={"sglang": "SGLang's LlamaForCausalLMEagle3", "vllm": "vLLM's Eagle3LlamaForCausalLM",
             "llama.cpp": "llama.cpp's EAGLE-3 converter", "eagle-repo": "the EAGLE-3 repo's model"},
    opt_in=("eagle-repo",),  # checked only when named: the repo captures hardcoded layers, no config ids
    problems=eagle3_problems, repo_rope=True))

"""EAGLE-1 heads in the layouts of their two consumer families, written and read back.

- `eagle`: SGLang's LlamaForCausalLMEagle (python/sglang/srt/models/llama_eagle.py, its layers from llama.py) and
  the EAGLE repo's EAGLE-1 model (SafeAILab/EAGLE eagle/model/cnets1.py, loaded by ea_model.py). The target's
  config with num_hidden_layers = n, rope_theta; fc.weight, fc.bias, layers.{i}.* (no layer-0 input norm, no
  lm_head). Config key `bias` means the fc bias in the EAGLE repo and the attention bias in SGLang (whose fc always
  has one): fc.bias is always written (zeros for a head without one) and, with `bias` true, zero q/k/v/o biases,
  so both read the head exactly.
- `eagle-vllm`: vLLM's EagleLlamaForCausalLM (vllm/model_executor/models/llama_eagle.py, its layers from
  llama.py). vLLM builds the fc without bias and reads `bias` / `attention_bias` as attention biases: no fc.bias is
  written; a head with an fc bias b has it folded into layer 0's attention (q/k/v bias = W_{q,k,v} b, o bias = b:
  layer 0 has no input norm, so this is the same function).
"""
from __future__ import annotations

import torch

from specheads.heads.base import HeadConfig, HeadSpec
from specheads.heads.export.common import (
    check_dims, drop_zero_attention_biases, legacy_rope_keys, need, zero_attention_biases,
)
from specheads.heads.export.formats import Format, register_format
from specheads.utils import SpecheadsError


def _eagle1_config(cfg: HeadConfig, architecture: str) -> dict:
    """The target's text config as one EAGLE-1 draft: n layers, the consumer's architecture name, legacy keys.
    tie_word_embeddings false whatever the target's: the draft carries neither lm_head nor embedding (the engine
    hands it the target's), and SGLang's LlamaForCausalLMEagle with true makes its lm_head its embed_tokens, so
    set_embed_and_head deletes the one module's weight twice and fails before drafting."""
    d = dict(cfg.target_config)
    for k in ("transformers_version", "_name_or_path", "auto_map", "id2label", "label2id"):
        d.pop(k, None)
    n = cfg.head_spec.num_layers
    if isinstance(d.get("layer_types"), list):
        d["layer_types"] = d["layer_types"][:n]
    d.update(num_hidden_layers=n, architectures=[architecture], tie_word_embeddings=False)
    return legacy_rope_keys(d)


def write_eagle(cfg: HeadConfig, sd: dict, expected: list[str], **_) -> tuple[dict, dict, list[str]]:
    """EAGLE repo + SGLang. `bias`: the EAGLE repo's fc bias (ea_model.py: con["bias"], default true); SGLang's
    attention bias (llama.py: attention_bias or bias), whose fc is nn.Linear(2D, D) with a bias always."""
    b, n = cfg.head_spec.resolved_bias(), cfg.head_spec.num_layers
    config = _eagle1_config(cfg, "LlamaForCausalLMEagle")
    config.update(bias=b, attention_bias=False)
    tensors = {k: v for k, v in sd.items() if k not in ("d2t", "t2d")}
    tensors.setdefault("fc.bias", torch.zeros(cfg.hidden_size, dtype=sd["fc.weight"].dtype))
    if b:
        for i in range(n):
            tensors.update(zero_attention_biases(sd, f"layers.{i}."))
    return config, tensors, ["fc.weight", "fc.bias"] + [k for k in expected if k.startswith("layers.")]


def write_eagle_vllm(cfg: HeadConfig, sd: dict, expected: list[str], **_) -> tuple[dict, dict, list[str]]:
    """vLLM: fc without bias (llama_eagle.py), `bias` / `attention_bias` -> q/k/v and o biases (llama.py). An fc
    bias b is folded into layer 0: g = W x + b enters layer 0 without a norm, so q = W_q W x + W_q b (same for k, v,
    RoPE applied after either way) and the residual carries b, which the o_proj bias adds back."""
    b, n = cfg.head_spec.resolved_bias(), cfg.head_spec.num_layers
    config = _eagle1_config(cfg, "EagleLlamaForCausalLM")
    config.update(bias=b, attention_bias=b, eagle_fc_bias=False)
    tensors = {k: v for k, v in sd.items() if k not in ("d2t", "t2d", "fc.bias")}
    if b:
        for i in range(n):
            tensors.update(zero_attention_biases(sd, f"layers.{i}."))
        fc_b = sd["fc.bias"].double()
        for p in ("q", "k", "v"):
            w = sd[f"layers.0.self_attn.{p}_proj.weight"]
            tensors[f"layers.0.self_attn.{p}_proj.bias"] = (w.double() @ fc_b).to(w.dtype)
        tensors["layers.0.self_attn.o_proj.bias"] = sd["fc.bias"].clone()
    return config, tensors, ["fc.weight"] + [k for k in expected if k.startswith("layers.")]


def read_eagle(config: dict, sd: dict, target, where: str, w: str) -> tuple[HeadSpec, dict]:
    check_dims(config, target, where)
    n = int(need(config, "num_hidden_layers", where))
    tensors = drop_zero_attention_biases(sd, w)
    fc_b = tensors.get("fc.bias")
    if fc_b is not None and config.get("bias") is False and not fc_b.any():
        del tensors["fc.bias"]  # the zero bias `eagle` exports write for SGLang, whose fc always has one
    return HeadSpec(kind="eagle", num_layers=n, bias="fc.bias" in tensors), tensors


def read_eagle_vllm(config: dict, sd: dict, target, where: str, w: str) -> tuple[HeadSpec, dict]:
    """Unfold an fc bias from layer 0's attention biases (see write_eagle_vllm): o bias = b, q/k/v = W b."""
    tensors = dict(sd)
    b = tensors.get("layers.0.self_attn.o_proj.bias")
    if b is not None and b.any():
        for p in ("q", "k", "v"):
            key, wq = f"layers.0.self_attn.{p}_proj.bias", tensors[f"layers.0.self_attn.{p}_proj.weight"]
            want = wq.double() @ b.double()
            tol = 8 * torch.finfo(wq.dtype).eps * float(want.abs().max() + 1e-30)
            if key not in tensors or float((tensors[key].double() - want).abs().max()) > tol:
                raise SpecheadsError(f"{w}: layer 0's attention biases are not an fc bias folded in "
                                     f"({key} != {p}_proj.weight @ o_proj.bias); specheads EAGLE heads have none")
            del tensors[key]
        del tensors["layers.0.self_attn.o_proj.bias"]
        tensors["fc.bias"] = b.clone()
    return read_eagle(config, tensors, target, where, w)


def eagle1_problems(fmt: str, consumer: str, cfg: HeadConfig) -> list[str]:
    """Why an EAGLE-1 consumer cannot read the head: each builds Llama decoder layers only."""
    if cfg.target_config.get("model_type") != "llama":
        return [f"it builds Llama decoder layers and this head's layer is the target's "
                f"{cfg.target_config.get('model_type')!r} layer"]
    return []


def _is_eagle_vllm(config: dict) -> bool:
    return "eagle_fc_bias" in config or "EagleLlamaForCausalLM" in (config.get("architectures") or [])


def _is_eagle(config: dict) -> bool:
    """The plainest layout: any decoder config (detected last)."""
    return "hidden_size" in config and "num_hidden_layers" in config


EAGLE = register_format(Format(
    "eagle", rank=10, writer=write_eagle, reader=read_eagle, detect=_is_eagle, detect_rank=90,
    loaders={"sglang": "SGLang's LlamaForCausalLMEagle", "eagle-repo": "the EAGLE repo's EAGLE-1 model"},
    problems=eagle1_problems, repo_rope=True))
EAGLE_VLLM = register_format(Format(
    "eagle-vllm", rank=20, writer=write_eagle_vllm, reader=read_eagle_vllm, detect=_is_eagle_vllm, detect_rank=50,
    loaders={"vllm": "vLLM's EagleLlamaForCausalLM"}, problems=eagle1_problems))

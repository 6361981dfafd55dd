"""Export a native head folder to the layouts serving engines read, and import those layouts (and the original
research repos' checkpoints) back. Safetensors only: nothing here unpickles a file.

Formats (consumer: config; keys):
- native (specheads): HeadConfig; our state dict.
- eagle (EAGLE-1 repo; SGLang / vLLM EAGLE): the target's config with num_hidden_layers = n;
  fc.weight [, fc.bias], layers.{i}.* (no layers.0.input_layernorm, no lm_head).
- eagle3 (SGLang LlamaForCausalLMEagle3, EAGLE-3 repo): Llama config + draft_vocab_size +
  eagle_config.eagle_aux_hidden_state_layer_ids; fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t, t2d.
- speculators (vLLM via speculators' Eagle3Speculator): speculators_model_type, transformer_layer_config,
  speculators_config {...}; fc.weight, layers.0.*, norm.weight, lm_head.weight [, d2t, t2d when V' < V].
- medusa-vllm (vLLM MedusaModel): model_type medusa, num_heads, num_hidden_layers, truncated_vocab_size, ...;
  blocks.{h}.layers.{l}.weight/bias, lm_heads.{h}.weight [, token_map].
- speculators, dspark head (vLLM via speculators' DSparkDraftModel / DFlashDraftModel): speculators_model_type
  dspark (dflash when markov_rank 0 and no confidence head), transformer_layer_config (Qwen3), block_size,
  aux_hidden_state_layer_ids, mask_token_id, sample_from_anchor, markov_* / *confidence_head*;
  fc, hidden_norm, layers.{i}.*, norm, markov_head.*, confidence_head.proj.* [, lm_head, d2t, t2d when V' < V].
- specforge (SpecForge DFlashDraftModel / DSparkDraftModel; SGLang's DFlash loader): a flat Qwen3 config +
  block_size, num_target_layers, dflash_config {target_layer_ids (ours - 1), mask_token_id}, DSpark fields; the
  same tensors, full vocabulary only (SpecForge drafts through the target's lm_head).

Conventions at the border (checked against the consumers' loaders):
- d2t: SGLang / EAGLE-3 / speculators store offsets, target id = i + d2t[i] (SGLang llama_eagle3.py load_weights);
  we hold absolute ids. vLLM Medusa's `token_map` holds absolute ids.
- Aux layer ids: SGLang's `eagle_aux_hidden_state_layer_ids` are our hidden_states-tuple ids minus one (SGLang
  captures the input of layer id+1); vLLM / speculators use the tuple ids unchanged (id j = output of layer j-1).
- vLLM Medusa reads `medusa_fc_bias` (default false) and `truncated_vocab_size` with `token_map`.
Imports also accept FasterDecoding Medusa checkpoints (`medusa_head.{h}.{l}.linear.*`, config medusa_num_heads /
medusa_num_layers) and EAGLE-1 / EAGLE-3 repo folders (same layouts as `eagle` / `eagle3`).
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

FORMATS = ("native", "eagle", "eagle3", "speculators", "medusa-vllm", "specforge")
KIND_OF_FORMAT = {"eagle": "eagle", "eagle3": "eagle3", "speculators": "eagle3", "medusa-vllm": "medusa",
                  "specforge": "dspark"}
BLOCK_FORMATS = ("speculators", "specforge")  # the formats a dspark head exports to (speculators: dspark / dflash)
BLOCK_TYPES = ("dspark", "dflash")  # speculators_model_type values imported as a dspark head
SPECULATIVE_TOKENS = 3  # speculators' greedy proposal default (its EAGLE-3 converter writes 3)
HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}  # our aliases -> the id serving engines load
_SKIP_ON_IMPORT = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")  # target's, not ours


def _check_keys(tensors: dict, required: list[str], where: str) -> None:
    for k in required:
        if k not in tensors:
            raise SpecheadsError(f"{where}: missing key {k!r}")


def _eagle3_llama_dict(cfg: HeadConfig) -> dict:
    from specheads.heads.eagle3 import eagle3_layer_config

    d = eagle3_layer_config(cfg.target_config, cfg.vocab_size).to_dict()
    rope = d.get("rope_parameters") or {}
    d["rope_theta"] = rope.get("rope_theta", cfg.target_config.get("rope_theta", 10000.0))  # older readers
    for k in ("transformers_version", "_name_or_path", "output_hidden_states", "return_dict", "id2label", "label2id"):
        d.pop(k, None)
    return d


def _offsets(d2t: torch.Tensor) -> torch.Tensor:
    return (d2t - torch.arange(d2t.numel(), dtype=d2t.dtype)).to(torch.int64)


def _vocab_maps(cfg: HeadConfig, sd: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t offsets [V'], t2d [V] bool) for EAGLE-3 layouts; identity maps without a draft vocab."""
    if cfg.draft_vocab_size:
        return _offsets(sd["d2t"]), sd["t2d"].to(torch.bool)
    return torch.zeros(cfg.vocab_size, dtype=torch.int64), torch.ones(cfg.vocab_size, dtype=torch.bool)


def export_head(head_dir: str | Path, fmt: str, out_dir: str | Path, target=None,
                verifier_name_or_path: str | None = None, speculative_tokens: int = SPECULATIVE_TOKENS) -> Path:
    """Write the native head folder `head_dir` in layout `fmt` to `out_dir` (atomically).

    `target` is needed only for medusa-vllm with the shared lm_head (vLLM wants one projection per head).
    `verifier_name_or_path` goes into the speculators config (default: the target name recorded in the head).
    """
    if fmt not in FORMATS:
        raise SpecheadsError(f"--format: {fmt!r} is not one of {list(FORMATS)}")
    head_dir = Path(head_dir)
    cfg = read_head_config(head_dir)
    sd = read_safetensors(head_dir / WEIGHTS_NAME)
    where = str(head_dir / WEIGHTS_NAME)
    if cfg.kind == "dspark" and fmt in BLOCK_FORMATS:
        return export_block_head(cfg, sd, fmt, out_dir, where, verifier_name_or_path)
    if fmt != "native" and KIND_OF_FORMAT[fmt] != cfg.kind:
        raise SpecheadsError(f"--format {fmt}: needs a {KIND_OF_FORMAT[fmt]} head, {head_dir} holds a {cfg.kind} head")
    spec = cfg.head_spec
    # Every key our own head would have must be present (a truncated export is worse than none).
    expected = list(head_class(cfg.kind)(cfg).state_dict())  # built on CPU: small next to the checkpoint itself
    _check_keys(sd, expected, where)

    if fmt == "native":
        config, tensors = cfg.to_dict(), sd
    elif fmt == "eagle":
        config = dict(cfg.target_config)
        config.update(num_hidden_layers=spec.num_layers, bias=spec.resolved_bias(),
                      architectures=config.get("architectures") or ["LlamaForCausalLM"])
        config.pop("transformers_version", None)
        tensors = {k: v for k, v in sd.items() if k not in ("d2t", "t2d")}
        required = ["fc.weight"] + (["fc.bias"] if spec.resolved_bias() else []) + \
            [k for k in expected if k.startswith("layers.")]
    elif fmt == "eagle3":
        config = _eagle3_llama_dict(cfg)
        config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=cfg.out_vocab,
                      bias=spec.resolved_bias(), eagle_config={
                          "eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.feature_layers],
                          "use_aux_hidden_state": True})
        d2t, t2d = _vocab_maps(cfg, sd)
        tensors = {k: v for k, v in sd.items() if k not in ("d2t", "t2d")}
        tensors.update(d2t=d2t, t2d=t2d)
        required = ["fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"] + \
            [k for k in expected if k.startswith("midlayer.")]
    elif fmt == "speculators":
        if spec.resolved_bias():
            raise SpecheadsError(f"--format speculators: {head_dir} has an fc bias; speculators' Eagle3 fc has none")
        if len(set(cfg.feature_layers)) != len(cfg.feature_layers):
            raise SpecheadsError(f"--format speculators: {head_dir} reads feature layers {cfg.feature_layers}; "
                                 "speculators requires distinct ids")
        layer = _eagle3_llama_dict(cfg)
        layer.pop("architectures", None)
        verifier = verifier_name_or_path or HUB_IDS.get(cfg.target_name, cfg.target_name)
        config = {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "transformer_layer_config": layer, "draft_vocab_size": cfg.out_vocab, "norm_before_residual": False,
            "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": list(cfg.feature_layers),
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens)}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier,
                             "architectures": cfg.target_config.get("architectures") or ["LlamaForCausalLM"]}},
        }
        tensors = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
                   for k, v in sd.items() if k not in ("d2t", "t2d")}
        required = ["fc.weight", "norm.weight", "lm_head.weight"] + \
            ["layers.0." + k[len("midlayer."):] for k in expected if k.startswith("midlayer.")]
        if cfg.draft_vocab_size:  # speculators registers d2t/t2d only when V' < V
            tensors.update(d2t=_offsets(sd["d2t"]), t2d=sd["t2d"].to(torch.bool))
            required += ["d2t", "t2d"]
    else:  # medusa-vllm
        K, n = spec.num_heads, spec.num_layers
        config = {"architectures": ["MedusaModel"], "model_type": "medusa", "num_heads": K, "num_hidden_layers": n,
                  "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "truncated_vocab_size": cfg.out_vocab,
                  "medusa_fc_bias": spec.resolved_bias(), "original_lm_head": False}
        tensors = {k: v for k, v in sd.items() if k.startswith("blocks.")}
        if spec.medusa_lm_head == "shared":
            if target is None:
                raise SpecheadsError("--format medusa-vllm: this head shares the target lm_head; give --target so "
                                     "its rows can be written as the per-head projections vLLM reads")
            check_target(cfg, target, str(head_dir))
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
    if fmt != "native":
        _check_keys(tensors, required, f"export {fmt}")
    with atomic_dir(out_dir) as tmp:
        atomic_write_json(tmp / CONFIG_NAME, config)
        write_safetensors(tensors, tmp / WEIGHTS_NAME, metadata={"format": "pt"})
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
    archs = " ".join(config.get("architectures") or [])
    if "Eagle3" in archs or "draft_vocab_size" in config or "eagle_config" in config:
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
    wpath = _weights_file(src)
    sd = {k: v for k, v in read_safetensors(wpath).items() if k not in _SKIP_ON_IMPORT}
    where, w = str(cpath), str(wpath)
    L = target.num_layers

    if fmt == "specforge" or fmt == "speculators" and config.get("speculators_model_type") in BLOCK_TYPES:
        spec, tensors = import_block_tensors(fmt, config, sd, target, where, w)
    elif fmt == "eagle":
        _check_dims(config, target, where)
        n = int(_need(config, "num_hidden_layers", where))
        spec = HeadSpec(kind="eagle", num_layers=n, bias="fc.bias" in sd)
        tensors = sd
    elif fmt in ("eagle3", "speculators"):
        if fmt == "speculators":
            if config["speculators_model_type"] != "eagle3":
                raise SpecheadsError(f"{where}: speculators_model_type {config['speculators_model_type']!r}: only "
                                     "eagle3 speculators are imported")
            layer = _need(config, "transformer_layer_config", where)
            ids = config.get("eagle_aux_hidden_state_layer_ids")
            sd = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in sd.items()}
            if any(k.startswith("layers.") for k in sd):
                raise SpecheadsError(f"{w}: more than one decoder layer; specheads EAGLE-3 heads have one")
        else:
            layer = config
            aux = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            ids = [i + 1 for i in aux] if aux else None  # SGLang ids are ours minus one
        _check_dims(layer, target, where)
        if int(layer.get("num_hidden_layers", 1)) != 1:
            raise SpecheadsError(f"{where}: num_hidden_layers {layer['num_hidden_layers']}: one midlayer supported")
        ids = list(ids) if ids else [2, L // 2, L - 3]
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
    elif fmt == "medusa-vllm":
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
    elif fmt == "medusa-repo":  # FasterDecoding/Medusa: medusa_head.{h}.{l}.linear.*, medusa_head.{h}.{n}.weight
        if "hidden_size" in config:
            _check_dims(config, target, where)
        K, n = int(_need(config, "medusa_num_heads", where)), int(_need(config, "medusa_num_layers", where))
        spec = HeadSpec(kind="medusa", num_heads=K, num_layers=n, medusa_lm_head="per_head",
                        bias="medusa_head.0.0.linear.bias" in sd)
        tensors = {}
        for k, v in sd.items():
            m = re.fullmatch(r"medusa_head\.(\d+)\.(\d+)\.(linear\.)?(weight|bias)", k)
            if m is None:
                raise SpecheadsError(f"{w}: unexpected key {k!r}")
            h, l, lin, p = int(m[1]), int(m[2]), m[3], m[4]
            if lin:  # each tied repeat becomes its own tensor here: our blocks are distinct
                tensors[f"blocks.{h}.layers.{l}.{p}"] = v.clone()
            elif l == n and p == "weight":
                tensors[f"lm_heads.{h}.weight"] = v
            else:
                raise SpecheadsError(f"{w}: unexpected key {k!r}")
    else:
        raise SpecheadsError(f"--format: {fmt!r} is not one of {list(FORMATS) + ['medusa-repo']}")

    head_cfg = HeadConfig.from_target(spec, target)
    klass = head_class(spec.kind)
    head = klass(head_cfg)
    load_state_checked(head, tensors, Path(w))
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


def export_block_head(cfg: HeadConfig, sd: dict, fmt: str, out_dir, where: str, verifier: str | None) -> Path:
    """A dspark head in speculators' or SpecForge's layout: same tensor names as ours (heads/dspark.py), d2t as
    offsets; the calibration temperatures have no slot in either format and stay in the native folder."""
    from specheads.heads.dspark import DSparkHead

    _check_keys(sd, list(DSparkHead(cfg).state_dict()), where)
    tensors = {k: v for k, v in sd.items() if k not in ("d2t", "t2d", "conf_temperature")}
    if fmt == "speculators":
        config = _speculators_block_config(cfg, verifier)
        if cfg.draft_vocab_size:  # speculators registers d2t/t2d (offsets) and keeps lm_head only when V' < V
            tensors.update(d2t=_offsets(sd["d2t"]), t2d=sd["t2d"].to(torch.bool))
    else:
        config = _specforge_block_config(cfg, where)
    with atomic_dir(out_dir) as tmp:
        atomic_write_json(tmp / CONFIG_NAME, config)
        write_safetensors(tensors, tmp / WEIGHTS_NAME, metadata={"format": "pt"})
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
    tensors["conf_temperature"] = torch.ones(spec.num_drafts)  # uncalibrated: the formats carry no temperatures
    return spec, tensors

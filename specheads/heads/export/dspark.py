"""DSpark / DFlash block heads in the layouts of their two consumer families, written and read back.

- `speculators`: speculators' DSparkDraftModel / DFlashDraftModel (speculators models/dspark/config.py and core.py,
  models/dflash/config.py and core.py), which vLLM runs. speculators_model_type dspark (dflash when markov_rank 0
  and no confidence head), transformer_layer_config (Qwen3), block_size, aux_hidden_state_layer_ids,
  mask_token_id, sample_from_anchor, markov_* / *confidence_head*; fc, hidden_norm, layers.{i}.*, norm,
  markov_head.*, confidence_head.proj.* [, lm_head, d2t, t2d when V' < V].
- `specforge`: SpecForge's DFlashDraftModel / DSparkDraftModel (sgl-project/SpecForge
  specforge/modeling/draft/dflash.py, dspark.py) and SGLang's DFlash loader (python/sglang/srt/models/dflash.py):
  a flat Qwen3 config + block_size, num_target_layers, dflash_config {target_layer_ids (ours - 1),
  mask_token_id}, DSpark fields; the same tensors, full vocabulary only (SpecForge drafts through the target's
  lm_head). A Domino head (heads/domino.py) is SpecForge's DominoDraftModel: written through export/domino.py's
  keys (export_block_head's specforge_fields), read back here (dflash_config.projector_type domino), with its
  prefix_gru.weight_ih_l0 / weight_hh_l0 and embed_proj.0 / embed_proj.2 tensors (our names are its names).
Our tensor names are speculators' (heads/dspark.py), so nothing is renamed; d2t is written as offsets.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import torch

from specheads.heads.base import CONFIG_NAME, WEIGHTS_NAME, HeadConfig, HeadSpec, head_class, write_safetensors
from specheads.heads.dspark import block_layer_config
from specheads.heads.export.common import (
    HUB_IDS, absolute_d2t, check_dims, check_keys, d2t_offsets, need, speculators_section, t2d_of,
)
from specheads.heads.export.formats import Format, register_format, register_variant, variants
from specheads.utils import SpecheadsError, atomic_dir, atomic_write_json

log = logging.getLogger(__package__)  # the package's one logger, specheads.heads.export

BLOCK_TYPES = ("dspark", "dflash")  # speculators_model_type values imported as a dspark head
# The loaders of the block formats, as refusals name them.
BLOCK_LOADERS = {"speculators": "speculators' DSparkDraftModel / DFlashDraftModel (and vLLM, which runs it)",
                 "specforge": "SpecForge's DSparkDraftModel / DFlashDraftModel (and SGLang's DFlash loader)"}


def _block_type(spec: HeadSpec) -> str:
    """speculators' name for the head: DFlash is DSpark without its Markov and confidence heads."""
    return "dflash" if spec.options.markov_rank == 0 and not spec.options.confidence_head else "dspark"


def block_layer_dict(cfg: HeadConfig) -> dict:
    d = block_layer_config(cfg.target_config, cfg.head_spec.num_layers, cfg.vocab_size).to_dict()
    for k in ("transformers_version", "_name_or_path", "output_hidden_states",
              "return_dict", "id2label", "label2id", "architectures"):
        d.pop(k, None)
    return d



def dflash_config(cfg: HeadConfig, architecture: str) -> dict:
    """The DFlash draft config every DFlash-family loader reads (SpecForge, SGLang, vLLM, ModelOpt's export): the
    layer dict, `architectures`, block_size, num_target_layers and dflash_config {target_layer_ids in z-lab's
    convention (hidden_states[id + 1]: ours - 1), mask_token_id}; formats add their own keys."""
    config = block_layer_dict(cfg)
    config.update(architectures=[architecture], block_size=cfg.head_spec.options.block_size,
                  num_target_layers=int(cfg.target_config["num_hidden_layers"]),
                  dflash_config={"target_layer_ids": [i - 1 for i in cfg.feature_layers],
                                 "mask_token_id": cfg.head_spec.mask_token_id})
    return config

def _block_head_fields(spec: HeadSpec) -> dict:
    return {"markov_rank": spec.options.markov_rank, "markov_head_type": spec.options.markov_head_type,
            "enable_confidence_head": spec.options.confidence_head,
            "confidence_head_with_markov": spec.options.confidence_head and spec.options.confidence_with_markov}


def _speculators_block_config(cfg: HeadConfig, verifier: str | None) -> dict:
    """DSparkSpeculatorConfig / DFlashSpeculatorConfig fields (speculators models/dflash/config.py,
    models/dspark/config.py); aux ids are hidden_states-tuple ids, ours unchanged (its dflash converter maps the
    z-lab ids by +1)."""
    spec, kind = cfg.head_spec, _block_type(cfg.head_spec)
    config = {
        "architectures": ["DSparkSpeculator" if kind == "dspark" else "DFlashSpeculator"],
        "speculators_model_type": kind, "transformer_layer_config": block_layer_dict(cfg),
        "draft_vocab_size": cfg.out_vocab, "block_size": spec.options.block_size, "target_hidden_size": None,
        "aux_hidden_state_layer_ids": list(cfg.feature_layers), "mask_token_id": spec.mask_token_id,
        "sliding_window_non_causal": False, "sample_from_anchor": spec.options.sample_from_anchor,
        "speculators_config": speculators_section(kind, spec.num_drafts,
                                                  verifier or HUB_IDS.get(cfg.target_name, cfg.target_name),
                                                  cfg.target_config),
    }
    if kind == "dspark":
        config.update(_block_head_fields(spec))
    return config


def _specforge_block_config(cfg: HeadConfig, where: str,
                            own_fields: Callable[[dict, HeadSpec, str], None] | None = None) -> dict:
    """SpecForge's DFlashDraftModel / DSparkDraftModel (specforge/modeling/draft/dflash.py, dspark.py; SpecForge
    0.2.0 = main a6b6b02 there) read a Qwen3 config (model_type qwen3: AutoConfig and SGLang's start-up load it),
    block_size, num_target_layers and dflash_config: target_layer_ids in z-lab's convention (hidden_states[id + 1],
    i.e. ours - 1), mask_token_id and, for DSpark, projector_type dspark, attention_mode (gqa needs fewer kv heads
    than query heads, else mha), markov_rank, markov_head_type, enable_confidence_head, confidence_head_with_markov
    (as its configs/qwen3-8b-dspark.json writes them). The DSpark fields are copied to the top level, where SGLang
    0.5.23's DSparkDraftModel builds its heads from (models/dspark.py build_markov_head: getattr(config,
    "markov_rank")); sample_from_anchor too (SGLang and llama.cpp read it there, default true)."""
    spec = cfg.head_spec
    if cfg.draft_vocab_size:
        raise SpecheadsError(f"--format specforge: {where} drafts over a {cfg.draft_vocab_size}-token draft vocab; "
                             "SpecForge's DFlash / DSpark use the target's full vocabulary "
                             "(head.draft_vocab_size null)")
    kind = _block_type(spec)
    if own_fields is None:  # a kind with fields of its own says its alignment itself (Domino: shift_label true)
        _check_specforge_slots(spec, kind, where)
    config = dflash_config(cfg, "DSparkDraftModel" if kind == "dspark" else "DFlashDraftModel")
    ids = config["dflash_config"]["target_layer_ids"]
    # top-level copies: DeepSpec's Qwen3DSparkModel config keys, and llama.cpp's DSparkModel reads
    # sample_from_anchor here (its default without it is true)
    config.update(target_layer_ids=ids, mask_token_id=spec.mask_token_id,
                  sample_from_anchor=spec.options.sample_from_anchor)
    if kind == "dspark":
        heads, gqa = _block_head_fields(spec), config["num_key_value_heads"] < config["num_attention_heads"]
        config["dflash_config"].update(projector_type="dspark", attention_mode="gqa" if gqa else "mha", **heads)
        config.update(heads)
    if own_fields is not None:
        own_fields(config, spec, where)
    return config


def _check_specforge_slots(spec: HeadSpec, kind: str, where: str) -> None:
    """SpecForge has no sample_from_anchor key: its DSpark trains slot k on x_{p+k+1} (OnlineDSparkModel, labels
    anchor + 1..K: our sample_from_anchor true), its DFlash slot k >= 1 on x_{p+k} (OnlineDFlashModel, the anchor
    slot unsupervised: false). A head aligned the other way would be read one token off: refused."""
    want = kind == "dspark"
    if spec.options.sample_from_anchor != want:
        raise SpecheadsError(
            f"--format specforge: {where} has {spec.key('sample_from_anchor')} "
            f"{str(spec.options.sample_from_anchor).lower()}; "
            f"SpecForge's {'DSpark' if want else 'DFlash'}DraftModel reads slot k as the draft of "
            f"{'x_(p+k+1) (true)' if want else 'x_(p+k), the anchor slot drafting nothing (false)'} and has no key "
            "for the other alignment; export speculators (its sample_from_anchor key) or keep the native folder")


def check_block_exportable(cfg: HeadConfig, flag: str, consumer: str, where: str) -> None:
    """One SpecheadsError naming the consumer when it cannot run this dspark head: the anchor-features variant
    (head.anchor_features) adds W_a c_{p-1} to the anchor slot's input, and the engines build the block's input
    from token embeddings alone ([x_p, m, ..., m]), with no tensor or config key for anchor_proj."""
    if cfg.head_spec.options.anchor_features:
        key = cfg.head_spec.key("anchor_features")
        raise SpecheadsError(f"{flag}: {where}: {consumer} cannot run this head: it was trained with "
                             f"{key} (the anchor slot reads the fused target features of the last "
                             "context row through anchor_proj.weight), and that engine builds the block's input "
                             "from the token embeddings alone; the native folder keeps the head (specheads "
                             f"generate / bench run it), or train one with {key} false for the engines")


def export_block_head(cfg: HeadConfig, sd: dict, fmt: str, out_dir, where: str, verifier: str | None,
                      specforge_fields: Callable[[dict, HeadSpec, str], None] | None = None) -> Path:
    """A dspark head in speculators' or SpecForge's layout: same tensor names as ours (heads/dspark.py), d2t as
    offsets; the calibration (temperatures and biases) has no slot in either format and stays in the native folder.
    specforge_fields(config, spec, where): a block kind's own SpecForge keys, which then say its alignment too
    (Domino: export/domino.py)."""
    check_block_exportable(cfg, f"--format {fmt}", BLOCK_LOADERS[fmt], where)
    check_keys(sd, list(head_class(cfg.kind)(cfg).state_dict()), where)
    tensors = {k: v for k, v in sd.items() if k not in ("d2t", "t2d", "conf_temperature", "conf_bias")}
    if fmt == "speculators":
        config = _speculators_block_config(cfg, verifier)
        if cfg.draft_vocab_size:  # speculators registers d2t/t2d (offsets) and keeps lm_head only when V' < V
            tensors.update(d2t=d2t_offsets(sd["d2t"]), t2d=sd["t2d"].to(torch.bool))
    else:
        config = _specforge_block_config(cfg, where, specforge_fields)
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
        layer, kind = need(config, "transformer_layer_config", where), config["speculators_model_type"]
        ids = list(need(config, "aux_hidden_state_layer_ids", where))
        heads = config if kind == "dspark" else {"markov_rank": 0, "enable_confidence_head": False}
        mask, sfa = config.get("mask_token_id"), config.get("sample_from_anchor", kind == "dspark")
    else:
        layer, dfc = config, need(config, "dflash_config", where)
        ids = [i + 1 for i in need(dfc, "target_layer_ids", where)]
        heads, dspark = _specforge_heads(config, dfc)
        mask, sfa = dfc.get("mask_token_id"), config.get("sample_from_anchor", dspark)
    check_dims(layer, target, where)
    if fmt == "specforge" and dfc.get("projector_type") not in (None, "dflash", "dspark"):  # not a kind's own
        raise SpecheadsError(f"{where}: dflash_config.projector_type {dfc.get('projector_type')!r} is not one "
                             f"specheads reads ({', '.join(['dflash', *variants('specforge')])})")
    dv = int(config.get("draft_vocab_size") or target.vocab_size)
    rank, conf = int(heads.get("markov_rank", 256)), bool(heads.get("enable_confidence_head", True))
    return HeadSpec(kind="dspark", num_layers=int(need(layer, "num_hidden_layers", where)), feature_layers=ids,
                    draft_vocab_size=dv if dv < target.vocab_size else None,
                    block_size=int(need(config, "block_size", where)), markov_rank=rank,
                    markov_head_type=heads.get("markov_head_type", "vanilla"), confidence_head=conf,
                    confidence_with_markov=bool(heads.get("confidence_head_with_markov", rank > 0)) and rank > 0,
                    sample_from_anchor=bool(sfa), mask_token_id=mask)


def _specforge_heads(config: dict, dfc: dict) -> tuple[dict, bool]:
    """(the DSpark head fields, whether it is a DSpark) of a SpecForge folder: dflash_config (SpecForge's layout,
    ours since issue 38; SpecForge's defaults where a key is absent: markov_rank 0, the confidence head on when
    confidence_head_alpha > 0, confidence_head_with_markov false), else our earlier layouts (dspark_config or the
    top level, model_type dspark); a DFlash otherwise."""
    arch = (config.get("architectures") or [""])[0]
    if dfc.get("projector_type") == "dspark" or "markov_rank" in dfc or arch == "DSparkDraftModel" and \
            "markov_rank" not in config and "dspark_config" not in config:
        alpha = float(dfc.get("confidence_head_alpha", 0.0) or 0.0)
        return {"markov_rank": int(dfc.get("markov_rank", 0) or 0),
                "markov_head_type": dfc.get("markov_head_type", "vanilla"),
                "enable_confidence_head": bool(dfc.get("enable_confidence_head", alpha > 0.0)),
                "confidence_head_with_markov": bool(dfc.get("confidence_head_with_markov", False))}, True
    old = config.get("dspark_config") or config
    if "markov_rank" in old:
        return old, True
    return {"markov_rank": 0, "enable_confidence_head": False}, False


def import_block_tensors(fmt: str, config: dict, sd: dict, target, where: str, w: str) -> tuple[HeadSpec, dict]:
    """(HeadSpec, native state dict) of a speculators dspark / dflash or SpecForge DFlash / DSpark folder."""
    return block_tensors(_block_spec(fmt, config, target, where), sd, target, w)


def block_tensors(spec: HeadSpec, sd: dict, target, w: str, own_keys: tuple[str, ...] = ()) -> tuple[HeadSpec, dict]:
    """(spec, native state dict) of a block folder read as `spec`: the block tensors checked (and `own_keys`, the
    tensors of a kind's own layout, e.g. Domino's), d2t made absolute, the calibration uncalibrated."""
    check_keys(sd, ["fc.weight", "hidden_norm.weight", "norm.weight"], w)
    if own_keys:
        check_keys(sd, list(own_keys), w)
    tensors = {k: v for k, v in sd.items() if k not in ("d2t", "t2d")}
    if spec.draft_vocab_size:
        check_keys(sd, ["d2t", "lm_head.weight"], w)
        tensors["d2t"] = absolute_d2t(sd["d2t"], sd.get("t2d"), w)
        tensors["t2d"] = t2d_of(tensors["d2t"], target.vocab_size)
    tensors["conf_temperature"] = torch.ones(spec.num_drafts)  # uncalibrated: the formats carry no calibration
    tensors["conf_bias"] = torch.zeros(spec.num_drafts)
    return spec, tensors


def read_specforge(config: dict, sd: dict, target, where: str, w: str) -> tuple[HeadSpec, dict]:
    """A SpecForge folder: a kind's own projector type (dflash_config.projector_type, registered by its export
    module: Domino's in export/domino.py) through its reader, DFlash / DSpark here."""
    own = variants("specforge").get((config.get("dflash_config") or {}).get("projector_type"))
    if own is not None:
        return own(config, sd, target, where, w)
    return import_block_tensors("specforge", config, sd, target, where, w)


def read_block_speculators(config: dict, sd: dict, target, where: str, w: str) -> tuple[HeadSpec, dict]:
    """A speculators dspark / dflash folder."""
    return import_block_tensors("speculators", config, sd, target, where, w)


for _model_type in BLOCK_TYPES:
    register_variant("speculators", _model_type, read_block_speculators)
SPECFORGE = register_format(Format(
    "specforge", rank=60, reader=read_specforge, detect_rank=20,  # written by the block kinds' exporters
    detect=lambda config: "dflash_config" in config or config.get("model_type") == "dspark"))

"""Domino heads (heads/domino.py) in SpecForge's layout: its DominoDraftModel (specforge/modeling/draft/domino.py,
configs/qwen3-8b-domino.json) is the DFlash config (export/dspark.py) with architectures [DominoDraftModel], a
top-level emb_dim and dflash_config {projector_type domino, emb_dim, gru_hidden_dim, pure_draft_prefix_len,
shift_label true}; its prefix_gru / embed_proj tensors keep our names (they are its names). Reading a Domino
folder back is export/dspark.py's (the projector type says it). speculators 0.9.0 has no Domino model: refused
(the kind's KindSpec.refused)."""
from __future__ import annotations

from pathlib import Path

from specheads.heads.base import HeadConfig, HeadSpec
from specheads.heads.export.common import check_dims, need
from specheads.heads.export.dspark import block_tensors, export_block_head
from specheads.heads.export.formats import register_variant
from specheads.utils import SpecheadsError

OWN_KEYS = ("prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight", "embed_proj.2.weight")


def specforge_fields(config: dict, spec: HeadSpec, where: str) -> None:
    """SpecForge DominoDraftModel's keys (configs/qwen3-8b-domino.json; _init_draft_head reads them)."""
    if spec.options.confidence_head:
        raise SpecheadsError(f"--format specforge: {where} has a confidence head; SpecForge's DominoDraftModel has "
                             f"none ({spec.key('confidence_head')} false)")
    config["architectures"] = ["DominoDraftModel"]
    config["emb_dim"] = spec.options.emb_dim
    config["dflash_config"].update(projector_type="domino", emb_dim=spec.options.emb_dim,
                                   gru_hidden_dim=spec.options.gru_hidden,
                                   pure_draft_prefix_len=spec.options.prefix_len, shift_label=True)


def export_domino(cfg: HeadConfig, sd: dict, fmt: str, out_dir, where: str, verifier: str | None) -> Path:
    """The Domino kind's exporter (its KindSpec.exporter): the block export with Domino's SpecForge keys."""
    return export_block_head(cfg, sd, fmt, out_dir, where, verifier, specforge_fields=specforge_fields)


def domino_spec(config: dict, target, where: str) -> HeadSpec:
    """A SpecForge DominoDraftModel config -> a domino HeadSpec (its shift_label false alignment is not built)."""
    dfc = need(config, "dflash_config", where)
    ids = [i + 1 for i in need(dfc, "target_layer_ids", where)]
    check_dims(config, target, where)
    if not dfc.get("shift_label", False):
        raise SpecheadsError(f"{where}: a Domino head with shift_label false; specheads builds shift_label true "
                             "only (heads/domino.py)")
    return HeadSpec(kind="domino", num_layers=int(need(config, "num_hidden_layers", where)), feature_layers=ids,
                    block_size=int(need(config, "block_size", where)), markov_rank=0, confidence_head=False,
                    confidence_with_markov=False, sample_from_anchor=True, mask_token_id=dfc.get("mask_token_id"),
                    domino_gru_hidden=int(need(dfc, "gru_hidden_dim", where)),
                    domino_emb_dim=int(need(dfc, "emb_dim", where)),
                    domino_prefix_len=int(dfc.get("pure_draft_prefix_len", 0)))


def read_domino(config: dict, sd: dict, target, where: str, w: str) -> tuple[HeadSpec, dict]:
    """A SpecForge Domino folder -> (HeadSpec, native state dict): the block tensors plus prefix_gru / embed_proj."""
    return block_tensors(domino_spec(config, target, where), sd, target, w, OWN_KEYS)


register_variant("specforge", "domino", read_domino)

"""Domino heads (heads/domino.py) in SpecForge's layout: its DominoDraftModel (specforge/modeling/draft/domino.py,
configs/qwen3-8b-domino.json) is the DFlash config (export/dspark.py) with architectures [DominoDraftModel], a
top-level emb_dim and dflash_config {projector_type domino, emb_dim, gru_hidden_dim, pure_draft_prefix_len,
shift_label true}; its prefix_gru / embed_proj tensors keep our names (they are its names). Reading a Domino
folder back is export/dspark.py's (the projector type says it). speculators 0.9.0 has no Domino model: refused
(the kind's KindSpec.refused)."""
from __future__ import annotations

from pathlib import Path

from specheads.heads.base import HeadConfig, HeadSpec
from specheads.heads.export.dspark import export_block_head
from specheads.utils import SpecheadsError


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

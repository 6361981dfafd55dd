"""The head: section's per-kind sections (heads/headspec.py): a kind's own settings under its name, from a file and
from dotted overrides, through HeadSpec and config.json and back; the old flat spellings (recipes, overrides, head
folders, a run's saved train_config.yaml) read under the new names with one warning line; a section of another
kind and unknown keys refused naming the key."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml

from specheads.config import config_to_dict, load_config, renamed_keys
from specheads.heads import build_head, load_head
from specheads.heads.base import HeadSpec, read_head_config
from specheads.heads.dflash2 import DFlash2Options
from specheads.heads.domino import DominoOptions
from specheads.heads.headspec import all_flat_keys, flat_keys
from specheads.train.recipe import Recipe
from specheads.utils import SpecheadsError

DFLASH2 = {"kind": "dflash2", "feature_layers": [1, 2, 3], "mask_token_id": 5,
           "dflash2": {"block_size": 4, "markov_rank": 0, "confidence_head": False, "sample_from_anchor": False,
                       "conv_kernel_size": 3, "selector_rank": 8, "selector_top_k": 4}}
REPO = Path(__file__).resolve().parents[1]


def _write(path: Path, head: dict) -> Path:
    path.write_text(yaml.safe_dump({"head": head}))
    return path


def _config_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "specheads.config"]


def test_section_round_trip_recipe_headspec_config_json_load(tiny, tmp_path, caplog):
    recipe = load_config(Recipe, _write(tmp_path / "r.yaml", DFLASH2))
    assert not _config_warnings(caplog)
    spec = recipe.head
    assert spec.options == DFlash2Options(block_size=4, markov_rank=0, confidence_head=False,
                                          sample_from_anchor=False, conv_kernel_size=3, selector_rank=8,
                                          selector_top_k=4)
    assert config_to_dict(recipe)["head"] == {"bias": None, "draft_vocab_size": None, "num_layers": 1, **DFLASH2,
                                              "dflash2": {**DFLASH2["dflash2"], **{
                                                  "markov_head_type": "vanilla", "confidence_with_markov": False,
                                                  "anchor_features": False, "conv_group_size": 16}}}
    head = build_head(spec, tiny)
    head.save_pretrained(tmp_path / "h")
    written = json.loads((tmp_path / "h" / "config.json").read_text())["spec"]
    assert written["dflash2"]["conv_kernel_size"] == 3 and "conv_kernel_size" not in written
    assert HeadSpec(**written) == HeadSpec(**{**config_to_dict(recipe)["head"], "feature_layers": [1, 2, 3]})
    back = load_head(tmp_path / "h", tiny)
    assert back.spec == head.spec and back.config.to_dict() == json.loads(json.dumps(head.config.to_dict()))
    assert HeadSpec(kind="dflash2", options=spec.options, feature_layers=[1, 2, 3], mask_token_id=5) == spec


def test_dotted_overrides_reach_the_kinds_section(tmp_path):
    recipe = load_config(Recipe, _write(tmp_path / "r.yaml", DFLASH2),
                         ["head.dflash2.block_size=6", "head.dflash2.conv_kernel_size=2"])
    assert (recipe.head.options.block_size, recipe.head.options.conv_kernel_size) == (6, 2)
    recipe = load_config(Recipe, None, ["head.kind=domino", "head.domino.gru_hidden=16",
                                        "head.domino={markov_rank: 0, confidence_head: false}"])
    assert recipe.head.options == DominoOptions(gru_hidden=1024, markov_rank=0, confidence_head=False)  # replaced
    recipe = load_config(Recipe, None, ["head.kind=domino", "head.domino.markov_rank=0",
                                        "head.domino.confidence_head=false", "head.domino.gru_hidden=16"])
    assert recipe.head.options.gru_hidden == 16


def test_old_flat_keys_load_with_one_warning(tmp_path, caplog):
    """Old flat keys in a file and in overrides: read under the new names, one warning line naming each old -> new;
    the same head as the sectioned recipe."""
    flat = {"kind": "domino", "block_size": 4, "markov_rank": 0, "confidence_head": False, "domino_gru_hidden": 16}
    caplog.set_level(logging.WARNING)
    recipe = load_config(Recipe, _write(tmp_path / "old.yaml", flat), ["head.domino_emb_dim=8", "head.num_layers=2"])
    said = _config_warnings(caplog)
    assert len(said) == 1
    for old, new in [("head.block_size", "head.domino.block_size"), ("head.domino_gru_hidden", "head.domino.gru_hidden"),
                     ("head.domino_emb_dim", "head.domino.emb_dim")]:
        assert f"{old} -> {new}" in said[0]
    new = load_config(Recipe, _write(tmp_path / "new.yaml", {
        "kind": "domino", "num_layers": 2, "domino": {"block_size": 4, "markov_rank": 0, "confidence_head": False,
                                                      "gru_hidden": 16, "emb_dim": 8}}))
    assert recipe.head == new.head
    # an old override over a sectioned file (the configs/ recipes are sectioned now): the new key, overridden
    caplog.clear()
    got = load_config(Recipe, REPO / "configs" / "dspark-smollm2.yaml", ["head.block_size=3"])
    assert got.head.options.block_size == 3 and len(_config_warnings(caplog)) == 1
    # an old override whose section head.kind (given after it) picks
    got = load_config(Recipe, None, ["head.num_heads=2", "head.kind=medusa"])
    assert got.head.options.num_heads == 2


def test_old_and_new_name_together_are_refused(tmp_path):
    with pytest.raises(SpecheadsError, match=r"head\.block_size and head\.dspark\.block_size: the same setting"):
        load_config(Recipe, _write(tmp_path / "r.yaml", {"kind": "dspark", "block_size": 3,
                                                         "dspark": {"block_size": 4}}))
    with pytest.raises(SpecheadsError, match=r"head\.block_size and head\.dspark\.block_size: the same setting"):
        HeadSpec(kind="dspark", block_size=3, dspark={"block_size": 4})


def test_a_section_of_another_kind_and_unknown_keys_are_refused(tmp_path):
    with pytest.raises(SpecheadsError, match=r"r\.yaml: head\.dspark: the section of kind dspark, and head\.kind is "
                                             r"'dflash2'"):
        load_config(Recipe, _write(tmp_path / "r.yaml", {**DFLASH2, "dspark": {"block_size": 3}}))
    with pytest.raises(SpecheadsError, match=r"head\.dflash2: unknown key\(s\) \['conv_kernal_size'\]"):
        load_config(Recipe, _write(tmp_path / "r.yaml", {"kind": "dflash2", "dflash2": {"conv_kernal_size": 2}}))
    with pytest.raises(SpecheadsError, match=r"unknown key 'head\.dflash2\.blok_size'"):
        load_config(Recipe, None, ["head.kind=dflash2", "head.dflash2.blok_size=3"])
    with pytest.raises(SpecheadsError, match=r"unknown key 'head\.blok_size'"):
        load_config(Recipe, None, ["head.blok_size=3"])
    with pytest.raises(SpecheadsError, match=r"head\.eagle: an EAGLE head has no settings of its own"):
        HeadSpec(kind="eagle", eagle={})
    # another kind's old flat key: dropped at its default (old files held every key), refused otherwise
    assert HeadSpec(kind="medusa", block_size=7, ttt_steps=7) == HeadSpec(kind="medusa")
    with pytest.raises(SpecheadsError, match=r"head\.ttt_steps: a setting of eagle3 heads, not of a Medusa head"):
        load_config(Recipe, None, ["head.kind=medusa", "head.ttt_steps=3"])
    assert load_config(Recipe, None, ["head.kind=medusa", "head.ttt_steps=7"]).head == HeadSpec(kind="medusa")
    with pytest.raises(SpecheadsError, match=r"expected its settings as DFlash2Options, got DominoOptions"):
        HeadSpec(kind="dflash2", options=DominoOptions())


def _old_flat_spec(spec: HeadSpec) -> dict:
    """config.json's "spec" as the flat HeadSpec wrote it: every kind's key at the top level, the others' defaults."""
    out = {k: v for k, v in spec.to_section().items() if k != spec.kind}
    out.update({old: default for old, (_, default, _) in all_flat_keys().items()})
    if spec.options is not None:
        out.update({old: getattr(spec.options, new) for old, new in flat_keys(type(spec.options)).items()})
    return out


@pytest.mark.parametrize("spec", [HeadSpec(**DFLASH2), HeadSpec(kind="medusa", num_heads=2, medusa_lm_head="per_head"),
                                  HeadSpec(kind="domino", feature_layers=[1, 2, 3], block_size=4, markov_rank=0,
                                           confidence_head=False, domino_gru_hidden=16, domino_emb_dim=8),
                                  HeadSpec(kind="eagle", feature_layers=[4])])
def test_an_old_flat_head_folder_loads_unchanged(tiny, tmp_path, spec):
    head = build_head(spec, tiny)
    head.save_pretrained(tmp_path / "h")
    path = tmp_path / "h" / "config.json"
    cfg = json.loads(path.read_text())
    cfg["spec"] = {**_old_flat_spec(HeadSpec(**cfg["spec"])), "feature_layers": cfg["feature_layers"]}
    assert cfg["spec"]["kind"] == spec.kind and "block_size" in cfg["spec"]  # the old layout, every kind's keys
    path.write_text(json.dumps(cfg))
    before = path.read_bytes()
    back = load_head(tmp_path / "h", tiny)
    assert back.spec == head.spec and back.config.spec == head.config.spec  # read in today's form
    assert path.read_bytes() == before


def _flat(d: Path) -> bool:
    """A head folder written before the sections: its spec holds the kind's settings flat, no `kind:` section."""
    spec = json.loads((d / "config.json").read_text()).get("spec") or {}
    return "kind" in spec and spec["kind"] not in spec


# the trained folders in runs/ that an earlier code wrote flat (folders trained since are in the new form)
REAL = sorted(p for p in [REPO / "runs/demo/best", REPO / "runs/demo-dspark/best",
                          *(REPO / "runs/kinds-256").glob("*/best")] if (p / "config.json").exists() and _flat(p))


@pytest.mark.skipif(not REAL, reason="no head folders written flat (before the sections) in runs/")
def test_real_old_head_folders_read_as_they_were_written():
    """The repo's trained folders (flat "spec", written before the sections) read to the settings they hold."""
    for d in REAL:
        raw = json.loads((d / "config.json").read_text())["spec"]
        cfg = read_head_config(d)
        spec = cfg.head_spec
        assert cfg.spec == spec.to_section() and spec.kind == raw["kind"]
        own = {old: new for old, new in HeadSpec.section_renames({"kind": spec.kind}).items() if old in raw}
        for old, new in own.items():
            assert getattr(spec.options, new.split(".", 1)[1]) == raw[old], (d, old)
        for key in ("num_layers", "draft_vocab_size", "feature_layers", "bias", "mask_token_id"):
            assert getattr(spec, key) == raw[key], (d, key)


def test_resume_compares_an_old_runs_flat_recipe_under_the_new_names(tmp_path):
    """A run written before the sections holds head: flat in train_config.yaml (every kind's keys): resuming it with
    the same settings finds no change; a changed block size is refused under its new name."""
    from specheads.train.checkpoint import check_resume_settings

    recipe = load_config(Recipe, REPO / "configs" / "dspark-smollm2.yaml")
    saved = config_to_dict(recipe)
    saved["head"] = _old_flat_spec(recipe.head)
    (tmp_path / "train_config.yaml").write_text(yaml.safe_dump(saved))
    now = config_to_dict(recipe)
    assert check_resume_settings(tmp_path, now, renamed_keys(Recipe, data=now)) == {}
    other = config_to_dict(load_config(Recipe, REPO / "configs" / "dspark-smollm2.yaml", ["head.dspark.block_size=5"]))
    with pytest.raises(SpecheadsError, match=r"head\.dspark\.block_size 7 -> 5 differ"):
        check_resume_settings(tmp_path, other, renamed_keys(Recipe, data=other))
    # the saved recipe itself still loads (specheads eval --dataset heldout:RUN reads it)
    assert load_config(Recipe, tmp_path / "train_config.yaml").head == recipe.head

"""The config system: YAML + dotted overrides, unknown keys fail with the file/flag and key named."""
import logging
from dataclasses import dataclass, field

import pytest

from specheads.config import config_to_dict, format_config, load_config
from specheads.utils import SpecheadsError


@dataclass
class Inner:
    lr: float = 1e-3
    steps: int = 10
    layers: list[int] | None = None
    name: str = "x"
    path: str | None = None


@dataclass
class Outer:
    seed: int = 0
    flag: bool = False
    inner: Inner = field(default_factory=Inner)


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("command: specheads train --config c.yaml\nseed: 3\ninner:\n  lr: 3e-4\n  layers: [1, 2]\n")
    cfg = load_config(Outer, p, ["inner.steps=7", "flag=true"])
    assert cfg.seed == 3 and cfg.flag is True
    assert cfg.inner.lr == pytest.approx(3e-4) and cfg.inner.steps == 7 and cfg.inner.layers == [1, 2]
    assert "lr: 0.0003" in format_config(cfg)
    assert config_to_dict(cfg)["inner"]["steps"] == 7


def test_string_overrides_keep_their_text():
    # YAML alone would read `no` as false and `1e-3` as a string/number: a string field takes the text as written
    cfg = load_config(Outer, None, ["inner.name=no", "inner.path=off"])
    assert cfg.inner.name == "no" and cfg.inner.path == "off"
    assert load_config(Outer, None, ["inner.path=null"]).inner.path is None
    assert load_config(Outer, None, ["inner.name=007"]).inner.name == "007"


def test_unknown_key_in_yaml_names_file_and_key(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("inner:\n  lrr: 1\n")
    with pytest.raises(SpecheadsError, match=r"bad\.yaml: inner.*lrr"):
        load_config(Outer, p)


def test_unknown_override_names_flag():
    with pytest.raises(SpecheadsError, match=r"override 'inner\.nope=1'.*inner\.nope"):
        load_config(Outer, None, ["inner.nope=1"])


def test_type_errors_are_reported():
    with pytest.raises(SpecheadsError, match=r"inner\.steps.*integer"):
        load_config(Outer, None, ["inner.steps=abc"])
    with pytest.raises(SpecheadsError, match="true/false"):
        load_config(Outer, None, ["flag=3"])


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(SpecheadsError, match="not found"):
        load_config(Outer, tmp_path / "none.yaml")
    p = tmp_path / "broken.yaml"
    p.write_text("a: [1, 2\n")
    with pytest.raises(SpecheadsError, match="broken.yaml: not valid YAML"):
        load_config(Outer, p)


@pytest.mark.parametrize("override, want", [
    ("inner.layers=[1,", r"override 'inner\.layers=\[1,': not a valid value \(expected the node content"),
    ("inner.layers=[1, 2]]", r"override 'inner\.layers=\[1, 2\]\]': not a valid value"),
    ("inner.lr=@x", r"override 'inner\.lr=@x': not a valid value \(found character '@'"),
    ("inner.lr=*a", r"override 'inner\.lr=\*a': not a valid value \(found undefined alias"),
    ("inner.lr=!!python/object:os.system x",
     r"override 'inner\.lr=!!python/object:os\.system x': YAML tags are not allowed in a value \(found "
     r"'!!python/object:os\.system'\)"),
    ("seed=!!binary aGVsbG8=", r"override 'seed=!!binary aGVsbG8=': YAML tags are not allowed"),
])
def test_malformed_override_values_are_one_line_naming_the_override(override, want):
    with pytest.raises(SpecheadsError, match=want) as e:
        load_config(Outer, None, [override])
    assert "\n" not in str(e.value)


def test_a_string_field_keeps_tag_like_text():
    assert load_config(Outer, None, ["inner.name=!!x"]).inner.name == "!!x"


def test_unreadable_config_files_name_the_file(tmp_path):
    p = tmp_path / "bin.yaml"
    p.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(SpecheadsError, match=r"bin\.yaml: not a text file"):
        load_config(Outer, p)
    with pytest.raises(SpecheadsError, match=rf"{tmp_path}: is a folder, not a config file"):
        load_config(Outer, tmp_path)
    p = tmp_path / "tag.yaml"
    p.write_text("seed: !!python/object:os.system x\n")
    with pytest.raises(SpecheadsError, match=r"tag\.yaml: not valid YAML at line 1, column 7: could not determine a "
                                             r"constructor") as e:
        load_config(Outer, p)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ the recipe's train: sections and renamed keys
def _renames(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "old key names" in r.getMessage()]


def test_nested_section_override_and_yaml(tmp_path):
    from specheads.train.recipe import Recipe

    p = tmp_path / "r.yaml"
    p.write_text("train:\n  lr: 1.0e-3\n  block:\n    gamma: 2.0\n    max_anchors: 16\n  lora:\n    r: 4\n")
    r = load_config(Recipe, p, ["train.block.gamma=3", "train.lora.enabled=true", "train.eagle.w_ce=0.5"])
    assert r.train.block.gamma == 3.0 and r.train.block.max_anchors == 16 and r.train.block.w_l1 == 0.9
    assert r.train.lora.enabled is True and r.train.lora.r == 4 and r.train.eagle.w_ce == 0.5
    assert r.train.lr == pytest.approx(1e-3)
    assert config_to_dict(r)["train"]["block"]["gamma"] == 3.0  # what train_config.yaml holds


def test_unknown_nested_key_names_it(tmp_path):
    from specheads.train.recipe import Recipe

    with pytest.raises(SpecheadsError, match=r"override 'train\.block\.gama=3': unknown key 'train\.block\.gama'; "
                                             r"known keys here: \[.*'gamma'"):
        load_config(Recipe, None, ["train.block.gama=3"])
    p = tmp_path / "r.yaml"
    p.write_text("train:\n  block:\n    gama: 3\n")
    with pytest.raises(SpecheadsError, match=r"r\.yaml: train\.block: unknown key\(s\) \['gama'\]"):
        load_config(Recipe, p)
    with pytest.raises(SpecheadsError, match=r"override 'train\.block\.gamma=0'.*train\.block\.gamma: must be > 0"):
        load_config(Recipe, None, ["train.block.gamma=0"])  # a section's own check names its dotted key


def test_old_flat_keys_map_to_the_sections_with_one_warning(tmp_path, caplog):
    from specheads.train.recipe import Recipe

    p = tmp_path / "old.yaml"
    p.write_text("train:\n  block_gamma: 2.0\n  max_anchors: 16\n  lora: true\n  lora_targets: [q_proj]\n"
                 "  soft_labels: true\n")
    with caplog.at_level(logging.WARNING, logger="specheads.config"):
        r = load_config(Recipe, p, ["train.block_w_l1=0.5", "train.eagle_w_reg=2"])
    assert (r.train.block.gamma, r.train.block.max_anchors, r.train.block.w_l1) == (2.0, 16, 0.5)
    assert r.train.lora.enabled is True and r.train.lora.targets == ["q_proj"] and r.train.medusa.soft_labels
    assert r.train.eagle.w_reg == 2.0
    said = _renames(caplog)
    assert len(said) == 1 and "\n" not in said[0]
    for old, new in [("train.block_gamma", "train.block.gamma"), ("train.lora", "train.lora.enabled"),
                     ("train.block_w_l1", "train.block.w_l1"), ("train.soft_labels", "train.medusa.soft_labels")]:
        assert f"{old} -> {new}" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specheads.config"):
        load_config(Recipe, None, ["train.block.gamma=2"])
    assert not _renames(caplog)  # the new names: no warning


def test_old_key_on_the_command_line_overrides_the_file_new_key(tmp_path):
    from specheads.train.recipe import Recipe

    p = tmp_path / "r.yaml"
    p.write_text("train:\n  block:\n    gamma: 2.0\n")
    assert load_config(Recipe, p, ["train.block_gamma=5"]).train.block.gamma == 5.0
    assert load_config(Recipe, None, ["train.lora={r: 8}"]).train.lora.r == 8  # `lora` as the section


@pytest.mark.parametrize("yaml_text, overrides, where", [
    ("train:\n  block_gamma: 2.0\n  block:\n    gamma: 3.0\n", [], r"r\.yaml"),
    ("train:\n  lora_merge: true\n  lora:\n    merge: false\n", [], r"r\.yaml"),
    ("", ["train.block_gamma=2", "train.block.gamma=3"], r"override 'train\.block\.gamma=3'"),
    ("", ["train.lora.r=4", "train.lora_r=8"], r"override 'train\.lora_r=8'"),
], ids=["yaml-block", "yaml-lora", "flags-old-first", "flags-new-first"])
def test_one_setting_under_both_names_is_an_error(tmp_path, yaml_text, overrides, where):
    from specheads.train.recipe import Recipe

    p = tmp_path / "r.yaml"
    p.write_text(yaml_text)
    with pytest.raises(SpecheadsError, match=where + r": train\.(block_gamma and train\.block\.gamma|lora_\w+ and "
                                                     r"train\.lora\.\w+): the same setting under its old and its new"):
        load_config(Recipe, p, overrides)


def test_upgrade_flat_maps_a_written_recipe():
    from specheads.config import renamed_keys, upgrade_flat
    from specheads.train.recipe import Recipe

    renamed = renamed_keys(Recipe)
    assert renamed["train.block_gamma"] == "train.block.gamma" and renamed["train.lora"] == "train.lora.enabled"
    assert upgrade_flat({"train.lora": True, "train.lr": 1.0}, renamed, "x") == {"train.lora.enabled": True,
                                                                                 "train.lr": 1.0}
    with pytest.raises(SpecheadsError, match=r"x: train\.lora_r and train\.lora\.r"):
        upgrade_flat({"train.lora_r": 4, "train.lora.r": 8}, renamed, "x")



@pytest.mark.parametrize("value", ['!<tag:yaml.org,2002:python/object/apply:os.system> ["touch x"]',
                                   "!<tag:yaml.org,2002:float> 3", "!!float 3"])
def test_a_verbatim_yaml_tag_in_an_override_is_one_line(value, tmp_path):
    """issue 38: a tag written verbatim (`!<tag:...>`, no handle) raised a TypeError from the tag check."""
    from specheads.train.recipe import Recipe

    with pytest.raises(SpecheadsError, match=r"^override 'train.lr=.*': YAML tags are not allowed in a value "
                                             r"\(found '(!<tag:yaml.org,2002:|!!)"):
        load_config(Recipe, None, [f"train.lr={value}"])


def test_a_config_that_never_ends_is_refused_with_bounded_memory(tmp_path, monkeypatch):
    """An endless --config (a device or pipe; here /dev/zero behind a .yaml name) is read at most
    MAX_TEXT_BYTES, then refused naming it."""
    import specheads.utils
    from specheads.train.recipe import Recipe

    monkeypatch.setattr(specheads.utils, "MAX_TEXT_BYTES", 1 << 20)
    link = tmp_path / "r.yaml"
    link.symlink_to("/dev/zero")
    with pytest.raises(SpecheadsError, match=rf"^{link}: more than 1 MiB \(read no further"):
        load_config(Recipe, link)

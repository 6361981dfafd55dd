"""The config system: YAML + dotted overrides, unknown keys fail with the file/flag and key named."""
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

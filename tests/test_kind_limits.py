"""Every kind's own settings out of range, and every export format that cannot carry a kind (issue 49, point 7).

The (kind, setting, bad value) cases come from the registry: each kind's options class declares its ranges in
LIMITS (heads/headspec.py check_options; utils.check_values rules) and its types in its annotations; the bad
values are derived from each rule (its bound, just past it, nan / inf for a number) and each type (a string; 1.5 for
a count; 3 for a switch). Each is refused with one line naming head.<kind>.<setting> from Python, from a YAML
recipe (naming the file), from a dotted override (naming the flag) and from a head folder's config.json (naming the
file and its key). The ranges that need other settings or the target (a kernel longer than the block, a group size
that does not divide the hidden size, ...) are the rows of CROSS and TARGET_BOUND. The (kind, format) pairs are
every registered kind against every written format it is not exported in, and gguf for every kind llama.cpp does
not draft: refused with one line naming the format and the kind, nothing written.
"""
from __future__ import annotations

import dataclasses
import json
import math
import typing

import pytest
import yaml

from specheads.heads import HeadSpec, build_head
from specheads.heads.headspec import option_limits
from specheads.heads.kinds import kind_names, kind_spec, kinds_where
from specheads.utils import SpecheadsError

def bad_values(rule: str, tp) -> list:
    """Values outside a check_values rule (">=N", ">N", "(a,b)", "[a,b]", ...), of the field's type where it can
    be (an int field gets ints), then nan and inf for a float field."""
    step = 1 if tp is int else 0.5
    out = []
    if rule.startswith(">="):
        out.append(float(rule[2:]) - step)
    elif rule.startswith(">"):
        out += [float(rule[1:]), float(rule[1:]) - step]
    else:
        lo, hi = (float(x) for x in rule[1:-1].split(","))
        out += [lo if rule[0] == "(" else lo - step, hi if rule[-1] == ")" else hi + step]
    out = [int(v) if tp is int else v for v in out]
    return out + ([math.nan, math.inf] if tp is float else [])


def wrong_types(tp) -> list:
    """Values of another type than the field's annotation."""
    if typing.get_origin(tp) is typing.Literal:
        return ["no-such-choice", 3]
    return {int: ["x", 1.5], float: ["x"], bool: [3, "x"]}.get(tp, [])


def cases() -> list[tuple[str, str, object]]:
    out = []
    for kind in kind_names():
        cls = kind_spec(kind).options
        if cls is None:
            continue
        hints, limits = typing.get_type_hints(cls), option_limits(cls)
        for f in dataclasses.fields(cls):
            bad = bad_values(limits[f.name], hints[f.name]) if f.name in limits else []
            out += [(kind, f.name, v) for v in bad + wrong_types(hints[f.name])]
    return out


CASES = cases()


def case_id(c) -> str:
    return f"{c[0]}.{c[1]}={c[2]!r}"


def section(kind: str, **changes) -> dict:
    """The kind's example head: section (KindSpec.example) with `changes` to its own settings."""
    ex = json.loads(json.dumps(kind_spec(kind).example))
    if kind_spec(kind).options is not None:
        ex[kind] = {**ex.get(kind, {}), **changes}
    return {"kind": kind, **ex}


def one_line(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_every_kind_with_options_declares_its_ranges():
    """A kind's numeric settings all have a range (a new one without its LIMITS entry fails here)."""
    missing = []
    for kind in kind_names():
        cls = kind_spec(kind).options
        if cls is None:
            continue
        hints, limits = typing.get_type_hints(cls), option_limits(cls)
        missing += [f"head.{kind}.{f.name}" for f in dataclasses.fields(cls)
                    if hints[f.name] in (int, float) and f.name not in limits]
    assert not missing
    assert len(CASES) > 100  # every kind's settings, several bad values each


@pytest.mark.parametrize("kind,field,bad", CASES, ids=[case_id(c) for c in CASES])
def test_python_spec_refuses_it_naming_the_field(kind, field, bad):
    with pytest.raises(SpecheadsError) as e:
        HeadSpec(**section(kind, **{field: bad}))
    assert one_line(e).startswith(f"head.{kind}.{field}: ")


@pytest.mark.parametrize("kind,field,bad", CASES, ids=[case_id(c) for c in CASES])
def test_recipe_and_override_refuse_it_naming_the_field_and_where(kind, field, bad, tmp_path):
    from specheads.config import load_config
    from specheads.train.recipe import Recipe

    key = f"head.{kind}.{field}"
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({"head": section(kind, **{field: bad})}))
    with pytest.raises(SpecheadsError) as e:
        load_config(Recipe, tmp_path / "r.yaml")
    assert one_line(e).startswith(f"{tmp_path / 'r.yaml'}: {key}: ")
    raw = yaml.safe_dump(bad, default_flow_style=True).strip().removesuffix("...").strip()
    good = section(kind)
    flags = [f"head.kind={kind}"] + [f"head.{k}={json.dumps(v)}" for k, v in good.items() if k != "kind"]
    with pytest.raises(SpecheadsError) as e:
        load_config(Recipe, None, [*flags, f"{key}={raw}"])
    assert one_line(e).startswith(f"override '{key}={raw}': ")  # the flag names the field (a wrong type is refused
    # as the override is parsed, before the key is repeated)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """kind -> the config.json of its example head saved on the tiny target (one per kind with options)."""
    from specheads.target import tiny_target

    t, out = tiny_target(), {}
    for kind in kind_names():
        if kind_spec(kind).options is not None:
            folder = tmp_path_factory.mktemp(kind)
            build_head(HeadSpec(**section(kind)), t).save_pretrained(folder)
            out[kind] = json.loads((folder / "config.json").read_text())
    return out


@pytest.mark.parametrize("kind,field,bad", CASES, ids=[case_id(c) for c in CASES])
def test_head_folder_refuses_it_naming_the_file_and_key(kind, field, bad, configs, tmp_path):
    from specheads.heads.base import read_head_config

    cfg = json.loads(json.dumps(configs[kind]))
    cfg["spec"][kind][field] = bad
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecheadsError) as e:
        read_head_config(tmp_path)
    assert one_line(e).startswith(f"{tmp_path / 'config.json'}: key 'spec': head.{kind}.{field}: ")


# ranges across settings: (kind, changes, the field named, a fragment of the reason)
CROSS = [
    ("dflash2", {"conv_kernel_size": 5}, "conv_kernel_size", "taps exceed the block's 4 slots"),
    ("dflash2", {"block_size": 1}, "block_size", "must be >= 2"),
    ("dspine", {"block_size": 1}, "block_size", "must be >= 2"),
    ("lilicorr", {"block_size": 1}, "block_size", "must be >= 2"),
    ("domino", {"prefix_len": 5}, "prefix_len", "must be in 0..4"),
    ("domino", {"markov_rank": 8}, "markov_rank", "set it 0"),
    ("dspine", {"sample_from_anchor": True}, "sample_from_anchor", "set it false"),
    ("lilicorr", {"sample_from_anchor": True}, "sample_from_anchor", "set it false"),
    ("domino", {"sample_from_anchor": False}, "sample_from_anchor", "set it true"),
    ("dflash2", {"anchor_features": True}, "anchor_features", "not built for DFlash2"),
]

# ranges against the 4-layer tiny target (hidden 64, vocab 256, 512 positions)
TARGET_BOUND = [
    ("dflash2", {"conv_group_size": 24}, "conv_group_size", "does not divide the target's hidden size 64"),
    ("dflash2", {"selector_top_k": 257}, "selector_top_k", "exceeds the vocabulary 256"),
    ("dspine", {"transfer_rank": 65}, "transfer_rank", "must be within 1..64"),
    ("dspine", {"top_k": 257}, "top_k", "exceeds the draft vocabulary 256"),
    ("lilicorr", {"num_heads": 3}, "num_heads", "does not divide the lattice width 32"),
    ("lilicorr", {"candidate_topk": 257}, "candidate_topk", "exceeds the vocabulary 256"),
    ("peagle", {"num_depths": 600}, "num_depths", "does not fit the 512 positions"),
    *[(k, {"block_size": 600}, "block_size", "does not fit the 512 positions")
      for k in kinds_where(block_positions=True)],
]


@pytest.mark.parametrize("kind,changes,field,why", CROSS, ids=[f"{c[0]}.{c[2]}" for c in CROSS])
def test_ranges_across_settings_name_the_field(kind, changes, field, why):
    with pytest.raises(SpecheadsError) as e:
        HeadSpec(**section(kind, **changes))
    msg = one_line(e)
    assert msg.startswith(f"head.{kind}.{field}") and why in msg


@pytest.mark.parametrize("kind,changes,field,why", TARGET_BOUND, ids=[f"{c[0]}.{c[2]}" for c in TARGET_BOUND])
def test_ranges_against_the_target_name_the_field(kind, changes, field, why, tiny):
    with pytest.raises(SpecheadsError) as e:
        build_head(HeadSpec(**section(kind, **changes)), tiny)
    msg = one_line(e)
    assert msg.startswith(f"head.{kind}.{field}: ") and why in msg


@pytest.mark.parametrize("kind,field", [("domino", "gru_hidden"), ("dflash2", "selector_rank")])
def test_a_width_too_large_for_memory_is_one_line(kind, field, tiny):
    """A typo'd width (10^7 GRU units, 10^11 codebook columns) that torch's allocator refuses at once: one line
    naming the kind's section, no traceback (one that the allocator grants is not caught: see the report)."""
    with pytest.raises(SpecheadsError) as e:
        build_head(HeadSpec(**section(kind, **{field: 10 ** 7 if field == "gru_hidden" else 10 ** 11})), tiny)
    assert one_line(e).startswith(f"head.{kind}: ") and "does not fit in memory" in str(e.value)


# ------------------------------------------------------------------------------------------ train-level settings

def train_cases() -> list[tuple[str, str, object]]:
    from specheads.train.settings import BlockTrainConfig, PEagleTrainConfig

    out = []
    for name, cls in (("block", BlockTrainConfig), ("peagle", PEagleTrainConfig)):
        hints = typing.get_type_hints(cls)
        out += [(name, f, v) for f, rule in cls.LIMITS.items() for v in bad_values(rule, hints[f])]
    return out


TRAIN_CASES = train_cases()


@pytest.mark.parametrize("sec,field,bad", TRAIN_CASES, ids=[case_id(c) for c in TRAIN_CASES])
def test_train_settings_of_the_kinds_refuse_out_of_range_overrides(sec, field, bad):
    from specheads.config import load_config
    from specheads.train.recipe import Recipe

    raw = yaml.safe_dump(bad, default_flow_style=True).strip().removesuffix("...").strip()
    key = f"train.{sec}.{field}"
    with pytest.raises(SpecheadsError) as e:
        load_config(Recipe, None, [f"{key}={raw}"])
    assert one_line(e).startswith(f"override '{key}={raw}': {key}: ")


# -------------------------------------------------------------------------------------------- (kind, format) pairs

def refused_pairs() -> list[tuple[str, str]]:
    from specheads.heads.export import FORMATS

    return [(k, f) for k in kind_names() for f in FORMATS
            if f not in ("native", "gguf") and f not in kind_spec(k).formats]


@pytest.fixture(scope="module")
def heads(tmp_path_factory, tiny_module):
    """kind -> a saved folder of its example head."""
    out = {}
    for kind in kind_names():
        out[kind] = tmp_path_factory.mktemp("h")  # a name without the kind's (the messages must name it)
        build_head(HeadSpec(**section(kind)), tiny_module).save_pretrained(out[kind])
    return out


@pytest.fixture(scope="module")
def tiny_module():
    from specheads.target import tiny_target

    return tiny_target()


def names_kind(msg: str, kind: str) -> bool:
    """The message names the kind (as its name, or its label's spelling: DFlash2, P-EAGLE, LiLiCorr)."""
    return kind in msg.lower().replace("-", "")


PAIRS = refused_pairs()


@pytest.mark.parametrize("kind,fmt", PAIRS, ids=[f"{k}-{f}" for k, f in PAIRS])
def test_a_format_that_cannot_carry_a_kind_refuses_it_with_the_reason(kind, fmt, heads, tiny_module, tmp_path):
    from specheads.heads.export import export_head

    with pytest.raises(SpecheadsError) as e:
        export_head(heads[kind], fmt, tmp_path / "o", target=tiny_module)
    msg = one_line(e)
    assert msg.startswith(f"--format {fmt}: ") and names_kind(msg, kind)
    assert not (tmp_path / "o").exists() and not list(tmp_path.iterdir())  # nothing half-written beside it
    if fmt not in kind_spec(kind).refused:  # the generic refusal says what the kind is exported as
        assert "exported as native" in msg


@pytest.mark.parametrize("kind", [k for k in kind_names() if kind_spec(k).gguf is None])
def test_gguf_refuses_a_kind_llama_cpp_does_not_draft_in_one_line(kind, heads, tmp_path):
    """Refused before llama.cpp's tools are looked for (so it holds where they are not built), naming the kinds
    GGUF carries; the block kinds also say why theirs is not one of them."""
    from specheads.heads.gguf import draft_kinds, export_gguf

    with pytest.raises(SpecheadsError) as e:
        export_gguf(heads[kind], tmp_path / "o")
    msg = one_line(e)
    assert msg.startswith("--format gguf: ") and f"holds a {kind} head" in msg
    assert str(sorted(draft_kinds())) in msg and not (tmp_path / "o").exists()
    if kind_spec(kind).family == "block":
        assert kind_spec(kind).not_drafted and kind_spec(kind).not_drafted in msg

"""The contract every registered head kind keeps (parametrized over the registry, heads/kinds.py, not a hand list):
its KindSpec is consistent, its heads provide its family's Protocol, a save / load round trip is bit-exact, one
optimizer step moves every trainable parameter and not the target, fp32 greedy output through its drafter equals
plain greedy decoding (single and batched), and every export format either round-trips or is refused with one
clear line. The tiny 4-layer Llama target (conftest.tiny); each kind's own small head is its KindSpec.example."""
from __future__ import annotations

import json

import pytest
import torch

from specheads.heads import HeadSpec, build_head, load_head
from specheads.heads.kinds import kind_names, kind_spec, resolve
from specheads.utils import SpecheadsError
from helpers import make_head

KINDS = kind_names()  # the registry: a new kind is checked here without an edit


def serve_tree(kind: str) -> str | None:
    """A fixed --tree for the kind's drafter (block heads: 3 drafts per pass; tree heads: their default tree)."""
    return "3" if kind_spec(kind).family == "block" else None


@pytest.mark.parametrize("kind", KINDS)
def test_declaration_is_consistent(kind, tiny):
    """The KindSpec's references resolve, name this kind, and its head class and family agree."""
    from specheads.heads.base import default_feature_layers
    from specheads.train.kinds import head_kind

    ks = kind_spec(kind)
    assert ks.name == kind and ks.head.kind == kind
    assert head_kind(kind).name == kind
    drafter = resolve(ks.drafter)
    assert drafter.head and drafter.name == kind
    assert (drafter.family == "block") == (ks.family == "block")
    layers = default_feature_layers(kind, tiny.num_layers)
    assert all(0 <= i <= tiny.num_layers for i in layers)
    assert not ks.final_state_only or layers == [tiny.num_layers]
    assert (ks.gguf is None) or not ks.not_drafted  # drafted, or the reason it is not
    assert isinstance(make_head(tiny, kind), ks.protocol)


@pytest.mark.parametrize("kind", KINDS)
def test_own_settings_are_a_recipe_section_named_after_the_kind(kind, tmp_path):
    """The kind's options (KindSpec.options, declared in its module) are head.<kind> in a recipe: its example written
    as a YAML section loads to the same spec, and writes back the same section."""
    import dataclasses

    import yaml

    from specheads.config import config_to_dict, load_config
    from specheads.train.recipe import Recipe

    ks = kind_spec(kind)
    spec = HeadSpec(kind=kind, **ks.example)
    assert (spec.options is None) == (ks.options is None)
    assert ks.options is None or (dataclasses.is_dataclass(ks.options) and type(spec.options) is ks.options)
    section = spec.to_section()
    assert set(section) - {"kind", "num_layers", "draft_vocab_size", "feature_layers", "bias", "mask_token_id"} == \
        ({kind} if ks.options is not None else set())
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({"head": section}))
    recipe = load_config(Recipe, tmp_path / "r.yaml")
    assert recipe.head == spec and config_to_dict(recipe)["head"] == section


@pytest.mark.parametrize("kind", KINDS)
def test_the_kind_alone_is_a_valid_head(kind):
    """`head.kind=<kind>` with nothing else builds (the kind's defaults pass its own check), and a recipe that only
    picks the kind differs from the defaults in head.kind alone (what train prints, config.format_changes)."""
    from specheads.config import load_config, non_default_settings
    from specheads.train.recipe import Recipe

    spec = HeadSpec(kind=kind)
    assert spec.kind == kind
    assert kind_spec(kind).family != "block" or spec.num_drafts >= 1
    recipe = load_config(Recipe, None, [f"head.kind={kind}"])
    assert set(non_default_settings(recipe)) <= {"head.kind"}


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_round_trip(kind, tiny, tmp_path):
    head = make_head(tiny, kind)
    head.save_pretrained(tmp_path / "h")
    loaded = load_head(tmp_path / "h", tiny)
    assert type(loaded) is type(head)
    assert loaded.config.to_dict() == json.loads(json.dumps(head.config.to_dict()))  # as config.json holds it
    want = head.state_dict()
    assert set(loaded.state_dict()) == set(want)
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())


def train_one_step(kind: str, target, out):
    """One optimizer step of the real Trainer on the kind's example head -> (head, names of the changed tensors);
    train_checked asserts those are exactly the trainable parameters and the target is bit-identical."""
    from specheads.config import load_config
    from specheads.train.recipe import Recipe
    from tests.test_dspark import _greedy_samples
    from tests.trained import train_checked

    ks = kind_spec(kind)
    keys = [f"head.{k}={json.dumps(v)}" for k, v in ks.example.items()]
    keys += [f"train.{k}={json.dumps(v)}" for k, v in ks.example_train.items()]
    recipe = load_config(Recipe, None, [
        f"output_dir={out}", "seed=0", f"head.kind={kind}", *keys, "train.tracker=none", "train.batch_size=2",
        "train.lr=1e-2", "train.warmup_steps=0", "train.max_steps=1", "eval.every_steps=0", "eval.at_start=false",
        "eval.max_samples=2"])
    data, val = _greedy_samples(target, 4, T=20), _greedy_samples(target, 2, T=20, seed=1)
    torch.manual_seed(0)
    head = build_head(recipe.head, target)
    _, changed = train_checked(recipe, target, head, data, val)
    return head, changed


@pytest.mark.parametrize("kind", KINDS)
def test_one_step_moves_the_head_and_not_the_target(kind, tiny, tmp_path):
    head, changed = train_one_step(kind, tiny, tmp_path)
    assert changed  # and (train_checked) every trainable parameter, nothing else, the target untouched
    assert load_head(tmp_path / "final", tiny).kind == kind


def check_greedy_exact(target, head, tree: str | None) -> None:
    """fp32 greedy output through the kind's drafter equals plain greedy decoding, single and batched."""
    from specheads.infer.drafters import build_drafter
    from specheads.infer.engine.batch import generate_batch
    from specheads.infer.engine.generate import generate
    from tests.test_batch import mixed_prompts
    from tests.test_generate import hf_greedy

    ps = mixed_prompts(target.vocab_size, 4)
    refs = [hf_greedy(target, p, 12) for p in ps]
    drafted = 0
    for p, ref in zip(ps, refs):
        r = generate(target, build_drafter(target, head, tree), p, max_new_tokens=12)
        assert r.ids == ref
        drafted += r.stats.tree_nodes - r.stats.target_forwards
    assert drafted > 0  # drafts were verified, not only the root
    res = generate_batch(target, lambda: build_drafter(target, head, tree), ps, 12, batch_size=3)
    assert [row.ids for row in res.rows] == refs


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_serving_is_exact_single_and_batched(kind, tiny):
    check_greedy_exact(tiny, make_head(tiny, kind), serve_tree(kind))


def check_exports(target, head, head_dir, out_root) -> dict[str, str]:
    """Every non-native format: the kind's own formats export and read back to the same tensors, the others are
    refused with one line naming the format and nothing is written. Returns format -> "ok" | the refusal."""
    from specheads.heads.export import FORMATS, export_head, import_head

    ks, seen = kind_spec(head.kind), {}
    want = head.state_dict()
    for fmt in FORMATS:
        if fmt in ("native", "gguf"):  # native: the round trip above; gguf: test_gguf_is_drafted_or_refused
            continue
        out = out_root / fmt
        if fmt not in ks.formats:
            with pytest.raises(SpecheadsError, match=f"--format {fmt}: ") as e:
                export_head(head_dir, fmt, out, target=target)
            assert "\n" not in str(e.value) and not out.exists()
            seen[fmt] = str(e.value)
            continue
        export_head(head_dir, fmt, out, target=target)
        back = import_head(out, target)
        assert back.kind == head.kind
        got = back.state_dict()
        common = set(got) & set(want)
        assert common, f"{fmt}: no tensor read back"
        for k in common:
            assert torch.allclose(got[k].float(), want[k].float()), (fmt, k)
        seen[fmt] = "ok"
    return seen


@pytest.mark.parametrize("kind", KINDS)
def test_every_export_format_round_trips_or_is_refused(kind, tiny, tmp_path):
    head = make_head(tiny, kind)
    head.save_pretrained(tmp_path / "h")
    seen = check_exports(tiny, head, tmp_path / "h", tmp_path)
    assert {f for f, v in seen.items() if v == "ok"} == set(kind_spec(kind).formats)


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_is_drafted_or_refused_with_the_reason(kind, tiny, tmp_path):
    from specheads.heads.base import read_head_config
    from specheads.heads.gguf import _draft_kind

    ks = kind_spec(kind)
    make_head(tiny, kind).save_pretrained(tmp_path / "h")
    cfg = read_head_config(tmp_path / "h")
    if ks.gguf is not None:
        assert _draft_kind(cfg, tmp_path / "h") is resolve(ks.gguf)
        return
    with pytest.raises(SpecheadsError, match=f"holds a {kind} head; llama.cpp drafts with") as e:
        _draft_kind(cfg, tmp_path / "h")
    assert ks.not_drafted in str(e.value)


def test_the_old_tables_are_views_of_the_registry():
    """HEAD_CLASSES, HEAD_KINDS, BLOCK_KINDS, KINDS, DEFAULT_LOSS, KIND_OF_FORMAT, DRAFT_KINDS and NOT_DRAFTED still
    import, and each says what the KindSpecs say (none is kept by hand)."""
    from specheads.heads import base, gguf
    from specheads.heads.export import KIND_OF_FORMAT
    from specheads.train.kinds import KINDS
    from specheads.train.losses import DEFAULT_LOSS

    specs = {k: kind_spec(k) for k in KINDS}
    assert base.HEAD_KINDS == kind_names() == tuple(specs)
    assert {k: getattr(__import__(m, fromlist=[c]), c) for k, (m, c) in base.HEAD_CLASSES.items()} == {
        k: s.head for k, s in specs.items()}
    assert set(base.BLOCK_KINDS) == {k for k, s in specs.items() if s.family == "block"}
    assert DEFAULT_LOSS == {k: s.default_loss for k, s in specs.items()}
    assert {(f, k) for f, ks in KIND_OF_FORMAT.items() for k in ks} == {(f, k) for k, s in specs.items()
                                                                         for f in s.formats}
    assert set(gguf.DRAFT_KINDS) == {k for k, s in specs.items() if s.gguf}
    assert gguf.NOT_DRAFTED == {k: s.not_drafted for k, s in specs.items() if s.not_drafted}
    with pytest.raises(AttributeError):
        base.NO_SUCH_TABLE  # noqa: B018

"""A head kind added as a user adds one: ONE module of their own (written here into tmp_path), loaded the way
`--plugin FILE.py` loads it, with no edit to any package file. It declares its head, its training step, its
drafter and its KindSpec; the kind then builds, saves and loads, trains a step (the head moves, the target does
not), serves exactly in fp32 (single and batched), and every export format refuses it with one line."""
from __future__ import annotations

import textwrap

import pytest

from specheads.heads.kinds import kind_names, unregister_kind

TOY_MODULE = '''
"""A toy head kind: K residual linear maps on the target's final state, read out by the target's lm_head (a
small Medusa without its stack). Served by the Medusa drafter class (composed, not subclassed). Its own setting
is its options section, head.toy in a recipe."""
from dataclasses import dataclass

import torch
from torch import nn

from specheads.heads.base import DraftHead, final_layer
from specheads.heads.kinds import KindSpec, register_kind
from specheads.infer.drafters.medusa import MedusaDrafter
from specheads.infer.drafters.registry import DrafterKind, register_drafter
from specheads.train.kinds import medusa as medusa_steps
from specheads.train.kinds.base import HeadKind


@dataclass
class ToyOptions:
    """head.toy: the toy's own settings."""

    num_heads: int = 3  # K residual maps


class ToyHead(DraftHead):
    kind = "toy"

    def __init__(self, config):
        super().__init__(config)
        D, self.num_heads = config.hidden_size, self.spec.options.num_heads
        self.maps = nn.ModuleList(nn.Linear(D, D) for _ in range(self.num_heads))

    def forward(self, hidden, heads=None):
        """hidden [B,T,D] -> logits [K,B,T,V']."""
        h = hidden.to(self.head_dtype)
        return torch.stack([self.target_lm_logits(h + m(h)) for m in self.maps[:heads]], dim=0)


STEP = HeadKind("toy", medusa_steps.loss, medusa_steps.drafts)  # Medusa's objective over [K,B,T,V'] logits
DRAFTER = register_drafter(DrafterKind("toy", "static", "a toy head",
                                       lambda target, head, spec: MedusaDrafter(head, [list(c) for c in spec.choices]),
                                       default_tree="default", head=True))
KIND = register_kind(KindSpec(
    name="toy", head=ToyHead, family="tree", label="a toy head", feature_layers=final_layer, final_state_only=True,
    train_step=f"{__name__}:STEP", drafter=f"{__name__}:DRAFTER", options=ToyOptions, example={"toy": {"num_heads": 2}},
    not_drafted="a toy: llama.cpp has no graph for it"))
'''


@pytest.fixture
def toy(tmp_path):
    """The user's module, imported as `--plugin toy_kind.py` imports it; unregistered again afterwards."""
    import sys

    from specheads.infer.drafters import DRAFTERS
    from specheads.infer.drafters.plugins import load_plugin

    path = tmp_path / "toy_kind.py"
    path.write_text(textwrap.dedent(TOY_MODULE))
    module = load_plugin(str(path))
    yield module
    unregister_kind("toy")
    DRAFTERS.pop("toy", None)
    sys.modules.pop(module.__name__, None)


def test_toy_kind_registers_from_one_module(toy):
    assert "toy" in kind_names()


def test_toy_kind_saves_loads_trains_and_serves_exactly(toy, tiny, tmp_path):
    from tests.test_kind_contract import check_greedy_exact, make_head, train_one_step

    head, changed = train_one_step("toy", tiny, tmp_path / "run")
    assert {n for n, _ in head.named_parameters()} == changed
    from specheads.heads import load_head

    loaded = load_head(tmp_path / "run" / "final", tiny)
    assert type(loaded).__name__ == "ToyHead"
    check_greedy_exact(tiny, make_head(tiny, "toy"), None)


def test_toy_kind_exports_natively_and_refuses_every_other_format(toy, tiny, tmp_path):
    from specheads.heads.base import read_head_config
    from specheads.heads.export import export_head
    from specheads.heads.gguf import _draft_kind
    from specheads.utils import SpecheadsError
    from tests.test_kind_contract import check_exports, make_head

    head = make_head(tiny, "toy")
    head.save_pretrained(tmp_path / "h")
    seen = check_exports(tiny, head, tmp_path / "h", tmp_path / "out")
    assert seen and all(v != "ok" and "holds a toy head" in v for v in seen.values())
    export_head(tmp_path / "h", "native", tmp_path / "native")
    assert read_head_config(tmp_path / "native").kind == "toy"
    with pytest.raises(SpecheadsError, match="a toy: llama.cpp has no graph for it"):
        _draft_kind(read_head_config(tmp_path / "h"), tmp_path / "h")


def test_a_kind_name_is_registered_once(toy):
    """Another module cannot take a registered kind's name (a user's kind never replaces the package's)."""
    import dataclasses

    from specheads.heads.kinds import kind_spec, register_kind

    with pytest.raises(ValueError, match="register_kind medusa: already registered by specheads.heads.medusa"):
        register_kind(dataclasses.replace(toy.KIND, name="medusa"))
    assert kind_spec("medusa").head.__name__ == "MedusaHead"


def test_toy_kind_declares_its_own_recipe_section(toy, tiny, tmp_path):
    """The toy's options are a recipe section of its own (head.toy), from a file and from a dotted override, written
    back in that form to config.json and read from it; no shared module names it."""
    import json

    from specheads.config import load_config
    from specheads.heads import build_head, load_head
    from specheads.train.recipe import Recipe
    from specheads.utils import SpecheadsError

    (tmp_path / "r.yaml").write_text("head:\n  kind: toy\n  toy:\n    num_heads: 2\n")
    recipe = load_config(Recipe, tmp_path / "r.yaml", ["head.toy.num_heads=5"])
    assert type(recipe.head.options).__name__ == "ToyOptions" and recipe.head.options.num_heads == 5
    head = build_head(recipe.head, tiny)
    assert len(head.maps) == 5
    head.save_pretrained(tmp_path / "h")
    spec = json.loads((tmp_path / "h" / "config.json").read_text())["spec"]
    assert spec["toy"] == {"num_heads": 5} and "num_heads" not in spec
    assert load_head(tmp_path / "h", tiny).spec.options.num_heads == 5
    with pytest.raises(SpecheadsError, match=r"head\.toy: the section of kind toy, and head\.kind is 'medusa'"):
        load_config(Recipe, None, ["head.kind=medusa", "head.toy.num_heads=2"])

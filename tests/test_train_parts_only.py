"""Training without the target's decoder layers (issue 50, point 3): prepare on the full tiny target's folder, train
offline on a copy of it holding no `model.layers.*` tensor, and get the same head, bit for bit, as training with the
whole target; what asks for the decoder gets one clear line."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specheads.utils import SpecheadsError

KINDS = {"eagle3": ["head.kind=eagle3", "head.feature_layers=[1,2,3]", "head.draft_vocab_size=64",
                    "head.ttt_steps=2"],
         "dspark": ["head.kind=dspark", "head.dspark.block_size=3", "head.feature_layers=[1,2,3]",
                    "head.draft_vocab_size=64", "train.block.max_anchors=4"],
         "medusa": ["head.kind=medusa", "head.medusa.num_heads=2", "head.draft_vocab_size=64"]}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, smol_tokenizer):
    """(full, stripped): the tiny target (4 layers, hidden 64, SmolLM2's vocabulary and tokenizer) as an HF folder,
    and a copy of it without any decoder-layer tensor."""
    from specheads.target import tiny_target

    root = tmp_path_factory.mktemp("targets")
    t = tiny_target(vocab_size=len(smol_tokenizer), tokenizer=smol_tokenizer)
    full, stripped = root / "full", root / "stripped"
    t.model.save_pretrained(full)
    smol_tokenizer.save_pretrained(full)
    stripped.mkdir()
    for f in full.iterdir():
        if f.name != "model.safetensors":
            (stripped / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(full / "model.safetensors"))
    kept = {k: v for k, v in weights.items() if not k.startswith("model.layers.")}
    assert len(kept) < len(weights) and not any(".layers." in k for k in kept)
    save_file(kept, str(stripped / "model.safetensors"), metadata={"format": "pt"})
    return full, stripped


def _conversations(tmp_path, n=16):
    rows = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"Question {i}: " + "why? " * (i % 5)},
                                              {"from": "gpt", "value": f"Answer {i}. " + "Because. " * (i % 7 + 1)}]}
            for i in range(n)]
    p = tmp_path / "convs.json"
    p.write_text(json.dumps(rows))
    return p


def _recipe(*overrides):
    from specheads.config import load_config
    from specheads.train.recipe import Recipe

    base = ["seed=0", "train.tracker=none", "train.batch_size=2", "train.lr=1e-2", "train.warmup_steps=1",
            "train.log_every=1", "train.max_steps=3", "eval.every_steps=2", "eval.max_samples=4",
            "eval.batch_size=2", "data.val_fraction=0.2"]
    return load_config(Recipe, None, base + list(overrides))


@pytest.fixture(scope="module")
def features(tmp_path_factory, folders):
    """Offline features of the full folder at layers 1..4 (every kind below reads them)."""
    from specheads.train.prepare import prepare

    tmp = tmp_path_factory.mktemp("prep")
    recipe = _recipe(f"output_dir={tmp / 'run'}", f"target.name={folders[0]}", f"data.source={_conversations(tmp)}",
                     "data.max_length=48", "features.shard_tokens=120", "features.batch_tokens=96",
                     "features.layers=[1,2,3]", "head.kind=eagle3")
    prepare(recipe, progress=False)
    feat = tmp / "run" / "features"
    assert (feat / "target.json").is_file()
    return feat


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_offline_training_without_decoder_layers_gives_the_same_head(kind, folders, features, tmp_path):
    from specheads.target import load_target
    from specheads.target_parts import PartsTarget
    from specheads.train import parts
    from specheads.train.trainer import run_training

    full, stripped = folders
    common = [f"features.dir={features}", *KINDS[kind]]
    recipe = _recipe(f"output_dir={tmp_path / 'full'}", f"target.name={full}", *common)
    whole = load_target(str(full), dtype=recipe.target.dtype)  # as run_training loads it, decoder included
    res_full = run_training(recipe, target=whole)
    seen = []
    real = parts.training_target
    parts.training_target = lambda r: seen.append(real(r)) or seen[-1]
    try:
        import specheads.train.trainer as trainer_mod

        trainer_mod.training_target = parts.training_target
        res_parts = run_training(_recipe(f"output_dir={tmp_path / 'parts'}", f"target.name={stripped}", *common))
    finally:
        parts.training_target = real
        trainer_mod.training_target = real
    assert isinstance(seen[0], PartsTarget) and res_parts.steps == res_full.steps == 3
    a = load_file(str(tmp_path / "full" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "parts" / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ca = json.loads((tmp_path / "full" / "final" / "config.json").read_text())
    cb = json.loads((tmp_path / "parts" / "final" / "config.json").read_text())
    assert ca["target_record"] == cb["target_record"] and ca["fingerprint"] == cb["fingerprint"]
    assert res_full.history == res_parts.history  # the evaluation (held-out walk) read the same figures


def test_parts_target_refuses_the_decoder_in_one_line(folders):
    from specheads.target_parts import load_target_parts

    t = load_target_parts(str(folders[1]))
    assert t.num_layers == 4 and t.vocab_size == t.embed_tokens.weight.shape[0] and t.final_norm is not None
    assert not any(".layers." in n for n, _ in t.model.named_parameters())
    for ask in (lambda: t.base.layers, lambda: t.base(input_ids=torch.tensor([[1, 2]])),
                lambda: t.model(torch.tensor([[1]]))):
        with pytest.raises(SpecheadsError, match="needs the target's decoder layers, which offline training"):
            ask()
    with pytest.raises(SpecheadsError, match="lacks 36 of the model's tensors .*specheads prepare"):
        t.record()  # no features folder bound: the stripped folder cannot give the full record


def test_parts_of_the_full_folder_equal_the_whole_target(folders):
    from specheads.target import load_target
    from specheads.target_parts import load_target_parts

    for dtype in ("float32", "bfloat16"):
        p, w = load_target_parts(str(folders[0]), dtype), load_target(str(folders[0]), dtype)
        assert torch.equal(p.embed_tokens.weight, w.embed_tokens.weight) and p.dtype == w.dtype
        assert torch.equal(p.lm_head.weight, w.lm_head.weight)
        assert torch.equal(p.final_norm.weight, w.final_norm.weight)
        assert p.fingerprint() == w.fingerprint() and p.record() == w.record()  # sampled from the files


def test_dev_prompts_with_a_stripped_folder_is_one_line(folders, features):
    from specheads.train.parts import training_target

    r = _recipe("output_dir=/nonexistent-out", f"target.name={folders[1]}", f"features.dir={features}",
                "eval.dev_prompts=4", *KINDS["medusa"])
    with pytest.raises(SpecheadsError, match="eval.dev_prompts: the dev set's answers need the target's decoder"):
        training_target(r)

"""Medusa-2: LoRA adapters on the target trained jointly with the heads; the teacher is the same model with adapters
disabled (equal to a separate base copy); heads-only warm-up; adapters exported beside the head."""
from __future__ import annotations

import datasets
import pytest
import torch

from specheads.target import tiny_target
from specheads.utils import SpecheadsError
from test_train import make_head, make_recipe, token_samples


def save_tokens(folder, rows):
    datasets.Dataset.from_dict({"input_ids": [r["input_ids"].tolist() for r in rows],
                                "loss_mask": [r["loss_mask"].tolist() for r in rows],
                                "conversation_id": [f"c{i}" for i in range(len(rows))]}).save_to_disk(str(folder))


def test_teacher_is_the_base_model_and_kl_starts_at_zero():
    from specheads.train.lora import LoraSettings, Medusa2Model, add_adapters, kl_to_teacher

    t, ref = tiny_target(), tiny_target()  # same seed: identical weights
    recipe = make_recipe("/tmp/unused")
    model = Medusa2Model(add_adapters(t, LoraSettings(r=4, alpha=8, dropout=0.0)), make_head(recipe, t))
    with torch.no_grad():  # make the adapters non-trivial
        for n, p in model.peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    ids = torch.randint(3, 256, (2, 12))
    am = torch.ones_like(ids)
    teacher = model.teacher_logits(ids, am)
    assert torch.equal(teacher, ref.model(input_ids=ids, attention_mask=am).logits)
    _, student = model(ids, am)
    assert not torch.allclose(student, teacher)
    assert kl_to_teacher(student, teacher, am) > 0
    assert kl_to_teacher(teacher, teacher, am).abs() < 1e-6


def test_medusa2_trains_adapters_and_heads_with_heads_only_warmup(tmp_path):
    from specheads.heads.base import load_head
    from specheads.train.trainer import run_training

    target = tiny_target()
    save_tokens(tmp_path / "data" / "tokens", token_samples(12))
    recipe = make_recipe(tmp_path, "features.mode=online", "train.lora.enabled=true", "train.lora.r=4",
                         "train.lora.warmup_steps=2", "train.max_steps=4", "train.warmup_steps=0",
                         "data.val_fraction=0.25", "eval.at_start=false", "train.save_every=2")
    base = {n: p.detach().clone() for n, p in target.model.named_parameters()}
    # run the first 2 steps (heads only), then the rest (joint)
    from specheads.train.trainer import Trainer, load_training_data
    from specheads.heads.base import build_head
    from accelerate.utils import set_seed

    train_ds, val_ds, collate, layers, extract = load_training_data(recipe, target)
    set_seed(0)
    head = build_head(recipe.head, target)
    tr = Trainer(recipe, target, head, train_ds, val_ds, collate_fn=collate, layers=layers, extract_fn=extract)
    tr.train(stop_after=2)
    lora = {n: p.detach().clone() for n, p in target.model.named_parameters() if "lora_" in n}
    assert lora and all(torch.count_nonzero(v) == 0 for n, v in lora.items() if "lora_B" in n), \
        "adapters moved during the heads-only warm-up"
    # resume as a fresh process would: new target (same base weights), new head, adapters attached again
    target = tiny_target()
    head = build_head(recipe.head, target)
    tr = Trainer(recipe, target, head, train_ds, val_ds, collate_fn=collate, layers=layers, extract_fn=extract)
    res = tr.train(resume=True)
    assert res.steps == 4
    moved = [n for n, p in target.model.named_parameters() if "lora_B" in n and torch.count_nonzero(p) > 0]
    assert moved, "adapters did not train after the warm-up"
    frozen = {n.replace("base_layer.", ""): p for n, p in target.model.named_parameters() if "lora_" not in n}
    assert frozen.keys() == base.keys() and all(torch.equal(frozen[n], base[n]) for n in base), "base weights moved"
    assert (tmp_path / "final" / "adapter" / "adapter_model.safetensors").exists()
    assert type(load_head(tmp_path / "final", tiny_target())).__name__ == "MedusaHead"


def test_lora_needs_medusa_online(tmp_path):
    from specheads.train.trainer import Trainer

    t = tiny_target()
    recipe = make_recipe(tmp_path, "train.lora.enabled=true", "features.mode=online", "head.kind=eagle")
    with pytest.raises(SpecheadsError, match="head.kind medusa"):
        Trainer(recipe, t, make_head(recipe, t), token_samples(4)).train()

"""The training engine on a tiny random Llama: a step changes the head and not the target, checkpoints and the best
head load back, resume gives the same weights as an uninterrupted run, a NaN loss stops with the step named."""
from __future__ import annotations

import pytest
import torch

from specheads.config import load_config
from specheads.train.checkpoint import list_checkpoints
from specheads.train.recipe import Recipe
from specheads.train.trainer import Trainer
from specheads.utils import SpecheadsError

V = 256


def token_samples(n: int, T: int = 24, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = T - (i % 3) * 4  # ragged lengths exercise padding
        ids = torch.randint(3, V, (t,), generator=g)
        lm = torch.zeros(t, dtype=torch.long)
        lm[t // 3:] = 1  # "assistant" tail
        out.append({"input_ids": ids, "loss_mask": lm})
    return out


def make_recipe(tmp_path, *overrides: str) -> Recipe:
    """A small recipe: a Medusa head of 2 heads, or the kind an override picks (with that kind's defaults)."""
    kinds = [o.split("=", 1)[1] for o in overrides if o.startswith("head.kind=")]
    own = ["head.medusa.num_heads=2"] if not kinds or kinds[-1] == "medusa" else []
    base = [f"output_dir={tmp_path}", "seed=0", "head.kind=medusa", *own, "train.tracker=none",
            "train.batch_size=2", "train.lr=1e-2", "train.warmup_steps=1", "train.log_every=1",
            "eval.every_steps=2", "eval.max_samples=4", "eval.batch_size=2"]
    return load_config(Recipe, None, base + list(overrides))


def make_head(recipe, target):
    from specheads.heads.base import build_head

    torch.manual_seed(recipe.seed)
    return build_head(recipe.head, target)


def state(head) -> dict:
    return {k: v.detach().clone() for k, v in head.state_dict().items()}


def test_medusa_step_changes_head_not_target_and_exports(tiny, tmp_path):
    from specheads.heads.base import load_head

    recipe = make_recipe(tmp_path, "train.max_steps=4", "train.save_every=2")
    head = make_head(recipe, tiny)
    before, target_before = state(head), {k: v.clone() for k, v in tiny.model.state_dict().items()}
    res = Trainer(recipe, tiny, head, token_samples(12), token_samples(4, seed=1)).train()
    assert res.steps == 4
    after = state(head)
    assert any(not torch.equal(before[k], after[k]) for k in before), "trainable parameters did not change"
    assert all(torch.equal(v, tiny.model.state_dict()[k]) for k, v in target_before.items()), "target changed"
    assert (tmp_path / "train_config.yaml").exists()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000002", "step-000004"]
    assert not list((tmp_path / "checkpoints").glob(".*tmp*"))  # no half-written folders left
    for name in ("best", "final"):
        loaded = load_head(tmp_path / name, tiny)
        assert type(loaded).__name__ == "MedusaHead"
    final = load_head(tmp_path / "final", tiny)
    assert all(torch.equal(final.state_dict()[k], after[k]) for k in after)
    assert [h["step"] for h in res.history] == [0, 2, 4]  # baseline, interval, end
    assert {"tau_chain", "tau_tree", "top1_0", "top5_1"} <= set(res.history[-1])
    assert res.history[0]["tau_chain"] >= 1.0


def test_keep_last_prunes(tiny, tmp_path):
    recipe = make_recipe(tmp_path, "train.max_steps=6", "train.save_every=1", "train.keep_last=2", "eval.every_steps=0",
                         "eval.at_start=false")
    Trainer(recipe, tiny, make_head(recipe, tiny), token_samples(12), None).train()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000005", "step-000006"]
    with pytest.raises(SpecheadsError, match="--resume"):  # a fresh run never mixes with an earlier run's checkpoints
        Trainer(recipe, tiny, make_head(recipe, tiny), token_samples(12), None).train()


def test_resume_gives_same_weights(tiny, tmp_path):
    # 10 samples, batch 2, grad accum 2: 5 micro-batches = 3 steps per epoch (the last one short); 7 steps: 3 epochs
    over = ["train.max_steps=7", "train.save_every=2", "train.grad_accum=2", "eval.every_steps=3", "eval.max_samples=2"]
    data, val = token_samples(10), token_samples(4, seed=1)
    a = make_recipe(tmp_path / "a", *over)
    head_a = make_head(a, tiny)
    Trainer(a, tiny, head_a, data, val).train()

    b = make_recipe(tmp_path / "b", *over)
    res = Trainer(b, tiny, make_head(b, tiny), data, val).train(stop_after=4)  # "killed" after step 4's checkpoint
    assert res.steps == 4 and list_checkpoints(tmp_path / "b")[-1].name == "step-000004"
    torch.manual_seed(123)  # a fresh process: different RNG, different initial head
    head_b = make_head(b, tiny)
    with torch.no_grad():
        for p in head_b.parameters():
            p.add_(1.0)
    res = Trainer(b, tiny, head_b, data, val).train(resume=True)
    assert res.steps == 7
    sa, sb = state(head_a), state(head_b)
    diff = max((sa[k] - sb[k]).abs().max().item() for k in sa)
    assert diff == 0.0, f"resumed run differs from the uninterrupted one by {diff}"


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tiny, tmp_path, monkeypatch):
    import specheads.train.steps as steps

    real = steps.train_loss
    calls = {"n": 0}

    def flaky(*a, **k):
        out = real(*a, **k)
        calls["n"] += 1
        if calls["n"] == 3:
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(steps, "train_loss", flaky)
    recipe = make_recipe(tmp_path, "train.max_steps=6", "train.save_every=2", "eval.at_start=false")
    with pytest.raises(SpecheadsError, match=r"loss is nan at step 3.*step-000002"):
        Trainer(recipe, tiny, make_head(recipe, tiny), token_samples(12), None).train()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000002"]
    assert not (tmp_path / "final").exists()


def test_train_config_rejects_bad_values(tmp_path):
    with pytest.raises(SpecheadsError, match="train.tracker"):
        make_recipe(tmp_path, "train.tracker=mlflow")
    with pytest.raises(SpecheadsError, match="unknown key"):
        make_recipe(tmp_path, "train.learning_rate=1")


@pytest.mark.parametrize("case", ["eagle", "eagle-draft-vocab", "eagle3", "medusa", "domino", "peagle"])
def test_other_kinds_train_and_evaluate(tiny, tmp_path, case):
    kind = case.split("-")[0]
    extra = {"eagle3": ["head.draft_vocab_size=64", "head.ttt_steps=2"], "eagle": ["eval.eagle_steps=2"],
             "eagle-draft-vocab": ["eval.eagle_steps=2", "head.draft_vocab_size=64"],  # CE over the draft vocab
             "medusa": ["head.draft_vocab_size=64"],  # Medusa over a draft vocab: labels mapped / masked
             "domino": ["head.block_size=3", "head.markov_rank=0", "head.confidence_head=false",
                        "head.feature_layers=[1,2,3]", "head.domino_gru_hidden=8", "head.domino_emb_dim=8",
                        "head.draft_vocab_size=64", "train.block.max_anchors=4"],
             "peagle": ["head.num_layers=2", "head.num_depths=3", "head.draft_vocab_size=64"]}[case]
    recipe = make_recipe(tmp_path, f"head.kind={kind}", "train.max_steps=2", "eval.at_start=false", *extra)
    head = make_head(recipe, tiny)
    before = state(head)
    res = Trainer(recipe, tiny, head, token_samples(8), token_samples(4, seed=1)).train()
    after = state(head)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed and not any(k in ("d2t", "t2d") for k in changed)
    m = res.history[-1]
    assert {"top1_0", "top1_1", "tau_chain", "tau_tree"} <= set(m) and 1.0 <= m["tau_chain"] <= 3.0


def test_run_training_online_from_prepared_tokens(tiny, tmp_path):
    import datasets

    from specheads.heads.base import load_head
    from specheads.train.trainer import run_training

    rows = token_samples(12)
    ds = datasets.Dataset.from_dict({"input_ids": [r["input_ids"].tolist() for r in rows],
                                     "loss_mask": [r["loss_mask"].tolist() for r in rows],
                                     "conversation_id": [f"c{i}" for i in range(12)]})
    ds.save_to_disk(str(tmp_path / "data" / "tokens"))
    recipe = make_recipe(tmp_path, "features.mode=online", "train.max_steps=2", "data.val_fraction=0.3",
                         "head.kind=eagle3", "head.draft_vocab_size=32", "head.ttt_steps=2")
    res = run_training(recipe, target=tiny)
    assert res.steps == 2 and res.history
    head = load_head(tmp_path / "best", tiny)
    counts = torch.zeros(V, dtype=torch.long)
    for r in rows:
        counts += torch.bincount(r["input_ids"][r["loss_mask"].bool()], minlength=V)
    assert set(head.d2t.tolist()) <= set(counts.nonzero().flatten().tolist())  # draft vocab from assistant tokens


def test_offline_features_missing_is_a_clear_error(tiny, tmp_path):
    from specheads.train.trainer import run_training

    with pytest.raises(SpecheadsError, match="specheads prepare"):
        run_training(make_recipe(tmp_path), target=tiny)


def test_wandb_offline_without_api_key_lands_under_output_dir(tiny, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for k in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR"):
        monkeypatch.setenv(k, "")  # recorded, so that teardown restores the original state ...
        monkeypatch.delenv(k)  # ... after the trainer sets WANDB_MODE / WANDB_DIR itself
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    recipe = make_recipe(tmp_path, "train.tracker=wandb", "train.max_steps=2", "eval.at_start=false")
    Trainer(recipe, tiny, make_head(recipe, tiny), token_samples(8), token_samples(2, seed=1)).train()
    import os

    assert os.environ["WANDB_MODE"] == "offline"
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs, f"no offline run under {tmp_path / 'wandb'}"

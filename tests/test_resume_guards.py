"""Run-folder guards (issue 28): a resume never continues with settings that change what its checkpoints mean, and
records the settings it may change; a fresh run never replaces a trained run's heads; `prepare` never mixes data,
split, target or layers into a prepared run without --overwrite."""
from __future__ import annotations

import json
import shutil

import pytest
import yaml

from test_train import make_head, make_recipe, token_samples

from specheads.train.trainer import Trainer
from specheads.utils import SpecheadsError

OVER = ["train.max_steps=4", "train.save_every=2", "eval.every_steps=0", "eval.at_start=false"]


def _stopped_run(tiny, run, *extra):
    r = make_recipe(run, *OVER, *extra)
    Trainer(r, tiny, make_head(r, tiny), token_samples(8), None).train(stop_after=2)
    return r


def _files(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("changed,key", [
    (["train.batch_size=4"], "train.batch_size 2 -> 4"),
    (["seed=1"], "seed 0 -> 1"),
    (["train.lr=0.05"], "train.lr 0.01 -> 0.05"),
    (["train.grad_accum=2"], "train.grad_accum 1 -> 2"),
    (["data.max_length=64"], "data.max_length 2048 -> 64"),
    (["head.medusa.num_heads=3"], "head.medusa.num_heads 2 -> 3"),
    (["target.dtype=float32"], "target.dtype 'bfloat16' -> 'float32'"),
    (["features.layers=[1]"], "features.layers None -> [1]"),
], ids=["batch_size", "seed", "lr", "grad_accum", "data", "head", "target", "features"])
def test_resume_refuses_settings_that_change_what_the_checkpoints_mean(tiny, tmp_path, changed, key):
    run = tmp_path / "run"
    _stopped_run(tiny, run)
    before = _files(run)
    r = make_recipe(run, *OVER, *changed)
    with pytest.raises(SpecheadsError) as e:
        Trainer(r, tiny, make_head(make_recipe(run, *OVER), tiny), token_samples(8), None).train(resume=True)
    msg = str(e.value)
    assert "\n" not in msg and key in msg and "another output_dir" in msg and "train_config.yaml" in msg
    assert _files(run) == before  # train_config.yaml (the record of steps 1-2) unchanged, nothing written


def test_resume_names_every_refused_key(tiny, tmp_path):
    run = tmp_path / "run"
    _stopped_run(tiny, run)
    r = make_recipe(run, *OVER, "train.batch_size=4", "seed=3", "train.max_steps=6")
    with pytest.raises(SpecheadsError, match=r"seed 0 -> 3.*train.batch_size 2 -> 4") as e:
        Trainer(r, tiny, make_head(r, tiny), token_samples(8), None).train(resume=True)
    assert "max_steps" not in str(e.value)  # allowed: not named among the refused ones


def test_resume_records_the_settings_it_may_change(tiny, tmp_path):
    run = tmp_path / "run"
    _stopped_run(tiny, run)
    first = (run / "train_config.yaml").read_text()
    r = make_recipe(run, *OVER, "train.max_steps=6", "eval.every_steps=3")
    r_stop = Trainer(r, tiny, make_head(r, tiny), token_samples(8), None).train(resume=True, stop_after=4)
    assert r_stop.steps == 4
    assert (run / "train_config.yaml").read_text() == first  # the first segment's recipe is kept
    r2 = make_recipe(run, *OVER, "train.max_steps=8", "eval.every_steps=3", "train.log_every=2")
    assert Trainer(r2, tiny, make_head(r2, tiny), token_samples(8), None).train(resume=True).steps == 8
    assert (run / "train_config.yaml").read_text() == first
    assert yaml.safe_load(first)["train"]["max_steps"] == 4
    hist = yaml.safe_load((run / "train_config_history.yaml").read_text())
    assert [h["resumed_at_step"] for h in hist] == [2, 4]
    assert [h["checkpoint"] for h in hist] == ["step-000002", "step-000004"]
    assert hist[0]["changed"] == {"eval.every_steps": [0, 3], "train.max_steps": [4, 6]}
    assert hist[1]["changed"] == {"train.log_every": [1, 2], "train.max_steps": [6, 8]}  # against the last segment
    assert all(h["time"] for h in hist)


def test_resume_without_changes_records_an_empty_segment(tiny, tmp_path):
    run = tmp_path / "run"
    r = _stopped_run(tiny, run)
    Trainer(r, tiny, make_head(r, tiny), token_samples(8), None).train(resume=True)
    hist = yaml.safe_load((run / "train_config_history.yaml").read_text())
    assert len(hist) == 1 and hist[0]["resumed_at_step"] == 2 and hist[0]["changed"] == {}


@pytest.mark.parametrize("left", ["best", "final", "train_summary.json"])
def test_fresh_train_into_a_trained_run_without_checkpoints_is_refused(tiny, tmp_path, left):
    run = tmp_path / "run"
    r = make_recipe(run, *OVER)
    Trainer(r, tiny, make_head(r, tiny), token_samples(8), token_samples(2, seed=1)).train()
    shutil.rmtree(run / "checkpoints")
    for name in {"best", "final", "train_summary.json"} - {left}:
        p = run / name
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    before = _files(run)
    with pytest.raises(SpecheadsError) as e:
        Trainer(r, tiny, make_head(r, tiny), token_samples(8), None).train()
    msg = str(e.value)
    assert "\n" not in msg and left in msg and "another output_dir" in msg and "remove" in msg
    assert _files(run) == before


def test_fresh_train_after_the_outputs_were_removed_starts_over(tiny, tmp_path):
    run = tmp_path / "run"
    _stopped_run(tiny, run)
    r = make_recipe(run, *OVER, "train.max_steps=6")
    Trainer(r, tiny, make_head(r, tiny), token_samples(8), None).train(resume=True)
    assert (run / "train_config_history.yaml").exists()
    for name in ("checkpoints", "final"):
        shutil.rmtree(run / name)
    (run / "train_summary.json").unlink()
    r2 = make_recipe(run, *OVER, "seed=5")
    assert Trainer(r2, tiny, make_head(r2, tiny), token_samples(8), None).train().steps == 4
    assert yaml.safe_load((run / "train_config.yaml").read_text())["seed"] == 5
    assert not (run / "train_config_history.yaml").exists()  # the history of the removed run went with it
    assert json.loads((run / "train_summary.json").read_text())["steps"] == 4


def test_cli_resume_with_another_batch_size_is_one_line(tiny, tmp_path, monkeypatch, capsys):
    """Through `specheads train --resume`: exit 2, one line naming the key and its values."""
    import specheads.train.trainer as trainer_mod
    from specheads.cli import main

    run = tmp_path / "run"
    _stopped_run(tiny, run)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"output_dir": str(run)}))

    def fake_run_training(rc, resume=False, target=None):
        return Trainer(rc, tiny, make_head(rc, tiny), token_samples(8), None).train(resume=resume)

    monkeypatch.setattr(trainer_mod, "run_training", fake_run_training)
    capsys.readouterr()  # the first segment's progress bar
    base = ["seed=0", "head.kind=medusa", "head.num_heads=2", "train.tracker=none", "train.lr=1e-2",
            "train.warmup_steps=1", "train.log_every=1", "eval.max_samples=4", "eval.batch_size=2", *OVER]
    assert main(["train", "--config", str(recipe), *base, "train.batch_size=3", "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train.batch_size 2 -> 3" in err


def _as_old_flat_keys(run):
    """Rewrite the run's train_config.yaml (and history) with the flat train keys runs wrote before the sections
    (train.block_gamma, train.lora, train.lora_merge, ...)."""
    from specheads.train.settings import TrainConfig

    path = run / "train_config.yaml"
    data = yaml.safe_load(path.read_text())
    train = data["train"]
    for old, new in TrainConfig.RENAMED_KEYS.items():
        section, key = new.split(".")
        train[f"_{old}"] = train[section][key]
    for section in {new.split(".")[0] for new in TrainConfig.RENAMED_KEYS.values()}:
        del train[section]
    data["train"] = {k.lstrip("_"): v for k, v in train.items()}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert "block_gamma: 4.0" in path.read_text() and "lora: false" in path.read_text()


def test_a_run_written_with_the_old_flat_keys_resumes_and_guards_the_new_names(tiny, tmp_path):
    run = tmp_path / "run"
    _stopped_run(tiny, run)
    _as_old_flat_keys(run)
    old = (run / "train_config.yaml").read_text()
    for changed, key in [("train.block.gamma=3", "train.block.gamma 4.0 -> 3.0"),
                         ("train.lora.lm_loss_weight=2", "train.lora.lm_loss_weight 1.0 -> 2.0"),
                         ("train.medusa.soft_labels=true", "train.medusa.soft_labels False -> True")]:
        r = make_recipe(run, *OVER, changed)
        with pytest.raises(SpecheadsError) as e:
            Trainer(r, tiny, make_head(r, tiny), token_samples(8), None).train(resume=True)
        assert key in str(e.value) and "train_config.yaml" in str(e.value)
    # train.lora.merge may change on resume, as train.lora_merge could; the history names it by its new name
    r = make_recipe(run, *OVER, "train.max_steps=6", "train.lora.merge=false")
    assert Trainer(r, tiny, make_head(r, tiny), token_samples(8), None).train(resume=True, stop_after=4).steps == 4
    hist = yaml.safe_load((run / "train_config_history.yaml").read_text())
    assert hist[0]["changed"] == {"train.max_steps": [4, 6]}  # the old keys compared equal under their new names
    assert (run / "train_config.yaml").read_text() == old  # the record is kept as written
    # an older history that recorded train.lora_merge is read under train.lora.merge
    hist[0]["changed"]["train.lora_merge"] = [False, True]
    (run / "train_config_history.yaml").write_text(yaml.safe_dump(hist))
    r = make_recipe(run, *OVER, "train.max_steps=6", "train.lora.merge=true")
    Trainer(r, tiny, make_head(r, tiny), token_samples(8), None).train(resume=True)
    hist = yaml.safe_load((run / "train_config_history.yaml").read_text())
    assert hist[-1]["changed"] == {}  # train.lora.merge is already true since the last segment


# ------------------------------------------------------------------------------------------------------ prepare
from test_prepare import _recipe, _sharegpt_file, _tree_state, tiny_chat  # noqa: E402,F401 (tiny_chat: fixture)


def _prepared(tiny_chat, tmp_path, *extra):
    from specheads.train.prepare import prepare

    prepare(_recipe(tmp_path, _sharegpt_file(tmp_path), *extra), target=tiny_chat, progress=False)
    return tmp_path / "run"


@pytest.mark.parametrize("changed,match", [
    (["data.val_fraction=0.5"], r"split with data.val_fraction 0.2 \(manifest.json\), not 0.5.*--overwrite"),
    (["features.layers=[1]"], "holds features of other data, target or layers"),
    (["data.max_length=40"], "holds features of other data, target or layers"),
], ids=["val_fraction", "layers", "data"])
def test_prepare_of_another_split_or_layers_is_refused_unless_overwrite(tiny_chat, tmp_path, changed, match):
    from specheads.train.prepare import prepare

    run = _prepared(tiny_chat, tmp_path)
    before = _tree_state(run)
    recipe = _recipe(tmp_path, _sharegpt_file(tmp_path), *changed)
    with pytest.raises(SpecheadsError, match=match) as e:
        prepare(recipe, target=tiny_chat, progress=False)
    assert "\n" not in str(e.value)
    assert _tree_state(run) == before  # tokens and features unchanged
    prepare(recipe, target=tiny_chat, progress=False, overwrite=True)
    manifest = json.loads((run / "features" / "manifest.json").read_text())
    assert manifest["val_fraction"] == recipe.data.val_fraction and manifest["complete"]
    recorded = yaml.safe_load((run / "prepare_config.yaml").read_text())
    assert recorded["data"]["max_length"] == recipe.data.max_length and recorded["features"]["layers"] == \
        recipe.features.layers


def test_prepare_of_another_target_is_refused_unless_overwrite(tiny_chat, tmp_path):
    from specheads.target import tiny_target
    from specheads.train.prepare import prepare

    run = _prepared(tiny_chat, tmp_path)
    before = _tree_state(run)
    other = tiny_target(vocab_size=len(tiny_chat.tokenizer), tokenizer=tiny_chat.tokenizer, seed=1)
    recipe = _recipe(tmp_path, _sharegpt_file(tmp_path))
    with pytest.raises(SpecheadsError, match="holds features of target"):
        prepare(recipe, target=other, progress=False)
    assert _tree_state(run) == before
    prepare(recipe, target=other, progress=False, overwrite=True)
    assert json.loads((run / "features" / "manifest.json").read_text())["fingerprint"] == other.fingerprint()


def test_online_prepare_of_other_data_keeps_the_tokens_unless_overwrite(tiny_chat, tmp_path):
    import datasets

    from specheads.train.prepare import prepare

    run = _prepared(tiny_chat, tmp_path, "features.mode=online")
    before = _tree_state(run)
    (tmp_path / "other").mkdir()
    recipe = _recipe(tmp_path, _sharegpt_file(tmp_path / "other", 9), "features.mode=online")
    with pytest.raises(SpecheadsError, match=r"data/tokens: holds tokens of other data.*--overwrite"):
        prepare(recipe, target=tiny_chat, progress=False)
    assert _tree_state(run) == before
    prepare(_recipe(tmp_path, _sharegpt_file(tmp_path), "features.mode=online"), target=tiny_chat, progress=False)
    assert _tree_state(run).keys() == before.keys()  # the same data again: a rerun, allowed
    prepare(recipe, target=tiny_chat, progress=False, overwrite=True)
    assert len(set(datasets.load_from_disk(str(run / "data" / "tokens"))["conversation_id"])) == 9


def test_prepare_overwrite_says_what_it_removes_and_never_touches_a_trained_run(tiny_chat, tmp_path, caplog):
    from specheads.train.prepare import prepare

    run = _prepared(tiny_chat, tmp_path)
    recipe = _recipe(tmp_path, _sharegpt_file(tmp_path), "data.val_fraction=0.5")
    with caplog.at_level("WARNING"):
        prepare(recipe, target=tiny_chat, progress=False, overwrite=True)
    lines = [r.getMessage() for r in caplog.records if "--overwrite" in r.getMessage()]
    assert len(lines) == 1 and all(str(run / n) in lines[0] for n in ("features", "data", "prepare_config.yaml"))
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    before = _tree_state(run)
    with pytest.raises(SpecheadsError, match=r"--overwrite: .* holds a trained run \(checkpoints\)"):
        prepare(_recipe(tmp_path, _sharegpt_file(tmp_path)), target=tiny_chat, progress=False, overwrite=True)
    assert _tree_state(run) == before


def test_cli_prepare_has_overwrite(tmp_path, capsys):
    from specheads.cli import main

    with pytest.raises(SystemExit):
        main(["prepare", "--help"])
    assert "--overwrite" in capsys.readouterr().out


def test_train_refuses_features_split_otherwise_than_the_recipe(tiny_chat, tmp_path):
    """A fresh train whose data.val_fraction differs from its own features' split is one line, not a silent
    evaluation on the manifest's split."""
    from specheads.train.prepare import prepare
    from specheads.train.trainer import run_training

    src = _sharegpt_file(tmp_path)
    prepare(_recipe(tmp_path, src), target=tiny_chat, progress=False)
    with pytest.raises(SpecheadsError, match="split with data.val_fraction 0.2"):
        run_training(_recipe(tmp_path, src, "data.val_fraction=0.3", "train.max_steps=1"), target=tiny_chat)

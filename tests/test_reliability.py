"""Nothing lost, nothing executed, nothing silently wrong (issue 17): export never deletes what --out holds or the
source, bad values name the flag / file / key, damaged weights and shards are caught, a refused train leaves the run
folder as it was, a run without a held-out split says that best/ is not written."""
from __future__ import annotations

import json
import os

import pytest

from test_train import make_head, make_recipe, token_samples

from specheads.heads import HeadSpec, build_head, load_head
from specheads.utils import SpecheadsError

V = 256


def _head(tiny, folder, spec=None):
    head = build_head(spec or HeadSpec(kind="eagle3", feature_layers=[1, 2, 3]), tiny)
    head.save_pretrained(folder)
    return head


def _export(*args) -> tuple[int, str]:
    from specheads import cli

    import io
    import contextlib

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = cli.main(["export", *map(str, args)])
    return rc, err.getvalue()


# ------------------------------------------------------------------------------------------------- export --out

def test_export_refuses_a_non_empty_folder_and_keeps_its_files(tiny, tmp_path):
    _head(tiny, tmp_path / "h")
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    rc, err = _export("--head", tmp_path / "h", "--format", "eagle3", "--out", out)
    assert rc == 2 and "not empty and not an earlier eagle3 export" in err and "--force" in err
    assert (out / "notes.txt").read_text() == "keep me"
    assert _export("--head", tmp_path / "h", "--format", "eagle3", "--out", out, "--force")[0] == 0
    assert not (out / "notes.txt").exists() and (out / "model.safetensors").exists()


def test_export_replaces_an_earlier_export_of_the_same_format_only(tiny, tmp_path):
    _head(tiny, tmp_path / "h")
    out = tmp_path / "sg"
    assert _export("--head", tmp_path / "h", "--format", "eagle3", "--out", out)[0] == 0
    assert _export("--head", tmp_path / "h", "--format", "eagle3", "--out", out)[0] == 0  # re-export: fine
    rc, err = _export("--head", tmp_path / "h", "--format", "speculators", "--out", out)
    assert rc == 2 and "not an earlier speculators export" in err
    (out / "extra.bin").write_bytes(b"x")  # an earlier export with a file of the user's in it: not ours any more
    assert _export("--head", tmp_path / "h", "--format", "eagle3", "--out", out)[0] == 2
    assert (out / "extra.bin").exists()


@pytest.mark.parametrize("where", ["run", "head", "inside"])
def test_export_never_deletes_the_source_even_with_force(tiny, tmp_path, where):
    run = tmp_path / "run"
    _head(tiny, run / "final")
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "keep").write_text("x")
    out = {"run": run, "head": run / "final", "inside": run / "final" / "eagle3"}[where]
    rc, err = _export("--head", run / "final", "--format", "eagle3", "--out", out, "--force")
    assert rc == 2 and "source folder" in err
    assert (run / "checkpoints" / "keep").exists() and load_head(run / "final", tiny).kind == "eagle3"
    assert not (run / "final" / "eagle3").exists()


def test_import_out_is_guarded_too(tiny, tmp_path, monkeypatch):
    _head(tiny, tmp_path / "h")
    assert _export("--head", tmp_path / "h", "--format", "eagle3", "--out", tmp_path / "sg")[0] == 0
    monkeypatch.setattr("specheads.target.load_target", lambda name, dtype="float32", **kw: tiny)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "data.json").write_text("{}")
    rc, err = _export("--import", tmp_path / "sg", "--target", "tiny", "--out", busy)
    assert rc == 2 and "not an earlier native export" in err and (busy / "data.json").exists()
    assert _export("--import", tmp_path / "sg", "--target", "tiny", "--out", tmp_path / "n")[0] == 0
    assert _export("--import", tmp_path / "sg", "--target", "tiny", "--out", tmp_path / "n")[0] == 0  # re-import
    rc, err = _export("--import", tmp_path / "sg", "--target", "tiny", "--out", tmp_path / "sg")
    assert rc == 2 and "source folder" in err


def test_stale_temporary_folders_of_a_killed_writer_are_removed(tiny, tmp_path):
    (tmp_path / ".final.tmp-999999999-ab12").mkdir()  # a writer that no longer runs (its pid is gone)
    (tmp_path / ".final.tmp-k2j3h4x9").mkdir()  # the name older builds used (no pid)
    (tmp_path / ".final.old-999999999").mkdir()
    mine = tmp_path / f".final.tmp-{os.getpid()}-live"  # a live writer's folder stays
    mine.mkdir()
    _head(tiny, tmp_path / "final")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, "final"])


@pytest.mark.parametrize("earlier", [False, True])
def test_an_out_that_is_a_symlink_is_written_through(tiny, tmp_path, earlier):
    """issue 38: --out naming a symlink to a folder was replaced by a local folder (the link's target stayed as it
    was, a hidden .NAME.old-PID link was left). The export is written into the folder the link names; the link
    stays a link, nothing is left beside either; a re-export through the link replaces the earlier one."""
    _head(tiny, tmp_path / "h")
    real = tmp_path / "disk" / "exports"
    real.mkdir(parents=True)
    link = tmp_path / "out"
    link.symlink_to(real)
    if earlier:
        assert _export("--head", tmp_path / "h", "--format", "eagle3", "--out", link)[0] == 0
    rc, err = _export("--head", tmp_path / "h", "--format", "eagle3", "--out", link)
    assert rc == 0, err
    assert link.is_symlink() and os.path.realpath(link) == str(real)
    assert sorted(p.name for p in real.iterdir()) == ["config.json", "export_info.json", "model.safetensors",
                                                      "specheads_target.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "h", "out"]
    assert [p.name for p in real.parent.iterdir()] == ["exports"]


def test_an_out_that_is_a_link_to_nothing_yet_is_written_through(tiny, tmp_path):
    _head(tiny, tmp_path / "h")
    (tmp_path / "disk").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "disk" / "exports")
    rc, err = _export("--head", tmp_path / "h", "--format", "eagle3", "--out", tmp_path / "out")
    assert rc == 0, err
    assert (tmp_path / "out").is_symlink() and (tmp_path / "disk" / "exports" / "model.safetensors").is_file()


# ------------------------------------------------------------------------------------------------ config values

def test_override_error_names_the_flag_and_file_error_names_the_file(tmp_path):
    from specheads.config import load_config
    from specheads.train.recipe import Recipe

    cfg = tmp_path / "r.yaml"
    cfg.write_text("train:\n  batch_size: 0\n")
    with pytest.raises(SpecheadsError, match=r"^override 'train\.lr=abc': expected a number, got 'abc'$"):
        load_config(Recipe, cfg, ["train.lr=abc"])
    with pytest.raises(SpecheadsError, match=rf"^{cfg}: train\.batch_size: must be >= 1, got 0$"):
        load_config(Recipe, cfg)
    with pytest.raises(SpecheadsError, match=r"^override 'train\.batch_size=-1': train\.batch_size: must be >= 1"):
        load_config(Recipe, cfg, ["train.batch_size=-1"])


@pytest.mark.parametrize("override,match", [
    ("eval.batch_size=0", r"eval\.batch_size: must be >= 1"),
    ("eval.max_samples=0", r"eval\.max_samples: must be >= 1"),
    ("eval.every_steps=-1", r"eval\.every_steps: must be >= 0"),
    ("eval.tree_width=0", r"eval\.tree_width"),
    ("train.lr=nan", r"train\.lr: must be > 0, got nan"),
    ("train.noise=-0.1", r"train\.noise: must be >= 0"),
    ("train.lora.dropout=1.5", r"train\.lora\.dropout: must be in \[0,1\)"),
    ("train.block.gamma=0", r"train\.block\.gamma: must be > 0"),
    ("train.betas=[0.9, 1.5]", r"train\.betas"),
    ("data.max_length=1", r"data\.max_length: must be >= 2"),
    ("data.val_fraction=1", r"data\.val_fraction: must be in \[0,1\)"),
    ("data.regen_top_p=0", r"data\.regen_top_p: must be in \(0,1\]"),
    ("data.regen_dtype=float8", r"data\.regen_dtype"),
    ("features.shard_tokens=0", r"features\.shard_tokens: must be >= 1"),
    ("features.layers=[-1]", r"features\.layers"),
])
def test_stage_configs_validate_in_their_dataclass(tmp_path, override, match):
    with pytest.raises(SpecheadsError, match=rf"^override '{override.split('=')[0]}=.*{match}"):
        make_recipe(tmp_path, override)


# ----------------------------------------------------------------------------------------- head folders on load

@pytest.mark.parametrize("edit,match", [
    (lambda c, w: c.update(hidden_size="64"), r"key 'hidden_size': expected a positive integer, got '64'"),
    (lambda c, w: c.update(vocab_size=0), r"key 'vocab_size': expected a positive integer"),
    (lambda c, w: c.update(feature_layers=[1, 2, 9], spec={**c["spec"], "feature_layers": [1, 2, 9]}),
     r"key 'feature_layers': \[9\] outside 0\.\.4"),
    (lambda c, w: c.update(feature_layers="1,2,3"), r"key 'feature_layers': expected a non-empty list"),
    (lambda c, w: c.update(draft_vocab_size=999), r"key 'draft_vocab_size': expected null or an integer in 1\.\.255"),
    (lambda c, w: c.update(spec={**c["spec"], "eagle3": {**c["spec"]["eagle3"], "ttt_steps": 0}}), r"key 'spec': head\.eagle3\.ttt_steps: must be >= 1"),
    (lambda c, w: c.update(spec={**c["spec"], "draft_vocab_size": 32}), r"key 'spec\.draft_vocab_size' is 32"),
    (lambda c, w: w.update(d2t=w["d2t"] + 300), r"key 'd2t': expected strictly increasing target ids in 0\.\.255"),
    (lambda c, w: w.update(d2t=w["d2t"].flip(0)), r"key 'd2t': expected strictly increasing"),
    (lambda c, w: w.update(t2d=~w["t2d"]), r"keys 'd2t' and 't2d' disagree"),
])
def test_bad_head_values_are_one_error_naming_file_and_key(tiny, tmp_path, edit, match):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "h"
    _head(tiny, d, HeadSpec(kind="eagle3", draft_vocab_size=64, feature_layers=[1, 2, 3]))
    cfg, w = json.loads((d / "config.json").read_text()), load_file(str(d / "model.safetensors"))
    edit(cfg, w)
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(d / "model.safetensors"))
    (d / "model.safetensors.sha256").unlink()  # the edit is deliberate: the value checks must catch it
    with pytest.raises(SpecheadsError, match=match) as e:
        load_head(d, tiny)
    assert str(d) in str(e.value)


def test_medusa_feature_layers_must_be_the_final_state(tiny, tmp_path):
    d = tmp_path / "m"
    _head(tiny, d, HeadSpec(kind="medusa", num_heads=2))
    cfg = json.loads((d / "config.json").read_text())
    cfg["feature_layers"] = cfg["spec"]["feature_layers"] = [2]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecheadsError, match=r"config.json: key 'feature_layers': a medusa head reads the final"):
        load_head(d, tiny)


def test_head_weights_checksum_is_checked_on_load(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "h"
    _head(tiny, d)
    side = (d / "model.safetensors.sha256").read_text()
    assert side.endswith("  model.safetensors\n") and len(side.split()[0]) == 64
    w = load_file(str(d / "model.safetensors"))
    w["fc.weight"] = w["fc.weight"].clone()
    w["fc.weight"][0, 0] += 1.0  # one weight changed, file still well-formed
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt", "kind": "eagle3"})
    with pytest.raises(SpecheadsError, match=r"model.safetensors: sha256 .* differs .* model.safetensors.sha256"):
        load_head(d, tiny)
    (d / "model.safetensors.sha256").unlink()  # a folder without a checksum (older build, native export) loads
    assert load_head(d, tiny).kind == "eagle3"


# --------------------------------------------------------------------------------------------- feature shards

def test_damaged_feature_shard_is_caught_on_read(tiny, tmp_path):
    from specheads.train.dataset import FeatureDataset
    from specheads.train.features import FeatureConfig, write_features

    rows = [{"input_ids": list(range(3, 3 + 10 + i)), "loss_mask": [1] * (10 + i), "conversation_id": f"c{i}"}
            for i in range(6)]
    folder = tmp_path / "f"
    write_features(tiny, rows, folder, [4], FeatureConfig(shard_tokens=30), progress=False)
    shard = sorted(folder.glob("shard-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # one byte of the hidden states flipped: same size, still parses
    shard.write_bytes(bytes(data))
    with pytest.raises(SpecheadsError, match=rf"{shard.name}: sha256 differs .* --verify"):
        [x for x in FeatureDataset(folder)]
    assert len([x for x in FeatureDataset(folder, verify=False)]) == 6  # features.verify=false: size only
    m = write_features(tiny, rows, folder, [4], FeatureConfig(shard_tokens=30), progress=False, verify=True)
    assert m["complete"] and len([x for x in FeatureDataset(folder)]) == 6  # prepare --verify rewrote it
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(SpecheadsError, match=r"bytes, the manifest lists"):
        [x for x in FeatureDataset(folder, verify=False)]


# ------------------------------------------------------------------------------------------------------- train

def test_refused_train_leaves_train_config_unchanged(tiny, tmp_path):
    from specheads.train.trainer import Trainer

    r = make_recipe(tmp_path, "train.max_steps=2", "train.save_every=1", "eval.at_start=false")
    Trainer(r, tiny, make_head(r, tiny), token_samples(8), None).train()
    before = (tmp_path / "train_config.yaml").read_text()
    other = make_recipe(tmp_path, "train.max_steps=2", "train.lr=5e-2", "eval.at_start=false")
    with pytest.raises(SpecheadsError, match="--resume"):
        Trainer(other, tiny, make_head(other, tiny), token_samples(8), None).train()
    assert (tmp_path / "train_config.yaml").read_text() == before


def test_no_held_out_split_says_best_is_not_written(tiny, tmp_path, monkeypatch, capsys):
    import datasets

    from specheads import cli

    rows = token_samples(8)
    datasets.Dataset.from_dict({"input_ids": [r["input_ids"].tolist() for r in rows],
                                "loss_mask": [r["loss_mask"].tolist() for r in rows],
                                "conversation_id": [f"c{i}" for i in range(8)]}).save_to_disk(
        str(tmp_path / "data" / "tokens"))
    monkeypatch.setattr("specheads.target.load_target", lambda *a, **k: tiny)
    cfg = tmp_path / "r.yaml"
    cfg.write_text(f"command: specheads train --config {cfg}\noutput_dir: {tmp_path}\n")
    rc = cli.main(["train", "--config", str(cfg), "features.mode=online", "data.val_fraction=0", "head.kind=medusa",
                   "head.num_heads=2", "train.max_steps=2", "train.tracker=none", "train.batch_size=2"])
    out = capsys.readouterr().out
    assert rc == 0 and "no held-out split: best/ not written" in out and str(tmp_path / "final") in out
    assert not (tmp_path / "best").exists() and (tmp_path / "final").exists()
    summ = json.loads((tmp_path / "train_summary.json").read_text())
    assert summ["best_dir"] is None and summ["history"] == [] and summ["last_loss"] is not None

"""Output guards (issue 28): `specheads export` never replaces another head's folder or a folder it reads, never
copies a damaged head, and says when --import binds a head to another target; `bench --batch-sizes` never labels a
row with a batch size it did not run."""
from __future__ import annotations

import json



# ------------------------------------------------------------------------------------------- bench --batch-sizes
def test_batch_sizes_above_the_prompt_count_are_refused_before_the_target_loads(tmp_path, monkeypatch, capsys):
    """2 prompts and --batch-sizes 1,1000000: the 1000000 row would run as B = 2 under the label B = 1000000."""
    import specheads.target
    from specheads.cli import main

    def no_load(*a, **k):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(specheads.target, "load_target", no_load)
    ds = tmp_path / "p.jsonl"
    ds.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(2)))
    out = tmp_path / "out"
    assert main(["bench", "--batch-sizes", "1,1000000", "--dataset", str(ds), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--batch-sizes 1,1000000: 1000000 above the 2 prompts" in err
    assert not out.exists()
    assert main(["bench", "--batch-sizes", "2,4", "--dataset", str(ds), "--limit", "1", "--out", str(out)]) == 2
    assert "2,4 above the 1 prompts" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------ export
from specheads.heads import HeadSpec, build_head, load_head  # noqa: E402


def _head(tiny, folder, seed=0):
    import torch

    head = build_head(HeadSpec(kind="eagle3", feature_layers=[1, 2, 3]), tiny)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.01 * torch.randn_like(p))
    head.save_pretrained(folder)
    return head


def _export(*args) -> tuple[int, str]:
    import contextlib
    import io

    from specheads import cli

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = cli.main(["export", *map(str, args)])
    return rc, err.getvalue().strip()


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_native_export_onto_another_trained_head_is_refused_without_force(tiny, tmp_path):
    """`export --head run/final --format native --out run/best` replaced best/ (a native head counts as an earlier
    native export): only an earlier export of the same head is replaced without --force."""
    run = tmp_path / "run"
    _head(tiny, run / "final", seed=1)
    _head(tiny, run / "best", seed=2)
    before = _files(run / "best")
    rc, err = _export("--head", run / "final", "--format", "native", "--out", run / "best")
    assert rc == 2 and len(err.splitlines()) == 1
    assert f"not an earlier native export of {run / 'final'}" in err and "--force" in err
    assert _files(run / "best") == before
    # an export of another head in the same format: refused too
    assert _export("--head", run / "final", "--format", "eagle3", "--out", tmp_path / "sg")[0] == 0
    rc, err = _export("--head", run / "best", "--format", "eagle3", "--out", tmp_path / "sg")
    assert rc == 2 and "not an earlier eagle3 export" in err
    info = json.loads((tmp_path / "sg" / "export_info.json").read_text())
    assert info["source"] == str((run / "final").resolve()) and info["format"] == "eagle3"
    assert len(info["source_sha256"]) == 64
    # the same head again (re-export after more training): replaced without --force
    _head(tiny, run / "final", seed=3)
    assert _export("--head", run / "final", "--format", "eagle3", "--out", tmp_path / "sg")[0] == 0
    assert _export("--head", run / "final", "--format", "native", "--out", tmp_path / "nat")[0] == 0
    assert _export("--head", run / "final", "--format", "native", "--out", tmp_path / "nat")[0] == 0
    # with --force: replaced
    assert _export("--head", run / "final", "--format", "native", "--out", run / "best", "--force")[0] == 0
    assert json.loads((run / "best" / "export_info.json").read_text())["source"] == str((run / "final").resolve())


def test_import_never_replaces_the_target_folder_it_reads(tiny, tmp_path, monkeypatch):
    """`export --import X --target T --out T --force` deleted the target model folder the command reads."""
    _head(tiny, tmp_path / "h")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setattr("specheads.target.load_target", lambda name, dtype="float32", **kw: tiny)
    for out in (model, tmp_path, model / "sub"):
        rc, err = _export("--import", tmp_path / "h", "--target", model, "--out", out, "--force")
        assert rc == 2 and len(err.splitlines()) == 1 and "--target" in err and "never replaced" in err
        assert (model / "config.json").read_text() == "{}" and load_head(tmp_path / "h", tiny).kind == "eagle3"
    assert not (model / "sub").exists()
    rc, err = _export("--head", tmp_path / "h", "--format", "eagle3", "--target", model, "--out", model, "--force")
    assert rc == 2 and "never replaced" in err and (model / "config.json").exists()


def test_export_of_a_damaged_head_is_refused(tiny, tmp_path):
    _head(tiny, tmp_path / "h")
    w = tmp_path / "h" / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 0xFF  # a flipped byte in the tensor data: still a readable safetensors file
    w.write_bytes(bytes(data))
    for fmt in ("native", "eagle3", "speculators"):
        rc, err = _export("--head", tmp_path / "h", "--format", fmt, "--out", tmp_path / fmt)
        assert rc == 2 and len(err.splitlines()) == 1 and "sha256" in err and "model.safetensors" in err
        assert not (tmp_path / fmt).exists()


def test_import_bound_to_another_target_than_its_config_names_warns(tiny, tmp_path, monkeypatch, caplog):
    _head(tiny, tmp_path / "h")
    assert _export("--head", tmp_path / "h", "--format", "eagle3", "--out", tmp_path / "sg")[0] == 0
    named = json.loads((tmp_path / "sg" / "config.json").read_text())["specheads"]["head_target"]
    monkeypatch.setattr("specheads.target.load_target", lambda name, dtype="float32", **kw: tiny)
    with caplog.at_level("WARNING"):
        assert _export("--import", tmp_path / "sg", "--target", "org/other-model", "--out", tmp_path / "n")[0] == 0
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "--import" in r.getMessage()]
    assert len(warned) == 1 and repr(named) in warned[0] and "'org/other-model'" in warned[0]
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert _export("--import", tmp_path / "sg", "--target", named, "--out", tmp_path / "n2")[0] == 0
    assert not [r for r in caplog.records if "names the target" in r.getMessage()]


def test_named_target_reads_the_usual_fields(tmp_path):
    from specheads.heads.export_guards import named_target

    for config, want in [({"target_name": "a"}, "a"), ({"specheads": {"head_target": "b"}}, "b"),
                         ({"speculators_config": {"verifier": {"name_or_path": "c"}}}, "c"),
                         ({"base_model_name_or_path": "d"}, "d"), ({"hidden_size": 8}, None)]:
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert named_target(tmp_path) == want

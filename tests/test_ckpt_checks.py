"""Checkpoints carry checksums and are verified on resume: a damaged or missing file, a damaged RNG or trainer state
is one SpecheadsError naming the file; a checkpoint of the checksummed format without its checksums is refused,
an older one (format /2) without them still loads (with a log line saying what is known); a folder
under checkpoints/ that is not `step-<number>` is ignored with a warning."""
from __future__ import annotations

import json
import logging
import shutil

import pytest

from test_train import make_head, make_recipe, token_samples

from specheads.train.checkpoint import CHECKSUMS_NAME, FORMAT, list_checkpoints, write_checksums
from specheads.train.trainer import Trainer
from specheads.utils import SpecheadsError, sha256_file

OVER = ["train.max_steps=4", "train.save_every=2", "eval.every_steps=0", "eval.at_start=false"]


@pytest.fixture(scope="module")
def tiny():
    """The tiny random Llama, once for this module (the checkpoint below is made once)."""
    from specheads.target import tiny_target

    return tiny_target()


@pytest.fixture(scope="module")
def made(tiny, tmp_path_factory):
    """A run stopped after step 2 (checkpoint step-000002), made once and copied by each test."""
    run = tmp_path_factory.mktemp("ckpt") / "run"
    r = make_recipe(run, *OVER)
    Trainer(r, tiny, make_head(r, tiny), token_samples(8), None).train(stop_after=2)
    return run


@pytest.fixture
def run(made, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(made, dst)
    return dst


def _resume(run, tiny):
    r = make_recipe(run, *OVER)
    return Trainer(r, tiny, make_head(r, tiny), token_samples(8), None).train(resume=True)


def _ckpt(run):
    ck = list_checkpoints(run)
    assert [p.name for p in ck] == ["step-000002"]
    return ck[-1]


def test_checksums_cover_every_file_and_a_clean_resume_passes(run, tiny):
    ck = _ckpt(run)
    lines = (ck / CHECKSUMS_NAME).read_text().splitlines()
    listed = {line.split("  ", 1)[1]: line.split("  ", 1)[0] for line in lines}
    files = {p.name for p in ck.iterdir() if p.name != CHECKSUMS_NAME}
    assert set(listed) == files >= {"model.safetensors", "optimizer.safetensors", "rng_state_0.json",
                                     "trainer_state.json"}
    assert all(sha256_file(ck / name) == digest for name, digest in listed.items())
    assert _resume(run, tiny).steps == 4
    assert (list_checkpoints(run)[-1] / CHECKSUMS_NAME).exists()


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors", "rng_state_0.json"])
def test_a_flipped_byte_is_one_line_naming_the_file(run, tiny, name):
    path = _ckpt(run) / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(SpecheadsError, match=rf"{path}: sha256 differs from the one recorded in {CHECKSUMS_NAME}") \
            as e:
        _resume(run, tiny)
    assert "\n" not in str(e.value) and "resume from the checkpoint before it" in str(e.value)


def test_a_missing_file_and_a_damaged_checksum_file_are_named(run, tiny):
    ck = _ckpt(run)
    (ck / "optimizer.safetensors").unlink()
    with pytest.raises(SpecheadsError, match=rf"{ck / 'optimizer.safetensors'}: missing \(listed in"):
        _resume(run, tiny)
    (ck / CHECKSUMS_NAME).write_text(f"not a checksum\n{'0' * 64}  trainer_state.json\n")
    with pytest.raises(SpecheadsError, match=rf"{ck / CHECKSUMS_NAME}: line 1 is not"):
        _resume(run, tiny)
    (ck / CHECKSUMS_NAME).write_text("")  # cut short
    with pytest.raises(SpecheadsError, match=rf"{ck / CHECKSUMS_NAME}: does not list trainer_state.json"):
        _resume(run, tiny)


def _set_format(ck, fmt: str) -> None:
    st = json.loads((ck / "trainer_state.json").read_text())
    st["format"] = fmt
    (ck / "trainer_state.json").write_text(json.dumps(st))


def test_a_checkpoint_of_the_checksummed_format_without_its_checksums_is_refused(run, tiny):
    """issue 38: a checkpoint whose checksums.sha256 was removed resumed with damaged weights, described as
    "written before checkpoints carried checksums". The format says a checkpoint carries them: without, refused."""
    ck = _ckpt(run)
    assert json.loads((ck / "trainer_state.json").read_text())["format"] == FORMAT == "specheads-checkpoint/3"
    (ck / CHECKSUMS_NAME).unlink()
    flip = bytearray((ck / "model.safetensors").read_bytes())
    flip[-5] ^= 0xFF  # the damage the checksums would have caught
    (ck / "model.safetensors").write_bytes(bytes(flip))
    with pytest.raises(SpecheadsError) as e:
        _resume(run, tiny)
    assert str(e.value) == (f"{ck / CHECKSUMS_NAME}: missing; a specheads-checkpoint/3 checkpoint always carries "
                            f"it, so its files cannot be verified (removed or lost since the save): remove {ck} to "
                            f"resume from the checkpoint before it")


def test_an_older_checkpoint_without_checksums_still_loads_said_truthfully(run, tiny, caplog):
    ck = _ckpt(run)
    (ck / CHECKSUMS_NAME).unlink()
    _set_format(ck, "specheads-checkpoint/2")
    with caplog.at_level(logging.INFO, logger="specheads.train.checkpoint"):
        assert _resume(run, tiny).steps == 4
    said = [r.getMessage() for r in caplog.records if str(ck) in r.getMessage() and "not verified" in r.getMessage()]
    assert said and "format specheads-checkpoint/2" in said[0] and "or the file was removed since" in said[0]


def test_an_older_checkpoint_whose_weights_are_not_safetensors_is_one_line(run, tiny):
    """issue 38: no checksums to catch it, the weights file is not safetensors: one line naming it, never a
    traceback (and never unpickled)."""
    ck = _ckpt(run)
    (ck / CHECKSUMS_NAME).unlink()
    _set_format(ck, "specheads-checkpoint/2")
    (ck / "model.safetensors").write_bytes(b"garbage, not a safetensors file")
    with pytest.raises(SpecheadsError, match=rf"^{ck / 'model.safetensors'}: not a readable safetensors file \("):
        _resume(run, tiny)


def test_a_checkpoint_of_a_newer_format_is_refused_naming_it(run, tiny):
    ck = _ckpt(run)
    _set_format(ck, "specheads-checkpoint/12")
    with pytest.raises(SpecheadsError, match="format 'specheads-checkpoint/12' is newer than this specheads reads"):
        _resume(run, tiny)


@pytest.mark.parametrize("damage", [
    lambda st: st.update(torch=st["torch"][:10]),
    lambda st: st.update(python=[3, [1, 2, 3], None]),
    lambda st: st.update(numpy=["MT19937", [1, 2], 0, 0, 0.0]),
    lambda st: st.update(generators={"noise": [1, 2, 3]}),
    lambda st: st.pop("python"),
])
def test_a_damaged_rng_state_is_one_line_naming_it(run, tiny, damage):
    ck = _ckpt(run)
    (ck / CHECKSUMS_NAME).unlink()  # an older checkpoint: only the state check stands between it and a traceback
    _set_format(ck, "specheads-checkpoint/2")
    path = ck / "rng_state_0.json"
    st = json.loads(path.read_text())
    damage(st)
    path.write_text(json.dumps(st))
    with pytest.raises(SpecheadsError, match=rf"{path}: not a valid RNG state") as e:
        _resume(run, tiny)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("damage, want", [
    (lambda st: st.pop("scheduler"), r"key\(s\) \['scheduler'\] missing"),
    (lambda st: st.pop("step"), r"key\(s\) \['step'\] missing"),
    (lambda st: st.update(step="two"), r"key 'step': unexpected value 'two'"),
    (lambda st: st.update(history={"a": 1}), r"key 'history': unexpected value"),
    (lambda st: st.update(step=3), r"key 'step' is 3 but the folder is step-000002"),
    (lambda st: st.update(scheduler={"nothing": 1}), r"key 'scheduler': not this run's LR scheduler state"),
])
def test_a_damaged_trainer_state_is_one_line_naming_it(run, tiny, damage, want):
    ck = _ckpt(run)
    path = ck / "trainer_state.json"
    st = json.loads(path.read_text())
    damage(st)
    path.write_text(json.dumps(st))
    write_checksums(ck)  # the checksums match: the state check behind them is what fires
    with pytest.raises(SpecheadsError, match=rf"{path}: {want}") as e:
        _resume(run, tiny)
    assert "\n" not in str(e.value)


def test_a_non_numeric_step_folder_is_ignored_with_a_warning(run, tiny, caplog):
    ck = _ckpt(run)
    for name in ("step-abc", "step-000009-old"):
        shutil.copytree(ck, ck.parent / name)
    with caplog.at_level(logging.WARNING, logger="specheads.train.checkpoint"):
        assert [p.name for p in list_checkpoints(run)] == ["step-000002"]
        res = _resume(run, tiny)
    assert res.steps == 4
    warned = [r.getMessage() for r in caplog.records if "not a checkpoint name" in r.getMessage()]
    assert any("step-abc" in m for m in warned) and any("step-000009-old" in m for m in warned)
    assert (ck.parent / "step-abc").exists(), "a folder that is not ours was deleted"

"""A head knows its target (issue 49 point 4): every head records the whole target (family, a sampled hash of every
tensor, the GGUF source and its quantization); generate, bench, eval and export refuse a target of the same family
with other weights in one line naming the head folder and what differs, unless --allow-other-target (then one
warning); another family is always refused; heads written before the record keep loading with the old check."""
from __future__ import annotations

import contextlib
import io
import json
import logging
import shutil

import pytest
import torch

from specheads.heads import HeadSpec, build_head, load_head
from specheads.heads.base import CONFIG_NAME, read_head_config
from specheads.target import load_target, tiny_target
from specheads.target_record import (OTHER_FAMILY, OTHER_WEIGHTS, SAME, compare, gguf_record, sample_positions,
                                     target_record)
from specheads.utils import SpecheadsError

CHANGED = "model.layers.1.mlp.down_proj.weight"  # the one decoder weight the "changed" copy alters


def _change(model, name: str = CHANGED, scale: float = 1.05) -> None:
    with torch.no_grad():
        dict(model.named_parameters())[name].mul_(scale)


# ------------------------------------------------------------------------------------------------- the record

def test_one_changed_decoder_tensor_is_named_and_counted(tiny):
    before = tiny.record()
    _change(tiny.model)
    outcome, what = compare(before, tiny.record())
    n = before["weights"]["count"]
    assert outcome == OTHER_WEIGHTS and what == f"decoder weights differ in 1 of {n} tensors (first: {CHANGED})"
    assert n == len(list(tiny.model.parameters()))  # every parameter tensor is in the record


def test_a_bf16_copy_of_the_same_weights_is_the_same_target(tiny):
    copy = tiny_target(dtype=torch.bfloat16)  # the same seed: the same weights, rounded to bf16
    assert compare(tiny.record(), copy.record()) == (SAME, "")
    assert tiny.record()["weights"] == copy.record()["weights"]


def test_another_family_is_named(tiny):
    wider = tiny_target(hidden_size=128)
    outcome, what = compare(tiny.record(), wider.record())
    assert outcome == OTHER_FAMILY and "hidden_size 64 vs 128" in what
    deeper = tiny_target(num_layers=5)
    assert compare(tiny.record(), deeper.record())[0] == OTHER_FAMILY


def test_sample_positions_spread_over_the_tensor_and_stay_inside():
    for n in (1, 7, 64, 1000, 49152 * 576):
        pos = sample_positions(n)
        assert len(pos) == min(64, n) and int(pos.min()) >= 0 and int(pos.max()) < n
        assert len(set(pos.tolist())) == len(pos)
    big = sample_positions(49152 * 576)
    assert len({int(p) % 576 for p in big}) > 32  # many columns of a [V, D] matrix, not one


def test_another_quantization_of_the_same_model_is_named(tiny):
    """Another quantization moves the weights and is named with both files; the same weights from another source
    (the very GGUF's converted folder, a renamed copy) are the same target."""
    rec = tiny.record()
    q4 = {**rec, "gguf": {"file": "smollm2.Q4_1.gguf", "size": 1, "types": {"Q4_1": 2}, "type": "Q4_1"}}
    _change(tiny.model)
    moved = tiny.record()
    q8 = {**moved, "gguf": {"file": "smollm2.Q8_0.gguf", "size": 2, "types": {"Q8_0": 2}, "type": "Q8_0"}}
    outcome, what = compare(q4, q8)
    assert outcome == OTHER_WEIGHTS
    assert what.startswith("trained on smollm2.Q4_1.gguf (Q4_1 GGUF), given smollm2.Q8_0.gguf (Q8_0 GGUF) of the "
                           "same model family; decoder weights differ in 1 of")
    assert "given a safetensors / Hugging Face copy (no GGUF)" in compare(q4, moved)[1]
    assert compare(q4, rec) == (SAME, "")  # the converted folder of that GGUF: the same weights
    assert compare(q4, {**q4, "gguf": {**q4["gguf"], "file": "renamed.gguf"}}) == (SAME, "")


def test_the_gguf_header_reader_agrees_with_gguf_s_own(tmp_path):
    """Our header walk (no metadata decoded) gives the tensor types gguf's GGUFReader reads, past string arrays."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

    path = tmp_path / "m.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
    w.add_array("tokenizer.ggml.scores", [0.5] * 300)
    w.add_string("general.name", "tiny")
    w.add_tensor("token_embd.weight", np.ones((8, 4), dtype=np.float16))
    w.add_tensor("blk.0.attn_q.weight", np.ones((4, 4), dtype=np.float16))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    rec = gguf_record(path)
    want = {}
    for t in GGUFReader(str(path)).tensors:
        want[GGMLQuantizationType(t.tensor_type).name] = want.get(GGMLQuantizationType(t.tensor_type).name, 0) + 1
    assert rec["types"] == want == {"F16": 2, "F32": 1}
    assert rec["type"] == "F16" and rec["file"] == "m.gguf" and rec["size"] == path.stat().st_size


def test_the_bundled_target_records_its_q4_1_gguf():
    from specheads.assets import smollm2_gguf

    try:
        path = smollm2_gguf()
    except SpecheadsError as e:
        pytest.skip(str(e))
    rec = gguf_record(path)
    assert rec["type"] == "Q4_1" and rec["types"]["Q4_1"] == 210 and rec["file"].endswith(".Q4_1.gguf")


# ------------------------------------------------------------------------------------------------- loading

def _head(target, folder):
    head = build_head(HeadSpec(kind="eagle3", feature_layers=[1, 2, 3]), target)
    head.save_pretrained(folder)
    return folder


def test_a_head_records_the_whole_target_and_refuses_other_weights(tiny, tmp_path, caplog):
    folder = _head(tiny, tmp_path / "h")
    cfg = read_head_config(folder)
    assert cfg.target_record == target_record(tiny) and cfg.fingerprint == tiny.fingerprint()
    load_head(folder, tiny)  # its own target: silent
    _change(tiny.model)
    with pytest.raises(SpecheadsError) as e:
        load_head(folder, tiny)
    msg = str(e.value)
    assert msg.startswith(f"{folder}: head was trained for target") and "\n" not in msg
    assert "decoder weights differ in 1 of" in msg and "--allow-other-target" in msg
    tiny.allow_other_target = True
    with caplog.at_level(logging.WARNING, logger="specheads"):
        load_head(folder, tiny)
        load_head(folder, tiny)  # bench loads a head more than once: one warning
    warned = [r.getMessage() for r in caplog.records if "proceeding (--allow-other-target)" in r.getMessage()]
    assert len(warned) == 1 and "decoder weights differ in 1 of" in warned[0]


def test_another_family_is_refused_even_with_the_flag(tiny, tmp_path):
    folder = _head(tiny, tmp_path / "h")
    other = tiny_target(vocab_size=300)
    other.allow_other_target = True
    with pytest.raises(SpecheadsError, match=r"head was trained for target .*vocab 256 vs 300$"):
        load_head(folder, other)


def test_an_old_head_without_the_record_loads_with_the_old_check(tiny, tmp_path):
    folder = _head(tiny, tmp_path / "h")
    config = json.loads((folder / CONFIG_NAME).read_text())
    del config["target_record"]
    (folder / CONFIG_NAME).write_text(json.dumps(config))
    assert read_head_config(folder).target_record is None
    load_head(folder, tiny)
    _change(tiny.model)  # a decoder weight: the old record never saw those
    load_head(folder, tiny)
    _change(tiny.model, "model.embed_tokens.weight")
    with pytest.raises(SpecheadsError, match=r"embedding / lm_head fingerprint differs .*--allow-other-target"):
        load_head(folder, tiny)
    tiny.allow_other_target = True
    load_head(folder, tiny)


def test_a_damaged_record_is_one_line(tiny, tmp_path):
    folder = _head(tiny, tmp_path / "h")
    config = json.loads((folder / CONFIG_NAME).read_text())
    config["target_record"] = [1, 2]
    (folder / CONFIG_NAME).write_text(json.dumps(config))
    with pytest.raises(SpecheadsError, match=r"config.json: key 'target_record': expected null or a JSON object"):
        read_head_config(folder)


def test_training_records_the_target(tiny, tmp_path):
    from test_train import make_recipe, token_samples

    from specheads.train.trainer import Trainer

    recipe = make_recipe(tmp_path, "train.max_steps=2", "train.save_every=2")
    torch.manual_seed(0)
    head = build_head(recipe.head, tiny)
    Trainer(recipe, tiny, head, token_samples(6), token_samples(4, seed=1)).train()
    saved = json.loads((tmp_path / "final" / CONFIG_NAME).read_text())
    assert saved["target_record"] == json.loads(json.dumps(tiny.record()))
    assert saved["target_record"]["weights"]["count"] == len(list(tiny.model.parameters()))


# ------------------------------------------------------------------------------------------------- the commands

@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny Llama over SmolLM2's tokenizer saved as a folder (target/), an EAGLE-3 head trained on nothing but
    recorded against it (head/), and changed/: target/ with one decoder weight altered."""
    from transformers import AutoTokenizer

    from specheads.target import resolve_target_path

    try:
        tok = AutoTokenizer.from_pretrained(resolve_target_path("smollm2-135m"))
    except SpecheadsError as e:  # the bundled asset is not installed
        pytest.skip(str(e))
    root = tmp_path_factory.mktemp("fingerprint")
    t = tiny_target(vocab_size=len(tok), tokenizer=tok)
    t.model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    target = load_target(str(root / "target"))
    build_head(HeadSpec(kind="eagle3", feature_layers=[1, 2, 3], draft_vocab_size=64), target,
               token_counts=torch.arange(len(tok))).save_pretrained(root / "head")
    shutil.copytree(root / "target", root / "changed", ignore=shutil.ignore_patterns("*.safetensors"))
    _change(t.model)
    t.model.save_pretrained(root / "changed")
    return root


def _cli(*argv) -> tuple[int, str]:
    from specheads import cli

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main([str(a) for a in argv])
    return rc, err.getvalue()


def _commands(root, out):
    head, changed = root / "head", root / "changed"
    return {
        "generate": ["generate", "--target", changed, "--head", head, "--prompt", "hi", "--max-new-tokens", "2",
                     "--tree", "2,2,4"],
        "bench": ["bench", "--target", changed, "--head", head, "--methods", "head", "--limit", "1",
                  "--max-new-tokens", "2", "--warmup-tokens", "0", "--tree", "2,2,4", "--out", out],
        "eval": ["eval", "--target", changed, "--head", head, "--limit", "1", "--max-new-tokens", "4", "--dtype",
                 "fp32"],
        "export": ["export", "--head", head, "--format", "eagle3", "--target", changed, "--out", out],
    }


@pytest.mark.parametrize("command", ["generate", "bench", "eval", "export"])
def test_each_command_refuses_a_target_with_other_weights_in_one_line(folders, tmp_path, command, one_thread):
    rc, err = _cli(*_commands(folders, tmp_path / "out")[command])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, err
    assert lines[-1].startswith(f"specheads {command}: error: {folders / 'head'}: head was trained for target")
    assert "decoder weights differ in 1 of" in lines[-1] and "--allow-other-target" in lines[-1]
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.parametrize("command", ["generate", "export"])
def test_the_flag_proceeds_with_one_warning(folders, tmp_path, command, caplog, one_thread):
    with caplog.at_level(logging.WARNING, logger="specheads"):
        rc, err = _cli(*_commands(folders, tmp_path / "out")[command], "--allow-other-target")
    assert rc == 0, err
    warned = [r.getMessage() for r in caplog.records if "proceeding (--allow-other-target)" in r.getMessage()]
    assert len(warned) == 1 and "decoder weights differ in 1 of" in warned[0]


def test_an_export_carries_the_record(folders, tmp_path, one_thread):
    head = folders / "head"
    record = read_head_config(head).target_record
    assert _cli("export", "--head", head, "--format", "eagle3", "--out", tmp_path / "e3")[0] == 0
    side = json.loads((tmp_path / "e3" / "specheads_target.json").read_text())
    assert side["target_record"] == record and side["fingerprint"] == read_head_config(head).fingerprint
    assert "target_record" not in json.loads((tmp_path / "e3" / CONFIG_NAME).read_text())  # the layout as it was
    assert _cli("export", "--head", head, "--format", "eagle3", "--out", tmp_path / "e3")[0] == 0  # re-export
    assert _cli("export", "--head", head, "--format", "native", "--out", tmp_path / "nat")[0] == 0
    assert read_head_config(tmp_path / "nat").target_record == record
    assert not (tmp_path / "nat" / "specheads_target.json").exists()


def test_gguf_export_checks_before_the_converter(folders, tmp_path):
    """--format gguf loads the target the converter would read and refuses another one before llama.cpp runs."""
    rc, err = _cli("export", "--head", folders / "head", "--format", "gguf", "--target", folders / "changed",
                   "--out", tmp_path / "g")
    assert rc == 2 and "decoder weights differ in 1 of" in err.splitlines()[-1]


def test_the_bundled_gguf_and_its_converted_folder_in_bf16_are_the_same_target(smollm2):
    """The alias records its Q4_1 GGUF; the folder it was converted into, loaded in bf16, holds the same weights:
    the same target (the source alone never refuses)."""
    from specheads.target import resolve_target_path

    rec = smollm2.record()
    assert rec["gguf"]["type"] == "Q4_1" and rec["weights"]["count"] == 272
    folder = load_target(resolve_target_path("smollm2-135m"), dtype="bfloat16")
    assert folder.record()["gguf"] is None
    assert compare(rec, folder.record()) == (SAME, "")

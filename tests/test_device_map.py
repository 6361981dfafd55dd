"""target.device_map (issue 50 point 1) on this CPU-only machine: cpu, a per-module map and auto (no accelerator:
cpu, said in the log line) load the target whose hidden states equal the device_map-less load's bit for bit; bad
values are refused naming target.device_map; cuda without a GPU is one line. The GPU behaviour (cuda, auto split
across GPUs) is the prepared GPU check's."""
from __future__ import annotations

import logging

import pytest
import torch

from specheads.config import load_config
from specheads.target import check_device_map, load_target, resolve_device_map, where_target_runs
from specheads.train.features import extract_features
from specheads.train.recipe import Recipe
from specheads.utils import SpecheadsError


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    from specheads.target import resolve_target_path, tiny_target

    d = tmp_path_factory.mktemp("dm") / "target"
    tok = AutoTokenizer.from_pretrained(resolve_target_path("smollm2-135m"))
    t = tiny_target(vocab_size=len(tok), tokenizer=tok)
    t.model.config.eos_token_id = tok.eos_token_id  # not the tiny config's id 2, which it would answer at once
    t.model.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


PER_MODULE = {"model.embed_tokens": "cpu", **{f"model.layers.{i}": "cpu" for i in range(4)}, "model.norm": "cpu",
              "model.rotary_emb": "cpu", "lm_head": "cpu"}


@pytest.mark.parametrize("device_map", ["cpu", "auto", PER_MODULE], ids=["cpu", "auto", "per-module"])
def test_device_map_on_cpu_gives_the_same_hidden_states(target_dir, device_map):
    ids = torch.randint(3, 2000, (2, 19), generator=torch.Generator().manual_seed(0))
    am = torch.ones_like(ids)
    am[1, 15:] = 0  # one padded row
    ref = extract_features(load_target(target_dir), ids, am, [1, 2, 4])
    t = load_target(target_dir, device_map=device_map)
    got = extract_features(t, ids, am, [1, 2, 4])
    assert torch.equal(got, ref)
    assert got.device.type == "cpu"
    where = where_target_runs(t)
    assert where.startswith("on cpu (float32")
    if device_map == "auto":
        assert "device_map auto found no accelerator" in where


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_is_one_line_naming_the_setting():
    for value in ("cuda", "cuda:1", {"model": "cpu", "lm_head": 0}):
        with pytest.raises(SpecheadsError, match=r"target\.device_map"):
            resolve_device_map(value)
    assert resolve_device_map("auto")[0] == "cpu"
    assert resolve_device_map("auto", rank=(1, 2))[0] == "cpu"  # several processes, no GPU: each on its CPU


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "disk", {}, {"lm_head": "disk"}, {"lm_head": True}, 3])
def test_bad_device_map_refused_by_name(bad):
    with pytest.raises(SpecheadsError, match=r"target\.device_map"):
        check_device_map(bad)


def test_recipe_override_takes_words_and_maps():
    assert load_config(Recipe, None, ["target.device_map=cuda:1"]).target.device_map == "cuda:1"
    m = load_config(Recipe, None, ["target.device_map={model: cpu, lm_head: 0}"]).target.device_map
    assert m == {"model": "cpu", "lm_head": 0}
    with pytest.raises(SpecheadsError, match=r"target\.device_map"):
        load_config(Recipe, None, ["target.device_map=gpu"])
    assert load_config(Recipe, None, []).target.device_map is None  # as before: the CPU


def test_prepare_logs_where_each_stage_runs(target_dir, tmp_path, caplog):
    import json

    from specheads.train.prepare import prepare

    convs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"Q {i}?"},
                                               {"from": "gpt", "value": f"A {i}. " * 3}]} for i in range(4)]
    (tmp_path / "convs.json").write_text(json.dumps(convs))
    recipe = load_config(Recipe, None, [f"output_dir={tmp_path / 'run'}", f"target.name={target_dir}",
                                        "target.dtype=float32", "target.device_map=auto",
                                        f"data.source={tmp_path / 'convs.json'}", "data.regenerate=true",
                                        "data.regen_max_new_tokens=3", "data.max_length=64", "head.kind=medusa"])
    with caplog.at_level(logging.INFO):
        prepare(recipe, progress=False)
    lines = [r.getMessage() for r in caplog.records]
    assert "regenerate: on cpu (float32, device_map auto found no accelerator)" in lines
    assert "features: extracting on cpu (float32, device_map auto found no accelerator)" in lines

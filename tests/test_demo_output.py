"""What `make demo` prints: the recipe once, as the keys that differ from the defaults (train after prepare of the
same recipe: one line); one line per model load, naming the file it decodes; no third-party warning per process."""
from __future__ import annotations

import dataclasses
import logging

from specheads.config import format_changes, load_config, non_default_settings, save_config
from specheads.train.recipe import Recipe
from specheads.target import quiet_loading, tiny_target
from specheads.utils import setup_logging

DEMO = "configs/demo-eagle3-smollm2.yaml"


def test_recipe_prints_only_what_differs_from_the_defaults():
    recipe = load_config(Recipe, None, ["output_dir=runs/x", "train.lr=0.001", "head.kind=dspark",
                                        "head.dspark.block_size=4"])
    changed = non_default_settings(recipe)
    # the dspark section compares with dspark's own defaults: only block_size differs
    assert changed == {"output_dir": "runs/x", "head.kind": "dspark", "head.dspark.block_size": 4, "train.lr": 0.001}
    text = format_changes(recipe, "runs/x/prepare_config.yaml")
    assert text.splitlines()[0] == ("recipe: 4 settings differ from the defaults (the full resolved config: "
                                    "runs/x/prepare_config.yaml)")
    assert "  head.dspark.block_size: 4" in text and "  output_dir: runs/x" in text and len(text.splitlines()) == 5
    assert non_default_settings(Recipe()) == {}


def test_the_demo_recipe_is_a_few_lines_not_the_whole_config():
    recipe = load_config(Recipe, DEMO, ["output_dir=runs/demo"])
    lines = format_changes(recipe, "runs/demo/prepare_config.yaml").splitlines()
    assert 10 < len(lines) < 30 and "  head.eagle3.ttt_steps: 3" in lines  # the whole config is ~150 lines


def test_train_after_prepare_of_the_same_recipe_says_it_in_one_line(tmp_path):
    recipe = load_config(Recipe, DEMO, [f"output_dir={tmp_path}"])
    save_config(recipe, tmp_path / "prepare_config.yaml")  # as prepare writes it
    same = format_changes(recipe, tmp_path / "train_config.yaml", tmp_path / "prepare_config.yaml")
    assert same == (f"recipe: as prepared ({tmp_path / 'prepare_config.yaml'}); the full resolved config: "
                    f"{tmp_path / 'train_config.yaml'}")
    other = dataclasses.replace(recipe, seed=7)
    text = format_changes(other, tmp_path / "train_config.yaml", tmp_path / "prepare_config.yaml")
    assert "differ from the defaults" in text and "  seed: 7" in text
    (tmp_path / "bad.yaml").write_bytes(b"\xff\xfe: [")
    assert "differ from the defaults" in format_changes(recipe, "f", tmp_path / "bad.yaml")  # unreadable: listed


def test_target_describe_names_the_file_it_decodes():
    tiny = tiny_target()
    assert tiny.describe() == f"{tiny.name} (float32)"
    gguf = dataclasses.replace(tiny, name="smollm2-135m", gguf="/somewhere/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert gguf.describe() == "smollm2-135m (SmolLM2-135M-Instruct.Q4_1.gguf dequantised to float32)"


def test_quiet_loading_turns_the_weights_bar_off_and_back():
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()
    with quiet_loading():
        assert not hf_logging.is_progress_bar_enabled()
    assert hf_logging.is_progress_bar_enabled()
    with quiet_loading(local=False):  # a hub load keeps its download bars
        assert hf_logging.is_progress_bar_enabled()
    try:
        with quiet_loading():
            raise KeyError("x")
    except KeyError:
        pass
    assert hf_logging.is_progress_bar_enabled()  # restored after a failed load too


def test_deepspeeds_cpu_notice_is_dropped_and_its_other_lines_kept(capsys):
    setup_logging()
    setup_logging()  # twice (a second command in one process): one filter
    ds = logging.getLogger("DeepSpeed")
    assert len(ds.filters) == 1
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    ds.addHandler(handler)
    try:
        ds.warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
        ds.warning("something else")
    finally:
        ds.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["something else"]

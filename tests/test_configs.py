"""Every shipped config loads: recipe YAMLs through load_config(Recipe, ...) and begin with a `command:` line;
accelerate YAMLs through accelerate's own loader; DeepSpeed JSONs parse and are consistent with their names."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from specheads.config import load_config
from specheads.heads.kinds import kind_names
from specheads.train.recipe import Recipe

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
RECIPES = sorted(CONFIGS.glob("*.yaml"))
ACCEL = sorted((CONFIGS / "accelerate").glob("*.yaml"))
DS = sorted((CONFIGS / "deepspeed").glob("*.json"))


def first_line(p: Path) -> str:
    return next(line for line in p.read_text().splitlines() if line.strip())


def test_every_config_file_is_covered():
    every = sorted(p for p in CONFIGS.rglob("*") if p.is_file())
    assert every == sorted(RECIPES + ACCEL + DS), "a config file this test does not check"
    assert {"demo-eagle3-smollm2.yaml", "eagle3-smollm2.yaml", "eagle-smollm2.yaml", "medusa-smollm2.yaml",
            "eagle3-llama3-8b.yaml"} <= {p.name for p in RECIPES}
    assert {"zero1.json", "zero2.json", "zero3.json"} == {p.name for p in DS}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_loads_and_names_its_command(path):
    assert first_line(path).startswith("command: specheads "), f"{path.name}: first line must be `command: ...`"
    recipe = load_config(Recipe, path)
    assert recipe.head.kind in kind_names()  # the registry (heads/kinds.py)
    names = {"dspark": ("dspark", "dflash")}.get(recipe.head.kind, (recipe.head.kind,))  # DFlash = dspark minus heads
    stem = path.stem.split("-")
    if recipe.train.stage == "opd":  # a stage over a trained head: opd-<kind>-..., starting from a head folder
        assert stem[0] == "opd" and recipe.train.init_head
        stem = stem[1:]
    assert stem[0].startswith(("demo", "prepare") + names)
    if recipe.head.kind == "dspark" and stem[0] == "dflash":
        assert recipe.head.options.markov_rank == 0 and not recipe.head.options.confidence_head
    if recipe.train.lora.enabled:
        assert recipe.head.kind == "medusa" and recipe.features.mode == "online"
    if recipe.train.deepspeed:
        assert (CONFIGS.parent / recipe.train.deepspeed).exists()
    if "llama" in path.name or "qwen" in path.name:
        assert "accelerate launch --config_file configs/accelerate/" in first_line(path)
        acc = first_line(path).split("--config_file ")[1].split()[0]
        assert (CONFIGS.parent / acc).exists()


@pytest.mark.parametrize("path", ACCEL, ids=lambda p: p.name)
def test_accelerate_config_loads(path):
    from accelerate.commands.config.config_args import ClusterConfig

    assert first_line(path).startswith("# command: ") and "accelerate launch --config_file" in first_line(path)
    cfg = ClusterConfig.from_yaml_file(str(path))  # accelerate's own loader (unknown keys fail there)
    raw = yaml.safe_load(path.read_text())
    assert cfg.num_processes >= cfg.num_machines >= 1
    if str(cfg.distributed_type).endswith("DEEPSPEED"):
        ds_file = raw["deepspeed_config"]["deepspeed_config_file"]
        assert (CONFIGS.parent / ds_file).exists()
        assert "mixed_precision" not in raw, "mixed_precision must not appear beside a DeepSpeed config file"


@pytest.mark.parametrize("path", DS, ids=lambda p: p.name)
def test_deepspeed_json(path):
    cfg = json.loads(path.read_text())
    assert cfg["zero_optimization"]["stage"] == int(path.stem[-1])
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
        assert cfg[key] == "auto", f"{path.name}: {key} should be 'auto' (accelerate fills it from the recipe)"
    assert cfg.get("zero_allow_untested_optimizer") is True  # the trainer hands DeepSpeed a torch AdamW
    assert "optimizer" not in cfg and "scheduler" not in cfg  # the trainer owns both


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_with_the_old_flat_train_keys_loads_the_same(path, tmp_path):
    """The recipe rewritten with the flat train keys of earlier recipes (train.block_gamma, train.lora, ...) loads
    to the same config, every section key under its old name."""
    from specheads.train.settings import TrainConfig

    data = yaml.safe_load(path.read_text())
    train = data.get("train") or {}
    flat = {k: v for k, v in train.items() if not isinstance(v, dict)}
    for old, new in TrainConfig.RENAMED_KEYS.items():
        section, key = new.split(".")
        if key in (train.get(section) or {}):
            flat[old] = train[section][key]
    renamed = set(TrainConfig.RENAMED_KEYS.values())  # keys born in a section (no old name) stay in it
    for section, keys in train.items():
        newer = {k: v for k, v in keys.items() if f"{section}.{k}" not in renamed} if isinstance(keys, dict) else {}
        if newer:
            flat[section] = newer
    if train:
        data["train"] = flat
    old = tmp_path / path.name
    old.write_text(yaml.safe_dump(data))
    assert load_config(Recipe, old) == load_config(Recipe, path)

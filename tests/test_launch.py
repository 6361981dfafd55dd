"""`specheads launch` (issue 50 point 4): the recipe's launch: section becomes accelerate launch's arguments; bad
settings are one line naming the setting; and two "nodes" on 127.0.0.1 (two machine ranks x 1 process, gloo)
train through the real `specheads train` path to the same head, bit for bit, as one process with the same global
batch (grad_accum 2). The last test launches real processes (~1 min on 2 shared cores)."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from specheads.config import load_config
from specheads.train.recipe import Recipe
from specheads.train.launch import LaunchConfig, accelerate_argv, wait_for_main
from specheads.utils import SpecheadsError

ROOT = Path(__file__).resolve().parents[1]


def _args(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_two_nodes_become_accelerate_launch_arguments():
    cfg = LaunchConfig(num_machines=2, num_processes_per_machine=8, main_process_ip="10.0.0.1",
                       main_process_port=29511)
    argv, env = accelerate_argv(cfg, 1, None, "bf16", ["train", "--config", "r.yaml"])
    assert argv[1:3] == ["-m", "accelerate.commands.launch"] and env == {}  # nccl: no CPU switch
    assert _args(argv, "--num_processes") == "16" and _args(argv, "--machine_rank") == "1"  # all nodes' processes
    assert _args(argv, "--main_process_ip") == "10.0.0.1" and _args(argv, "--main_process_port") == "29511"
    assert _args(argv, "--mixed_precision") == "bf16" and _args(argv, "--rdzv_conf") == "timeout=300"
    assert "--multi_gpu" in argv and argv[-5:] == ["-m", "specheads", "train", "--config", "r.yaml"]
    argv, env = accelerate_argv(cfg, 0, "10.0.0.9", "no", ["train"])  # --main-ip wins over the recipe
    assert _args(argv, "--main_process_ip") == "10.0.0.9"
    one, env = accelerate_argv(LaunchConfig(backend="gloo"), 0, None, "no", ["train"])
    assert "--multi_gpu" not in one and "--rdzv_conf" not in one and env == {"ACCELERATE_USE_CPU": "true"}


@pytest.mark.parametrize("rank,ip,match", [
    (2, "10.0.0.1", r"--node-rank 2: out of range for launch.num_machines 2 \(0..1"),
    (-1, "10.0.0.1", "--node-rank -1: out of range"),
    (1, None, "launch.main_process_ip: not set"),
    (1, "10.0.0.1:29500", "--main-ip: '10.0.0.1:29500' is not an address"),
])
def test_a_bad_node_rank_or_address_is_one_line(rank, ip, match):
    with pytest.raises(SpecheadsError, match=match) as e:
        accelerate_argv(LaunchConfig(num_machines=2), rank, ip, "no", ["train"])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("override,match", [
    ("launch.backend=mpi", r"launch.backend: 'mpi' is not one of \['nccl', 'gloo'\]"),
    ("launch.num_machines=0", "launch.num_machines: must be >= 1"),
    ("launch.main_process_port=70000", "launch.main_process_port: must be in"),
    ("launch.main_process_ip=http://x", "launch.main_process_ip: 'http://x' is not an address"),
])
def test_bad_launch_settings_are_refused_by_name(override, match):
    with pytest.raises(SpecheadsError, match=match):
        load_config(Recipe, None, [override])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_node_that_cannot_reach_the_main_one_times_out_in_one_line():
    port = _free_port()  # nobody listens there
    with pytest.raises(SpecheadsError, match=f"cannot reach the main node at 127.0.0.1:{port} within 1 s") as e:
        wait_for_main("127.0.0.1", port, 1, poll_s=0.2)
    assert "\n" not in str(e.value) and "launch.timeout_s" in str(e.value)


def _cli(*args: str, timeout: int = 240, **popen):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "specheads", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **popen)


def _finish(p: subprocess.Popen, timeout: int = 300) -> str:
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        raise AssertionError(out[-3000:])
    assert p.returncode == 0, out[-3000:]
    return out


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.fixture
def prepared(smol_tokenizer, tmp_path):
    """A recipe on a saved tiny Llama with SmolLM2's tokenizer, prepared (offline features), its run folder."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_prepare import _sharegpt_file

    from specheads.cli import main
    from specheads.target import tiny_target

    target_dir = tmp_path / "target"
    tiny_target(vocab_size=len(smol_tokenizer)).model.save_pretrained(target_dir)
    smol_tokenizer.save_pretrained(target_dir)
    recipe = {"output_dir": str(tmp_path / "nodes"), "seed": 0,
              "target": {"name": str(target_dir), "dtype": "float32"},
              "data": {"source": str(_sharegpt_file(tmp_path)), "max_length": 48, "val_fraction": 0.2},
              "features": {"shard_tokens": 120, "batch_tokens": 96},
              "head": {"kind": "medusa", "medusa": {"num_heads": 2}},
              "train": {"tracker": "none", "batch_size": 2, "lr": 1e-2, "warmup_steps": 1, "max_steps": 3,
                        "save_every": 0, "log_every": 1},
              "eval": {"every_steps": 0, "at_start": False},
              "launch": {"num_machines": 2, "num_processes_per_machine": 1, "main_process_ip": "127.0.0.1",
                         "main_process_port": _free_port(), "backend": "gloo", "timeout_s": 120}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["prepare", "--config", str(path), "--no-progress"]) == 0
    return path


@pytest.mark.slow
def test_two_loopback_nodes_equal_one_process_with_the_same_global_batch(prepared, tmp_path):
    shutil.copytree(tmp_path / "nodes", tmp_path / "one")  # the same prepared data for the one-process run
    node1 = _cli("launch", "--config", str(prepared), "--node-rank", "1", "--", "train")  # before node 0: it waits
    node0 = _cli("launch", "--config", str(prepared), "--node-rank", "0")
    out0, out1 = _finish(node0), _finish(node1)
    assert "the main node answers at 127.0.0.1" in out1 and "trained 3 steps" in out0
    one = _cli("train", "--config", str(prepared), f"output_dir={tmp_path / 'one'}", "train.grad_accum=2")
    _finish(one)
    a, b = _weights(tmp_path / "nodes" / "final"), _weights(tmp_path / "one" / "final")
    assert set(a) == set(b)
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert diff == 0.0, f"2 nodes x 1 process vs 1 process x grad accum 2: max diff {diff}"
    summaries = [json.loads((tmp_path / run / "train_summary.json").read_text()) for run in ("nodes", "one")]
    assert [s["tokens_this_run"] for s in summaries] == [3 * 4 * 48] * 2  # 3 steps x global batch 4 x 48 tokens
    start = _fresh_head(prepared)  # the head both runs started from (set_seed(recipe.seed), as run_training)
    assert any(not torch.equal(a[k], start[k]) for k in start), "the 2-node run did not train"


def _fresh_head(recipe_path: Path) -> dict:
    from accelerate.utils import set_seed

    from specheads.heads.base import build_head
    from specheads.target import load_target

    recipe = load_config(Recipe, recipe_path)
    target = load_target(recipe.target.name, dtype="float32")
    set_seed(recipe.seed)
    return {k: v.detach().clone() for k, v in build_head(recipe.head, target).state_dict().items()}

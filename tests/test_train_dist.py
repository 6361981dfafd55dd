"""Distributed training on this CPU through `accelerate launch` (gloo): 2 processes == 1 process with gradient
accumulation 2 (same weights, bit for bit); DeepSpeed ZeRO-2 through accelerate completes, resumes, and its checkpoint
consolidates into a head that loads, and a crafted pickle in its shards is refused on resume. Each test launches
real processes (~20 s per launch)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
ROOT = HERE.parent
ACCELERATE = str(Path(sys.executable).parent / "accelerate")
LAUNCH = [ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
          "no", "--dynamo_backend", "no", "--main_process_port", "0"]
WORKER = str(HERE / "train_dist_worker.py")


def launch(args: list[str], cpu_env: bool = True, timeout: int = 150, ok: bool = True):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if cpu_env:
        env["ACCELERATE_USE_CPU"] = "true"  # plain DDP on CPU; DeepSpeed picks its CPU accelerator by itself
    r = subprocess.run(LAUNCH + [WORKER] + args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if ok:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.mark.slow
def test_two_processes_equal_one_process_with_grad_accum(tmp_path):
    launch(["--out", str(tmp_path / "ddp"), "--grad-accum", "1", "--max-steps", "4"])
    r = subprocess.run([sys.executable, WORKER, "--out", str(tmp_path / "one"), "--grad-accum", "2",
                        "--max-steps", "4"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = weights(tmp_path / "ddp" / "final"), weights(tmp_path / "one" / "final")
    start = weights_of_fresh_head()
    assert any(not torch.equal(a[k], start[k]) for k in a), "the 2-process run did not train"
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert diff == 0.0, f"2 processes vs 1 process x grad accum 2: max diff {diff}"


def weights_of_fresh_head() -> dict:
    sys.path.insert(0, str(HERE))
    from test_train import make_head, make_recipe

    from specheads.target import tiny_target

    recipe = make_recipe("/tmp/unused", "train.grad_accum=1")
    return {k: v.detach().clone() for k, v in make_head(recipe, tiny_target()).state_dict().items()}


@pytest.mark.slow
def test_deepspeed_zero2_completes_resumes_and_loads(tmp_path):
    pytest.importorskip("deepspeed")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from specheads.heads.base import load_head
    from specheads.target import tiny_target

    out = tmp_path / "ds"
    common = ["--out", str(out), "--deepspeed", str(ROOT / "configs/deepspeed/zero2.json"), "--save-every", "2",
              "--max-steps", "4"]
    launch(common + ["--stop-after", "2"], cpu_env=False, timeout=240)  # first launch may JIT-build a comm op
    ck2 = out / "checkpoints" / "step-000002"
    assert (ck2 / "pytorch_model").is_dir(), "not a DeepSpeed checkpoint"
    launch(common + ["--resume"], cpu_env=False)
    ck4 = out / "checkpoints" / "step-000004"
    assert ck4.is_dir() and (out / "final").is_dir()
    # the ZeRO shards consolidate to the exported head's weights, and the head folder loads
    zero = get_fp32_state_dict_from_zero_checkpoint(str(ck4))  # reads ck4/latest -> the "pytorch_model" tag
    final = weights(out / "final")
    assert set(zero) >= set(k for k in final if not k.startswith(("d2t", "t2d")))
    assert all(torch.equal(zero[k].float(), final[k].float()) for k in zero if k in final)
    start = weights_of_fresh_head()
    assert any(not torch.equal(final[k], start[k]) for k in final), "the DeepSpeed run did not train"
    head = load_head(out / "final", tiny_target())
    assert type(head).__name__ == "MedusaHead"
    # DeepSpeed's shards are pickles: a crafted one is refused (torch.load weights_only + allowlist), never run
    marker = tmp_path / "pwned"
    states = ck4 / "pytorch_model" / "mp_rank_00_model_states.pt"
    torch.save({"module": _Payload(marker)}, states)
    r = launch(common[:-1] + ["6", "--resume"], cpu_env=False, ok=False)
    assert r.returncode != 0 and "sha256 differs" in r.stdout + r.stderr and not marker.exists()  # checksums first
    (ck4 / "checksums.sha256").unlink()  # without checksums (an older checkpoint) the loader's allowlist refuses it
    state = json.loads((ck4 / "trainer_state.json").read_text())
    (ck4 / "trainer_state.json").write_text(json.dumps({**state, "format": "specheads-checkpoint/2"}))  # older
    r = launch(common[:-1] + ["6", "--resume"], cpu_env=False, ok=False)
    assert r.returncode != 0 and "refused to unpickle" in r.stdout + r.stderr and not marker.exists()


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)

"""scripts/gpu_check.py, the prepared device check, run on CPU with tiny sizes so that it cannot rot before a GPU
is lent (about 20 s on 2 shared cores). On the device it runs the same sections at full size (docs/gpu.md)."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _exact(drafters: dict) -> None:
    for name, v in drafters.items():  # every drafter ran (DSpark included) and equals HF generate
        assert "error" not in v and v["identical"] == 1.0 and v["tau"] >= 1.0, (name, v)


def test_gpu_check_runs_every_section_on_cpu(tmp_path):
    threads = torch.get_num_threads()
    try:
        rc = _script().main(["--tiny", "--sections", "serve", "--out", str(tmp_path / "gpu_check.json")])
    finally:
        torch.set_num_threads(threads)
    rec = json.loads((tmp_path / "gpu_check.json").read_text())
    sec = rec["sections"]
    assert rc == 0 and rec["schema"] == "specheads.gpu_check/1" and rec["mode"] == "tiny"
    assert set(sec) == {"environment", "exactness_fp32", "verify_cost_llama-1b", "decode_llama-1b", "training_bf16",
                        "batched_fp32", "verify_cost_llama-8b", "decode_llama-8b", "identical_bf16"}
    assert all(v["ok"] for v in sec.values()) and rec["summary"]["failed_sections"] == []
    assert sec["environment"]["torch"] == torch.__version__ and sec["environment"]["transformers"]
    from specheads.heads.kinds import kind_names

    assert {"plain", "prompt-lookup", *kind_names()} <= set(sec["exactness_fp32"]["drafters"])  # every kind
    for shape in ("llama-1b", "llama-8b"):  # our loop's tokens/s beside HF generate's, the same greedy tokens
        d = sec[f"decode_{shape}"]
        assert d["plain_eager_equals_hf"] and d["methods"]["plain/off"]["tokens_per_s"] > 0
    _exact(sec["exactness_fp32"]["drafters"])  # fp32 greedy: every drafter equals HF generate
    _exact(sec["batched_fp32"]["drafters"])  # batched rows too, with and without the verify budget
    assert {"eagle3+sched", "prompt-lookup+sched"} <= set(sec["batched_fp32"]["drafters"])
    assert 0 <= sec["identical_bf16"]["drafters"]["plain"]["identical"] <= 1  # a share, not a promise, in bf16
    for shape in ("llama-1b", "llama-8b"):
        v = sec[f"verify_cost_{shape}"]
        rel = [v["verify"]["relative"][k] for k in sorted(v["verify"]["relative"], key=int)]
        assert rel[0] == 1.0 and rel == sorted(rel) and v["batch"]["relative"]["1"]["1"] == 1.0
    kinds = sec["training_bf16"]["kinds"]
    assert set(kinds) == {"medusa", "eagle", "eagle3", "dspark"}
    assert all(k["finite"] and k["params_changed"] and k["tokens_per_s"] > 0 for k in kinds.values())


@pytest.mark.slow
def test_gpu_check_train_sections_on_cpu(tmp_path):
    """prepare on the device against the CPU, a bf16 accelerate train + resume and an eval, with device=cpu (tiny
    shapes, SmolLM2's tokenizer from the converted cache)."""
    threads = torch.get_num_threads()
    try:
        rc = _script().main(["--tiny", "--sections", "train", "--out", str(tmp_path / "gpu_check.json")])
    finally:
        torch.set_num_threads(threads)
    sec = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert set(sec) == {"environment", "prepare_cuda_vs_cpu", "train_accelerate", "eval_accelerator"}
    assert rc == 0 and all(v["ok"] for v in sec.values()), {k: v.get("error") for k, v in sec.items()}
    prep = sec["prepare_cuda_vs_cpu"]
    assert prep["regenerate"]["tokens_equal"] and prep["extract"]["within_tolerance"]
    for kind in ("eagle3", "dspark"):
        k = sec["train_accelerate"]["kinds"][kind]
        assert k["finite"] and k["falling"] and k["steps"] == [3, 6] and k["checkpoints_after_3"]
    assert sec["eval_accelerator"]["prompts"] == 3

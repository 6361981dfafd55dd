"""The training half of the prepared device check (scripts/gpu_check.py runs these sections; docs/gpu.md):
- prepare_cuda_vs_cpu: greedy regeneration of a few prompts (train/regenerate.regenerate, fp32) and hidden-state
  extraction of a few samples (train/features.extract_features) on the device and on the CPU, both timed, on a
  random Llama of the 1B shape with SmolLM2's tokenizer: regenerated token ids equal, hidden states within fp32 /
  bf16 tolerance;
- train_accelerate: `run_training` (the `specheads train` path, accelerate, train.mixed_precision bf16) of an
  EAGLE-3 and a DSpark head on a random target saved to a folder, offline features prepared on the device
  (`prepare` with the target there), 3 steps, a checkpoint, then --resume to 6 steps: loss finite and falling;
- eval_accelerator: `specheads eval` (cli main) of the trained EAGLE-3 head with --device on the accelerator.
No network: random weights; the tokenizer is a folder (`--tokenizer`, default .gpu/tokenizer, else the converted
SmolLM2 cache of this machine). tiny=True: the same on the CPU with tiny shapes (tests/test_gpu_check.py).
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PREP_SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, rope_theta=500000.0)  # Llama-3.2-1B (vocab: the tokenizer's, 49,152)
TRAIN_SHAPE = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=16,
                   num_key_value_heads=4)  # ~0.15B: a short train and eval, not a speed figure
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
BF16_REL_TOL = 0.05  # ||bf16 device - fp32 cpu|| / ||fp32 cpu|| per layer (bf16: 8 bits of mantissa, 16 layers)
FP32_REL_TOL = 1e-3  # fp32 device against fp32 cpu (summation order only)


def find_tokenizer(folder: str | None):
    """The tokenizer: `folder`, else ROOT/.gpu/tokenizer, else the converted SmolLM2 cache (no model load)."""
    from transformers import AutoTokenizer

    for cand in ([folder] if folder else []) + [str(ROOT / ".gpu" / "tokenizer")]:
        if Path(cand, "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(cand)
    from specheads.target import _gguf_cache_dir, _gguf_source

    src = _gguf_source("smollm2-135m")
    cache = _gguf_cache_dir(Path(src)) if src else None
    if cache is None or not (cache / "tokenizer.json").is_file():
        raise RuntimeError("no tokenizer: pass --tokenizer DIR or copy one to .gpu/tokenizer (docs/gpu.md)")
    return AutoTokenizer.from_pretrained(str(cache))


def random_target(shape: dict, tok, device: str, dtype: torch.dtype, name: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    from specheads.target import Target

    cfg = LlamaConfig(**shape, vocab_size=len(tok), max_position_embeddings=2048, tie_word_embeddings=False,
                      bos_token_id=tok.bos_token_id or 1, eos_token_id=tok.eos_token_id or 2, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
    return Target(model.eval().requires_grad_(False), tok, name)


def conversations(n: int) -> list[dict]:
    topics = ("rivers", "prime numbers", "bread", "the moon", "chess", "rain", "clocks", "bees")
    return [{"conversation_id": f"c{i}", "messages": [
        {"role": "user", "content": f"Tell me about {topics[i % len(topics)]}, briefly. " * (1 + i % 3)},
        {"role": "assistant", "content": f"Here is a short note on {topics[i % len(topics)]}. " * (2 + i % 4)}]}
        for i in range(n)]


def _timed(device: str, fn):
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def _regen_ids(target, convs, path: Path, new_tokens: int) -> list[list[int]]:
    from specheads.train.regenerate import regenerate

    regenerate(target, convs, path, max_length=256, max_new_tokens=new_tokens, batch_size=1, progress=False)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [m.get("token_ids") for r in rows for m in r["messages"] if m["role"] == "assistant"]


def prepare_cuda_vs_cpu(device: str, tiny: bool, tokenizer: str | None) -> dict:
    """Regeneration (fp32) and extraction (fp32 and bf16) on `device` against the CPU, timed both ways."""
    from specheads.target import chat_prompt_ids
    from specheads.train.features import extract_features

    tok = find_tokenizer(tokenizer)
    shape, n, new = (TINY, 2, 8) if tiny else (PREP_SHAPE, 4, 24)
    cpu = random_target(shape, tok, "cpu", torch.float32, "random-1b")
    dev = random_target(shape, tok, device, torch.float32, "random-1b")
    dev.model.load_state_dict(cpu.model.state_dict())  # the same weights on both
    convs = conversations(n)
    out = {"shape": shape, "vocab": len(tok), "conversations": n, "new_tokens": new}
    with tempfile.TemporaryDirectory() as d:
        ids_cpu, s_cpu = _timed("cpu", lambda: _regen_ids(cpu, convs, Path(d, "cpu.jsonl"), new))
        ids_dev, s_dev = _timed(device, lambda: _regen_ids(dev, convs, Path(d, "dev.jsonl"), new))
    out["regenerate"] = {"cpu_s": round(s_cpu, 2), "device_s": round(s_dev, 2),
                         "tokens_equal": ids_cpu == ids_dev and all(ids_cpu), "answers": len(ids_cpu)}
    rows = [chat_prompt_ids(tok, c["messages"][:1]) for c in convs]
    T = max(map(len, rows))
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    layers = sorted({1, cpu.num_layers // 2, cpu.num_layers})
    ref, s_cpu = _timed("cpu", lambda: extract_features(cpu, ids, mask, layers))
    got, s_dev = _timed(device, lambda: extract_features(dev, ids.to(device), mask.to(device), layers))
    dev.model.to(torch.bfloat16)
    got16, s16 = _timed(device, lambda: extract_features(dev, ids.to(device), mask.to(device), layers))
    lens = [len(r) for r in rows]

    def rel(a, b):  # per sample (its real positions), over all stored layers; the worst sample
        return max(float((a[i][:n].float().cpu() - b[i][:n]).norm() / b[i][:n].norm()) for i, n in enumerate(lens))

    ext = {"layers": layers, "tokens": sum(lens), "cpu_s": round(s_cpu, 3), "device_fp32_s": round(s_dev, 3),
           "device_bf16_s": round(s16, 3), "rel_err_fp32": rel(got, ref), "rel_err_bf16": rel(got16, ref)}
    ext["within_tolerance"] = ext["rel_err_fp32"] < FP32_REL_TOL and ext["rel_err_bf16"] < BF16_REL_TOL
    out["extract"] = ext
    if not (out["regenerate"]["tokens_equal"] and ext["within_tolerance"]):
        raise AssertionError(f"{device} against cpu: regenerate {out['regenerate']}, extract {ext}")
    return out


def _precision(tiny: bool) -> tuple[str, str]:
    """(target.dtype, train.mixed_precision): bf16 on the device; fp32 for the CPU run of the same path (tiny=True:
    an AVX2 CPU has no bf16 matmul, a bf16 step there took ~2 min where fp32 takes under a second)."""
    return ("float32", "no") if tiny else ("bfloat16", "bf16")


def _recipe(folder: Path, target_dir: Path, data: Path, kind: str, tiny: bool, *over: str):
    from specheads.config import load_config
    from specheads.train.recipe import Recipe

    own = {"eagle3": ["head.draft_vocab_size=2048", "head.eagle3.ttt_steps=3"],
           "dspark": ["head.dspark.block_size=4"]}[kind]
    dtype, mixed = _precision(tiny)
    return load_config(Recipe, None, [
        f"output_dir={folder}", f"target.name={target_dir}", f"target.dtype={dtype}", f"data.source={data}",
        "data.max_length=128", "data.val_fraction=0.2", f"head.kind={kind}", *own, "train.tracker=none",
        "train.batch_size=4", "train.lr=2e-3", "train.warmup_steps=1", "train.log_every=1", "train.save_every=3",
        "train.max_steps=3", f"train.mixed_precision={mixed}", "eval.every_steps=0", "eval.at_start=false",
        "eval.max_samples=8", "eval.batch_size=4", *over])


def _train_kind(work: Path, target_dir: Path, data: Path, kind: str, device: str, tiny: bool) -> dict:
    from specheads.target import load_target
    from specheads.train.prepare import prepare
    from specheads.train.trainer import Trainer, run_training

    losses: list[float] = []

    class Recording(Trainer):  # the loss of every logged step (train.log_every=1)
        def _log_if_due(self, run, bar):
            super()._log_if_due(run, bar)
            if run.state.last_loss is not None and len(losses) < run.state.step:
                losses.append(float(run.state.last_loss))

    run = work / kind
    recipe = _recipe(run, target_dir, data, kind, tiny)
    target = load_target(str(target_dir), dtype=_precision(tiny)[0], device=device)
    prep, prep_s = _timed(device, lambda: prepare(recipe, target=target, progress=False))
    del target
    first, s1 = _timed(device, lambda: run_training(recipe, trainer_class=Recording))
    ck = sorted(p.name for p in (run / "checkpoints").iterdir())
    resumed, s2 = _timed(device, lambda: run_training(_recipe(run, target_dir, data, kind, tiny, "train.max_steps=6"),
                                                      resume=True, trainer_class=Recording))
    finite = all(math.isfinite(x) for x in losses)
    out = {"prepare_s": round(prep_s, 2), "samples": prep.get("samples"), "train_s": round(s1, 2),
           "resume_s": round(s2, 2), "steps": [first.steps, resumed.steps], "checkpoints_after_3": ck,
           "losses": [round(x, 4) for x in losses], "finite": finite,
           "falling": finite and len(losses) >= 4 and sum(losses[-2:]) < sum(losses[:2]),
           "final": str(run / "final")}
    if not (out["finite"] and out["falling"] and resumed.steps == 6 and ck):
        raise AssertionError(f"{kind}: {out}")
    return out


def train_accelerate(device: str, tiny: bool, tokenizer: str | None, work: Path) -> dict:
    """EAGLE-3 and DSpark through run_training on `device` (accelerate picks it), bf16 (fp32 on the CPU run),
    checkpoint + resume."""
    tok = find_tokenizer(tokenizer)
    target_dir = work / "target"
    dtype, mixed = _precision(tiny)
    t = random_target(TINY if tiny else TRAIN_SHAPE, tok, "cpu", getattr(torch, dtype), "random-train")
    t.model.save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    data = work / "convs.json"
    data.write_text(json.dumps([{"id": c["conversation_id"], "conversations": [
        {"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]} for m in c["messages"]]}
        for c in conversations(24)]))
    out = {"shape": TINY if tiny else TRAIN_SHAPE, "mixed_precision": mixed, "kinds": {}}
    for kind in ("eagle3", "dspark"):
        out["kinds"][kind] = _train_kind(work, target_dir, data, kind, device, tiny)
    return out


def eval_accelerator(device: str, work: Path) -> dict:
    """`specheads eval` of the trained EAGLE-3 head (train_accelerate's) on `device`, MT-bench prompts."""
    from specheads.cli import main

    buf = io.StringIO()
    argv = ["eval", "--head", str(work / "eagle3" / "final"), "--target", str(work / "target"), "--device", device,
            "--limit", "3", "--max-new-tokens", "24", "--block-tree-nodes", "0", "--json"]
    with contextlib.redirect_stdout(buf):
        t = time.perf_counter()
        rc = main(argv)
        s = time.perf_counter() - t
    text = buf.getvalue().strip().splitlines()
    if rc != 0 or not text:
        raise AssertionError(f"specheads eval exited {rc}: {text[-3:]}")
    figures = json.loads(text[-1])
    return {"seconds_eval": round(s, 2), "device": device, "prompts": figures.get("prompts"),
            "answer_tokens": figures.get("answer_tokens"),
            "figures": {k: v for k, v in figures.items() if isinstance(v, (int, float))}}

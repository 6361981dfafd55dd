"""The prepared device check (docs/gpu.md): one command, about 8 minutes on one H200, no network, every model built
from config with random weights (the bundled SmolLM2 GGUF lives in the venv, not in the repo that travels).

    PYTHONPATH=/tmp/site:. python3 scripts/gpu_check.py --out $OUT/gpu_check.json      # CUDA
    python scripts/gpu_check.py --tiny --out /tmp/gpu_check.json                        # CPU, tiny sizes (a test)

Sections, each timed and recorded even when it fails (the JSON is rewritten after each one, so a timeout keeps
what finished; a section that would start past --budget-s is skipped and says so):
- environment: device, torch, CUDA, cuDNN, transformers, attention implementation;
- exactness_fp32: greedy fp32 output of every drafter (plain, prompt-lookup, random EAGLE-1 / EAGLE-3 / Medusa /
  DSpark heads through drafters.build_drafter) against HF generate on the device, one prompt at a time;
- batched_fp32: infer/batch.generate_batch (3 rows at a time, prompts joining) against HF generate per row, with
  and without the batch verify budget;
- identical_bf16: the same in bf16: share of prompts whose tokens equal HF generate's (bf16 rounding differs
  between a tree forward and a one-token forward, so below 100% is possible and is what this measures);
- verify_cost_<shape>: t(n)/t(1) for n up to 128 nodes (profile.measure_verify_cost) and the rows x tokens
  surface t(B, n)/t(1, 1) (profile.measure_batch_cost) for a ~1B and a ~8B Llama shape in bf16;
- training_bf16: tokens/s of one training step (target features + head loss + backward + AdamW) per head kind,
  head under bf16 autocast with fp32 master weights, as train.mixed_precision bf16 runs it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # the repo root
# (`specheads` without an install) and scripts/ (gpu_check_train)

import torch  # noqa: E402

SCHEMA = "specheads.gpu_check/1"
# Llama shapes (random weights, bf16) for the cost curves: Llama-3.2-1B and Llama-3.1-8B configs
SHAPES = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
}
TINY_SHAPES = {  # --tiny: the same sections on CPU in seconds
    "llama-1b": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256),
    "llama-8b": dict(hidden_size=96, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256),
}
HEAD_KINDS = ("medusa", "eagle", "eagle3", "dspark")


class Check:
    """Runs sections in order, records each (figures, seconds, error), writes the JSON after each one."""

    def __init__(self, out: Path, budget_s: float, tiny: bool):
        self.out, self.budget_s, self.tiny, self.t0 = out, budget_s, tiny, time.perf_counter()
        self.record = {"schema": SCHEMA, "mode": "tiny" if tiny else "cuda", "sections": {}}

    def section(self, name: str, fn, *args) -> None:
        elapsed = time.perf_counter() - self.t0
        if elapsed > self.budget_s:
            self.record["sections"][name] = {"ok": False, "skipped": f"time budget: {elapsed:.0f} s of "
                                                                      f"{self.budget_s:.0f} s used"}
        else:
            t = time.perf_counter()
            try:
                got = {"ok": True, **fn(*args)}
            except Exception as e:  # noqa: BLE001 (a device check records every failure and goes on)
                got = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}
            got["seconds"] = round(time.perf_counter() - t, 2)
            self.record["sections"][name] = got
            print(f"[gpu_check] {name}: {'ok' if got['ok'] else 'FAILED ' + got['error']} ({got['seconds']} s)",
                  flush=True)
        self.write()

    def write(self) -> None:
        self.record["total_s"] = round(time.perf_counter() - self.t0, 2)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record, indent=1, default=str))
        os.replace(tmp, self.out)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------ sections
def environment(device: str) -> dict:
    import transformers

    import specheads

    env = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
           "transformers": transformers.__version__, "specheads": specheads.__version__,
           "python": platform.python_version(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=torch.cuda.get_device_name(0), gpu_memory_gib=round(p.total_memory / 2 ** 30, 1),
                   capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count)
    return env


def exact_target(device: str, dtype: torch.dtype):
    """A small random Llama on the device (tests/exactness size on CPU, a little larger on CUDA)."""
    from specheads.target import tiny_target

    t = tiny_target(vocab_size=256 if device == "cpu" else 1024, hidden_size=64 if device == "cpu" else 256,
                    num_layers=4, seed=0, dtype=dtype)
    t.model.to(device)
    return t


def prompts(vocab: int, n: int) -> list[list[int]]:
    """n prompts of 6..17 tokens, every other one repetitive (prompt lookup drafts from it)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        base = torch.randint(3, vocab, (6 + i,), generator=g).tolist()
        out.append(base * 2 if i % 2 else base + torch.randint(3, vocab, (5,), generator=g).tolist())
    return out


def hf_greedy(target, p: list[int], n: int) -> list[int]:
    ids = torch.tensor([p], device=target.device)
    with torch.no_grad():
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                    pad_token_id=0)
    return out[0, len(p):].tolist()


def drafter_makers(target) -> dict:
    """name -> make_drafter() through the public API (drafters.build_drafter); a kind without a drafter in this
    build is recorded, not raised."""
    from specheads.heads.base import HeadSpec, build_head
    from specheads.infer.drafters import build_drafter

    makers = {"plain": lambda: build_drafter(target, "plain"),
              "prompt-lookup": lambda: build_drafter(target, "prompt-lookup", "5")}
    counts = torch.arange(float(target.vocab_size))
    specs = {"medusa": HeadSpec(kind="medusa", num_heads=3), "eagle": HeadSpec(kind="eagle"),
             "eagle3": HeadSpec(kind="eagle3", draft_vocab_size=target.vocab_size // 4),
             "dspark": HeadSpec(kind="dspark", block_size=4)}
    from specheads.heads.kinds import kind_names, kind_spec

    for kind in kind_names():  # every registered kind: the ones above, the rest from their declared example
        ks = kind_spec(kind)
        spec = specs.get(kind) or HeadSpec(kind=kind, **ks.example)
        try:
            head = build_head(spec, target, token_counts=counts if spec.draft_vocab_size else None).eval()
        except Exception as e:  # noqa: BLE001 (recorded as that drafter's error)
            makers[kind] = (lambda err=e: (_ for _ in ()).throw(err))
            continue
        tree = "3,3,8" if kind.startswith("eagle") else "3" if ks.family == "block" else None
        makers[kind] = (lambda h=head, tr=tree: build_drafter(target, h, tr))
    return makers


def exactness(device: str, dtype: torch.dtype, n_prompts: int, new_tokens: int) -> dict:
    """Per drafter: share of prompts whose greedy tokens equal HF generate's, τ, and errors (e.g. no drafter); on
    CUDA each drafter twice, the owned forward eager (--compile off) and through CUDA graphs ("+graphs")."""
    from specheads.infer.engine.generate import generate

    target = exact_target(device, dtype)
    ps = prompts(target.vocab_size, n_prompts)
    refs = [hf_greedy(target, p, new_tokens) for p in ps]
    out = {"dtype": str(dtype).replace("torch.", ""), "prompts": n_prompts, "new_tokens": new_tokens, "drafters": {}}
    modes = ("off", "on") if device == "cuda" else ("auto",)
    for mode in modes:
        target.compile = mode
        for name, make in drafter_makers(target).items():
            key = name + ("+graphs" if mode == "on" else "")
            try:
                res = [generate(target, make(), p, max_new_tokens=new_tokens) for p in ps]
            except Exception as e:  # noqa: BLE001 (one drafter's failure is its own record)
                out["drafters"][key] = {"error": f"{type(e).__name__}: {e}"}
                continue
            fw = sum(r.stats.target_forwards for r in res)
            out["drafters"][key] = {"identical": sum(r.ids == ref for r, ref in zip(res, refs)) / len(ps),
                                    "tau": sum(r.stats.new_tokens for r in res) / max(fw, 1)}
    target.compile = "auto"
    return out


def decode_speed(shape_name: str, device: str, tiny: bool) -> dict:
    """Tokens/s of one request (a 128-token prompt, 128 new tokens; tiny: 16 and 16) on a random-weight Llama of
    the shape: HF generate, and plain decoding and prompt lookup through our loop with the owned forward eager
    (--compile off) and through CUDA graphs (--compile on); `same_as_eager`: the graphed run's tokens equal the
    eager run's (bf16: rounding may differ between the two attention lengths)."""
    from specheads.infer.drafters import build_drafter
    from specheads.infer.engine.generate import generate
    from specheads.infer.engine.runner import runner_for

    shape = (TINY_SHAPES if tiny else SHAPES)[shape_name]
    target = shape_target(shape, device, torch.float32 if tiny else torch.bfloat16, shape_name)
    n = 16 if tiny else 128
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, target.vocab_size, (n,), generator=g).tolist()
    inputs = {"plain": prompt, "prompt-lookup": prompt[: n // 4] * 4}  # lookup drafts from a repetitive prompt

    def timed(fn):
        fn()  # warm-up (and graph capture)
        sync(device)
        t = time.perf_counter()
        r = fn()
        sync(device)
        return r, time.perf_counter() - t

    hf, s = timed(lambda: hf_greedy(target, prompt, n))
    out = {"new_tokens": n, "hf_generate": {"tokens_per_s": n / s}, "methods": {}}
    eager = {}
    for mode in (("off",) if tiny else ("off", "on")):
        target.compile = mode
        for name, p in inputs.items():
            r, s = timed(lambda: generate(target, build_drafter(target, name, "5" if name != "plain" else None), p,
                                          max_new_tokens=n, ignore_eos=True))
            rec = {"tokens_per_s": len(r.ids) / s, "tau": r.stats.new_tokens / max(r.stats.target_forwards, 1),
                   "path": runner_for(target).compiled or "eager"}
            if mode == "off":
                eager[name] = r.ids
            else:
                rec["same_as_eager"] = r.ids == eager[name]
                rec["speedup_vs_eager"] = rec["tokens_per_s"] / out["methods"][f"{name}/off"]["tokens_per_s"]
            out["methods"][f"{name}/{mode}"] = rec
    out["plain_eager_equals_hf"] = eager["plain"] == hf
    del target
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def batched(device: str, dtype: torch.dtype, n_prompts: int, new_tokens: int, cost=None) -> dict:
    """generate_batch, 3 rows at a time, against HF generate per row; with the batch budget on `cost` (or a
    made-up surface) too."""
    from specheads.infer.engine.batch import generate_batch
    from specheads.infer.scheduling.batch_budget import BudgetScheduler

    target = exact_target(device, dtype)
    ps = prompts(target.vocab_size, n_prompts)
    refs = [hf_greedy(target, p, new_tokens) for p in ps]
    makers = drafter_makers(target)
    cost = cost or (lambda B, n: 1.0 + 0.05 * B * (n - 1))
    out = {"rows_at_a_time": 3, "prompts": n_prompts, "drafters": {}}
    for name in ("plain", "prompt-lookup", "eagle3", "medusa", "dspark"):
        for sched in (False, True):
            key = name + ("+sched" if sched else "")
            try:
                res = generate_batch(target, makers[name], ps, new_tokens, batch_size=3,
                                     scheduler=BudgetScheduler(cost) if sched else None)
            except Exception as e:  # noqa: BLE001
                out["drafters"][key] = {"error": f"{type(e).__name__}: {e}"}
                continue
            out["drafters"][key] = {"identical": sum(r.ids == ref for r, ref in zip(res.rows, refs)) / len(ps),
                                    "tau": res.stats.tau, "tokens_per_s": res.stats.tokens_per_s}
    return out


def shape_target(shape: dict, device: str, dtype: torch.dtype, name: str):
    """A random-weight Llama of `shape`, built on the device in `dtype` (no weights loaded, no network)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specheads.target import Target

    cfg = LlamaConfig(**shape, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
    model.eval().requires_grad_(False)
    return Target(model, None, f"random-{name}")


def verify_cost(shape_name: str, device: str, tiny: bool) -> dict:
    """t(n)/t(1) for n up to 128 nodes over 1024 cached tokens (tiny: 16 over 64), and the rows x tokens surface."""
    from specheads.infer.scheduling.profile import measure_batch_cost, measure_verify_cost

    shape = (TINY_SHAPES if tiny else SHAPES)[shape_name]
    target = shape_target(shape, device, torch.float32 if tiny else torch.bfloat16, shape_name)
    params = sum(p.numel() for p in target.model.parameters())
    sizes = (1, 2, 4, 8, 16) if tiny else (1, 2, 4, 8, 16, 32, 64, 128)
    context = 64 if tiny else 1024
    verify = measure_verify_cost(target, sizes=sizes, context=context, repeats=2 if tiny else 5)
    eager = None
    if device == "cuda":  # the curve above ran through CUDA graphs (--compile auto); the eager one beside it
        target.compile = "off"
        eager = measure_verify_cost(target, sizes=sizes, context=context, repeats=5)
        target.compile = "auto"
    rows = (1, 2, 4) if tiny else (1, 2, 4, 8, 16)
    surface = measure_batch_cost(target, rows=rows, tokens=(1, 2, 4) if tiny else (1, 2, 4, 8, 16),
                                 context=min(context, 512), repeats=2 if tiny else 3)
    out = {"shape": shape, "params_b": round(params / 1e9, 3), "dtype": str(target.dtype).replace("torch.", ""),
           "attn_implementation": target.model.config._attn_implementation, "verify": verify, "batch": surface,
           "verify_eager": eager}
    del target
    if device == "cuda":
        out["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)
        torch.cuda.empty_cache()
    return out


def training(device: str, tiny: bool) -> dict:
    """Tokens/s of one training step per head kind on the ~1B shape (tiny: the tiny shape): the target's features
    (bf16, no grad), the head's loss under bf16 autocast (fp32 master weights), backward, AdamW."""
    from specheads.heads.base import HeadSpec, build_head
    from specheads.train.features import extract_features
    from specheads.train.steps import LossSettings, train_loss

    dtype = torch.float32 if tiny else torch.bfloat16
    target = shape_target((TINY_SHAPES if tiny else SHAPES)["llama-1b"], device, dtype, "llama-1b")
    B, T, steps = (2, 32, 2) if tiny else (4, 1024, 5)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, target.vocab_size, (B, T), generator=g).to(device)
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "attention_mask": torch.ones_like(ids)}
    out = {"batch": B, "seq_len": T, "timed_steps": steps, "kinds": {}}
    L = target.num_layers
    for kind in HEAD_KINDS:
        own = {"medusa": {"num_heads": 3}, "eagle3": {"ttt_steps": 3 if tiny else 7}}.get(kind, {})  # head.<kind>
        spec = HeadSpec(kind=kind, draft_vocab_size=min(8192, target.vocab_size // 4) if kind == "eagle3" else None,
                        **own)
        head = build_head(spec, target, token_counts=torch.arange(float(target.vocab_size)))
        layers = sorted(set(head.config.feature_layers) | {L})
        opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-4)
        before = [p.detach().clone() for p in head.parameters() if p.requires_grad]
        times, feats = [], []
        for i in range(steps + 1):  # the first step warms up kernels and allocators
            sync(device)
            t = time.perf_counter()
            hidden = extract_features(target, ids, batch["attention_mask"], layers)
            sync(device)
            feats.append(time.perf_counter() - t)
            with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=not tiny):
                loss = train_loss(kind, head, {**batch, "hidden": hidden}, target, layers,
                                  head.config.feature_layers, LossSettings()).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(device)
            times.append(time.perf_counter() - t)
        changed = any(not torch.equal(a, p.detach()) for a, p in zip(before, (q for q in head.parameters()
                                                                              if q.requires_grad)))
        best = min(times[1:])
        out["kinds"][kind] = {"tokens_per_s": B * T / best, "step_s": best, "target_s": min(feats[1:]),
                              "head_tokens_per_s": B * T / max(best - min(feats[1:]), 1e-9),
                              "loss": float(loss.detach()),
                              "finite": bool(torch.isfinite(loss)), "params_changed": changed}
        del head, opt
    return out


def summarize(rec: dict) -> dict:
    """The figures a reader looks for first, gathered from the sections."""
    sec = rec["sections"]
    out = {"failed_sections": [k for k, v in sec.items() if not v.get("ok")]}
    for name in ("exactness_fp32", "batched_fp32", "identical_bf16"):
        parts = sec.get(name, {})
        for key in ("drafters", "batched"):
            for d, v in (parts.get(key) or {}).items():
                out.setdefault(f"{name}.{key}" if key == "batched" else name, {})[d] = v.get("identical",
                                                                                             v.get("error"))
    for shape in SHAPES:
        v = sec.get(f"verify_cost_{shape}", {}).get("verify")
        if v:
            out[f"t(n)/t(1) {shape}"] = {n: round(x, 3) for n, x in v["relative"].items()}
    kinds = sec.get("training_bf16", {}).get("kinds") or {}
    out["training tokens/s"] = {k: round(v["tokens_per_s"]) for k, v in kinds.items()}
    return out


def serve_sections(check: Check, device: str, tiny: bool) -> None:
    """The serving sections: exactness, cost curves, decoding speed, the training step, batched, bf16."""
    n, new = (3, 12) if tiny else (6, 48)
    check.section("exactness_fp32", exactness, device, torch.float32, n, new)
    check.section("verify_cost_llama-1b", verify_cost, "llama-1b", device, tiny)
    check.section("decode_llama-1b", decode_speed, "llama-1b", device, tiny)
    check.section("training_bf16", training, device, tiny)
    surface = check.record["sections"]["verify_cost_llama-1b"].get("batch")
    cost = None
    if surface:
        from specheads.infer.scheduling.costs import batch_cost_fn

        cost = batch_cost_fn({"batch": surface})
    check.section("batched_fp32", batched, device, torch.float32, n, new, cost)
    check.section("verify_cost_llama-8b", verify_cost, "llama-8b", device, tiny)
    check.section("decode_llama-8b", decode_speed, "llama-8b", device, tiny)
    check.section("identical_bf16", lambda: {**exactness(device, torch.bfloat16, n, new),
                                             "batched": batched(device, torch.bfloat16, n, new, cost)["drafters"]})


def train_sections(check: Check, device: str, tiny: bool, tokenizer: str | None) -> None:
    """prepare on the device against the CPU, a bf16 accelerate train + resume, an eval (gpu_check_train.py)."""
    import tempfile

    import gpu_check_train as gt

    check.section("prepare_cuda_vs_cpu", gt.prepare_cuda_vs_cpu, device, tiny, tokenizer)
    with tempfile.TemporaryDirectory(prefix="gpu_check_train-") as work:
        check.section("train_accelerate", gt.train_accelerate, device, tiny, tokenizer, Path(work))
        check.section("eval_accelerator", gt.eval_accelerator, device, Path(work))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSON written (rewritten after each section)")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes on CPU (the default without CUDA)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="sections starting later are skipped (seconds)")
    ap.add_argument("--sections", choices=("all", "serve", "train"), default="all",
                    help="serve: exactness, costs, decoding, batched; train: prepare on the device against the CPU, "
                         "a bf16 accelerate train with resume, an eval (scripts/gpu_check_train.py); default all")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder for the train sections (default "
                                                      ".gpu/tokenizer, else this machine's converted SmolLM2)")
    a = ap.parse_args(argv)
    tiny = a.tiny or not torch.cuda.is_available()
    device = "cpu" if tiny else "cuda"
    if tiny:
        torch.set_num_threads(1)  # tiny sequential forwards: one thread is several times faster on shared cores
    check = Check(Path(a.out), a.budget_s, tiny)
    check.section("environment", environment, device)
    import transformers

    if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 24):
        print(f"[gpu_check] transformers {transformers.__version__} is older than our 5.24 (the `cache=` argument): "
              "carry the wheel (docs/gpu.md) and put /tmp/site first on PYTHONPATH", flush=True)
    if a.sections in ("all", "serve"):
        serve_sections(check, device, tiny)
    if a.sections in ("all", "train"):
        train_sections(check, device, tiny, a.tokenizer)
    check.record["summary"] = summarize(check.record)
    check.write()
    print(json.dumps(check.record["summary"], indent=1))
    return 0 if not check.record["summary"]["failed_sections"] else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Which compiled path runs the owned one-token step fastest on this CPU? `--compile`'s auto picks the C++ kernels on
a bf16 AVX512-BF16 CPU; this measures that choice against torch.compile (inductor, weights frozen) of the same
static-shape step CUDA graphs capture (engine/graphs.py), and PyTorch's eager ops, alternated round by round in one
process (a benchmark, not a test; run it on an idle machine).

    .venv/bin/python scripts/bench_compile_paths.py --threads 2 --out docs/results/compile-paths/compile.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256, help="cached tokens before the timed steps")
    ap.add_argument("--steps", type=int, default=40, help="timed one-token steps per path and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import torch._inductor.config as ic

    from specheads.infer.engine.graphs import GraphedOwned, _Graph
    from specheads.infer.engine.owned import OwnedLlama
    from specheads.target import load_target

    ic.freezing = True  # weights as constants: inductor may prepack them for oneDNN
    t = load_target("smollm2-135m", dtype="bfloat16")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, t.vocab_size, (a.context,), generator=g)
    paths, record = {}, {"threads": a.threads, "context": a.context, "steps": a.steps}
    kern = OwnedLlama(t.model, use_kernels=True)
    eager = OwnedLlama(t.model, use_kernels=False)
    for name, m in (("kernels", kern), ("eager", eager)):
        m.reset(a.context + a.steps + 8)
        paths[name] = m
    static = OwnedLlama(t.model, use_kernels=False)
    GraphedOwned(static).reset(a.context + a.steps + 8)
    step = _Graph(static, 1, (), "all")  # the static step (no capture on a CPU)
    t0 = time.perf_counter()
    compiled = torch.compile(step._step, dynamic=False)
    with torch.no_grad():
        compiled()
    record["inductor_compile_s"] = time.perf_counter() - t0
    print(f"inductor compile {record['inductor_compile_s']:.1f} s", flush=True)

    def prefill(m):
        m.reset(a.context + a.steps + 8)
        m.forward(prompt, torch.arange(a.context), None, logit_rows="none")
        m.length = a.context

    def run_owned(m):
        prefill(m)
        tok = torch.tensor([7])
        s = time.perf_counter()
        for i in range(a.steps):
            m.forward(tok, torch.tensor([a.context + i]), None)
            m.length += 1
        return (time.perf_counter() - s) / a.steps

    def run_inductor():
        prefill(static)
        s = time.perf_counter()
        for i in range(a.steps):
            n0 = static.length
            step.tokens.fill_(7)
            step.positions.fill_(n0)
            step.cols.fill_(n0)
            step.mask.zero_()
            step.mask[0, :n0 + 1] = True
            with torch.no_grad():
                compiled()
            static.length += 1
        return (time.perf_counter() - s) / a.steps

    times = {"kernels": [], "eager": [], "inductor": []}
    for _ in range(a.rounds):
        times["kernels"].append(run_owned(kern))
        times["eager"].append(run_owned(eager))
        times["inductor"].append(run_inductor())
    record["step_ms"] = {k: min(v) * 1e3 for k, v in times.items()}
    record["vs_kernels"] = {k: record["step_ms"]["kernels"] / v for k, v in record["step_ms"].items()}
    print(json.dumps(record, indent=1), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

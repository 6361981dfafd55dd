#!/usr/bin/env python
"""Does feature extraction pay on the owned forward? Prefill of T tokens that keeps the EAGLE-3 layers' hidden states
(prepare / training / the dev set's features), HF's forward (`train/features.extract_features`, what they run) against
the owned forward (`runner.forward(..., layers)`, what decoding's prefill runs), alternated round by round, one
process, bf16 SmolLM2-135M (a benchmark, not a test; run it on an idle machine).

    .venv/bin/python scripts/bench_prefill_paths.py --threads 2 --out docs/results/prefill-paths/prefill.json
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
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seq", default="256,1024", help="prompt lengths T (comma-separated)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from specheads.infer.engine.runner import runner_for
    from specheads.target import load_target
    from specheads.train.features import extract_features

    t = load_target("smollm2-135m", dtype="bfloat16")
    L = t.num_layers
    layers = [2, L // 2, L - 3, L]
    runner = runner_for(t)
    g = torch.Generator().manual_seed(0)
    rows = []
    for T in (int(x) for x in a.seq.split(",")):
        ids = torch.randint(0, t.vocab_size, (1, T), generator=g)
        best = {"hf": [], "owned": []}
        for _ in range(a.rounds):
            s = time.perf_counter()
            ref = extract_features(t, ids, None, layers)
            best["hf"].append(time.perf_counter() - s)
            s = time.perf_counter()
            runner.reset(T + 8)
            _, feats = runner.forward(ids[0], None, layers, "none")
            best["owned"].append(time.perf_counter() - s)
        diff = (ref[0].float() - feats.view(T, len(layers), -1).float()).abs().max().item()
        hf, owned = min(best["hf"]), min(best["owned"])
        rows.append({"tokens": T, "hf_ms": hf * 1e3, "owned_ms": owned * 1e3, "owned_vs_hf": hf / owned,
                     "hf_tokens_per_s": T / hf, "max_abs_diff_bf16": diff})
        print(rows[-1], flush=True)
    Path(a.out).write_text(json.dumps({"threads": a.threads, "rounds": a.rounds, "layers": layers,
                                       "runner": runner.name, "compiled": runner.compiled, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

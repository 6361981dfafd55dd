"""Weight streaming of the decode step's matrix products: every linear layer of a Llama-shaped target (SmolLM2-135M's
shapes by default) applied to M token rows, by each kernel candidate, one thread and all threads, as GB/s of weights
read. What infer/engine/kernels.py's choice rests on; run it on an idle machine.

    python scripts/bench_kernels.py [--rows 1,4,8,16] [--threads 1,2] [--out docs/results/engine/kernels.json]

Candidates: PyTorch F.linear in fp32 and bf16, oneDNN's packed bf16 linear (`torch.ops.mkldnn._linear_pointwise`),
our compiled bf16 kernels (`kernels.bf16_ops().linear_bf16` over row-major weights and
`linear_packed_bf16` over the packed layout the owned forward decodes with, where the CPU has AVX512-BF16), and for reference a plain
read of the same bytes (`Tensor.sum`, the memory's speed).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from specheads.infer.engine import kernels  # noqa: E402
from specheads.runinfo import environment  # noqa: E402
from specheads.utils import atomic_write_json  # noqa: E402

# (out, in) of one layer's fused q/k/v, o, fused gate/up, down; then the lm_head
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS, VOCAB = 30, 49152


def timed(pairs, f, repeats: int) -> float:
    """Fastest pass over every (x, w) pair: contention only adds time."""
    for x, w in pairs:
        f(x, w)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for x, w in pairs:
            f(x, w)
        best = min(best, time.perf_counter() - t)
    return best


def candidates(dtype: torch.dtype) -> dict:
    out = {f"F.linear {str(dtype)[6:]}": lambda x, w: F.linear(x, w)}
    if dtype == torch.bfloat16:
        out["oneDNN packed bf16"] = lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        ops = kernels.bf16_ops()
        if ops is not None:
            out["specheads bf16 kernel"] = ops.linear_bf16
            # the decode path's layout: packed once per weight (kernels.packed keeps it), timed without the packing
            out["specheads packed bf16 kernel"] = lambda x, w: ops.linear_packed_bf16(x, kernels.packed(w), w.shape[0])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,8,16", help="token rows M per product (1 = one decoded token)")
    ap.add_argument("--threads", default="1,2", help="torch threads to measure with")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    a = ap.parse_args()
    rows, threads = [int(x) for x in a.rows.split(",")], [int(x) for x in a.threads.split(",")]
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        ws = [torch.randn(s, generator=g).to(dtype) * 0.02 for s in LAYER * LAYERS + [(VOCAB, 576)]]
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        flat = torch.cat([w.reshape(-1) for w in ws])
        for th in threads:
            torch.set_num_threads(th)
            s = timed([(None, flat)], lambda x, w: w.sum(), a.repeats)
            results.append({"dtype": str(dtype)[6:], "kernel": "read (Tensor.sum)", "threads": th, "rows": 0,
                            "ms": s * 1e3, "gb_s": nbytes / s / 1e9})
            for name, f in candidates(dtype).items():
                packed = [w.to_mkldnn() for w in ws] if name.startswith("oneDNN") else ws
                for m in rows:
                    xs = {k: torch.randn(m, k, generator=g).to(dtype) for k in (576, 1536)}
                    s = timed([(xs[w.shape[1]], p) for w, p in zip(ws, packed)], f, a.repeats)
                    results.append({"dtype": str(dtype)[6:], "kernel": name, "threads": th, "rows": m,
                                    "ms": s * 1e3, "gb_s": nbytes / s / 1e9})
                    r = results[-1]
                    print(f"{r['dtype']:8s} {name:24s} threads {th} rows {m:2d}: {r['ms']:7.1f} ms "
                          f"{r['gb_s']:5.1f} GB/s", flush=True)
    if a.out:
        atomic_write_json(a.out, {"command": " ".join(sys.argv), "environment": environment(), "rows": results,
                                  "note": "ms = fastest of --repeats passes over every linear layer of a "
                                          "SmolLM2-135M-shaped target (30 layers + lm_head); gb_s = weight bytes / ms"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

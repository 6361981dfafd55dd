"""Print this machine's verification-cost profile t(n)/t(1) for a target (the numbers `--tree auto` uses).

usage: python scripts/bench_profile.py [--target smollm2-135m] [--dtype bf16 fp32] [--threads N] [--refresh]
Each dtype's profile is cached under cache_root()/profiles; --refresh re-measures.
"""
from __future__ import annotations

import argparse

import torch

from specheads.infer.scheduling.profile import load_or_profile
from specheads.target import load_target


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", nargs="+", default=["bf16", "fp32"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--refresh", action="store_true")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = {}
    for dt in a.dtype:
        t = load_target(a.target, dtype={"bf16": "bfloat16", "fp32": "float32"}.get(dt, dt))
        prof = load_or_profile(t, refresh=a.refresh)
        rows[dt] = prof
    sizes = list(next(iter(rows.values()))["verify"]["relative"])
    print(f"target {a.target}, {torch.get_num_threads()} threads, {next(iter(rows.values()))['verify']['context']} cached tokens")
    print("| nodes | " + " | ".join(f"{d} t(n)/t(1) (raw)" for d in rows) + " |")
    print("|---:|" + "---:|" * len(rows))
    for n in sizes:
        cells = [f"{r['verify']['relative'][n]:.2f} ({r['verify']['relative_raw'][n]:.2f})" for r in rows.values()]
        print(f"| {n} | " + " | ".join(cells) + " |")
    print("t(1): " + ", ".join(f"{d} {1000 * float(r['verify']['seconds']['1']):.1f} ms" for d, r in rows.items()))


if __name__ == "__main__":
    main()

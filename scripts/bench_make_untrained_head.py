"""Write an untrained (freshly initialised) head folder for a target: the `specheads bench` smoke test's head.

usage: python scripts/bench_make_untrained_head.py OUT_DIR [--kind eagle3|eagle|medusa] [--target smollm2-135m]
"""
from __future__ import annotations

import argparse

from specheads.heads.base import HeadSpec, build_head
from specheads.target import load_target


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--kind", default="eagle3", choices=["eagle3", "eagle", "medusa"])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    import torch

    torch.manual_seed(a.seed)
    target = load_target(a.target, dtype="float32")
    head = build_head(HeadSpec(kind=a.kind), target)
    head.save_pretrained(a.out)
    print(f"wrote an untrained {a.kind} head for {a.target} to {a.out}")


if __name__ == "__main__":
    main()

"""Training throughput per head kind on SmolLM2-135M on this machine: tokens/s online (target forward + head step)
and offline (head step on cached features), and the share of time in the target forward vs the head.

    .venv/bin/python scripts/bench_train.py --kinds medusa eagle eagle3 --batch-size 2 --seq-len 256 --steps 3

A benchmark, not a test: figures depend on the machine and its load. Tokens are real ShareGPT assistant text when the
packaged file is present (else random ids); offline excludes the disk read (features held in memory as bf16).
"""
from __future__ import annotations

import argparse
import time

import torch


def batch_of_ids(tokenizer, B: int, T: int) -> torch.Tensor:
    try:
        from specheads.train.data import load_conversations

        convs, _ = load_conversations("sharegpt", 64)
        text = "\n".join(m["content"] for c in convs["messages"] for m in c)
        ids = tokenizer(text, return_tensors="pt").input_ids[0]
        if len(ids) >= B * T:
            return ids[: B * T].view(B, T)
    except Exception:  # noqa: BLE001 (benchmark: fall back to random ids)
        pass
    return torch.randint(0, tokenizer.vocab_size, (B, T))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", nargs="+", default=["medusa", "eagle", "eagle3"])
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per kind (after one warm-up step)")
    ap.add_argument("--ttt-steps", type=int, default=7, help="EAGLE-3 unroll (paper default 7)")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="EAGLE-3 draft vocab")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    from specheads.heads.base import HeadSpec, build_head
    from specheads.target import load_target
    from specheads.train.features import extract_features
    from specheads.train.steps import LossSettings, train_loss

    target = load_target("smollm2-135m", dtype="bfloat16")
    B, T, L = a.batch_size, a.seq_len, target.num_layers
    ids = batch_of_ids(target.tokenizer, B, T)
    batch = {"input_ids": ids, "loss_mask": torch.ones(B, T, dtype=torch.long),
             "attention_mask": torch.ones(B, T, dtype=torch.long)}
    print(f"SmolLM2-135M bf16 target, batch {B} x {T} tokens, {torch.get_num_threads()} threads, "
          f"{a.steps} timed steps per kind")
    print(f"{'kind':8s} {'target fwd s':>12s} {'head step s':>12s} {'online tok/s':>12s} {'offline tok/s':>13s} "
          f"{'target share':>12s}")
    for kind in a.kinds:
        spec = HeadSpec(kind=kind, num_heads=3, ttt_steps=a.ttt_steps,
                        draft_vocab_size=a.draft_vocab if kind == "eagle3" else None)
        head = build_head(spec, target)
        layers = sorted(set(head.config.feature_layers) | {L})
        opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-4)
        settings = LossSettings()
        t_target, t_head = 0.0, 0.0
        for i in range(a.steps + 1):
            t0 = time.perf_counter()
            hidden = extract_features(target, ids, batch["attention_mask"], layers)  # [B,T,F,D]
            t1 = time.perf_counter()
            out = train_loss(kind, head, {**batch, "hidden": hidden}, target, layers, head.config.feature_layers,
                             settings)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            if i > 0:  # the first step warms up allocators and kernels
                t_target += t1 - t0
                t_head += t2 - t1
        n = a.steps
        tok = B * T
        print(f"{kind:8s} {t_target / n:12.2f} {t_head / n:12.2f} {tok * n / (t_target + t_head):12.0f} "
              f"{tok * n / t_head:13.0f} {t_target / (t_target + t_head):11.0%}", flush=True)


if __name__ == "__main__":
    main()

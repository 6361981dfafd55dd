"""Training throughput on SmolLM2-135M on this machine.

Per head kind (default mode): tokens/s online (target forward + head step) and offline (head step on cached
features), and the share of time in the target forward vs the head:

    .venv/bin/python scripts/bench_train.py --kinds medusa eagle eagle3 --batch-size 2 --seq-len 256 --steps 3

`--compare-targets`: the offline step with and without the target sidecar (features.py), side by side in ONE run,
alternating path by path each round, on the recipes' shapes: EAGLE-3 -regen (V' 8192, TTT 2, batch 4 x 512, bf16
autocast) and DSpark (2 layers, block 7, Markov 256, confidence head, 48 anchors, V' 8192). "full" computes the
target's logits over all 49,152 columns every step (no sidecar: online mode, older folders), "sidecar" only the
draft vocabulary's 8,192 (greedy token and logsumexp read from the batch); DSpark's default loss reads only the
draft vocabulary either way, its exact-acceptance option (train.block.full_vocab) is where the sidecar matters.
Printed per path: the median optimizer step (forward, backward, AdamW), tokens/s = tokens per step / that median,
the ratio to the full path, and for EAGLE-3 the target-logits part alone (`teacher.target_rows`, timed right after each
step); also the sidecar pass itself (what `specheads prepare` pays once per token, loss rows only).

    .venv/bin/python scripts/bench_train.py --compare-targets --rounds 8 --json bench_targets.json

A benchmark, not a test: figures depend on the machine and its load (compare ratios within one run). Tokens are
real ShareGPT text when the packaged file is present (else random ids); offline excludes the disk read (features
held in memory as bf16).
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def batch_of_ids(tokenizer, B: int, T: int) -> torch.Tensor:
    try:
        from specheads.conversations.load import load_conversations

        convs, _ = load_conversations("sharegpt", 256)
        text = "\n".join(m["content"] for c in convs["messages"] for m in c)
        ids = tokenizer(text, return_tensors="pt").input_ids[0]
        if len(ids) >= B * T:
            return ids[: B * T].view(B, T)
    except Exception:  # noqa: BLE001 (benchmark: fall back to random ids)
        pass
    return torch.randint(0, tokenizer.vocab_size, (B, T))


def per_kind(a, target) -> None:
    """The default mode: online / offline tokens/s per head kind."""
    from specheads.heads.base import HeadSpec, build_head
    from specheads.train.features import extract_features
    from specheads.train.steps import LossSettings, train_loss

    B, T, L = a.batch_size, a.seq_len, target.num_layers
    ids = batch_of_ids(target.tokenizer, B, T)
    batch = {"input_ids": ids, "loss_mask": torch.ones(B, T, dtype=torch.long),
             "attention_mask": torch.ones(B, T, dtype=torch.long)}
    print(f"SmolLM2-135M bf16 target, batch {B} x {T} tokens, {torch.get_num_threads()} threads, "
          f"{a.steps} timed steps per kind")
    print(f"{'kind':8s} {'target fwd s':>12s} {'head step s':>12s} {'online tok/s':>12s} {'offline tok/s':>13s} "
          f"{'target share':>12s}")
    for kind in a.kinds:
        own = {"medusa": {"num_heads": 3}, "eagle3": {"ttt_steps": a.ttt_steps}}.get(kind, {})  # head.<kind>
        spec = HeadSpec(kind=kind, draft_vocab_size=a.draft_vocab if kind == "eagle3" else None, **own)
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


# ----------------------------------------------------------------------------------------- --compare-targets
SHAPES = {  # the recipes' head and train.block settings (configs/eagle3-smollm2-regen6k.yaml, configs/dspark-smollm2.yaml)
    "eagle3": ({"kind": "eagle3", "ttt_steps": 2, "draft_vocab_size": 8192}, {}),
    "dspark": ({"kind": "dspark", "num_layers": 2, "block_size": 7, "markov_rank": 256, "draft_vocab_size": 8192},
               {"max_anchors": 48}),
}


def shape_batch(target, a, layers):
    """One offline batch [B,T] of real text: features in bf16 (as stored), the first `prompt_fraction` of each
    sequence outside the loss (the regen data: 505k answer tokens of 739k), and its sidecar fields."""
    from specheads.train.features import extract_features
    from specheads.train.teacher import greedy_and_lse, lm_head_logits, need_rows

    B, T = a.batch_size, a.seq_len
    ids = batch_of_ids(target.tokenizer, B, T)
    lm = torch.ones(B, T, dtype=torch.long)
    lm[:, : int(T * a.prompt_fraction)] = 0
    batch = {"input_ids": ids, "loss_mask": lm, "attention_mask": torch.ones(B, T, dtype=torch.long)}
    batch["hidden"] = extract_features(target, ids, None, layers).to(torch.bfloat16)
    need = need_rows(lm)
    t0 = time.perf_counter()
    g, z = greedy_and_lse(lm_head_logits(target, batch["hidden"][:, :, -1][need]))
    sidecar_s = time.perf_counter() - t0
    greedy, lse = torch.full((B, T), -1, dtype=torch.long), torch.zeros(B, T)
    greedy[need], lse[need] = g, z
    return batch, {"target_greedy": greedy, "target_lse": lse}, sidecar_s, int(need.sum())


def timed_step(kind, model, opt, acc, batch, target, layers, settings) -> tuple[float, float | None]:
    """(seconds of one optimizer step, seconds of its target-logits part measured alone, EAGLE-3 only)."""
    from specheads.train.kinds.base import split_features
    from specheads.train.steps import train_loss
    from specheads.train.teacher import target_rows

    inner = acc.unwrap_model(model)
    t0 = time.perf_counter()
    out = train_loss(kind, model, batch, target, layers, inner.config.feature_layers, settings)
    acc.backward(out.loss)
    opt.step()
    opt.zero_grad(set_to_none=True)
    step_s = time.perf_counter() - t0
    if kind != "eagle3":
        return step_s, None
    h_last = split_features(batch["hidden"], layers, inner.config.feature_layers, target.num_layers)[1]
    t0 = time.perf_counter()
    target_rows(target, h_last, batch["loss_mask"], inner.d2t, batch, need_greedy=True)
    return step_s, time.perf_counter() - t0


def _median(x: list[float]) -> float:
    return sorted(x)[len(x) // 2]


def compare_shape(shape: str, target, a) -> dict:
    """Alternate the paths of one shape round by round (order reversed every other round); tokens/s per path."""
    from accelerate import Accelerator

    from specheads.heads.base import HeadSpec, build_head
    from specheads.train.settings import BlockTrainConfig
    from specheads.train.steps import LossSettings

    spec_kw, block_kw = SHAPES[shape]
    kind = spec_kw["kind"]
    counts = torch.ones(target.vocab_size, dtype=torch.long)
    counts[:spec_kw["draft_vocab_size"]] += 1  # any V' ids: timing only
    head = build_head(HeadSpec(**spec_kw), target, token_counts=counts)
    layers = sorted(set(head.config.feature_layers) | {target.num_layers})
    batch, side, sidecar_s, rows = shape_batch(target, a, layers)
    acc = Accelerator(mixed_precision="bf16" if a.autocast else "no", cpu=True)
    model, opt = acc.prepare(head, torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-4))
    plain, exact = (LossSettings(block=BlockTrainConfig(**block_kw, full_vocab=f)) for f in (False, True))
    paths = {"full": (batch, plain), "sidecar": ({**batch, **side}, plain)}
    if kind == "dspark":  # the default reads only V' either way; the exact acceptance is where the sidecar counts
        paths = {"default": (batch, plain), "exact-full": (batch, exact), "exact-sidecar": ({**batch, **side}, exact)}
    secs: dict[str, list] = {p: [] for p in paths}
    for p, (b, st) in paths.items():  # one warm-up step per path
        timed_step(kind, model, opt, acc, b, target, layers, st)
    for r in range(a.rounds):
        for p in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
            b, st = paths[p]
            secs[p] += [timed_step(kind, model, opt, acc, b, target, layers, st) for _ in range(a.steps)]
    tok = a.batch_size * a.seq_len
    out = {"shape": shape, "tokens_per_step": tok, "loss_rows_per_step": rows, "steps_per_path": a.rounds * a.steps,
           "sidecar_pass_tokens_per_s": round(rows / sidecar_s, 1), "paths": {}}
    for p, x in secs.items():
        step, part = [s for s, _ in x], [t for _, t in x if t is not None]
        out["paths"][p] = {"step_s_median": round(_median(step), 4), "step_s_mean": round(sum(step) / len(step), 4),
                           "tokens_per_s": round(tok / _median(step), 1),
                           "target_logits_s_median": round(_median(part), 4) if part else None}
    base = out["paths"]["full" if kind != "dspark" else "exact-full"]["tokens_per_s"]
    for p in out["paths"].values():
        p["vs_full"] = round(p["tokens_per_s"] / base, 3)
    return out


def compare_targets(a, target) -> None:
    from specheads.runinfo import environment

    print(f"SmolLM2-135M bf16 target, batch {a.batch_size} x {a.seq_len} tokens ({1 - a.prompt_fraction:.0%} in the "
          f"loss), {torch.get_num_threads()} threads, {a.rounds} rounds x {a.steps} steps per path, alternating; "
          f"bf16 autocast {'on' if a.autocast else 'off'}")
    results = []
    print(f"{'shape':8s} {'path':14s} {'step s (median)':>15s} {'tokens/s':>9s} {'vs full':>8s} "
          f"{'target logits s':>15s}")
    for shape in a.shapes:
        res = compare_shape(shape, target, a)
        results.append(res)
        for p, v in res["paths"].items():
            part = "-" if v["target_logits_s_median"] is None else f"{v['target_logits_s_median']:.3f}"
            print(f"{shape:8s} {p:14s} {v['step_s_median']:15.3f} {v['tokens_per_s']:9.0f} {v['vs_full']:7.2f}x "
                  f"{part:>15s}", flush=True)
        print(f"{shape:8s} sidecar pass (prepare, once per token): {res['sidecar_pass_tokens_per_s']:.0f} tokens/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"settings": vars(a), "environment": environment(), "results": results}, f, indent=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", nargs="+", default=["medusa", "eagle", "eagle3"])
    ap.add_argument("--batch-size", type=int, default=None, help="default 2 (per kind) / 4 (--compare-targets)")
    ap.add_argument("--seq-len", type=int, default=None, help="default 256 (per kind) / 512 (--compare-targets)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per kind (3) / per path and round (1)")
    ap.add_argument("--ttt-steps", type=int, default=7, help="EAGLE-3 unroll (paper default 7)")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="EAGLE-3 draft vocab")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--compare-targets", action="store_true", help="the offline step with / without the sidecar")
    ap.add_argument("--shapes", nargs="+", default=["eagle3", "dspark"], choices=sorted(SHAPES))
    ap.add_argument("--rounds", type=int, default=8, help="--compare-targets: alternation rounds")
    ap.add_argument("--prompt-fraction", type=float, default=0.32, help="share of each sequence outside the loss")
    ap.add_argument("--no-autocast", dest="autocast", action="store_false", help="fp32 head (recipes: bf16)")
    ap.add_argument("--json", default=None, help="--compare-targets: write the figures to this file")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    cmp = a.compare_targets
    a.batch_size = a.batch_size or (4 if cmp else 2)
    a.seq_len = a.seq_len or (512 if cmp else 256)
    a.steps = a.steps or (1 if cmp else 3)

    from specheads.target import load_target

    target = load_target("smollm2-135m", dtype="bfloat16")
    (compare_targets if cmp else per_kind)(a, target)


if __name__ == "__main__":
    main()

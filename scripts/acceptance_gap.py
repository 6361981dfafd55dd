"""What separates a head's training-time acceptance from served acceptance, measured (docs/training.md "What
remains of the gap"): the same head, teacher-forced, on the run's held-out split, on its serving-true dev set and on
the target's greedy answers to benchmark prompts, each split by kind of request, by answer position and by whether
a position lies inside a repeated n-gram of its answer (a 135M target's greedy answers fall into loops).

    python scripts/acceptance_gap.py --run runs/eagle3-regen1k --head runs/eagle3-regen1k/best \
        --bench mt-bench --limit 80 --max-new-tokens 256 --out docs/results/serving-eval/gap-eagle3-regen1k.json

A position t of an answer is "in a repeat" when the n-gram ending at t (n = --ngram, default 4) occurred earlier in
the same answer. τ figures are per position (1 + consecutive accepted drafts) and the serving walk (train/walk.py).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

import torch


def repeat_mask(ids: list[int], start: int, n: int) -> list[bool]:
    """Per position: the n-gram ending there occurred earlier in ids[start:] (the answer)."""
    seen, out = set(), []
    for t in range(len(ids)):
        g = tuple(ids[t - n + 1:t + 1]) if t - n + 1 >= start else None
        out.append(g is not None and g in seen)
        if g is not None:
            seen.add(g)
    return out


def score_batches(head, batches, target, layers, labels, ngram: int) -> dict:
    """Per-position and walk τ (chain), overall and per label / repeat / answer-position bucket."""
    from specheads.train.losses import accepted_lengths, step_correct
    from specheads.train.steps import draft_step_logits
    from specheads.train.walk import walk_batch

    sums = defaultdict(lambda: [0.0, 0.0])  # name -> [Σ accepted, rows] (walk: [tokens, forwards])
    kind = head.config.kind
    with torch.no_grad():
        for b, label in zip(batches, labels):
            steps, d2t, targ = draft_step_logits(kind, head, b, target, layers, list(head.config.feature_layers))
            valid, top1, _ = step_correct(steps, targ, b["loss_mask"], d2t, topk=1)
            start = valid[0]
            acc = accepted_lengths(top1)
            tok, fwd = walk_batch(acc, start)
            for name in ("all", f"kind:{label}"):
                sums[f"walk/{name}"][0] += float(tok.sum())
                sums[f"walk/{name}"][1] += float(fwd.sum())
            for row in range(acc.shape[0]):
                ids = b["input_ids"][row].tolist()
                lm = b["loss_mask"][row].tolist()
                first = lm.index(1) if 1 in lm else len(lm)
                rep = repeat_mask(ids, first, ngram)
                for t in range(acc.shape[1]):
                    if not bool(start[row, t]):
                        continue
                    a = float(acc[row, t])
                    pos = t + 2 - first  # the drafted token's position in its answer
                    bucket = "0-63" if pos < 64 else "64-127" if pos < 128 else "128-255" if pos < 256 else "256+"
                    for name in ("all", f"kind:{label}", f"repeat:{rep[t + 2]}", f"position:{bucket}"):
                        sums[f"row/{name}"][0] += a
                        sums[f"row/{name}"][1] += 1
    out = {}
    for k, (s, n) in sorted(sums.items()):
        out[k] = {"tau": round(s / max(n, 1), 4), "n": int(n)}
    rows = out.get("row/all", {"n": 0})["n"]
    out["repeat_share"] = round(out.get("row/repeat:True", {"n": 0})["n"] / max(rows, 1), 4)
    return out


def main(argv=None) -> int:
    from specheads.heads.base import load_head
    from specheads.train.head_eval import answer_batch, target_answers
    from specheads.train.heldout import heldout_recipe
    from specheads.prompts import load_prompts
    from specheads.target import load_target
    from specheads.train.devset import dev_answers
    from specheads.train.dataset import collate
    from specheads.train.trainer import load_training_data
    from specheads.utils import atomic_write_json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True)
    p.add_argument("--head", required=True)
    p.add_argument("--bench", default="mt-bench", help="benchmark prompts answered by the target (or 'none')")
    p.add_argument("--limit", type=int, default=80)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--ngram", type=int, default=4)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    recipe = heldout_recipe(a.run)
    target = load_target(recipe.target.name, dtype=recipe.target.dtype)
    head = load_head(a.head, target).eval()
    _, val_ds, _, layers, _ = load_training_data(recipe, target)
    report = {"run": a.run, "head": a.head, "ngram": a.ngram}
    held = [collate([val_ds[i]]) for i in range(len(val_ds))]
    report["held_out"] = score_batches(head, held, target, layers, ["sharegpt"] * len(held), a.ngram)
    if recipe.eval.dev_prompts:
        rows = dev_answers(recipe, target)
        dev = [answer_batch(target, r["prompt_ids"], r["answer_ids"], layers) for r in rows]
        report["dev"] = score_batches(head, dev, target, layers, [r["category"] for r in rows], a.ngram)
    if a.bench != "none":
        prompts = load_prompts(a.bench, a.limit)
        pairs = target_answers(target, prompts, a.max_new_tokens)
        bench = [answer_batch(target, pi, ai, layers) for pi, ai in pairs]
        report[a.bench] = score_batches(head, bench, target, layers, [q.category for q in prompts], a.ngram)
    print(json.dumps(report, indent=1))
    if a.out:
        atomic_write_json(a.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Teacher-forced accuracy of a trained head on the target's own answers to benchmark prompts.

    .venv/bin/python scripts/eval_head_on_prompts.py --head runs/eagle3-smollm2/best [--dataset mt-bench]
        [--limit 8] [--max-new-tokens 64] [--dtype bf16]

--dataset: mt-bench, humaneval, a JSONL file (as `specheads bench`), or sharegpt:START = first user turns of the
packaged ShareGPT conversations from index START on (the recipes train on the first `data.max_conversations`, so a
START past that gives unseen prompts of the training distribution).

The target answers each prompt greedily (HF generate); the head is then scored exactly as `specheads train`
scores it on its held-out split (specheads.train.evaluate: per-step top-1/top-5, simulated τ chain and tree).
Comparing the two numbers separates a data shift (held-out ShareGPT vs the benchmark's prompts) from an
inference problem (teacher-forced accuracy here far above the acceptance `specheads bench` measures).
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json

import torch


def sharegpt_prompts(start: int, limit: int):
    """First user turns (20-1500 characters) of ShareGPT conversations start, start+1, ... as chat prompts."""
    from specheads.infer.prompts import BenchPrompt
    from specheads.train.data import load_conversations

    convs, _ = load_conversations("sharegpt", start + 20 * limit)
    out = []
    for i in range(start, len(convs)):
        users = [m["content"] for m in convs[i]["messages"] if m["role"] == "user"]
        if users and 20 < len(users[0]) < 1500:
            out.append(BenchPrompt(id=str(i), category="sharegpt", turns=[users[0]], chat=True))
        if len(out) == limit:
            break
    return out


def main() -> int:
    from specheads.heads.base import load_head
    from specheads.infer.prompts import encode_turn, load_prompts
    from specheads.target import load_target
    from specheads.train.evaluate import EvalConfig, evaluate
    from specheads.train.features import extract_features, resolve_layers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", required=True)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dataset", default="mt-bench", help="mt-bench | humaneval | FILE.jsonl | sharegpt:START")
    ap.add_argument("--limit", type=int, default=8, help="prompts (MT-bench: categories interleaved)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--tree-width", type=int, default=2)
    ap.add_argument("--tree-depth", type=int, default=4)
    a = ap.parse_args()
    target = load_target(a.target, dtype={"bf16": "bfloat16", "fp32": "float32"}[a.dtype])
    head = load_head(a.head, target)
    head.eval()
    kind = head.config.kind
    layers = resolve_layers(target.num_layers, head.config.feature_layers, kind)
    batches = []
    if a.dataset.startswith("sharegpt:"):
        start = a.dataset.split(":", 1)[1]
        if not start.isdigit():
            ap.error(f"--dataset {a.dataset}: expected sharegpt:START with START a conversation index, e.g. sharegpt:2000")
        prompts = sharegpt_prompts(int(start), a.limit)
    else:
        prompts = load_prompts(a.dataset, a.limit, False)
    for p in prompts:
        ids = encode_turn(target.tokenizer, p, 0, [])
        with torch.no_grad():
            out = target.model.generate(torch.tensor([ids]), max_new_tokens=a.max_new_tokens, do_sample=False)[0]
        n = out.shape[0]
        lm = torch.zeros(1, n, dtype=torch.long)
        lm[0, len(ids):] = 1  # the answer's tokens, as the assistant mask in training
        b = {"input_ids": out[None], "loss_mask": lm, "attention_mask": torch.ones(1, n, dtype=torch.long)}
        b["hidden"] = extract_features(target, b["input_ids"], b["attention_mask"], layers)
        batches.append(b)
    cfg = EvalConfig(tree_width=a.tree_width, tree_depth=a.tree_depth)
    m = evaluate(kind, head, batches, target, layers, list(head.config.feature_layers), cfg)
    print(json.dumps({"head": a.head, "dataset": a.dataset, "prompts": len(batches),
                      "max_new_tokens": a.max_new_tokens, **{k: round(v, 4) for k, v in m.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

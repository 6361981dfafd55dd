"""Where does a speculative step spend its time? Per-phase breakdown of our decode loop on SmolLM2 (bf16, CPU).

usage: python scripts/bench_decode.py [--prompts 3] [--max-new-tokens 64] [--threads 1] [--repeats 1]
                                      [--methods hf,plain,prompt-lookup,medusa,eagle3] [--eagle-tree 4,4,12]
                                      [--temperature 0 --top-p 1]

Methods, alternated prompt by prompt in ONE process (machine drift cancels out; figures are ratios of this run):
  hf            HF model.generate(do_sample=False)            (the baseline: tokens/s ratio 1.00)
  plain         our loop with NoDrafter                         (τ = 1.00: the loop's own overhead vs HF)
  prompt-lookup our loop with PromptLookupDrafter
  draft-model   the target's first 4 layers drafting a chain of 3 (method: opt-in, --methods ...,draft-model)
  medusa        untrained Medusa head (4 heads, full vocab)    (τ near 1: untrained)
  eagle3        untrained EAGLE-3 head, draft vocab 4096       (τ near 1: untrained)
Per method: ms per step for each phase of GenerationStats.timings (draft, tree, target, verify, cache, other),
the non-model share of a step = (tree + verify + cache + other) / step, τ, tokens/s and its ratio to hf.
agree = mean share of each output before its first difference from hf's (1.00 in fp32; bf16 may differ where
the rounding of a different kernel shape flips a near-tie: --dtype float32 checks exactness).
"""
from __future__ import annotations

import argparse
import time

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from specheads.heads.base import HeadSpec, build_head
from specheads.infer.drafters import (DraftModelDrafter, EagleDrafter, MedusaDrafter, NoDrafter, PromptLookupDrafter,
                                      truncated_draft_model)
from specheads.infer.generate import PHASES, generate
from specheads.prompts import encode_turn, load_prompts
from specheads.target import load_target

NON_MODEL = ("tree", "verify", "cache", "other")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1, help="passes over the prompts")
    ap.add_argument("--methods", default="hf,plain,prompt-lookup,medusa,eagle3")
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: lossless sampling (agree is then n/a)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--eagle-tree", default="4,4,12", help="depth,top_k,total_tokens for eagle3")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)

    target = load_target(a.target, dtype=a.dtype)
    dt = target.dtype
    methods = a.methods.split(",")
    drafters = {}
    if "plain" in methods:
        drafters["plain"] = NoDrafter()
    if "prompt-lookup" in methods:
        drafters["prompt-lookup"] = PromptLookupDrafter(num_tokens=8)
    if "draft-model" in methods:
        drafters["draft-model"] = DraftModelDrafter(truncated_draft_model(target, 4), num_tokens=3)
    if "medusa" in methods:
        med = build_head(HeadSpec(kind="medusa", num_heads=4, num_layers=1), target, dtype=dt).eval()
        drafters["medusa"] = MedusaDrafter(med)
    if "eagle3" in methods:
        e3 = build_head(HeadSpec(kind="eagle3", draft_vocab_size=4096), target, dtype=dt).eval()
        d, k, n = (int(x) for x in a.eagle_tree.split(","))
        drafters["eagle3"] = EagleDrafter(e3, depth=d, top_k=k, total_tokens=n)

    prompts = load_prompts("mt-bench", limit=a.prompts)
    encoded = [encode_turn(target.tokenizer, p, 0, []) for p in prompts]

    sampling = dict(temperature=a.temperature, top_p=a.top_p)
    hf_sampling = (dict(do_sample=True, temperature=a.temperature, top_p=a.top_p, top_k=0) if a.temperature > 0
                   else dict(do_sample=False))

    class Stamp(LogitsProcessor):  # called once per generated token: the first call ends the prefill
        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    def run_hf(ids):
        """HF greedy; returns (new ids, decode seconds of tokens 2..n, tokens timed = n - 1): prefill excluded as
        in our stats (HF's prefill also runs lm_head on hidden[:, -1:], the slow strided bf16 path)."""
        x = torch.tensor([ids], device=target.device)
        stamp = Stamp()
        stamp.times = []
        out = target.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=a.max_new_tokens,
                                    min_new_tokens=a.max_new_tokens, pad_token_id=0, **hf_sampling,
                                    logits_processor=LogitsProcessorList([stamp]))
        t_end = time.perf_counter()
        return out[0, len(ids):].tolist(), t_end - stamp.times[0], len(stamp.times) - 1

    # warm-up (one short run each)
    run_hf(encoded[0][:32])
    for dr in drafters.values():
        generate(target, dr, encoded[0][:32], max_new_tokens=8, ignore_eos=True)

    agg = {m: {"tokens": 0, "steps": 0, "gen_s": 0.0, "nodes": 0, "same": 0, "runs": 0,
               "t": {p: 0.0 for p in PHASES}} for m in methods}
    for _ in range(a.repeats):
        for ids in encoded:
            ref = None
            for m in methods:
                if m == "hf":
                    out, s, timed = run_hf(ids)
                    ref = out
                    r = agg[m]
                    r["tokens"] += timed
                    r["steps"] += timed
                    r["gen_s"] += s
                    r["runs"] += 1
                    continue
                res = generate(target, drafters[m], ids, max_new_tokens=a.max_new_tokens, ignore_eos=True, seed=0,
                               **sampling)
                st = res.stats
                r = agg[m]
                r["tokens"] += st.new_tokens
                r["steps"] += st.target_forwards
                r["gen_s"] += st.wall_s - st.prefill_s
                r["nodes"] += st.tree_nodes
                r["runs"] += 1
                if ref is not None and a.temperature == 0:  # tokens before the first difference from hf
                    r["same"] += next((i for i, (x, y) in enumerate(zip(res.ids, ref)) if x != y), len(ref)) / len(ref)
                for p in PHASES:
                    r["t"][p] += st.timings[p]

    hf_tps = agg["hf"]["tokens"] / agg["hf"]["gen_s"] if "hf" in agg else None
    print(f"target {a.target} {a.dtype}, {a.threads} thread(s), {len(encoded)} MT-bench prompts x {a.repeats}, "
          f"{a.max_new_tokens} new tokens, eagle tree {a.eagle_tree}, temperature {a.temperature} top-p {a.top_p}")
    head = f"{'method':>14} {'tok/s':>6} {'xHF':>5} {'tau':>5} {'nodes':>5} " + " ".join(f"{p:>7}" for p in PHASES)
    head += f" {'step':>7} {'nonmod':>6} {'agree':>5}"
    print(head + "   (phase columns: ms per step)")
    for m in methods:
        r = agg[m]
        tps = r["tokens"] / r["gen_s"]
        ratio = f"{tps / hf_tps:5.2f}" if hf_tps else "  -  "
        if m == "hf":
            print(f"{m:>14} {tps:6.1f} {ratio} {1.0:5.2f} {1:5d}   (ms/token {1000 * r['gen_s'] / r['tokens']:.1f})")
            continue
        steps = max(r["steps"], 1)
        per = {p: 1000 * r["t"][p] / steps for p in PHASES}
        step = sum(per.values())
        nonmod = sum(per[p] for p in NON_MODEL) / step
        cells = " ".join(f"{per[p]:7.2f}" for p in PHASES)
        print(f"{m:>14} {tps:6.1f} {ratio} {r['tokens'] / steps:5.2f} {r['nodes'] / steps:5.1f} {cells} "
              f" {step:7.2f} {100 * nonmod:5.1f}% {r['same'] / r['runs']:5.2f}")


if __name__ == "__main__":
    main()

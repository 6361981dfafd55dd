"""Reliability sweep, round four (issue 49): limits met mid-run: context window, trees and batches over the engine's buckets, cache length.

`cases(h)` returns rows in scripts/reliability_sweep.py's case format (area, name, argv, rc, expect, risk from
reliability_doc.RISKS, optional setup / check / run / during); `h` is the sweep's HELPERS namespace.
The cases run on a copy of the fixture target whose config.json says max_position_embeddings 64 ({tmp}/t64: its
chat template's system prompt alone is ~30 tokens, so every answer meets the window within a few dozen tokens).
"""
from __future__ import annotations

import json
import shutil

from reliability_cli import run_in_process  # scripts/ is on sys.path (the sweep puts it there)

WINDOW = 64  # positions of the small-window copy of the fixture target


def small_window(ctx, head: bool = False, prompts: list | None = None) -> None:
    """{tmp}/t64: the fixture target with a 64-position window; the trained head at {head}; prompts in {tmp}/p.jsonl
    (one JSON object a line)."""
    t = ctx.tmp / "t64"
    shutil.copytree(ctx.base / "target", t)
    cfg = json.loads((t / "config.json").read_text())
    cfg["max_position_embeddings"] = WINDOW
    (t / "config.json").write_text(json.dumps(cfg))
    if head:
        shutil.copytree(ctx.base / "trained" / "final", ctx.path("head"))
    if prompts is not None:
        (ctx.tmp / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))


SHORT = [{"prompt": f"Question {i}: why? why?"} for i in range(3)]


def setup(head: bool = False, prompts: list | None = None):
    return lambda ctx: small_window(ctx, head, prompts)


def tree_equals_plain(ctx, argv: list[str]):
    """generate --json with the EAGLE-3 tree, then with the plain drafter: the same ids, both stopped at the window."""
    rc, out, err = run_in_process(argv)
    plain = [a for a in argv if a not in ("--tree", "5,8,48")]
    i = plain.index("--head")
    plain[i:i + 2] = ["--drafter", "plain"]
    rc2, out2, err2 = run_in_process(plain)
    if rc or rc2:
        return rc or rc2, out + out2, err + err2
    a, b = json.loads(out.splitlines()[-1]), json.loads(out2.splitlines()[-1])
    if a["ids"] != b["ids"] or {a["stats"]["stop_reason"], b["stats"]["stop_reason"]} != {"context_window"}:
        return 1, out, err + f"\ntree {a['ids']} {a['stats']['stop_reason']} != plain {b['ids']}\n"
    return 0, out, err + f"the tree's {len(a['ids'])} tokens equal plain decoding's, both stopped at the window\n"


def identical(ctx) -> str:
    """Every method's greedy output equals vanilla's (HF generate cut at the window as ours stop)."""
    res = json.loads((ctx.tmp / "b" / "results.json").read_text())
    if "batch_sizes" not in res:  # the single run
        shares = {m: v["overall"]["identical"] for m, v in res["methods"].items()}
    else:  # the batched sweep: the methods' figures per batch size
        shares = {f"{m}@{b}": v["identical"] for b, ms in res["batch_sizes"].items() for m, v in ms.items()}
    assert shares and all(v == 1.0 for v in shares.values()), f"identical to vanilla: {shares}"
    return "every method identical to vanilla"


def cases(h) -> list[dict]:
    gen = ["generate", "--target", "{tmp}/t64", "--prompt", "hi", "--json"]
    bench = ["bench", "--target", "{tmp}/t64", "--dataset", "{tmp}/p.jsonl", "--methods", "vanilla,plain,prompt-lookup",
             "--warmup-tokens", "0", "--dtype", "fp32", "--out", "{tmp}/b"]
    return [
        {"area": "limits", "risk": "traceback", "name": "generate --max-new-tokens 1000000000",
         "setup": setup(), "argv": gen + ["--drafter", "prompt-lookup", "--max-new-tokens", "1000000000"], "rc": 0,
         "expect": f"stopped at the context window of {WINDOW} positions"},
        {"area": "limits", "risk": "unclear", "name": "generate prompt longer than the context window",
         "setup": setup(), "argv": ["generate", "--target", "{tmp}/t64", "--prompt", "why " * 80, "--max-new-tokens",
                                    "4"], "rc": 2, "expect": f"tokens do not fit the context window of {WINDOW}"},
        {"area": "limits", "risk": "silent wrong result", "name": "generate EAGLE-3 tree 5,8,48 meeting the window",
         "setup": setup(head=True), "run": tree_equals_plain,
         "argv": gen + ["--head", "{head}", "--tree", "5,8,48", "--max-new-tokens", "100", "--dtype", "fp32"],
         "rc": 0, "expect": "equal plain decoding's, both stopped at the window"},
        {"area": "limits", "risk": "silent wrong result", "name": "bench answers meeting the context window",
         "setup": setup(prompts=SHORT), "argv": bench + ["--max-new-tokens", "200"], "rc": 0,
         "expect": f"turns stopped at the context window of {WINDOW}", "check": identical},
        {"area": "limits", "risk": "silent wrong result", "name": "bench --batch-sizes rows meeting the context window",
         "setup": setup(prompts=SHORT), "argv": bench + ["--max-new-tokens", "200", "--batch-sizes", "1,3"], "rc": 0,
         "expect": f"rows stopped at the context window of {WINDOW}", "check": identical},
        {"area": "limits", "risk": "unclear", "name": "bench --batch-sizes prompt longer than the context window",
         "setup": setup(prompts=SHORT[:1] + [{"prompt": "why " * 80}]),
         "argv": bench + ["--max-new-tokens", "4", "--batch-sizes", "1,2"], "rc": 2,
         "expect": f"p.jsonl: prompt 2: 81 tokens do not fit the context window of {WINDOW}"},
        {"area": "limits", "risk": "unclear", "name": "bench --both-turns second turn past the context window",
         "setup": setup(prompts=[{"turns": ["Question 1: why?", "And then?"]}]),
         "argv": bench + ["--max-new-tokens", "40", "--both-turns"], "rc": 2,
         "expect": "turn 2: up to 90 tokens after 1 answer(s) of up to 40 tokens, over the context window of 64"},
        {"area": "limits", "risk": "traceback", "name": "eval --max-new-tokens 1000000000 on a 64-position window",
         "setup": setup(head=True, prompts=SHORT),
         "argv": ["eval", "--head", "{head}", "--target", "{tmp}/t64", "--dataset", "{tmp}/p.jsonl", "--dtype", "fp32",
                  "--max-new-tokens", "1000000000"], "rc": 0, "expect": "answer tokens"},
    ]

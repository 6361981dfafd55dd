"""`specheads generate`: speculative generation with a head (or a training-free drafter), streamed to stdout."""
from __future__ import annotations

import json
import sys

from specheads.utils import SpecheadsError


def add_arguments(p) -> None:
    p.add_argument("--target", default="smollm2-135m", help="target alias, HF folder, hub id or .gguf")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--head", help="head folder (medusa, eagle, eagle3; native layout)")
    src.add_argument("--drafter", choices=["plain", "prompt-lookup", "draft-model"], default=None,
                     help="training-free drafter (default prompt-lookup when no --head)")
    q = p.add_mutually_exclusive_group(required=True)
    q.add_argument("--prompt", help="prompt text (sent through the chat template unless --raw)")
    q.add_argument("--chat", action="store_true", help="interactive chat through the target's template")
    p.add_argument("--raw", action="store_true", help="send --prompt as plain text, without the chat template")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (exact); > 0 = lossless sampling")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--tree", default=None,
                   help="Medusa: 'chain:K' or JSON rank paths; EAGLE: 'depth,top_k,total_tokens' (default 5,8,48); "
                        "draft-model / prompt-lookup: tokens per step; 'auto' (with --head): the size and depth "
                        "that pay on this machine (cached cost profile + a short acceptance probe, as bench does)")
    p.add_argument("--lookup", type=int, default=0, metavar="N",
                   help="with --head, greedy: also merge a prompt-lookup chain of up to N tokens into the tree")
    p.add_argument("--draft-layers", type=int, default=4, help="draft-model: target layers kept in the draft copy")
    p.add_argument("--draft-target", default=None, help="draft-model: a separate small model with the same vocabulary")
    p.add_argument("--typical-acceptance", action="store_true",
                   help="Medusa typical acceptance: LOSSY (output no longer follows the target's distribution)")
    p.add_argument("--dtype", default="float32", help="target dtype (float32 | bfloat16 | float16)")
    p.add_argument("--device", default=None)
    p.add_argument("--json", action="store_true", help="print the result and figures as one JSON object")


def drafter_kwargs(args) -> dict:
    kw: dict = {"draft_layers": args.draft_layers, "draft_target": args.draft_target}
    if not args.tree or args.tree == "auto":  # auto: chosen after loading (auto_tree)
        return kw
    if args.head:
        from specheads.heads.base import read_head_config
        from pathlib import Path

        kind = read_head_config(Path(args.head)).kind
        if kind == "medusa":
            from specheads.infer.tree import parse_choices

            kw["choices"] = parse_choices(args.tree)
        else:
            try:
                d, k, n = (int(x) for x in args.tree.split(","))
            except ValueError:
                raise SpecheadsError(f"--tree {args.tree!r}: EAGLE trees take 'depth,top_k,total_tokens'") from None
            kw.update(depth=d, top_k=k, total_tokens=n)
    else:
        try:
            kw["num_tokens"] = int(args.tree)
        except ValueError:
            raise SpecheadsError(f"--tree {args.tree!r}: {args.drafter} takes a number of tokens per step") from None
    return kw


def auto_tree(target, drafter):
    """`--tree auto`: the bench's choice (specheads.infer.bench.choose_tree_for_head: the cached verify-cost profile
    of this machine + the head's acceptance on a short probe of a few MT-bench questions) -> a new drafter."""
    from specheads.infer.bench import calibration_ids, choose_tree_for_head
    from specheads.infer.drafters import EagleDrafter, MedusaDrafter
    from specheads.infer.prompts import load_prompts

    head = drafter.head
    kind = "medusa" if head.config.kind == "medusa" else "eagle"
    calib = calibration_ids(target.tokenizer, load_prompts("mt-bench"))
    choice, tree = choose_tree_for_head(target, head, kind, calib)
    print(f"--tree auto: {tree['summary']} ({choice.reason})", file=sys.stderr)
    if kind == "medusa":
        return MedusaDrafter(head, choices=choice.choices)
    return EagleDrafter(head, depth=choice.depth, top_k=choice.top_k, total_tokens=choice.total_tokens)


def run(args) -> int:
    from specheads.infer.drafters import load_drafter
    from specheads.infer.generate import generate
    from specheads.target import load_target

    if args.max_new_tokens < 1:
        raise SpecheadsError(f"--max-new-tokens: must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        raise SpecheadsError("--temperature must be >= 0, --top-p in (0, 1], --top-k >= 0")
    if args.tree == "auto" and not args.head:
        raise SpecheadsError("--tree auto: needs --head DIR (training-free drafters take a number of tokens per step)")
    target = load_target(args.target, dtype=args.dtype, device=args.device)
    drafter = load_drafter(args.drafter or "prompt-lookup", target, head_dir=args.head, **drafter_kwargs(args))
    if args.tree == "auto":
        drafter = auto_tree(target, drafter)
    if args.lookup > 0:
        if not args.head:
            raise SpecheadsError("--lookup: merges prompt lookup into a head's tree; needs --head DIR")
        from specheads.infer.drafters import LookupMergedDrafter

        drafter = LookupMergedDrafter(drafter, num_tokens=args.lookup)
    verification = "typical-lossy" if args.typical_acceptance else "auto"
    streamer = None
    if not args.json:
        from transformers import TextStreamer

        streamer = TextStreamer(target.tokenizer, skip_prompt=True, skip_special_tokens=True)
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
              stop_strings=args.stop, seed=args.seed, verification=verification, streamer=streamer)
    if args.chat:
        messages: list[dict] = []
        while True:
            try:
                line = input("> ")
            except EOFError:
                return 0
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            res = generate(target, drafter, messages=messages, **kw)
            messages.append({"role": "assistant", "content": res.text})
            _report(res, args)
    if args.raw:
        res = generate(target, drafter, prompt=args.prompt, **kw)
    else:
        res = generate(target, drafter, messages=[{"role": "user", "content": args.prompt}], **kw)
    _report(res, args)
    return 0


def _report(res, args) -> None:
    s = res.stats
    if args.json:
        print(json.dumps({"text": res.text, "ids": res.ids, "stats": s.to_dict()}))
        return
    t = s.timings
    lossy = " (typical acceptance: LOSSY)" if args.typical_acceptance else ""
    print(f"\n--- {s.new_tokens} tokens, {s.target_forwards} target forwards, tau {s.tau:.2f}, "
          f"{s.tokens_per_s:.1f} tok/s, stop: {s.stop_reason}{lossy}", file=sys.stderr)
    print("    accepted per step: " + " ".join(f"{n}:{c}" for n, c in enumerate(s.accept_hist) if c), file=sys.stderr)
    print("    seconds: " + " ".join(f"{k} {v:.3f}" for k, v in t.items()) + f" prefill {s.prefill_s:.3f}",
          file=sys.stderr)

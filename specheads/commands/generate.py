"""`specheads generate`: speculative generation with a head (or a training-free drafter), streamed to stdout."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import specheads.target
from specheads.commands import args as shared
from specheads.heads.base import read_head_config
from specheads.heads.kinds import kind_names
from specheads.heads.locate import head_folder
from specheads.infer.drafters import build_drafter, check_lookup, drafter_kind, parse_tree
from specheads.infer.drafters.plugins import load_plugins
from specheads.infer.engine.generate import generate
from specheads.infer.resolve import HeadResolver
from specheads.infer.verify import SamplingParams
from specheads.prompts import calibration_ids, load_prompts
from specheads.utils import SpecheadsError


def add_arguments(p) -> None:
    shared.add_target(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--head", help="head folder or hub id org/name[@revision] in the native layout, of a registered "
                                    f"kind ({', '.join(kind_names())}; --plugin adds your own)")
    src.add_argument("--drafter", default=None,
                     help="training-free drafter: plain, prompt-lookup (default when no --head), draft-model, "
                          "recycling (Token Recycling, --tree rank paths or default), layer-skip (the target drafting "
                          "for itself with --skip-layers left out; --tree auto or K drafts per step), or a "
                          "--plugin's own kind")
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
                   help="EAGLE heads: DEPTH,TOP_K,TOTAL (default 5,8,48), chain:K or JSON rank paths; Medusa heads: "
                        "chain:K, JSON rank paths such as [[0],[0,0],[1]] or default; DSpark heads: auto (default: "
                        "the per-step scheduler verifies the prefix of each block that pays) or K / chain:K draft "
                        "tokens per step; prompt-lookup (default 8) / draft-model (default 4): draft tokens per "
                        "step; auto (with an EAGLE / Medusa head): the size and depth that pay on this machine "
                        "(cached cost profile + a short acceptance probe, as bench does)")
    shared.add_lookup(p, 0, "with --head (or --drafter layer-skip, draft-model, recycling), greedy: also propose a "
                            "prompt-lookup chain of up to N tokens, the draft's tree and the chain under one per-step "
                            "scheduler (one verify budget; 0 = off)")
    shared.add_skip_layers(p)
    shared.add_pricing(p)
    shared.add_draft_model(p, f"--drafter draft-model: a separate small model with the same vocabulary, or "
                              f"truncated:N, the target's first N layers (1..layers-1; default "
                              f"truncated:{shared.DEFAULT_DRAFT_LAYERS})")
    p.add_argument("--typical-acceptance", action="store_true",
                   help="Medusa typical acceptance: LOSSY (output no longer follows the target's distribution)")
    shared.add_dtype(p)
    shared.add_engine(p)
    shared.add_device(p)
    shared.add_allow_other_target(p)
    shared.add_plugin(p)
    p.add_argument("--json", action="store_true", help="print the result and figures as one JSON object")


def drafter_source(args):
    """(drafter name, head config or None): the head folder's kind, else --drafter (prompt-lookup by default)."""
    if args.head:
        label, eq, rest = args.head.partition("=")
        if eq and not Path(args.head).exists() and Path(rest).is_dir():  # bench's LABEL=DIR given to generate
            raise SpecheadsError(f"--head {args.head}: no such folder; generate takes one head folder, not LABEL=DIR "
                                 f"(as bench does): --head {rest}")
        args.head = str(head_folder(args.head))  # a hub id: its snapshot folder in the hub cache (heads/locate.py)
        config = read_head_config(Path(args.head))
        return config.kind, config
    return args.drafter or "prompt-lookup", None


def build(args):
    """Target and drafter from the flags; every flag is checked before the target loads where it can be."""
    load_plugins(args.plugin)
    shared.check_max_new_tokens(args.max_new_tokens)
    SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    name, config = drafter_source(args)
    block = not args.head and drafter_kind(name).family == "block"  # a training-free block drafter (layer-skip)
    if args.tree == "auto" and not args.head and not block:
        raise SpecheadsError("--tree auto: needs --head DIR (training-free drafters take a number of tokens per step)")
    check_lookup(args.lookup)
    if args.lookup and not args.head and name in ("plain", "prompt-lookup"):
        raise SpecheadsError("--lookup: merges prompt lookup into a head's or a draft's tree; needs --head DIR or "
                             "--drafter layer-skip, draft-model, recycling")
    spec = parse_tree(args.tree, name, config)
    options = shared.draft_model_options(args) if name == "draft-model" else {}
    if name == "layer-skip":
        options = {"skip": args.skip_layers}
    target = specheads.target.load_target(args.target, dtype=shared.dtype_name(args.dtype), device=args.device)
    target.engine, target.compile = args.engine, args.compile
    shared.allow_other_target(target, args)
    if not args.head:
        return target, build_drafter(target, name, spec, lookup=args.lookup, pricing=args.pricing, **options)
    # a tree head's auto: probed on a few MT-bench questions spread over its categories
    resolver = HeadResolver(target, args.tree, lambda: calibration_ids(target.tokenizer, load_prompts("mt-bench")))
    r = resolver.resolve(args.head)
    if r.acceptance is not None:
        print(f"--tree auto: {r.tree['summary']} ({r.tree['reason']})", file=sys.stderr)
    return target, build_drafter(target, r.head, r.spec, lookup=args.lookup, acceptance=r.acceptance,
                                 pricing=args.pricing)


def run(args) -> int:
    target, drafter = build(args)
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
            _report(res, args, target)
    if args.raw:
        res = generate(target, drafter, prompt=args.prompt, **kw)
    else:
        res = generate(target, drafter, messages=[{"role": "user", "content": args.prompt}], **kw)
    _report(res, args, target)
    return 0


def _report(res, args, target) -> None:
    s = res.stats
    if s.stop_reason == "context_window":  # one line, --json too (its stats say stop_reason context_window)
        print(f"stopped at the context window of {target.max_positions} positions of target {target.name} "
              f"(prompt {len(res.prompt_ids)} + {s.new_tokens} new tokens), before --max-new-tokens "
              f"{args.max_new_tokens}", file=sys.stderr)
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
    sc = s.schedule
    if sc is not None:  # the per-step scheduler's own prediction (infer/scheduling/step.py), and the sources alone
        line = (f"    scheduler: expected τ {sc.expected_tau_sum / sc.scheduled_steps:.2f}, expected speedup "
                f"{sc.expected_tau_sum / max(sc.expected_cost_sum, 1e-9):.2f}x over {sc.scheduled_steps} steps")
        if sc.source_tokens:
            alone = ", ".join(f"{k} {v / sc.source_steps.get(k, sc.scheduled_steps):.2f} "
                              f"({sc.source_steps.get(k, 0)} steps)" for k, v in sc.source_tokens.items())
            line += f"; alone τ: {alone}; oracle τ {sc.oracle_tokens / sc.scheduled_steps:.2f}"
        print(line, file=sys.stderr)

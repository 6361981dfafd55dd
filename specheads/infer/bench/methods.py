"""The methods of `specheads bench` (single runs): HF `generate` (`vanilla`, `prompt-lookup`), our loop with a
drafter (`plain`, `prompt-lookup-ours`, `recycling`, `head` / `head:LABEL` with or without `+lookup`, the unions,
`draft-model`, the self-speculative `layer-skip` and `layer-skip+lookup`), llama.cpp (bench/llamacpp/) and vLLM
(bench/vllm/). Names and their grammar: bench/names.py; heads and trees: infer/resolve.py. Each method is a `Method`
(bench/records.py): `generate(input_ids, max_new_tokens) -> RunRecord`.

HF's target forwards are counted with a forward pre-hook (the peer users already have); ours come from the loop's
stats. Every drafter comes from drafters.build_drafter / combine_drafters; a tree head's `--tree auto` from
autotree.choose_tree_for_head (one probe per head, shared by its methods), a block head's is its scheduler.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from specheads.infer.bench.llamacpp.method import build_llamacpp_method
from specheads.infer.bench.names import (DRAFTER_PREFIX, HEAD_LOOKUP_TOKENS, LOOKUP_SUFFIX, OURS_TRAINING_FREE,
                                         PROMPT_LOOKUP_MAX_NGRAM, PROMPT_LOOKUP_NUM_TOKENS, SELF_SPEC_METHODS,
                                         UNION_METHODS,
                                         check_method_names, expand_heads, is_drafter_method, is_head_method,
                                         is_llamacpp_method, is_vllm_method, split_lookup)
from specheads.infer.bench.records import Method, RunRecord
from specheads.infer.bench.vllm.method import build_vllm_method
from specheads.infer.drafters import build_drafter, combine_drafters, draft_model_source, parse_tree
from specheads.infer.engine.generate import GenerationResult, generate
from specheads.infer.resolve import HeadResolver
from specheads.infer.scheduling.step import RULE as SCHEDULER_RULE
from specheads.infer.scheduling.step import check_pricing
from specheads.infer.treespec import MAX_TREE_DEPTH, TreeSpec
from specheads.utils import SpecheadsError

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------- HF and ours
def hf_sampling_kwargs(temperature: float) -> dict[str, Any]:
    """HF generate's greedy, or plain temperature sampling."""
    if temperature <= 0:
        return {"do_sample": False}
    # plain temperature sampling: switch off the generation config's top-k / top-p defaults
    return {"do_sample": True, "temperature": float(temperature), "top_k": 0, "top_p": 1.0}


class HFGenerate(Method):
    """HF `model.generate` (vanilla or with HF's prompt lookup). Target forwards and the tokens each emitted are
    read with a forward pre-hook: the first position of each call tells how far the previous call advanced."""

    def __init__(self, name: str, target, temperature: float, **generate_kwargs):
        self.name = name
        self.target = target
        self.kwargs = {**hf_sampling_kwargs(temperature), **generate_kwargs}
        self.info = {"implementation": "transformers model.generate", **generate_kwargs}
        self._starts: list[int] = []

    def _hook(self, module, args, kwargs):
        pos = kwargs.get("position_ids")
        if pos is not None:
            self._starts.append(int(pos.reshape(-1)[0]))
            return
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        self._starts.append(int(cache.get_seq_length()) if cache is not None else 0)

    def generate(self, input_ids: list[int], max_new_tokens: int) -> RunRecord:
        model = self.target.model
        tok = self.target.tokenizer
        cap = window_cap(self.target, len(input_ids), max_new_tokens)
        ids = torch.tensor([input_ids], device=self.target.device)
        pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else (self.target.eos_token_ids or [0])[0]
        self._starts = []
        handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)
        try:
            with torch.inference_mode():
                t0 = time.perf_counter()
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=cap,
                                     eos_token_id=self.target.eos_token_ids or None, pad_token_id=pad, **self.kwargs)
                dt = time.perf_counter() - t0
        finally:
            handle.remove()
        new = out[0, len(input_ids):].tolist()
        step_tokens = forward_token_counts(self._starts, len(input_ids), len(new))
        eos = bool(new) and new[-1] in set(self.target.eos_token_ids or [])
        stop = "eos" if eos else "max_new_tokens" if cap == max_new_tokens else "context_window"
        return RunRecord(method=self.name, prompt_id="", category="", turn=0, prompt_tokens=len(input_ids),
                         new_tokens=len(new), time_s=dt, target_forwards=len(self._starts) if self._starts else None,
                         step_tokens=step_tokens, output_ids=new,
                         text=tok.decode(new, skip_special_tokens=True) if tok is not None else "", stop_reason=stop)


def window_cap(target, prompt_len: int, max_new_tokens: int) -> int:
    """The new tokens HF generate may make: max_new_tokens, cut where the target's context window ends (HF would
    go on past it; our loop stops there, and the outputs are compared token for token). A prompt with no room
    left is one SpecheadsError, as generate's."""
    window = target.max_positions
    if not window:
        return max_new_tokens
    if prompt_len >= window:
        raise SpecheadsError(f"{prompt_len} tokens do not fit the context window of {window} of target "
                             f"{target.name} (no room for a new token)")
    return min(max_new_tokens, window - prompt_len)


def forward_token_counts(starts: list[int], prompt_len: int, new_tokens: int) -> list[int] | None:
    """Tokens emitted by each target forward, from the first position of each call. After a call the sequence holds
    exactly one token not yet in the cache, so call i emitted starts[i+1] - starts[i] tokens (the first call:
    starts[1] + 1 - prompt_len; the last: prompt_len + new_tokens - 1 - starts[-1])."""
    if not starts:
        return None
    ends = [s + 1 for s in starts[1:]] + [prompt_len + new_tokens]
    prev = [prompt_len] + ends[:-1]
    counts = [e - p for e, p in zip(ends, prev)]
    if any(c < 0 for c in counts) or sum(counts) != new_tokens:
        return None
    return counts


class OursGenerate(Method):
    """Our speculative loop (specheads.infer.generate) with a drafter. Needs from the inference module:
    `generate(target, drafter, input_ids, max_new_tokens=, temperature=, ...) -> GenerationResult(ids, text, stats)`
    with stats new_tokens, target_forwards, accept_hist, and per-phase timings (docs/architecture.md)."""

    def __init__(self, name: str, target, drafter, temperature: float, info: dict[str, Any], **gen_kwargs):
        self.name = name
        self.target = target
        self.drafter = drafter
        self.temperature = temperature
        self.gen_kwargs = gen_kwargs
        self.info = info

    def generate(self, input_ids: list[int], max_new_tokens: int) -> RunRecord:
        ids = torch.tensor([input_ids], device=self.target.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            res = generate(self.target, self.drafter, ids, max_new_tokens=max_new_tokens,
                                   temperature=self.temperature, **self.gen_kwargs)
        dt = time.perf_counter() - t0
        return record_from_generation(self.name, res, len(input_ids), dt, self.target.tokenizer)


def record_from_generation(name: str, res: GenerationResult, prompt_len: int, dt: float, tokenizer) -> RunRecord:
    """Adapt our loop's GenerationResult (ids: the new tokens) into a RunRecord: the accept histogram spread into
    each step's tokens (prefill excluded: sum = target forwards), the phase seconds with the prefill's."""
    stats = res.stats
    new = list(res.ids)
    step_tokens = [n for n, count in enumerate(stats.accept_hist) for _ in range(count)]
    phases = {**{str(k): float(x) for k, x in stats.timings.items()}, "prefill": float(stats.prefill_s)}
    text = res.text or (tokenizer.decode(new, skip_special_tokens=True) if tokenizer is not None else "")
    schedule = asdict(stats.schedule) if stats.schedule is not None else None
    return RunRecord(method=name, prompt_id="", category="", turn=0, prompt_tokens=prompt_len, new_tokens=len(new),
                     time_s=dt, target_forwards=stats.target_forwards, step_tokens=step_tokens,
                     output_ids=new, text=text, phase_times=phases, schedule=schedule, stop_reason=stats.stop_reason)


def hf_methods(target, temperature: float) -> dict[str, Callable[[], Method]]:
    return {
        "vanilla": lambda: HFGenerate("vanilla", target, temperature),
        "prompt-lookup": lambda: HFGenerate("prompt-lookup", target, temperature,
                                            prompt_lookup_num_tokens=PROMPT_LOOKUP_NUM_TOKENS,
                                            max_matching_ngram_size=PROMPT_LOOKUP_MAX_NGRAM),
    }


# --------------------------------------------------------------------------------------------------- building
@dataclass
class MethodOptions:
    """What one run's methods are built from (`specheads bench` turns its flags into this)."""

    temperature: float = 0.0
    heads: dict[str, str] = field(default_factory=dict)  # method name -> head folder (names.head_entries)
    tree: str | dict[str, str] = "auto"  # --tree for every head (treespec: auto, DEPTH,TOP_K,TOTAL, rank paths),
    # or {head folder: tree} (names.head_trees)
    refresh_profile: bool = False  # measure the cost profile again before `--tree auto`
    lookup: int = HEAD_LOOKUP_TOKENS  # tokens of the prompt-lookup chain the +lookup and combo methods merge in
    draft_model: str | None = None  # the draft-model method's model: a name, or truncated:N (the target's N layers)
    draft_tokens: int = 4  # the draft model's chain per step (bench --tree draft-model=N)
    threads: int | None = None  # llama.cpp methods: llama-server -t (None = the cores this process may run on)
    llamacpp_target: str | None = None  # llama.cpp methods: the target GGUF (None = the target converted, cached)
    llamacpp_draft_max: int | None = None  # llama.cpp:LABEL: --spec-draft-n-max (None = llama.cpp's default, 3)
    llamacpp_p_min: float | None = None  # llama.cpp:LABEL, DSpark: --spec-draft-p-min (None = chosen on calib prompts)
    vllm_eager: bool = False  # vllm methods: --enforce-eager (no torch.compile: faster start, slower decoding)
    pricing: str = "measured"  # the schedulers' (step.PRICINGS): the run's seconds, or the cost profile alone
    skip_layers: str = "auto"  # layer-skip methods: --skip-layers (auto: the cached search, search: again, or SPEC)

    def __post_init__(self) -> None:
        check_lookup_tokens(self.lookup)
        check_pricing(self.pricing, "--pricing")


def check_lookup_tokens(n: int, flag: str = "--lookup") -> None:
    """The +lookup / combo chain: 1..MAX_TREE_DEPTH prompt-lookup tokens."""
    if not 1 <= n <= MAX_TREE_DEPTH:
        raise SpecheadsError(f"{flag} {n}: must be 1..{MAX_TREE_DEPTH} (tokens of the prompt-lookup chain)")


def build_methods(names: list[str], target, options: MethodOptions, calib_ids: list[list[int]] | None = None
                  ) -> tuple[list[Method], dict[str, Any]]:
    """Methods in the order asked (vanilla always included, first), plus extra results fields: the tree chosen
    for each head method and why. `calib_ids`: prompts for the heads' acceptance probe (`--tree auto`)."""
    check_method_names(names)
    names = ["vanilla"] + [n for n in names if n != "vanilla"]  # speedup and identical are measured against it
    if options.temperature > 0 and any(split_lookup(n)[1] or n in UNION_METHODS for n in names):
        raise SpecheadsError(f"--methods {','.join(names)}: {LOOKUP_SUFFIX} and combo methods are greedy only "
                             "(use --temperature 0)")
    factories = hf_methods(target, options.temperature)
    # one load and one probe per head folder, one cost profile for every scheduler of the run
    resolver = HeadResolver(target, options.tree, calib_ids or [], refresh=options.refresh_profile,
                            pricing=options.pricing)
    methods: list[Method] = []
    extra: dict[str, Any] = {"methods_info": {}}
    for n in expand_heads(names, options.heads, split_lookup):
        if n in factories:
            m = factories[n]()
        elif n in OURS_TRAINING_FREE:
            m = build_ours_method(n, target, options.temperature)
        elif is_drafter_method(n):
            m = build_registered_method(n, target, options.temperature)
        elif is_head_method(n):
            base, merged = split_lookup(n)
            if base not in options.heads:
                raise SpecheadsError(f"--methods {n}: no such head; given: "
                                     f"{list(options.heads) or 'none (use --head DIR)'}")
            m, tree = build_head_method(target, options, resolver, head_dir=options.heads[base], name=base,
                                        lookup=options.lookup if merged else 0)
            extra.setdefault("trees", {})[m.name] = tree
            extra.setdefault("tree", tree)  # the first head's tree (results.json schema 1)
        elif n in UNION_METHODS:
            m, tree = build_combo_method(target, options, resolver, name=n)
            extra.setdefault("trees", {})[m.name] = tree
        elif n in SELF_SPEC_METHODS:
            m, tree = build_layer_skip_method(target, options, resolver, lookup=n.endswith(LOOKUP_SUFFIX))
            extra.setdefault("trees", {})[m.name] = tree
        elif is_llamacpp_method(n):  # llama-server engines (bench/llamacpp/)
            m = build_llamacpp_method(n, target, options, calib_ids)
        elif is_vllm_method(n):  # vLLM OpenAI servers (bench/vllm/)
            m = build_vllm_method(n, target, options)
        else:
            m = build_draft_model_method(target, options)
        methods.append(m)
        extra["methods_info"][m.name] = m.info
    return methods, extra


def build_ours_method(name: str, target, temperature: float) -> Method:
    """`plain` (our loop, no drafter: its gap to vanilla is the loop's overhead), `prompt-lookup-ours` (our loop
    with our prompt-lookup drafter, HF prompt lookup's settings) or `recycling` (Token Recycling, its default tree;
    one drafter for every prompt of the run: its table carries over, the paper's hot start)."""
    if name in ("plain", "recycling"):
        drafter = build_drafter(target, name)
    else:
        drafter = build_drafter(target, "prompt-lookup", TreeSpec.tokens(PROMPT_LOOKUP_NUM_TOKENS),
                                max_ngram=PROMPT_LOOKUP_MAX_NGRAM)
    return OursGenerate(name, target, drafter, temperature,
                        {"implementation": f"specheads.infer.generate + {type(drafter).__name__}"})


def build_registered_method(name: str, target, temperature: float) -> Method:
    """`drafter:NAME`: our loop with the registered training-free drafter NAME at its default tree (a --plugin's
    kind included): what a new drafter kind needs to be benchmarked beside the others."""
    kind = name[len(DRAFTER_PREFIX):]
    drafter = build_drafter(target, kind, parse_tree(None, kind))
    return OursGenerate(name, target, drafter, temperature,
                        {"implementation": f"specheads.infer.generate + {type(drafter).__name__}", "drafter": kind})


def build_head_method(target, options: MethodOptions, resolver: HeadResolver, head_dir: str, name: str = "head",
                      lookup: int = 0) -> tuple[Method, dict[str, Any]]:
    """`head`: our loop with the head's drafter and tree (`--tree auto`: autotree.choose_tree_for_head for tree
    heads, the per-step scheduler for block heads). `lookup` > 0: the head and a prompt-lookup chain of up to that
    many tokens under one per-step scheduler (method NAME+lookup; greedy only). `resolver`: shared by one run's
    methods, so that a head's methods load it and run the `--tree auto` probe once."""
    r = resolver.resolve(head_dir)
    tree = r.tree
    block_auto = r.family == "block" and r.spec.scheduled
    scheduler = resolver.scheduler() if lookup or r.family == "block" else None
    drafter = build_drafter(target, r.head, r.spec, lookup=lookup, lookup_ngram=PROMPT_LOOKUP_MAX_NGRAM,
                            acceptance=r.acceptance, scheduler=scheduler)
    info: dict[str, Any] = {"implementation": "specheads.infer.generate", "head": str(head_dir),
                            "head_kind": r.head.config.kind,
                            "tree": {k: tree.get(k) for k in ("total_tokens", "depth", "top_k") if k in tree}}
    if block_auto:
        tree["scheduler"] = scheduler.record()
    if lookup > 0:
        name += LOOKUP_SUFFIX
        info["lookup_tokens"] = lookup
        tree["summary"] = (f"{tree.get('summary', '')} + a prompt-lookup chain of up to {lookup} tokens, one verify "
                           "budget per step (scheduler)")
        tree["scheduler"] = scheduler.record()
    tree["method"] = name
    return OursGenerate(name, target, drafter, options.temperature, info), tree


def build_combo_method(target, options: MethodOptions, resolver: HeadResolver, name: str = "combo"
                       ) -> tuple[Method, dict[str, Any]]:
    """`combo`: every --head and a prompt-lookup chain of --lookup tokens under one per-step scheduler (each
    head's draft pass is paid every step and priced by the measured drafter seconds); `combo+recycling`: Token
    Recycling's tree as one more source; `lookup+recycling`: the two training-free sources alone. Greedy only."""
    heads = {} if name == "lookup+recycling" else options.heads
    if name != "lookup+recycling" and not heads:
        raise SpecheadsError(f"--methods {name}: needs --head DIR (one or more)")
    scheduler = resolver.scheduler()
    drafters, priors, parts = [], [], {}
    for label, head_dir in heads.items():
        r = resolver.resolve(head_dir)
        drafters.append(build_drafter(target, r.head, r.spec, scheduler=scheduler))
        priors.append(r.acceptance)
        parts[label] = r.tree.get("summary", "")
    if name.endswith("+recycling"):
        drafters.append(build_drafter(target, "recycling"))
        priors.append(None)
        parts["recycling"] = "Token Recycling, Medusa's default 25-node tree"
    if name.endswith("+layer-skip"):
        drafters.append(build_drafter(target, "layer-skip", "auto", scheduler=scheduler, skip=options.skip_layers,
                                      calib_ids=resolver.calib_ids))
        priors.append(None)
        parts["layer-skip"] = layer_skip_summary(drafters[-1])
    drafter = combine_drafters(target, drafters, lookup=options.lookup, lookup_ngram=PROMPT_LOOKUP_MAX_NGRAM,
                               acceptances=priors, scheduler=scheduler)
    summary = (f"{' + '.join(f'{k} ({v})' for k, v in parts.items())} + a prompt-lookup chain of up to "
               f"{options.lookup} tokens, one verify budget per step (scheduler)")
    tree = {"mode": "combo", "method": name, "summary": summary, "reason": SCHEDULER_RULE,
            "sources": drafter.names, "scheduler": scheduler.record()}
    info = {"implementation": "specheads.infer.generate + ScheduledUnionDrafter", "heads": dict(heads),
            "lookup_tokens": options.lookup, "sources": drafter.names}
    return OursGenerate(name, target, drafter, options.temperature, info), tree


def layer_skip_summary(drafter) -> str:
    """One line on a layer-skip draft: its skip set, the weights a draft pass reads, where the set comes from."""
    r = drafter.record
    acc = ", ".join(f"{a:.2f}" for a in (r.get("acceptance") or [])[:4])
    measured = f"; measured acceptance per depth {acc}, {r['value']:.2f} of plain decoding" if acc else ""
    return (f"the target skipping {r['skip']} ({r['skipped']} of {2 * drafter.target.num_layers} sublayers, a draft "
            f"pass reads {r['share']:.0%} of a forward's weights; {r.get('from', 'given')}{measured})")


def build_layer_skip_method(target, options: MethodOptions, resolver: HeadResolver, lookup: bool = False
                            ) -> tuple[Method, dict[str, Any]]:
    """`layer-skip`: our loop with the target drafting for itself with a skip set of its sublayers (--skip-layers:
    the cached search result by default), its chain cut by the adaptive exit and the per-step scheduler;
    `layer-skip+lookup`: it and a prompt-lookup chain under one scheduler (greedy only)."""
    scheduler = resolver.scheduler()
    drafter = build_drafter(target, "layer-skip", "auto", scheduler=scheduler, skip=options.skip_layers,
                            calib_ids=resolver.calib_ids, lookup=options.lookup if lookup else 0,
                            lookup_ngram=PROMPT_LOOKUP_MAX_NGRAM)
    inner = drafter.sources[0] if lookup else drafter
    name = "layer-skip" + (LOOKUP_SUFFIX if lookup else "")
    summary = layer_skip_summary(inner) + (f" + a prompt-lookup chain of up to {options.lookup} tokens, one verify "
                                           "budget per step (scheduler)" if lookup else "")
    tree = {"mode": "layer-skip", "method": name, "summary": summary, "reason": SCHEDULER_RULE,
            "skip": inner.record, "scheduler": scheduler.record()}
    info = {"implementation": f"specheads.infer.generate + {type(drafter).__name__}", "skip": inner.record["skip"],
            "share": inner.record["share"]}
    if lookup:
        info["lookup_tokens"] = options.lookup
    return OursGenerate(name, target, drafter, options.temperature, info), tree


def build_draft_model_method(target, options: MethodOptions) -> Method:
    """`draft-model`: our loop with a small causal LM drafting a chain. --draft-model NAME (loaded like a target,
    same dtype; must share the vocabulary) or truncated:N (the target's first N layers, no training)."""
    spec = options.draft_model
    if not spec:
        raise SpecheadsError("--methods draft-model: needs --draft-model NAME (or truncated:N)")
    chain = parse_tree(str(options.draft_tokens), "draft-model", flag="--tree draft-model")
    drafter = build_drafter(target, "draft-model", chain, **draft_model_source(spec))
    info = {"implementation": "specheads.infer.generate + DraftModelDrafter", "draft_model": spec,
            "draft_tokens": chain.num_tokens}
    return OursGenerate("draft-model", target, drafter, options.temperature, info)

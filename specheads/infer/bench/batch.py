"""`specheads bench --batch-sizes 1,2,4,8,16`: every method at every batch size on the same prompts (the runner,
bench/runner.py, and `write_results` shared with single runs; what is only the sweep's lives here).

At batch size B the prompts are cut into consecutive chunks of B rows; each chunk is decoded by every method in
turn (the order rotated chunk by chunk, after one untimed warm-up per method and batch size). Static batches, as HF
generate runs them: a chunk's rows start together; ours drop a row when it finishes, HF computes it to the end.
Methods:
- `vanilla`: HF `model.generate` on the chunk, left-padded (attention mask), greedy or sampling;
- `plain`: our batched loop (infer/engine/batch.py) without drafting (its gap to vanilla is our loop's overhead);
- `prompt-lookup`: our loop with a prompt-lookup drafter per row (HF's assisted decoding takes batch 1 only);
- `recycling`: our loop with a Token Recycling drafter per row (drafters.TokenRecyclingDrafter; each row's own
  table);
- `head` / `head:LABEL`: our loop with each --head's drafter per row (the tree of --tree; auto = the batch-1 choice);
- any of the last four with `+sched`: the per-row verify budget of batch_budget.BudgetScheduler on this machine's
  rows x tokens cost surface (profile.load_or_profile_batch), which can always fall back to plain decoding.
Figures (pure functions over the runs, tested on hand-made runs): tokens/s = new tokens / wall time of the calls
(prefill included), τ = new tokens / row forwards (vanilla 1.00), speedup = tokens/s over vanilla's at the same B
(ratio of totals), identical (greedy) = share of rows whose tokens equal vanilla's.
Output: results.json (schema `specheads.batchbench/1`, its own), results.md, speedup_batch.png.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from specheads.infer.bench.methods import hf_sampling_kwargs, window_cap
from specheads.infer.bench.metrics import ratio
from specheads.infer.bench.names import (PROMPT_LOOKUP_MAX_NGRAM, PROMPT_LOOKUP_NUM_TOKENS, check_batch_methods,
                                         expand_heads, split_sched)
from specheads.infer.bench.plots import write_batch_plot
from specheads.infer.bench.records import BatchMethod, BatchRun
from specheads.infer.bench.report import definitions_lines, fmt, header_lines, write_results
from specheads.infer.bench.runner import Unit, run_meta, run_units
from specheads.infer.drafters import NoDrafter, build_drafter
from specheads.infer.engine.batch import generate_batch
from specheads.infer.resolve import HeadResolver
from specheads.infer.scheduling import profile
from specheads.infer.scheduling.batch_budget import AcceptanceTracker, BudgetScheduler, ExploreClock
from specheads.infer.scheduling.costs import batch_cost_fn
from specheads.infer.treespec import TreeSpec
from specheads.utils import SpecheadsError

log = logging.getLogger(__name__)

SCHEMA = "specheads.batchbench/1"
DEFINITIONS = {
    "tokens_per_s": "total new tokens / total wall time of the batched calls (prefill included), all rows together",
    "tau": "total new tokens / row forwards (each forward counts once per row in it; vanilla = 1.00)",
    "speedup": "tokens_per_s(method) / tokens_per_s(vanilla) at the same batch size, over the same prompts",
    "speedup_vs_plain": "tokens_per_s(method) / tokens_per_s(plain) at the same batch size",
    "identical": "greedy only: share of rows whose output token ids equal vanilla's at the same batch size",
    "vs_plain_chunks": "the chunk-paired view of speedup_vs_plain: the geometric mean over chunks of each chunk's "
                       "tokens/s ratio to plain's on the same prompts, and the standard error of its log (the "
                       "noise band of 'not worse than plain': geomean x exp(+-2 se) holding 1.00)",
}


def _trim_at_eos(row: list[int], eos: set[int]) -> list[int]:
    """HF pads a finished row after its end-of-sequence token: keep up to that token (ours emits it too)."""
    for i, t in enumerate(row):
        if t in eos:
            return row[:i + 1]
    return row


class HFBatch(BatchMethod):
    """`vanilla`: HF generate on the chunk, left-padded; forwards counted with a pre-hook."""

    def __init__(self, target, temperature: float):
        self.name, self.target, self.temperature = "vanilla", target, temperature
        self.info = {"implementation": "transformers model.generate, left-padded batch"}

    def run(self, prompts: list[list[int]], max_new_tokens: int, seed: int) -> BatchRun:
        t, T = self.target, max(len(p) for p in prompts)
        caps = [window_cap(t, len(p), max_new_tokens) for p in prompts]  # each row's room in the context window
        eos = list(t.eos_token_ids or [])
        pad = getattr(t.tokenizer, "pad_token_id", None) if t.tokenizer is not None else None
        pad = pad if pad is not None else (eos or [0])[0]
        ids = torch.full((len(prompts), T), pad, dtype=torch.long)
        mask = torch.zeros(len(prompts), T, dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, T - len(p):], mask[r, T - len(p):] = torch.tensor(p), 1
        calls = []
        hook = t.model.register_forward_pre_hook(lambda *a: calls.append(1))
        sample = hf_sampling_kwargs(self.temperature)
        torch.manual_seed(seed)
        try:
            with torch.inference_mode():
                t0 = time.perf_counter()
                out = t.model.generate(ids.to(t.device), attention_mask=mask.to(t.device),
                                       max_new_tokens=max(caps), eos_token_id=eos or None, pad_token_id=pad,
                                       **sample)
                dt = time.perf_counter() - t0
        finally:
            hook.remove()
        # a row is cut where its window ends: HF generate goes on past it (left-padded rows count positions from
        # their own first token), our loop stops there
        rows = [_trim_at_eos(out[r, T:].tolist()[:caps[r]], set(eos)) for r in range(len(prompts))]
        at_window = sum(len(row) == cap < max_new_tokens and not (row and row[-1] in eos)
                        for row, cap in zip(rows, caps))
        return BatchRun(self.name, len(prompts), [], rows, dt, len(calls), sum(len(r) for r in rows),
                        at_window=at_window)


class OursBatch(BatchMethod):
    """Our batched loop: `make_drafter()` per row, and with `make_scheduler` a verify budget per step."""

    def __init__(self, name: str, target, make_drafter: Callable | None, temperature: float, info: dict[str, Any],
                 make_scheduler: Callable | None = None):
        self.name, self.target, self.make_drafter, self.temperature = name, target, make_drafter, temperature
        self.info, self.make_scheduler = info, make_scheduler

    def run(self, prompts: list[list[int]], max_new_tokens: int, seed: int) -> BatchRun:
        sched = self.make_scheduler() if self.make_scheduler is not None else None
        t0 = time.perf_counter()
        res = generate_batch(self.target, self.make_drafter, prompts, max_new_tokens, temperature=self.temperature,
                             seed=seed if self.temperature > 0 else None, scheduler=sched)
        dt = time.perf_counter() - t0
        return BatchRun(self.name, len(prompts), [], [r.ids for r in res.rows], dt, res.stats.target_forwards,
                        res.stats.row_forwards, {**res.stats.timings, "prefill": res.stats.prefill_s},
                        at_window=sum(r.stats.stop_reason == "context_window" for r in res.rows))


# --------------------------------------------------------------------------------------------------- figures
def summarize_runs(runs: list[BatchRun]) -> dict[str, Any]:
    tokens, time_s = sum(r.new_tokens for r in runs), sum(r.time_s for r in runs)
    rows_fw = sum(r.row_forwards for r in runs)
    phases: dict[str, float] = {}
    for r in runs:
        for k, v in (r.timings or {}).items():
            phases[k] = phases.get(k, 0.0) + v
    return {"rows": sum(len(r.outputs) for r in runs), "chunks": len(runs), "new_tokens": tokens,
            "time_s": round(time_s, 6), "tokens_per_s": ratio(tokens, time_s),
            "target_forwards": sum(r.target_forwards for r in runs), "row_forwards": rows_fw,
            "tau": ratio(tokens, rows_fw), "phase_seconds": {k: round(v, 4) for k, v in phases.items()} or None}


def compare_runs(runs: list[BatchRun], vanilla: list[BatchRun], plain: list[BatchRun], greedy: bool) -> dict:
    """summarize_runs plus speedup against vanilla / plain at the same batch size and (greedy) the identical share,
    rows matched by prompt id."""
    s = summarize_runs(runs)
    s["speedup"] = ratio(s["tokens_per_s"], summarize_runs(vanilla)["tokens_per_s"]) if vanilla else None
    s["speedup_vs_plain"] = ratio(s["tokens_per_s"], summarize_runs(plain)["tokens_per_s"]) if plain else None
    s["vs_plain_chunks"] = paired_chunk_ratio(runs, plain) if plain else None
    s["identical"] = None
    if greedy and vanilla:
        ref = {pid: out for r in vanilla for pid, out in zip(r.prompt_ids, r.outputs)}
        pairs = [(out, ref[pid]) for r in runs for pid, out in zip(r.prompt_ids, r.outputs) if pid in ref]
        s["identical"] = sum(a == b for a, b in pairs) / len(pairs) if pairs else None
    return s


def paired_chunk_ratio(runs: list[BatchRun], plain: list[BatchRun]) -> dict | None:
    """Per chunk (matched by its prompt ids) the method's tokens/s over plain's -> {chunks, geomean, se_log}: the
    geometric mean ratio and the standard error of the mean log ratio (None below two chunks)."""
    ref = {tuple(r.prompt_ids): r.new_tokens / r.time_s for r in plain if r.time_s > 0}
    logs = [math.log(r.new_tokens / r.time_s / ref[tuple(r.prompt_ids)]) for r in runs
            if r.time_s > 0 and r.new_tokens > 0 and tuple(r.prompt_ids) in ref]
    if len(logs) < 2:
        return None
    mean = sum(logs) / len(logs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1))
    return {"chunks": len(logs), "geomean": math.exp(mean), "se_log": sd / math.sqrt(len(logs))}


def build_batch_results(runs: list[BatchRun], names: list[str], batch_sizes: list[int], settings: dict,
                        meta: dict, complete: bool) -> dict[str, Any]:
    greedy = float(settings.get("temperature", 0.0)) <= 0
    per_b: dict[str, dict[str, Any]] = {}
    for B in batch_sizes:
        mine = [r for r in runs if r.batch_size == B]
        van = [r for r in mine if r.method == "vanilla"]
        plain = [r for r in mine if r.method == "plain"]
        if mine:
            per_b[str(B)] = {n: compare_runs([r for r in mine if r.method == n], van, plain, greedy) for n in names}
    speedup = {n: {B: per_b[B][n]["speedup"] for B in per_b} for n in names}
    return {"schema": SCHEMA, **meta, "settings": settings, "complete": complete, "definitions": DEFINITIONS,
            "methods": names, "batch_sizes": per_b, "speedup": speedup,
            "num_prompts": len({p for r in runs for p in r.prompt_ids})}


# --------------------------------------------------------------------------------------------------- the sweep
@dataclass
class BatchBenchSettings:
    target: str
    dataset: str
    dtype: str
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    temperature: float = 0.0  # 0 = greedy (identical-to-vanilla check on)
    max_new_tokens: int = 256  # per row, tokens
    limit: int | None = None
    seed: int = 0
    warmup_tokens: int = 8  # tokens each method generates on the first chunk of each batch size, untimed


def check_batch_sizes(sizes) -> list[int]:
    out = [int(b) for b in sizes]
    if not out or any(b < 1 for b in out) or len(set(out)) != len(out):
        raise SpecheadsError(f"--batch-sizes {','.join(map(str, sizes))}: expected distinct whole numbers >= 1, "
                             "e.g. 1,2,4,8,16")
    return sorted(out)


def run_batch_bench(prompts: list[tuple[str, list[int]]], methods: list[BatchMethod], settings: BatchBenchSettings,
                    out_dir: str | Path | None = None, extra: dict[str, Any] | None = None,
                    progress: bool = True) -> dict[str, Any]:
    """Every method at every batch size on the same (prompt id, token ids) list, methods alternated chunk by chunk
    (bench/runner.py: a unit = one chunk; each batch size's first chunk warms every method up, untimed).
    results.json is rewritten after every chunk; Ctrl-C keeps the finished chunks (complete = False)."""
    names = [m.name for m in methods]
    if len(set(names)) != len(names) or "vanilla" not in names:
        raise SpecheadsError(f"--methods: {names} must hold vanilla once and no method twice")
    sizes = check_batch_sizes(settings.batch_sizes)
    meta = run_meta(extra)
    units = []
    for B in sizes:
        chunks = [prompts[i:i + B] for i in range(0, len(prompts), B)]
        for c, chunk in enumerate(chunks):
            units.append(Unit(run=lambda m, B=B, c=c, chunk=chunk: [_run_chunk(m, B, c, chunk, settings)],
                              size=len(chunk), index=c))
        if chunks and settings.warmup_tokens > 0:
            first = [ids for _, ids in chunks[0]]
            units[-len(chunks)].warmup = lambda m, first=first: m.run(first, settings.warmup_tokens, settings.seed)
    runs, results = run_units(units, methods,
                           lambda runs, done: build_batch_results(runs, names, sizes, asdict(settings), meta, done),
                           out_dir, {"total": len(sizes) * len(prompts), "desc": "bench --batch-sizes", "unit": "row"},
                           "chunks", progress)
    if out_dir is not None:
        write_results(results, Path(out_dir), write_batch_plot, batch_markdown)
    results["stopped_at_window"] = sum(r.at_window for r in runs)  # rows, every method and batch size
    return results


def _run_chunk(m: BatchMethod, B: int, c: int, chunk: list[tuple[str, list[int]]], settings: BatchBenchSettings
               ) -> BatchRun:
    """One method on chunk c of batch size B, seeded alike for every method."""
    run = m.run([ids for _, ids in chunk], settings.max_new_tokens, settings.seed + 1000 * c)
    run.batch_size, run.prompt_ids = B, [pid for pid, _ in chunk]
    return run


# --------------------------------------------------------------------------------------------------- outputs
def batch_markdown(results: dict[str, Any]) -> str:
    s, per_b = results["settings"], results["batch_sizes"]
    env = results.get("environment", {})
    sizes = list(per_b)
    lines = header_lines(results, "specheads bench --batch-sizes", "row",
                         env.get("gpu") or env.get("cpu") or "unknown device")
    lines += ["Speedup against vanilla at the same batch size (tokens/s, τ):", "",
              "| method | " + " | ".join(f"B={b}" for b in sizes) + " |", "|---|" + "---:|" * len(sizes)]
    for n in results["methods"]:
        cells = [f"{fmt(per_b[b][n]['speedup'], '.2f', 'x')} ({fmt(per_b[b][n]['tokens_per_s'], '.1f')}, "
                 f"{fmt(per_b[b][n]['tau'])})" for b in sizes]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", "Against plain, chunk by chunk (geometric mean of the per-chunk ratios, ± 2 standard errors: the noise "
              "band):", "", "| method | " + " | ".join(f"B={b}" for b in sizes) + " |", "|---|" + "---:|" * len(sizes)]
    for n in results["methods"]:
        if n in ("vanilla", "plain"):
            continue
        cells = []
        for b in sizes:
            c = per_b[b][n].get("vs_plain_chunks")
            cells.append("n/a" if not c else f"{c['geomean']:.3f} [{c['geomean'] * math.exp(-2 * c['se_log']):.3f}, "
                                             f"{c['geomean'] * math.exp(2 * c['se_log']):.3f}]")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    if float(s["temperature"]) <= 0:
        lines += ["", "Rows identical to vanilla's (greedy):", "",
                  "| method | " + " | ".join(f"B={b}" for b in sizes) + " |", "|---|" + "---:|" * len(sizes)]
        for n in results["methods"]:
            lines.append(f"| {n} | " + " | ".join(fmt(per_b[b][n]["identical"], ".0%") for b in sizes) + " |")
    for name, tree in (results.get("trees") or {}).items():
        lines += ["", f"Tree of {name}: {tree.get('summary', '')} ({tree.get('reason', '')})"]
    lines += definitions_lines(results)
    return "\n".join(lines)


def build_batch_methods(names: list[str], target, options, calib_ids: list[list[int]] | None = None
                        ) -> tuple[list[BatchMethod], dict[str, Any]]:
    """The sweep's methods (vanilla first) from bench.methods.MethodOptions (temperature, heads, tree,
    refresh_profile, pricing); extra results fields: each head's tree and why, and the cost surface the +sched methods
    spend."""
    check_batch_methods(names)
    names = ["vanilla"] + [n for n in names if n != "vanilla"]
    extra: dict[str, Any] = {"methods_info": {}}
    makers: dict[str, Callable] = {"plain": NoDrafter, "prompt-lookup": lambda: build_drafter(
        target, "prompt-lookup", TreeSpec.tokens(PROMPT_LOOKUP_NUM_TOKENS), max_ngram=PROMPT_LOOKUP_MAX_NGRAM),
        "recycling": lambda: build_drafter(target, "recycling")}
    resolver = HeadResolver(target, options.tree, calib_ids or [], refresh=options.refresh_profile,
                            pricing=options.pricing)
    cost = None
    methods: list[BatchMethod] = []
    for n in expand_heads(names, options.heads, split_sched):
        base, sched = split_sched(n)
        if n == "vanilla":
            methods.append(HFBatch(target, options.temperature))
            extra["methods_info"][n] = methods[-1].info
            continue
        if base not in makers:
            makers[base] = _head_maker(base, target, options, resolver, extra)
        make_sched = None
        if sched:
            cost = cost or _cost_surface(target, options.refresh_profile, extra)
            make_sched = _scheduler_factory(cost, draft_cost=None if options.pricing == "measured" else 0.0)
        info = {"implementation": "specheads.infer.engine.batch.generate_batch", "budget": "BudgetScheduler" if sched
                else "whole trees"}
        if sched:
            info["pricing"] = options.pricing
        methods.append(OursBatch(n, target, makers[base], options.temperature, info, make_sched))
        extra["methods_info"][n] = info
    return methods, extra


def _head_maker(name: str, target, options, resolver: HeadResolver, extra: dict) -> Callable:
    """make_drafter for a head method: the head loaded once, its tree from --tree (auto: the batch-1 choice; a block
    head's auto: its whole block, which +sched's budget cuts per row and step)."""
    if name not in options.heads:
        raise SpecheadsError(f"--methods {name}: no such head; given: {list(options.heads) or 'none (use --head DIR)'}")
    r = resolver.resolve(options.heads[name], block_auto="block")
    extra.setdefault("trees", {})[name] = r.tree
    return lambda: build_drafter(target, r.head, r.spec)


def _cost_surface(target, refresh: bool, extra: dict):
    prof = profile.load_or_profile_batch(target, refresh=refresh)
    extra["cost_surface"] = {k: prof.get(k) for k in ("path", "cached", "noisy", "noise", "batch")}
    return batch_cost_fn(prof)


def _scheduler_factory(cost, draft_cost: float | None = None) -> Callable:
    """A fresh BudgetScheduler per chunk sharing one tracker's pooled rates and one exploration clock (the method
    learns its drafter's acceptance across chunks, and a chunk starts resting while explorations find nothing;
    per-row rates start over with each chunk's rows). draft_cost: None = measured; 0 = --pricing profile (the cost
    surface alone: no in-run seconds)."""
    tracker, clock = AcceptanceTracker(), ExploreClock()

    def make():
        tracker.rows.clear()
        return BudgetScheduler(cost, tracker=tracker, clock=clock, draft_cost=draft_cost)

    return make

"""`specheads bench`: every method on the same prompts in one process, alternated prompt by prompt.

Figures (all computed by the pure functions `summarize` / `compare`, tested on hand-made runs):
- tokens/s = total new tokens / total wall time of the generate calls (prefill included) over the prompts;
- τ = total new tokens / total target forwards that emit tokens (bonus included), so plain decoding is exactly
  1.00: HF generate's prefill forward emits the first token and counts; our loop's prefill only fills the cache
  (the first token comes from the first tree forward) and does not; None ("n/a") when forwards cannot be counted;
- speedup = tokens/s of the method / tokens/s of vanilla over the same prompts (a ratio of totals, not a mean of
  per-prompt ratios, so long answers weigh more, as in Spec-Bench);
- acceptance-length histogram: how many target forwards emitted 1, 2, 3, ... tokens (its mean is τ);
- identical (greedy only): share of prompt turns whose output token ids equal vanilla's exactly.

- expected speedup (scheduled methods: DSpark `--tree auto`, +lookup, combo): Σ expected τ / Σ expected step cost
  in one-token target forwards, the per-step scheduler's own prediction (infer/scheduler.py), beside the measured
  speedup; the oracle: per step the better of the sources alone (head alone, lookup alone), priced by the same
  cost model (`oracle_tau`, `oracle_speedup`).

Methods: `vanilla` = HF `model.generate`; `prompt-lookup` = HF `model.generate(prompt_lookup_num_tokens=...)` (the
peer users already have; target forwards counted with a forward pre-hook); `head` = ours (specheads.infer.generate
with the head's drafter; `head+lookup` = the head and a prompt-lookup chain under one per-step scheduler, greedy
only; `combo` = every --head and the lookup chain under one scheduler); `draft-model` = ours with a small draft
model as drafter. Every drafter comes from drafters.build_drafter / combine_drafters; a tree head's `--tree auto`
from autotree.choose_tree_for_head (one probe per head, shared by its methods), a block head's is its scheduler.
"""
from __future__ import annotations

import datetime as _dt
import json
import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from specheads.infer import autotree
from specheads.infer.drafters import build_drafter, combine_drafters, drafter_kind, parse_tree
from specheads.infer.generate import generate
from specheads.infer.profile import load_or_profile, t1_seconds
from specheads.infer.prompts import BenchPrompt, encode_turn
from specheads.infer.records import Method, RunRecord  # noqa: F401 (re-exported)
from specheads.infer.scheduler import RULE as SCHEDULER_RULE
from specheads.infer.scheduler import Scheduler
from specheads.infer.treespec import MAX_TREE_DEPTH, TreeSpec
from specheads.runinfo import command_line, environment
from specheads.utils import SpecheadsError, atomic_write_json, atomic_write_text

log = logging.getLogger(__name__)

SCHEMA = "specheads.bench/1"
KNOWN_METHODS = ("vanilla", "prompt-lookup", "head", "draft-model", "plain", "prompt-lookup-ours", "combo",
                 "recycling", "lookup+recycling", "combo+recycling")
# plain: our loop with no drafter (its gap to vanilla is our loop's overhead); prompt-lookup-ours: our loop with our
# PromptLookupDrafter (compare with HF's prompt-lookup); combo: every --head and prompt lookup under one scheduler;
# recycling: our loop with Token Recycling (training-free, drafters.TokenRecyclingDrafter); lookup+recycling: both training-free
# sources under one scheduler; combo+recycling: combo with Token Recycling as one more source
PROMPT_LOOKUP_NUM_TOKENS = 10  # HF docs' example value for prompt_lookup_num_tokens (candidate tokens per step)
PROMPT_LOOKUP_MAX_NGRAM = 2  # HF default max_matching_ngram_size
UNION_METHODS = ("combo", "combo+recycling", "lookup+recycling")  # several sources under one scheduler
LOOKUP_SUFFIX = "+lookup"  # head:LABEL+lookup = that head and a prompt-lookup chain under one per-step scheduler
HEAD_LOOKUP_TOKENS = PROMPT_LOOKUP_NUM_TOKENS  # +lookup chain length by default: the same chain as HF prompt lookup
DEFINITIONS = {
    "tokens_per_s": "total new tokens / total wall time of the generate calls (prefill included)",
    "tau": "total new tokens / total target forwards that emit tokens (bonus included; HF's prefill emits the first "
           "token and counts, our prefill only fills the cache and does not); vanilla = 1.00",
    "speedup": "tokens_per_s(method) / tokens_per_s(vanilla) over the same prompts (ratio of totals)",
    "accept_hist": "number of target forwards that emitted k tokens (k = accepted draft tokens + 1 bonus)",
    "identical": "greedy runs only: share of prompt turns whose output token ids equal vanilla's",
    "expected_tau": "scheduled methods: the scheduler's expected tokens per step, Σ (1 + Σ p over verified nodes) / "
                    "scheduled steps",
    "expected_speedup": "scheduled methods: Σ expected τ / Σ expected step cost (t(n)/t(1) + drafters' and loop's "
                        "measured seconds / t(1)), i.e. the predicted speedup over one target forward per token",
    "sources_tau": "greedy unions: per source, Σ tokens its own proposal alone would have emitted / the steps it "
                   "proposed on (a source whose pass does not pay rests; the target's argmax is known along every "
                   "emitted path)",
    "oracle_tau": "per step the better source alone (more tokens; equal: cheaper), Σ its tokens / steps, on the "
                  "method's own steps (a lower bound where censored)",
    "oracle_speedup": "the oracle's Σ tokens / Σ its own step costs (its source's tree verified alone + its draft + "
                      "the loop, by the scheduler's cost model): comparable with expected_speedup",
    "oracle_censored": "steps where the better source matched every emitted token and proposed deeper (the "
                       "scheduler cut it): its figure there is a lower bound",
}
SCHEDULE_FIELDS = ("scheduled_steps", "expected_tau_sum", "expected_cost_sum", "source_tokens", "source_steps",
                   "oracle_tokens", "oracle_cost_sum", "oracle_censored")  # GenerationStats fields a record keeps


# --------------------------------------------------------------------------------------------------- records
def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def accept_histogram(records: list[RunRecord]) -> dict[str, int] | None:
    """{"k": number of target forwards that emitted k tokens}; None if any record lacks per-forward counts."""
    if not records or any(r.step_tokens is None for r in records):
        return None
    c = Counter(k for r in records for k in r.step_tokens)  # type: ignore[union-attr]
    return {str(k): c[k] for k in sorted(c)}


def summarize(records: list[RunRecord]) -> dict[str, Any]:
    """Figures for one method over a set of records (see the module docstring for definitions)."""
    tokens = sum(r.new_tokens for r in records)
    time_s = sum(r.time_s for r in records)
    fw = None if any(r.target_forwards is None for r in records) else sum(r.target_forwards for r in records)  # type: ignore[misc]
    return {
        "turns": len(records),
        "new_tokens": tokens,
        "time_s": round(time_s, 6),
        "tokens_per_s": _ratio(tokens, time_s),
        "target_forwards": fw,
        "tau": _ratio(tokens, fw) if fw else None,
        "accept_hist": accept_histogram(records),
        **schedule_summary(records),
    }


def schedule_summary(records: list[RunRecord]) -> dict[str, Any]:
    """The scheduler's expected figures and the oracle's over a set of records (None where nothing was scheduled)."""
    out: dict[str, Any] = {"expected_tau": None, "expected_speedup": None, "sources_tau": None, "oracle_tau": None,
                           "oracle_speedup": None, "oracle_censored": None}
    recs = [r.schedule for r in records if r.schedule and r.schedule.get("scheduled_steps")]
    steps = sum(s["scheduled_steps"] for s in recs)
    if not steps:
        return out
    tau, cost = sum(s["expected_tau_sum"] for s in recs), sum(s["expected_cost_sum"] for s in recs)
    out.update(expected_tau=tau / steps, expected_speedup=_ratio(tau, cost))
    sources: Counter = Counter()
    source_steps: Counter = Counter()  # steps each source proposed on (a resting source sits some out)
    for s in recs:
        sources.update(s.get("source_tokens") or {})
        source_steps.update(s.get("source_steps") or {})
    if sources:
        oracle = sum(s["oracle_tokens"] for s in recs)
        out.update(sources_tau={k: v / (source_steps.get(k) or steps) for k, v in sorted(sources.items())},
                   oracle_tau=oracle / steps,
                   oracle_speedup=_ratio(oracle, sum(s["oracle_cost_sum"] for s in recs)),
                   oracle_censored=sum(s["oracle_censored"] for s in recs))
    return out


def compare(method_records: list[RunRecord], vanilla_records: list[RunRecord] | None, greedy: bool) -> dict[str, Any]:
    """`summarize` plus speedup against vanilla and (greedy) the identical share, matched by (prompt, turn)."""
    s = summarize(method_records)
    s["speedup"] = None
    s["identical"] = None
    s["expected_vs_measured"] = None
    if vanilla_records:
        s["speedup"] = _ratio(s["tokens_per_s"], summarize(vanilla_records)["tokens_per_s"])
        s["expected_vs_measured"] = _ratio(s["expected_speedup"], s["speedup"])
        if greedy:
            ref = {(r.prompt_id, r.turn): r.output_ids for r in vanilla_records}
            pairs = [(r.output_ids, ref[(r.prompt_id, r.turn)]) for r in method_records if (r.prompt_id, r.turn) in ref]
            s["identical"] = (sum(a == b for a, b in pairs) / len(pairs)) if pairs else None
    return s


def step_breakdown(records: list[RunRecord]) -> dict[str, Any] | None:
    """Seconds per phase summed over records (from our loop's stats), each phase's share of the decoding steps
    (prefill excluded), and the non-model share: everything but the target's and the drafter's phases."""
    recs = [r for r in records if r.phase_times]
    if not recs:
        return None
    total: Counter = Counter()
    for r in recs:
        total.update({k: float(v) for k, v in r.phase_times.items()})  # type: ignore[union-attr]
    steps = {k: v for k, v in total.items() if k not in NOT_STEP_PHASES}
    step_s = sum(steps.values())
    shares = {k: (v / step_s if step_s else None) for k, v in steps.items()}
    model_keys = [k for k in steps if k in MODEL_PHASES]
    model = sum(steps[k] for k in model_keys)
    forwards = sum(r.target_forwards or 0 for r in recs)
    return {"seconds": {k: round(v, 6) for k, v in total.items()}, "step_share": shares,
            "model_phases": model_keys, "non_model_share": (1 - model / step_s) if step_s else None,
            "ms_per_step": (1000 * step_s / forwards) if forwards else None}


# phases (specheads.infer.generate stats.timings) that are model forwards; the rest is our loop's own work
MODEL_PHASES = {"draft", "target"}
NOT_STEP_PHASES = {"prefill"}


# --------------------------------------------------------------------------------------------------- methods
def _sampling_kwargs(temperature: float) -> dict[str, Any]:
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
        self.kwargs = {**_sampling_kwargs(temperature), **generate_kwargs}
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
        ids = torch.tensor([input_ids], device=self.target.device)
        pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else (self.target.eos_token_ids or [0])[0]
        self._starts = []
        handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)
        try:
            with torch.inference_mode():
                t0 = time.perf_counter()
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                     eos_token_id=self.target.eos_token_ids or None, pad_token_id=pad, **self.kwargs)
                dt = time.perf_counter() - t0
        finally:
            handle.remove()
        new = out[0, len(input_ids):].tolist()
        step_tokens = forward_token_counts(self._starts, len(input_ids), len(new))
        return RunRecord(method=self.name, prompt_id="", category="", turn=0, prompt_tokens=len(input_ids),
                         new_tokens=len(new), time_s=dt, target_forwards=len(self._starts) if self._starts else None,
                         step_tokens=step_tokens, output_ids=new,
                         text=tok.decode(new, skip_special_tokens=True) if tok is not None else "")


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


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def record_from_generation(name: str, res: Any, prompt_len: int, dt: float, tokenizer) -> RunRecord:
    """Adapt a GenerationResult (ids = new tokens or prompt + new; stats as a dict or object) into a RunRecord."""
    stats = _get(res, "stats", {}) or {}
    ids = _get(res, "ids")
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    n_new = _get(stats, "new_tokens")
    new = ids[-n_new:] if n_new else (ids[prompt_len:] if len(ids) > prompt_len else ids)
    if n_new == 0:
        new = []
    fw = _get(stats, "target_forwards")
    hist = _get(stats, "accept_hist")
    step_tokens = None
    if isinstance(hist, dict):
        step_tokens = [int(k) for k, v in sorted(hist.items(), key=lambda kv: int(kv[0])) for _ in range(int(v))]
    elif isinstance(hist, (list, tuple)) and all(isinstance(x, int) for x in hist):
        # specheads.infer.generate: accept_hist[n] = steps that emitted n tokens
        step_tokens = [k for k, v in enumerate(hist) for _ in range(int(v))]
    if step_tokens is not None and fw is not None and (len(step_tokens) != fw or sum(step_tokens) != len(new)):
        # prefill forward (one token) not in the histogram: add it so that mean(hist) == tau
        if len(step_tokens) == fw - 1 and sum(step_tokens) == len(new) - 1:
            step_tokens = [1] + step_tokens
        else:
            log.debug("%s: accept_hist does not add up (forwards %s, tokens %s); histogram kept as reported",
                      name, fw, len(new))
    phases = None
    timings = _get(stats, "timings")
    if isinstance(timings, dict) and timings:
        phases = {str(k): float(x) for k, x in timings.items() if isinstance(x, (int, float))}
        pre = _get(stats, "prefill_s")
        if pre is not None:
            phases["prefill"] = float(pre)
    text = _get(res, "text") or (tokenizer.decode(new, skip_special_tokens=True) if tokenizer is not None else "")
    schedule = {k: _get(stats, k) for k in SCHEDULE_FIELDS} if _get(stats, "scheduled_steps") else None
    return RunRecord(method=name, prompt_id="", category="", turn=0, prompt_tokens=prompt_len, new_tokens=len(new),
                     time_s=dt, target_forwards=int(fw) if fw is not None else None, step_tokens=step_tokens,
                     output_ids=list(new), text=text, phase_times=phases, schedule=schedule)


# --------------------------------------------------------------------------------------------------- the run
@dataclass
class BenchSettings:
    target: str
    dataset: str
    dtype: str
    temperature: float = 0.0  # 0 = greedy (identical-to-vanilla check on)
    max_new_tokens: int = 256  # per turn, tokens; MT-bench answers are usually longer, 256 keeps CPU runs short
    limit: int | None = None
    both_turns: bool = False
    seed: int = 0
    warmup_tokens: int = 16  # tokens generated by each method on the first prompt before timing starts


def run_bench(prompts: list[BenchPrompt], methods: list[Method], settings: BenchSettings, tokenizer,
              out_dir: str | Path | None = None, extra: dict[str, Any] | None = None,
              progress: bool = True) -> dict[str, Any]:
    """Run every method on every prompt (methods alternated prompt by prompt, starting method rotated), after one
    untimed warm-up per method. Writes results.json after every prompt; Ctrl-C keeps finished prompts
    (results["complete"] = False). Returns the results dict."""
    from tqdm.auto import tqdm

    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise SpecheadsError(f"--methods: duplicate method in {names}")
    records: list[RunRecord] = []
    meta = {"command": command_line(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "environment": environment(), **(extra or {})}
    complete = False
    interrupted = False
    bar = None
    try:
        if prompts and settings.warmup_tokens > 0:
            warm = encode_turn(tokenizer, prompts[0], 0, [])
            for m in methods:
                m.generate(warm, settings.warmup_tokens)
        n_turns = sum(len(p.turns) for p in prompts)
        bar = tqdm(total=n_turns, desc="bench", unit="turn", disable=not progress)
        for i, p in enumerate(prompts):
            order = methods[i % len(methods):] + methods[:i % len(methods)]
            prompt_records: list[RunRecord] = []
            for m in order:
                answers: list[str] = []
                for turn in range(len(p.turns)):
                    ids = encode_turn(tokenizer, p, turn, answers)
                    torch.manual_seed(settings.seed + 1000 * i + turn)  # same seed for every method
                    r = m.generate(ids, settings.max_new_tokens)
                    r.prompt_id, r.category, r.turn = p.id, p.category, turn
                    prompt_records.append(r)
                    answers.append(r.text)
            records.extend(prompt_records)  # a prompt counts only when every method finished it
            bar.update(len(p.turns))
            if out_dir is not None:
                atomic_write_json(Path(out_dir) / "results.json", build_results(records, names, settings, meta, False))
        complete = True
    except KeyboardInterrupt:
        interrupted = True
        log.warning("interrupted: keeping the %d finished prompts", len({r.prompt_id for r in records}))
    finally:
        if bar is not None:
            bar.close()
    results = build_results(records, names, settings, meta, complete)
    results["interrupted"] = interrupted
    if out_dir is not None:
        write_outputs(results, records, out_dir)
    return results


def build_results(records: list[RunRecord], names: list[str], settings: BenchSettings, meta: dict[str, Any],
                  complete: bool) -> dict[str, Any]:
    greedy = settings.temperature <= 0
    van = [r for r in records if r.method == "vanilla"]
    cats = sorted({r.category for r in records}, key=lambda c: (c not in _CAT_ORDER, _CAT_ORDER.get(c, 0), c))
    methods_out: dict[str, Any] = {}
    for name in names:
        mine = [r for r in records if r.method == name]
        overall = compare(mine, van or None, greedy)
        per_cat = {c: compare([r for r in mine if r.category == c], [r for r in van if r.category == c] or None, greedy)
                   for c in cats}
        methods_out[name] = {"overall": overall, "categories": per_cat, "step_breakdown": step_breakdown(mine)}
        ref = [r for r in records if r.method == "llama.cpp"]  # the second reference: llama.cpp plain decoding
        if ref and name != "llama.cpp":
            methods_out[name]["vs_llama.cpp"] = compare(mine, ref, greedy)
    return {"schema": SCHEMA, **meta, "settings": asdict(settings), "complete": complete, "definitions": DEFINITIONS,
            "num_prompts": len({r.prompt_id for r in records}), "categories": cats, "methods": methods_out}


def _cat_order() -> dict[str, int]:
    from specheads.infer.prompts import MT_BENCH_CATEGORIES

    return {c: i for i, c in enumerate(MT_BENCH_CATEGORIES)}


_CAT_ORDER = _cat_order()


# --------------------------------------------------------------------------------------------------- outputs
def _fmt(x: Any, spec: str = ".2f", suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def llamacpp_table(results: dict[str, Any]) -> list[str]:
    """With `llama.cpp` in the run: every method against llama.cpp plain, the second reference beside vanilla."""
    rows = [(n, m["vs_llama.cpp"]) for n, m in results["methods"].items() if m.get("vs_llama.cpp")]
    if not rows:
        return []
    lines = ["", "## Against llama.cpp plain decoding (same prompts, same run)", "",
             "| method | tokens/s | speedup over llama.cpp | identical to llama.cpp |", "|---|---:|---:|---:|"]
    for name, v in rows:
        lines.append(f"| {name} | {_fmt(v['tokens_per_s'], '.1f')} | {_fmt(v['speedup'], '.2f', 'x')} | "
                     f"{_fmt(v['identical'], '.0%')} |")
    return lines


def markdown_table(results: dict[str, Any]) -> str:
    s = results["settings"]
    lines = [f"# specheads bench: {s['target']} on {s['dataset']}", "",
             f"{results['num_prompts']} prompts, dtype {s['dtype']}, temperature {s['temperature']}, "
             f"max {s['max_new_tokens']} new tokens per turn, {results['environment']['cpu'] or 'unknown CPU'}"
             f" ({results['environment']['torch_threads']} threads), {results['date']}."
             + ("" if results.get("complete") else " **Incomplete run (interrupted).**"), "",
             "| method | tokens/s | τ | speedup | expected | identical | new tokens | target forwards |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, m in results["methods"].items():
        o = m["overall"]
        lines.append(f"| {name} | {_fmt(o['tokens_per_s'], '.1f')} | {_fmt(o['tau'])} | {_fmt(o['speedup'], '.2f', 'x')}"
                     f" | {_fmt(o.get('expected_speedup'), '.2f', 'x')} | {_fmt(o['identical'], '.0%')} | "
                     f"{o['new_tokens']} | {_fmt(o['target_forwards'], 'd')} |")
    lines += llamacpp_table(results) + schedule_table(results)
    cats = results["categories"]
    if len(cats) > 1:
        names = list(results["methods"])
        lines += ["", "## Per category (speedup / τ)", "", "| category | " + " | ".join(names) + " |",
                  "|---|" + "---:|" * len(names)]
        for c in cats:
            cells = []
            for n in names:
                f = results["methods"][n]["categories"][c]
                cells.append(f"{_fmt(f['speedup'], '.2f', 'x')} / {_fmt(f['tau'])}")
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
    for name, m in results["methods"].items():
        b = m.get("step_breakdown")
        if b:
            lines += ["", f"## Step time breakdown: {name} ({_fmt(b['ms_per_step'], '.1f')} ms per step)", "",
                      "| phase | seconds | share of steps |", "|---|---:|---:|"]
            for k, v in sorted(b["seconds"].items(), key=lambda kv: -kv[1]):
                lines.append(f"| {k} | {v:.3f} | {_fmt(b['step_share'].get(k), '.1%')} |")
            lines.append(f"| **non-model share** (all but {' + '.join(b['model_phases'])}) | | "
                         f"{_fmt(b['non_model_share'], '.1%')} |")
    trees = results.get("trees") or ({"head": results["tree"]} if results.get("tree") else {})
    for name, tree in trees.items():
        title = "Tree" if len(trees) == 1 else f"Tree: {name}"
        lines += ["", f"## {title}", "", f"{tree.get('summary', '')}", "", f"Why: {tree.get('reason', '')}"]
    lines += ["", "Definitions: " + "; ".join(f"**{k}** = {v}" for k, v in results["definitions"].items()) + ".", ""]
    return "\n".join(lines)


def schedule_table(results: dict[str, Any]) -> list[str]:
    """results.md's scheduler section: expected against measured per scheduled method, each source alone and the
    oracle on the same steps."""
    rows = [(n, m["overall"]) for n, m in results["methods"].items() if m["overall"].get("expected_tau") is not None]
    if not rows:
        return []
    lines = ["", "## Scheduler: expected against measured, each source alone, the oracle", "",
             "| method | τ | expected τ | speedup | expected speedup | expected / measured | alone τ (same steps) | "
             "oracle τ | oracle speedup (est.) | censored steps |", "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for n, o in rows:
        alone = ", ".join(f"{k} {v:.2f}" for k, v in (o.get("sources_tau") or {}).items()) or "n/a"
        lines.append(f"| {n} | {_fmt(o['tau'])} | {_fmt(o['expected_tau'])} | {_fmt(o['speedup'], '.2f', 'x')} | "
                     f"{_fmt(o['expected_speedup'], '.2f', 'x')} | {_fmt(o.get('expected_vs_measured'), '.2f')} | "
                     f"{alone} | {_fmt(o['oracle_tau'])} | {_fmt(o['oracle_speedup'], '.2f', 'x')} | "
                     f"{_fmt(o['oracle_censored'], 'd')} |")
    lines += ["", "Expected figures are the scheduler's own predictions (over one target forward per token, by the "
              "machine's cost profile and the run's measured draft and loop seconds); the oracle takes, per step, the "
              "better source alone, priced by the same model, so compare oracle speedup with expected speedup."]
    return lines


def write_plots(results: dict[str, Any], out_dir: str | Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out_dir = Path(out_dir)
    written = []
    names = list(results["methods"])
    cats = results["categories"] + (["overall"] if len(results["categories"]) > 1 else [])
    if not cats:
        return written

    def fig_value(name: str, cat: str, key: str):
        m = results["methods"][name]
        f = m["overall"] if cat == "overall" or len(results["categories"]) == 1 else m["categories"][cat]
        return f[key]

    shown = [n for n in names if n != "vanilla"] or names  # vanilla is the dashed line at 1.0
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 0.9 * len(cats) + 3), 7.5), sharex=True)
    width = 0.8 / max(1, len(shown))
    x = np.arange(len(cats))
    for ax, key, title in ((axes[0], "speedup", "Speedup vs vanilla (ratio of tokens/s)"),
                           (axes[1], "tau", "τ: tokens per target forward (accepted + bonus)")):
        for j, n in enumerate(shown):
            vals = [fig_value(n, c, key) for c in cats]
            ys = [v if v is not None else 0 for v in vals]
            bars = ax.bar(x + (j - (len(shown) - 1) / 2) * width, ys, width, label=n)
            for b_, v in zip(bars, vals):
                ax.text(b_.get_x() + b_.get_width() / 2, (v or 0) + 0.01, "n/a" if v is None else f"{v:.2f}",
                        ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="grey", lw=1, ls="--", label="vanilla = 1.00")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.set_ylim(0, max([1.15] + [1.15 * (fig_value(n, c, key) or 0) for n in shown for c in cats]))
    axes[1].set_xticks(x)
    axes[1].set_xticklabels(cats, rotation=30, ha="right")
    axes[0].legend(fontsize=8, loc="upper left", ncol=len(shown) + 1)
    s = results["settings"]
    fig.suptitle(f"{s['target']} · {s['dataset']} · {s['dtype']} · T={s['temperature']} · {results['num_prompts']} "
                 f"prompts · {s['max_new_tokens']} new tokens", fontsize=10)
    fig.tight_layout()
    p = out_dir / "speedup_tau.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    written.append(p.name)

    hists = {n: results["methods"][n]["overall"]["accept_hist"] for n in names}
    hists = {n: h for n, h in hists.items() if h and (n != "vanilla" or len(hists) == 1)}
    if hists:
        kmax = max(int(k) for h in hists.values() for k in h)
        ks = np.arange(1, kmax + 1)
        fig, ax = plt.subplots(figsize=(max(6, 0.5 * kmax + 3), 3.8))
        width = 0.8 / len(hists)
        for j, (n, h) in enumerate(hists.items()):
            tot = sum(h.values())
            ys = [h.get(str(k), 0) / tot for k in ks]
            tau = results["methods"][n]["overall"]["tau"]
            bars = ax.bar(ks + (j - (len(hists) - 1) / 2) * width, ys, width, label=f"{n} (τ={_fmt(tau)})")
            for b_, k in zip(bars, ks):  # counts on top: small shares stay readable
                if h.get(str(k)):
                    ax.text(b_.get_x() + b_.get_width() / 2, b_.get_height() + 0.005, str(h[str(k)]),
                            ha="center", va="bottom", fontsize=6)
        ax.set_xticks(ks)
        ax.set_xlabel("tokens emitted per target forward (accepted + bonus)")
        ax.set_ylabel("share of target forwards")
        ax.set_title("Acceptance-length histogram")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        p = out_dir / "accept_hist.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        written.append(p.name)
    return written


def write_results(results: dict[str, Any], out_dir: Path, plots: Callable[[dict, Path], list[str]],
                  markdown: Callable[[dict], str]) -> None:
    """results.json, results.md and the plots into out_dir (created); a failing plot is logged and skipped."""
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        results["plots"] = plots(results, out_dir)
    except Exception as e:  # a plot must never lose the measurements
        log.warning("plots not written: %s", e)
        results["plots"] = []
    atomic_write_json(out_dir / "results.json", results)
    atomic_write_text(out_dir / "results.md", markdown(results))


def write_outputs(results: dict[str, Any], records: list[RunRecord], out_dir: str | Path) -> None:
    out_dir = Path(out_dir)
    write_results(results, out_dir, write_plots, markdown_table)
    atomic_write_text(out_dir / "outputs.jsonl", "".join(
        json.dumps({"method": r.method, "prompt_id": r.prompt_id, "category": r.category, "turn": r.turn,
                    "new_tokens": r.new_tokens, "time_s": round(r.time_s, 4), "target_forwards": r.target_forwards,
                    "text": r.text}) + "\n" for r in records))


def hf_methods(target, temperature: float) -> dict[str, Callable[[], Method]]:
    return {
        "vanilla": lambda: HFGenerate("vanilla", target, temperature),
        "prompt-lookup": lambda: HFGenerate("prompt-lookup", target, temperature,
                                            prompt_lookup_num_tokens=PROMPT_LOOKUP_NUM_TOKENS,
                                            max_matching_ngram_size=PROMPT_LOOKUP_MAX_NGRAM),
    }


def split_lookup(name: str) -> tuple[str, bool]:
    """'head:eagle3+lookup' -> ('head:eagle3', True); names without the suffix -> (name, False)."""
    return (name[:-len(LOOKUP_SUFFIX)], True) if name.endswith(LOOKUP_SUFFIX) else (name, False)


def is_head_method(name: str) -> bool:
    """head, head:LABEL, and either with +lookup."""
    base, _ = split_lookup(name)
    return base == "head" or (base.startswith("head:") and len(base) > len("head:"))


def is_llamacpp_method(name: str) -> bool:
    from specheads.infer.llamacpp import is_llamacpp_method as check

    return check(name)


def check_method_names(names: list[str]) -> None:
    """One clear error for unknown --methods names (checked before the target loads)."""
    unknown = [n for n in names if n not in KNOWN_METHODS and not is_head_method(n) and not is_llamacpp_method(n)]
    if unknown:
        raise SpecheadsError(f"--methods: unknown method(s) {unknown}; choose from {list(KNOWN_METHODS)} "
                             f"or head:LABEL, with {LOOKUP_SUFFIX} after a head method to schedule a prompt-lookup "
                             "chain with it, "
                             "or llama.cpp, llama.cpp:LABEL, llama.cpp-ngram")


@dataclass
class MethodOptions:
    """What one run's methods are built from (`specheads bench` turns its flags into this)."""

    temperature: float = 0.0
    heads: dict[str, str] = field(default_factory=dict)  # method name -> head folder (`head_entries`)
    tree: str = "auto"  # --tree for every head (treespec: auto, DEPTH,TOP_K,TOTAL, rank paths)
    refresh_profile: bool = False  # measure the cost profile again before `--tree auto`
    head_lookup: int = HEAD_LOOKUP_TOKENS  # tokens of the prompt-lookup chain the +lookup methods merge in
    draft_model: str | None = None  # the draft-model method's model: a name, or truncated:N (the target's N layers)
    draft_tokens: int = 4  # the draft model's chain per step
    threads: int | None = None  # llama.cpp methods: llama-server -t (None = infer/llamacpp.THREADS)
    llamacpp_target: str | None = None  # llama.cpp methods: the target GGUF (None = the target converted, cached)
    llamacpp_draft_max: int | None = None  # llama.cpp:LABEL: --spec-draft-n-max (None = llama.cpp's default, 3)
    llamacpp_p_min: float | None = None  # llama.cpp:LABEL, DSpark: --spec-draft-p-min (None = chosen on calib prompts)

    def __post_init__(self) -> None:
        if not 1 <= self.head_lookup <= MAX_TREE_DEPTH:
            raise SpecheadsError(f"--head-lookup {self.head_lookup}: must be 1..{MAX_TREE_DEPTH} (tokens of the "
                                 "prompt-lookup chain)")


def head_entries(spec) -> dict[str, str]:
    """--head values -> {method name: head folder}. One head is the method `head`; several are `head:LABEL`, with
    LABEL given as LABEL=DIR or else the folder's head kind (eagle3, medusa, ...)."""
    if not spec:
        return {}
    items = [spec] if isinstance(spec, str) else list(spec)
    if len(items) == 1 and "=" not in items[0]:
        return {"head": items[0]}
    out: dict[str, str] = {}
    for it in items:
        label, _, path = it.rpartition("=") if "=" in it else ("", "", it)
        if not label:
            label = _kind_from_folder(path)
        name = f"head:{label}"
        if name in out:
            raise SpecheadsError(f"--head {it}: label {label!r} used twice; name them as LABEL=DIR")
        out[name] = path
    return out


def _kind_from_folder(path: str) -> str:
    from specheads.heads.base import read_head_config

    try:
        return str(read_head_config(Path(path)).kind)
    except SpecheadsError as e:
        raise SpecheadsError(f"--head {path}: no readable head config ({e}); give it as LABEL=DIR") from None


def build_methods(names: list[str], target, options: MethodOptions, calib_ids: list[list[int]] | None = None
                  ) -> tuple[list[Method], dict[str, Any]]:
    """Methods in the order asked (vanilla always included, first), plus extra results fields: the tree chosen
    for each head method and why. `calib_ids`: prompts for the heads' acceptance probe (`--tree auto`)."""
    check_method_names(names)
    names = ["vanilla"] + [n for n in names if n != "vanilla"]  # speedup and identical are measured against it
    if options.temperature > 0 and any(split_lookup(n)[1] or n in UNION_METHODS for n in names):
        raise SpecheadsError(f"--methods {','.join(names)}: {LOOKUP_SUFFIX} and combo methods are greedy only "
                             "(use --temperature 0)")
    expanded: list[str] = []
    for n in names:  # `head` / `head+lookup` stand for every --head given
        base, merged = split_lookup(n)
        expanded += [h + LOOKUP_SUFFIX * merged for h in options.heads] if base == "head" and options.heads else [n]
    factories = hf_methods(target, options.temperature)
    loaded: dict[str, Any] = {}  # head folder -> {"head", and with --tree auto "spec", "tree"}: one load, one probe
    # (and "costs": the cost profile every scheduler of the run is priced by, read once)
    methods: list[Method] = []
    extra: dict[str, Any] = {"methods_info": {}}
    for n in expanded:
        if n in factories:
            m = factories[n]()
        elif n in ("plain", "prompt-lookup-ours", "recycling"):
            m = build_ours_method(n, target, options.temperature)
        elif is_head_method(n):
            base, merged = split_lookup(n)
            if base not in options.heads:
                raise SpecheadsError(f"--methods {n}: no such head; given: "
                                     f"{list(options.heads) or 'none (use --head DIR)'}")
            m, tree = build_head_method(target, options, calib_ids or [], head_dir=options.heads[base], name=base,
                                        lookup=options.head_lookup if merged else 0, loaded=loaded)
            extra.setdefault("trees", {})[m.name] = tree
            extra.setdefault("tree", tree)  # the first head's tree (results.json schema 1)
        elif n in UNION_METHODS:
            m, tree = build_combo_method(target, options, calib_ids or [], loaded, name=n)
            extra.setdefault("trees", {})[m.name] = tree
        elif is_llamacpp_method(n):  # llama-server engines (infer/llamacpp.py)
            from specheads.infer.llamacpp import build_llamacpp_method

            m = build_llamacpp_method(n, target, options, calib_ids)
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


def build_head_method(target, options: MethodOptions, calib_ids: list[list[int]], head_dir: str,
                      name: str = "head", lookup: int = 0, loaded: dict | None = None
                      ) -> tuple[Method, dict[str, Any]]:
    """`head`: our loop with the head's drafter and tree (`--tree auto`: autotree.choose_tree_for_head for tree
    heads, the per-step scheduler for block heads). `lookup` > 0: the head and a prompt-lookup chain of up to that
    many tokens under one per-step scheduler (method NAME+lookup; greedy only). `loaded`: {head folder: ...} shared
    by one run's methods, so that a head's methods load it and run the `--tree auto` probe once."""
    loaded = {} if loaded is None else loaded
    head, spec, tree = head_and_tree(target, options, calib_ids, head_dir, loaded)
    scheduler = run_scheduler(target, options, loaded) if lookup or tree.get("family") == "block" else None
    drafter = build_drafter(target, head, spec, lookup=lookup, lookup_ngram=PROMPT_LOOKUP_MAX_NGRAM,
                            acceptance=acceptance_prior(tree), scheduler=scheduler)
    info: dict[str, Any] = {"implementation": "specheads.infer.generate", "head": str(head_dir),
                            "head_kind": head.config.kind,
                            "tree": {k: tree.get(k) for k in ("total_tokens", "depth", "top_k") if k in tree}}
    if lookup > 0:
        name += LOOKUP_SUFFIX
        info["lookup_tokens"] = lookup
        tree["summary"] = (f"{tree.get('summary', '')} + a prompt-lookup chain of up to {lookup} tokens, one verify "
                           "budget per step (scheduler)")
        tree["scheduler"] = scheduler.record()
    tree["method"] = name
    return OursGenerate(name, target, drafter, options.temperature, info), tree


def head_and_tree(target, options: MethodOptions, calib_ids: list[list[int]], head_dir: str, loaded: dict
                  ) -> tuple[Any, TreeSpec, dict[str, Any]]:
    """(the head, its tree spec, the tree's record), the head loaded and a tree head's `--tree auto` probe run once
    per run (cached in `loaded`)."""
    from specheads.heads.base import load_head

    entry = loaded.setdefault(str(head_dir), {})
    if "head" not in entry:
        entry["head"] = load_head(head_dir, target).eval()
    head = entry["head"]
    kind = drafter_kind(head.config.kind, head=True)
    spec = parse_tree(options.tree, head.config.kind, head)
    if spec.mode == "auto" and kind.family == "block":
        tree = {"mode": "auto", "kind": head.config.kind, "family": kind.family, "reason": SCHEDULER_RULE,
                "summary": f"per-step scheduler over the block of {head.num_drafts} drafts (prefix that pays)",
                "scheduler": run_scheduler(target, options, loaded).record()}
    elif spec.mode == "auto":
        if "spec" not in entry:
            entry["spec"], entry["tree"] = autotree.choose_tree_for_head(target, head, calib_ids,
                                                                         refresh=options.refresh_profile)
        spec, tree = entry["spec"], dict(entry["tree"])
        loaded.setdefault("costs", tree["profile"])  # the profile the probe settled on prices the run's schedulers
    else:
        tree = given_tree_record(head.config.kind, kind.family, spec)
    return head, spec, tree


def acceptance_prior(tree: dict[str, Any]) -> dict[str, Any] | None:
    """A tree head's `--tree auto` probe acceptance (per depth and rank, with counts): its rates' prior under a
    scheduler; None without a probe."""
    acc = tree.get("acceptance")
    return {"acc": acc["acc_monotone"], "counts": acc["counts"]} if acc else None


def run_scheduler(target, options: MethodOptions, loaded: dict) -> Scheduler:
    """A fresh per-step scheduler priced by the run's cost profile: the one a `--tree auto` probe of this run
    settled on, else read (or measured) once per run."""
    if "costs" not in loaded:
        prof = load_or_profile(target, refresh=options.refresh_profile)
        loaded["costs"] = {"verify_relative": prof["verify"]["relative"], "t1_s": t1_seconds(prof),
                           **{k: prof.get(k) for k in ("path", "cached", "noisy", "measured_at")}}
    costs = loaded["costs"]
    return Scheduler(costs["verify_relative"], costs["t1_s"], profile=costs)


def build_combo_method(target, options: MethodOptions, calib_ids: list[list[int]], loaded: dict,
                       name: str = "combo") -> tuple[Method, dict[str, Any]]:
    """`combo`: every --head and a prompt-lookup chain of --head-lookup tokens under one per-step scheduler (each
    head's draft pass is paid every step and priced by the measured drafter seconds); `combo+recycling`: Token
    Recycling's tree as one more source; `lookup+recycling`: the two training-free sources alone. Greedy only."""
    heads = {} if name == "lookup+recycling" else options.heads
    if name != "lookup+recycling" and not heads:
        raise SpecheadsError(f"--methods {name}: needs --head DIR (one or more)")
    scheduler = run_scheduler(target, options, loaded)
    drafters, priors, parts = [], [], {}
    for label, head_dir in heads.items():
        head, spec, tree = head_and_tree(target, options, calib_ids, head_dir, loaded)
        drafters.append(build_drafter(target, head, spec, scheduler=scheduler))
        priors.append(acceptance_prior(tree))
        parts[label] = tree.get("summary", "")
    if name.endswith("+recycling"):
        drafters.append(build_drafter(target, "recycling"))
        priors.append(None)
        parts["recycling"] = "Token Recycling, Medusa's default 25-node tree"
    drafter = combine_drafters(target, drafters, lookup=options.head_lookup, lookup_ngram=PROMPT_LOOKUP_MAX_NGRAM,
                               acceptances=priors, scheduler=scheduler)
    summary = (f"{' + '.join(f'{k} ({v})' for k, v in parts.items())} + a prompt-lookup chain of up to "
               f"{options.head_lookup} tokens, one verify budget per step (scheduler)")
    tree = {"mode": "combo", "method": name, "summary": summary, "reason": SCHEDULER_RULE,
            "sources": drafter.names, "scheduler": scheduler.record()}
    info = {"implementation": "specheads.infer.generate + ScheduledUnionDrafter", "heads": dict(heads),
            "lookup_tokens": options.head_lookup, "sources": drafter.names}
    return OursGenerate(name, target, drafter, options.temperature, info), tree


def given_tree_record(kind: str, family: str, spec: TreeSpec) -> dict[str, Any]:
    """results.json's record of a tree given with --tree."""
    tree: dict[str, Any] = {"mode": spec.text, "kind": kind, "family": family, "reason": "given with --tree",
                            "summary": f"{spec.summary()} (given)"}
    if spec.mode == "dynamic":
        tree.update(total_tokens=spec.total_tokens, depth=spec.depth, top_k=spec.top_k)
    elif spec.mode == "static":
        tree.update(choices=[list(c) for c in spec.choices], total_tokens=len(spec.choices))
    return tree


def build_draft_model_method(target, options: MethodOptions) -> Method:
    """`draft-model`: our loop with a small causal LM drafting a chain. --draft-model NAME (loaded like a target,
    same dtype; must share the vocabulary) or truncated:N (the target's first N layers, no training)."""
    spec = options.draft_model
    if not spec:
        raise SpecheadsError("--methods draft-model: needs --draft-model NAME (or truncated:N)")
    chain = parse_tree(str(options.draft_tokens), "draft-model", flag="--draft-tokens")
    layers = {}
    if spec.startswith("truncated:"):
        n = spec.split(":", 1)[1]
        if not n.strip().isdigit() or not 1 <= int(n) < target.num_layers:
            raise SpecheadsError(f"--draft-model {spec!r}: expected truncated:N with N layers, 1..{target.num_layers - 1}")
        layers = {"draft_layers": int(n)}
    drafter = build_drafter(target, "draft-model", chain, draft_target=None if layers else spec, **layers)
    info = {"implementation": "specheads.infer.generate + DraftModelDrafter", "draft_model": spec,
            "draft_tokens": chain.num_tokens}
    return OursGenerate("draft-model", target, drafter, options.temperature, info)

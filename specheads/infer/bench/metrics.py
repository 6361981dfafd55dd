"""The figures of a single bench run, as pure functions of the records (tested on hand-made runs).

- tokens/s = total new tokens / total wall time of the generate calls (prefill included) over the prompts;
- τ = total new tokens / total target forwards that emit tokens (bonus included), so plain decoding is exactly
  1.00: HF generate's prefill forward emits the first token and counts; our loop's prefill only fills the cache
  (the first token comes from the first tree forward) and does not; None ("n/a") when forwards cannot be counted;
- speedup = tokens/s of the method / tokens/s of vanilla over the same prompts (a ratio of totals, not a mean of
  per-prompt ratios, so long answers weigh more, as in Spec-Bench);
- acceptance-length histogram: how many target forwards emitted 1, 2, 3, ... tokens (its mean is τ);
- identical (greedy only): share of prompt turns whose output token ids equal vanilla's exactly;
- expected speedup (scheduled methods: DSpark `--tree auto`, +lookup, combo): Σ expected τ / Σ expected step cost
  in one-token target forwards, the per-step scheduler's own prediction (infer/scheduling/step.py), beside the measured
  speedup; the oracle: per step the better of the sources alone (head alone, lookup alone), priced by the same
  cost model (`oracle_tau`, `oracle_speedup`);
- speedup vs plain (with `plain` in the run): tokens/s of the method / tokens/s of `plain` (our loop drafting
  nothing, one target forward per token): the baseline the expected speedup predicts against, so expected / measured
  divides the predicted speedup over plain by the measured one over plain (None without plain: never a speedup over
  vanilla, which carries HF generate's own loop).
"""
from __future__ import annotations

from collections import Counter
from typing import Any

from specheads.infer.bench.records import RunRecord

DEFINITIONS = {
    "tokens_per_s": "total new tokens / total wall time of the generate calls (prefill included)",
    "tau": "total new tokens / total target forwards that emit tokens (bonus included; HF's prefill emits the first "
           "token and counts, our prefill only fills the cache and does not); vanilla = 1.00",
    "speedup": "tokens_per_s(method) / tokens_per_s(vanilla) over the same prompts (ratio of totals)",
    "speedup_vs_plain": "with plain in the run: tokens_per_s(method) / tokens_per_s(plain) over the same prompts "
                        "(plain = our loop drafting nothing, one target forward per token)",
    "accept_hist": "number of target forwards that emitted k tokens (k = accepted draft tokens + 1 bonus)",
    "identical": "greedy runs only: share of prompt turns whose output token ids equal vanilla's",
    "expected_tau": "scheduled methods: the scheduler's expected tokens per step, Σ (1 + Σ p over verified nodes) / "
                    "scheduled steps",
    "expected_speedup": "scheduled methods: Σ expected τ / Σ expected step cost (t(n)/t(1) + drafters' and loop's "
                        "measured seconds / t(1)), i.e. the predicted speedup over one target forward per token",
    "expected_vs_measured": "expected_speedup / speedup_vs_plain: both over plain (n/a without plain in the run)",
    "sources_tau": "greedy unions: per source, Σ tokens its own proposal alone would have emitted / the steps it "
                   "proposed on (a source whose pass does not pay rests; the target's argmax is known along every "
                   "emitted path)",
    "oracle_tau": "per step the better source alone (more tokens; equal: cheaper), Σ its tokens / steps, on the "
                  "method's own steps (a lower bound where censored)",
    "oracle_speedup": "the oracle's Σ tokens / Σ its own step costs (its source's tree verified alone + its draft + "
                      "the loop, by the scheduler's cost model): comparable with expected_speedup",
    "oracle_censored": "steps where the better source matched every emitted token and proposed deeper (the "
                       "scheduler cut it): its figure there is a lower bound",
    "ttft_ms": "our loop's methods (step breakdown): the mean prefill per turn plus one mean step, the first token "
               "coming from the first step after the prefill",
}
# phases (specheads.infer.generate stats.timings) that are model forwards; the rest is our loop's own work
MODEL_PHASES = {"draft", "target"}
NOT_STEP_PHASES = {"prefill"}


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b; None when either is unknown or b is 0."""
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
        "tokens_per_s": ratio(tokens, time_s),
        "target_forwards": fw,
        "tau": ratio(tokens, fw) if fw else None,
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
    out.update(expected_tau=tau / steps, expected_speedup=ratio(tau, cost))
    sources: Counter = Counter()
    source_steps: Counter = Counter()  # steps each source proposed on (a resting source sits some out)
    for s in recs:
        sources.update(s.get("source_tokens") or {})
        source_steps.update(s.get("source_steps") or {})
    if sources:
        oracle = sum(s["oracle_tokens"] for s in recs)
        out.update(sources_tau={k: v / (source_steps.get(k) or steps) for k, v in sorted(sources.items())},
                   oracle_tau=oracle / steps,
                   oracle_speedup=ratio(oracle, sum(s["oracle_cost_sum"] for s in recs)),
                   oracle_censored=sum(s["oracle_censored"] for s in recs))
    return out


def compare(method_records: list[RunRecord], vanilla_records: list[RunRecord] | None, greedy: bool,
            plain_records: list[RunRecord] | None = None) -> dict[str, Any]:
    """`summarize` plus speedup against vanilla, (greedy) the identical share, matched by (prompt, turn), and with
    plain records the speedup against plain and expected / measured, both over plain (the same baseline)."""
    s = summarize(method_records)
    s["speedup"] = None
    s["speedup_vs_plain"] = None
    s["identical"] = None
    s["expected_vs_measured"] = None
    if plain_records:
        s["speedup_vs_plain"] = ratio(s["tokens_per_s"], summarize(plain_records)["tokens_per_s"])
        s["expected_vs_measured"] = ratio(s["expected_speedup"], s["speedup_vs_plain"])
    if vanilla_records:
        s["speedup"] = ratio(s["tokens_per_s"], summarize(vanilla_records)["tokens_per_s"])
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
    ms_step = (1000 * step_s / forwards) if forwards else None
    prefill_ms = 1000 * total["prefill"] / len(recs) if "prefill" in total else None
    # our loop's first token comes from the first step after the prefill: time to first token = the prefill and
    # one step (priced at the mean step)
    ttft = prefill_ms + ms_step if prefill_ms is not None and ms_step is not None else None
    return {"seconds": {k: round(v, 6) for k, v in total.items()}, "step_share": shares,
            "model_phases": model_keys, "non_model_share": (1 - model / step_s) if step_s else None,
            "ms_per_step": ms_step, "prefill_ms_per_turn": prefill_ms, "ttft_ms": ttft}

"""The results of a single bench run: results.json (schema `specheads.bench/1`: figures per method, overall and
per category, against vanilla, with `plain` in the run against plain too (`speedup_vs_plain`, the baseline the
scheduler's expected speedup predicts against), and with `llama.cpp` in the run against it) and results.md (tables;
a results.json written before `speedup_vs_plain` renders without the vs plain column);
`write_results` writes both with the plots (the batched sweep's report, bench/batch.py, uses it and `fmt` too).
"""
from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from specheads.infer.bench.metrics import DEFINITIONS, compare, ratio, step_breakdown
from specheads.infer.bench.records import BenchSettings, RunRecord
from specheads.prompts import MT_BENCH_CATEGORIES
from specheads.utils import atomic_write_json, atomic_write_text

log = logging.getLogger(__name__)

SCHEMA = "specheads.bench/1"
_CAT_ORDER = {c: i for i, c in enumerate(MT_BENCH_CATEGORIES)}


def build_results(records: list[RunRecord], names: list[str], settings: BenchSettings, meta: dict[str, Any],
                  complete: bool) -> dict[str, Any]:
    """results.json of a single run: per method its figures overall and per category (MT-bench's order first)
    against vanilla and (with `plain` in the run) plain, its step breakdown, and with `llama.cpp` in the run its
    figures against llama.cpp."""
    greedy = settings.temperature <= 0
    van = [r for r in records if r.method == "vanilla"]
    plain = [r for r in records if r.method == "plain"]
    cats = sorted({r.category for r in records}, key=lambda c: (c not in _CAT_ORDER, _CAT_ORDER.get(c, 0), c))
    methods_out: dict[str, Any] = {}
    for name in names:
        mine = [r for r in records if r.method == name]
        overall = compare(mine, van or None, greedy, plain or None)
        per_cat = {c: compare([r for r in mine if r.category == c], [r for r in van if r.category == c] or None,
                              greedy, [r for r in plain if r.category == c] or None) for c in cats}
        methods_out[name] = {"overall": overall, "categories": per_cat, "step_breakdown": step_breakdown(mine)}
        ref = [r for r in records if r.method == "llama.cpp"]  # the second reference: llama.cpp plain decoding
        if ref and name != "llama.cpp":
            methods_out[name]["vs_llama.cpp"] = compare(mine, ref, greedy)
    return {"schema": SCHEMA, **meta, "settings": asdict(settings), "complete": complete, "definitions": DEFINITIONS,
            "num_prompts": len({r.prompt_id for r in records}), "categories": cats, "methods": methods_out}


def fmt(x: Any, spec: str = ".2f", suffix: str = "") -> str:
    """A figure as results.md shows it: n/a when unknown."""
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def llamacpp_table(results: dict[str, Any]) -> list[str]:
    """With `llama.cpp` in the run: every method against llama.cpp plain, the second reference beside vanilla."""
    rows = [(n, m["vs_llama.cpp"]) for n, m in results["methods"].items() if m.get("vs_llama.cpp")]
    if not rows:
        return []
    lines = ["", "## Against llama.cpp plain decoding (same prompts, same run)", "",
             "| method | tokens/s | speedup over llama.cpp | identical to llama.cpp |", "|---|---:|---:|---:|"]
    for name, v in rows:
        lines.append(f"| {name} | {fmt(v['tokens_per_s'], '.1f')} | {fmt(v['speedup'], '.2f', 'x')} | "
                     f"{fmt(v['identical'], '.0%')} |")
    return lines


def header_lines(results: dict[str, Any], title: str, unit: str, device: str) -> list[str]:
    """results.md's title and run line, single runs and the batched sweep alike (unit: turn | row)."""
    s, env = results["settings"], results.get("environment", {})
    source = results.get("target_source")  # what the target decodes (Target.describe); older results lack it
    return [f"# {title}: {s['target']} on {s['dataset']}", "",
            f"{results['num_prompts']} prompts, dtype {s['dtype']}, temperature {s['temperature']}, max "
            f"{s['max_new_tokens']} new tokens per {unit}, {device} ({env.get('torch_threads')} threads), "
            f"{results.get('date', '')}." + ("" if results.get("complete") else " **Incomplete run (interrupted).**"),
            ""] + ([f"Target decoded: {source}.", ""] if source else [])


def has_vs_plain(results: dict[str, Any]) -> bool:
    """Whether `plain` ran and the results carry speedups over it (a results.json written before them does not)."""
    return any(m["overall"].get("speedup_vs_plain") is not None for m in results["methods"].values())


def main_table(results: dict[str, Any]) -> list[str]:
    """results.md's first table: every method's figures, its speedup over vanilla (HF generate) and, with `plain`
    in the run, over plain beside it (the baseline of the expected column)."""
    plain = has_vs_plain(results)
    vs = " vs plain |" if plain else ""
    lines = [f"| method | tokens/s | τ | speedup |{vs} expected | identical | new tokens | target forwards |",
             "|---|---:|---:|---:|" + ("---:|" if plain else "") + "---:|---:|---:|---:|"]
    for name, m in results["methods"].items():
        o = m["overall"]
        cell = f" {fmt(o.get('speedup_vs_plain'), '.2f', 'x')} |" if plain else ""
        lines.append(f"| {name} | {fmt(o['tokens_per_s'], '.1f')} | {fmt(o['tau'])} | {fmt(o['speedup'], '.2f', 'x')}"
                     f" |{cell} {fmt(o.get('expected_speedup'), '.2f', 'x')} | {fmt(o['identical'], '.0%')} | "
                     f"{o['new_tokens']} | {fmt(o['target_forwards'], 'd')} |")
    if plain:
        lines += ["", "speedup: over vanilla (HF generate); vs plain: over plain (our loop drafting nothing), the "
                      "baseline the expected speedup predicts against."]
    return lines


def markdown_table(results: dict[str, Any]) -> str:
    lines = header_lines(results, "specheads bench", "turn", results["environment"]["cpu"] or "unknown CPU")
    lines += main_table(results)
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
                cells.append(f"{fmt(f['speedup'], '.2f', 'x')} / {fmt(f['tau'])}")
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
    for name, m in results["methods"].items():
        b = m.get("step_breakdown")
        if b:
            lines += ["", f"## Step time breakdown: {name} ({fmt(b['ms_per_step'], '.1f')} ms per step, prefill "
                          f"{fmt(b.get('prefill_ms_per_turn'), '.0f')} ms per turn, time to first token "
                          f"{fmt(b.get('ttft_ms'), '.0f')} ms)", "",
                      "| phase | seconds | share of steps |", "|---|---:|---:|"]
            for k, v in sorted(b["seconds"].items(), key=lambda kv: -kv[1]):
                lines.append(f"| {k} | {v:.3f} | {fmt(b['step_share'].get(k), '.1%')} |")
            lines.append(f"| **non-model share** (all but {' + '.join(b['model_phases'])}) | | "
                         f"{fmt(b['non_model_share'], '.1%')} |")
    trees = results.get("trees") or ({"head": results["tree"]} if results.get("tree") else {})
    for name, tree in trees.items():
        title = "Tree" if len(trees) == 1 else f"Tree: {name}"
        lines += ["", f"## {title}", "", f"{tree.get('summary', '')}", "", f"Why: {tree.get('reason', '')}"]
    lines += definitions_lines(results)
    return "\n".join(lines)


def schedule_table(results: dict[str, Any]) -> list[str]:
    """results.md's scheduler section: expected against measured per scheduled method, each source alone and the
    oracle on the same steps."""
    rows = [(n, m["overall"]) for n, m in results["methods"].items() if m["overall"].get("expected_tau") is not None]
    if not rows:
        return []
    lines = ["", "## Scheduler: expected against measured, each source alone, the oracle", "",
             "| method | τ | expected τ | speedup vs plain | expected speedup | expected / measured | alone τ (same "
             "steps) | oracle τ | oracle speedup (est.) | censored steps |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for n, o in rows:
        alone = ", ".join(f"{k} {v:.2f}" for k, v in (o.get("sources_tau") or {}).items()) or "n/a"
        # both over plain; a results.json from before speedup_vs_plain divided by a speedup over vanilla: n/a
        measured = o.get("speedup_vs_plain")
        lines.append(f"| {n} | {fmt(o['tau'])} | {fmt(o['expected_tau'])} | {fmt(measured, '.2f', 'x')} | "
                     f"{fmt(o['expected_speedup'], '.2f', 'x')} | {fmt(ratio(o['expected_speedup'], measured), '.2f')}"
                     f" | {alone} | {fmt(o['oracle_tau'])} | {fmt(o['oracle_speedup'], '.2f', 'x')} | "
                     f"{fmt(o['oracle_censored'], 'd')} |")
    lines += ["", "Expected figures are the scheduler's own predictions (over one target forward per token, by the "
              "machine's cost profile and the run's measured draft and loop seconds); the oracle takes, per step, the "
              "better source alone, priced by the same model, so compare oracle speedup with expected speedup. Measured "
              "and expected are both over plain (our loop drafting nothing): n/a where plain did not run (add it to "
              "--methods)."]
    return lines


def definitions_lines(results: dict[str, Any]) -> list[str]:
    """results.md's last line: every figure's definition (results["definitions"])."""
    return ["", "Definitions: " + "; ".join(f"**{k}** = {v}" for k, v in results["definitions"].items()) + ".", ""]


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

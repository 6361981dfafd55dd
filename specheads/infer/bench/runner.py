"""The one runner of `specheads bench`, single and batched: every method on every unit of work (a prompt, or a chunk
of B prompts), the methods alternated unit by unit (the starting method rotated), after an untimed warm-up;
results.json is rewritten after every unit, and Ctrl-C or SIGTERM keeps the finished units (results["complete"] =
False, results["interrupted"] = True, results["interrupted_by"] = the signal's name: the command then ends with
`interrupted_exit`, the CLI's one line and exit 128 + signal). `run_bench` is the single run (a unit = one prompt, every turn of it); the batched
sweep's units are built in bench/batch.py.
"""
from __future__ import annotations

import datetime as _dt
import json
import logging
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from tqdm.auto import tqdm

from specheads.infer.bench.plots import write_plots
from specheads.infer.bench.records import BenchSettings, Method, RunRecord
from specheads.infer.bench.report import build_results, markdown_table, write_results
from specheads.prompts import BenchPrompt, encode_turn
from specheads.runinfo import command_line, environment
from specheads.utils import Interrupted, SpecheadsError, atomic_write_json, atomic_write_text

log = logging.getLogger(__name__)


@dataclass
class Unit:
    """One unit of work: `run(method)` -> that method's records on it; `warmup(method)`, when set, runs untimed
    before the unit (every method, in the given order); `index` rotates the starting method."""

    run: Callable[[Any], list]
    size: int  # progress-bar steps (turns, rows)
    index: int
    warmup: Callable[[Any], None] | None = None


def run_meta(extra: dict[str, Any] | None) -> dict[str, Any]:
    """What every results.json starts with: the command as typed, the date, the machine, and the run's extras."""
    return {"command": command_line(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "environment": environment(), **(extra or {})}


def run_units(units: Sequence[Unit], methods: Sequence, build: Callable[[list, bool], dict[str, Any]],
              out_dir: str | Path | None, bar: dict[str, Any], what: str, progress: bool = True
              ) -> tuple[list, dict[str, Any]]:
    """Every method on every unit, rotated; a unit's records count only when every method finished it. After each
    unit `build(records, False)` is written to out_dir/results.json. `bar`: the progress bar's total, desc and
    unit; `what`: the units' name in the interrupt notice. Returns (records, results), results["interrupted"]
    set (and, when it is, results["interrupted_by"]: "SIGINT" or "SIGTERM")."""
    records: list = []
    complete = False
    interrupted: int | None = None  # the signal that stopped it
    finished = 0
    pbar = tqdm(**bar, disable=not progress)
    try:
        for unit in units:
            for m in methods if unit.warmup is not None else ():
                unit.warmup(m)
            k = unit.index % len(methods)
            done: list = []
            for m in list(methods[k:]) + list(methods[:k]):
                done += unit.run(m)
            records += done
            finished += 1
            pbar.update(unit.size)
            if out_dir is not None:
                atomic_write_json(Path(out_dir) / "results.json", build(records, False))
        complete = True
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (utils.Interrupted, raised by the CLI's handler)
        interrupted = int(getattr(e, "signum", signal.SIGINT))  # a plain KeyboardInterrupt is Ctrl-C's
        log.debug("interrupted: keeping the %d finished %s", finished, what)  # the CLI's last line says it
    finally:
        pbar.close()
    results = build(records, complete)
    results["interrupted"] = interrupted is not None
    if interrupted is not None:
        results["interrupted_by"] = signal.Signals(interrupted).name
    return records, results


def interrupted_exit(results: dict[str, Any], out_dir: str | Path | None, what: str) -> int:
    """A command's exit after run_units: 0 when it ran to its end; after a signal (its outputs written),
    Interrupted with that signal, so the CLI ends as every command does on one (one line, exit 128 + signal)."""
    if not results.get("interrupted"):
        return 0
    where = f" in {Path(out_dir) / 'results.json'} (complete: false)" if out_dir is not None else ""
    raise Interrupted(signal.Signals[results.get("interrupted_by", "SIGINT")], f"the finished {what} are kept{where}")


def run_bench(prompts: list[BenchPrompt], methods: list[Method], settings: BenchSettings, tokenizer,
              out_dir: str | Path | None = None, extra: dict[str, Any] | None = None,
              progress: bool = True) -> dict[str, Any]:
    """Run every method on every prompt (methods alternated prompt by prompt, starting method rotated), after one
    untimed warm-up per method on the first prompt. Writes results.json after every prompt; Ctrl-C keeps finished
    prompts (results["complete"] = False). Returns the results dict."""
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise SpecheadsError(f"--methods: duplicate method in {names}")
    meta = run_meta(extra)
    units = [Unit(run=lambda m, i=i, p=p: _run_prompt(m, p, i, settings, tokenizer), size=len(p.turns), index=i)
             for i, p in enumerate(prompts)]
    if units and settings.warmup_tokens > 0:
        warm = encode_turn(tokenizer, prompts[0], 0, [])
        units[0].warmup = lambda m: m.generate(warm, settings.warmup_tokens)
    records, results = run_units(units, methods, lambda recs, done: build_results(recs, names, settings, meta, done),
                                 out_dir, {"total": sum(len(p.turns) for p in prompts), "desc": "bench",
                                           "unit": "turn"}, "prompts", progress)
    if out_dir is not None:
        write_outputs(results, records, out_dir)
    results["stopped_at_window"] = sum(r.stop_reason == "context_window" for r in records)  # turns, every method
    return results


def _run_prompt(m: Method, p: BenchPrompt, i: int, settings: BenchSettings, tokenizer) -> list[RunRecord]:
    """One method on every turn of prompt i, each turn after the method's own earlier answers, seeded alike for
    every method."""
    answers: list[str] = []
    out: list[RunRecord] = []
    for turn in range(len(p.turns)):
        ids = encode_turn(tokenizer, p, turn, answers)
        torch.manual_seed(settings.seed + 1000 * i + turn)  # same seed for every method
        try:
            r = m.generate(ids, settings.max_new_tokens)
        except SpecheadsError as e:  # a later turn (its own earlier answers) past the context window, say
            raise SpecheadsError(f"prompt {p.id} turn {turn + 1} ({m.name}): {e}") from None
        r.prompt_id, r.category, r.turn = p.id, p.category, turn
        out.append(r)
        answers.append(r.text)
    return out


def write_outputs(results: dict[str, Any], records: list[RunRecord], out_dir: str | Path) -> None:
    """results.json, results.md, the plots and outputs.jsonl (every turn's text and counts) into out_dir."""
    out_dir = Path(out_dir)
    write_results(results, out_dir, write_plots, markdown_table)
    atomic_write_text(out_dir / "outputs.jsonl", "".join(
        json.dumps({"method": r.method, "prompt_id": r.prompt_id, "category": r.category, "turn": r.turn,
                    "new_tokens": r.new_tokens, "time_s": round(r.time_s, 4), "target_forwards": r.target_forwards,
                    "stop_reason": r.stop_reason, "text": r.text}) + "\n" for r in records))

"""Like with like in the bench's report: with `plain` in the run every method gets its speedup over plain beside the
one over vanilla (HF generate), and the scheduler's expected / measured divides a predicted speedup over plain by a
measured one over plain, never over vanilla. Hand-made records, figures worked out by hand; results.json files
written before these fields render without them (the committed runs)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from specheads.infer.bench import BenchSettings, RunRecord, build_results, compare, markdown_table
from specheads.infer.bench.report import has_vs_plain

ROOT = Path(__file__).resolve().parents[1]
META = {"command": "x", "date": "d", "environment": {"cpu": "cpu", "torch_threads": 2}}


def rec(method, pid, tokens, time_s, steps, cat="writing"):
    return RunRecord(method=method, prompt_id=pid, category=cat, turn=0, prompt_tokens=10, new_tokens=tokens,
                     time_s=time_s, target_forwards=len(steps), step_tokens=steps, output_ids=list(range(tokens)))


def scheduled(pid, time_s, tau_sum, cost_sum, cat="writing"):
    r = rec("m", pid, 10, time_s, [2] * 5, cat)
    r.schedule = {"scheduled_steps": 5, "expected_tau_sum": tau_sum, "expected_cost_sum": cost_sum,
                  "source_tokens": {"head": 7, "lookup": 7}, "oracle_tokens": 10, "oracle_cost_sum": 5.0,
                  "oracle_censored": 0}
    return r


def run_records():
    """vanilla 20 tokens in 4.0 s (5 tok/s); plain 20 in 2.0 s (10 tok/s, 2x vanilla); m 20 in 1.25 s (16 tok/s:
    3.2x vanilla, 1.6x plain), its scheduler expecting Σ τ 20 / Σ cost 10 = 2.0x over one forward per token."""
    van = [rec("vanilla", "a", 10, 2.0, [1] * 10), rec("vanilla", "b", 10, 2.0, [1] * 10, "math")]
    plain = [rec("plain", "a", 10, 1.0, [1] * 10), rec("plain", "b", 10, 1.0, [1] * 10, "math")]
    m = [scheduled("a", 0.5, 11.0, 5.0), scheduled("b", 0.75, 9.0, 5.0, "math")]
    return van + plain + m


def results(with_plain=True):
    recs = [r for r in run_records() if with_plain or r.method != "plain"]
    names = ["vanilla", "plain", "m"] if with_plain else ["vanilla", "m"]
    return build_results(recs, names, BenchSettings("t", "mt-bench", "float32"), META, True)


def test_expected_over_measured_divides_over_the_same_baseline():
    recs = run_records()
    van, plain, m = ([r for r in recs if r.method == n] for n in ("vanilla", "plain", "m"))
    s = compare(m, van, True, plain)
    assert s["speedup"] == pytest.approx(3.2) and s["speedup_vs_plain"] == pytest.approx(1.6)
    assert s["expected_speedup"] == pytest.approx(2.0)
    assert s["expected_vs_measured"] == pytest.approx(1.25)  # 2.0 / 1.6; over vanilla it would read 2.0 / 3.2
    without = compare(m, van, True)
    assert without["speedup_vs_plain"] is None and without["expected_vs_measured"] is None  # never a mixed ratio
    assert compare(plain, van, True, plain)["speedup_vs_plain"] == pytest.approx(1.0)


def test_main_table_has_vs_plain_beside_speedup():
    res = results()
    md = markdown_table(res)
    assert "| method | tokens/s | τ | speedup | vs plain | expected | identical | new tokens | target forwards |" in md
    assert "| vanilla | 5.0 | 1.00 | 1.00x | 0.50x | n/a | 100% | 20 | 20 |" in md
    assert "| plain | 10.0 | 1.00 | 2.00x | 1.00x | n/a | 100% | 20 | 20 |" in md
    assert "| m | 16.0 | 2.00 | 3.20x | 1.60x | 2.00x | 100% | 20 | 10 |" in md
    assert "vs plain: over plain (our loop drafting nothing)" in md
    per_cat = res["methods"]["m"]["categories"]  # a: 10 / 0.5 s over 10 / 1.0 s; b: 10 / 0.75 s over 10 / 1.0 s
    assert per_cat["writing"]["speedup_vs_plain"] == pytest.approx(2.0)
    assert per_cat["math"]["speedup_vs_plain"] == pytest.approx(4 / 3)


def test_scheduler_table_states_both_over_plain():
    md = markdown_table(results())
    assert "| method | τ | expected τ | speedup vs plain | expected speedup | expected / measured |" in md
    assert "| m | 2.00 | 2.00 | 1.60x | 2.00x | 1.25 | head 1.40, lookup 1.40 | 2.00 | 2.00x | 0 |" in md


def test_without_plain_no_column_and_no_mixed_ratio():
    res = results(with_plain=False)
    md = markdown_table(res)
    assert not has_vs_plain(res) and "vs plain |" not in md.split("## Scheduler")[0]
    assert "| m | 16.0 | 2.00 | 3.20x | 2.00x | 100% | 20 | 10 |" in md
    assert "| m | 2.00 | 2.00 | n/a | 2.00x | n/a |" in md  # not 2.0 / 3.2
    assert "add it to --methods" in md


def test_old_results_without_the_new_fields_render():
    """A results.json from before speedup_vs_plain (plain in the run, the stored expected_vs_measured over vanilla):
    the main table keeps its old columns, the scheduler's measured and ratio read n/a, not the stored mixed figure."""
    res = copy.deepcopy(results())
    for m in res["methods"].values():
        for f in [m["overall"], *m["categories"].values()]:
            f.pop("speedup_vs_plain")
            f["expected_vs_measured"] = 0.625 if f.get("expected_speedup") else None
    md = markdown_table(res)
    assert "| method | tokens/s | τ | speedup | expected | identical | new tokens | target forwards |" in md
    assert "| m | 16.0 | 2.00 | 3.20x | 2.00x | 100% | 20 | 10 |" in md
    assert "| m | 2.00 | 2.00 | n/a | 2.00x | n/a |" in md and "0.62" not in md


@pytest.mark.parametrize("run", ["engine-80", "exactness-fp32-dspark", "demo-fresh-epyc"])
def test_committed_results_render_with_their_own_main_table_header(run):
    """The committed runs (left as they are) still render, their main table's header the one results.md holds."""
    docs = ROOT / "docs" / "results" / run
    res = json.loads((docs / "results.json").read_text())
    md = markdown_table(res)
    header = next(line for line in (docs / "results.md").read_text().splitlines() if line.startswith("| method |"))
    assert header == next(line for line in md.splitlines() if line.startswith("| method |"))


def test_results_header_says_which_target_file_it_decodes():
    res = results()
    assert "Target decoded" not in markdown_table(res)  # older runs: no such field, no line
    res["target_source"] = "smollm2-135m (SmolLM2-135M-Instruct.Q4_1.gguf dequantised to bfloat16)"
    lines = markdown_table(res).splitlines()
    assert "Target decoded: smollm2-135m (SmolLM2-135M-Instruct.Q4_1.gguf dequantised to bfloat16)." in lines[:8]

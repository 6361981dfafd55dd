"""docs/reliability.md stays true: it is rendered from docs/reliability.json, which holds one row per case of
scripts/reliability_sweep.py, and a sample of the cases run again here gives the recorded messages exactly (the kill
cases, minutes of processes, run in tests/test_kill9.py)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ["override with a bad number", "other data into a prepared run", "crafted pickles in the newest checkpoint",
          "--out is the run folder holding the head", "hidden_size as a string", "weights changed after saving",
          "run folder locked by a live process", "flipped byte in a checkpoint's model.safetensors",
          "export --out . (the current folder)", "quota exceeded (EDQUOT) at fsync during export",
          "file too large (ulimit -f) during export", "non-UTF-8 bytes in row 1 of a JSONL dataset",
          "export --force --out RUN while train runs in RUN", "verbatim YAML tag in an override",
          "GGUF target that is not GGUF", "checkpoint whose checksums.sha256 was removed"]


def _sweep():
    spec = importlib.util.spec_from_file_location("reliability_sweep", ROOT / "scripts" / "reliability_sweep.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def recorded():
    return json.loads((ROOT / "docs" / "reliability.json").read_text())


def test_page_is_rendered_from_the_recorded_rows_of_every_case(recorded):
    sweep = _sweep()
    assert [(r["area"], r["name"]) for r in recorded] == [(c["area"], c["name"]) for c in sweep.CASES], \
        "cases and docs/reliability.json differ: run `python scripts/reliability_sweep.py`"
    assert all(r["ok"] or r["open"] for r in recorded), [r["name"] for r in recorded if not r["ok"]]
    assert (ROOT / "docs" / "reliability.md").read_text() == sweep.render_markdown(recorded)


def test_every_class_of_failure_is_tried(recorded):
    """At least 110 cases, each with its expected and observed outcome and a class the table counts; a case that
    still fails says why (`open`), and one that passes carries no such mark."""
    sweep = _sweep()
    assert len(recorded) >= 110
    assert {r["risk"] for r in recorded} == set(sweep.RISKS)
    assert all(r["expected"] and "expected_rc" in r and "message" in r for r in recorded)
    assert [r["name"] for r in recorded if r["ok"] and r["open"]] == [], "fixed: remove the case's `open` mark"
    page = (ROOT / "docs" / "reliability.md").read_text()
    for risk in sweep.RISKS:
        rows = [r for r in recorded if r["risk"] == risk]
        assert f"| {risk} | {len(rows)} | {sum(r['ok'] for r in rows)} |" in page


def test_a_rerun_of_some_cases_merges_into_the_recorded_rows(recorded):
    """`--only WORD --update`: the rows run replace theirs, every other case keeps its recorded row, in the cases'
    order; a case with no row at all is refused, naming it."""
    sweep = _sweep()
    again = [dict(recorded[3], message="new"), dict(recorded[0], message="newer")]
    merged = sweep.merge_rows(recorded, again, sweep.CASES)
    assert [(r["area"], r["name"]) for r in merged] == [(c["area"], c["name"]) for c in sweep.CASES]
    assert [r["message"] for r in merged[:4]] == ["newer", recorded[1]["message"], recorded[2]["message"], "new"]
    assert merged[4:] == recorded[4:]
    with pytest.raises(SystemExit, match="no recorded row for .'hidden_size as a string'"):
        sweep.merge_rows([r for r in recorded if r["name"] != "hidden_size as a string"], again, sweep.CASES)


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    """The sweep's shared fixtures (tiny target, prepared and trained runs), built once for this module."""
    base = tmp_path_factory.mktemp("sweep")
    _sweep().build_fixtures(base)
    return base


def test_the_fixture_run_trains(fixtures):
    """The resume and checkpoint cases run on the fixture's trained run: its loss is not 0 and every trainable
    tensor of the head changes between its two checkpoints (the target's random lm_head once put every row outside
    the 64-token draft vocabulary: loss 0.0000, weights never moved, and resuming them proved nothing)."""
    import torch
    from safetensors.torch import load_file

    summary = json.loads((fixtures / "trained" / "train_summary.json").read_text())
    assert summary["steps"] == 2 and summary["last_loss"] > 0
    first, last = (load_file(str(p / "model.safetensors"))
                   for p in sorted((fixtures / "trained" / "checkpoints").glob("step-*")))
    weights = [k for k, v in first.items() if v.is_floating_point()]
    assert weights and [k for k in weights if torch.equal(first[k], last[k])] == []


def test_a_sample_of_cases_gives_the_recorded_messages(recorded, fixtures):
    sweep = _sweep()
    want = {r["name"]: r for r in recorded}
    rows = sweep.sweep(base=fixtures, names=SAMPLE)
    assert sorted(r["name"] for r in rows) == sorted(SAMPLE)
    for r in rows:
        assert r["ok"], r
        assert (r["rc"], r["message"], r["also"]) == (want[r["name"]]["rc"], want[r["name"]]["message"],
                                                      want[r["name"]]["also"]), r["name"]

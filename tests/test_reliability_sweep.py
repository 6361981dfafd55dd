"""docs/reliability.md stays true: it is rendered from docs/reliability.json, which holds one row per case of
scripts/reliability_sweep.py, and a sample of the cases run again here gives the recorded messages exactly."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ["override with a bad number", "other data into a prepared run", "crafted pickles in the newest checkpoint",
          "--out is the run folder holding the head", "hidden_size as a string", "weights changed after saving"]


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
    assert all(r["ok"] for r in recorded), [r["name"] for r in recorded if not r["ok"]]
    assert (ROOT / "docs" / "reliability.md").read_text() == sweep.render_markdown(recorded)


def test_a_sample_of_cases_gives_the_recorded_messages(recorded, tmp_path):
    sweep = _sweep()
    want = {r["name"]: r for r in recorded}
    rows = sweep.sweep(base=tmp_path, names=SAMPLE)
    assert [r["name"] for r in rows] == SAMPLE
    for r in rows:
        assert r["ok"], r
        assert (r["rc"], r["message"], r["also"]) == (want[r["name"]]["rc"], want[r["name"]]["message"],
                                                      want[r["name"]]["also"]), r["name"]

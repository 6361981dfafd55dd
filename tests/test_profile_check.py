"""Cached cost profiles damaged or edited by hand (scheduling/profile_check.py, profile.cached_profile): every
reader of the verify profile and of the batch profile gets one warning naming the file and what is wrong, a
re-measured profile (written in place) and finite positive costs, never a ZeroDivisionError / KeyError /
TypeError. Nothing is timed: the measurements are scripted (profile.verify_from_timings / batch_from_timings)."""
from __future__ import annotations

import json
import logging
import math

import pytest

import specheads.infer.scheduling.profile as prof_mod
from specheads.infer.scheduling.costs import batch_cost_fn, interp_cost, relative_costs, t1_seconds
from specheads.infer.scheduling.profile_check import (DAMAGED, OK, STALE, check_batch_profile,
                                                      check_verify_profile)

SIZES, CONTEXT = (1, 2, 4), 32
ROWS, TOKENS = (1, 2), (1, 2, 4)


def _clean_time(cell) -> float:
    """An idle machine's forward, in seconds: 1 ms plus 0.1 ms per token (cell: n, or (B, n))."""
    b, n = cell if isinstance(cell, tuple) else (1, cell)
    return 1e-3 * (1 + 0.1 * b * n)


@pytest.fixture
def cache(tiny, tmp_path, monkeypatch):
    """A cache of the test's own, the scripted measurements, and the paths of both profiles of `tiny`."""
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    monkeypatch.setattr(prof_mod, "_WARNED", set())
    monkeypatch.setattr(prof_mod, "PROFILE_SIZES", SIZES)
    monkeypatch.setattr(prof_mod, "PROFILE_CONTEXT", CONTEXT)
    monkeypatch.setattr(prof_mod, "BATCH_ROWS", ROWS)
    monkeypatch.setattr(prof_mod, "BATCH_TOKENS", TOKENS)
    measured = []

    def verify(target, sizes, context, repeats, seed=0):
        measured.append("verify")
        return prof_mod.verify_from_timings(sizes, repeats, context, _clean_time)

    def batch(target, rows, tokens, context, repeats, seed=0):
        measured.append("batch")
        return prof_mod.batch_from_timings(rows, tokens, repeats, context, _clean_time)

    monkeypatch.setattr(prof_mod, "measure_verify_cost", verify)
    monkeypatch.setattr(prof_mod, "measure_batch_cost", batch)
    prof_mod.load_or_profile(tiny)
    prof_mod.load_or_profile_batch(tiny)
    measured.clear()
    return {"verify": prof_mod.profile_path(tiny, tiny.dtype), "batch": prof_mod.batch_profile_path(tiny, tiny.dtype),
            "measured": measured}


def _set(*keys, value):
    def edit(d):
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value
    return edit


def _drop(*keys):
    def edit(d):
        for k in keys[:-1]:
            d = d[k]
        del d[keys[-1]]
    return edit


RAW = object()  # the form replaces the whole file with these bytes
VERIFY_FORMS = {
    "not JSON": (RAW, b"{broken", "not valid JSON"),
    "not UTF-8": (RAW, b'{"version": 5, "x": "\xff"}', "not UTF-8"),
    "JSON list": (RAW, b"[1, 2]", "is a JSON list, not an object"),
    "JSON null": (RAW, b"null", "is a JSON null, not an object"),
    "JSON string": (RAW, b'"profile"', "is a JSON str, not an object"),
    "empty object": (RAW, b"{}", "has no 'version'"),
    "version a string": (_set("version", value="5"), None, "version is \"5\""),
    "version true": (_set("version", value=True), None, "version is true"),
    "no verify": (_drop("verify"), None, "has no 'verify'"),
    "verify null": (_set("verify", value=None), None, "verify is null"),
    "verify a list": (_set("verify", value=[1, 2]), None, "verify is [1, 2]"),
    "context a string": (_set("verify", "context", value="32"), None, "verify.context is \"32\""),
    "context null": (_set("verify", "context", value=None), None, "verify.context is null"),
    "noisy a string": (_set("noisy", value="no"), None, "noisy is \"no\""),
    "relative zero": (_set("verify", "relative", "2", value=0), None, "verify.relative['2'] is 0"),
    "relative negative": (_set("verify", "relative", "4", value=-1.5), None, "verify.relative['4'] is -1.5"),
    "relative NaN": (_set("verify", "relative", "2", value=math.nan), None, "verify.relative['2'] is nan"),
    "relative inf": (_set("verify", "relative", "4", value=math.inf), None, "verify.relative['4'] is inf"),
    "relative a string": (_set("verify", "relative", "2", value="1.1"), None, "verify.relative['2'] is \"1.1\""),
    "relative null": (_set("verify", "relative", "2", value=None), None, "verify.relative['2'] is null"),
    "relative absurd": (_set("verify", "relative", "4", value=1e9), None, "from 1 to 256"),
    "relative[1] zero": (_set("verify", "relative", "1", value=0), None, "verify.relative['1'] is 0"),
    "relative[1] not 1": (_set("verify", "relative", "1", value=1.5), None, "is below verify.relative['1']"),
    "relative decreasing": (_set("verify", "relative", "4", value=1.0), None, "never costs less"),
    "relative of the wrong length": (_drop("verify", "relative", "4"), None, "(expected the same)"),
    "relative empty": (_set("verify", "relative", value={}), None, "verify.relative is {}"),
    "relative a list": (_set("verify", "relative", value=[1, 1.1, 1.2]), None, "verify.relative is [1"),
    "relative key not a size": (_set("verify", "relative", "x", value=1.0), None, "has the key \"x\""),
    "relative key 01": (lambda d: d["verify"]["relative"].update({"01": d["verify"]["relative"].pop("1")}), None,
                        "has the key \"01\""),
    "nested too deeply": (RAW, b"[" * 100000 + b"]" * 100000, "nested too deeply"),
    "no relative": (_drop("verify", "relative"), None, "verify.relative is null"),
    "seconds 0": (_set("verify", "seconds", "1", value=0), None, "verify.seconds['1'] is 0"),
    "seconds negative": (_set("verify", "seconds", "2", value=-0.001), None, "verify.seconds['2'] is -0.001"),
    "seconds NaN": (_set("verify", "seconds", "1", value=math.nan), None, "verify.seconds['1'] is nan"),
    "seconds a string": (_set("verify", "seconds", "1", value="fast"), None, "verify.seconds['1'] is \"fast\""),
    "seconds absurd": (_set("verify", "seconds", "1", value=1e6), None, "> 0 and at most 600"),
    "no seconds": (_drop("verify", "seconds"), None, "verify.seconds is null"),
    "relative_raw zero": (_set("verify", "relative_raw", "2", value=0), None, "verify.relative_raw['2'] is 0"),
    "no relative_raw": (_drop("verify", "relative_raw"), None, "verify.relative_raw is null"),
}
BATCH_FORMS = {
    "not JSON": (RAW, b"", "not valid JSON"),
    "JSON list": (RAW, b"[]", "is a JSON list, not an object"),
    "empty object": (RAW, b"{}", "has no 'version'"),
    "no batch": (_drop("batch"), None, "has no 'batch'"),
    "batch a number": (_set("batch", value=3), None, "batch is 3"),
    "rows a string": (_set("batch", "rows", value="1,2"), None, "batch.rows is \"1,2\""),
    "rows empty": (_set("batch", "rows", value=[]), None, "batch.rows is []"),
    "tokens with 0": (_set("batch", "tokens", value=[0, 1, 2]), None, "batch.tokens is [0, 1, 2]"),
    "rows unsorted": (_set("batch", "rows", value=[2, 1]), None, "expected ascending"),
    "context null": (_set("batch", "context", value=None), None, "batch.context is null"),
    "cell zero": (_set("batch", "relative", "2", "2", value=0), None, "batch.relative['2']['2'] is 0"),
    "cell negative": (_set("batch", "relative", "1", "4", value=-3), None, "batch.relative['1']['4'] is -3"),
    "cell NaN": (_set("batch", "relative", "2", "1", value=math.nan), None, "batch.relative['2']['1'] is nan"),
    "cell inf": (_set("batch", "relative", "2", "4", value=math.inf), None, "batch.relative['2']['4'] is inf"),
    "cell a string": (_set("batch", "relative", "1", "2", value="x"), None, "batch.relative['1']['2'] is \"x\""),
    "cell null": (_set("batch", "relative", "1", "2", value=None), None, "batch.relative['1']['2'] is null"),
    "origin zero": (_set("batch", "relative", "1", "1", value=0), None, "batch.relative['1']['1'] is 0"),
    "origin not 1": (_set("batch", "relative", "1", "1", value=1.01), None, "batch.relative['1']['1'] is 1.01"),
    "a row missing": (_drop("batch", "relative", "2"), None, "expected an object of the rows [1, 2]"),
    "a row not an object": (_set("batch", "relative", "2", value=[1, 2, 3]), None, "batch.relative['2'] is [1, 2, 3]"),
    "a token missing": (_drop("batch", "relative", "1", "4"), None, "expected an object of the tokens [1, 2, 4]"),
    "fewer in more rows": (_set("batch", "relative", "2", "4", value=1.0), None, "never cost less"),
    "seconds 0": (_set("batch", "seconds", "1", "1", value=0), None, "batch.seconds['1']['1'] is 0"),
    "seconds a string": (_set("batch", "seconds", "2", "2", value="0.1"), None, "batch.seconds['2']['2'] is \"0.1\""),
    "no seconds": (_drop("batch", "seconds"), None, "batch.seconds is null"),
    "raw NaN": (_set("batch", "relative_raw", "2", "2", value=math.nan), None, "batch.relative_raw['2']['2'] is nan"),
}


def _damage(path, form) -> None:
    edit, raw, _ = form
    if edit is RAW:
        path.write_bytes(raw)
        return
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))  # NaN and Infinity as Python's json writes them


def _one_warning(caplog, path, fragment) -> str:
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1, lines
    assert str(path) in lines[0] and fragment in lines[0], lines[0]
    return lines[0]


def _verify_readers(tiny):
    """Every reader of the verify profile: (name, a call returning the costs it read)."""
    from specheads.infer.resolve import HeadResolver
    from specheads.infer.scheduling.step import Scheduler

    def scheduler():
        s = Scheduler.for_target(tiny)
        prices = s.prices(None, 1e-4)
        return s.verify_costs, s.t1_profile, s.fixed_cost(prices), s.cost_of(3, prices)

    def resolver():
        s = HeadResolver(tiny, tree="2").scheduler()
        return s.verify_costs, s.t1_profile, s.fixed_cost(s.prices(None, 1e-4))

    def loaded():
        prof = prof_mod.load_or_profile(tiny)
        costs = relative_costs(prof)
        return costs, t1_seconds(prof), interp_cost(costs, 3), prof["verify"]["context"]

    return {"load_or_profile": loaded, "Scheduler.for_target": scheduler, "HeadResolver.scheduler": resolver}


def _finite(x) -> bool:
    if isinstance(x, dict):
        return all(_finite(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return all(_finite(v) for v in x)
    return not isinstance(x, (int, float)) or (math.isfinite(x) and x >= 0)


@pytest.mark.parametrize("reader", ["load_or_profile", "Scheduler.for_target", "HeadResolver.scheduler"])
@pytest.mark.parametrize("form", list(VERIFY_FORMS))
def test_damaged_verify_profile_is_named_once_and_measured_again(tiny, cache, caplog, form, reader):
    path = cache["verify"]
    _damage(path, VERIFY_FORMS[form])
    caplog.set_level(logging.INFO)
    got = _verify_readers(tiny)[reader]()
    line = _one_warning(caplog, path, VERIFY_FORMS[form][2])
    assert line.endswith("measuring it again") and "\n" not in line
    assert cache["measured"] == ["verify"] and _finite(got)
    rewritten = json.loads(path.read_text())  # overwritten by the fresh measurement
    assert check_verify_profile(rewritten, SIZES, CONTEXT, prof_mod.PROFILE_VERSION) == (OK, "")


@pytest.mark.parametrize("form", ["not JSON", "JSON list", "relative zero", "seconds 0", "relative NaN", "no verify"])
def test_layer_skip_search_reads_a_damaged_profile_as_flat(tiny, cache, caplog, form):
    from specheads.infer.scheduling.skipsearch import FLAT_VERIFY, _verify_costs

    path = cache["verify"]
    _damage(path, VERIFY_FORMS[form])
    costs, source = _verify_costs(tiny, None)
    assert costs == FLAT_VERIFY and "flat" in source and cache["measured"] == []  # the search times nothing
    assert _one_warning(caplog, path, VERIFY_FORMS[form][2]).endswith("using a flat CPU stand-in")


@pytest.mark.parametrize("reader", ["load_or_profile_batch", "bench _cost_surface"])
@pytest.mark.parametrize("form", list(BATCH_FORMS))
def test_damaged_batch_profile_is_named_once_and_measured_again(tiny, cache, caplog, form, reader):
    from specheads.infer.bench.batch import _cost_surface
    from specheads.infer.scheduling.batch_budget import choose_batch_budget

    path = cache["batch"]
    _damage(path, BATCH_FORMS[form])
    if reader == "load_or_profile_batch":
        cost = batch_cost_fn(prof_mod.load_or_profile_batch(tiny))
    else:
        cost = _cost_surface(tiny, False, {})
    _one_warning(caplog, path, BATCH_FORMS[form][2])
    assert cache["measured"] == ["batch"]
    assert all(math.isfinite(cost(B, n)) and cost(B, n) > 0 for B in (1, 2, 3, 5) for n in (1, 3, 8))
    choose_batch_budget([[1.0, 0.8, 0.5], [1.0, 0.6, 0.3]], cost)  # the budget reads it without raising
    rewritten = json.loads(path.read_text())
    assert check_batch_profile(rewritten, ROWS, TOKENS, CONTEXT, prof_mod.BATCH_PROFILE_VERSION) == (OK, "")


def test_a_damaged_file_warns_once_however_many_readers(tiny, cache, caplog, monkeypatch):
    """Two readers of the same damaged file in one process: one line (the second finds it re-measured); a reader
    that does not measure (the layer-skip search) and then one that does: still one line for the same fault."""
    from specheads.infer.scheduling.skipsearch import _verify_costs

    path = cache["verify"]
    _damage(path, VERIFY_FORMS["seconds 0"])
    _verify_costs(tiny, None)
    prof_mod.load_or_profile(tiny)
    prof_mod.load_or_profile(tiny)
    _one_warning(caplog, path, "verify.seconds['1'] is 0")
    assert cache["measured"] == ["verify"]


def test_profiles_measured_for_other_settings_are_replaced_quietly(tiny, cache, caplog):
    """Another version, other sizes, another context, a noisy profile: measured again without a warning."""
    path = cache["verify"]
    good = json.loads(path.read_text())
    for edit in (_set("version", value=4), _set("noisy", value=True), _set("verify", "context", value=64)):
        d = json.loads(json.dumps(good))
        edit(d)
        path.write_text(json.dumps(d))
        assert prof_mod.load_or_profile(tiny)["cached"] is False
    prof_mod.load_or_profile(tiny, sizes=(1, 2))  # other sizes than the cached (1, 2, 4)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert cache["measured"] == ["verify"] * 4
    assert prof_mod.load_or_profile(tiny, sizes=(1, 2))["cached"] is True


def test_check_verdicts_directly():
    good = {"version": 5, "verify": {"relative": {"1": 1.0, "2": 1.2}, "relative_raw": {"1": 1.0, "2": 1.2},
                                     "seconds": {"1": 0.01, "2": 0.012}, "context": 8}}
    assert check_verify_profile(good, (1, 2), 8, 5) == (OK, "")
    assert check_verify_profile(good, (1, 2, 4), 8, 5)[0] == STALE
    assert check_verify_profile(good, (1, 2), 8, 6)[0] == STALE
    assert check_verify_profile({**good, "version": 5.0}, (1, 2), 8, 5)[0] == DAMAGED  # 5.0 is not a version
    raw_dip = json.loads(json.dumps(good))
    raw_dip["verify"]["relative_raw"]["2"] = 0.7  # a repeatable dip of the raw curve: a fact, not damage
    assert check_verify_profile(raw_dip, (1, 2), 8, 5) == (OK, "")


@pytest.mark.parametrize("form", ["not JSON", "seconds 0"])
def test_tree_auto_reads_a_damaged_profile_measured_again(tiny, cache, caplog, monkeypatch, form):
    """--tree auto (autotree.choose_tree_for_head) on the tiny target with a damaged profile: the damage named
    once, the tree chosen on the re-measured profile (its probe runs for real; nothing about its speed is checked)."""
    import specheads.infer.autotree as autotree
    from specheads.heads.base import HeadSpec, build_head

    monkeypatch.setattr(autotree, "CALIBRATION_TOKENS", 8)
    path = cache["verify"]
    _damage(path, VERIFY_FORMS[form])
    head = build_head(HeadSpec(kind="eagle"), tiny)
    spec, record = autotree.choose_tree_for_head(tiny, head, [[1, 5, 6, 7, 5, 6, 7, 5, 6]])
    named = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and str(path) in r.getMessage()]
    assert len(named) == 1 and VERIFY_FORMS[form][2] in named[0], named
    assert record["profile"]["t1_s"] > 0 and _finite(record["profile"]["verify_relative"])
    assert record["total_tokens"] >= 1 and math.isfinite(record["expected_speedup"])


def test_layer_skip_search_record_damaged_is_searched_again():
    """The layer-skip search's cached record beside the profiles: not an object or no skip set -> DAMAGED (one line,
    searched again); another version -> STALE."""
    from specheads.infer.scheduling.skipsearch import SEARCH_VERSION, _check_search

    assert _check_search([1, 2])[0] == DAMAGED and _check_search(None)[1] == "is a JSON null, not an object"
    assert _check_search({"version": SEARCH_VERSION, "skip": None})[0] == DAMAGED
    assert _check_search({"version": -1, "skip": "m1"})[0] == STALE
    assert _check_search({"version": SEARCH_VERSION, "skip": "m1"}) == (OK, "")

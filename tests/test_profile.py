"""The verification-cost profile (scheduling/profile.py, read through scheduling/costs.py) and the tree-choice
arithmetic on it (infer/autotree.py): best-first trees against brute force, the choice on synthetic cost
profiles, acceptance counting, and the cached profile on the tiny target."""
from __future__ import annotations

import itertools
import logging
import random

import pytest
import torch

import specheads.infer.scheduling.profile as prof_mod
import specheads.infer.scheduling.profile_check as profile_check
from specheads.infer.autotree import acceptance_matrix, best_first_paths, choose_tree, monotone_in_rank
from specheads.infer.scheduling.costs import cost_drop, inner_band, interp_cost, isotonic, noise_drop, slot_spread
from specheads.infer.scheduling.profile import (batch_from_timings, load_or_profile, measure_verify_cost,
                                                paired_timings, profile_noise, verify_from_timings)
from specheads.infer.tree import DraftTree


def expected_tau(acc, choices) -> float:
    """Expected tokens per target forward of the static tree `choices` (rank paths, root excluded): 1 + the sum over
    nodes of the product of acc along the path; a node whose depth or rank is not measured adds 0."""
    tau = 1.0
    for path in choices:
        p = 1.0
        for d, r in enumerate(path):
            p *= acc[d][r] if d < len(acc) and r < len(acc[d]) else 0.0
        tau += p
    return tau


def _connected_trees(acc, n):
    nodes = [p for d in range(1, len(acc) + 1) for p in itertools.product(range(len(acc[0])), repeat=d)]
    for combo in itertools.combinations(nodes, n):
        s = set(combo)
        if all(len(p) == 1 or p[:-1] in s for p in combo):
            yield combo


def test_best_first_is_the_best_tree_of_each_size():
    acc = [[0.55, 0.25], [0.7, 0.15], [0.8, 0.1]]
    paths = best_first_paths(acc, 6, 3)
    for n in range(1, 7):
        greedy = expected_tau(acc, [p for p, _ in paths[:n]])
        brute = max(expected_tau(acc, t) for t in _connected_trees(acc, n))
        assert greedy == pytest.approx(brute)
        prefix = {p for p, _ in paths[:n]}
        assert all(len(p) == 1 or p[:-1] in prefix for p in prefix)  # connected


def test_interp_cost():
    costs = {1: 1.0, 2: 1.1, 4: 1.2, 8: 2.0}
    assert interp_cost(costs, 1) == 1.0
    assert interp_cost(costs, 3) == pytest.approx(1.15)
    assert interp_cost(costs, 6) == pytest.approx(1.6)
    assert interp_cost(costs, 12) == pytest.approx(2.8)  # extrapolated with the last slope (0.2 per node)


def test_choice_free_up_to_four_tokens_perfect_chain():
    # the top-1 draft is always right, nothing else ever is; verifying up to 4 tokens costs the same as 1,
    # more costs 10x: the obvious best tree is the chain of 3 draft nodes (root + 3 = 4 tokens), τ = 4
    acc = [[1.0, 0.0, 0.0]] * 6
    costs = {1: 1.0, 2: 1.0, 4: 1.0, 5: 10.0, 64: 10.0}
    ch = choose_tree(acc, costs, draft_cost=0.0, family="dynamic")
    assert (ch.total_tokens, ch.depth) == (3, 3)
    assert ch.choices == [[0], [0, 0], [0, 0, 0]]
    assert ch.expected_tau == pytest.approx(4.0)
    assert ch.expected_speedup == pytest.approx(4.0)
    assert "expected speedup" in ch.reason


def test_choice_draft_cost_is_paid_per_depth_by_both_kinds():
    # every top-1 draft accepted with 0.5; verification cost flat. EAGLE runs one head pass per depth and Medusa
    # one head per depth (MedusaDrafter runs only the heads the tree reaches), so depth costs D x c for both
    acc = [[0.5]] * 6
    costs = {1: 1.0, 64: 1.0}
    for family in ("dynamic", "static"):
        # value(D) = (2 - 0.5^D) / (1 + 0.5 D): D=1 -> 1.5/1.5 = 1.0, D=2 -> 1.75/2 ... best D = 1
        ch = choose_tree(acc, costs, draft_cost=0.5, family=family)
        assert ch.depth == 1 and ch.expected_speedup == pytest.approx(1.0) and ch.family == family
        # cheap drafts: D=6 -> (2 - 0.5^6) / 1.006 beats every shallower chain
        cheap = choose_tree(acc, costs, draft_cost=0.001, family=family)
        assert cheap.depth == 6 and cheap.expected_speedup == pytest.approx((2 - 0.5 ** 6) / 1.006)


def test_choice_untrained_head_takes_smallest_tree_and_says_why():
    ch = choose_tree([[0.0, 0.0]] * 4, {1: 1.0, 2: 1.2, 4: 1.3}, draft_cost=0.1)
    assert (ch.total_tokens, ch.depth) == (1, 1)
    assert ch.expected_speedup < 1
    assert "no tree beats plain decoding" in ch.reason


def test_acceptance_matrix_counts_ranks_along_the_accepted_path():
    # root 0 -> children 1 (rank 0), 2 (rank 1); 1 -> 3 (rank 0); 2 -> 4 (rank 0)
    tree = DraftTree(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([-1, 0, 0, 1, 2]), torch.tensor([0, 1, 1, 2, 2]))
    steps = [(tree, [0, 2, 4]),  # rank 1 at depth 1, then rank 0 at depth 2
             (tree, [0, 1]),  # rank 0 at depth 1, depth-2 child rejected
             (tree, [0])]  # nothing accepted
    acc, seen = acceptance_matrix(steps, max_depth=2, max_rank=2)
    assert seen == [[3, 3], [2, 0]]
    assert acc[0] == pytest.approx([1 / 3, 1 / 3])
    assert acc[1] == pytest.approx([0.5, 0.0])


def test_profile_tiny_target_is_cached(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    monkeypatch.setattr(prof_mod, "MAX_T1_SPREAD", float("inf"))  # microsecond forwards of the tiny model are noisy
    monkeypatch.setattr(prof_mod, "MAX_COST_DROP", float("inf"))
    monkeypatch.setattr(profile_check, "MAX_COST_PER_TOKEN", float("inf"))  # one repeat: any ratio is plausible
    m = measure_verify_cost(tiny, sizes=(1, 4), context=32, repeats=1)
    assert m["relative"]["1"] == 1.0 and m["seconds"]["4"] > 0
    p1 = load_or_profile(tiny, sizes=(1, 2), context=32, repeats=1)
    p2 = load_or_profile(tiny, sizes=(1, 2), context=32, repeats=1)
    assert p1["cached"] is False and p2["cached"] is True
    assert p2["verify"]["relative"] == p1["verify"]["relative"]
    assert str(tmp_path / "profiles") in p2["path"]


def test_isotonic_smooths_noisy_costs():
    assert isotonic([1, 1.5, 1.1, 2]) == pytest.approx([1, 1.3, 1.3, 2])
    assert isotonic([1.0, 1.2, 1.4]) == [1.0, 1.2, 1.4]
    out = isotonic([1, 5.2, 3.2, 0.7, 2.4, 1.05])
    assert all(a <= b + 1e-12 for a, b in zip(out, out[1:]))
    assert sum(out) == pytest.approx(1 + 5.2 + 3.2 + 0.7 + 2.4 + 1.05)


def test_monotone_in_rank_pools_a_noisy_inversion():
    # a short Medusa probe: rank 3 accepted 3/24, rank 0 only 2/24; unfitted, a one-node tree drafts the rank-3 token
    raw = [[2 / 24, 2 / 24, 1 / 24, 3 / 24], [0.5, 0.0, 0.25, 0.0]]
    fit = monotone_in_rank(raw, [[24, 24, 24, 24], [8, 5, 4, 0]])
    assert fit[0] == pytest.approx([2 / 24] * 4)  # pooled: 8 hits in 96
    assert fit[1] == pytest.approx([0.5, 1 / 9, 1 / 9, 0.0])  # (0*5 + 0.25*4) / 9; an unseen rank stays 0
    assert all(a >= b for row in fit for a, b in zip(row, row[1:]))
    assert choose_tree(raw, {1: 1.0, 2: 1.05}, 0.01, family="static", max_nodes=1, max_depth=1).choices == [[3]]
    assert choose_tree(fit, {1: 1.0, 2: 1.05}, 0.01, family="static", max_nodes=1, max_depth=1).choices == [[0]]
    assert monotone_in_rank([[0.4, 0.2, 0.1]], [[10, 10, 10]]) == [[0.4, 0.2, 0.1]]  # already monotone: unchanged


def test_cost_drop_and_noise_verdict():
    assert cost_drop([1.0, 1.06, 1.13, 1.24, 1.41, 1.84]) == 0.0  # an idle 2-core machine
    assert cost_drop([1.0, 2.055, 1.206, 1.628, 0.931, 1.425]) == pytest.approx(1 - 0.931 / 2.055)  # two busy loops
    assert profile_noise({"t1_spread": 1.1, "cost_drop": 0.02, "noise_drop": 0.0}) == ""
    assert "varied 4.50x" in profile_noise({"t1_spread": 4.5, "noise_drop": 0.0})
    assert "cheaper than a smaller one" in profile_noise({"t1_spread": 1.1, "cost_drop": 0.55, "noise_drop": 0.55})
    assert profile_noise({"t1_spread": 1.1, "cost_drop": 0.55, "noise_drop": 0.0}) == ""  # a repeatable dip
    # the paired ratios judged by their own spread: bands apart = a fact of the curve; overlapping = noise
    assert inner_band([5.0, 1.0, 1.1, 0.2, 1.2]) == (1.0, 1.2)  # a single outlier either way set aside
    assert noise_drop([[1.0] * 5, [0.78, 0.8, 0.82, 0.79, 0.81]]) == 0.0  # 20% cheaper in every repeat
    assert noise_drop([[1.0] * 5, [3.5, 2.06, 1.0, 2.8, 1.3], [0.5, 0.93, 2.5, 0.7, 1.8]]) == pytest.approx(
        1 - 0.93 / 2.06)  # contention: medians 2.06 -> 0.93 inside overlapping bands
    assert slot_spread([[1.0, 1.02, 1.01, 1.03, 1.0], [1.6, 1.62, 1.6, 1.61, 1.63]]) < 1.05  # slots apart, each steady
    assert slot_spread([[1.0, 3.0, 2.5, 4.0, 1.2], [2.0, 1.1, 5.0, 3.3, 1.0]]) > 2  # each slot all over the place


# ------------------------------------------------------------------------- the noise check on scripted timings
SIZES = (1, 2, 4, 8, 16, 32)
# an fp32 curve with a real dip: a 2- and 4-node forward cheaper than a 1-node one (in seconds)
DIP = {1: 1.0e-3, 2: 0.8e-3, 4: 0.85e-3, 8: 1.1e-3, 16: 1.5e-3, 32: 2.4e-3}


def idle_timer(base, jitter: float = 0.02, seed: int = 0, slow_after: int | None = None, outlier: int | None = None):
    """A scripted idle machine: base[cell] seconds within +-jitter; slow_after: a one-token forward timed after a
    forward of at least that many nodes is 1.6x slower, every time (a repeatable feature, not noise); outlier: the
    call of that index is 10x slower (one hiccup)."""
    rng, state = random.Random(seed), {"calls": 0, "last": 1}

    def time_cell(cell):
        t = base[cell] * (1 + rng.uniform(-jitter, jitter))
        if slow_after is not None and cell == 1 and state["last"] >= slow_after:
            t *= 1.6
        if state["calls"] == outlier:
            t *= 10
        state["calls"] += 1
        state["last"] = cell
        return t
    return time_cell


def busy_timer(base, seed: int = 0):
    """Two busy loops beside the profile: a forward gets the cores for only part of its time, 1.5-6x slower, at
    random (most forwards)."""
    rng = random.Random(seed)
    return lambda cell: base[cell] * (1.0 if rng.random() < 0.35 else rng.uniform(1.5, 6.0))


def test_idle_repeatable_dip_is_no_noise():
    m = verify_from_timings(SIZES, 5, 384, idle_timer(DIP))
    assert m["cost_drop"] > prof_mod.MAX_COST_DROP  # the old verdict fired on this idle curve
    assert m["noise_drop"] == 0.0 and m["t1_spread"] < 1.1 and profile_noise(m) == ""
    rel = [m["relative"][str(n)] for n in SIZES]
    assert rel[0] == 1.0 and all(a <= b for a, b in zip(rel, rel[1:]))  # the isotonic fit pools the dip
    assert rel[1] == rel[0] and m["relative_raw"]["2"] < 0.85  # kept as measured in the raw record


def test_idle_slot_dependent_one_token_forward_is_no_noise():
    """One-token forwards repeatably slower after a large forward: the old pooled median / fastest read 1.6x."""
    m = verify_from_timings(SIZES, 5, 384, idle_timer(DIP, slow_after=4))
    assert m["t1_spread"] < 1.1 and profile_noise(m) == ""
    before, _ = paired_timings(list(SIZES), 1, 5, idle_timer(DIP, slow_after=4))  # the same forwards again
    pooled = sorted(t for ts in before.values() for t in ts)
    assert pooled[len(pooled) // 2] / pooled[0] > prof_mod.MAX_T1_SPREAD  # what the old check read: a false alarm


@pytest.mark.parametrize("seed", range(6))
def test_contended_machine_is_noise(seed):
    m = verify_from_timings(SIZES, 5, 384, busy_timer(DIP, seed))
    assert profile_noise(m), m
    b = batch_from_timings((1, 2, 4), (1, 2, 4), 5, 384, busy_timer(_surface(), seed))
    assert profile_noise(b), b


@pytest.mark.parametrize("outlier", [0, 7, 31, 45, 58])
def test_a_single_outlier_is_no_noise(outlier):
    clean = verify_from_timings(SIZES, 5, 384, idle_timer(DIP))
    m = verify_from_timings(SIZES, 5, 384, idle_timer(DIP, outlier=outlier))
    assert profile_noise(m) == ""
    assert all(m["relative"][k] == pytest.approx(v, rel=0.05) for k, v in clean["relative"].items())


def _surface():
    """An fp32 batch surface with a real dip: 2 rows of 1 token cheaper than 1 row (seconds per (B, n))."""
    base = {(B, n): 1e-3 * (1 + 0.05 * B * n) for B in (1, 2, 4) for n in (1, 2, 4)}
    base[(2, 1)] = 0.8e-3
    return base


def test_batch_surface_idle_dip_is_no_noise():
    b = batch_from_timings((1, 2, 4), (1, 2, 4), 5, 384, idle_timer(_surface()))
    assert b["cost_drop"] > prof_mod.MAX_COST_DROP and b["noise_drop"] == 0.0 and profile_noise(b) == ""
    assert b["relative"]["2"]["1"] >= b["relative"]["1"]["1"] == pytest.approx(1.0)  # fitted non-decreasing in B


def test_load_or_profile_on_scripted_machines(tiny, tmp_path, monkeypatch, caplog):
    """Through load_or_profile: an idle dip gives no warning and is cached; a busy first attempt is named at info
    and measured again (a clean second attempt is kept, with no warning: only a kept noisy profile warns)."""
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    caplog.set_level(logging.INFO, logger=prof_mod.log.name)
    timers = iter([idle_timer(DIP), busy_timer(DIP), idle_timer(DIP, outlier=12)])
    monkeypatch.setattr(prof_mod, "measure_verify_cost", lambda target, sizes, context, repeats, seed=0:
                        verify_from_timings(sizes, repeats, context, next(timers)))
    p = load_or_profile(tiny, sizes=SIZES, context=32)
    assert p["attempts"] == 1 and not p["noisy"] and not [r for r in caplog.records if r.levelno >= logging.WARNING]
    p = load_or_profile(tiny, sizes=SIZES, context=32, refresh=True)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    retried = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "attempt 1/3" in r.getMessage()]
    assert p["attempts"] == 2 and not p["noisy"] and warned == [] and len(retried) == 1  # a clean retry: no warning
    assert load_or_profile(tiny, sizes=SIZES, context=32)["cached"] is True


def test_noisy_profile_is_measured_again_and_not_trusted_later(tiny, tmp_path, monkeypatch, caplog):
    """A busy machine (another process on the cores) gives a disturbed profile: measured again up to
    PROFILE_ATTEMPTS times; one that stays noisy serves this run but the next run measures afresh."""
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    verdicts = iter(["busy", "", "busy", "busy", "busy", ""])
    calls = []

    def fake_measure(target, sizes, context, repeats, seed=0):
        calls.append(seed)
        return {"seconds": {str(n): 0.01 * n for n in sizes}, "relative": {str(n): float(n) for n in sizes},
                "relative_raw": {str(n): float(n) for n in sizes}, "context": context, "repeats": repeats,
                "t1_spread": 3.0 if next(verdicts) else 1.0, "cost_drop": 0.0}

    monkeypatch.setattr(prof_mod, "measure_verify_cost", fake_measure)
    p = load_or_profile(tiny, sizes=(1, 2), context=32, repeats=1)
    assert calls == [0, 1] and p["attempts"] == 2 and p["noisy"] is False
    assert load_or_profile(tiny, sizes=(1, 2), context=32, repeats=1)["cached"] is True  # a clean one is kept
    calls.clear()
    p = load_or_profile(tiny, sizes=(1, 2), context=32, repeats=1, refresh=True)
    assert calls == [0, 1, 2] and p["noisy"] is True and "varied 3.00x" in p["noise"]
    assert "stayed busy" in caplog.text
    calls.clear()
    p = load_or_profile(tiny, sizes=(1, 2), context=32, repeats=1)  # the noisy one on disk is not trusted
    assert p["cached"] is False and calls == [0] and p["noisy"] is False


def test_choose_tree_prices_the_first_depth_apart():
    """draft(D) = first + (D - 1) x further: a dear first depth (the accepted tokens' bookkeeping) with cheap
    further depths favours going deeper than the same total priced per depth."""
    acc = [[0.8], [0.8]]
    flat = {1: 1.0, 2: 1.0, 4: 1.0}
    per_depth = choose_tree(acc, flat, 0.3, max_nodes=2)  # depth 1: 1.8 / 1.3 = 1.385; depth 2: 2.44 / 1.6 = 1.525
    assert (per_depth.depth, per_depth.expected_speedup) == (2, pytest.approx(2.44 / 1.6))
    split = choose_tree(acc, flat, 0.05, max_nodes=2, draft_first=0.3)  # depth 2: 2.44 / 1.35
    assert (split.depth, split.expected_speedup) == (2, pytest.approx(2.44 / 1.35))
    dear = choose_tree(acc, flat, 1.5, max_nodes=2, draft_first=0.3)  # depth 2: 2.44 / 2.8 < depth 1: 1.8 / 1.3
    assert (dear.depth, dear.expected_speedup) == (1, pytest.approx(1.8 / 1.3))

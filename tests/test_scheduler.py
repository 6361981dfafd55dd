"""The per-step scheduler (infer/scheduling/step.py, acceptance.py) on hand-made confidences and cost curves whose answer is obvious, its
estimators and replay arithmetic, and the DSpark and union drafters' bookkeeping on the tiny target."""
from __future__ import annotations

import itertools
import time

import pytest
import torch

from specheads.heads.base import HeadSpec, build_head
from specheads.infer.bench.methods import MethodOptions
from specheads.infer.drafters import (DSparkDrafter, PromptLookupDrafter, ScheduledUnionDrafter, ScoredDrafter,
                                      combine_drafters)
from specheads.infer.engine.generate import generate
from specheads.infer.scheduling.acceptance import (Candidates, LookupRates, Rates, accepted_along, consistent,
                                                   merge_candidates, outcomes, rank_rates, survival)
from specheads.infer.scheduling.costs import interp_cost
from specheads.infer.scheduling.step import MIN_CLOCK_STEPS, Scheduler, StepClock, StepReport, choose_nodes
from specheads.infer.tree import DraftTree, chain_tree

from specheads.utils import SpecheadsError

from test_generate import hf_greedy

pytestmark = pytest.mark.usefixtures("one_thread")

FLAT = {1: 1.0, 2: 1.05, 4: 1.15, 8: 1.35}  # nearly flat: each further node costs ~5% of a one-token forward
STEEP = {1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0}  # every node costs a whole forward (no gain from verifying in one pass)


# ------------------------------------------------------------------------------------------------ the value rule
def _chain_choice(conf, verify_costs, fixed_cost):
    """A block's chain: choose_nodes over p = survival(conf), each draft the parent of the next."""
    return choose_nodes([1.0] + survival(conf), [-1] + list(range(len(conf))), verify_costs, fixed_cost)


def test_prefix_length_obvious_answers():
    c = _chain_choice([0.9, 0.9, 0.1], FLAT, fixed_cost=0.1)
    assert len(c.keep) - 1 == 2  # the third draft (survival 0.081) is not worth its 5%
    assert c.expected_tau == pytest.approx(1 + 0.9 + 0.81)
    assert c.cost == pytest.approx(interp_cost(FLAT, 3) + 0.1) and c.value == pytest.approx(c.expected_tau / c.cost)
    assert len(_chain_choice([0.9, 0.9, 0.1], STEEP, fixed_cost=0.0).keep) == 1  # L = 0: plain decoding pays best
    assert len(_chain_choice([0.99] * 4, FLAT, fixed_cost=0.1).keep) == 5  # a sure block: all of it
    assert _chain_choice([], FLAT, 0.1).keep == [0]
    # a fixed cost per step (a costly draft pass) makes longer prefixes pay: it is spread over more tokens
    assert len(_chain_choice([0.9, 0.3], STEEP, 0.0).keep) == 1 and len(_chain_choice([0.9, 0.3], STEEP, 3.0).keep) > 1


def test_survival_and_consistent():
    assert survival([0.5, 0.5, 0.8]) == pytest.approx([0.5, 0.25, 0.2])
    # children of the root 0.7 + 0.8 exceed 1 (they are disjoint events): scaled to sum 1; node 3 claimed more than
    # its parent: never above it
    p = consistent([1.0, 0.7, 0.8, 0.9], [-1, 0, 0, 1])
    assert p[1] + p[2] == pytest.approx(1.0) and p[1] == pytest.approx(0.7 / 1.5) and p[3] <= p[1] + 1e-12
    # a subtree follows its parent's scaling (conditional rates kept)
    q = consistent([1.0, 0.8, 0.8, 0.4], [-1, 0, 0, 1])
    assert q[3] / q[1] == pytest.approx(0.5)
    assert consistent([1.0, 0.3, 0.6], [-1, 0, 1]) == pytest.approx([1.0, 0.3, 0.3])


def _closed_subsets(parents):
    n = len(parents)
    for bits in itertools.product([0, 1], repeat=n - 1):
        keep = [0] + [i for i, b in enumerate(bits, start=1) if b]
        if all(parents[i] in keep for i in keep[1:]):
            yield keep


def test_choose_nodes_is_the_best_ancestor_closed_set():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        parents = [-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, 8)]
        raw = [1.0] + torch.rand(7, generator=g).tolist()
        p = consistent(raw, parents)
        fixed = float(torch.rand((), generator=g)) * 0.5
        costs = FLAT if trial % 2 else {1: 1.0, 2: 1.3, 4: 1.9, 8: 3.1}
        best = max((1 + sum(p[i] for i in s[1:])) / (interp_cost(costs, len(s)) + fixed) for s in _closed_subsets(parents))
        c = choose_nodes(p, parents, costs, fixed)
        assert c.value == pytest.approx(best) and all(parents[i] in c.keep for i in c.keep[1:])


def test_lookup_with_high_measured_acceptance_beats_a_weak_head():
    rates = LookupRates()
    for _ in range(20):
        for d in range(1, 5):
            rates.add(6, d, True)  # 6-token matches were always right this request
    head = Candidates(chain_tree(9, [1, 2, 3]), [1.0] + survival([0.2, 0.1, 0.1]), "head")
    lookup = Candidates(chain_tree(9, [4, 5, 6, 7]), [1.0] + survival([rates.rate(6, d) for d in range(1, 5)]),
                        "lookup")
    merged, maps = merge_candidates([head, lookup])
    c = choose_nodes(merged.p, merged.tree.parents.tolist(), FLAT, 0.1)
    kept = {int(merged.tree.tokens[i]) for i in c.keep[1:]}
    assert {4, 5, 6, 7} <= kept and not {2, 3} & kept
    assert maps[1] == [0, 4, 5, 6, 7]  # the lookup chain's nodes after the head's 3 in the union
    # the same chain, measured wrong all along, loses to a confident head
    bad = LookupRates()
    for _ in range(20):
        bad.add(6, 1, False)
    strong = Candidates(chain_tree(9, [1, 2, 3]), [1.0] + survival([0.95, 0.9, 0.9]), "head")
    weak = Candidates(chain_tree(9, [4, 5, 6, 7]), [1.0] + survival([bad.rate(6, d) for d in range(1, 5)]), "lookup")
    merged, _ = merge_candidates([strong, weak])
    c = choose_nodes(merged.p, merged.tree.parents.tolist(), FLAT, 0.1)
    assert [int(merged.tree.tokens[i]) for i in c.keep] == [9, 1, 2, 3]


def test_merge_keeps_the_larger_estimate_never_above_the_parent():
    a = Candidates(chain_tree(9, [1, 2]), [1.0, 0.5, 0.4], "a")
    b = Candidates(chain_tree(9, [1, 2, 3]), [1.0, 0.8, 0.2, 0.1], "b")
    m, maps = merge_candidates([a, b])
    assert m.tree.tokens.tolist() == [9, 1, 2, 3] and maps == [[0, 1, 2], [0, 1, 2, 3]]
    assert m.p == pytest.approx([1.0, 0.8, 0.4, 0.1]) and m.source == "a+b"


# ------------------------------------------------------------------------------------------------ estimators
def test_rates_priors_and_learning():
    r = Rates()
    assert r.rate("x") == 0.5  # Laplace: (0 + 1) / (0 + 2)
    for _ in range(3):
        r.add("x", True)
    assert r.rate("x") == pytest.approx(4 / 5)
    lk = LookupRates()
    for _ in range(8):
        lk.add(3, 1, True)
    lk.add(3, 2, False)
    assert lk.by_match.rate(3) == pytest.approx(9 / 11)
    assert lk.rate(3, 1) == pytest.approx((8 + 2 * 9 / 11) / 10)  # a cell shrunk towards its match length's rate
    assert lk.rate(3, 5) == pytest.approx(9 / 11)  # an unseen depth: the pooled rate
    assert lk.rate(20, 1) == lk.rate(8, 1)  # long matches share one estimate
    probe = rank_rates([[0.9, 0.2]], [[100, 3]])
    assert probe.rate((1, 0)) == pytest.approx(0.9) and probe.rate((1, 1)) == pytest.approx(0.2)
    probe.add((1, 1), True)
    assert probe.rate((1, 1)) == pytest.approx((1 + 3 * 0.2) / 4)  # the probe's 3 observations weigh 3
    for _ in range(16):
        probe.add((1, 0), False)
    assert probe.rate((1, 0)) == pytest.approx(16 * 0.9 / 32)  # 100 capped at 16: one request moves it
    assert rank_rates().rate((3, 1)) == pytest.approx(0.25)  # no probe: 0.5 / (1 + rank)


def test_outcomes_and_accepted_length_along_the_true_path():
    # root 9 -> 1 -> 2 -> 3, and a sibling 4 of the first; the step emitted 1, 2 then the bonus 7
    tree = DraftTree([9, 1, 4, 2, 3], [-1, 0, 0, 1, 3], [0, 1, 1, 2, 3])
    assert outcomes(tree, [1, 2, 7]) == [(1, True), (2, False), (3, True), (4, False)]
    assert accepted_along(tree, [1, 2, 7]) == (2, False)
    assert accepted_along(tree, [1, 2]) == (2, True)  # matched all that is known and proposes deeper: a lower bound
    assert accepted_along(tree, [4, 5]) == (1, False)
    assert outcomes(tree, [5]) == [(1, False), (2, False)]  # nothing deeper is decided


def test_oracle_takes_the_better_source_and_the_cheaper_on_a_tie():
    r = StepReport(3.0, 1.5, sources={"head": 3, "lookup": 3}, source_cost={"head": 1.5, "lookup": 1.2},
                   censored={"lookup": True})
    assert r.oracle() == ("lookup", 3, 1.2, True)
    r.sources["head"] = 4
    assert r.oracle()[:2] == ("head", 4)
    assert StepReport(1.0, 1.0).oracle() is None


# ------------------------------------------------------------------------------------------------ measured costs
def test_clock_medians_and_the_prices_fallbacks():
    sched = Scheduler(FLAT, t1=0.050)
    clock = StepClock()
    p = sched.prices(clock, draft_now=0.004)
    assert (p.t1, p.draft, p.other) == (0.050, 0.004, 0.0) and "profile" in p.source
    for i in range(MIN_CLOCK_STEPS):
        clock.add_step({"draft": 0.010 + 0.001 * i, "tree": 0.001, "target": 0.105, "verify": 0.002, "cache": 0.0,
                        "other": 0.001}, nodes=2)
    p = sched.prices(clock)
    assert p.t1 == pytest.approx(0.105 / 1.05) and p.draft == pytest.approx(0.012) and p.other == pytest.approx(0.004)
    assert sched.fixed_cost(p) == pytest.approx(0.016 / 0.1) and sched.fixed_cost(p, draft_s=0.0) == pytest.approx(0.04)
    assert sched.cost_of(4, p) == pytest.approx(1.15 + 0.16)
    nxt = StepClock()  # the next request's first steps: the previous request's medians
    nxt.add_step({"draft": 1.0, "target": 1.0}, nodes=1)
    q = sched.prices(nxt)
    assert (q.t1, q.draft) == (p.t1, p.draft) and "previous" in q.source


# ------------------------------------------------------------------------------------------------ drafters
def dspark_head(target, **kw):
    spec = HeadSpec(**{"kind": "dspark", "feature_layers": [1, 2, 3], "block_size": 4, "markov_rank": 16,
                       "num_layers": 1, "draft_vocab_size": 64, **kw})
    torch.manual_seed(0)
    return build_head(spec, target, token_counts=torch.arange(256.0)).eval()


def _features(target, ids, layers):
    with torch.no_grad():
        hs = target.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hs[l][0] for l in layers], dim=-1)


def test_dspark_cache_holds_true_rows_only(tiny):
    """At every step the head's context cache equals one built afresh from the target's features of everything
    verified so far: rejected drafts never enter it."""
    head = dspark_head(tiny)
    checked = []

    class Checked(DSparkDrafter):
        def candidates(self, ctx):
            self.catch_up()  # the verified rows' features wait until a block is drafted
            fresh = head.new_cache()
            head.extend_context(fresh, _features(tiny, ctx.ids[:-1], head.config.feature_layers))
            assert self.cache.length == fresh.length == len(ctx.ids) - 1
            for a, b in zip(self.cache.keys + self.cache.values, fresh.keys + fresh.values):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
            checked.append(len(ctx.ids))
            return super().candidates(ctx)

    p = [5, 6, 7, 8, 9, 10] * 3
    for drafter in (Checked(head, scheduler=Scheduler(FLAT, 1e-3)), Checked(head, num_tokens=3)):
        r = generate(tiny, drafter, p, max_new_tokens=16, ignore_eos=True)
        assert len(r.ids) == 16
    assert len(checked) >= 8


def test_dspark_scheduled_steps_record_their_expectations(tiny):
    head = dspark_head(tiny)
    p = [5, 6, 7, 8, 9, 10] * 3
    auto = generate(tiny, DSparkDrafter(head, scheduler=Scheduler(FLAT, 1e-3)), p, max_new_tokens=16).stats
    sc = auto.schedule
    assert sc.scheduled_steps == auto.target_forwards > 0
    assert sc.expected_tau_sum >= sc.scheduled_steps and sc.expected_cost_sum >= sc.scheduled_steps
    assert auto.tree_nodes <= auto.target_forwards * (1 + head.num_drafts + 2) and not sc.source_tokens  # 2 siblings
    fixed = generate(tiny, DSparkDrafter(head, num_tokens=3), p, max_new_tokens=16).stats
    assert fixed.schedule is None and fixed.tree_nodes == 4 * fixed.target_forwards  # every block's 3 drafts
    assert fixed.to_dict()["scheduled_steps"] == 0 and auto.to_dict()["scheduled_steps"] == sc.scheduled_steps
    # a prohibitive cost curve: nothing pays, every step is plain decoding (τ 1) and says so
    prohibitive = {1: 1.0, 2: 50.0, 4: 150.0, 8: 350.0}
    steep = generate(tiny, DSparkDrafter(head, scheduler=Scheduler(prohibitive, 1e-3)), p, max_new_tokens=8).stats
    assert steep.tree_nodes == steep.target_forwards
    assert steep.schedule.expected_tau_sum == steep.schedule.scheduled_steps


def test_union_replays_each_source_alone(tiny):
    """With a dead-flat cost curve the scheduler verifies every candidate, so each source's own figure is exact
    (never censored) and never above what the union emitted."""
    head = dspark_head(tiny)
    seen = []

    class Recorded(ScheduledUnionDrafter):
        def observe(self, tree, accepted, features):
            super().observe(tree, accepted, features)
            seen.append((self.report, len(accepted.nodes), len(tree)))

    free = Scheduler({1: 1.0, 64: 1.0}, 1e-3)
    union = combine_drafters(tiny, [DSparkDrafter(head, scheduler=free)], lookup=6, scheduler=free)
    union = Recorded(union.sources, free, explore_every=1)  # 1: no source ever rests
    p = [5, 6, 7, 8, 9, 10] * 3
    r = generate(tiny, union, p, max_new_tokens=24, ignore_eos=True)
    assert union.names == ["dspark", "lookup"] and len(seen) == r.stats.target_forwards
    for report, emitted, nodes in seen:
        assert set(report.sources) == {"dspark", "lookup"} and not any(report.censored.values())
        assert max(report.sources.values()) <= emitted
    st = r.stats.schedule
    assert st.oracle_tokens == sum(max(rep.sources.values()) for rep, _, _ in seen) and st.oracle_censored == 0
    assert set(st.source_tokens) == {"dspark", "lookup"} and st.oracle_cost_sum > 0
    assert st.source_tokens["lookup"] > r.stats.target_forwards  # the repeated prompt: lookup alone is right often
    # sampling: the first source drafts alone (its own scheduler), nothing is replayed
    s = generate(tiny, union, p, max_new_tokens=8, temperature=1.0, seed=0, ignore_eos=True).stats
    assert s.schedule.scheduled_steps == s.target_forwards and not s.schedule.source_tokens


class Slow(ScoredDrafter):
    """A source whose pass costs `delay` seconds and whose chain of made-up tokens is never right (p = 0.05)."""
    name = "slow"

    def __init__(self, delay: float):
        self.delay, self.passes = delay, 0

    def candidates(self, ctx):
        self.passes += 1
        time.sleep(self.delay)
        return Candidates(chain_tree(ctx.ids[-1], [3, 3, 3]), [1.0, 0.05, 0.0025, 0.0001], self.name)


def test_union_rests_a_source_whose_pass_does_not_pay(tiny):
    """A slow source that is never right rests (proposes on few steps, its replay counted over its own steps);
    prompt lookup, free and right on a repeated prompt, never rests; output stays greedy-exact."""
    # t(1) = 100 ms: the slow source's 200 ms pass costs 2 forwards, more than its never-right chain returns, while
    # prompt lookup's sub-millisecond pass stays far below its gain even on a loaded machine (with t(1) = 1 ms a
    # lookup pass slowed to ~1 ms by other work rested it on some steps; with t(1) = 10 ms it rested on 17 of 35
    # steps beside a parallel suite and two other jobs)
    # the HF forward: the tiny target's owned forward takes ~0.3 ms, about a lookup pass, and then resting lookup
    # on some steps is the right call by the same rule
    tiny.engine = "hf"
    flat = Scheduler({1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1}, 1e-1)
    slow = Slow(delay=0.2)
    union = combine_drafters(tiny, [slow], lookup=6, scheduler=flat)
    p = [5, 6, 7, 8, 9, 10] * 3
    try:
        r = generate(tiny, union, p, max_new_tokens=40, ignore_eos=True)
    finally:
        tiny.engine = "auto"
    assert r.ids == hf_greedy(tiny, p, 40)
    st = r.stats
    assert slow.passes <= st.target_forwards // 2, (slow.passes, st.target_forwards)
    assert st.schedule.source_steps["slow"] == slow.passes
    assert st.schedule.source_steps["lookup"] == st.schedule.scheduled_steps
    assert "lookup" not in union.resting


def test_profile_pricing_reads_no_clock():
    """pricing="profile": the profile's t(1), no drafting or loop cost, whatever the clock and the sources' seconds
    say; an unknown mode is one clear error."""
    clock = StepClock()
    for _ in range(MIN_CLOCK_STEPS):
        clock.add_step({"draft": 0.5, "target": 0.2, "other": 0.1}, nodes=2)
    measured, profile = Scheduler(FLAT, t1=0.05), Scheduler(FLAT, t1=0.05, pricing="profile")
    assert measured.fixed_cost(measured.prices(clock)) > 1 and measured.source_seconds([0.3, 0.1, 0.2]) == 0.2
    for c, now in ((clock, 0.4), (StepClock(), 0.0), (None, 9.0)):
        p = profile.prices(c, draft_now=now)
        assert (p.t1, p.draft, p.other) == (0.05, 0.0, 0.0)
        assert profile.fixed_cost(p) == 0.0 and profile.fixed_cost(p, draft_s=3.0) == 0.0
        assert profile.cost_of(4, p, draft_s=3.0) == pytest.approx(1.15)
    assert profile.source_seconds([0.3, 0.1, 0.2]) == 0.0 and profile.memory is None
    assert profile.record()["pricing"] == "profile" and measured.record()["pricing"] == "measured"
    with pytest.raises(SpecheadsError, match="pricing 'wall': expected one of measured, profile"):
        Scheduler(FLAT, t1=0.05, pricing="wall")
    with pytest.raises(SpecheadsError, match="--pricing 'x'"):
        MethodOptions(pricing="x")


class FakeClock:
    """time.perf_counter that stands still except when a source's pass moves it on (its "seconds")."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Costly(ScoredDrafter):
    """A never-right chain whose pass takes `delay` seconds of the fake clock."""
    name = "costly"

    def __init__(self, clock: FakeClock, delay: float):
        self.clock, self.delay = clock, delay

    def candidates(self, ctx):
        self.clock.now += self.delay
        return Candidates(chain_tree(ctx.ids[-1], [3, 3, 3]), [1.0, 0.05, 0.0025, 0.0001], self.name)


@pytest.mark.parametrize("pricing", ["measured", "profile"])
def test_profile_pricing_makes_the_same_choices_whatever_the_clock(tiny, monkeypatch, pricing):
    """A union (a costly source and prompt lookup) and a scheduled DSpark head, each run twice under clock readings
    that differ (the costly pass free, then 1 s of a 10 ms t(1)): measured pricing follows the clock (the costly
    source rests, the step's fixed cost lengthens the prefixes); profile pricing verifies the same trees, with the same
    sources proposing, both times."""
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    head, p = dspark_head(tiny), [5, 6, 7, 8, 9, 10] * 3

    def trees(make, delay):
        seen = []
        drafter = make(delay)
        inner = drafter.propose
        drafter.propose = lambda ctx: seen.append(inner(ctx)) or seen[-1]
        r = generate(tiny, drafter, p, max_new_tokens=24, ignore_eos=True)
        assert r.ids == hf_greedy(tiny, p, 24) and any(len(t) > 1 for t in seen)  # drafts were verified
        return [(t.tokens.tolist(), t.parents.tolist()) for t in seen], r.stats.schedule.source_steps  # (a rested source)

    def union(delay):
        return combine_drafters(tiny, [Costly(clock, delay)], lookup=6,
                                scheduler=Scheduler(FLAT, 1e-2, pricing=pricing))

    def dspark(delay):  # its draft phase: the fake clock moved on by `delay` in the model's forward
        d = DSparkDrafter(head, scheduler=Scheduler(FLAT, 1e-2, pricing=pricing))
        cand = d.candidates
        d.candidates = lambda ctx: (setattr(clock, "now", clock.now + delay), cand(ctx))[1]
        return d

    for make in (union, dspark):
        same = trees(make, 0.0) == trees(make, 1.0)
        assert same == (pricing == "profile"), make.__name__


def test_lookup_match_length():
    pl = PromptLookupDrafter(num_tokens=3, max_ngram=2)
    ids = [1, 2, 3, 4, 5, 9, 9, 2, 3, 4, 5, 6, 7, 2, 3, 4, 5]
    cont, match = pl.find(ids, 3)
    assert cont == [6, 7, 2] and match == 4  # the latest 2-gram (4, 5) matched; 2, 3, 4, 5 precede both
    assert pl.find([1, 2, 3], 3) == ([], 0)

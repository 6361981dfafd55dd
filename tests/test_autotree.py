"""`--tree auto` in its steps, each without a benchmark run: the probe plan, the one-token time from the probe, the
profile-trust verdicts, the draft price, the spec the choice becomes, and the recording drafter."""
import pytest
import torch

from specheads.heads.base import HeadSpec, build_head
from specheads.infer.autotree import (T1_FROM_PROBE, RecordingDrafter, choose_tree, draft_t1, price_draft,
                                                 probe_plan, probe_t1, profile_is_stale, run_probe, spec_from_choice)
from specheads.infer.drafters import PromptLookupDrafter, build_drafter
from specheads.infer.tree import DEFAULT_MEDUSA_CHOICES
from specheads.infer.treespec import TreeSpec
from specheads.utils import SpecheadsError


def profile(t1: float, cached: bool, noisy: bool = False) -> dict:
    """The fields of a load_or_profile result that the trust steps read."""
    return {"cached": cached, "noisy": noisy, "verify": {"seconds": {"1": t1, "2": 1.1 * t1}}}


def test_probe_t1_is_the_median_over_prompts_of_seconds_per_relative_cost():
    costs = {1: 1.0, 2: 1.2, 4: 1.6}
    # prompts whose trees averaged 2 and 4 nodes: 0.12 s / 1.2 = 0.1; 0.32 / 1.6 = 0.2; 0.03 / 1.0 = 0.03
    assert probe_t1([(0.12, 2), (0.32, 4), (0.03, 1)], costs) == pytest.approx(0.1)


def test_profile_trust_verdicts():
    assert not profile_is_stale(profile(0.040, cached=True), 0.050)  # within 1.5x: trusted
    assert profile_is_stale(profile(0.040, cached=True), 0.070)  # cached, 1.75x slower now: measure again
    assert profile_is_stale(profile(0.040, cached=True), 0.020)  # either way
    assert not profile_is_stale(profile(0.040, cached=False), 0.070)  # just measured: nothing to refresh
    assert draft_t1(profile(0.040, cached=True), 0.050) == (0.050, T1_FROM_PROBE)  # agree: the probe's own timing
    t1, source = draft_t1(profile(0.043, cached=False), 0.142)  # a clean profile measured now still disagrees
    assert t1 == 0.043 and source.startswith("the profile (the probe's tree forwards gave 142.0 ms)")
    assert draft_t1(profile(0.043, cached=False, noisy=True), 0.142) == (0.142, T1_FROM_PROBE)  # noisy: not trusted


def test_price_draft_first_depth_apart():
    p = price_draft(deep_s=0.030, depth1_s=0.010, probe_depth=5, t1=0.050)
    assert p.first == pytest.approx(0.2) and p.per_depth == pytest.approx(0.1)  # (0.030 - 0.010) / 4 / 0.050
    assert price_draft(0.005, 0.010, 5, 0.05).per_depth == 0.0  # a faster deep run (noise) is no negative price
    assert price_draft(0.02, 0.01, 1, 0.05).per_depth == pytest.approx(0.2)


def test_probe_plans_and_specs_per_family(tiny):
    medusa = build_head(HeadSpec(kind="medusa", num_heads=3), tiny)
    plan = probe_plan("static", medusa)
    assert plan.depth == 3 and plan.ranks == 4  # the head's own count, not the default tree's depth
    assert max(len(c) for c in plan.deep.choices) == 3 and plan.shallow.choices == ((0,), (1,), (2,), (3,))
    assert plan.record == {"choices": len([c for c in DEFAULT_MEDUSA_CHOICES if len(c) <= 3]), "depth": 3}
    dyn = probe_plan("dynamic", build_head(HeadSpec(kind="eagle"), tiny))
    assert (dyn.deep.depth, dyn.deep.top_k, dyn.deep.total_tokens) == (5, 3, 24)
    assert (dyn.shallow.depth, dyn.shallow.top_k, dyn.shallow.total_tokens) == (1, 3, 3)
    with pytest.raises(SpecheadsError, match="--tree auto"):
        probe_plan("tokens", None)
    acc = [[0.9, 0.3], [0.8, 0.1]]
    choice = choose_tree(acc, {1: 1.0, 8: 1.0}, 0.01, family="static", max_nodes=3)
    assert spec_from_choice("static", choice) == TreeSpec.static(choice.choices, text="auto")
    dyn_choice = choose_tree(acc, {1: 1.0, 8: 1.0}, 0.01, family="dynamic", max_nodes=3)
    spec = spec_from_choice("dynamic", dyn_choice)
    assert (spec.depth, spec.top_k, spec.total_tokens) == (dyn_choice.depth, dyn_choice.top_k, dyn_choice.total_tokens)


def test_run_probe_records_steps_and_excludes_prompt_feeding(tiny):
    probe = run_probe(tiny, PromptLookupDrafter(num_tokens=3), [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9]], 6)
    assert len(probe.per_prompt) == 2 and len(probe.steps) >= 2 and probe.seconds > 0
    assert all(sec > 0 and nodes >= 1 for sec, nodes in probe.per_prompt)
    rec = RecordingDrafter(build_drafter(tiny, "plain"))
    rec.reset(torch.tensor([1, 2]), None)
    for _ in range(3):
        tree = rec.propose(_ctx([1, 2]))
        rec.observe(tree, _accepted(), None)
    assert rec.num_steps == 3 and len(rec.step_s) == 2  # the prompt's first step is left out of the median


def _ctx(ids):
    from specheads.infer.drafters import DraftContext

    return DraftContext(ids=ids)


def _accepted():
    from specheads.infer.verify import Accepted

    return Accepted([0], 1)

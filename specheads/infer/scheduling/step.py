"""The per-step scheduler: which of this step's candidate draft nodes to verify, from per-node acceptance estimates
and this machine's measured cost profile (DSpark, Cheng et al. 2026, arXiv:2607.05147, Algorithm 1, the batch-1
case; Sequoia's hardware-aware value for trees). `--tree auto` for tree heads (infer/autotree.py) chooses one tree shape
per run by the same value; this module chooses per step (a block head's `--tree auto`, `+lookup`, `combo`).

Rule. A step's candidates form a tree (node 0 the root); p_i is the estimated probability that node i is accepted
(the product of conditional acceptance rates along its path: for a DSpark block a_i = c_1 ... c_i from the calibrated
confidences). Verifying an ancestor-closed set S of draft nodes emits E[τ](S) = 1 + Σ_{i∈S} p_i tokens in expectation
(the bonus, plus each node: siblings are disjoint events) and costs t(|S|+1)/t(1) + d one-token target forwards,
d = the step's fixed cost (the drafters' passes and the loop's own work) in t(1) units. Each step verifies

    S* = argmax_S  E[τ](S) / (t(|S|+1)/t(1) + d),        S = {} (plain decoding, value 1 / (1 + d)) when nothing pays.

The cost depends on |S| only and p never rises down a path (acceptance.consistent), so the best S of each size is the
top-|S| nodes by p (ties: parents first) and the search is one sorted pass (`choose_nodes`). A block drafter's chain
makes S a prefix: L = argmax (1 + a_1 + ... + a_L) / (t(L+1)/t(1) + d).

What is measured (nothing assumed):
- t(n)/t(1): the cached verification-cost profile of this machine + target + dtype (profile.load_or_profile with its
  noise guards), read through costs.interp_cost;
- t(1) now, and d: running medians over the request's last WINDOW_STEPS steps (`StepClock`, fed by the generator
  with each step's phase seconds): t(1) = target seconds / t(n)/t(1) of the step's tree, d = (drafter seconds per
  step + the loop's other seconds per step) / t(1). Until a request has MIN_CLOCK_STEPS steps the previous request's
  medians stand in; before any, the profile's t(1) and the seconds this step's drafting took so far.
- p: per source (acceptance.py), `Rates` learned from outcomes with a prior (lookup: by match length and depth, per
  request; EAGLE / Medusa trees: by depth and rank, the `--tree auto` probe's matrix as prior; DSpark: its
  calibrated confidences).
Pricing (`Scheduler(pricing=)`, `--pricing`): "measured" (the default) prices t(1) and d from the run's own seconds as
above; "profile" prices every step from the cost profile alone: t(1) = the profile's, d = 0 (the drafters' and the
loop's seconds unpriced, each source's pass included), so the choices depend on the candidates and the cached curve
only and two runs on one profile choose alike whatever the machine's load.
Several sources (a head and prompt lookup, or several heads) are merged as a trie (acceptance.merge_candidates: a
node proposed twice keeps the larger estimate, never above its parent's) and one S is chosen across them: one verify
budget per step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

# StepClock and StepReport live beside the drafter protocol (the generator feeds and reads them); the drafters
# that schedule import them from here with the Scheduler
from specheads.infer.engine.protocol import WINDOW_STEPS, StepClock, StepReport  # noqa: F401
from specheads.infer.scheduling.acceptance import Candidates
from specheads.infer.scheduling.costs import interp_cost, median, relative_costs, t1_seconds
from specheads.infer.scheduling.profile import load_or_profile
from specheads.utils import SpecheadsError

MIN_CLOCK_STEPS = 4  # a request's own medians price its steps from its 4th step on (the median of 3 already drops
# one outlier); before that, the previous request's
RULE = ("per step, verify the ancestor-closed set S of candidate nodes maximising (1 + Σ_S p_i) / (t(|S|+1)/t(1) + d)"
        ", p_i = estimated acceptance of node i, t(n)/t(1) = this machine's verification-cost profile, d = the "
        "drafters' and the loop's measured seconds per step / t(1) now (running medians); S = {} (plain decoding) "
        "when nothing pays (DSpark Algorithm 1, batch 1)")
PRICINGS = ("measured", "profile")  # measured: t(1) and d from the run's seconds; profile: the cost profile alone
PROFILE_PRICES = "the profile's t(1), drafting and the loop unpriced (pricing=profile: no in-run seconds)"


def check_pricing(pricing: str, flag: str = "pricing") -> str:
    """The scheduler's pricing mode, one of PRICINGS."""
    if pricing not in PRICINGS:
        raise SpecheadsError(f"{flag} {pricing!r}: expected one of {', '.join(PRICINGS)}")
    return pricing


# --------------------------------------------------------------------------------------------------- the value rule
@dataclass
class Choice:
    keep: list[int]  # node indices to verify, ascending, root included
    expected_tau: float  # 1 + Σ p over the kept draft nodes
    cost: float  # t(n)/t(1) + fixed cost, in one-token target forwards
    value: float  # expected_tau / cost (plain decoding without draft cost = 1)


def choose_nodes(p: Sequence[float], parents: Sequence[int], verify_costs: dict[int, float], fixed_cost: float,
                 max_nodes: int | None = None) -> Choice:
    """The rule of the module docstring over a candidate tree (p consistent: acceptance.consistent). max_nodes:
    draft nodes at most (None = all)."""
    order = sorted(range(1, len(p)), key=lambda i: (-p[i], i))  # best first; equal p: the parent (lower index) first
    cost0 = interp_cost(verify_costs, 1) + fixed_cost
    best_n, best = 0, Choice([0], 1.0, cost0, 1.0 / cost0)
    tau = 1.0
    for n, i in enumerate(order[:max_nodes], start=1):
        if p[i] <= 0:
            break
        tau += p[i]
        cost = interp_cost(verify_costs, n + 1) + fixed_cost
        if tau / cost > best.value + 1e-12:
            best_n, best = n, Choice([], tau, cost, tau / cost)
    best.keep = sorted([0] + order[:best_n])
    return best


# --------------------------------------------------------------------------------------------------- measured costs
def clock_medians(clock: StepClock, verify_costs: dict[int, float]) -> tuple[float, float, float]:
    """(t(1) seconds now, drafter seconds per step, the loop's other seconds per step): running medians over the
    clock's steps, each target forward's seconds divided by its tree's relative cost t(n)/t(1)."""
    t1 = median([t / interp_cost(verify_costs, n) for _, t, _, n in clock.steps])
    return t1, median([d for d, _, _, _ in clock.steps]), median([o for _, _, o, _ in clock.steps])


@dataclass
class Prices:
    """Seconds that price a step: one-token target forward now, the drafter per step, the loop's other work."""

    t1: float
    draft: float
    other: float
    source: str  # where they come from (the record says)


class Scheduler:
    """The rule of the module docstring, priced on this machine. One per drafter (it remembers the last request's
    medians); `for_target` reads the cached cost profile (measured once if missing). pricing: "measured" (t(1) and
    d from the run's seconds) or "profile" (the profile alone: the same choices on every run)."""

    def __init__(self, verify_costs: dict[int, float], t1: float, profile: dict[str, Any] | None = None,
                 max_nodes: int | None = None, pricing: str = "measured"):
        self.verify_costs = {int(k): float(v) for k, v in verify_costs.items()}
        self.t1_profile = float(t1)
        self.profile = profile
        self.max_nodes = max_nodes
        self.pricing = check_pricing(pricing)
        self.memory: tuple[float, float, float] | None = None  # the last medians a request measured

    @classmethod
    def for_target(cls, target, refresh: bool = False, pricing: str = "measured") -> "Scheduler":
        prof = load_or_profile(target, refresh=refresh)
        return cls(relative_costs(prof), t1_seconds(prof), profile=prof, pricing=pricing)

    @property
    def measured(self) -> bool:
        """True when steps are priced by the run's own seconds (pricing="measured")."""
        return self.pricing == "measured"

    def prices(self, clock: StepClock | None, draft_now: float = 0.0) -> Prices:
        """This step's prices: the request's running medians, else the previous request's, else the profile's t(1)
        with the seconds this step's drafting has taken so far; pricing="profile": the profile's t(1) and no
        drafting or loop cost, the clock unread."""
        if not self.measured:
            return Prices(self.t1_profile, 0.0, 0.0, PROFILE_PRICES)
        if clock is not None and len(clock) >= MIN_CLOCK_STEPS:
            self.memory = clock_medians(clock, self.verify_costs)
            if self.memory[0] > 0:
                return Prices(*self.memory, "this request's running medians")
        if self.memory is not None and self.memory[0] > 0:
            return Prices(*self.memory, "the previous request's medians")
        return Prices(self.t1_profile, draft_now, 0.0, "the profile's t(1) and this step's draft so far")

    def source_seconds(self, seen: Sequence[float]) -> float:
        """One source's pass per step (a union's sources): the median of its measured seconds `seen`; 0 under
        pricing="profile" (drafting unpriced)."""
        return median(list(seen)) if self.measured else 0.0

    def fixed_cost(self, prices: Prices, draft_s: float | None = None) -> float:
        """d: the drafter's (or, draft_s, one source's) and the loop's seconds per step, in t(1) units (0 under
        pricing="profile")."""
        if not self.measured:
            return 0.0
        return ((prices.draft if draft_s is None else draft_s) + prices.other) / prices.t1

    def choose(self, cand: Candidates, prices: Prices, draft_s: float | None = None) -> Choice:
        return choose_nodes(cand.p, cand.tree.parents.tolist(), self.verify_costs, self.fixed_cost(prices, draft_s),
                            self.max_nodes)

    def cost_of(self, nodes: int, prices: Prices, draft_s: float | None = None) -> float:
        """A step verifying `nodes` tree nodes (root included), in t(1) units."""
        return interp_cost(self.verify_costs, nodes) + self.fixed_cost(prices, draft_s)

    def record(self) -> dict[str, Any]:
        """results.json's account of the scheduler's inputs."""
        prof = self.profile or {}
        measured = ("running median of the drafter's seconds per step (propose + observe) and of the loop's other "
                    "seconds per step, over t(1) now = running median of the target forward's seconds / t(n)/t(1) "
                    "of its tree (StepClock, fed by the generator)")
        return {"rule": RULE, "verify_relative": {str(k): v for k, v in sorted(self.verify_costs.items())},
                "t1_profile_s": self.t1_profile, "pricing": self.pricing, "window_steps": WINDOW_STEPS,
                "min_clock_steps": MIN_CLOCK_STEPS,
                "profile": {k: prof.get(k) for k in ("path", "cached", "noisy", "measured_at")} if prof else None,
                "draft_cost": measured if self.measured else PROFILE_PRICES}

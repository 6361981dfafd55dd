"""The per-step scheduler: which of this step's candidate draft nodes to verify, from per-node acceptance estimates
and this machine's measured cost profile (DSpark, Cheng et al. 2026, arXiv:2607.05147, Algorithm 1, the batch-1
case; Sequoia's hardware-aware value for trees). The tree-choice family: autotree.py chooses one tree shape per run,
this module chooses per step.

Rule. A step's candidates form a tree (node 0 the root); p_i is the estimated probability that node i is accepted
(the product of conditional acceptance rates along its path: for a DSpark block a_i = c_1 ... c_i from the calibrated
confidences). Verifying an ancestor-closed set S of draft nodes emits E[τ](S) = 1 + Σ_{i∈S} p_i tokens in expectation
(the bonus, plus each node: siblings are disjoint events) and costs t(|S|+1)/t(1) + d one-token target forwards,
d = the step's fixed cost (the drafters' passes and the loop's own work) in t(1) units. Each step verifies

    S* = argmax_S  E[τ](S) / (t(|S|+1)/t(1) + d),        S = {} (plain decoding, value 1 / (1 + d)) when nothing pays.

The cost depends on |S| only and p never rises down a path (`consistent`), so the best S of each size is the top-|S|
nodes by p (ties: parents first) and the search is one sorted pass (`choose_nodes`). A block drafter's chain makes S
a prefix: L = argmax (1 + a_1 + ... + a_L) / (t(L+1)/t(1) + d) (`choose_prefix`).

What is measured (nothing assumed):
- t(n)/t(1): the cached verification-cost profile of this machine + target + dtype (profile.load_or_profile with its
  noise guards), read through profile.interp_cost;
- t(1) now, and d: running medians over the request's last WINDOW_STEPS steps (`StepClock`, fed by the generator
  with each step's phase seconds): t(1) = target seconds / t(n)/t(1) of the step's tree, d = (drafter seconds per
  step + the loop's other seconds per step) / t(1). Until a request has MIN_CLOCK_STEPS steps the previous request's
  medians stand in; before any, the profile's t(1) and the seconds this step's drafting took so far.
- p: per source, `Rates` learned from outcomes with a prior (lookup: by match length and depth, per request; EAGLE /
  Medusa trees: by depth and rank, the `--tree auto` probe's matrix as prior; DSpark: its calibrated confidences).
Several sources (a head and prompt lookup, or several heads) are merged as a trie (a node proposed twice keeps the
larger estimate, never above its parent's) and one S is chosen across them: one verify budget per step.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

from specheads.infer.profile import interp_cost, load_or_profile, relative_costs, t1_seconds
from specheads.infer.tree import DraftTree, trie_union

log = logging.getLogger(__name__)

WINDOW_STEPS = 32  # steps the running medians look back over: recent enough to follow a machine whose load changes,
# long enough that one slow step (a collection, another job's burst) does not move them
MIN_CLOCK_STEPS = 4  # a request's own medians price its steps from its 4th step on (the median of 3 already drops
# one outlier); before that, the previous request's
PRIOR_STRENGTH = 2.0  # pseudo-observations of a rate's prior: Laplace's rule of succession (hits + 1) / (seen + 2)
PROBE_PRIOR_CAP = 16.0  # at most this many of the probe's observations weigh as the prior of a head's (depth, rank)
# rate, so that one request (~100 steps) can move it
MATCH_CAP = 8  # prompt-lookup match lengths of 8 tokens and more share one estimate
RULE = ("per step, verify the ancestor-closed set S of candidate nodes maximising (1 + Σ_S p_i) / (t(|S|+1)/t(1) + d)"
        ", p_i = estimated acceptance of node i, t(n)/t(1) = this machine's verification-cost profile, d = the "
        "drafters' and the loop's measured seconds per step / t(1) now (running medians); S = {} (plain decoding) "
        "when nothing pays (DSpark Algorithm 1, batch 1)")


# --------------------------------------------------------------------------------------------------- the value rule
@dataclass
class Candidates:
    """What one source (or a union of sources) offers to verify this step."""

    tree: DraftTree  # deterministic in a union; a block drafter alone may carry q rows (sampling)
    p: list[float]  # p[i] = estimated probability that node i is accepted; p[0] = 1 (the root is emitted anyway)
    source: str = ""


def survival(conf: Sequence[float]) -> list[float]:
    """a_i = c_1 ... c_i: the probability that drafts 1..i are all accepted, from per-position confidences."""
    out, s = [], 1.0
    for c in conf:
        s *= float(c)
        out.append(s)
    return out


def path_products(tree: DraftTree, rate: Callable[[int, int], float]) -> list[float]:
    """p of every node of `tree` from conditional rates: p_i = p_parent x rate(depth, rank) (rank = the node's
    position among its parent's children, best first)."""
    kids = tree.children_lists()
    p = [1.0] * len(tree)
    for parent, ch in enumerate(kids):
        for rank, c in enumerate(ch):
            p[c] = p[parent] * rate(int(tree.depth[c]), rank)
    return p


def consistent(p: Sequence[float], parents: Sequence[int]) -> list[float]:
    """p made a probability over a tree of disjoint sibling events: a node never above its parent, siblings never
    summing above their parent; a node lowered by a factor lowers its subtree by the same factor (its conditional
    rates are kept). Parents come before children."""
    n = len(p)
    kids: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        kids[int(parents[i])].append(i)
    out = [1.0] + [0.0] * (n - 1)
    for i in range(n):
        if not kids[i]:
            continue
        ratio = out[i] / p[i] if p[i] > 0 else 0.0  # how much node i was lowered
        vals = [min(max(float(p[c]), 0.0) * ratio, out[i]) for c in kids[i]]
        total = sum(vals)
        scale = out[i] / total if total > out[i] > 0 else 1.0
        for c, v in zip(kids[i], vals):
            out[c] = v * scale
    return out


@dataclass
class Choice:
    keep: list[int]  # node indices to verify, ascending, root included
    expected_tau: float  # 1 + Σ p over the kept draft nodes
    cost: float  # t(n)/t(1) + fixed cost, in one-token target forwards
    value: float  # expected_tau / cost (plain decoding without draft cost = 1)


def choose_nodes(p: Sequence[float], parents: Sequence[int], verify_costs: dict[int, float], fixed_cost: float,
                 max_nodes: int | None = None) -> Choice:
    """The rule of the module docstring over a candidate tree (p consistent: `consistent`). max_nodes: draft nodes
    at most (None = all)."""
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


def choose_prefix(conf: Sequence[float], verify_costs: dict[int, float], fixed_cost: float) -> Choice:
    """A block drafter's chain: the prefix length L = len(keep) - 1 maximising (1 + a_1..a_L) / (t(L+1)/t(1) + d)."""
    p = [1.0] + survival(conf)
    return choose_nodes(p, [-1] + list(range(len(conf))), verify_costs, fixed_cost)


# --------------------------------------------------------------------------------------------------- acceptance
class Rates:
    """Conditional acceptance rates by key, learned from outcomes with a prior per key: a Beta of mean m and strength
    s, so rate = (hits + s m) / (seen + s). prior(key) -> (m, s)."""

    def __init__(self, prior: Callable[[Hashable], tuple[float, float]] | None = None):
        self.prior = prior or (lambda key: (0.5, PRIOR_STRENGTH))
        self.hits: dict[Hashable, int] = {}
        self.seen: dict[Hashable, int] = {}

    def rate(self, key: Hashable, mean: float | None = None) -> float:
        m, s = self.prior(key)
        m = m if mean is None else mean
        return (self.hits.get(key, 0) + s * m) / (self.seen.get(key, 0) + s)

    def add(self, key: Hashable, accepted: bool) -> None:
        self.seen[key] = self.seen.get(key, 0) + 1
        self.hits[key] = self.hits.get(key, 0) + int(accepted)

    def clear(self) -> None:
        self.hits.clear()
        self.seen.clear()


class LookupRates:
    """Prompt lookup's tokens: P(accepted | parent accepted) by match length (tokens of the context that matched
    before the continuation, capped at MATCH_CAP) and depth, learned per request. Each (match, depth) cell is shrunk
    towards its match length's pooled rate, itself Laplace's (hits + 1) / (seen + 2)."""

    def __init__(self):
        self.by_match = Rates()
        self.cells = Rates()

    def rate(self, match: int, depth: int) -> float:
        m = min(match, MATCH_CAP)
        return self.cells.rate((m, depth), mean=self.by_match.rate(m))

    def add(self, match: int, depth: int, accepted: bool) -> None:
        m = min(match, MATCH_CAP)
        self.by_match.add(m, accepted)
        self.cells.add((m, depth), accepted)

    def clear(self) -> None:
        self.by_match.clear()
        self.cells.clear()


def rank_rates(acc: Sequence[Sequence[float]] | None = None, counts: Sequence[Sequence[int]] | None = None) -> Rates:
    """A tree head's P(accepted | parent accepted) by (depth, rank): the `--tree auto` probe's matrix acc[d-1][r] as
    prior (weighing its observations, at most PROBE_PRIOR_CAP), else 0.5 / (1 + rank) at Laplace strength (a
    head ranks its children by its own probability, so a lower rank is accepted more often)."""
    def prior(key):
        d, r = key
        if acc is not None and d - 1 < len(acc) and r < len(acc[d - 1]):
            n = counts[d - 1][r] if counts is not None else PROBE_PRIOR_CAP
            return float(acc[d - 1][r]), max(min(float(n), PROBE_PRIOR_CAP), 1.0)
        return 0.5 / (1 + r), PRIOR_STRENGTH

    return Rates(prior)


def outcomes(tree: DraftTree, truth: Sequence[int]) -> list[tuple[int, bool]]:
    """(node, accepted) for every node of `tree` whose parent lies on the true path (the step's emitted tokens
    `truth` from the root) at depth <= len(truth): accepted = its token is the true one there. Under greedy
    verification the emitted tokens are the target's own argmax continuation, so this is each candidate's outcome
    had it been verified, whether or not the scheduler kept it."""
    tokens, parents, depth = tree.tokens.tolist(), tree.parents.tolist(), tree.depth.tolist()
    on_path = {0}
    out = []
    for i in range(1, len(tree)):
        if parents[i] in on_path and depth[i] <= len(truth):
            ok = tokens[i] == truth[depth[i] - 1]
            out.append((i, ok))
            if ok:
                on_path.add(i)
    return out


def accepted_along(tree: DraftTree, truth: Sequence[int]) -> tuple[int, bool]:
    """(draft tokens of `tree` a greedy verification would accept, censored): censored = the tree matched all of
    `truth` and proposes deeper, so the figure is only a lower bound."""
    kids, tokens = tree.children_lists(), tree.tokens.tolist()
    cur = 0
    for n, tok in enumerate(truth):
        nxt = next((c for c in kids[cur] if tokens[c] == tok), None)
        if nxt is None:
            return n, False
        cur = nxt
    return len(truth), bool(kids[cur])


def merge_candidates(cands: Sequence[Candidates]) -> tuple[Candidates, list[list[int]]]:
    """Trie union of deterministic candidate trees: a node proposed by several sources gets the largest estimate,
    then `consistent` (never above its parent). Returns (the union, per source the union node of each of its nodes)."""
    tree, maps = trie_union([c.tree for c in cands])
    p = [0.0] * len(tree)
    p[0] = 1.0
    for c, where in zip(cands, maps):
        for j, i in enumerate(where):
            p[i] = max(p[i], c.p[j])
    return Candidates(tree, consistent(p, tree.parents.tolist()), "+".join(c.source for c in cands)), maps


# --------------------------------------------------------------------------------------------------- measured costs
class StepClock:
    """Each recent step's seconds by phase (the generator adds one entry per target forward): what the scheduler's
    t(1) and per-step costs are measured from."""

    def __init__(self, window: int = WINDOW_STEPS):
        self.steps: deque[tuple[float, float, float, int]] = deque(maxlen=window)  # (draft, target, other, nodes)

    def add_step(self, seconds: dict[str, float], nodes: int) -> None:
        other = sum(v for k, v in seconds.items() if k not in ("draft", "target"))
        self.steps.append((seconds.get("draft", 0.0), seconds.get("target", 0.0), other, int(nodes)))

    def __len__(self) -> int:
        return len(self.steps)

    def medians(self, verify_costs: dict[int, float]) -> tuple[float, float, float]:
        """(t(1) seconds now, drafter seconds per step, the loop's other seconds per step), running medians."""
        t1 = _median([t / interp_cost(verify_costs, n) for _, t, _, n in self.steps])
        return t1, _median([d for d, _, _, _ in self.steps]), _median([o for _, _, o, _ in self.steps])


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else 0.0


@dataclass
class Prices:
    """Seconds that price a step: one-token target forward now, the drafter per step, the loop's other work."""

    t1: float
    draft: float
    other: float
    source: str  # where they come from (the record says)


@dataclass
class StepReport:
    """What one scheduled step expected, and (greedy unions) what each source alone would have emitted: the
    generator adds these into GenerationStats."""

    expected_tau: float  # 1 + Σ p over the verified draft nodes
    expected_cost: float  # t(n)/t(1) + draft + loop, in one-token target forwards
    sources: dict[str, int] = field(default_factory=dict)  # tokens each source's own proposal alone would emit
    source_cost: dict[str, float] = field(default_factory=dict)  # its own step's cost alone, t(1) units
    censored: dict[str, bool] = field(default_factory=dict)  # its figure is a lower bound (its path was cut correct)
    rested: bool = False  # a union's step where every source rested: plain decoding

    def oracle(self) -> tuple[str, int, float, bool] | None:
        """The better source this step (more tokens; equal: the cheaper): (name, tokens, cost, censored)."""
        if not self.sources:
            return None
        name = max(self.sources, key=lambda s: (self.sources[s], -self.source_cost.get(s, 0.0)))
        return name, self.sources[name], self.source_cost.get(name, 0.0), self.censored.get(name, False)


class Scheduler:
    """The rule of the module docstring, priced on this machine. One per drafter (it remembers the last request's
    medians); `for_target` reads the cached cost profile (measured once if missing)."""

    def __init__(self, verify_costs: dict[int, float], t1: float, profile: dict[str, Any] | None = None,
                 max_nodes: int | None = None):
        self.verify_costs = {int(k): float(v) for k, v in verify_costs.items()}
        self.t1_profile = float(t1)
        self.profile = profile
        self.max_nodes = max_nodes
        self.memory: tuple[float, float, float] | None = None  # the last medians a request measured

    @classmethod
    def for_target(cls, target, refresh: bool = False) -> "Scheduler":
        prof = load_or_profile(target, refresh=refresh)
        return cls(relative_costs(prof), t1_seconds(prof), profile=prof)

    def prices(self, clock: StepClock | None, draft_now: float = 0.0) -> Prices:
        """This step's prices: the request's running medians, else the previous request's, else the profile's t(1)
        with the seconds this step's drafting has taken so far."""
        if clock is not None and len(clock) >= MIN_CLOCK_STEPS:
            self.memory = clock.medians(self.verify_costs)
            if self.memory[0] > 0:
                return Prices(*self.memory, "this request's running medians")
        if self.memory is not None and self.memory[0] > 0:
            return Prices(*self.memory, "the previous request's medians")
        return Prices(self.t1_profile, draft_now, 0.0, "the profile's t(1) and this step's draft so far")

    def fixed_cost(self, prices: Prices, draft_s: float | None = None) -> float:
        """d: the drafter's (or, draft_s, one source's) and the loop's seconds per step, in t(1) units."""
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
        return {"rule": RULE, "verify_relative": {str(k): v for k, v in sorted(self.verify_costs.items())},
                "t1_profile_s": self.t1_profile, "window_steps": WINDOW_STEPS, "min_clock_steps": MIN_CLOCK_STEPS,
                "profile": {k: prof.get(k) for k in ("path", "cached", "noisy", "measured_at")} if prof else None,
                "draft_cost": "running median of the drafter's seconds per step (propose + observe) and of the "
                              "loop's other seconds per step, over t(1) now = running median of the target "
                              "forward's seconds / t(n)/t(1) of its tree (StepClock, fed by the generator)"}

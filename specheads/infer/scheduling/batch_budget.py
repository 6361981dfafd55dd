"""The verify budget of a batch: how many of each row's draft nodes the next target forward verifies.

DSpark's Algorithm 1 in its batch form, over B rows whose trees are already drafted:
  every draft node i of row r is a candidate with survival probability s_ri = P(node i is accepted); the expected
  tokens of a step are E = sum_r (1 + the s_ri kept) (each row's bonus plus each kept node that survives); the step
  costs c(B, n) = t(B, n) / t(1, 1) for n tokens per row (profile.load_or_profile_batch's surface, read
  through costs.batch_cost_fn);
  candidates of ALL rows are added in order of falling survival while E / (c + overhead) rises, and the best point
  of that scan is kept (it goes on past a dip: with our padded forward, a width one row pays for is free for the
  others). The empty point is plain decoding (L = 0 for every row: E = B at c(B, 1)), so the choice never expects
  less than no speculation.
`choose_batch_budget` is that pure function. `AcceptanceTracker` estimates survival from verification outcomes alone
(per row and per (depth, rank), shrunk to the pooled rate), for drafters that give no node scores, and
`BudgetScheduler` plugs both into engine.batch.generate_batch (`scheduler=`): it cuts each row's tree to its budget.
Shapes: B rows, N tree nodes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from specheads.infer.scheduling.costs import CostFn, median
from specheads.infer.tree import DraftTree
from specheads.infer.verify import Accepted

MEDIAN_STEPS = 64  # steps behind the running medians of t(1, 1) and of a row's drafting


@dataclass
class BudgetChoice:
    keep: list[list[int]]  # per row: the tree nodes to verify, root (0) first, ancestor- and sibling-prefix-closed
    budgets: list[int]  # per row: draft nodes kept (L_r = len(keep[r]) - 1; 0 = plain decoding for that row)
    tokens_per_row: int  # n = 1 + max(L_r): the padded forward's width
    expected_tokens: float  # E = sum over rows of 1 + kept survivals
    expected_rate: float  # E / (cost(B, n) + overhead): tokens per t(1, 1)
    plain_rate: float  # B / (cost(B, 1) + overhead): no speculation


def effective_survival(survival: Sequence[float], parents: Sequence[int]) -> list[float]:
    """Survivals made non-increasing down each path and along each node's children in index order (min with the
    parent and the previous sibling), so that ranking by them keeps a node's parent and earlier siblings first.
    Sampling verification needs the earlier siblings: each child was drawn after them (tree.py)."""
    eff = [1.0] * len(survival)
    last_child: dict[int, int] = {}
    for i in range(1, len(survival)):
        p = int(parents[i])
        s = min(float(survival[i]), eff[p])
        if p in last_child:
            s = min(s, eff[last_child[p]])
        last_child[p] = i
        eff[i] = max(s, 0.0)
    return eff


def choose_batch_budget(survival: Sequence[Sequence[float]], cost: CostFn,
                        parents: Sequence[Sequence[int]] | None = None, overhead: float = 0.0,
                        packing: str = "padded") -> BudgetChoice:
    """survival[r][i]: P(node i of row r's tree is accepted), node 0 the root (its value is ignored); parents[r]
    the tree's parents (None = chains: the parent of i is i - 1); cost(B, n) relative to t(1, 1); overhead: the
    step's other work in the same unit. Candidates of all rows are ranked by survival and added one by one; the
    best point seen by expected tokens per unit of time is kept (the empty one = plain decoding).
    packing "flat" (engines that pack rows without padding): a step of T tokens costs cost(B, T / B).
    packing "padded" (our forward pads every row to the widest): once a candidate widens the forward to n, every
    row's own best n - 1 candidates ride along for free, so the ranked scan visits each width n = 1, 2, ... with
    every row filled to it; that is what is scored."""
    if packing not in ("padded", "flat"):
        raise ValueError(f"choose_batch_budget: packing {packing!r} is not padded or flat")
    B = len(survival)
    pars = [list(p) for p in parents] if parents is not None else [[-1] + list(range(len(s) - 1)) for s in survival]
    eff = [effective_survival(s, p) for s, p in zip(survival, pars)]
    ranked = [sorted(range(1, len(e)), key=lambda i, e=e: (-e[i], i)) for e in eff]  # each row's nodes, best first
    plain = B / (cost(B, 1) + overhead)
    best = (plain, [0] * B, float(B))  # (rate, candidates kept per row, E)
    if packing == "padded":
        for n in range(2, 2 + max(len(x) for x in ranked)):
            kept = [min(len(x), n - 1) for x in ranked]
            expected = B + sum(eff[r][i] for r, x in enumerate(ranked) for i in x[:kept[r]])
            rate = expected / (cost(B, n) + overhead)
            best = max(best, (rate, kept, expected), key=lambda b: b[0])
    else:
        kept, expected = [0] * B, float(B)
        for neg, r in sorted((-eff[r][i], r) for r, x in enumerate(ranked) for i in x):
            kept[r] += 1
            expected -= neg
            rate = expected / (cost(B, (B + sum(kept)) / B) + overhead)
            best = max(best, (rate, list(kept), expected), key=lambda b: b[0])
    rate, kept, expected = best
    keep = [sorted([0] + x[:k]) for x, k in zip(ranked, kept)]  # ancestor- and sibling-prefix-closed
    return BudgetChoice(keep, kept, 1 + max(kept), expected, rate, plain)


def child_ranks(tree: DraftTree) -> list[int]:
    """ranks[i] = node i's position among its parent's children (index order); the root gets 0."""
    ranks, seen = [0] * len(tree), {}
    for i, p in enumerate(tree.parents.tolist()[1:], start=1):
        ranks[i] = seen.get(p, 0)
        seen[p] = ranks[i] + 1
    return ranks


@dataclass
class AcceptanceTracker:
    """Survival estimates from verification outcomes alone (no drafter scores): alpha(d, k) = P(the rank-k child at
    depth d is accepted | its parent was), per row, shrunk toward the pooled rate of every row (weight `shrink`
    pseudo-observations), the pooled rate toward `prior` (weight `prior_weight`). Survival of a node = the product
    of alpha along its path (autotree's expected-τ arithmetic)."""

    prior: float = 0.5  # before any outcome: every child accepted half the time (optimistic enough to explore)
    prior_weight: float = 2.0  # pseudo-observations behind the prior
    shrink: float = 4.0  # pseudo-observations of the pooled rate behind each row's own
    pooled: dict = field(default_factory=dict)  # (d, k) -> [accepted, tried]
    rows: dict = field(default_factory=dict)  # row -> {(d, k) -> [accepted, tried]}

    def alpha(self, row, d: int, k: int) -> float:
        a, t = self.pooled.get((d, k), (0, 0))
        pooled = (a + self.prior * self.prior_weight) / (t + self.prior_weight)
        a, t = self.rows.get(row, {}).get((d, k), (0, 0))
        return (a + pooled * self.shrink) / (t + self.shrink)

    def survival(self, row, tree: DraftTree) -> list[float]:
        ranks, depth, parents = child_ranks(tree), tree.depth.tolist(), tree.parents.tolist()
        s = [1.0] * len(tree)
        for i in range(1, len(tree)):
            s[i] = s[parents[i]] * self.alpha(row, depth[i], ranks[i])
        return s

    def observe(self, row, tree: DraftTree, accepted: Accepted) -> None:
        """Every child of an accepted node was tried; the accepted path's children were accepted."""
        on_path, ranks, depth = set(accepted.nodes), child_ranks(tree), tree.depth.tolist()
        mine = self.rows.setdefault(row, {})
        for i, p in enumerate(tree.parents.tolist()[1:], start=1):
            if p not in on_path:
                continue
            key = (depth[i], ranks[i])
            for table in (self.pooled, mine):
                c = table.setdefault(key, [0, 0])
                c[0] += int(i in on_path)
                c[1] += 1


@dataclass
class ExploreClock:
    """When resting rows draft again: all together (in a padded forward one exploring row widens every row's
    forward: at B = 8 here t(8, 2) = 1.37 t(8, 1), so one exploring step serves them all), after `rest_steps` steps
    with some row resting. An exploring step on which no row pays doubles the wait, up to `longest`; one on which a
    row pays sets it back to `base`. Shared by reference, it carries across schedulers (the bench's chunks)."""

    base: int = 16  # steps of rest after the first failure (explore_every)
    longest: int = 256  # steps: the longest wait between explorations
    rest_steps: int = 0  # the current wait (0: base)
    since: int = 0  # steps since the last exploration on which some row rested

    def __post_init__(self):
        self.rest_steps = self.rest_steps or self.base

    @property
    def backed_off(self) -> bool:
        return self.rest_steps > self.base

    def due(self) -> bool:
        return self.since >= self.rest_steps

    def tick(self, anyone_resting: bool) -> None:
        self.since = self.since + 1 if anyone_resting else 0

    def explored(self, paid: bool) -> None:
        self.since = 0
        self.rest_steps = self.base if paid else min(2 * self.rest_steps, self.longest)


class BudgetScheduler:
    """engine.batch.generate_batch's `scheduler`. `depth_limits(rows)` before drafting, `select(trees, rows)` before
    the forward, `observe(rows, trees, accepted, draft_s, target_s)` after it.
    select: every row's tree is cut to the nodes `choose_batch_budget` keeps (survival from `survival_fn(row,
    tree)`, default the AcceptanceTracker's; the cost surface `cost(B, n)`). The drafting of this step is paid by
    then, so it does not enter this choice; it enters the next one:
    observe: t(1, 1) in seconds is read off the step's own forward (target_s / cost(B, n)) and one row's drafting
    d in that unit (draft_s over the rows that drafted), both running medians. A row keeps drafting only while the
    tokens its kept drafts add, g_r, pay for its drafting at the step's rate with drafting counted:
    g_r > d * E / (cost(B, n) + overhead + d * R) for the R rows drafting (adding row r raises tokens per unit of
    time exactly when its own g_r / d beats the rate); and the batch drafts only while that rate beats plain
    decoding's B / (cost(B, 1) + overhead). A row that does not pay rests (depth limit 0: no head pass, no draft
    nodes) until the ExploreClock says the resting rows draft again, all on one step; a row whose budget is still
    empty then verifies its most likely node, so a drafter that got better is noticed. While explorations find
    nothing the wait doubles (16, 32, ... 256 steps) and rows that join then start resting. draft_cost: d fixed
    instead of measured (0 = the cost surface alone decides; rows still rest when their budget is empty)."""

    def __init__(self, cost: CostFn, survival_fn: Callable | None = None, overhead: float = 0.0,
                 explore_every: int = 16, tracker: AcceptanceTracker | None = None, packing: str = "padded",
                 draft_cost: float | None = None, clock: ExploreClock | None = None):
        self.cost, self.overhead, self.packing = cost, overhead, packing
        self.draft_cost = draft_cost  # None: measured
        self.tracker = tracker or AcceptanceTracker()
        self.survival_fn = survival_fn or self.tracker.survival
        self.clock = clock or ExploreClock(base=explore_every)
        self.resting: set = set()  # rows not drafting until the next exploring step
        self.seen: set = set()  # rows that have been scheduled (a new row starts resting while the clock backs off)
        self.exploring: set = set()  # the resting rows drafting on this step
        self.unit_s: list[float] = []  # measured t(1, 1) in seconds, the last MEDIAN_STEPS steps
        self.draft_units: list[float] = []  # one row's drafting in units of t(1, 1), per step that drafted (same)
        self.last: dict = {}  # the last select: rows that drafted, their gains g_r and the forward's cost
        self.choices: list[tuple[int, int, float]] = []  # per step (rows, tokens per row, expected rate / plain)

    def depth_limits(self, rows: list) -> list[int | None] | None:
        """0 for each resting row (no drafting this step) unless this is an exploring step, None (no limit) else."""
        for r in rows:
            if r not in self.seen and self.clock.backed_off:
                self.resting.add(r)
            self.seen.add(r)
        resting = [r for r in rows if r in self.resting]
        self.exploring = set(resting) if resting and self.clock.due() else set()
        limits = [0 if r in self.resting and r not in self.exploring else None for r in rows]
        return None if all(x is None for x in limits) else limits

    def select(self, trees: list[DraftTree], rows: list) -> list[DraftTree]:
        self.clock.tick(any(r in self.resting for r in rows))
        drafted = [r for r, t in zip(rows, trees) if len(t) > 1]
        self.last = {"drafted": drafted, "gains": {}, "cost": self.cost(len(trees), 1) + self.overhead}
        if not drafted:  # nothing drafted (every row resting, or no drafts): plain decoding
            self.choices.append((len(trees), 1, 1.0))
            return trees
        surv = [self.survival_fn(r, t) for r, t in zip(rows, trees)]
        parents = [t.parents.tolist() for t in trees]
        choice = choose_batch_budget(surv, self.cost, parents, self.overhead, self.packing)
        keep = [k if len(k) > 1 or len(t) == 1 or r not in self.exploring else [0, 1]
                for r, t, k in zip(rows, trees, choice.keep)]  # a row back from rest verifies its best node
        for r, t, k, sv, ps in zip(rows, trees, keep, surv, parents):
            if len(t) > 1:
                eff = effective_survival(sv, ps)
                self.last["gains"][r] = sum(eff[i] for i in k[1:])
        width = max(len(k) for k in keep)
        self.last["cost"] = self.cost(len(trees), width) + self.overhead
        self.choices.append((len(trees), width, choice.expected_rate / choice.plain_rate))
        return [t if len(k) == len(t) else t.select(torch.tensor(k)) for t, k in zip(trees, keep)]

    def observe(self, rows: list, trees: list[DraftTree], accepted: list[Accepted], draft_s: float | None = None,
                target_s: float | None = None) -> None:
        for r, t, a in zip(rows, trees, accepted):
            self.tracker.observe(r, t, a)
        width = max(len(t) for t in trees)
        if target_s:
            self.unit_s = self.unit_s[-(MEDIAN_STEPS - 1):] + [target_s / self.cost(len(trees), width)]
        drafted = self.last.get("drafted", [])
        if draft_s is not None and drafted and self.unit_s:
            self.draft_units = self.draft_units[-(MEDIAN_STEPS - 1):] + [
                draft_s / median(self.unit_s) / len(drafted)]
        self._rest(rows, drafted)

    def _rest(self, rows: list, drafted: list) -> None:
        """Rows whose drafting did not pay this step rest; the others draft on (module docstring's rule)."""
        d = self.draft_cost if self.draft_cost is not None else median(self.draft_units)
        gains, last = self.last.get("gains", {}), self.last
        paying = [r for r in drafted if gains.get(r, 0.0) > 0.0]
        while True:
            rate = (len(rows) + sum(gains[r] for r in paying)) / (last["cost"] + d * len(paying))
            keep = [r for r in paying if gains[r] > d * rate]
            if keep == paying:
                break
            paying = keep
        plain = len(rows) / (self.cost(len(rows), 1) + self.overhead)
        if paying and rate <= plain:
            paying = []
        for r in drafted:
            (self.resting.discard if r in paying else self.resting.add)(r)
        if self.exploring:
            self.clock.explored(paid=any(r in paying for r in self.exploring))
            self.exploring = set()


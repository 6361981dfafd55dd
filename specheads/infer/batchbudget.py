"""The verify budget of a batch: how many of each row's draft nodes the next target forward verifies.

DSpark's Algorithm 1 in its batch form, over B rows whose trees are already drafted:
  every draft node i of row r is a candidate with survival probability s_ri = P(node i is accepted); the expected
  tokens of a step are E = sum_r (1 + the s_ri kept) (each row's bonus plus each kept node that survives); the step
  costs c(B, n) = t(B, n) / t(1, 1) for n tokens per row (profile.load_or_profile_batch's surface);
  candidates of ALL rows are added in order of falling survival while E / (c + overhead) rises, and the best point
  of that scan is kept (it goes on past a dip: with our padded forward, a width one row pays for is free for the
  others). The empty point is plain decoding (L = 0 for every row: E = B at c(B, 1)), so the choice never expects
  less than no speculation.
`choose_batch_budget` is that pure function. `AcceptanceTracker` estimates survival from verification outcomes alone
(per row and per (depth, rank), shrunk to the pooled rate), for drafters that give no node scores, and
`BudgetScheduler` plugs both into batch.generate_batch (`scheduler=`): it cuts each row's tree to its budget.
Shapes: B rows, N tree nodes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from specheads.infer.tree import DraftTree
from specheads.infer.verify import Accepted

CostFn = Callable[[int, int], float]  # cost(B rows, n tokens per row) = t(B, n) / t(1, 1)


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

    def forget(self, row) -> None:
        self.rows.pop(row, None)


class BudgetScheduler:
    """batch.generate_batch's `scheduler`. `depth_limits(rows)` before drafting, `select(trees, rows)` before the
    forward, `observe(rows, trees, accepted)` after it.
    select: every row's tree is cut to the nodes `choose_batch_budget` keeps (survival from `survival_fn(row,
    tree)`, default the AcceptanceTracker's; the cost surface `cost(B, n)`).
    Once the whole batch chose plain decoding, the next steps skip drafting (depth limit 0: the estimates cannot
    change without outcomes) until `explore_every` steps have passed; then the rows draft again and, if plain is
    still the choice, that step verifies each row's most likely node, so a drafter that got better is noticed."""

    def __init__(self, cost: CostFn, survival_fn: Callable | None = None, overhead: float = 0.0,
                 explore_every: int = 16, tracker: AcceptanceTracker | None = None, packing: str = "padded"):
        self.cost, self.overhead, self.explore_every, self.packing = cost, overhead, explore_every, packing
        self.tracker = tracker or AcceptanceTracker()
        self.survival_fn = survival_fn or self.tracker.survival
        self.plain_streak = 0  # steps since the batch last chose plain decoding with drafts in hand (0 = drafting)
        self.choices: list[tuple[int, int, float]] = []  # per step (rows, tokens per row, expected rate / plain)

    def depth_limits(self, rows: list[int]) -> list[int] | None:
        """0 for every row while the batch rests on plain decoding (no drafting), else None (no limit)."""
        return [0] * len(rows) if 0 < self.plain_streak < self.explore_every else None

    def select(self, trees: list[DraftTree], rows: list[int]) -> list[DraftTree]:
        if all(len(t) == 1 for t in trees):  # nothing drafted (skipped, or no drafts): plain decoding
            self.plain_streak += self.plain_streak > 0
            self.choices.append((len(trees), 1, 1.0))
            return trees
        surv = [self.survival_fn(r, t) for r, t in zip(rows, trees)]
        choice = choose_batch_budget(surv, self.cost, [t.parents.tolist() for t in trees], self.overhead,
                                     self.packing)
        keep = choice.keep
        if choice.tokens_per_row > 1:
            self.plain_streak = 0
        elif self.plain_streak >= self.explore_every:  # explore: each row's first child of the root
            keep, self.plain_streak = [[0, 1] if len(t) > 1 else [0] for t in trees], 0
        else:
            self.plain_streak = 1
        self.choices.append((len(trees), max(len(k) for k in keep), choice.expected_rate / choice.plain_rate))
        return [t if len(k) == len(t) else t.select(torch.tensor(k)) for t, k in zip(trees, keep)]

    def observe(self, rows: list[int], trees: list[DraftTree], accepted: list[Accepted]) -> None:
        for r, t, a in zip(rows, trees, accepted):
            self.tracker.observe(r, t, a)

"""What the per-step choice (step.py) reads: a step's candidate draft nodes with per-node acceptance estimates p
(`Candidates`), how p is made from conditional rates (`survival` for a block's calibrated confidences,
`path_products` for a tree, `consistent`: a probability over disjoint sibling events), the rates learned from
outcomes with a prior (`Rates`, prompt lookup's `LookupRates`, a tree head's `rank_rates`), each candidate's
outcome against the emitted tokens (`outcomes`, `accepted_along`), and the trie union of several sources'
candidates (`merge_candidates`: a node proposed twice keeps the larger estimate, never above its parent's).
Shapes: N tree nodes (node 0 the root).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

from specheads.infer.tree import DraftTree, trie_union

PRIOR_STRENGTH = 2.0  # pseudo-observations of a rate's prior: Laplace's rule of succession (hits + 1) / (seen + 2)
PROBE_PRIOR_CAP = 16.0  # at most this many of the probe's observations weigh as the prior of a head's (depth, rank)
# rate, so that one request (~100 steps) can move it
MATCH_CAP = 8  # prompt-lookup match lengths of 8 tokens and more share one estimate


# --------------------------------------------------------------------------------------------------- candidates
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



# --------------------------------------------------------------------------------------------------- rates
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


# --------------------------------------------------------------------------------------------------- outcomes, unions
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

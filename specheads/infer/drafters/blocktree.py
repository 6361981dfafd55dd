"""Trees over a block head's drafts (DDTree): one block pass gives every draft position j a distribution; instead of
verifying one chain, the drafter offers the best-first tree of the most probable prefixes.

A node is a path of per-position ranks (r_1 .. r_d): rank r at position j is the r-th most probable token of
position j's distribution (greedy), or the r-th token drawn from it without replacement (sampling). Every node at
depth j reads position j's distribution from the ONE block pass, whatever its path (the block's Markov bias read
the chain's own drafts), so a tree costs no head pass beyond the chain's. Its estimated acceptance is the product
along its path of per-position factors (`rank_factors`): rank 0 gets the chain's conditional rate c_j (the head's
calibrated confidence, or the per-depth rate learned per request), rank r >= 1 the rest of the mass shared as the
distribution shares it, (1 - c_j) P_j(r) / (1 - P_j(0)), so siblings never sum above their parent. `best_first`
keeps the N nodes of largest estimate (a connected tree: a child never outranks its parent); the scheduler
(`tree:auto`) or a fixed node budget (`tree:N`) decides N.

Sampling stays lossless (verify_sampling): node v's children are drawn from q_v = position depth(v)+1's warped
distribution without replacement, in index order; the chain's node keeps its drawn draft as first child and the
rest are fresh draws from q without it; every other node's children are fresh draws. The shape is decided from the
sorted q probabilities (never from the fresh draws), so whether a child exists never depends on the token drawn
for it. Shapes: K drafts per block, R ranks per position, V / V' target / draft vocabulary, N tree nodes.
"""
from __future__ import annotations

import heapq
from typing import Sequence

import torch

from specheads.infer.engine.protocol import DraftContext
from specheads.infer.scheduling.acceptance import Candidates
from specheads.infer.tree import DraftTree, tree_from_parents

BRANCH = 8  # ranks per position a tree may use (R): DDTree's gains come from the first few ranks of each position
AUTO_NODES = 64  # draft nodes offered to the scheduler (`tree:auto`); it keeps the prefix of them that pays


def rank_factors(first: float, probs: Sequence[float]) -> list[float]:
    """Per-rank factors of one position: [c, (1 - c) P(1) / (1 - P(0)), ...]. first: the chain's conditional rate
    c; probs: the position's probabilities by rank, descending (P(0) the top token's). Each factor is capped at
    the one before it (a confident chain can rate its own rank 0 below the share rank 1 gets), so a node never
    outranks its earlier sibling: best_first is exact, and any top-n by estimate keeps each parent's children a
    prefix of its ranks (sampling draws them in that order)."""
    c = min(max(float(first), 0.0), 1.0)
    rest = 1.0 - float(probs[0]) if probs else 0.0
    out = [c]
    for pr in probs[1:]:
        out.append(min(out[-1], (1.0 - c) * float(pr) / rest if rest > 1e-12 else 0.0))
    return out


def best_first(factors: Sequence[Sequence[float]], budget: int) -> list[tuple[tuple[int, ...], float]]:
    """The `budget` rank paths of largest product of factors (factors[j][r]: position j+1, rank r), best first, each
    with its product; a path's parent always comes before it (a child's product never exceeds its parent's, and on
    a tie the parent was popped first). Paths of product 0 are never kept."""
    out: list[tuple[tuple[int, ...], float]] = []
    if not factors or not factors[0]:
        return out
    tick = 0  # insertion order breaks ties: parents and lower ranks first
    heap = [(-float(factors[0][0]), tick, (0,), 1.0)]  # (-product, order, path, the parent's product)
    while heap and len(out) < budget:
        neg, _, path, parent = heapq.heappop(heap)
        if -neg <= 0:
            break
        out.append((path, -neg))
        d, r = len(path) - 1, path[-1]
        if r + 1 < len(factors[d]):  # the next sibling: same parent, next rank
            tick += 1
            heapq.heappush(heap, (-parent * float(factors[d][r + 1]), tick, path[:-1] + (r + 1,), parent))
        if d + 1 < len(factors):  # the first child: next position, rank 0
            tick += 1
            heapq.heappush(heap, (neg * float(factors[d + 1][0]), tick, path + (0,), -neg))
    return out


def chain_first(paths: Sequence[tuple[tuple[int, ...], float]]) -> list[tuple[tuple[int, ...], float]]:
    """The kept paths reordered: the chain (all ranks 0) first, by depth, then the rest best first. Parents still
    precede children and siblings stay in rank order, so node d (1..k) is the chain's draft d."""
    chain = [x for x in paths if not any(x[0])]
    return sorted(chain, key=lambda x: len(x[0])) + [x for x in paths if any(x[0])]


def tree_of_paths(root: int, paths: Sequence[tuple[tuple[int, ...], float]], token) -> Candidates:
    """Candidates of rank paths (parents first): node tokens token(path, parent node) and estimates p."""
    index: dict[tuple[int, ...], int] = {(): 0}
    tokens, parents, p = [root], [-1], [1.0]
    for path, prob in paths:
        par = index[path[:-1]]
        index[path] = len(tokens)
        tokens.append(int(token(path, par)))
        parents.append(par)
        p.append(prob)
    return Candidates(tree_from_parents(tokens, parents), p)


def greedy_tree(drafter, ctx: DraftContext, logits: torch.Tensor, conf: Sequence[float] | None, k: int,
                budget: int) -> Candidates:
    """The best-first tree over one greedy block: logits [K', V'] of the block pass, conf [K'] calibrated
    confidences or None (the drafter's learned per-depth rates), the first k positions, `budget` draft nodes."""
    head = drafter.head
    r = min(BRANCH, logits.shape[-1])
    probs = torch.softmax(logits[:k].float(), -1)  # [k, V'] the head's own distribution per position
    top_p, top_i = probs.topk(r, dim=-1)  # [k, R]
    ids = head.to_target_ids(top_i).cpu().tolist()  # [k][R] target ids by rank
    conf = [drafter.depth_rates.rate(d) for d in range(1, k + 1)] if conf is None else list(conf)
    factors = [rank_factors(conf[j], top_p[j].tolist()) for j in range(k)]
    paths = chain_first(best_first(factors, budget))
    cand = tree_of_paths(ctx.ids[-1], paths, lambda path, par: ids[len(path) - 1][path[-1]])
    cand.source = drafter.name
    return cand


def sampled_tree(drafter, ctx: DraftContext, drafts: list[int], conf: Sequence[float] | None, q: torch.Tensor,
                 budget: int) -> Candidates:
    """The best-first tree over one sampled block: drafts [k] the chain drawn by the block pass (draft j from q[j],
    the next draft's Markov bias reading it), q [k+1, V] the warped distributions (target vocabulary), conf as in
    greedy_tree. The shape comes from each position's sorted probabilities; node v's children are draws without
    replacement from q[depth(v)] (the chain's node: its draft first), so the tree's q rows are q[depth]."""
    k, gen = len(drafts), ctx.generator
    r = min(BRANCH, q.shape[-1])
    top_p = q[:k].topk(r, dim=-1).values  # [k, R] sorted probabilities: the shape never reads a draw
    conf = [drafter.depth_rates.rate(d) for d in range(1, k + 1)] if conf is None else list(conf)
    paths = chain_first(best_first([rank_factors(conf[j], top_p[j].tolist()) for j in range(k)], budget))
    width: dict[tuple[int, ...], int] = {}  # children per parent path
    for path, _ in paths:
        width[path[:-1]] = max(width.get(path[:-1], 0), path[-1] + 1)
    drawn: dict[tuple[int, ...], list[int]] = {}
    for parent, n in width.items():
        d, row = len(parent), q[len(parent)].double()
        if not any(parent):  # the chain's node: its own draft, then draws from q without it
            first = drafts[d]
            row = row.clone()
            row[first] = 0.0
            more = torch.multinomial(row.float(), n - 1, replacement=False, generator=gen).tolist() if n > 1 else []
            drawn[parent] = [first] + more
        else:
            drawn[parent] = torch.multinomial(row.float(), n, replacement=False, generator=gen).tolist()
    cand = tree_of_paths(ctx.ids[-1], paths, lambda path, par: drawn[path[:-1]][path[-1]])
    cand.tree = DraftTree(cand.tree.tokens, cand.tree.parents, cand.tree.depth, q[cand.tree.depth])
    cand.source = drafter.name
    return cand


def chain_nodes(tree: DraftTree) -> list[int]:
    """The chain's nodes of a block tree (chain_first order): each node's first child from the root down."""
    kids, out, cur = tree.children_lists(), [], 0
    while kids[cur] and int(tree.depth[kids[cur][0]]) == len(out) + 1 and kids[cur][0] == len(out) + 1:
        cur = kids[cur][0]
        out.append(cur)
    return out

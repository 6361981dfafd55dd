"""Draft trees: what a drafter proposes and the target verifies in one forward.

N tree nodes, K heads/depth, V vocab. Node 0 is the root: the last emitted token, not yet in the target's cache.
Parents always come before children (parents[i] < i), so one pass in index order visits a path top-down.
The attention mask and position ids are derived from `parents` / `depth`, never stored.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from specheads.utils import SpecheadsError


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [N] long; tokens[0] = root
    parents: torch.Tensor  # [N] long; parents[0] = -1, parents[i] < i
    depth: torch.Tensor  # [N] long; depth[0] = 0, depth[i] = depth[parents[i]] + 1
    q: torch.Tensor | None = None  # [N, V] draft distribution node i's children were drawn from; None = deterministic

    def __post_init__(self):
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.long).reshape(-1)
        self.parents = torch.as_tensor(self.parents, dtype=torch.long).reshape(-1)
        self.depth = torch.as_tensor(self.depth, dtype=torch.long).reshape(-1)
        n = self.tokens.numel()
        if n == 0 or self.parents.numel() != n or self.depth.numel() != n:
            raise ValueError(f"DraftTree: tokens/parents/depth must have the same length >= 1, got "
                             f"{self.tokens.numel()}/{self.parents.numel()}/{self.depth.numel()}")
        if int(self.parents[0]) != -1 or int(self.depth[0]) != 0:
            raise ValueError("DraftTree: node 0 must be the root (parent -1, depth 0)")
        if n > 1:
            idx = torch.arange(1, n)
            par = self.parents[1:]
            if bool((par < 0).any()) or bool((par >= idx).any()):
                raise ValueError("DraftTree: every parent must come before its child")
            if not torch.equal(self.depth[1:], self.depth[par] + 1):
                raise ValueError("DraftTree: depth[i] must equal depth[parents[i]] + 1")
        if self.q is not None and self.q.shape[0] != n:
            raise ValueError(f"DraftTree: q has {self.q.shape[0]} rows for {n} nodes")

    def __len__(self) -> int:
        return self.tokens.numel()

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    def children_lists(self) -> list[list[int]]:
        """children_lists()[i] = node i's children in index order (one pass; verification walks these)."""
        kids: list[list[int]] = [[] for _ in range(len(self))]
        for i, par in enumerate(self.parents.tolist()[1:], start=1):
            kids[par].append(i)
        return kids

    def path(self, i: int) -> list[int]:
        """Node indices from the root down to node i (inclusive)."""
        out = []
        while i >= 0:
            out.append(i)
            i = int(self.parents[i])
        return out[::-1]

    def ancestors(self) -> torch.Tensor:
        """[N, N] bool: a[i, j] = node j is node i itself or one of its ancestors (one vectorised hop per depth)."""
        n = len(self)
        a = torch.eye(n, dtype=torch.bool)
        rows, up = torch.arange(n), self.parents.clone()  # up[i] = the ancestor of i one more hop up (-1: none)
        for _ in range(self.max_depth):
            ok = up >= 0
            a[rows[ok], up[ok]] = True
            up = torch.where(ok, self.parents[up.clamp(min=0)], up)
        return a

    def attention_mask(self, cache_len: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
        """[1, 1, N, cache_len + N] float: 0 where a node attends (whole cached prefix, ancestors, itself), -inf else."""
        n = len(self)
        allowed = torch.cat([torch.ones(n, cache_len, dtype=torch.bool), self.ancestors()], dim=1)
        mask = torch.zeros(n, cache_len + n, dtype=dtype)
        mask.masked_fill_(~allowed, float("-inf"))
        return mask[None, None].to(device) if device is not None else mask[None, None]

    def position_ids(self, cache_len: int, device=None) -> torch.Tensor:
        """[1, N] long: position of node i = cache_len + depth[i] (the root sits right after the cached prefix)."""
        pos = (cache_len + self.depth)[None]
        return pos.to(device) if device is not None else pos

    def truncate_depth(self, max_depth: int) -> "DraftTree":
        """Drop nodes deeper than max_depth (used near the end of the context window)."""
        keep = (self.depth <= max_depth).nonzero().flatten()
        return self.select(keep)

    def select(self, keep: torch.Tensor) -> "DraftTree":
        """Sub-tree on the (sorted, ancestor-closed) node indices `keep`; node 0 must be kept."""
        keep = torch.as_tensor(keep, dtype=torch.long).sort().values
        remap = torch.full((len(self),), -1, dtype=torch.long)
        remap[keep] = torch.arange(keep.numel())
        par = self.parents[keep]
        new_par = torch.where(par >= 0, remap[par.clamp(min=0)], par)
        if int(keep[0]) != 0 or bool((new_par[1:] < 0).any()):
            raise ValueError("DraftTree.select: the kept nodes must include the root and every kept node's parent")
        return DraftTree(self.tokens[keep], new_par, self.depth[keep], None if self.q is None else self.q[keep])


def chain_tree(root: int, tokens: Sequence[int], q: torch.Tensor | None = None) -> DraftTree:
    """A chain (tree of width 1): root -> tokens[0] -> tokens[1] ...; q [1+len(tokens), V] or None."""
    n = 1 + len(tokens)
    return DraftTree(torch.tensor([root, *tokens], dtype=torch.long), torch.arange(-1, n - 1),
                     torch.arange(n), q)


def tree_from_parents(tokens: Sequence[int], parents: Sequence[int], q: torch.Tensor | None = None) -> DraftTree:
    """A tree given node by node: tokens [N] and parents [N] (parents[0] = -1, parents[i] < i); depth derived."""
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return DraftTree(torch.tensor(list(tokens), dtype=torch.long), torch.tensor(list(parents), dtype=torch.long),
                     torch.tensor(depth, dtype=torch.long), q)


def trie_union(trees: Sequence[DraftTree]) -> tuple[DraftTree, list[list[int]]]:
    """Union of deterministic trees over the same root as a trie (same token under the same parent = one node):
    the first tree's nodes keep their indices, each further tree's new nodes are appended in its order. Returns
    (the union, per tree the union node of each of its nodes). q must be None on every tree (mixing sampled and
    point-mass proposals per node would need their mixture as q)."""
    if any(t.q is not None for t in trees):
        raise ValueError("trie_union: only deterministic trees (q None) can be merged")
    if len({int(t.tokens[0]) for t in trees}) != 1:
        raise ValueError("trie_union: the trees have different roots")
    toks, pars, deps = [int(trees[0].tokens[0])], [-1], [0]
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> union node
    maps = []
    for t in trees:
        where = [0]  # t's node j -> union node
        for p, tok in zip(t.parents.tolist()[1:], t.tokens.tolist()[1:]):
            key = (where[p], tok)
            if key not in index:
                index[key] = len(toks)
                toks.append(tok)
                pars.append(key[0])
                deps.append(deps[key[0]] + 1)
            where.append(index[key])
        maps.append(where)
    return DraftTree(torch.tensor(toks), torch.tensor(pars), torch.tensor(deps)), maps


# ---------------------------------------------------------------------------------------------------------------
# Static trees (Medusa "choices"): a choice is a path of per-head top-k ranks, e.g. [0, 1] = head 0's top-1 token,
# then head 1's top-2 token under it.
# ---------------------------------------------------------------------------------------------------------------

def normalize_choices(choices: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """Deduplicate, add missing prefixes (a tree must be connected) and sort parents before children."""
    out: set[tuple[int, ...]] = set()
    for c in choices:
        c = tuple(int(r) for r in c)
        if not c or any(r < 0 for r in c):
            raise SpecheadsError(f"tree choice {list(c)}: must be a non-empty list of ranks >= 0")
        for i in range(1, len(c) + 1):
            out.add(c[:i])
    return sorted(out, key=lambda c: (len(c), c))


def tree_from_paths(root: int, paths: Sequence[Sequence[int]],
                    token: Callable[[tuple[int, ...], int], int | None]) -> DraftTree:
    """A tree grown along rank paths in the given order (parents first): path c becomes a node under path c[:-1]'s
    node with token(c, the parent node's token); a path whose parent is not in the tree, or whose token is None,
    is left out (and so are the paths under it)."""
    index: dict[tuple[int, ...], int] = {(): 0}
    tokens, parents, depth = [root], [-1], [0]
    for c in paths:
        c = tuple(c)
        p = index.get(c[:-1])
        if p is None:
            continue
        t = token(c, tokens[p])
        if t is None:
            continue
        index[c] = len(tokens)
        tokens.append(int(t))
        parents.append(p)
        depth.append(len(c))
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depth))


def tree_from_choices(root: int, topk_ids: torch.Tensor, choices: Sequence[Sequence[int]]) -> DraftTree:
    """Medusa static tree. topk_ids [K, R]: head k's token ids by rank; choice (r_0..r_d) gets topk_ids[d, r_d]."""
    k_heads, ranks = topk_ids.shape

    def token(c: tuple[int, ...], parent_token: int) -> int | None:
        if len(c) > k_heads or c[-1] >= ranks:
            return None  # deeper than the heads, or a rank beyond the computed top-k: not proposable
        return int(topk_ids[len(c) - 1, c[-1]])

    return tree_from_paths(root, normalize_choices(choices), token)


# Medusa's default-ish small tree: 1 + 25 nodes, 4 heads (a chain of top-1 plus top-k branches near the root).
DEFAULT_MEDUSA_CHOICES = [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
                          [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [1, 0, 0], [1, 0, 1], [2, 0, 0],
                          [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0], [0, 1, 0, 0], [1, 0, 0, 0]]


# ---------------------------------------------------------------------------------------------------------------
# Dynamic trees (EAGLE-2): expand the top-k children of the best frontier nodes by cumulative log-prob for `depth`
# steps, then rerank every generated node and keep the `total_tokens` best (a connected tree, parents first).
# ---------------------------------------------------------------------------------------------------------------

def dynamic_tree(root: int, expand: Callable[[list[int], list[int], list[int]], torch.Tensor], depth: int,
                 top_k: int, total_tokens: int, to_target: Callable | None = None) -> DraftTree:
    """`expand(nodes, tokens, parents)` receives the nodes to expand (indices into the growing node list, plus the
    full token/parent lists so far, target ids) and returns their children's log-probs [len(nodes), V'] (draft
    vocab; `to_target` maps top-k draft ids [F, k] to target ids, None = same vocab).
    depth: expansion steps (tree depth <= depth); top_k: children per expanded node and frontier width;
    total_tokens: draft nodes kept after reranking (root excluded)."""
    tokens, parents, score = [root], [-1], [0.0]  # score = cumulative log-prob of the path to the node
    dep = [0]
    frontier = [0]
    for _ in range(depth):
        logp = expand(frontier, tokens, parents)  # [F, V]
        top_lp, top_ids = logp.topk(min(top_k, logp.shape[-1]), dim=-1)  # [F, k]
        if to_target is not None:
            top_ids = to_target(top_ids)
        top_lp, top_ids = top_lp.cpu(), top_ids.cpu()
        cand = []
        for row, node in enumerate(frontier):
            for lp, tok in zip(top_lp[row].tolist(), top_ids[row].tolist()):
                tokens.append(tok)
                parents.append(node)
                dep.append(dep[node] + 1)
                score.append(score[node] + lp)
                cand.append(len(tokens) - 1)
        # next frontier: the top_k candidates of this layer by cumulative log-prob (EAGLE-2 expansion)
        cand.sort(key=lambda i: -score[i])
        frontier = cand[:top_k]
        if not frontier:
            break
    # rerank: the total_tokens best nodes by score; ties broken by depth so a parent precedes its child, and a node
    # is only kept when its parent is (log-probs <= 0, so a child never outranks its parent otherwise)
    order = sorted(range(1, len(tokens)), key=lambda i: (-score[i], dep[i], i))
    kept = {0}
    for i in order:
        if len(kept) > total_tokens:
            break
        if parents[i] in kept:
            kept.add(i)
    keep = sorted(kept, key=lambda i: (dep[i], i))
    remap = {old: new for new, old in enumerate(keep)}
    return DraftTree(torch.tensor([tokens[i] for i in keep]),
                     torch.tensor([-1] + [remap[parents[i]] for i in keep[1:]]),
                     torch.tensor([dep[i] for i in keep]))

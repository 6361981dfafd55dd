"""DraftTree structure: masks, positions, the builders (chain, parents, rank paths, Medusa choices, trie union),
dynamic (EAGLE-2) trees."""
import math

import pytest
import torch

from specheads.infer.tree import (DraftTree, chain_tree, dynamic_tree, normalize_choices, tree_from_choices,
                                  tree_from_parents, tree_from_paths, trie_union)
from specheads.utils import SpecheadsError

NEG = float("-inf")


def small_tree():
    #        0(root=10)
    #       /        \
    #    1(11)       2(12)
    #    /   \         \
    #  3(13) 4(14)     5(15)
    return DraftTree([10, 11, 12, 13, 14, 15], [-1, 0, 0, 1, 1, 2], [0, 1, 1, 2, 2, 2])


def test_mask_attends_prefix_ancestors_and_self_only():
    m = small_tree().attention_mask(cache_len=3)
    assert m.shape == (1, 1, 6, 9) and m.dtype == torch.float32
    allowed = (m[0, 0] == 0)
    assert allowed[:, :3].all()  # every node sees the whole cached prefix
    tree_part = allowed[:, 3:].int().tolist()
    assert tree_part == [[1, 0, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0, 0],
                         [1, 0, 1, 0, 0, 0],
                         [1, 1, 0, 1, 0, 0],
                         [1, 1, 0, 0, 1, 0],
                         [1, 0, 1, 0, 0, 1]]
    assert (m[0, 0][~allowed] == NEG).all()


def test_positions_follow_depth_and_paths():
    t = small_tree()
    assert t.position_ids(7).tolist() == [[7, 8, 8, 9, 9, 9]]
    assert t.path(4) == [0, 1, 4] and t.path(5) == [0, 2, 5]
    assert t.children_lists() == [[1, 2], [3, 4], [5], [], [], []]


def test_invalid_trees_are_rejected():
    with pytest.raises(ValueError):
        DraftTree([1, 2], [-1, 1], [0, 1])  # a node is its own parent
    with pytest.raises(ValueError):
        DraftTree([1, 2, 3], [-1, 0, 0], [0, 1, 2])  # wrong depth
    with pytest.raises(ValueError):
        DraftTree([1, 2], [0, 0], [0, 1])  # root has a parent


def test_truncate_and_chain():
    t = small_tree().truncate_depth(1)
    assert t.tokens.tolist() == [10, 11, 12] and t.parents.tolist() == [-1, 0, 0]
    c = chain_tree(5, [6, 7])
    assert c.parents.tolist() == [-1, 0, 1] and c.depth.tolist() == [0, 1, 2]


def test_tree_from_choices_uses_ranks_per_depth():
    topk = torch.tensor([[100, 101, 102], [200, 201, 202]])  # [K=2 heads, R=3 ranks]
    t = tree_from_choices(7, topk, [[1, 0], [0], [2], [0, 2], [0, 0, 0]])  # [1] missing: added; depth 3 > K: dropped
    assert t.tokens.tolist() == [7, 100, 101, 102, 200, 202, 200]
    assert t.parents.tolist() == [-1, 0, 0, 0, 1, 1, 2]
    assert t.depth.tolist() == [0, 1, 1, 1, 2, 2, 2]


def test_normalize_choices_adds_prefixes_parents_first():
    assert normalize_choices([[1], [0]]) == [(0,), (1,)]
    assert normalize_choices([[0, 1]]) == [(0,), (0, 1)]
    with pytest.raises(SpecheadsError, match="ranks >= 0"):
        normalize_choices([[0, -1]])


def test_dynamic_tree_keeps_best_connected_nodes():
    # a fixed "draft model": after token x the next-token log-probs are those of `table[x % 4]` over 4 tokens
    table = torch.log(torch.tensor([[0.7, 0.2, 0.05, 0.05],
                                    [0.1, 0.8, 0.05, 0.05],
                                    [0.25, 0.25, 0.25, 0.25],
                                    [0.4, 0.3, 0.2, 0.1]]))
    calls = []

    def expand(frontier, tokens, parents):
        calls.append(list(frontier))
        return torch.stack([table[tokens[i] % 4] for i in frontier])

    t = dynamic_tree(3, expand, depth=2, top_k=2, total_tokens=3)
    # depth 1 under root 3: tokens 0 (.4), 1 (.3); depth 2: under 0: 0 (.28), 1 (.08); under 1: 1 (.24), 0 (.03)
    # best 3 by cumulative prob: 0 (.4), 1 (.3), 0->0 (.28)
    assert t.tokens.tolist() == [3, 0, 1, 0]
    assert t.parents.tolist() == [-1, 0, 0, 1]
    assert calls[0] == [0] and len(calls) == 2
    scores = [0.4, 0.3, 0.28]
    assert math.isclose(scores[2], 0.4 * 0.7)
    big = dynamic_tree(3, expand, depth=3, top_k=2, total_tokens=100)  # everything generated is kept
    assert len(big) == 1 + 2 + 4 + 4
    assert bool((big.parents[1:] < torch.arange(1, len(big))).all())


def test_ancestors_equal_paths_on_a_random_deep_tree():
    g = torch.Generator().manual_seed(3)
    parents, depth = [-1], [0]
    for i in range(1, 40):
        p = int(torch.randint(0, i, (1,), generator=g))
        parents.append(p)
        depth.append(depth[p] + 1)
    t = DraftTree(torch.arange(40), parents, depth)
    ref = torch.zeros(40, 40, dtype=torch.bool)
    for i in range(40):
        ref[i, t.path(i)] = True
    assert t.max_depth >= 4
    assert torch.equal(t.ancestors(), ref)


def test_trie_union_shares_common_prefixes():
    # a: root 9 -> {1 -> 2, 3}; b: the chain 9 -> 1 -> 4 -> 5 shares node "1" and adds 4 -> 5 under it
    a = DraftTree(torch.tensor([9, 1, 3, 2]), torch.tensor([-1, 0, 0, 1]), torch.tensor([0, 1, 1, 2]))
    m, maps = trie_union([a, chain_tree(9, [1, 4, 5])])
    assert m.tokens.tolist() == [9, 1, 3, 2, 4, 5] and m.parents.tolist() == [-1, 0, 0, 1, 1, 4]
    assert m.depth.tolist() == [0, 1, 1, 2, 2, 3] and maps == [[0, 1, 2, 3], [0, 1, 4, 5]]
    same, maps = trie_union([a, chain_tree(9, [1, 2])])
    assert same.tokens.tolist() == a.tokens.tolist() and maps[1] == [0, 1, 3]  # nothing new: unchanged
    with pytest.raises(ValueError, match="roots"):
        trie_union([a, chain_tree(8, [1])])
    with pytest.raises(ValueError, match="deterministic"):
        trie_union([a, chain_tree(9, [1], q=torch.ones(2, 4) / 4)])


def test_tree_from_parents_derives_depth():
    t = tree_from_parents([5, 7, 8, 9, 10], [-1, 0, 1, 0, 0])  # a chain 5 -> 7 -> 8 and two more children of 5
    assert t.parents.tolist() == [-1, 0, 1, 0, 0] and t.depth.tolist() == [0, 1, 2, 1, 1] and t.q is None
    q = torch.ones(2, 4) / 4
    assert tree_from_parents([1, 2], [-1, 0], q).q is q
    with pytest.raises(ValueError):
        tree_from_parents([1, 2], [-1, 1])  # a node is its own parent


def test_tree_from_paths_follows_paths_in_order():
    """Path c gets token(c, its parent's token); a path whose parent is missing or whose token is None is left out."""
    table = {(10, 0): 11, (10, 1): 12, (11, 0): 13, (12, 0): None}
    t = tree_from_paths(10, [(0,), (1,), (0, 0), (1, 0), (1, 0, 0), (0, 1), (0, 0, 0)],
                        lambda c, parent: table.get((parent, c[-1])))
    assert t.tokens.tolist() == [10, 11, 12, 13] and t.parents.tolist() == [-1, 0, 0, 1]
    assert t.depth.tolist() == [0, 1, 1, 2]

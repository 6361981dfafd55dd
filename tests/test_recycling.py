"""Token Recycling (drafters.TokenRecyclingDrafter): the adjacency table and the breadth-first tree on hand-made logits, and
greedy exactness with a tree that is really accepted."""
import torch

from specheads.infer.drafters import DraftContext, TokenRecyclingDrafter, build_drafter, drafter_kind
from specheads.infer.generate import generate
from specheads.infer.treespec import TreeSpec

from test_generate import hf_greedy


def one_hot_rows(vocab: int, ranked: list[list[int]]) -> torch.Tensor:
    """logits [N, V] whose row i ranks ranked[i] first, second, ... (the rest below)."""
    out = torch.zeros(len(ranked), vocab)
    for i, toks in enumerate(ranked):
        for r, t in enumerate(toks):
            out[i, t] = 10.0 - r
    return out


def test_table_and_breadth_first_tree_obvious_answers():
    d = TokenRecyclingDrafter(20, choices=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]], k=2)
    assert d.k == 2 and bool((d.table == -1).all())
    assert len(d.propose(DraftContext(ids=[3]))) == 1  # nothing seen yet: the root alone
    # the target said: after 3 comes 5 (else 6); after 5 comes 7 (else 8); after 7 comes 9; 6 and 9 never seen
    d.recycle(torch.tensor([3, 5, 7]), one_hot_rows(20, [[5, 6], [7, 8], [9, 1]]))
    tree = d.propose(DraftContext(ids=[1, 3]))
    assert tree.tokens.tolist() == [3, 5, 6, 7, 8, 9] and tree.parents.tolist() == [-1, 0, 0, 1, 1, 3]
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 3]  # [1, 0] is left out: token 6 has no entry yet
    assert len(d.propose(DraftContext(ids=[3], max_depth=1))) == 3  # the context window's limit
    d.recycle(torch.tensor([3]), one_hot_rows(20, [[4, 2]]))  # a later output replaces the entry
    assert d.table[3].tolist() == [4, 2]
    d.reset(torch.tensor([1, 2]), None)
    assert d.table[3].tolist() == [4, 2]  # the table survives reset (hot start)


def test_recycling_greedy_exact_and_accepted_on_repetitive_text(tiny):
    """A repetitive prompt teaches the table the target's own continuations: greedy output equals HF generate
    and the trees are accepted (τ above 1.3); the registry builds it from --drafter recycling."""
    p = [5, 9, 13, 17, 21, 25] * 4
    ref = hf_greedy(tiny, p, 40)
    d = build_drafter(tiny, "recycling")
    assert isinstance(d, TokenRecyclingDrafter) and drafter_kind("recycling").family == "static"
    r = generate(tiny, d, p, max_new_tokens=40)
    assert r.ids == ref and r.stats.tau > 1.3, r.stats
    chain = build_drafter(tiny, "recycling", TreeSpec.static([(0,), (0, 0), (0, 0, 0)]))
    assert generate(tiny, chain, p, max_new_tokens=40).ids == ref

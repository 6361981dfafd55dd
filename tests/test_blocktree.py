"""Trees over block drafts (infer/drafters/blocktree.py, DDTree): the best-first builder by hand and against brute
force, the block tree a drafter offers (ranks, estimates, chain first, budget), greedy fp32 exactness against HF
generate for every block kind (alone, scheduled and batched), lossless sampling (chi-square) and `--tree tree:N`."""
from __future__ import annotations

import itertools

import pytest
import torch

from specheads.heads.base import HeadSpec, build_head
from specheads.heads.kinds import kinds_where
from specheads.infer.drafters import DraftContext, build_drafter, parse_tree
from specheads.infer.drafters.blocktree import best_first, chain_nodes, greedy_tree, rank_factors, sampled_tree
from specheads.infer.engine.batch import generate_batch
from specheads.infer.engine.generate import generate
from specheads.infer.scheduling.acceptance import Rates
from specheads.infer.scheduling.step import Scheduler
from specheads.infer.treespec import TreeSpec
from specheads.infer.verify import SamplingParams, target_probs, verify_sampling
from specheads.utils import SpecheadsError
from helpers import Recording, make_head, perturb, two_token_probs
from test_sampling_stats import assert_same, markov_logits

pytestmark = pytest.mark.usefixtures("one_thread")

FLAT = {1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.2, 32: 1.4, 64: 1.8}  # a hand-made cost profile
FREE = {1: 1.0, 128: 1.0}  # verification costs nothing more per node: every node of positive estimate pays


def test_rank_factors_by_hand():
    assert rank_factors(0.8, [0.5, 0.3, 0.1]) == pytest.approx([0.8, 0.2 * 0.3 / 0.5, 0.2 * 0.1 / 0.5])
    assert rank_factors(0.1, [0.5, 0.4]) == pytest.approx([0.1, 0.1])  # capped at rank 0's: never above it
    assert rank_factors(0.9, [1.0, 0.0]) == [0.9, 0.0]  # no mass left for rank 1


def test_best_first_by_hand():
    f = [[0.6, 0.3, 0.1], [0.4, 0.2], [0.9]]
    got = best_first(f, 5)
    assert [p for p, _ in got] == [(0,), (1,), (0, 0), (0, 0, 0), (1, 0)]
    assert [v for _, v in got] == pytest.approx([0.6, 0.3, 0.24, 0.216, 0.12])
    assert len(best_first(f, 2)) == 2 and best_first(f, 100)[-1][1] > 0  # the budget; no path of product 0
    assert len(best_first(f, 100)) == 3 + 3 * 2 + 3 * 2 * 1


def test_best_first_equals_brute_force_top_n():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        k, r = 4, 3
        f = [rank_factors(float(torch.rand((), generator=g)),
                          torch.rand(r, generator=g).softmax(0).sort(descending=True).values.tolist())
             for _ in range(k)]
        prods = {}
        for d in range(1, k + 1):
            for path in itertools.product(range(r), repeat=d):
                prods[path] = float(torch.tensor([f[j][x] for j, x in enumerate(path)]).prod())
        for n in (1, 5, 17):
            got = best_first(f, n)
            best = sorted(prods.values(), reverse=True)[:n]
            assert [v for _, v in got] == pytest.approx(best)  # the n largest products, in order
            seen = {()}
            for path, v in got:
                assert path[:-1] in seen and v == pytest.approx(prods[path])  # parents first
                seen.add(path)


class _Fake:
    """A drafter's parts greedy_tree / sampled_tree read: a head mapping draft ids to target ids (+100)."""
    name = "fake"

    class head:
        @staticmethod
        def to_target_ids(ids):
            return ids + 100

    depth_rates = Rates()


def test_greedy_tree_by_hand():
    """Two positions over a 4-token draft vocabulary: ranks by probability, estimates the products of the rank
    factors, the chain first, the budget kept."""
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.6, 0.2, 0.15]])
    cand = greedy_tree(_Fake(), DraftContext(ids=[7, 9]), probs.log(), [0.8, 0.5], 2, 4)
    f0 = rank_factors(0.8, [0.5, 0.3, 0.15, 0.05])  # 0.8, 0.12, 0.06, 0.02
    f1 = rank_factors(0.5, [0.6, 0.2, 0.15, 0.05])  # 0.5, 0.25, 0.1875, 0.0625
    assert cand.tree.tokens.tolist() == [9, 100, 101, 102, 103]  # draft ids + 100: the chain 0, 1, then 2, 3
    assert cand.tree.parents.tolist() == [-1, 0, 1, 1, 1]  # the first draft's children beat the root's siblings
    assert cand.p == pytest.approx([1.0, f0[0], f0[0] * f1[0], f0[0] * f1[1], f0[0] * f1[2]])
    five = greedy_tree(_Fake(), DraftContext(ids=[7, 9]), probs.log(), [0.8, 0.5], 2, 5)
    assert five.tree.tokens.tolist()[-1] == 101 and five.tree.parents.tolist()[-1] == 0  # then rank 1 at the root
    assert chain_nodes(cand.tree) == [1, 2]
    big = greedy_tree(_Fake(), DraftContext(ids=[7, 9]), probs.log(), [0.8, 0.5], 2, 100)
    assert len(big.tree) == 1 + 4 + 4 * 4 and chain_nodes(big.tree) == [1, 2]


def _drafter(target, head, nodes):
    """The kind's block drafter over a block tree of `nodes` draft nodes (0: scheduled, `tree:auto` priced by
    FREE)."""
    return build_drafter(target, head, f"tree:{nodes or 'auto'}", scheduler=Scheduler(FREE, 1e-3, pricing="profile"))


@pytest.mark.parametrize("kind", kinds_where(family="block"))  # the registry: a new block kind is checked too
def test_greedy_block_trees_equal_hf_generate_alone_and_batched(tiny, kind):
    """fp32 greedy: every block kind's tree (fixed 6 nodes, and scheduled) emits HF generate's tokens, alone and as
    batched rows (the batch proposes the fixed trees as each row alone); the trees really branch."""
    from test_generate import hf_greedy

    head = make_head(tiny, kind).eval()
    ps = [[5, 6, 7, 8, 9, 10] * 2, [3, 17, 40, 2], [11]]
    refs = [hf_greedy(tiny, p, 14) for p in ps]
    for nodes in (6, 0):
        alone = []
        for p, ref in zip(ps, refs):
            alone.append([])
            drafter = Recording(_drafter(tiny, head, nodes), alone[-1], clear_on_reset=False)
            assert generate(tiny, drafter, p, max_new_tokens=14).ids == ref
        assert any(max(par.count(i) for i in range(len(par))) > 1 for log in alone for _, par in log), nodes
        if nodes:
            assert all(len(tok) == 7 for log in alone for tok, _ in log[:-1])  # the fixed budget, every step
        logs = []

        def row():
            logs.append([])
            return Recording(_drafter(tiny, head, nodes), logs[-1], clear_on_reset=False)

        res = generate_batch(tiny, row, ps, 14, batch_size=2)
        assert [r.ids for r in res.rows] == refs
        if nodes:  # rows join in prompt order; (a 64-node tree's tail of near-equal ranks may order differently
            assert logs == alone  # when a row's features come from a padded batched forward)


def test_one_step_block_tree_sampling_is_lossless():
    """One verify-and-emit step of a sampled block tree (the chain drawn from q, the other children drawn without
    replacement, the shape from q's sorted probabilities) on V = 8 with an exact Markov target: the first two
    emitted tokens match the target's distribution (chi-square, 10,000 samples)."""
    V, n = 8, 10_000
    g = torch.Generator().manual_seed(3)
    sampling = SamplingParams(temperature=1.0)
    p_table = target_probs(markov_logits(), sampling)  # [V, V]
    q = torch.softmax(torch.randn(4, V, generator=torch.Generator().manual_seed(9)) * 1.2, -1)  # [k+1, V]
    root, counts, widest = 3, torch.zeros(V * V), 0
    for _ in range(n):
        drafts = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(3)]
        cand = sampled_tree(_Fake(), DraftContext(ids=[root], generator=g), drafts, [0.6, 0.5, 0.4], q, 9)
        tree = cand.tree
        widest = max(widest, max(len(c) for c in tree.children_lists()))
        acc = verify_sampling(tree, None, sampling, g, probs=p_table[tree.tokens])
        out = [int(tree.tokens[i]) for i in acc.nodes[1:]] + [acc.bonus]
        if len(out) == 1:
            out.append(int(torch.multinomial(p_table[out[0]], 1, generator=g)))
        counts[out[0] * V + out[1]] += 1
    assert widest >= 2 and len(tree) == 10
    assert_same(counts, (p_table[root][:, None] * p_table).flatten() * n)


# the two block drafts a tree is sampled over: DSpark's (the Markov bias reads the drawn token) and P-EAGLE's
# (independent depths); the block kinds' own lossless sampling is in their own test files
@pytest.mark.parametrize("kind", ["dspark", "peagle"])
def test_end_to_end_block_tree_sampling(kind):
    """generate() with a block tree (scheduled) on an 8-token vocabulary: the first two new tokens vs the exact
    target distribution (as test_sampling_stats' block-chain test)."""
    from specheads.target import tiny_target

    V, n = 8, 500
    target = tiny_target(vocab_size=V, hidden_size=32, num_layers=2, seed=0)
    torch.manual_seed(1)
    spec = HeadSpec(kind="peagle", feature_layers=[1, 2], num_layers=2, num_depths=3) if kind == "peagle" else \
        HeadSpec(kind="dspark", feature_layers=[1, 2], block_size=3, markov_rank=4, num_layers=1)
    head = perturb(build_head(spec, target).eval(), 0.5, seed=None, trainable_only=True)
    prompt = [1, 5, 3]
    expected = two_token_probs(target, prompt, SamplingParams(temperature=1.0, top_k=4))
    counts = torch.zeros(V * V)
    log = []
    drafter = Recording(_drafter(target, head, 0), log, clear_on_reset=False)
    for s in range(n):
        res = generate(target, drafter, prompt, max_new_tokens=2, temperature=1.0, top_k=4, seed=s, ignore_eos=True)
        counts[res.ids[0] * V + res.ids[1]] += 1
    branched = sum(max(par.count(i) for i in range(len(par))) > 1 for _, par in log)
    assert branched > n // 4  # most steps verified a real tree
    assert_same(counts, expected * n)


def test_tree_specs_and_build(tiny):
    head = make_head(tiny, "dspark")
    assert parse_tree("tree:12", "dspark", head) == TreeSpec.block_tree(12, text="tree:12")
    auto = parse_tree("tree:auto", "dspark", head)
    assert auto.mode == "blocktree" and auto.total_tokens == 0 and auto.scheduled
    for bad, why in (("tree:0", "outside 1..1024"), ("tree:x", "expected tree:N or tree:auto"),
                     ("tree:2000", "outside 1..1024")):
        with pytest.raises(SpecheadsError, match=why):
            parse_tree(bad, "dspark", head)
    fixed = build_drafter(tiny, head, "tree:12")
    assert fixed.tree_nodes == 12 and fixed.scheduler is None and fixed.siblings == 0
    sched = build_drafter(tiny, head, "tree:auto", scheduler=Scheduler(FLAT, 1e-3))
    assert sched.tree_nodes == 0 and sched.scheduler is not None and sched.siblings == 0


def test_teacher_forced_block_tree_lengths_by_hand():
    """train/blocktree_eval.py scores the tree greedy_tree builds: the same two positions as by hand above at every
    row; the target's tokens (0, 2) are ranks (0, 1), in the 4-node tree; (2, .) and (1, .) are not, until a
    fifth node adds rank 1 at the root."""
    from specheads.train.blocktree_eval import BlockTreeAccumulator, block_tree_lengths

    T = 8
    pos = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.6, 0.2, 0.15]]).log()  # [K, V']
    steps = [pos[k].expand(1, T, 4).clone() for k in range(2)]  # K [B,T,V']
    conf = torch.tensor([0.8, 0.5]).view(2, 1, 1).expand(2, 1, T)
    target = torch.tensor([[9, 0, 2, 1, 3, 0, 1, 1]])  # row j: the target's greedy token j+1
    mask = torch.ones(1, T, dtype=torch.long)
    acc, start = block_tree_lengths(steps, conf, target, mask, None, 4)
    assert acc[0, :4].tolist() == [3, 1, 1, 1] and bool(start[0, 0])
    acc5, _ = block_tree_lengths(steps, conf, target, mask, None, 5)
    assert acc5[0, :4].tolist() == [3, 1, 2, 1]  # row 2: (1,) now in the tree, (1, rank 2) still not
    chain, _ = block_tree_lengths(steps, torch.ones(2, 1, T), target, mask, None, 2)
    assert chain[0, :4].tolist() == [2, 1, 1, 1]  # confident: the tree is the chain, row 0's rank 1 is a miss
    a = BlockTreeAccumulator(4)
    a.add(steps, conf, target, mask, None)
    m = a.metrics()
    assert m["tau_blocktree"] == pytest.approx(float(acc[start].float().mean()))
    assert m["tau_blocktree_walk"] >= 1.0 and m["blocktree_nodes"] == 4


def test_scheduler_keeps_a_best_first_prefix_of_the_block_tree():
    """The scheduler ranks nodes by the builder's estimates: whatever size it chooses, it keeps the best nodes, a
    connected tree whose every parent's children are a prefix of its ranks (sampling draws them in that order)."""
    from specheads.infer.scheduling.step import choose_nodes

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 32, generator=g) * 3  # [K, V']
    cand = greedy_tree(_Fake(), DraftContext(ids=[7, 9]), logits, [0.9, 0.7, 0.6, 0.5], 4, 64)
    order = sorted(range(1, len(cand.p)), key=lambda i: -cand.p[i])
    sizes = set()
    for fixed in (0.0, 0.5, 2.0, 8.0):
        keep = choose_nodes(cand.p, cand.tree.parents.tolist(), FLAT, fixed).keep
        sizes.add(len(keep))
        assert sorted(keep[1:]) == sorted(order[:len(keep) - 1])  # the best len(keep) - 1 nodes
        sub = cand.tree.select(torch.tensor(keep))
        kids = cand.tree.children_lists()
        for i in keep:
            kept = [c for c in kids[i] if c in keep]
            assert kept == kids[i][:len(kept)]  # a prefix of the parent's children (rank order)
        assert len(sub) == len(keep)
    assert len(sizes) > 1  # the step's fixed cost moves the choice

"""The drafter registry and its one constructor (build_drafter), a new kind plugged in by registering it, and the
EAGLE drafter's proposals token for token against the implementation it replaced (kept below for this test only)."""
from __future__ import annotations

import re

import pytest
import torch

from specheads.heads.base import HeadSpec, build_head
from specheads.heads.kinds import kind_names, kinds_where
from specheads.infer.drafters import (DRAFTERS, DraftContext, Drafter, DrafterKind, DraftModelDrafter, DSparkDrafter,
                                      EagleDrafter, LayerSkipDrafter, MedusaDrafter, NoDrafter, PromptLookupDrafter,
                                      ScheduledUnionDrafter, ScoredLookupDrafter, ScoredTreeDrafter, build_drafter,
                                      combine_drafters, drafter_kind, parse_tree, register_drafter)
from specheads.infer.scheduling.step import Scheduler
from specheads.infer.tree import DraftTree, chain_tree, dynamic_tree
from specheads.infer.treespec import TreeSpec
from specheads.utils import SpecheadsError

pytestmark = pytest.mark.usefixtures("one_thread")

FLAT = {1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.2, 32: 1.4}  # a cost profile t(n)/t(1) as flat as a CPU's


def scheduler(costs=FLAT, t1=1e-3):
    """A scheduler priced by a hand-made profile (no measurement, no cache written)."""
    return Scheduler(costs, t1)


def dspark_head(target, **kw):
    spec = HeadSpec(**{"kind": "dspark", "feature_layers": [1, 2, 3], "block_size": 4, "markov_rank": 16,
                       "num_layers": 1, "draft_vocab_size": 64, **kw})
    torch.manual_seed(0)
    return build_head(spec, target, token_counts=torch.arange(256.0)).eval()


def test_build_drafter_for_every_registered_kind(tiny):
    medusa = build_head(HeadSpec(kind="medusa", num_heads=3), tiny)
    eagle3 = build_head(HeadSpec(kind="eagle3", draft_vocab_size=64), tiny, token_counts=torch.arange(256.0))
    d = build_drafter(tiny, eagle3, "2,4,8")
    assert isinstance(d, EagleDrafter) and (d.depth, d.top_k, d.total_tokens) == (2, 4, 8)
    assert (build_drafter(tiny, eagle3).depth, build_drafter(tiny, eagle3).total_tokens) == (5, 48)  # default tree
    m = build_drafter(tiny, medusa, "[[0], [1], [0, 0]]")
    assert isinstance(m, MedusaDrafter) and m.choices == [(0,), (1,), (0, 0)]
    assert len(build_drafter(tiny, medusa).choices) > 3  # default: the Medusa tree, cut to the 3 heads
    pl = build_drafter(tiny, "prompt-lookup", TreeSpec.tokens(6), max_ngram=2)
    assert isinstance(pl, PromptLookupDrafter) and (pl.k, pl.max_ngram) == (6, 2)
    dm = build_drafter(tiny, "draft-model", "3", draft_layers=2)
    assert isinstance(dm, DraftModelDrafter) and dm.k == 3 and len(dm.model.model.layers) == 2
    assert isinstance(build_drafter(tiny, "plain"), NoDrafter)
    ls = build_drafter(tiny, "layer-skip", "chain:3", skip="m1-2")
    assert isinstance(ls, LayerSkipDrafter) and ls.k == 3 and ls.scheduler is None and ls.skip.text() == "m1-2"
    ls = build_drafter(tiny, "layer-skip", skip="a1", scheduler=scheduler())  # default: auto, the adaptive exit
    assert ls.scheduler is not None and ls.k == LayerSkipDrafter.MAX_AUTO
    merged = build_drafter(tiny, eagle3, "2,2,4", lookup=5, scheduler=scheduler())
    assert isinstance(merged, ScheduledUnionDrafter) and merged.names == ["eagle", "lookup"]
    assert isinstance(merged.sources[0], ScoredTreeDrafter) and merged.sources[0].inner.top_k == 2
    assert isinstance(merged.sources[1], ScoredLookupDrafter) and merged.sources[1].lookup.k == 5
    ds = dspark_head(tiny)
    auto = build_drafter(tiny, ds, scheduler=scheduler())  # default: auto, the per-step scheduler
    assert isinstance(auto, DSparkDrafter) and auto.scheduler is not None and auto.k == 4
    fixed = build_drafter(tiny, ds, "chain:2")
    assert fixed.scheduler is None and fixed.k == 2 and build_drafter(tiny, ds, "3").k == 3
    with pytest.raises(ValueError, match="autotree"):
        build_drafter(tiny, eagle3, "auto")
    with pytest.raises(SpecheadsError, match="--drafter nonsense: expected prompt-lookup, draft-model, recycling, plain"):
        build_drafter(tiny, "nonsense")
    with pytest.raises(SpecheadsError, match="--drafter eagle3"):  # a head kind is not a training-free drafter
        drafter_kind("eagle3")
    # one family per drafter, named once: every registered kind's (resolved here, so that DRAFTERS holds them
    # whatever ran before) and the training-free drafters'
    family = {k: drafter_kind(k, head=True).family for k in kind_names()}
    assert {k: v.family for k, v in DRAFTERS.items() if v.head} == family
    assert all(family[k] == "block" for k in kinds_where(family="block"))
    assert all(family[k] in ("static", "dynamic") for k in kinds_where(family="tree"))
    assert {k: family[k] for k in ("medusa", "eagle", "eagle3")} == {"medusa": "static", "eagle": "dynamic",
                                                                     "eagle3": "dynamic"}
    assert {k: v.family for k, v in DRAFTERS.items() if not v.head} == {
        "prompt-lookup": "tokens", "draft-model": "tokens", "recycling": "static", "plain": "none",
        "layer-skip": "block"}


class BlockDrafter(Drafter):
    """A stand-in for a block drafter: one pass drafts a chain of K tokens (here: the root repeated)."""
    name = "block"

    def __init__(self, head, k):
        self.head, self.k = head, k

    def propose(self, ctx):
        return chain_tree(ctx.ids[-1], [ctx.ids[-1]] * min(self.k, ctx.max_depth))


def test_a_new_head_kind_plugs_in_by_registering(tiny, monkeypatch):
    """A head kind's KindSpec names the drafter it serves with (heads/kinds.py); build_drafter finds it there."""
    import dataclasses

    from specheads.heads.kinds import kind_spec, register_kind, unregister_kind

    monkeypatch.setitem(DRAFTERS, "block-test", None)  # removed again after the test
    drafter = register_drafter(DrafterKind("block-test", "tokens", "a block head",
                                           lambda t, h, s: BlockDrafter(h, s.num_tokens), default_tree="4", head=True))
    head = build_head(HeadSpec(kind="eagle"), tiny)
    register_kind(dataclasses.replace(kind_spec("eagle"), name="block-test", drafter=drafter))
    try:
        head.config.kind = "block-test"  # a head of the new kind, as far as the registry is concerned
        d = build_drafter(tiny, head, "6")
        assert isinstance(d, BlockDrafter) and d.k == 6 and build_drafter(tiny, head).k == 4
        with pytest.raises(SpecheadsError, match="--tree 0: .*a block head takes a number of draft tokens"):
            parse_tree("0", "block-test", head)
    finally:
        unregister_kind("block-test")
    with pytest.raises(ValueError, match="family"):
        register_drafter(DrafterKind("bad", "no-such-family", "x", lambda *a: None))


def test_a_training_free_kind_plugs_in_by_registering(tiny, monkeypatch):
    """A module of one's own registers a kind; build_drafter and the messages know it by name."""
    monkeypatch.setitem(DRAFTERS, "toy", None)  # removed again after the test
    register_drafter(DrafterKind("toy", "tokens", "toy", lambda t, h, s: BlockDrafter(h, s.num_tokens),
                                 default_tree="2"))
    d = build_drafter(tiny, "toy", "3")
    assert isinstance(d, BlockDrafter) and d.k == 3 and build_drafter(tiny, "toy").k == 2
    assert len(d.propose(DraftContext(ids=[4, 5]))) == 4
    with pytest.raises(SpecheadsError, match="--drafter nonsense: expected .*, toy"):
        build_drafter(tiny, "nonsense")


# ---------------------------------------------------------------------------------------------------------------
# The EAGLE drafter's proposal as it was before its draft rows became a DraftTree (tree.tree_from_parents): the
# reference the current one must equal token for token.
# ---------------------------------------------------------------------------------------------------------------
class ReferenceEagleDrafter(EagleDrafter):
    """The EAGLE-2 dynamic tree with its draft rows kept by hand (node -> row index), the head's true-row cache and
    its forward shared with EagleDrafter: only the tree building is the old one."""

    def propose(self, ctx: DraftContext) -> DraftTree:
        ids, root = ctx.ids, ctx.ids[-1]
        cached = len(ids) - 1  # target positions 0 .. cached-1 have true features
        p = 0 if self.pending is None else self.pending.shape[0]
        if self.cache is None or cached == 0 or ctx.max_depth <= 0 or self.rows + p == 0:
            return chain_tree(root, [])
        assert self.rows + p == cached, (self.rows, p, cached)
        param = next(self.head.parameters())
        # 1. true rows (f_t, x_{t+1}) for the newly cached positions; the last pairs f_{cached-1} with the root
        if p:
            t0 = self.rows
            feats = self.head.project_features(self.pending.to(param.device, param.dtype))  # [p, D]
            h, lp = self._run(feats, torch.tensor(ids[t0 + 1:cached + 1]), torch.arange(t0, cached),
                              torch.ones(p, p, dtype=torch.bool).tril(), last_only=True)  # only the last row drafts
            self.rows, self.pending = cached, None
            self._root = (h[-1], lp[-1])
        out_h, out_lp = {0: self._root[0]}, {0: self._root[1]}  # node -> its row's hidden out / children log-probs
        row_of: dict[int, int] = {}  # node -> index of its draft row in the head cache (after the true rows)

        # 2. EAGLE-2 expansion: node i at depth d >= 1 is the row (hidden out of its parent's row, token_i) at
        #    position cached - 1 + d, attending the true rows, its ancestors' draft rows and itself
        def expand(frontier, tokens, parents):
            todo = [i for i in frontier if i not in out_lp]
            if todo:
                r0 = len(row_of)
                m = torch.zeros(len(todo), r0 + len(todo), dtype=torch.bool)
                depth = []
                for r, i in enumerate(todo):
                    m[r, r0 + r] = True
                    j, d = parents[i], 1
                    while j > 0:
                        m[r, row_of[j]] = True
                        j, d = parents[j], d + 1
                    depth.append(d)
                hid = torch.stack([out_h[parents[i]] for i in todo])
                h2, lp2 = self._run(hid, torch.tensor([tokens[i] for i in todo]),
                                    cached - 1 + torch.tensor(depth), m)
                for r, i in enumerate(todo):
                    row_of[i] = r0 + r
                    out_h[i], out_lp[i] = h2[r], lp2[r]
            return torch.stack([out_lp[i] for i in frontier])  # [F, V']

        to_target = self.head.to_target_ids if getattr(self.head, "d2t", None) is not None else None
        try:
            tree = dynamic_tree(root, expand, min(self.depth, ctx.max_depth), self.top_k, self.total_tokens,
                                to_target=to_target)
        finally:
            if row_of:  # keep only the true rows in the head cache
                self.cache.crop(-len(row_of))
        return tree



def _perturbed(head, seed):
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for p in head.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return head


@pytest.mark.parametrize("kind,tree", [("eagle", (4, 3, 10)), ("eagle3", (3, 4, 12)), ("eagle", (2, 2, 100))])
def test_eagle_proposals_equal_the_reference_implementation(tiny, kind, tree):
    """Both drafters see the same contexts and outcomes for 12 steps; accepted paths of 0-3 nodes are picked at
    random from the proposed tree, and the true features of the accepted rows are fed back."""
    head = _perturbed(build_head(HeadSpec(kind=kind, draft_vocab_size=64 if kind == "eagle3" else None), tiny,
                                 token_counts=torch.arange(256.0) if kind == "eagle3" else None), seed=1)
    depth, top_k, total = tree
    new, ref = EagleDrafter(head, depth, top_k, total), ReferenceEagleDrafter(head, depth, top_k, total)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (9,), generator=g).tolist()

    def features(seq):  # [T, F*D] true target features of every position
        hs = tiny.model(torch.tensor([seq]), output_hidden_states=True).hidden_states
        return torch.cat([hs[i][0] for i in head.config.feature_layers], -1)

    with torch.no_grad():
        for d in (new, ref):
            d.reset(torch.tensor(ids), features(ids)[:-1])
        for step in range(12):
            a, b = new.propose(DraftContext(ids=ids)), ref.propose(DraftContext(ids=ids))
            assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist(), step
            assert new.cache.get_seq_length() == ref.cache.get_seq_length() == new.rows
            node = int(torch.randint(0, len(a), (1,), generator=g)) if step % 3 else 0
            path = a.path(node)[:4]  # accepted: root first
            accepted = [int(a.tokens[i]) for i in path[1:]]
            bonus = int(torch.randint(3, 256, (1,), generator=g))
            start = len(ids) - 1
            ids = ids + accepted + [bonus]
            feats = features(ids)[start:start + len(path)]
            for d in (new, ref):
                d.observe(a, None, feats)
        torch.testing.assert_close(new.root_logp, ref._root[1], atol=0, rtol=0)


def test_eagle_draft_rows_are_cropped_even_when_expansion_fails(tiny, monkeypatch):
    import specheads.infer.drafters.eagle as eagle_mod

    head = build_head(HeadSpec(kind="eagle"), tiny)
    d = EagleDrafter(head, depth=3, top_k=2, total_tokens=6)
    ids = list(range(3, 12))
    with torch.no_grad():
        hs = tiny.model(torch.tensor([ids[:-1]]), output_hidden_states=True).hidden_states
        d.reset(torch.tensor(ids), hs[-1][0])

        def failing(root, expand, *a, **k):
            expand([0], [root], [-1])

            tokens, parents = [root, 5, 6], [-1, 0, 0]
            expand([1, 2], tokens, parents)  # two draft rows now in the head cache
            raise RuntimeError("boom")

        monkeypatch.setattr(eagle_mod, "dynamic_tree", failing)
        with pytest.raises(RuntimeError):
            d.propose(DraftContext(ids=ids))
    assert d.cache.get_seq_length() == d.rows == len(ids) - 1 and d.draft is None
    monkeypatch.setattr(eagle_mod, "dynamic_tree", dynamic_tree)


def test_dspark_tree_specs_and_one_clear_error(tiny):
    ds = dspark_head(tiny)
    assert parse_tree("auto", "dspark", ds) == TreeSpec.auto() and parse_tree(None, "dspark", ds).mode == "auto"
    assert parse_tree("chain:3", "dspark", ds.config).num_tokens == 3 and parse_tree("4", "dspark", ds).num_tokens == 4
    for bad, why in (("5", "the number of draft tokens 5 is outside 1..4"), ("0", "the number of draft tokens 0 is outside 1..4"),
                     ("2,2,4", "expected a whole number of tokens"), ("chain:x", "expected chain:K"),
                     ("[[0]]", "expected a whole number")):
        with pytest.raises(SpecheadsError, match=rf"--tree {re.escape(bad)}: {why}.*a DSpark head takes auto \(the "
                                                 r"per-step scheduler"):
            parse_tree(bad, "dspark", ds)


def test_dspark_proposes_a_prefix_of_its_block(tiny):
    """The scheduled drafter verifies a prefix of the one block its head drafted (greedy: the Markov chain's
    argmax), chosen by the survival of the calibrated confidences."""
    ds = dspark_head(tiny)
    d = DSparkDrafter(ds, scheduler=scheduler(), siblings=0)
    p = [5, 6, 7, 8, 9, 10] * 2
    d.reset(torch.tensor(p), _target_features(tiny, p[:-1], ds.config.feature_layers))
    d.catch_up()  # the prompt's features wait until a block is drafted
    ctx = DraftContext(ids=p)
    logits, conf = ds.draft_block(d.cache, p[-1])
    block = ds.to_target_ids(logits.argmax(-1)).tolist()
    cand = d.candidates(ctx)
    assert cand.tree.tokens.tolist() == [p[-1]] + block
    assert cand.p == pytest.approx([1.0] + torch.cumprod(conf, 0).tolist())
    tree = d.propose(ctx)
    assert tree.tokens.tolist() == cand.tree.tokens.tolist()[:len(tree)] and d.step_report() is not None
    assert d.step_report().expected_tau == pytest.approx(sum(cand.p[:len(tree)]))
    assert d.candidates(DraftContext(ids=p, max_depth=2)).tree.max_depth == 2  # the context window's room


def test_dspark_first_draft_siblings_estimates_and_learning(tiny):
    """The first draft's siblings hang off the root with estimates (1 - a_1) r_1 and (1 - a_1)(1 - r_1) r_2; a step
    where the first draft missed and sibling 1 was right raises r_1 and leaves r_2 (never tried); a step where the
    first draft was right teaches the siblings nothing."""
    d = DSparkDrafter(dspark_head(tiny), scheduler=scheduler())
    assert d.siblings == 2 and DSparkDrafter(dspark_head(tiny)).siblings == 0  # scheduled drafters only
    cand = d._candidates(DraftContext(ids=[1, 5]), [7, 8], [0.6, 0.5], None, [9, 10])
    assert cand.tree.tokens.tolist() == [5, 7, 8, 9, 10] and cand.tree.parents.tolist() == [-1, 0, 1, 0, 0]
    assert cand.tree.depth.tolist() == [0, 1, 2, 1, 1]
    assert cand.p == pytest.approx([1.0, 0.6, 0.3, 0.4 * 0.15, 0.4 * 0.85 * 0.15])
    d.learn(cand, [7, 8, 3])  # the chain was right: nothing about the siblings
    assert d.sibling_rates.seen == {}
    d.learn(cand, [9, 4])  # the first draft missed, sibling 1 was the target's token
    assert d.sibling_rates.seen == {1: 1} and d.sibling_rates.rate(1) == pytest.approx((1 + 0.3) / 3)
    d.learn(cand, [11, 4])  # both siblings tried and wrong
    assert d.sibling_rates.seen == {1: 2, 2: 1} and d.sibling_rates.hits == {1: 1, 2: 0}


def _target_features(target, ids, layers):
    with torch.no_grad():
        hs = target.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hs[l][0] for l in layers], dim=-1)


def test_union_feeds_each_source_its_own_feature_layers(tiny):
    """A union of heads reading different layers gets the union of their layers from the target, and each source
    its own columns in its own order."""
    ds = dspark_head(tiny, feature_layers=[3, 1])
    eagle = EagleDrafter(build_head(HeadSpec(kind="eagle"), tiny), 2, 2, 4)  # reads layer 4
    u = combine_drafters(tiny, [DSparkDrafter(ds, num_tokens=2), eagle], lookup=3, scheduler=scheduler())
    assert u.feature_layers == [1, 3, 4]
    f = torch.arange(2 * 3 * 64, dtype=torch.float32).view(2, 3 * 64)  # [n, F*D] for layers 1, 3, 4
    assert torch.equal(u._features(u.sources[0], f), torch.cat([f[:, 64:128], f[:, :64]], -1))
    assert torch.equal(u._features(u.sources[1], f), f[:, 128:]) and u._features(u.sources[2], f) is None


@pytest.mark.parametrize("anchor", [False, True])
def test_dspark_draft_blocks_is_draft_block_per_row(tiny, anchor):
    """ONE batched head pass over rows whose contexts hold 0, 3 and 9 verified rows gives each row the logits and
    confidences of its own draft_block (the padding columns are masked out)."""
    head = dspark_head(tiny, anchor_features=anchor)
    width = len(head.config.feature_layers) * tiny.config.hidden_size
    g = torch.Generator().manual_seed(0)
    caches = []
    for n in (0, 3, 9):
        c = head.new_cache()
        if n:
            head.extend_context(c, torch.randn(n, width, generator=g))
        caches.append(c)
    anchors = [5, 17, 200]
    logits, conf = head.draft_blocks(caches, anchors)
    for r, (c, a) in enumerate(zip(caches, anchors)):
        one, one_conf = head.draft_block(c, a)
        torch.testing.assert_close(logits[r], one, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(conf[r], one_conf, atol=1e-6, rtol=1e-5)

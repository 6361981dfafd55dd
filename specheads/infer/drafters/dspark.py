"""DSpark / DFlash block heads (DSpark, Cheng et al. 2026, arXiv:2607.05147): one head pass drafts a block of
tokens anchored at the root, verified as a chain (a prefix chosen per step by the scheduler, or a fixed length)."""
from __future__ import annotations


import torch

from specheads.infer.drafters.blocktree import AUTO_NODES, chain_nodes, greedy_tree, sampled_tree
from specheads.infer.drafters.registry import DrafterKind, register_drafter
from specheads.infer.drafters.scored import ScoredDrafter, emitted_tokens
from specheads.infer.engine.protocol import DraftContext, Drafter
from specheads.infer.scheduling.acceptance import PRIOR_STRENGTH, Candidates, Rates, outcomes, survival
from specheads.infer.scheduling.step import Scheduler
from specheads.infer.tree import DraftTree, chain_tree, tree_from_parents
from specheads.infer.treespec import TreeSpec
from specheads.infer.verify import target_probs


class DSparkDrafter(ScoredDrafter):
    """DSpark / DFlash block heads (heads/dspark.py): ONE head pass per step drafts the block anchored at the root,
    as a chain. The head's context cache holds TRUE rows only: reset feeds the prompt's features (every cached
    position), observe appends the accepted rows' target features (root first), so nothing is rolled back.
    Greedy: the Markov chain's argmax tokens. Sampling: draft j is drawn from its warped distribution and draft
    j+1's Markov bias reads the drawn token; those distributions are the tree's q rows, so verify_sampling stays
    lossless. Estimates: survival a_i = c_1 ... c_i of the calibrated confidences (a head without a confidence
    head: per-depth rates learned per request). scheduler: the per-step prefix choice (`--tree auto`); None =
    num_tokens drafts every step. The verified rows' features wait in `unseen` until the next block is drafted
    (one context pass for all of them), so steps that draft nothing (a batch budget resting the row) cost no head
    pass. With a scheduler and greedy decoding the first draft also gets `siblings` alternatives (ranks 1.. of its
    logits) as children of the root, a small tree the scheduler verifies only where they pay: sibling j's estimate
    is (1 - a_1) * prod_{i<j} (1 - r_i) * r_j with r_j = P(rank j is the target's token | ranks < j were not),
    learned per request (prior SIBLING_PRIOR). tree_nodes (`--tree tree:N` / `tree:auto`): instead of the chain,
    the best-first tree over the block's per-position top ranks (blocktree.py, DDTree) of N draft nodes, or with
    a scheduler (0) of up to blocktree.AUTO_NODES of which the scheduler verifies the part that pays."""
    name = "dspark"
    SIBLING_PRIOR = 0.15  # P(the first draft's rank-1 token is right | its rank-0 token is not), before outcomes

    def __init__(self, head, scheduler: Scheduler | None = None, num_tokens: int | None = None, siblings: int = 2,
                 tree_nodes: int | None = None, name: str | None = None):
        self.head, self.scheduler = head, scheduler
        self.name = name or self.name  # the source its proposals report (the serving kind's drafter name)
        self.k = head.num_drafts if num_tokens is None else min(int(num_tokens), head.num_drafts)  # drafts per step
        self.tree_nodes = None if tree_nodes is None else int(tree_nodes)  # None: the chain; 0: scheduled tree
        if self.tree_nodes == 0 and scheduler is None:
            raise ValueError("DSparkDrafter: tree_nodes=0 (the scheduled tree) needs a scheduler")
        scheduled_chain = scheduler is not None and self.tree_nodes is None
        self.siblings = int(siblings) if scheduled_chain else 0  # alternatives to the first draft (the chain's)
        self.sibling_rates = Rates(lambda j: (self.SIBLING_PRIOR, PRIOR_STRENGTH))
        self.feature_layers = list(head.config.feature_layers)
        self.cache = None
        self.unseen: list[torch.Tensor] = []  # [n, F*D] verified rows' features not yet in the context cache
        self.depth_rates = Rates()  # P(draft j accepted | drafts < j were), only without a confidence head
        self.pending: tuple[Candidates, bool] | None = None  # own proposal to learn from (candidates, greedy)

    def reset(self, prompt_ids, features) -> None:
        self.cache = self.head.new_cache()
        self.depth_rates.clear()
        self.sibling_rates.clear()
        self.unseen = [] if features is None or not features.shape[0] else [features]

    def observe(self, tree, accepted, features) -> None:
        if features is not None and features.shape[0]:
            self.unseen.append(features)  # root + accepted nodes: true rows only
        if self.pending is not None:  # alone: the chain's outcome (sampling: only what was verified)
            cand, greedy = self.pending
            truth = emitted_tokens(tree, accepted)
            self.learn(cand if greedy else Candidates(tree, []), truth if greedy else truth[:-1] + [None])
            self.pending = None

    def catch_up(self) -> None:
        """One context pass over every verified row not yet cached."""
        if self.unseen:
            self.head.extend_context(self.cache, torch.cat(self.unseen) if len(self.unseen) > 1 else self.unseen[0])
            self.unseen = []

    @torch.no_grad()
    def candidates(self, ctx: DraftContext) -> Candidates:
        root, k = ctx.ids[-1], min(self.k, ctx.max_depth)
        if self.cache is not None:
            self.cache.ids = ctx.ids  # the sequence so far, root last (a P-EAGLE cache pairs its new rows with it)
        if self.cache is None or k <= 0:
            return Candidates(chain_tree(root, []), [1.0], self.name)
        self.catch_up()
        assert self.cache.length == len(ctx.ids) - 1, (self.cache.length, len(ctx.ids))
        if self.tree_nodes is not None:
            return self._tree_candidates(ctx, k)
        return self._candidates(ctx, *self._block(ctx, k))

    def _tree_candidates(self, ctx: DraftContext, k: int) -> Candidates:
        """The best-first tree over one block pass (blocktree.py): tree_nodes draft nodes, or AUTO_NODES for the
        scheduler to choose from."""
        budget = self.tree_nodes or AUTO_NODES
        if ctx.sampling.greedy:
            logits, conf = self.head.draft_block(self.cache, ctx.ids[-1])  # [K', V'], [K'] | None
            return greedy_tree(self, ctx, logits, None if conf is None else conf.tolist(), k, budget)
        drafts, conf, q, _ = self._block(ctx, k)
        return sampled_tree(self, ctx, drafts, conf, q, budget)

    def _candidates(self, ctx: DraftContext, drafts: list[int], conf: list[float] | None,
                    q: torch.Tensor | None, sibs: list[int] = ()) -> Candidates:
        """The chain of drafts after the root with its survival estimates (confidences or learned rates), then the
        first draft's siblings (children of the root) with theirs."""
        k = len(drafts)
        if conf is None:
            conf = [self.depth_rates.rate(d) for d in range(1, k + 1)]
        p = [1.0] + survival(conf[:k])
        if not sibs:
            return Candidates(chain_tree(ctx.ids[-1], drafts, q), p, self.name)
        miss = 1.0 - p[1]  # the first draft is not the target's token
        for j in range(len(sibs)):
            r = self.sibling_rates.rate(j + 1)
            p.append(miss * r)
            miss *= 1.0 - r
        tree = tree_from_parents([ctx.ids[-1]] + drafts + list(sibs), [-1] + list(range(k)) + [0] * len(sibs))
        return Candidates(tree, p, self.name)

    def _block(self, ctx: DraftContext, k: int
               ) -> tuple[list[int], list[float] | None, torch.Tensor | None, list[int]]:
        """One head pass: (k draft target ids, confidences or None, q [k+1, V] or None (greedy), the first draft's
        sibling target ids (greedy with self.siblings, else none))."""
        head, root = self.head, ctx.ids[-1]
        if ctx.sampling.greedy:
            logits, conf = head.draft_block(self.cache, root)  # [K', V'], [K'] | None
            drafts = head.to_target_ids(logits[:k].argmax(-1)).tolist()
            s = min(self.siblings, logits.shape[-1] - 1)
            sibs = head.to_target_ids(logits[0].topk(1 + s).indices[1:]).tolist() if s > 0 else []
            return drafts, None if conf is None else conf.tolist(), None, sibs
        drawn: dict[int, torch.Tensor] = {}

        def pick(j: int, lg: torch.Tensor) -> torch.Tensor:  # lg [1, 1, V']: draft j drawn from its warped q
            drawn[j] = torch.multinomial(target_probs(lg[0, 0:1], ctx.sampling)[0].cpu(), 1, generator=ctx.generator)
            return drawn[j].to(lg.device).view(1, 1)

        logits, conf = head.draft_block(self.cache, root, pick=pick)  # Markov bias of draft j reads drawn j-1
        qs = target_probs(logits[:k], ctx.sampling).cpu()  # [k, V'] the distributions the drafts came from
        ids = [drawn[j] if j in drawn else torch.multinomial(qs[j], 1, generator=ctx.generator) for j in range(k)]
        drafts = head.to_target_ids(torch.cat(ids).to(logits.device)).tolist()
        vocab = head.config.vocab_size
        q = torch.zeros(k + 1, vocab)
        cols = torch.arange(vocab) if getattr(head, "d2t", None) is None else head.d2t.cpu()
        q[:k, cols] = qs
        q[k] = 1.0 / vocab  # the leaf's row is never read
        return drafts, None if conf is None else conf.tolist(), q, []

    def learn(self, cand, truth) -> None:
        if self.tree_nodes is not None:  # a block tree: the chain's per-depth rates only (ranks >= 1 read the block)
            if self.head.confidence_head is None:
                chain = set(chain_nodes(cand.tree))
                for node, ok in outcomes(cand.tree, truth):
                    if node in chain:
                        self.depth_rates.add(int(cand.tree.depth[node]), ok)
            return
        parents = cand.tree.parents.tolist()
        sibs = [i for i in range(2, len(parents)) if parents[i] == 0]  # the first draft's siblings, rank order
        if self.head.confidence_head is None:
            for node, ok in outcomes(cand.tree, truth):
                if node not in sibs:
                    self.depth_rates.add(int(cand.tree.depth[node]), ok)
        tokens = cand.tree.tokens.tolist()
        if sibs and truth and truth[0] is not None and tokens[1] != truth[0]:  # the first draft missed
            for j, i in enumerate(sibs, start=1):
                self.sibling_rates.add(j, tokens[i] == truth[0])
                if tokens[i] == truth[0]:
                    break

    def alone(self, cand, scheduler, prices, draft_s) -> DraftTree:
        if self.scheduler is None:
            return cand.tree
        return cand.tree.select(scheduler.choose(cand, prices, draft_s).keep)

    @staticmethod
    @torch.no_grad()
    def propose_many(drafters: list["DSparkDrafter"], ctxs: list[DraftContext]) -> list[DraftTree]:
        """propose for many rows (batch.py): the greedy rows of one head without a per-row scheduler draft their
        blocks in ONE head pass (head.draft_blocks); any other row proposes alone. Same trees as propose."""
        trees: list[DraftTree | None] = [None] * len(drafters)
        groups: dict[int, list[int]] = {}
        for i, (d, c) in enumerate(zip(drafters, ctxs)):
            if d.scheduler is None and c.sampling.greedy and d.cache is not None and min(d.k, c.max_depth) > 0:
                groups.setdefault(id(d.head), []).append(i)
        for rows in groups.values():
            if len(rows) < 2:
                continue
            for i in rows:
                drafters[i].cache.ids = ctxs[i].ids
                drafters[i].catch_up()
                assert drafters[i].cache.length == len(ctxs[i].ids) - 1, (drafters[i].cache.length, len(ctxs[i].ids))
            head = drafters[rows[0]].head
            logits, conf = head.draft_blocks([drafters[i].cache for i in rows], [ctxs[i].ids[-1] for i in rows])
            for r, i in enumerate(rows):
                d, k = drafters[i], min(drafters[i].k, ctxs[i].max_depth)
                conf_r = None if conf is None else conf[r].tolist()
                if d.tree_nodes is not None:  # a fixed-size block tree (blocktree.py)
                    cand = greedy_tree(d, ctxs[i], logits[r], conf_r, k, d.tree_nodes)
                else:
                    drafts = head.to_target_ids(logits[r, :k].argmax(-1)).tolist()
                    cand = d._candidates(ctxs[i], drafts, conf_r, None)
                d.pending, d.report = (cand, True), None
                trees[i] = cand.tree
        return [t if t is not None else d.propose(c) for t, d, c in zip(trees, drafters, ctxs)]

    def propose(self, ctx: DraftContext) -> DraftTree:
        return self.scheduled_proposal(ctx)



def block_drafter(cls, head, spec: TreeSpec, scheduler: Scheduler | None = None) -> Drafter:
    """A block drafter of class `cls` for `--tree`: `auto`: the per-step scheduler chooses the prefix; K: the first
    K drafts of every block; `tree:N`: the best-first block tree of N draft nodes; `tree:auto`: the scheduler
    chooses from the best-first tree (blocktree.py)."""
    if spec.mode == "auto":
        return cls(head, scheduler=scheduler)
    if spec.mode == "blocktree":
        return cls(head, scheduler=scheduler if not spec.total_tokens else None, tree_nodes=spec.total_tokens)
    return cls(head, num_tokens=spec.num_tokens)


def _dspark(target, head, spec: TreeSpec, scheduler: Scheduler | None = None) -> Drafter:
    return block_drafter(DSparkDrafter, head, spec, scheduler)


KIND = register_drafter(DrafterKind("dspark", "block", "a DSpark head", _dspark, default_tree="auto", head=True))

"""Scored drafters: proposals with per-node acceptance estimates (acceptance.Candidates), so the per-step scheduler
(infer/scheduling/step.py) can choose what of them to verify, alone or merged with other sources (union.py)."""
from __future__ import annotations

import time

from specheads.infer.drafters.prompt_lookup import PromptLookupDrafter
from specheads.infer.engine.protocol import DraftContext, Drafter
from specheads.infer.scheduling.acceptance import Candidates, LookupRates, outcomes, path_products, rank_rates, survival
from specheads.infer.scheduling.step import Scheduler, StepReport
from specheads.infer.tree import DraftTree, chain_tree
from specheads.infer.verify import Accepted


class ScoredDrafter(Drafter):
    """A drafter whose proposal carries per-node acceptance estimates (acceptance.Candidates), so a scheduler can
    choose what of it to verify, alone or merged with other sources (ScheduledUnionDrafter)."""

    report: StepReport | None = None

    def candidates(self, ctx: DraftContext) -> Candidates:  # pragma: no cover - interface
        raise NotImplementedError

    def learn(self, cand: Candidates, truth: list[int | None]) -> None:
        """The step's outcome for the estimates: `truth` = the emitted tokens (greedy: the target's own argmax
        continuation, bonus included, which decides every candidate whose parent was on it)."""

    def alone(self, cand: Candidates, scheduler: Scheduler, prices, draft_s: float) -> DraftTree:
        """What this source would verify on its own (the oracle's figure): its whole proposal unless overridden."""
        return cand.tree

    def step_report(self) -> StepReport | None:
        return self.report

    def scheduled_proposal(self, ctx: DraftContext) -> DraftTree:
        """A drafter scheduling its own proposal (a block head's auto, the layer-skip chain): its candidates, the
        part `self.scheduler` (None: all of it) says pays at this step's prices; `pending` and `report` remember
        the step for observe and the generator."""
        t0 = time.perf_counter()
        cand = self.candidates(ctx)
        self.pending, self.report = (cand, ctx.sampling.greedy), None
        if self.scheduler is None:
            return cand.tree
        prices = self.scheduler.prices(ctx.clock, draft_now=time.perf_counter() - t0)
        choice = self.scheduler.choose(cand, prices)
        self.report = StepReport(choice.expected_tau, choice.cost)
        return cand.tree.select(choice.keep)


def emitted_tokens(tree: DraftTree, accepted: Accepted) -> list[int]:
    """The tokens a step emits before any stop cut: the accepted draft nodes' tokens, then the bonus."""
    return [int(tree.tokens[i]) for i in accepted.nodes[1:]] + [accepted.bonus]


class ScoredTreeDrafter(ScoredDrafter):
    """An EAGLE / Medusa drafter's tree with per-node estimates p = the product along the path of P(accepted |
    parent accepted) by (depth, rank) (scheduler.rank_rates: the `--tree auto` probe's matrix as prior, learned per
    request from every step's greedy outcome). Rates by depth and rank are what autotree measured for this head and
    are calibrated by construction; a small head's draft probabilities would need a calibration map of their own."""

    def __init__(self, inner: Drafter, acceptance: dict | None = None):
        self.inner, self.name, self.feature_layers = inner, inner.name, inner.feature_layers
        acceptance = acceptance or {}
        self.rates = rank_rates(acceptance.get("acc"), acceptance.get("counts"))

    def reset(self, prompt_ids, features) -> None:
        self.inner.reset(prompt_ids, features)
        self.rates.clear()

    def propose(self, ctx):
        return self.inner.propose(ctx)

    def observe(self, tree, accepted, features) -> None:
        self.inner.observe(tree, accepted, features)

    @property
    def reads_logits(self) -> bool:
        return self.inner.reads_logits

    def recycle(self, tokens, logits) -> None:
        self.inner.recycle(tokens, logits)

    def candidates(self, ctx) -> Candidates:
        tree = self.inner.propose(ctx)
        return Candidates(tree, path_products(tree, lambda d, r: self.rates.rate((d, r))), self.name)

    def learn(self, cand, truth) -> None:
        rank = [0] * len(cand.tree)
        for ch in cand.tree.children_lists():
            for r, c in enumerate(ch):
                rank[c] = r
        for node, ok in outcomes(cand.tree, truth):
            self.rates.add((int(cand.tree.depth[node]), rank[node]), ok)


class ScoredLookupDrafter(ScoredDrafter):
    """Prompt lookup's chain with per-token estimates: P(accepted | parent accepted) by match length and depth
    (acceptance.LookupRates), learned per request from each step's greedy outcome."""
    name = "lookup"

    def __init__(self, num_tokens: int = 10, max_ngram: int = 3):
        self.lookup = PromptLookupDrafter(num_tokens=num_tokens, max_ngram=max_ngram)
        self.rates = LookupRates()
        self.match = 0  # this step's match length

    def reset(self, prompt_ids, features) -> None:
        self.rates.clear()

    def propose(self, ctx):
        return self.lookup.propose(ctx)

    def candidates(self, ctx) -> Candidates:
        cont, self.match = self.lookup.find(ctx.ids, min(self.lookup.k, ctx.max_depth))
        conf = [self.rates.rate(self.match, d) for d in range(1, len(cont) + 1)]
        return Candidates(chain_tree(ctx.ids[-1], cont), [1.0] + survival(conf), self.name)

    def learn(self, cand, truth) -> None:
        for node, ok in outcomes(cand.tree, truth):
            self.rates.add(self.match, int(cand.tree.depth[node]), ok)



def scored(drafter: Drafter, acceptance: dict | None = None) -> ScoredDrafter:
    """A drafter as a scheduler source: scored drafters as they are, tree drafters with (depth, rank) rates."""
    return drafter if isinstance(drafter, ScoredDrafter) else ScoredTreeDrafter(drafter, acceptance)

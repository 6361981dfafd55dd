"""Several scored drafters (heads, prompt lookup) under one per-step scheduler: their proposals' trie union, one
verify budget per step, and sources whose draft pass does not pay resting."""
from __future__ import annotations

import time
from collections import deque

import torch

from specheads.infer.drafters.scored import ScoredDrafter, ScoredLookupDrafter, emitted_tokens, scored
from specheads.infer.engine.protocol import DraftContext, Drafter
from specheads.infer.scheduling.acceptance import accepted_along, merge_candidates
from specheads.infer.scheduling.step import WINDOW_STEPS, Scheduler, StepReport
from specheads.infer.tree import DraftTree, chain_tree


class ScheduledUnionDrafter(Drafter):
    """Several scored drafters under one scheduler: each step every source proposes its candidates, their trie union
    is scored (scheduler.merge_candidates) and the scheduler verifies its best ancestor-closed part, so one verify
    budget is spent across the sources; every source's draft pass is paid (the measured drafter seconds price it).
    Greedy only: with sampling the first source drafts alone. Every source observes every step (their caches hold
    true rows only). The report also says what each source alone would have emitted (greedy: the target's argmax is
    known along the emitted path), for the oracle figure.
    A source whose pass does not pay rests: when the mean expected tokens its own nodes added to the verified set
    over its last REST_WINDOW steps, g_s, is below d_s * E / C (its measured pass d_s in t(1) units times the step's
    expected tokens per unit of cost), it proposes nothing for `explore_every` - 1 steps, then drafts again (lazy
    caches make a rested head's catch-up one pass); explore_every=1, or the scheduler's pricing="profile" (d_s = 0):
    no source ever rests."""
    REST_WINDOW = 8  # steps of a source's gains behind a decision to rest it (at least half of them seen)

    def __init__(self, sources: list[ScoredDrafter], scheduler: Scheduler, explore_every: int = 16):
        self.sources, self.scheduler, self.explore_every = list(sources), scheduler, explore_every
        names = [s.name for s in self.sources]
        self.names = [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]
        self.name = "+".join(self.names)
        layers = sorted({l for s in self.sources for l in (s.feature_layers or [])})
        self.feature_layers = layers or None
        self.seconds = {n: deque(maxlen=WINDOW_STEPS) for n in self.names}  # per source: seconds per step
        self.step: dict | None = None  # this step's candidates, prices and seconds (greedy)
        self.report: StepReport | None = None
        self.gains = {n: deque(maxlen=self.REST_WINDOW) for n in self.names}  # per source: its nodes' expected tokens
        self.resting: dict[str, int] = {}  # source -> steps since it last proposed

    def _features(self, source: Drafter, features: torch.Tensor | None) -> torch.Tensor | None:
        """The columns of `features` [n, F*D] (this drafter's layers) that `source` reads, in its order."""
        if features is None or not source.feature_layers:
            return None
        if source.feature_layers == self.feature_layers:
            return features
        d = features.shape[-1] // len(self.feature_layers)
        idx = [self.feature_layers.index(l) for l in source.feature_layers]
        return torch.cat([features[..., i * d:(i + 1) * d] for i in idx], dim=-1)

    def reset(self, prompt_ids, features) -> None:
        for s in self.sources:
            s.reset(prompt_ids, self._features(s, features))

    def propose(self, ctx: DraftContext) -> DraftTree:
        self.step, self.report = None, None
        if not ctx.sampling.greedy:
            return self.sources[0].propose(ctx)
        t0 = time.perf_counter()
        cands, secs = {}, {}
        for name, s in zip(self.names, self.sources):
            if 0 < self.resting.get(name, 0) < self.explore_every:
                self.resting[name] += 1
                continue
            t = time.perf_counter()
            cands[name] = s.candidates(ctx)
            secs[name] = time.perf_counter() - t
        if not cands:  # every source resting: plain decoding (the oracle's step too: one token at this cost)
            self.report = StepReport(1.0, self.scheduler.cost_of(1, self.scheduler.prices(ctx.clock)), rested=True)
            self.step = {"cands": {}, "prices": None, "seconds": {}}
            return chain_tree(ctx.ids[-1], [])
        merged, maps = merge_candidates(list(cands.values()))
        prices = self.scheduler.prices(ctx.clock, draft_now=time.perf_counter() - t0)
        choice = self.scheduler.choose(merged, prices)
        self.step = {"cands": cands, "prices": prices, "seconds": secs}
        self.report = StepReport(choice.expected_tau, choice.cost)
        self._rest(cands, maps, merged.p, set(choice.keep), prices, choice.expected_tau / choice.cost)
        return merged.tree.select(choice.keep)

    def _rest(self, cands: dict, maps: list[list[int]], p: list[float], kept: set[int], prices, rate: float) -> None:
        """Each proposing source's gain this step (Σ p over the kept union nodes it alone proposed); a source whose
        mean gain is below its own pass's price at this step's rate rests (class docstring)."""
        owners: dict[int, int] = {}
        for where in maps:
            for i in set(where):
                owners[i] = owners.get(i, 0) + 1
        for name, where in zip(cands, maps):
            gain = sum(p[i] for i in set(where) if i in kept and i and owners[i] == 1)
            self.gains[name].append(gain)
            d = self.scheduler.source_seconds(self.seconds[name]) / prices.t1  # its pass, in t(1) units
            g = self.gains[name]
            if len(g) * 2 >= self.REST_WINDOW and sum(g) / len(g) < d * rate:
                self.resting[name], self.gains[name] = 1, deque(maxlen=self.REST_WINDOW)
            else:
                self.resting.pop(name, None)

    @property
    def reads_logits(self) -> bool:
        return any(s.reads_logits for s in self.sources)

    def recycle(self, tokens, logits) -> None:
        for s in self.sources:
            s.recycle(tokens, logits)

    def observe(self, tree, accepted, features) -> None:
        secs = self.step["seconds"] if self.step else {}
        for name, s in zip(self.names, self.sources):
            t = time.perf_counter()
            s.observe(tree, accepted, self._features(s, features))
            if name in secs:  # a resting source's seconds are not its pass's
                self.seconds[name].append(secs[name] + time.perf_counter() - t)
        if self.step is not None and self.step["cands"]:
            self._learn_and_replay(emitted_tokens(tree, accepted))

    def _learn_and_replay(self, truth: list[int]) -> None:
        """Each proposing source learns from the outcome and is replayed alone: its own proposal's accepted length
        and the cost of its own step (its draft seconds, the loop's, the verification of its own tree)."""
        prices = self.step["prices"]
        for name, s in zip(self.names, self.sources):
            cand = self.step["cands"].get(name)
            if cand is None:
                continue
            s.learn(cand, truth)
            own = self.scheduler.source_seconds(self.seconds[name])
            tree = s.alone(cand, self.scheduler, prices, own)
            n, censored = accepted_along(tree, truth)
            self.report.sources[name] = n + 1
            self.report.source_cost[name] = self.scheduler.cost_of(len(tree), prices, own)
            self.report.censored[name] = censored

    def step_report(self) -> StepReport | None:
        return self.report if self.step is not None else self.sources[0].step_report()


def combine_drafters(target, drafters: list[Drafter], *, lookup: int = 0, lookup_ngram: int = 3,
                     acceptances: list[dict | None] | None = None, scheduler: Scheduler | None = None,
                     explore_every: int = 16) -> ScheduledUnionDrafter:
    """Drafters (and, lookup > 0, prompt lookup's chain of up to that many tokens) under one per-step scheduler.
    acceptances: per drafter, the `--tree auto` probe's {"acc", "counts"} (the prior of a tree head's rates).
    scheduler: None = a drafter's own, else one priced by the target's cached cost profile. explore_every: steps a
    source whose pass does not pay rests (1 = never)."""
    sources = [scored(d, a) for d, a in zip(drafters, acceptances or [None] * len(drafters))]
    if lookup:
        sources.append(ScoredLookupDrafter(num_tokens=lookup, max_ngram=lookup_ngram))
    if scheduler is None:
        scheduler = next((d.scheduler for d in drafters if getattr(d, "scheduler", None) is not None), None)
    return ScheduledUnionDrafter(sources, scheduler or Scheduler.for_target(target), explore_every=explore_every)

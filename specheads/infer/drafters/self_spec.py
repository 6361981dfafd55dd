"""Self-speculative decoding: the target drafts for itself with some of its sublayers skipped, sharing its weights and
its KV cache, and verifies with its full pass (Draft & Verify, Zhang et al., ACL 2024, arXiv 2309.08168; LayerSkip,
Elhoushi et al., ACL 2024). Nothing is trained, shipped or kept in step with the target."""
from __future__ import annotations

import copy

import torch

from specheads.infer.drafters.registry import DrafterKind, register_drafter
from specheads.infer.drafters.scored import ScoredDrafter
from specheads.infer.engine.owned import SkipSet
from specheads.infer.engine.protocol import DraftContext, Drafter
from specheads.infer.scheduling.acceptance import (PRIOR_STRENGTH, PROBE_PRIOR_CAP, Candidates, Rates, outcomes,
                                                   survival)
from specheads.infer.scheduling.costs import interp_cost
from specheads.infer.scheduling.skipsearch import load_or_search, owned_model
from specheads.infer.scheduling.step import Scheduler, StepReport
from specheads.infer.tree import DraftTree, chain_tree
from specheads.infer.treespec import TreeSpec
from specheads.infer.verify import target_probs
from specheads.utils import SpecheadsError

SKIP_AUTO = ("auto", "search")  # --skip-layers: the cached search result (searched when missing) / search again


class LayerSkipDrafter(ScoredDrafter):
    """Draft & Verify's self-draft. The draft model is the target with a set z of attention / MLP sublayers left out,
        q_z(x | x_<t) = softmax(W_lm n_final(h^z_t)),   h^z = the residual stream through the kept sublayers only,
    and it drafts a chain x_1 .. x_K from the root autoregressively (greedy: argmax q_z; sampling: x_j ~ q_z warped
    as the target samples, q_z recorded as the tree's q rows, so verify_sampling stays lossless). z is chosen on this
    target by measured acceptance per cost (scheduling/skipsearch.py; the paper's Bayesian optimisation) or given.

    Cache: the draft runs OwnedLlama.draft over the target's own cache. Draft input j (the root, then draft j) sits
    at position length + j and writes the kept attention sublayers' keys / values at column length + j, reading the
    kept columns [0, length) that the full passes wrote and this step's earlier draft columns; the verify forward then
    writes its tree at [length, length + N) before it reads any of them, and `keep` moves the accepted nodes down as
    for any drafter. Nothing is copied, and the kept prefix is never written by a draft.

    Chain length: `num_tokens` drafts every step, or (a scheduler: `--tree auto`) Draft & Verify's adaptive draft
    exit priced by the scheduler's rule: after draft n with survival a_n, E_n = 1 + a_1 + ... + a_n and cost
    C_n = t(n+1)/t(1) + n c (c = OwnedLlama.draft_share, the pass's weights over a full pass's), drafting goes on
    while (E_n + a_n r_n) / C_{n+1} > E_n / C_n, up to MAX_AUTO; the scheduler then verifies the prefix that pays.
    A step drafts nothing (plain decoding, the rule's S = {} extended to the draft pass itself) while one draft is not
    expected to pay, (1 + r_1) / (t(2)/t(1) + c) <= 1 / (t(1)/t(1)), r_1 = P(draft 1 accepted) learned per step
    with the search's measured alpha_1 as prior; every EXPLORE_EVERY-th such step drafts anyway, to keep r_1 true.
    Estimates: P(draft j accepted | drafts < j were) = r(conf_j), conf_j the draft's top-1 probability, calibrated
    per tenth of confidence from every greedy outcome over the drafter's life (prior: the search's measured alpha_1,
    else the bin's own confidence)."""
    name = "layer-skip"
    MAX_AUTO = 10  # drafts per step at most under the adaptive exit
    EXPLORE_EVERY = 16  # a resting draft drafts again on every 16th step (the unions' explore_every)
    BINS = 10  # confidence bins of the calibration

    def __init__(self, target, skip: SkipSet, num_tokens: int | None = None, scheduler: Scheduler | None = None,
                 record: dict | None = None):
        self.target, self.owned, self.skip = target, owned_model(target), skip
        self.scheduler = scheduler if num_tokens is None else None
        self.k = self.MAX_AUTO if num_tokens is None else int(num_tokens)  # drafts per step (at most, with auto)
        self.share = self.owned.draft_share(skip)  # one draft pass, in one-token target forwards
        self.record = {"skip": skip.text(), "skipped": len(skip), "share": round(self.share, 4), **(record or {})}
        alpha1 = (self.record.get("acceptance") or [None])[0]  # the search's measured P(draft 1 accepted)
        seen1 = float((self.record.get("seen") or [0])[0])
        self.rates = Rates(lambda b: ((b + 0.5) / self.BINS if alpha1 is None else float(alpha1), PRIOR_STRENGTH))
        self.first = Rates(lambda _: (0.5 if alpha1 is None else float(alpha1),
                                      max(min(seen1, PROBE_PRIOR_CAP), PRIOR_STRENGTH)))
        self.rested = 0  # steps rested since the last draft
        self.conf: list[float] = []  # this step's draft confidences, chain order
        self.pending: tuple[Candidates, bool] | None = None
        self.report: StepReport | None = None

    def _bin(self, conf: float) -> int:
        return min(int(conf * self.BINS), self.BINS - 1)

    def reset(self, prompt_ids, features) -> None:
        self.owned = owned_model(self.target)  # the loop's runner of this request (refused should it be HF's now)

    def __deepcopy__(self, memo):
        """A copy with its own state (rates, pending step) drafting for the same target and forward."""
        new = copy.copy(self)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key not in ("target", "owned"):
                setattr(new, key, copy.deepcopy(value, memo))
        return new

    @torch.no_grad()
    def candidates(self, ctx: DraftContext) -> Candidates:
        root, k = ctx.ids[-1], min(self.k, ctx.max_depth)
        if self.owned.length != len(ctx.ids) - 1:
            raise SpecheadsError("--drafter layer-skip: drafts over the single-request loop's own cache (generate, "
                                 "bench single runs); the batched loop (--batch-sizes) keeps another cache")
        other = self._other(ctx)
        if k > 0 and not self._draft_pays(ctx, other):
            k = 0
        drafts, self.conf, q = self._chain(ctx, k, other) if k > 0 else ([], [], None)
        p = [1.0] + survival([self.rates.rate(self._bin(c)) for c in self.conf])
        return Candidates(chain_tree(root, drafts, q), p, self.name)

    def _chain(self, ctx: DraftContext, k: int, other: float) -> tuple[list[int], list[float], torch.Tensor | None]:
        """Up to k draft passes (fewer where the adaptive exit stops): (drafts, confidences, q [n+1, V] | None)."""
        greedy, tok = ctx.sampling.greedy, ctx.ids[-1]
        drafts, confs, qs = [], [], []
        tau, surv = 1.0, 1.0
        for j in range(k):
            logits = self.owned.draft(torch.tensor([tok]), j, self.skip).float()  # [V]
            if greedy:
                probs = torch.softmax(logits, -1)
                tok = int(logits.argmax())
                conf = float(probs[tok])
            else:
                probs = target_probs(logits[None], ctx.sampling)[0].cpu()  # [V] the draft's warped distribution
                qs.append(probs)
                tok = int(torch.multinomial(probs, 1, generator=ctx.generator))
                conf = float(probs.max())
            drafts.append(tok)
            confs.append(conf)
            rate = self.rates.rate(self._bin(conf))
            surv *= rate
            tau += surv
            if self.scheduler is not None and not self._worth_another(j + 1, tau, surv * rate, other):
                break
        q = None
        if qs:
            q = torch.cat([torch.stack(qs), torch.full((1, qs[0].numel()), 1.0 / qs[0].numel())])  # leaf row unused
        return drafts, confs, q

    def _other(self, ctx: DraftContext) -> float:
        """The loop's own seconds per step in t(1) units (measured pricing), added to every chain's cost."""
        if self.scheduler is None or not self.scheduler.measured:
            return 0.0
        prices = self.scheduler.prices(ctx.clock)
        return prices.other / prices.t1 if prices.t1 > 0 else 0.0

    def _draft_pays(self, ctx: DraftContext, other: float) -> bool:
        """Whether this step drafts at all (class docstring): always with a fixed chain or when sampling."""
        if self.scheduler is None or not ctx.sampling.greedy:
            return True
        costs = self.scheduler.verify_costs
        one = (1.0 + self.first.rate(1)) / (interp_cost(costs, 2) + self.share + other)
        if one > 1.0 / (interp_cost(costs, 1) + other):
            self.rested = 0
            return True
        self.rested += 1
        if self.rested >= self.EXPLORE_EVERY:
            self.rested = 0
            return True
        return False

    def _worth_another(self, n: int, tau: float, gain: float, other: float) -> bool:
        """The adaptive exit (class docstring): does draft n + 1, expected to add `gain`, raise tokens per cost?"""
        costs = self.scheduler.verify_costs
        now = interp_cost(costs, n + 1) + n * self.share + other
        more = interp_cost(costs, n + 2) + (n + 1) * self.share + other
        return (tau + gain) / more > tau / now

    def propose(self, ctx: DraftContext) -> DraftTree:
        return self.scheduled_proposal(ctx)

    def observe(self, tree, accepted, features) -> None:
        if self.pending is not None:
            cand, greedy = self.pending
            if greedy:  # greedy outcomes calibrate the confidences (what the scheduler's estimates are for)
                self.learn(cand, [int(tree.tokens[i]) for i in accepted.nodes[1:]] + [accepted.bonus])
            self.pending = None

    def learn(self, cand: Candidates, truth) -> None:
        for node, ok in outcomes(cand.tree, truth):
            self.rates.add(self._bin(self.conf[node - 1]), ok)
            if node == 1:
                self.first.add(1, ok)


def resolve_skip(target, skip: str | SkipSet = "auto", calib_ids=None, verify_costs=None) -> tuple[SkipSet, dict]:
    """The skip set of `--skip-layers`: SPEC as given, `auto` the cached search result (a search on `calib_ids`,
    default a few MT-bench questions, when none is cached), `search` a new search. -> (set, its record)."""
    if isinstance(skip, SkipSet):
        return skip, {"from": "given"}
    text = str(skip).strip()
    if text not in SKIP_AUTO:
        return SkipSet.parse(text, target.num_layers), {"from": "--skip-layers"}
    owned_model(target)  # the HF path is refused before any prompt is encoded
    if calib_ids is None:
        if target.tokenizer is None:
            raise SpecheadsError(f"--skip-layers {text}: target {target.name} has no tokenizer to encode the search's "
                                 "calibration prompts; give --skip-layers SPEC (e.g. m4-12,a9)")
        calib_ids = _mt_bench_ids(target)
    rec = load_or_search(target, calib_ids, refresh=text == "search", verify_costs=verify_costs)
    rec = {k: v for k, v in rec.items() if k not in ("evaluations", "influence", "order")}
    return SkipSet.parse(rec["skip"], target.num_layers), {"from": "search", **rec}


def _mt_bench_ids(target):
    def ids():
        from specheads.prompts import calibration_ids, load_prompts

        return calibration_ids(target.tokenizer, load_prompts("mt-bench"))

    return ids


def _layer_skip(target, head, spec: TreeSpec, scheduler: Scheduler | None = None, skip: str | SkipSet = "auto",
                calib_ids=None) -> Drafter:
    """`auto`: the adaptive exit and the per-step scheduler (made from the cached cost profile when not given);
    K: K drafts every step. skip: `--skip-layers` (resolve_skip)."""
    owned_model(target)
    if spec.mode == "auto" and scheduler is None:
        scheduler = Scheduler.for_target(target)
    chosen, record = resolve_skip(target, skip, calib_ids, scheduler.verify_costs if scheduler else None)
    if spec.mode == "auto":
        return LayerSkipDrafter(target, chosen, scheduler=scheduler, record=record)
    return LayerSkipDrafter(target, chosen, num_tokens=spec.num_tokens, record=record)


register_drafter(DrafterKind("layer-skip", "block", "layer-skip (self-speculative)", _layer_skip,
                             default_tree="auto", check=owned_model))

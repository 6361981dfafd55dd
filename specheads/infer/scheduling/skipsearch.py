"""The skip set of a layer-skip self-draft (drafters/self_spec.py), chosen on this target by measured acceptance per
cost, cached per target + machine + dtype beside the cost profile (cache_root()/profiles/*-layerskip-*.json; the
thread count is not part of the key: `search_key`).

Draft & Verify (Zhang et al., ACL 2024) chooses the skipped attention / MLP sublayers z by Bayesian optimisation of
the draft's speed on a few calibration prompts. This search has the same objective and search space on a fixed
budget (at most MAX_EVALS measured sets on CALIBRATION_PROMPTS prompts of SEARCH_TOKENS tokens each):

1. Continuations: the target's own greedy answer to each calibration prompt (our loop, plain decoding); the prompt
   plus answer is prefilled once per prompt through the owned forward and its cache kept (OwnedLlama.snapshot).
2. Order: each sublayer's block influence (ShortGPT, Men et al. 2024), BI = 1 - cos(x before, x after) of the
   residual stream averaged over the calibration tokens (one HF forward per prompt), over the weights it reads:
   sublayers that change the stream least per byte come first.
3. Measure (`walk`): a set's acceptance is the serving walk on the target's own continuation: from each root the
   draft chains greedily over the shared cache of the true prefix (OwnedLlama.draft with `prefix`), stopping at its
   first miss or WALK_DEPTH; the next root is the first token it missed, as serving continues after the bonus.
   alpha_j = P(draft j is the target's token | drafts < j were), hits / seen per depth.
4. Score (`score`): expected tokens per unit cost of the best fixed chain length k,
       value(z) = max_k (1 + sum_{j<=k} prod_{i<=j} alpha_i) / (t(k+1)/t(1) + k c(z)),
   t(n)/t(1) the cached verify-cost profile (a CPU-flat stand-in when none is cached: the search itself never
   times anything), c(z) = OwnedLlama.draft_share: the weights a draft pass reads over a full pass's (decoding is
   weight-bound: the kept sublayers plus the lm_head, whose share a small target makes large). Plain decoding = 1;
   the record says whether the best set beats it (`pays`).
5. Search: nested prefixes of the order at COARSE_SHARES of the weights skipped, then best-improvement local moves
   (skip the next sublayers of the order, keep the last skipped ones) while they gain MIN_GAIN and evaluations
   remain.
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import platform
import time
from typing import Any, Sequence

import torch

from specheads.infer.engine.owned import SkipSet
from specheads.infer.engine.runner import OwnedRunner, runner_for
from specheads.infer.scheduling.costs import interp_cost, relative_costs
from specheads.infer.scheduling.profile import cached_profile, cached_verify, profile_path
from specheads.infer.scheduling.profile_check import DAMAGED, STALE
from specheads.runinfo import environment
from specheads.utils import SpecheadsError, atomic_write_json, cache_root

log = logging.getLogger(__name__)

SEARCH_VERSION = 1  # bump when the measurement or the score changes: cached results of older versions are redone
SEARCH_TOKENS = 64  # target tokens per calibration prompt the walk runs over
WALK_DEPTH = 8  # deepest draft the walk measures
MAX_EVALS = 24  # measured skip sets at most
COARSE_SHARES = (0.1, 0.2, 0.3, 0.4, 0.5)  # the nested prefixes: fraction of the decoder weights skipped
LOCAL_MOVES = 3  # per side: the next sublayers of the order to skip, the last skipped ones to keep
MIN_GAIN = 0.01  # a local move is taken when its value is at least 1% higher
FLAT_VERIFY = {1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.2, 32: 1.4}  # t(n)/t(1) without a cached profile (a CPU's)


def owned_model(target, flag: str = "--drafter layer-skip"):
    """The target's owned forward (engine/owned.py) that a layer-skip draft shares; one line when it runs HF's."""
    runner = runner_for(target)
    if not isinstance(runner, OwnedRunner):
        from specheads.infer.engine.owned import owned_reason

        why = owned_reason(target.model) or "--engine hf"
        raise SpecheadsError(f"{flag}: target {target.name} runs the HF forward ({why}); a layer-skip draft shares "
                             "the owned forward's weights and cache (--engine auto or owned, a supported family)")
    return runner.model


# --------------------------------------------------------------------------------------------------- measurement
def continuations(target, calib_ids: Sequence[Sequence[int]], tokens: int = SEARCH_TOKENS) -> list[tuple[int, list]]:
    """(prompt length, prompt + the target's greedy continuation of up to `tokens` tokens) per prompt."""
    from specheads.infer.engine.generate import generate  # the loop imports the drafters, which import this

    out = []
    for ids in calib_ids:
        res = generate(target, None, list(ids), max_new_tokens=tokens)
        out.append((len(ids), list(ids) + list(res.ids)))
    return out


@torch.no_grad()
def influence(target, seqs: Sequence[tuple[int, list]]) -> list[float]:
    """Block influence of each sublayer in forward order (attention 0, MLP 0, attention 1, ...): 1 - cos of the
    residual stream before and after it, averaged over every token of `seqs` (the inputs of the HF model's norms)."""
    dec = target.model.get_decoder()
    norms = [m for lay in dec.layers for m in (lay.input_layernorm, lay.post_attention_layernorm)] + [dec.norm]
    states: list[torch.Tensor] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: states.append(args[0][0].float())) for m in norms]
    total, count = torch.zeros(len(norms) - 1), 0
    try:
        for _, seq in seqs:
            states.clear()
            target.model(input_ids=torch.tensor([seq], device=target.device), use_cache=False, logits_to_keep=1)
            for u in range(len(norms) - 1):
                total[u] += (1 - torch.cosine_similarity(states[u], states[u + 1], dim=-1)).sum().cpu()
            count += len(seq)
    finally:
        for h in hooks:
            h.remove()
    return (total / max(count, 1)).tolist()


@torch.no_grad()
def walk(owned, skip: SkipSet, snaps: Sequence[tuple[int, Any]], seqs: Sequence[tuple[int, list]],
         depth: int = WALK_DEPTH) -> tuple[list[int], list[int]]:
    """(hits, seen) per draft depth 1..depth of the serving walk over each cached sequence (module docstring, 3)."""
    hits, seen = [0] * depth, [0] * depth
    for snap, (plen, seq) in zip(snaps, seqs):
        owned.restore(snap, room=depth + 1)
        t = plen - 1  # the first root: the prompt's last token, the cache holding [0, t)
        while t < len(seq) - 1:
            tok, a = seq[t], 0
            for j in range(min(depth, len(seq) - 1 - t)):
                guess = int(owned.draft(torch.tensor([tok]), j, skip, prefix=t).float().argmax())
                seen[j] += 1
                if guess != seq[t + 1 + j]:
                    break
                hits[j] += 1
                tok, a = guess, a + 1
            t += a + 1
    return hits, seen


def score(hits: Sequence[int], seen: Sequence[int], share: float, verify_costs: dict[int, float]
          ) -> tuple[float, int, list[float]]:
    """(value, best chain length k >= 1, alpha per depth) of module docstring 4. Plain decoding is worth 1: a value
    below it means no chain of this set pays (the sets are still ranked by it)."""
    alpha = [h / s if s else 0.0 for h, s in zip(hits, seen)]
    best, best_k, tau, surv = -math.inf, 1, 1.0, 1.0
    for k, a in enumerate(alpha, start=1):
        surv *= a
        tau += surv
        value = tau / (interp_cost(verify_costs, k + 1) + k * share)
        if value > best + 1e-12:
            best, best_k = value, k
    return best, best_k, alpha


# --------------------------------------------------------------------------------------------------- search
class Evaluator:
    """Measures and scores skip sets on the cached calibration sequences, each set once, at most `budget` sets."""

    def __init__(self, owned, seqs, verify_costs: dict[int, float], budget: int):
        self.owned, self.seqs, self.costs, self.budget = owned, seqs, verify_costs, budget
        self.snaps = []
        for _, seq in seqs:  # the full passes' cache of each prompt + continuation, kept for every walk
            owned.reset(len(seq) + WALK_DEPTH + 1)
            owned.forward(torch.tensor(seq), torch.arange(len(seq), device=owned.device), None, logit_rows="none")
            owned.keep(len(seq), list(range(len(seq))))
            self.snaps.append(owned.snapshot())
        self.done: dict[SkipSet, dict[str, Any]] = {}

    @property
    def left(self) -> int:
        return self.budget - len(self.done)

    def __call__(self, skip: SkipSet) -> float:
        if skip not in self.done:
            if self.left <= 0:
                return -math.inf
            hits, seen = walk(self.owned, skip, self.snaps, self.seqs)
            share = self.owned.draft_share(skip)
            value, k, alpha = score(hits, seen, share, self.costs)
            self.done[skip] = {"skip": skip.text(), "skipped": len(skip), "share": round(share, 4),
                               "value": round(value, 4), "chain": k, "acceptance": [round(a, 4) for a in alpha],
                               "seen": seen}
            log.info("layer-skip search: %s -> value %.3f (chain %d, share %.2f, acceptance %s)", skip.text(), value,
                     k, share, " ".join(f"{a:.2f}" for a in alpha[:4]))
        return self.done[skip]["value"]


def _prefix(order: list[tuple[int, bool]], n: int) -> SkipSet:
    units = order[:n]
    return SkipSet(frozenset(i for i, a in units if a), frozenset(i for i, a in units if not a))


def search(target, calib_ids: Sequence[Sequence[int]], *, tokens: int = SEARCH_TOKENS, budget: int = MAX_EVALS,
           verify_costs: dict[int, float] | None = None) -> dict[str, Any]:
    """The skip set of module docstring 1-5 for `target` on `calib_ids`, with its record."""
    t0 = time.perf_counter()
    owned = owned_model(target)
    if not calib_ids:
        raise SpecheadsError("--skip-layers auto: the search needs calibration prompts (give --skip-layers SPEC)")
    costs, costs_from = _verify_costs(target, verify_costs)
    seqs = continuations(target, calib_ids, tokens)
    bi = influence(target, seqs)
    L = len(owned.layers)
    units = [(i, a) for i in range(L) for a in (True, False)]
    weight = {u: owned.unit_weights(*u) for u in units}
    order = sorted(units, key=lambda u: bi[2 * u[0] + (0 if u[1] else 1)] / weight[u])
    ev = Evaluator(owned, seqs, costs, budget)
    total = sum(weight.values())
    cum = [sum(weight[u] for u in order[:n]) / total for n in range(len(order) + 1)]
    coarse = sorted({min(range(1, len(order)), key=lambda n: abs(cum[n] - s)) for s in COARSE_SHARES})
    best_n = max(coarse, key=lambda n: ev(_prefix(order, n)))
    best = _prefix(order, best_n)
    while ev.left > 0:  # best-improvement local moves around the current set
        skipped = [u for u in order if u in _units(best)]
        kept = [u for u in order if u not in _units(best)]
        moves = [_with(best, u, True) for u in kept[:LOCAL_MOVES]] + \
                [_with(best, u, False) for u in skipped[::-1][:LOCAL_MOVES] if len(best) > 1]
        if not moves:
            break
        cand = max(moves, key=ev)  # each set measured once; beyond the budget a new one is worth nothing
        if ev(cand) < ev(best) * (1 + MIN_GAIN):
            break
        best = cand
    record = dict(ev.done[best])
    record.update({"pays": record["value"] > 1.0 / interp_cost(costs, 1), "version": SEARCH_VERSION, "target": target.name, "dtype": str(target.dtype).replace("torch.", ""),
                   "prompts": len(calib_ids), "tokens_per_prompt": tokens, "walk_depth": WALK_DEPTH,
                   "evaluations": list(ev.done.values()), "budget": budget, "verify_costs": costs,
                   "verify_costs_from": costs_from, "influence": [round(b, 5) for b in bi],
                   "order": [f"{'a' if a else 'm'}{i}" for i, a in order],
                   "search_s": round(time.perf_counter() - t0, 1), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    return record


def _units(skip: SkipSet) -> set[tuple[int, bool]]:
    return {(i, True) for i in skip.attn} | {(i, False) for i in skip.mlp}


def _with(skip: SkipSet, unit: tuple[int, bool], skipped: bool) -> SkipSet:
    units = _units(skip) | {unit} if skipped else _units(skip) - {unit}
    return SkipSet(frozenset(i for i, a in units if a), frozenset(i for i, a in units if not a))


def _verify_costs(target, given: dict[int, float] | None) -> tuple[dict[int, float], str]:
    """t(n)/t(1): given (a scheduler's), else the cached cost profile's, else FLAT_VERIFY (nothing is timed)."""
    if given:
        return {int(k): float(v) for k, v in given.items()}, "the scheduler's cost profile"
    prof = cached_verify(target, then="using a flat CPU stand-in")  # a damaged one: one warning, never read
    if prof is not None:
        path = profile_path(target, target.dtype)
        return relative_costs(prof), f"the cached cost profile {os.path.basename(path)}"
    return dict(FLAT_VERIFY), "a flat CPU stand-in (no usable cost profile cached)"


# --------------------------------------------------------------------------------------------------- cache
def search_key(target) -> str:
    """The cost profile's machine key (profile.machine_key) without the thread count: threads change a forward's
    speed, not what a draft accepts, and the run's scheduler prices the chain again with its own profile."""
    env = environment()
    raw = "|".join([env["cpu"] or platform.machine(), str(env["gpu"]), str(target.device), str(target.dtype),
                    torch.__version__, str(target.fingerprint()), str(target.num_layers), str(target.hidden_size),
                    runner_for(target).name])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def search_path(target) -> "os.PathLike":
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in str(target.name))[-60:]
    dtype = str(target.dtype).replace("torch.", "")
    return cache_root() / "profiles" / f"{safe}-{dtype}-layerskip-{search_key(target)}.json"


def _check_search(rec: Any) -> tuple[str, str]:
    """(verdict, why) of a cached search record (profile_check's verdicts): an object of this version, a skip set."""
    if not isinstance(rec, dict):
        return DAMAGED, f"is a JSON {type(rec).__name__ if rec is not None else 'null'}, not an object"
    if rec.get("version") != SEARCH_VERSION:
        return STALE, f"version {rec.get('version')!r} (this specheads searches version {SEARCH_VERSION})"
    if not isinstance(rec.get("skip"), str):
        return DAMAGED, f"skip is {rec.get('skip')!r} (expected a skip set such as 'm4-12,a9')"
    return "", ""


def load_or_search(target, calib_ids=None, refresh: bool = False, **kw) -> dict[str, Any]:
    """The cached search result of this target + machine + dtype, else a search on `calib_ids` (a callable is
    called only when a search runs), written atomically. The record's `skip` is the set; `cached` says which."""
    path = search_path(target)
    rec = None if refresh else cached_profile(path, _check_search, "searching again", what="layer-skip search")
    if rec is not None:
        return {**rec, "cached": True, "path": str(path)}
    ids = calib_ids() if callable(calib_ids) else calib_ids
    log.info("layer-skip: searching the skip set of %s on %d calibration prompts (at most %d sets, cached after)",
             target.name, len(ids or []), kw.get("budget", MAX_EVALS))
    rec = search(target, ids or [], **kw)
    atomic_write_json(path, rec)
    log.info("layer-skip: skipping %s (%d sublayers, draft pass %.2f of a target forward), acceptance %s, value "
             "%.2f of plain decoding%s; searched in %.0f s", rec["skip"], rec["skipped"], rec["share"],
             " ".join(f"{a:.2f}" for a in rec["acceptance"][:4]), rec["value"],
             "" if rec["pays"] else " (no set measured pays on this target)", rec["search_s"])
    return {**rec, "cached": False, "path": str(path)}

"""The cost profiles of a target on this machine, measured once and cached per machine + target + dtype under
cache_root()/profiles/*.json; a profile whose repeats disagree (another process shared the cores) is measured again
(`profile_noise`) and never trusted later; a cached one damaged or edited by hand is named in one warning and
measured again (`cached_profile`, checked field by field by profile_check.py).
- The verify-cost curve t(n)/t(1): one verification forward of n tree nodes over a cache of `context` tokens against
  one token, n in PROFILE_SIZES (`measure_verify_cost`, `load_or_profile`). The per-step scheduler (step.py) and
  `--tree auto` (infer/autotree.py) read it through costs.relative_costs, costs.interp_cost and costs.t1_seconds.
- The batch cost surface t(B, n)/t(1, 1) of B rows x n tokens per row, B in BATCH_ROWS, n in BATCH_TOKENS, with the
  same guards and its own file beside the curve's (`measure_batch_cost`, `load_or_profile_batch`); the batch budget
  (batch_budget.py) reads it through costs.batch_cost_fn.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import time
from typing import Any, Callable, Sequence

import torch

from specheads.kvcache import drop_tail, new_batch_cache
from specheads.infer.engine import kernels
from specheads.infer.engine.runner import runner_for
from specheads.infer.tree import chain_tree
from specheads.infer.scheduling.costs import (cost_drop, isotonic, median, monotone_surface, noise_drop, slot_spread,
                                              surface_drop, surface_noise_drop)
from specheads.infer.scheduling.profile_check import (DAMAGED, check_batch_profile, check_verify_profile,
                                                      read_profile)
from specheads.runinfo import environment
from specheads.utils import atomic_write_json, cache_root

log = logging.getLogger(__name__)

PROFILE_SIZES = (1, 2, 4, 8, 16, 32)  # tree nodes (root included) timed per verification forward; CPU trees are small
PROFILE_CONTEXT = 384  # cached tokens during profiling: mid-range of a chat turn (~256-512 tokens)
PROFILE_REPEATS = 5  # timed forwards per size (the fastest kept: noise from other processes only adds time)
PROFILE_VERSION = 5  # bump when the measurement changes: cached profiles of older versions are re-measured
PROFILE_ATTEMPTS = 3  # measurements tried until one is clean (see profile_noise); a busy machine gets a warning
MAX_T1_SPREAD = 1.5  # one-token forwards of one slot varying more than this between repeats (median / fastest,
# costs.slot_spread) = another process shared the cores (the pooled median / fastest was 4.5 with two busy loops
# beside the profile; an idle 2-core machine 1.04-1.18)
MAX_COST_DROP = 0.15  # a raw t(n)/t(1) this far below a smaller tree's AND inside the spread of the repeats'
# ratios (costs.noise_drop) = noise (busy: 2.06 -> 0.93); a fall that every repeat agrees on is the curve's


# --------------------------------------------------------------------------------------------------- profiling
def machine_key(target, dtype: torch.dtype | str) -> str:
    env = environment()
    dev = str(target.device)
    fp = target.fingerprint()
    raw = "|".join([env["cpu"] or platform.machine(), str(env["gpu"]), str(torch.get_num_threads()), dev,
                    str(dtype), torch.__version__, str(fp), str(target.num_layers), str(target.hidden_size),
                    runner_for(target).name,  # the owned and the HF forward have curves of their own
                    f"kernels-{kernels.build_key()}"])  # and so does each build of the compiled kernels
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def profile_path(target, dtype) -> "os.PathLike":
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in str(target.name))[-60:]
    return cache_root() / "profiles" / f"{safe}-{str(dtype).replace('torch.', '')}-{machine_key(target, dtype)}.json"


def _time_tree(runner, tree) -> float:
    """Seconds of one tree forward through the decoding loop's runner; the cache is left as it was."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t = time.perf_counter()
    runner.forward(tree.tokens, runner.tree_inputs(tree))
    sync()
    dt = time.perf_counter() - t
    runner.keep(len(tree), [])  # nothing kept: back to the profiled context
    return dt


def _time_forward(model, ids, mask, pos, cache) -> float:
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    sync()
    t = time.perf_counter()
    model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
    sync()
    dt = time.perf_counter() - t
    drop_tail(cache, ids.shape[1])  # back to the profiled context
    return dt


def _clip_context(target, context: int, sizes: Sequence[int]) -> int:
    return min(context, (target.max_positions or 1 << 30) - max(sizes) - 1)


MIN_SECONDS = 1e-9  # a timed forward below 1 ns is a clock's 0 (a coarse timer): divided by this, never by 0


def paired_timings(cells: Sequence, unit, repeats: int, time_cell: Callable[[Any], float]
                   ) -> tuple[dict[Any, list[float]], dict[Any, list[float]]]:
    """Side by side: each cell's forward timed right after one of `unit` (the one-token forward), every cell once
    per repeat, so that a slow spell of the machine (other jobs) hits both members of a pair alike.
    -> ({cell: t(unit) timed just before it, per repeat}, {cell: t(cell) per repeat}); `unit`'s own pair is one
    forward. time_cell(cell) -> seconds of one forward (measure_*_cost's; scripted in tests)."""
    before: dict[Any, list[float]] = {c: [] for c in cells}
    own: dict[Any, list[float]] = {c: [] for c in cells}
    for _ in range(repeats):
        for c in cells:
            t_unit = time_cell(unit)
            before[c].append(t_unit)
            own[c].append(time_cell(c) if c != unit else t_unit)
    return before, own


def pair_ratios(before: dict, own: dict) -> dict[Any, list[float]]:
    return {c: [t / max(t1, MIN_SECONDS) for t1, t in zip(before[c], own[c])] for c in own}


def verify_from_timings(sizes: Sequence[int], repeats: int, context: int, time_n: Callable[[int], float]
                        ) -> dict[str, Any]:
    """measure_verify_cost's record from the timer time_n(n) -> seconds of one forward of n tree nodes."""
    one, order = min(sizes), sorted(sizes)
    before, own = paired_timings(list(sizes), one, repeats, time_n)
    ratios = pair_ratios(before, own)
    raw = {n: median(r) for n, r in ratios.items()}
    seconds = {n: min(own[n]) for n in sizes}
    seconds[one] = min(t for ts in before.values() for t in ts)  # fastest seen (contention only adds time)
    # a forward of more nodes never costs less: a repeatable dip (and noise) is smoothed by an isotonic
    # (non-decreasing) fit, then normalised so that relative[1] == 1
    fit = isotonic([raw[n] for n in order])
    mono = {n: f / fit[0] for n, f in zip(order, fit)}
    return {"seconds": {str(n): seconds[n] for n in sizes}, "relative": {str(n): mono[n] for n in sizes},
            "relative_raw": {str(n): raw[n] for n in sizes}, "context": context, "repeats": repeats,
            "t1_spread": slot_spread(list(before.values())), "cost_drop": cost_drop([raw[n] for n in order]),
            "noise_drop": noise_drop([ratios[n] for n in order]), "note": VERIFY_NOTE}


VERIFY_NOTE = ("relative_raw = median over repeats of t(n)/t(1) timed back to back; relative = its isotonic "
               "(non-decreasing) fit normalised to relative[1] = 1; seconds = fastest forward seen; t1_spread = median"
               " over the one-token forwards' slots (each timed before one size, once per repeat) of median / "
               "fastest (near 1 on an idle machine); cost_drop = largest fall of relative_raw below a smaller "
               "tree's (a repeatable dip of the curve is one); noise_drop = the largest such fall that the repeats' "
               "ratios do not agree on (their inner bands overlap: 0 on an idle machine)")


@torch.no_grad()
def measure_verify_cost(target, sizes: Sequence[int] = PROFILE_SIZES, context: int = PROFILE_CONTEXT,
                        repeats: int = PROFILE_REPEATS, seed: int = 0) -> dict[str, Any]:
    """Cost of one target forward of n tree nodes (a chain mask) over `context` cached tokens, relative to one
    token: {"relative": {n: t(n)/t(1)}, "relative_raw", "seconds": {n: fastest s}, ...}. Each t(n) is paired with
    a t(1) timed just before it (ratios of side-by-side figures survive a busy machine: paired_timings)."""
    g = torch.Generator().manual_seed(seed)
    vocab = target.vocab_size
    context = _clip_context(target, context, sizes)
    runner = runner_for(target)  # the forward the decoding loop runs (owned or HF)
    runner.reset(context + max(sizes))
    prefix = torch.randint(0, vocab, (context,), generator=g)
    runner.forward(prefix, None, logit_rows="none")
    runner.keep(context, range(context))
    inputs = {}
    for n in sizes:
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        inputs[n] = chain_tree(ids[0], ids[1:])
        _time_tree(runner, inputs[n])  # warm-up per shape
    return verify_from_timings(sizes, repeats, context, lambda n: _time_tree(runner, inputs[n]))


def profile_noise(measured: dict[str, Any]) -> str:
    """Why a measured profile (verify or batch) cannot be trusted ("" = clean): its repeats disagree, as when
    another process shares the cores. A repeatable feature of the cost curve (a larger tree measured cheaper in
    every repeat) is no noise."""
    why = []
    if measured.get("t1_spread", 1.0) > MAX_T1_SPREAD:
        why.append(f"one-token forwards varied {measured['t1_spread']:.2f}x between repeats (median / fastest; "
                   "near 1 on an idle machine)")
    if measured.get("noise_drop", 0.0) > MAX_COST_DROP:
        why.append(f"a larger forward measured {measured['noise_drop']:.0%} cheaper than a smaller one, the repeats "
                   "disagreeing")
    return "; ".join(why)


def cached_profile(path, check: Callable[[Any], tuple[str, str]], then: str = "measuring it again",
                   what: str = "cost profile") -> dict[str, Any] | None:
    """The profile at `path` when `check` (profile_check) finds it usable, else None (the caller measures it again,
    or, `then`, does without): a file edited by hand or damaged gets one warning naming it and what is wrong (once
    per process and fault); one measured for other settings is replaced quietly."""
    if not os.path.exists(path):
        return None
    prof, why = read_profile(path)
    verdict, why = (DAMAGED, why) if why else check(prof)
    if verdict == DAMAGED and (str(path), why) not in _WARNED:
        _WARNED.add((str(path), why))
        log.warning("%s %s: %s; %s", what, path, why, then)
    elif verdict:
        log.info("%s %s: %s; %s", what, path, why, then)
    return None if verdict else prof


def _implausible(verdict: tuple[str, str]) -> str:
    """A fresh measurement that a later read would refuse (profile_check) is noise: measured again, never cached as
    trusted (it could only come from forwards that other work slowed)."""
    return f"a measured cost is implausible: {verdict[1]}" if verdict[0] else ""


_WARNED: set[tuple[str, str]] = set()  # (file, fault) already named this process (one line, however many readers)


def cached_verify(target, sizes: Sequence[int] | None = None, context: int | None = None,
                  then: str = "measuring it again") -> dict[str, Any] | None:
    """The cached verification profile of this machine + target + dtype if usable (cached_profile), else None."""
    sizes = tuple(sizes or PROFILE_SIZES)
    clipped = _clip_context(target, context or PROFILE_CONTEXT, sizes)
    return cached_profile(profile_path(target, target.dtype),
                          lambda p: check_verify_profile(p, sizes, clipped, PROFILE_VERSION), then)


def _retry_line(what: str, attempt: int, noise: str) -> None:
    """One disturbed attempt that is measured again: info only. A single timing outlier on an idle machine is
    common (a page fault, a frequency step); only a profile that stays disturbed after PROFILE_ATTEMPTS earns a
    warning (_warn_if_kept_noisy), so a warning always means the kept numbers are unreliable."""
    if attempt < PROFILE_ATTEMPTS:
        log.info("%s attempt %d/%d looks disturbed (%s); measuring again", what, attempt, PROFILE_ATTEMPTS, noise)


def _warn_if_kept_noisy(what: str, noise: str) -> None:
    if noise:
        log.warning("the machine stayed busy: keeping a noisy %s for this run only (not trusted next time; %s); "
                    "tree choices and speed figures measured now are unreliable", what, noise)


def load_or_profile(target, refresh: bool = False, sizes: Sequence[int] | None = None,
                    context: int | None = None, repeats: int | None = None) -> dict[str, Any]:
    """The cached verification-cost profile for this machine + target + dtype, measured once if missing
    (None = the module defaults PROFILE_SIZES / PROFILE_CONTEXT / PROFILE_REPEATS)."""
    sizes = tuple(sizes or PROFILE_SIZES)
    context = context or PROFILE_CONTEXT
    repeats = repeats or PROFILE_REPEATS
    path = profile_path(target, target.dtype)
    prof = None if refresh else cached_verify(target, sizes, context)
    if prof is not None:
        return {**prof, "cached": True, "path": str(path)}
    log.info("profiling the target's verification cost on this machine (sizes %s, %d cached tokens)", list(sizes), context)
    t = time.perf_counter()
    noise = ""
    clipped = _clip_context(target, context, sizes)
    for attempt in range(1, PROFILE_ATTEMPTS + 1):
        verify = measure_verify_cost(target, sizes, context, repeats, seed=attempt - 1)
        noise = profile_noise(verify) or _implausible(
            check_verify_profile({"version": PROFILE_VERSION, "verify": verify}, sizes, clipped, PROFILE_VERSION))
        if not noise:
            break
        _retry_line("cost profile", attempt, noise)
    _warn_if_kept_noisy("cost profile", noise)
    env = environment()
    prof = {"version": PROFILE_VERSION, "target": target.name, "dtype": str(target.dtype).replace("torch.", ""),
            "device": str(target.device), "cpu": env["cpu"], "gpu": env["gpu"], "torch_threads": env["torch_threads"],
            "torch": env["torch"], "verify": verify, "attempts": attempt, "noisy": bool(noise), "noise": noise,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "profiling_s": round(time.perf_counter() - t, 2)}
    atomic_write_json(path, prof)
    prof["cached"] = False
    prof["path"] = str(path)
    log.info("verification cost t(n)/t(1): %s", ", ".join(f"{k}: {v:.2f}" for k, v in verify["relative"].items()))
    return prof


# --------------------------------------------------------------------------------------- rows x tokens per row
BATCH_ROWS = (1, 2, 4, 8, 16)  # rows decoding together (B)
BATCH_TOKENS = (1, 2, 4, 8, 16)  # tokens per row in one forward (n: tree nodes, root included)
BATCH_PROFILE_VERSION = 1  # bump when the batch measurement changes


def _chain_inputs(B: int, n: int, context: int, vocab: int, dtype, dev, g: torch.Generator):
    """[B, n] random tokens as a chain over `context` cached tokens per row: ids, 4D mask, positions."""
    allowed = torch.ones(n, context + n, dtype=torch.bool)
    allowed[:, context:] = torch.ones(n, n, dtype=torch.bool).tril()
    mask = torch.zeros(B, 1, n, context + n, dtype=dtype).masked_fill_(~allowed[None, None], float("-inf"))
    ids = torch.randint(0, vocab, (B, n), generator=g)
    pos = torch.arange(context, context + n).repeat(B, 1)
    return ids.to(dev), mask.to(dev), pos.to(dev)


def _row_caches(target, rows: Sequence[int], context: int, g: torch.Generator) -> dict[int, Any]:
    """One cache of `context` random tokens per batch size (rows x context), written in place as the batched loop's
    (kvcache.new_batch_cache)."""
    model, dev = target.model, target.device
    caches = {}
    for B in sorted(set(rows) | {1}):
        cache = new_batch_cache(model)
        prefix = torch.randint(0, target.vocab_size, (B, context), generator=g).to(dev)
        model(input_ids=prefix, position_ids=torch.arange(context, device=dev).repeat(B, 1), cache=cache,
              use_cache=True)
        caches[B] = cache
    return caches


@torch.no_grad()
def measure_batch_cost(target, rows: Sequence[int] = BATCH_ROWS, tokens: Sequence[int] = BATCH_TOKENS,
                       context: int = PROFILE_CONTEXT, repeats: int = PROFILE_REPEATS, seed: int = 0
                       ) -> dict[str, Any]:
    """Cost of one forward of B rows x n tokens (each row a chain over `context` cached tokens) relative to one row
    of one token: {"relative": {B: {n: t(B,n)/t(1,1)}}, "relative_raw", "seconds", ...}. Each t(B, n) is paired
    with a t(1, 1) timed just before it, as measure_verify_cost pairs t(n) with t(1)."""
    g = torch.Generator().manual_seed(seed)
    context = _clip_context(target, context, tokens)
    caches = _row_caches(target, rows, context, g)
    inputs = {(B, n): _chain_inputs(B, n, context, target.vocab_size, target.dtype, target.device, g)
              for B in sorted(set(rows) | {1}) for n in sorted(set(tokens) | {1})}
    for (B, n), inp in inputs.items():
        _time_forward(target.model, *inp, caches[B])  # warm-up per shape
    return batch_from_timings(rows, tokens, repeats, context,
                              lambda c: _time_forward(target.model, *inputs[c], caches[c[0]]))


def batch_from_timings(rows: Sequence[int], tokens: Sequence[int], repeats: int, context: int,
                       time_cell: Callable[[tuple[int, int]], float]) -> dict[str, Any]:
    """measure_batch_cost's record from the timer time_cell((B, n)) -> seconds of one forward of B rows x n tokens."""
    grid = [(B, n) for B in rows for n in tokens]
    before, own = paired_timings(grid, (1, 1), repeats, time_cell)
    ratios = pair_ratios(before, own)
    raw = {c: median(r) for c, r in ratios.items()}
    fit = monotone_surface(raw, rows, tokens)
    return {"rows": list(rows), "tokens": list(tokens), "context": context, "repeats": repeats,
            "relative": _nested(fit, rows, tokens), "relative_raw": _nested(raw, rows, tokens),
            "seconds": _nested({c: min(v) for c, v in own.items()}, rows, tokens),
            "t1_spread": slot_spread(list(before.values())), "cost_drop": surface_drop(raw, rows, tokens),
            "noise_drop": surface_noise_drop(ratios, rows, tokens),
            "note": "relative[B][n] = t(B rows x n tokens per row) / t(1, 1): median over repeats of ratios timed "
                    "back to back, fitted non-decreasing in n (isotonic per B) and in B (running max per n), "
                    "normalised to relative[1][1] = 1 when B = 1 and n = 1 are on the grid; seconds = fastest seen; "
                    "t1_spread, cost_drop, noise_drop: as the verify profile's, along n and along B"}


def _nested(values: dict[tuple, float], rows, tokens) -> dict[str, dict[str, float]]:
    return {str(B): {str(n): float(values[(B, n)]) for n in tokens} for B in rows}


def batch_profile_path(target, dtype) -> "os.PathLike":
    p = profile_path(target, dtype)
    return p.with_name(p.stem + "-batch.json")


def load_or_profile_batch(target, refresh: bool = False, rows: Sequence[int] | None = None,
                          tokens: Sequence[int] | None = None, context: int | None = None,
                          repeats: int | None = None) -> dict[str, Any]:
    """The cached rows x tokens cost surface for this machine + target + dtype, measured once if missing (beside
    the batch-1 profile, same key, same noise guards: 3 attempts, a noisy one serves this run only)."""
    rows, tokens = tuple(rows or BATCH_ROWS), tuple(tokens or BATCH_TOKENS)
    context, repeats = context or PROFILE_CONTEXT, repeats or PROFILE_REPEATS
    path = batch_profile_path(target, target.dtype)
    clipped = _clip_context(target, context, tokens)
    prof = None if refresh else cached_profile(
        path, lambda p: check_batch_profile(p, rows, tokens, clipped, BATCH_PROFILE_VERSION))
    if prof is not None:
        return {**prof, "cached": True, "path": str(path)}
    log.info("profiling the target's batched forward cost (rows %s x tokens %s, %d cached tokens a row)",
             list(rows), list(tokens), context)
    t = time.perf_counter()
    for attempt in range(1, PROFILE_ATTEMPTS + 1):
        batch = measure_batch_cost(target, rows, tokens, context, repeats, seed=attempt - 1)
        noise = profile_noise(batch) or _implausible(
            check_batch_profile({"version": BATCH_PROFILE_VERSION, "batch": batch}, rows, tokens, clipped,
                                BATCH_PROFILE_VERSION))
        if not noise:
            break
        _retry_line("batch cost profile", attempt, noise)
    _warn_if_kept_noisy("batch cost profile", noise)
    env = environment()
    prof = {"version": BATCH_PROFILE_VERSION, "kind": "batch", "target": target.name,
            "dtype": str(target.dtype).replace("torch.", ""), "device": str(target.device), "cpu": env["cpu"],
            "gpu": env["gpu"], "torch_threads": env["torch_threads"], "torch": env["torch"], "batch": batch,
            "attempts": attempt, "noisy": bool(noise), "noise": noise,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "profiling_s": round(time.perf_counter() - t, 2)}
    atomic_write_json(path, prof)
    return {**prof, "cached": False, "path": str(path)}

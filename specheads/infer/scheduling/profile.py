"""The cost profiles of a target on this machine, measured once and cached per machine + target + dtype under
cache_root()/profiles/*.json; a profile measured while another process shared the cores is measured again
(`profile_noise`) and never trusted later.
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
from typing import Any, Sequence

import torch

from specheads.kvcache import drop_tail, new_batch_cache
from specheads.infer.engine import kernels
from specheads.infer.engine.runner import runner_for
from specheads.infer.tree import chain_tree
from specheads.infer.scheduling.costs import cost_drop, isotonic, monotone_surface, surface_drop
from specheads.runinfo import environment
from specheads.utils import atomic_write_json, cache_root, read_json

log = logging.getLogger(__name__)

PROFILE_SIZES = (1, 2, 4, 8, 16, 32)  # tree nodes (root included) timed per verification forward; CPU trees are small
PROFILE_CONTEXT = 384  # cached tokens during profiling: mid-range of a chat turn (~256-512 tokens)
PROFILE_REPEATS = 5  # timed forwards per size (the fastest kept: noise from other processes only adds time)
PROFILE_VERSION = 5  # bump when the measurement changes: cached profiles of older versions are re-measured
PROFILE_ATTEMPTS = 3  # measurements tried until one is clean (see profile_noise); a busy machine gets a warning
MAX_T1_SPREAD = 1.5  # median / fastest one-token forward above this = another process shared the cores (an idle
# 2-core machine gives 1.04-1.18, two busy loops beside the profile 4.5)
MAX_COST_DROP = 0.15  # a raw t(n)/t(1) this far below a smaller tree's = noise (idle: none; busy: 2.06 -> 0.93)


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


@torch.no_grad()
def measure_verify_cost(target, sizes: Sequence[int] = PROFILE_SIZES, context: int = PROFILE_CONTEXT,
                        repeats: int = PROFILE_REPEATS, seed: int = 0) -> dict[str, Any]:
    """Cost of one target forward of n tree nodes (a chain mask) over `context` cached tokens, relative to one
    token: {"relative": {n: t(n)/t(1)}, "relative_raw", "seconds": {n: fastest s}, ...}. Each t(n) is paired with
    a t(1) timed just before it (ratios of side-by-side figures survive a busy machine)."""
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
    # side by side: each t(n) is timed right after a t(1), and the ratio of the pair is kept, so that a slow spell
    # of the machine (other jobs) hits both members of a pair alike; relative = median of the paired ratios
    one = min(sizes)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    ratios: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            t_one = _time_tree(runner, inputs[one])
            t_n = _time_tree(runner, inputs[n]) if n != one else t_one
            times[one].append(t_one)
            if n != one:
                times[n].append(t_n)
            ratios[n].append(t_n / t_one)
    med = {n: min(v) for n, v in times.items()}  # fastest seen, for the record (contention only adds time)
    raw = {n: sorted(r)[len(r) // 2] for n, r in ratios.items()}
    t1s = sorted(times[one])
    spread = t1s[len(t1s) // 2] / t1s[0]  # median / fastest: ~1.1 on an idle machine
    # a forward of more nodes never costs less: noise is smoothed by an isotonic (non-decreasing) fit, then
    # normalised so that relative[1] == 1
    order = sorted(sizes)
    fit = isotonic([raw[n] for n in order])
    mono = {n: f / fit[0] for n, f in zip(order, fit)}
    return {"seconds": {str(n): med[n] for n in sizes}, "relative": {str(n): mono[n] for n in sizes},
            "relative_raw": {str(n): raw[n] for n in sizes}, "context": context, "repeats": repeats,
            "t1_spread": spread, "cost_drop": cost_drop([raw[n] for n in order]),
            "note": "relative_raw = median over repeats of t(n)/t(1) timed back to back; relative = its isotonic "
                    "(non-decreasing) fit normalised to relative[1] = 1; seconds = fastest forward seen; t1_spread ="
                    " median / fastest one-token forward; cost_drop = largest fall of relative_raw below a smaller "
                    "tree's (both near 1 and 0 on an idle machine)"}


def profile_noise(verify: dict[str, Any]) -> str:
    """Why a measured verification profile cannot be trusted ("" = clean): another process shared the cores."""
    why = []
    if verify.get("t1_spread", 1.0) > MAX_T1_SPREAD:
        why.append(f"one-token forwards varied {verify['t1_spread']:.2f}x (median / fastest; idle ~1.1)")
    if verify.get("cost_drop", 0.0) > MAX_COST_DROP:
        why.append(f"a larger tree measured {verify['cost_drop']:.0%} cheaper than a smaller one")
    return "; ".join(why)


def load_or_profile(target, refresh: bool = False, sizes: Sequence[int] | None = None,
                    context: int | None = None, repeats: int | None = None) -> dict[str, Any]:
    """The cached verification-cost profile for this machine + target + dtype, measured once if missing
    (None = the module defaults PROFILE_SIZES / PROFILE_CONTEXT / PROFILE_REPEATS)."""
    sizes = tuple(sizes or PROFILE_SIZES)
    context = context or PROFILE_CONTEXT
    repeats = repeats or PROFILE_REPEATS
    path = profile_path(target, target.dtype)
    if not refresh and os.path.exists(path):
        prof = read_json(path)
        if prof.get("version") == PROFILE_VERSION and [int(k) for k in prof["verify"]["relative"]] == list(sizes) \
                and prof["verify"]["context"] == _clip_context(target, context, sizes) and not prof.get("noisy"):
            prof["cached"] = True
            prof["path"] = str(path)
            return prof
    log.info("profiling the target's verification cost on this machine (sizes %s, %d cached tokens)", list(sizes), context)
    t = time.perf_counter()
    noise = ""
    for attempt in range(1, PROFILE_ATTEMPTS + 1):
        verify = measure_verify_cost(target, sizes, context, repeats, seed=attempt - 1)
        noise = profile_noise(verify)
        if not noise:
            break
        log.warning("cost profile attempt %d/%d looks disturbed by other work on this machine (%s)%s", attempt,
                    PROFILE_ATTEMPTS, noise, "; measuring again" if attempt < PROFILE_ATTEMPTS else "")
    if noise:
        log.warning("the machine stayed busy: keeping a noisy cost profile for this run only (not trusted next "
                    "time); tree choices and speed figures measured now are unreliable")
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
    grid = [(B, n) for B in rows for n in tokens]
    times: dict[tuple, list[float]] = {c: [] for c in grid}
    ratios: dict[tuple, list[float]] = {c: [] for c in grid}
    ones: list[float] = []
    for _ in range(repeats):
        for B, n in grid:
            t_one = _time_forward(target.model, *inputs[(1, 1)], caches[1])
            t_bn = _time_forward(target.model, *inputs[(B, n)], caches[B]) if (B, n) != (1, 1) else t_one
            ones.append(t_one)
            times[(B, n)].append(t_bn)
            ratios[(B, n)].append(t_bn / t_one)
    raw = {c: sorted(r)[len(r) // 2] for c, r in ratios.items()}
    fit = monotone_surface(raw, rows, tokens)
    ones.sort()
    return {"rows": list(rows), "tokens": list(tokens), "context": context, "repeats": repeats,
            "relative": _nested(fit, rows, tokens), "relative_raw": _nested(raw, rows, tokens),
            "seconds": _nested({c: min(v) for c, v in times.items()}, rows, tokens),
            "t1_spread": ones[len(ones) // 2] / ones[0], "cost_drop": surface_drop(raw, rows, tokens),
            "note": "relative[B][n] = t(B rows x n tokens per row) / t(1, 1): median over repeats of ratios timed "
                    "back to back, fitted non-decreasing in n (isotonic per B) and in B (running max per n), "
                    "normalised to relative[1][1] = 1 when B = 1 and n = 1 are on the grid; seconds = fastest seen"}


def _nested(values: dict[tuple, float], rows, tokens) -> dict[str, dict[str, float]]:
    return {str(B): {str(n): float(values[(B, n)]) for n in tokens} for B in rows}


def batch_profile_path(target, dtype) -> "os.PathLike":
    p = profile_path(target, dtype)
    return p.with_name(p.stem + "-batch.json")


def _usable_batch(prof: dict, rows, tokens, context: int) -> bool:
    b = prof.get("batch") or {}
    return (prof.get("version") == BATCH_PROFILE_VERSION and b.get("rows") == list(rows)
            and b.get("tokens") == list(tokens) and b.get("context") == context and not prof.get("noisy"))


def load_or_profile_batch(target, refresh: bool = False, rows: Sequence[int] | None = None,
                          tokens: Sequence[int] | None = None, context: int | None = None,
                          repeats: int | None = None) -> dict[str, Any]:
    """The cached rows x tokens cost surface for this machine + target + dtype, measured once if missing (beside
    the batch-1 profile, same key, same noise guards: 3 attempts, a noisy one serves this run only)."""
    rows, tokens = tuple(rows or BATCH_ROWS), tuple(tokens or BATCH_TOKENS)
    context, repeats = context or PROFILE_CONTEXT, repeats or PROFILE_REPEATS
    path = batch_profile_path(target, target.dtype)
    if not refresh and os.path.exists(path):
        prof = read_json(path)
        if _usable_batch(prof, rows, tokens, _clip_context(target, context, tokens)):
            return {**prof, "cached": True, "path": str(path)}
    log.info("profiling the target's batched forward cost (rows %s x tokens %s, %d cached tokens a row)",
             list(rows), list(tokens), context)
    t = time.perf_counter()
    for attempt in range(1, PROFILE_ATTEMPTS + 1):
        batch = measure_batch_cost(target, rows, tokens, context, repeats, seed=attempt - 1)
        noise = profile_noise(batch)
        if not noise:
            break
        log.warning("batch cost profile attempt %d/%d looks disturbed by other work on this machine (%s)%s", attempt,
                    PROFILE_ATTEMPTS, noise, "; measuring again" if attempt < PROFILE_ATTEMPTS else "")
    env = environment()
    prof = {"version": BATCH_PROFILE_VERSION, "kind": "batch", "target": target.name,
            "dtype": str(target.dtype).replace("torch.", ""), "device": str(target.device), "cpu": env["cpu"],
            "gpu": env["gpu"], "torch_threads": env["torch_threads"], "torch": env["torch"], "batch": batch,
            "attempts": attempt, "noisy": bool(noise), "noise": noise,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "profiling_s": round(time.perf_counter() - t, 2)}
    atomic_write_json(path, prof)
    return {**prof, "cached": False, "path": str(path)}

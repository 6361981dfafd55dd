"""The verification-cost profile of a target on this machine: t(n)/t(1), the time of one verification forward of n
tree nodes over a cache of `context` tokens against one token, n in PROFILE_SIZES. Measured once and cached per
machine + target + dtype under cache_root()/profiles/*.json; a profile measured while another process shared the
cores is measured again (`profile_noise`) and never trusted later. Tree choice (autotree.py) reads it through
`load_or_profile`, `relative_costs`, `interp_cost` and `t1_seconds`.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import time
from typing import Any, Sequence

import torch

from specheads.runinfo import environment
from specheads.utils import atomic_write_json, cache_root, read_json

log = logging.getLogger(__name__)

PROFILE_SIZES = (1, 2, 4, 8, 16, 32)  # tree nodes (root included) timed per verification forward; CPU trees are small
PROFILE_CONTEXT = 384  # cached tokens during profiling: mid-range of a chat turn (~256-512 tokens)
PROFILE_REPEATS = 5  # timed forwards per size (the fastest kept: noise from other processes only adds time)
PROFILE_VERSION = 4  # bump when the measurement changes: cached profiles of older versions are re-measured
PROFILE_ATTEMPTS = 3  # measurements tried until one is clean (see profile_noise); a busy machine gets a warning
MAX_T1_SPREAD = 1.5  # median / fastest one-token forward above this = another process shared the cores (an idle
# 2-core machine gives 1.04-1.18, two busy loops beside the profile 4.5)
MAX_COST_DROP = 0.15  # a raw t(n)/t(1) this far below a smaller tree's = noise (idle: none; busy: 2.06 -> 0.93)


def interp_cost(costs: dict[int, float], n: float) -> float:
    """t(n)/t(1) at any n from the measured sizes: piecewise linear, extrapolated linearly past the largest size."""
    pts = sorted((int(k), float(v)) for k, v in costs.items())
    if n <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if n <= x1:
            return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    return y1 + (y1 - y0) * (n - x1) / (x1 - x0)


# --------------------------------------------------------------------------------------------------- profiling
def machine_key(target, dtype: torch.dtype | str) -> str:
    env = environment()
    dev = str(target.device)
    fp = target.fingerprint()
    raw = "|".join([env["cpu"] or platform.machine(), str(env["gpu"]), str(torch.get_num_threads()), dev,
                    str(dtype), torch.__version__, str(fp), str(target.num_layers), str(target.hidden_size)])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def profile_path(target, dtype) -> "os.PathLike":
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in str(target.name))[-60:]
    return cache_root() / "profiles" / f"{safe}-{str(dtype).replace('torch.', '')}-{machine_key(target, dtype)}.json"


def _time_forward(model, ids, mask, pos, cache) -> float:
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    sync()
    t = time.perf_counter()
    model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
    sync()
    dt = time.perf_counter() - t
    cache.crop(-ids.shape[1])  # back to the profiled context (transformers 5: negative = tokens to drop)
    return dt


def isotonic(ys: Sequence[float], weights: Sequence[float] | None = None) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators): [1, 1.5, 1.1, 2] -> [1, 1.3, 1.3, 2]. Pooled
    values share their weighted mean (a weight of 0 counts as 1e-9: it follows its neighbours)."""
    w = [1.0] * len(ys) if weights is None else [max(float(x), 1e-9) for x in weights]
    blocks: list[list[float]] = []  # [weighted sum, weight, count]
    for y, wy in zip(ys, w):
        blocks.append([float(y) * wy, wy, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s2, w2, c2 = blocks.pop()
            blocks[-1][0] += s2
            blocks[-1][1] += w2
            blocks[-1][2] += c2
    out: list[float] = []
    for s_, w_, c in blocks:
        out += [s_ / w_] * c
    return out


def _clip_context(target, context: int, sizes: Sequence[int]) -> int:
    return min(context, (target.max_positions or 1 << 30) - max(sizes) - 1)


@torch.no_grad()
def measure_verify_cost(target, sizes: Sequence[int] = PROFILE_SIZES, context: int = PROFILE_CONTEXT,
                        repeats: int = PROFILE_REPEATS, seed: int = 0) -> dict[str, Any]:
    """Cost of one target forward of n tree nodes (a chain mask) over `context` cached tokens, relative to one
    token: {"relative": {n: t(n)/t(1)}, "relative_raw", "seconds": {n: fastest s}, ...}. Each t(n) is paired with
    a t(1) timed just before it (ratios of side-by-side figures survive a busy machine)."""
    from transformers import DynamicCache

    model = target.model
    dev, dtype = target.device, target.dtype
    g = torch.Generator().manual_seed(seed)
    vocab = target.vocab_size
    context = _clip_context(target, context, sizes)
    cache = DynamicCache(config=model.config)
    prefix = torch.randint(0, vocab, (1, context), generator=g).to(dev)
    model(input_ids=prefix, position_ids=torch.arange(context, device=dev)[None], cache=cache, use_cache=True)
    inputs = {}
    for n in sizes:
        allowed = torch.ones(n, context + n, dtype=torch.bool, device=dev)
        allowed[:, context:] = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        mask = torch.zeros(1, 1, n, context + n, dtype=dtype, device=dev).masked_fill(~allowed[None, None], float("-inf"))
        ids = torch.randint(0, vocab, (1, n), generator=g).to(dev)
        pos = torch.arange(context, context + n, device=dev)[None]
        inputs[n] = (ids, mask, pos)
        _time_forward(model, ids, mask, pos, cache)  # warm-up per shape
    # side by side: each t(n) is timed right after a t(1), and the ratio of the pair is kept, so that a slow spell
    # of the machine (other jobs) hits both members of a pair alike; relative = median of the paired ratios
    one = min(sizes)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    ratios: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            t_one = _time_forward(model, *inputs[one], cache)
            t_n = _time_forward(model, *inputs[n], cache) if n != one else t_one
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


def cost_drop(raw: Sequence[float]) -> float:
    """Largest relative fall of a cost below the highest cost of a smaller size: [1, 2.06, 1.2, 0.93] -> 0.55.
    A forward of more nodes never costs less, so a large fall is noise, not the machine's cost curve."""
    top, drop = 0.0, 0.0
    for v in raw:
        if top > 0:
            drop = max(drop, 1 - v / top)
        top = max(top, v)
    return drop


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


def relative_costs(profile: dict[str, Any]) -> dict[int, float]:
    return {int(k): float(v) for k, v in profile["verify"]["relative"].items()}


def t1_seconds(profile: dict[str, Any]) -> float:
    s = profile["verify"]["seconds"]
    return float(s[str(min(int(k) for k in s))])

"""Reading a measured cost profile (profile.py): the verify-cost curve t(n)/t(1) and the batch cost surface
t(B, n)/t(1, 1) at any point, and the monotone fits that measurement smooths noise with. Pure arithmetic on numbers
and profile dicts: no model, no timing. Shapes: B rows, n tokens (tree nodes, root included) per row.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

CostFn = Callable[[int, int], float]  # cost(B rows, n tokens per row) = t(B, n) / t(1, 1)


def median(xs: Sequence[float]) -> float:
    """The upper median (0 for no values): what the running medians of measured seconds read."""
    s = sorted(xs)
    return s[len(s) // 2] if s else 0.0


def interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise linear through (xs, ys) (xs ascending), extrapolated linearly past the last point."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    for x0, y0, x1, y1 in zip(xs, ys, xs[1:], ys[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1] + (ys[-1] - ys[-2]) * (x - xs[-1]) / (xs[-1] - xs[-2])


def interp_cost(costs: dict[int, float], n: float) -> float:
    """t(n)/t(1) at any n from the measured sizes: piecewise linear, extrapolated linearly past the largest size."""
    pts = sorted((int(k), float(v)) for k, v in costs.items())
    return interp([x for x, _ in pts], [y for _, y in pts], n)


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


def cost_drop(raw: Sequence[float]) -> float:
    """Largest relative fall of a cost below the highest cost of a smaller size: [1, 2.06, 1.2, 0.93] -> 0.55
    (the record's; a fall alone is no verdict: `noise_drop` judges it by the repeats' own spread)."""
    top, drop = 0.0, 0.0
    for v in raw:
        if top > 0:
            drop = max(drop, 1 - v / top)
        top = max(top, v)
    return drop


def inner_band(xs: Sequence[float]) -> tuple[float, float]:
    """(low, high) of the values left when the len // 4 lowest and highest are set aside (5 repeats: the 2nd and
    4th smallest): what most repeats agree on, a single outlier either way left out."""
    s = sorted(xs)
    k = len(s) // 4
    return s[k], s[len(s) - 1 - k]


def noise_drop(series: Sequence[Sequence[float]]) -> float:
    """The largest fall of a size's median below a smaller size's that its repeats do not agree on. `series`: each
    size's paired ratios t(n)/t(1) over the repeats, sizes ascending. A fall whose inner bands are apart (every
    repeat but an outlier puts the larger size below the smaller) is a fact of the machine's cost curve (fp32
    matmuls and the HF forward can run 2 or 4 rows faster than 1): 0, kept, and smoothed by the isotonic fit; a
    fall inside overlapping bands comes from repeats that disagree (other work on the cores): returned."""
    meds, bands = [median(s) for s in series], [inner_band(s) for s in series]
    worst = 0.0
    for j in range(len(series)):
        for i in range(j):
            fall = 1 - meds[j] / meds[i] if meds[i] > 0 else 0.0
            if fall > worst and bands[j][1] >= bands[i][0]:
                worst = fall
    return worst


def slot_spread(slots: Sequence[Sequence[float]]) -> float:
    """How much the one-token forwards of one slot (the t(1) timed before one size, once per repeat) vary: the
    median over slots of median / fastest. Within a slot every repeat runs the same sequence of shapes, so only
    other work makes them differ much (near 1 on an idle machine); a slot that is repeatably slower than another
    (after a large forward) and a single slow forward do not count, as they did in the median / fastest of all the
    one-token forwards pooled."""
    spreads = [median(s) / min(s) for s in slots if s and min(s) > 0]
    return median(spreads) if spreads else 1.0


def monotone_surface(raw: dict[tuple, float], rows: Sequence[int], tokens: Sequence[int]) -> dict[tuple, float]:
    """More rows or more tokens never cost less: isotonic along n for each B, then a running max along B."""
    rs, ns = sorted(rows), sorted(tokens)
    fit: dict[tuple, float] = {}
    for B in rs:
        for n, v in zip(ns, isotonic([raw[(B, n)] for n in ns])):
            fit[(B, n)] = v
    for n in ns:
        top = 0.0
        for B in rs:
            top = max(top, fit[(B, n)])
            fit[(B, n)] = top
    unit = fit.get((1, 1), 1.0)
    return {c: v / unit for c, v in fit.items()}


def surface_drop(raw: dict[tuple, float], rows: Sequence[int], tokens: Sequence[int]) -> float:
    """The largest `cost_drop` along n (each B) or along B (each n) of the raw surface."""
    rs, ns = sorted(rows), sorted(tokens)
    drops = [cost_drop([raw[(B, n)] for n in ns]) for B in rs] + [cost_drop([raw[(B, n)] for B in rs]) for n in ns]
    return max(drops)


def surface_noise_drop(ratios: dict[tuple, Sequence[float]], rows: Sequence[int], tokens: Sequence[int]) -> float:
    """The largest `noise_drop` along n (each B) or along B (each n) of the surface's paired ratios per cell."""
    rs, ns = sorted(rows), sorted(tokens)
    return max([noise_drop([ratios[(B, n)] for n in ns]) for B in rs]
               + [noise_drop([ratios[(B, n)] for B in rs]) for n in ns])


# --------------------------------------------------------------------------------------------------- profile dicts
def relative_costs(profile: dict[str, Any]) -> dict[int, float]:
    """{n: t(n)/t(1)} of a verification profile (profile.load_or_profile)."""
    return {int(k): float(v) for k, v in profile["verify"]["relative"].items()}


def t1_seconds(profile: dict[str, Any]) -> float:
    """The profile's fastest one-token forward, in seconds."""
    s = profile["verify"]["seconds"]
    return float(s[str(min(int(k) for k in s))])


def batch_costs(profile: dict[str, Any]) -> dict[tuple[int, int], float]:
    """{(B, n): t(B, n) / t(1, 1)} from a batch profile (profile.load_or_profile_batch) or its "batch" part."""
    b = profile.get("batch", profile)
    return {(int(B), int(n)): float(v) for B, row in b["relative"].items() for n, v in row.items()}


def interp_batch_cost(costs: dict[tuple[int, int], float], B: float, n: float) -> float:
    """t(B, n) / t(1, 1) anywhere: linear in n along each measured B, then linear in B between them (both
    extrapolated linearly past the grid)."""
    rows = sorted({b for b, _ in costs})
    tokens = sorted({k for _, k in costs})
    at_rows = [interp(tokens, [costs[(b, k)] for k in tokens], n) for b in rows]
    return interp(rows, at_rows, B)


def batch_cost_fn(profile: dict[str, Any]) -> CostFn:
    """cost(B, n) for batch_budget.choose_batch_budget, from a batch profile."""
    costs = batch_costs(profile)
    return lambda B, n: interp_batch_cost(costs, B, n)

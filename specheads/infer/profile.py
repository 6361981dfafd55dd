"""Hardware-aware tree size (`--tree auto`): measure what a tree costs on this machine, choose the one that pays.

1. Cost profile of the target (cached per machine + target + dtype under cache_root()/profiles/*.json): the time of
   one verification forward of n tree nodes over a cache of `context` tokens, as t(n)/t(1), n in PROFILE_SIZES.
2. Acceptance of the head: acc[d, r] = how often the rank-r draft token at depth d+1 was the right one given that
   its parent was (measured on a probe run with a wide tree: `RecordingDrafter` + `acceptance_matrix`).
3. Expected τ of a tree (pure arithmetic): 1 (the bonus token) + the sum over draft nodes of the product of acc
   along the node's path (siblings are disjoint events, so each node adds the probability that it is accepted).
   For each depth limit D, the best tree of n nodes adds nodes best-first (Medusa / Sequoia construction).
4. Choice (Sequoia's hardware-aware rule): maximise  expected τ(n, D) / (t(n+1)/t(1) + draft cost(D) / t(1)),
   draft cost(D) = c1 + (D - 1) x c: EAGLE runs one head pass per depth, Medusa one head (block + V' projection)
   per depth; c1 (the first depth, with the drafter's bookkeeping of the accepted tokens) and c (each further
   depth) are timed on the probe run: a depth-1 tree and the probe's deep one.
   The value of plain decoding is 1 (τ = 1, cost 1): a tree is worth it only when its value exceeds 1.
"""
from __future__ import annotations

import hashlib
import heapq
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch

from specheads.utils import atomic_write_json, cache_root, read_json

log = logging.getLogger(__name__)

PROFILE_SIZES = (1, 2, 4, 8, 16, 32)  # tree nodes (root included) timed per verification forward; CPU trees are small
PROFILE_CONTEXT = 384  # cached tokens during profiling: mid-range of a chat turn (issue: ~256-512)
PROFILE_REPEATS = 5  # timed forwards per size (the fastest kept: noise from other processes only adds time)
PROFILE_VERSION = 4  # bump when the measurement changes: cached profiles of older versions are re-measured
PROFILE_ATTEMPTS = 3  # measurements tried until one is clean (see profile_noise); a busy machine gets a warning
MAX_T1_SPREAD = 1.5  # median / fastest one-token forward above this = another process shared the cores (measured
# here: idle 1.04-1.18, two busy loops beside it 4.5)
MAX_COST_DROP = 0.15  # a raw t(n)/t(1) this far below a smaller tree's = noise (idle: none; busy: 2.06 -> 0.93)
PROBE_T1_TOLERANCE = 1.5  # the probe run's one-token forward vs the cached profile's: beyond this factor either
# way the profile is from another state of the machine (stop 12: a profile taken under contention, t1 107.6 ms
# vs 36.5 ms idle, priced every draft 3x too cheap) and is measured again


# --------------------------------------------------------------------------------------------------- arithmetic
def _as_lists(acc) -> list[list[float]]:
    if isinstance(acc, torch.Tensor):
        acc = acc.tolist()
    return [[float(x) for x in row] for row in acc]


def expected_tau(acc, choices: Sequence[Sequence[int]]) -> float:
    """Expected tokens per target forward of the static tree `choices` (rank paths, root excluded):
    1 + sum over nodes of prod_{i} acc[i][path[i]]. A node whose depth or rank is not measured adds 0."""
    a = _as_lists(acc)
    tau = 1.0
    for path in choices:
        p = 1.0
        for d, r in enumerate(path):
            p *= a[d][r] if d < len(a) and r < len(a[d]) else 0.0
        tau += p
    return tau


def best_first_paths(acc, max_nodes: int, max_depth: int) -> list[tuple[tuple[int, ...], float]]:
    """Nodes in best-first order (path, probability of being accepted), depth <= max_depth. Because every factor
    is <= 1 a child never beats its parent, so any prefix of this list is a connected tree, and the best one of
    its size (for a fixed per-depth / per-rank acceptance)."""
    a = _as_lists(acc)
    depth = min(max_depth, len(a))
    if depth <= 0 or max_nodes <= 0:
        return []
    # ties (an untrained head: all zeros) resolved towards shallow, low-rank nodes
    heap = [(-a[0][r], 1, r, (r,)) for r in range(len(a[0]))]
    heapq.heapify(heap)
    out: list[tuple[tuple[int, ...], float]] = []
    while heap and len(out) < max_nodes:
        neg, _, _, path = heapq.heappop(heap)
        out.append((path, -neg))
        if len(path) < depth:
            for r in range(len(a[len(path)])):
                heapq.heappush(heap, (neg * a[len(path)][r], len(path) + 1, r, path + (r,)))
    return out


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


@dataclass
class TreeChoice:
    kind: str  # "eagle" (dynamic: depth / top_k / total_tokens) or "medusa" (static choices)
    total_tokens: int  # draft nodes, root excluded
    depth: int
    top_k: int
    choices: list[list[int]]  # the best static tree of that size (Medusa uses it as is)
    expected_tau: float
    relative_cost: float  # (t(n+1) + draft) / t(1)
    expected_speedup: float  # expected_tau / relative_cost, vs plain decoding = 1
    reason: str = ""
    candidates: list[dict[str, float]] = field(default_factory=list)  # the best of each depth, for the record

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def choose_tree(acc, verify_cost: dict[int, float], draft_cost: float, kind: str = "eagle", max_nodes: int = 64,
                max_depth: int | None = None, min_nodes: int = 1, draft_first: float | None = None) -> TreeChoice:
    """Maximise expected τ / (t(n+1)/t(1) + draft) over tree size n (draft nodes) and depth D (see module doc).
    verify_cost: {nodes incl. root: t(nodes)/t(1)}; draft_cost: one further depth's draft pass relative to t(1)
    (an EAGLE head pass, or one Medusa head); draft_first: the whole draft of a depth-1 tree relative to t(1)
    (None = draft_cost). The tree is never empty (min_nodes): when no tree beats plain decoding the best-valued
    one is still returned and the reason says so."""
    first = draft_cost if draft_first is None else draft_first
    a = _as_lists(acc)
    dmax = min(max_depth or len(a), len(a))
    best = None
    per_depth = []
    for D in range(1, dmax + 1):
        paths = best_first_paths(a, max_nodes, D)
        tau = 1.0
        best_d = None
        depth_used = 0
        for n, (q_path, p) in enumerate(paths, 1):
            tau += p
            depth_used = max(depth_used, len(q_path))
            if n < min_nodes:
                continue
            if depth_used < D:  # the same tree is scored at its own depth
                continue
            draft = first + draft_cost * (D - 1)
            cost = interp_cost(verify_cost, n + 1) + draft
            val = tau / cost
            if best_d is None or val > best_d[0] + 1e-12:
                best_d = (val, n, tau, cost)
            if best is None or val > best[0] + 1e-12:
                best = (val, n, D, tau, cost, [list(q) for q, _ in paths[:n]])
        if best_d:
            per_depth.append({"depth": D, "total_tokens": best_d[1], "expected_tau": round(best_d[2], 4),
                              "relative_cost": round(best_d[3], 4), "expected_speedup": round(best_d[0], 4)})
    if best is None:
        raise ValueError("choose_tree: empty acceptance matrix")
    val, n, D, tau, cost, choices = best
    top_k = max(1, max(max(c) for c in choices) + 1)
    if val > 1:
        why = (f"{n} draft nodes, depth {D}: expected τ {tau:.2f} for a step costing {cost:.2f}x one plain forward "
               f"(verify {interp_cost(verify_cost, n + 1):.2f}x + draft {cost - interp_cost(verify_cost, n + 1):.2f}x)"
               f" = {val:.2f}x expected speedup, the best over sizes 1..{max_nodes} and depths 1..{dmax}")
    else:
        why = (f"no tree beats plain decoding with this head's acceptance (best {val:.2f}x expected): using the "
               f"best of them anyway ({n} draft node{'s' if n > 1 else ''}, depth {D}); the head needs more training "
               f"(or a machine where verifying more nodes is cheaper) to pay off")
    return TreeChoice(kind=kind, total_tokens=n, depth=D, top_k=top_k, choices=choices, expected_tau=tau,
                      relative_cost=cost, expected_speedup=val, reason=why, candidates=per_depth)


# --------------------------------------------------------------------------------------------------- acceptance
class RecordingDrafter:
    """Wraps a drafter, forwarding everything, and records each step's (tree, accepted nodes) for
    `acceptance_matrix`, plus the drafter's own seconds per step (propose + observe)."""

    def __init__(self, inner):
        self.inner = inner
        self.steps: list[tuple[Any, list[int]]] = []
        self.step_s: list[float] = []  # drafter seconds per step; the first step of a prompt also feeds the prompt
        self.draft_s = 0.0
        self.num_steps = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def reset(self, prompt_ids, features):
        t = time.perf_counter()
        self.inner.reset(prompt_ids, features)
        self.draft_s += time.perf_counter() - t
        self._first = True

    def propose(self, ctx):
        t = time.perf_counter()
        tree = self.inner.propose(ctx)
        dt = time.perf_counter() - t
        self.draft_s += dt
        self.num_steps += 1
        self._cur = dt
        return tree

    def observe(self, tree, accepted, features):
        t = time.perf_counter()
        self.inner.observe(tree, accepted, features)
        dt = time.perf_counter() - t
        self.draft_s += dt
        if not getattr(self, "_first", False):  # a prompt's first step runs the whole prompt through the head
            self.step_s.append(getattr(self, "_cur", 0.0) + dt)
        self._first = False
        self.steps.append((tree, list(accepted.nodes)))

    def seconds_per_step(self) -> float:
        """Median drafter seconds per step (prompt-feeding first steps excluded when others exist)."""
        if self.step_s:
            return float(sorted(self.step_s)[len(self.step_s) // 2])
        return self.draft_s / max(1, self.num_steps)


def acceptance_matrix(steps, max_depth: int, max_rank: int) -> tuple[list[list[float]], list[list[int]]]:
    """acc[d][r] = P(the rank-r child at depth d+1 is accepted | its parent was accepted and had a rank-r child),
    from recorded (tree, accepted nodes) steps. A node's rank is its position among its parent's children in
    index order (drafters create children best first). Returns (acc, counts of the denominators)."""
    hits = [[0] * max_rank for _ in range(max_depth)]
    seen = [[0] * max_rank for _ in range(max_depth)]
    for tree, nodes in steps:
        parents = tree.parents.tolist()
        children: dict[int, list[int]] = {}
        for i, p in enumerate(parents):
            if p >= 0:
                children.setdefault(p, []).append(i)
        acc_set = set(nodes)
        for d, node in enumerate(nodes):  # accepted path, root first; node at depth d
            if d >= max_depth:
                break
            kids = children.get(node, [])
            for r, c in enumerate(kids[:max_rank]):
                seen[d][r] += 1
                if c in acc_set:
                    hits[d][r] += 1
    acc = [[(h / s if s else 0.0) for h, s in zip(hr, sr)] for hr, sr in zip(hits, seen)]
    return acc, seen


def monotone_in_rank(acc, counts) -> list[list[float]]:
    """acc[d] made non-increasing in rank (`isotonic` weighted by the probe's counts): drafters rank children by
    their own probability, so a lower rank is never truly accepted more often; a short probe can say otherwise by
    chance (stop 10: Medusa's rank-3 token at 3/24 beat rank 0 at 2/24, and the bench then drafted only the
    rank-3 token)."""
    return [[-v for v in isotonic([-a for a in row], w)] for row, w in zip(_as_lists(acc), counts)]


# --------------------------------------------------------------------------------------------------- profiling
def machine_key(target, dtype: torch.dtype | str) -> str:
    from specheads.infer.bench import environment

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
    from specheads.infer.bench import environment

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

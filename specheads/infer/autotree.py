"""`--tree auto` for tree heads (EAGLE, Medusa): the one draft tree that pays on this machine, chosen once per run
(infer/resolve.py: once per head folder) in small steps, each testable without a benchmark run. Block heads (DSpark,
DFlash) are not probed: their `--tree auto` is the per-step scheduler (step.py), priced by the same cost profile;
when a scheduler runs a tree head (`+lookup`, `combo`), this probe's matrix is the prior of the head's rates
(acceptance.rank_rates).

1. Verify cost (profile.py, read through costs.py): t(n)/t(1), one target forward of n tree nodes against one token,
   cached per machine + target + dtype (`load_or_profile`, `relative_costs`, `interp_cost`).
2. Acceptance (`run_probe`, `acceptance_matrix`, `monotone_in_rank`): the head drafts a wide probe tree on a few
   prompts spread over the benchmark (untimed); acc[d][r] = how often the rank-r draft token at depth d+1 was right
   given that its parent was.
3. Trust (`profile_is_stale`, `draft_t1`): the probe's tree forwards divided by their relative cost give the
   one-token forward time now. A cached profile whose t(1) is PROBE_T1_TOLERANCE off was measured in another state
   of the machine (another process on the cores) and is measured again; when a profile measured now still
   disagrees, the probe's own forwards were slowed (the run's first tree work) and the profile's t(1) prices the
   draft.
4. Price (`price_draft`): the draft as first depth + (D - 1) x each further depth, relative to t(1), from the probe's
   deep tree and a short depth-1 run of the same width, timed beside the target's forwards.
5. Choice (`choose_tree`, Sequoia's hardware-aware rule): expected τ of a tree = 1 (the bonus) + the sum over draft
   nodes of the product of acc along the node's path (siblings are disjoint events); for each depth limit D the best
   tree of n nodes adds nodes best-first; maximise expected τ(n, D) / (t(n+1)/t(1) + draft cost(D) / t(1)). Plain
   decoding is worth 1 (τ 1, cost 1): a tree is worth drafting only above that.
`choose_tree_for_head` runs the five and returns a TreeSpec with its record.
"""
from __future__ import annotations

import heapq
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from specheads.infer.drafters import build_drafter, drafter_kind
from specheads.infer.engine.generate import generate
from specheads.infer.scheduling.costs import interp_cost, isotonic, relative_costs, t1_seconds
from specheads.infer.scheduling.profile import load_or_profile
from specheads.infer.tree import DEFAULT_MEDUSA_CHOICES
from specheads.infer.treespec import TREE_NAMES, TreeSpec
from specheads.utils import SpecheadsError

log = logging.getLogger(__name__)

DYNAMIC_PROBE = TreeSpec.dynamic(depth=5, top_k=3, total_tokens=24)  # measures acceptance per depth/rank; CPU-sized
STATIC_PROBE_RANKS = 4  # ranks per head a Medusa probe drafts (DEFAULT_MEDUSA_CHOICES' widest)
CALIBRATION_TOKENS = 32  # tokens generated per probe prompt (untimed): ~15-30 steps
PROBE_T1_TOLERANCE = 1.5  # the probe's one-token forward vs the profile's: beyond this factor either way they were
# measured in different states of the machine (a profile taken beside another job prices every draft ~3x too cheap)
T1_FROM_PROBE = "the probe's tree forwards / their relative cost"
RULE = ("maximise expected τ / (t(n+1)/t(1) + draft cost), Sequoia-style; acceptance measured on a probe run of the "
        "head with a wide tree on a few prompts spread over the benchmark (untimed)")


# --------------------------------------------------------------------------------------------------- arithmetic
def _as_lists(acc) -> list[list[float]]:
    if isinstance(acc, torch.Tensor):
        acc = acc.tolist()
    return [[float(x) for x in row] for row in acc]


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


@dataclass
class TreeChoice:
    family: str  # drafter family (treespec.FAMILIES): dynamic uses depth / top_k / total_tokens, static the choices
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


def choose_tree(acc, verify_cost: dict[int, float], draft_cost: float, family: str = "dynamic", max_nodes: int = 64,
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
    return TreeChoice(family=family, total_tokens=n, depth=D, top_k=top_k, choices=choices, expected_tau=tau,
                      relative_cost=cost, expected_speedup=val, reason=why, candidates=per_depth)


# --------------------------------------------------------------------------------------------------- acceptance
class RecordingDrafter:
    """Wraps a drafter, forwarding everything, and records each step's (tree, accepted nodes) for
    `acceptance_matrix`, plus the drafter's own seconds per step (propose + observe)."""

    def __init__(self, inner):
        self.inner = inner
        self.steps: list[tuple[Any, list[int]]] = []  # (tree, accepted nodes) per step
        self.step_s: list[float] = []  # drafter seconds per step, the prompt-feeding first step of a prompt excluded
        self.draft_s = 0.0  # every drafter second, reset included
        self.num_steps = 0
        self.first_step = True  # the next observe ends a prompt's first step
        self.propose_s = 0.0  # the current step's propose seconds

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def reset(self, prompt_ids, features):
        t = time.perf_counter()
        self.inner.reset(prompt_ids, features)
        self.draft_s += time.perf_counter() - t
        self.first_step = True

    def propose(self, ctx):
        t = time.perf_counter()
        tree = self.inner.propose(ctx)
        dt = time.perf_counter() - t
        self.draft_s += dt
        self.num_steps += 1
        self.propose_s = dt
        return tree

    def observe(self, tree, accepted, features):
        t = time.perf_counter()
        self.inner.observe(tree, accepted, features)
        dt = time.perf_counter() - t
        self.draft_s += dt
        if not self.first_step:  # a prompt's first step runs the whole prompt through the head
            self.step_s.append(self.propose_s + dt)
        self.first_step = False
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
    chance (rank 3 accepted 3/24 against rank 0's 2/24 would make a one-node tree draft the rank-3 token)."""
    return [[-v for v in isotonic([-a for a in row], w)] for row, w in zip(_as_lists(acc), counts)]


@dataclass
class ProbePlan:
    """The two probe trees of a head: `deep` measures acceptance per depth and rank, `shallow` (depth 1, as wide)
    times the first depth of the draft alone."""

    deep: TreeSpec
    shallow: TreeSpec
    depth: int  # depths measured
    ranks: int  # ranks measured per depth
    record: dict[str, Any]


def probe_plan(family: str, head) -> ProbePlan:
    if family == "static":  # one Medusa head per depth, up to the head's count
        depth = int(getattr(head, "num_heads", 0) or len(max(DEFAULT_MEDUSA_CHOICES, key=len)))
        choices = [c for c in DEFAULT_MEDUSA_CHOICES if len(c) <= depth]
        return ProbePlan(TreeSpec.static(choices), TreeSpec.static([[r] for r in range(STATIC_PROBE_RANKS)]),
                         depth, STATIC_PROBE_RANKS, {"choices": len(choices), "depth": depth})
    if family == "dynamic":
        p = DYNAMIC_PROBE
        return ProbePlan(p, TreeSpec.dynamic(1, p.top_k, p.top_k), p.depth, p.top_k,
                         {"depth": p.depth, "top_k": p.top_k, "total_tokens": p.total_tokens})
    raise SpecheadsError(f"--tree auto: chooses trees for heads that draft trees (EAGLE, Medusa); this head's drafter "
                         f"family is {family!r}")


@dataclass
class ProbeRun:
    steps: list[tuple[Any, list[int]]]  # (tree, accepted nodes) per step
    per_prompt: list[tuple[float, float]]  # (target seconds per tree forward, mean tree nodes) per prompt
    seconds_per_step: float  # median drafter seconds per step (propose + observe)
    seconds: float  # wall time of the whole probe


def run_probe(target, drafter, prompt_ids: list[list[int]], max_new_tokens: int) -> ProbeRun:
    """Greedy generation of `max_new_tokens` on each prompt with `drafter`, recorded step by step."""
    rec = RecordingDrafter(drafter)
    t = time.perf_counter()
    per_prompt = []
    for ids in prompt_ids:
        st = generate(target, rec, torch.tensor([ids], device=target.device), max_new_tokens=max_new_tokens,
                      temperature=0.0).stats
        per_prompt.append((st.timings["target"] / max(st.target_forwards, 1), st.tree_nodes / max(st.target_forwards, 1)))
    return ProbeRun(rec.steps, per_prompt, rec.seconds_per_step(), time.perf_counter() - t)


# --------------------------------------------------------------------------------------------------- trust, price
def probe_t1(per_prompt: list[tuple[float, float]], costs: dict[int, float]) -> float:
    """One-token forward seconds now: each probe prompt's seconds per tree forward / the relative cost of its mean
    tree size; the median over prompts (the first one also warms up)."""
    t1s = sorted(sec / interp_cost(costs, n) for sec, n in per_prompt)
    return t1s[len(t1s) // 2]


def _agree(a: float, b: float, tolerance: float) -> bool:
    return 1 / tolerance <= a / b <= tolerance


def profile_is_stale(profile: dict[str, Any], t1_probe: float, tolerance: float = PROBE_T1_TOLERANCE) -> bool:
    """A cached profile whose t(1) is far from the probe's was measured in another state of the machine."""
    return bool(profile["cached"]) and not _agree(t1_seconds(profile), t1_probe, tolerance)


def draft_t1(profile: dict[str, Any], t1_probe: float, tolerance: float = PROBE_T1_TOLERANCE) -> tuple[float, str]:
    """(t(1) that prices the draft, where it came from). The probe's, timed beside the draft; but a clean profile
    that still disagrees was measured in this state of the machine (fresh or just re-measured), so the probe's own
    forwards were slowed and the profile's timed one-token forward is the truer one."""
    if not profile.get("noisy") and not _agree(t1_seconds(profile), t1_probe, tolerance):
        return t1_seconds(profile), f"the profile (the probe's tree forwards gave {1e3 * t1_probe:.1f} ms)"
    return t1_probe, T1_FROM_PROBE


@dataclass
class DraftPrice:
    """The draft's cost relative to one target forward: draft(D) = first + (D - 1) x per_depth."""

    first: float  # a depth-1 tree's whole draft (the accepted tokens' bookkeeping included)
    per_depth: float  # each further depth
    seconds_per_step: float  # the deep probe's drafter seconds per step
    depth1_seconds_per_step: float  # the depth-1 run's


def price_draft(deep_s: float, depth1_s: float, probe_depth: int, t1: float) -> DraftPrice:
    further = max(0.0, (deep_s - depth1_s) / max(probe_depth - 1, 1))
    return DraftPrice(depth1_s / t1, further / t1, deep_s, depth1_s)


def spec_from_choice(family: str, choice: TreeChoice) -> TreeSpec:
    if family == "static":
        return TreeSpec.static(choice.choices, text="auto")
    return TreeSpec.dynamic(choice.depth, choice.top_k, choice.total_tokens, text="auto")


# --------------------------------------------------------------------------------------------------- the choice
def choose_tree_for_head(target, head, calib_ids: list[list[int]], refresh: bool = False
                         ) -> tuple[TreeSpec, dict[str, Any]]:
    """Cost profile (cached) + probe runs -> (the tree spec that pays, its record for results.json)."""
    family = drafter_kind(head.config.kind, head=True).family
    plan = probe_plan(family, head)
    prof = load_or_profile(target, refresh=refresh)
    probe = run_probe(target, build_drafter(target, head, plan.deep), calib_ids, CALIBRATION_TOKENS)
    acc, seen = acceptance_matrix(probe.steps, plan.depth, plan.ranks)
    fitted = monotone_in_rank(acc, seen)  # a lower rank never beats a higher one (probe noise aside)
    t1_now, remeasured = probe_t1(probe.per_prompt, relative_costs(prof)), False
    if profile_is_stale(prof, t1_now):
        log.warning("the cached cost profile's one-token forward (%.1f ms) is far from this run's (%.1f ms): "
                    "measuring the profile again", 1e3 * t1_seconds(prof), 1e3 * t1_now)
        prof, remeasured = load_or_profile(target, refresh=True), True
        t1_now = probe_t1(probe.per_prompt, relative_costs(prof))
    t1, t1_from = draft_t1(prof, t1_now)
    if t1_from != T1_FROM_PROBE:
        log.warning("the probe's one-token forward (%.1f ms) is far from the fresh profile's (%.1f ms): pricing the "
                    "draft against the profile's", 1e3 * t1_now, 1e3 * t1)
    depth1 = run_probe(target, build_drafter(target, head, plan.shallow), calib_ids[:2], CALIBRATION_TOKENS // 2)
    price = price_draft(probe.seconds_per_step, depth1.seconds_per_step, plan.depth, t1)
    costs = relative_costs(prof)
    choice = choose_tree(fitted, costs, price.per_depth, family=family, max_nodes=max(costs) - 1,
                         max_depth=plan.depth, draft_first=price.first)
    record = tree_record(head, choice, plan, probe, acc, fitted, seen, len(calib_ids), price, t1, t1_from, prof,
                         remeasured)
    log.info("tree: %s (%s)", record["summary"], choice.reason)
    return spec_from_choice(family, choice), record


def tree_record(head, choice: TreeChoice, plan: ProbePlan, probe: ProbeRun, acc, fitted, seen, prompts: int,
                price: DraftPrice, t1: float, t1_from: str, prof: dict[str, Any], remeasured: bool) -> dict[str, Any]:
    """What results.json records about an automatic choice: the tree, why, and every input of the rule."""
    summary = (f"{TREE_NAMES[choice.family]}: {choice.total_tokens} draft nodes, depth {choice.depth}, top-k "
               f"{choice.top_k}; expected τ {choice.expected_tau:.2f}, expected speedup {choice.expected_speedup:.2f}x")
    return {"mode": "auto", **choice.to_dict(), "kind": head.config.kind, "summary": summary, "rule": RULE,
            "acceptance": {"acc": acc, "acc_monotone": fitted, "counts": seen, "probe": plan.record,
                           "probe_steps": len(probe.steps), "probe_tokens": CALIBRATION_TOKENS * prompts,
                           "probe_s": round(probe.seconds, 3)},
            "draft_cost": {"seconds_per_step": price.seconds_per_step,
                           "depth1_seconds_per_step": price.depth1_seconds_per_step, "relative_first": price.first,
                           "relative_per_unit": price.per_depth, "unit": "per further depth", "t1_s": t1,
                           "t1_from": t1_from},
            "profile": {"path": prof["path"], "cached": prof["cached"], "verify_relative": prof["verify"]["relative"],
                        "t1_s": t1_seconds(prof), "context": prof["verify"]["context"], "remeasured": remeasured,
                        "noisy": prof.get("noisy", False), "measured_at": prof.get("measured_at")}}

"""Verification of a draft tree against the target's logits at every node (one target forward).

N tree nodes, V vocab. logits[i] is the target's next-token distribution after the path root..i.
- verify_greedy: exact; the longest path whose tokens equal the target's argmax, plus the bonus argmax
  (greedy_on_device / greedy_batch_on_device: the same as tensor ops for logits on an accelerator; verify_rows: a
  batched forward's rows, the greedy ones in one call).
- verify_sampling: lossless; SpecInfer / Sequoia recursive rejection sampling over each node's children.
- verify_typical_lossy: Medusa's typical acceptance; LOSSY (output distribution differs from the target's).
Every function returns Accepted(nodes starting with 0, bonus token). None of them knows which drafter proposed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from specheads.infer.tree import DraftTree
from specheads.utils import SpecheadsError


@dataclass
class Accepted:
    nodes: list[int]  # accepted node indices, root (0) first, along one root-to-node path
    bonus: int  # the token the target itself supplies after the last accepted node

    @property
    def length(self) -> int:
        """Tokens emitted by this step: accepted draft nodes (root excluded) + the bonus."""
        return len(self.nodes)


@dataclass
class SamplingParams:
    """How the target samples. Checked here, so that library callers get the same errors as the CLI flags."""

    temperature: float = 0.0  # 0 = greedy (argmax); > 0 = sampling
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]; 1.0 = off
    top_k: int = 0  # tokens kept; 0 = off

    def __post_init__(self) -> None:
        for name, value in (("temperature", self.temperature), ("top_p", self.top_p)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise SpecheadsError(f"--{name.replace('_', '-')} {value!r}: must be a finite number")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise SpecheadsError(f"--top-k {self.top_k!r}: must be a whole number (0 = off)")
        if self.temperature < 0:
            raise SpecheadsError(f"--temperature {self.temperature}: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise SpecheadsError(f"--top-p {self.top_p}: must be in (0, 1] (1 = off)")
        if self.top_k < 0:
            raise SpecheadsError(f"--top-k {self.top_k}: must be >= 0 (0 = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def target_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """[N, V] logits -> [N, V] fp32 probabilities exactly as HF generate samples them: temperature, then top-k, then
    top-p (transformers' own warpers, in generate's order), then softmax."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = logits.float()
    if sampling.temperature > 0 and sampling.temperature != 1.0:
        scores = TemperatureLogitsWarper(sampling.temperature)(None, scores)
    if sampling.top_k and sampling.top_k > 0:
        scores = TopKLogitsWarper(top_k=sampling.top_k)(None, scores)
    if sampling.top_p < 1.0:
        scores = TopPLogitsWarper(top_p=sampling.top_p)(None, scores)
    return torch.softmax(scores, dim=-1)


def verify_greedy(tree: DraftTree, logits: torch.Tensor) -> Accepted:
    """Accept the longest path whose every token equals the target's argmax at its parent; bonus = argmax there.
    Logits on the host: the walk reduces only the rows on its path (depth + 1 of N), each in fp32 as HF generate
    does (bf16 argmax on CPU is ~7x slower; the fp32 copy is exact, so the first maximal index is the same), and
    there is no device to wait for. Logits on an accelerator: `greedy_on_device`, one transfer per step."""
    if logits.device.type != "cpu":
        return greedy_on_device(tree, logits)
    tokens, kids, nodes, cur = tree.tokens.tolist(), tree.children_lists(), [0], 0
    while True:
        best = int(logits[cur].float().argmax())  # the target's own greedy choice after node cur
        nxt = next((c for c in kids[cur] if tokens[c] == best), None)
        if nxt is None:  # no child equals the target's token: the target's token is the bonus
            return Accepted(nodes, best)
        cur = nxt
        nodes.append(cur)


def _to(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device` without waiting for the work queued there (pinned, non-blocking)."""
    return x.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else x.to(device)


def _ancestors(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[..., N, N] bool: a[..., i, j] = node j is node i or one of its ancestors, built where `parents` [..., N]
    lives (one hop per depth, no host reads; a leading B dim = one tree per row)."""
    n = parents.shape[-1]
    cols = torch.arange(n, device=parents.device)
    a = (cols[:, None] == cols[None]).expand(*parents.shape[:-1], n, n).clone()
    up = parents
    for _ in range(max_depth):
        a |= up[..., :, None] == cols  # up = -1 (above the root) matches no column
        up = torch.where(up >= 0, parents.gather(-1, up.clamp(min=0)), up)
    return a


def greedy_on_device(tree: DraftTree, logits: torch.Tensor) -> Accepted:
    """verify_greedy as tensor ops where the logits [N, V] are, one transfer per step (greedy_batch_on_device of
    one row)."""
    return greedy_batch_on_device([tree], logits[None])[0]


def greedy_batch_on_device(trees: Sequence[DraftTree], logits: torch.Tensor) -> list[Accepted]:
    """verify_greedy of every row of a batched forward as tensor ops where the logits [B, N, V] are (gpt-fast's
    vectorised acceptance): row r's tree is nodes [0, len(trees[r])), the rest padding (never accepted); the
    target's argmax after every node at once, each row's walk found by masks, ONE transfer of every row's (last
    node, bonus) at the end. The walk takes a node's first child (index order) equal to the target's token: node i
    is on its path iff every node from the root to i equals the target's token after its parent and has no earlier
    sibling that does."""
    dev, (B, N) = logits.device, logits.shape[:2]
    best = logits.float().argmax(-1)  # [B, N] the target's greedy token after each node (first maximal index)
    host = torch.full((3, B, N), -1, dtype=torch.long)  # tokens, parents, depth; padding: -1 (no token, no parent)
    for r, tree in enumerate(trees):
        n = len(tree)
        host[0, r, :n], host[1, r, :n], host[2, r, :n] = tree.tokens, tree.parents, tree.depth
    tokens, parents, depth = _to(host, dev)  # [B, N] each
    match = tokens == best.gather(-1, parents.clamp(min=0))  # [B, N] node equals the target's token after its parent
    match[:, 0] = True  # the root is always kept (padding's token -1 never matches)
    idx = torch.arange(N, device=dev)
    earlier = (parents[:, :, None] == parents[:, None]) & (idx[None] < idx[:, None])  # [B, N, N] j earlier sibling
    first = match & ~(earlier & match[:, None]).any(-1)  # [B, N] the child the walk takes under its parent
    deepest = max(tree.max_depth for tree in trees)
    on_path = ~(_ancestors(parents, deepest) & ~first[:, None]).any(-1)  # [B, N] one root-to-node chain per row
    last = torch.where(on_path, depth, -1).argmax(-1)  # [B] each row's deepest path node
    bonus = best.gather(-1, last[:, None])[:, 0]  # [B]
    last, bonus = torch.stack([last, bonus]).tolist()  # the step's one device -> host transfer, every row
    return [Accepted(tree.path(i), b) for tree, i, b in zip(trees, last, bonus)]


def verify_rows(verifies: Sequence[Callable[[DraftTree, torch.Tensor], Accepted]], trees: Sequence[DraftTree],
                logits: torch.Tensor) -> list[Accepted]:
    """Each row of a batched forward verified by its own rule (logits [B, N, V], row r's nodes [0, len(trees[r]))):
    greedy rows with the logits off the host in one greedy_batch_on_device call (one host transfer for the batch);
    on the host (verify_greedy's walk reads only its path's rows) or sampling, each row alone."""
    if logits.device.type != "cpu" and all(v is verify_greedy for v in verifies):
        return greedy_batch_on_device(trees, logits)
    return [v(tree, logits[r, :len(tree)]) for r, (v, tree) in enumerate(zip(verifies, trees))]


def _sample(p: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=generator))


def verify_sampling(tree: DraftTree, logits: torch.Tensor, sampling: SamplingParams,
                    generator: torch.Generator | None = None, probs: torch.Tensor | None = None) -> Accepted:
    """Lossless multi-candidate speculative sampling (SpecInfer / Sequoia recursive rejection).

    At node `cur` with target distribution p and draft distribution q (tree.q[cur]; the children were drawn from q
    without replacement, in index order), try the children in turn:
      accept child x with probability min(1, p(x) / q(x));
      on rejection p <- norm(max(p - q, 0)) and q <- norm(q with x removed) (the next child was drawn from that q).
    Deterministic proposals (tree.q None) are point masses: accept x with probability p(x); on rejection p(x) <- 0
    and renormalise. If every child is rejected the bonus is drawn from the residual p; at a leaf from p itself.
    Each emitted token is therefore distributed exactly as the target's own sampling distribution.
    Logits on the host: only the rows the walk visits (depth + 1 of N) are warped. On an accelerator every row is
    warped there and all of them come to the host in one transfer (and q, if it is there, in one more), instead of
    one wait per depth; the walk itself runs on the host in float64 either way."""
    if probs is None and logits.device.type != "cpu":
        probs = target_probs(logits, sampling).cpu()  # [N, V]
    q_all = tree.q if tree.q is None or tree.q.device.type == "cpu" else tree.q.cpu()  # [N, V] | None

    def row(i: int) -> torch.Tensor:  # p at node i, warped only for the rows the walk visits (depth + 1 of N)
        return (target_probs(logits[i:i + 1], sampling)[0] if probs is None else probs[i]).to("cpu", torch.float64)

    tokens, kids, nodes, cur = tree.tokens.tolist(), tree.children_lists(), [0], 0
    while True:
        p = row(cur)  # float64 on CPU: exact-enough residuals, CPU generator
        q = None if q_all is None else q_all[cur].to(torch.float64)
        accepted = None
        for child in kids[cur]:
            x = tokens[child]
            u = float(torch.rand((), generator=generator))
            if q is None:  # point mass at x: accept with p(x); else zero p(x) and renormalise
                if u < float(p[x]):
                    accepted = child
                    break
                p = p.clone()
                p[x] = 0.0
            else:  # accept with min(1, p(x)/q(x)); else p <- max(p - q, 0), q <- q without x (both renormalised)
                px, qx = float(p[x]), float(q[x])
                if (qx > 0 and u < px / qx) or (qx <= 0 and px > 0):
                    accepted = child
                    break
                p = (p - q).clamp_(min=0)
                q = q.clone()
                q[x] = 0.0
                qs = float(q.sum())
                if qs > 0:
                    q /= qs
            s = float(p.sum())
            if s <= 0:  # cannot happen with exact arithmetic; guard against round-off
                p = row(cur)
                break
            p = p / s
        if accepted is None:  # every child rejected (or a leaf): the target supplies the token
            return Accepted(nodes, _sample(p.float(), generator))
        nodes.append(accepted)
        cur = accepted


def verify_typical_lossy(tree: DraftTree, logits: torch.Tensor, sampling: SamplingParams,
                         generator: torch.Generator | None = None, posterior_threshold: float = 0.09,
                         posterior_alpha: float = 0.3) -> Accepted:
    """Medusa typical acceptance. LOSSY: a token is accepted if the target gives it probability above
    min(posterior_threshold, posterior_alpha * exp(-entropy)), so the output is NOT distributed as the target's
    sampling. Defaults are Medusa's (threshold 0.09, alpha 0.3 = sqrt of 0.09). The longest accepted path wins; the
    bonus is sampled from the target (argmax when greedy)."""
    t = max(sampling.temperature, 1e-5)
    p_all = torch.softmax(logits.float() / t, dim=-1)  # [N, V]
    ent = -(p_all * torch.log(p_all.clamp_min(1e-12))).sum(-1)  # [N]
    thresh = torch.minimum(torch.full_like(ent, posterior_threshold), posterior_alpha * torch.exp(-ent))
    dev = p_all.device
    tpd = _to(torch.stack([tree.tokens, tree.parents, tree.depth]), dev)  # [3, N]
    tokens, parents, depth = tpd[0], tpd[1].clamp(min=0), tpd[2]
    ok = p_all[parents, tokens] > thresh[parents]  # [N] node i passes under its parent's threshold
    ok[0] = True  # the root
    good = ~(_ancestors(tpd[1], tree.max_depth) & ~ok[None]).any(-1)  # [N] it and all its ancestors pass
    best = int(torch.where(good, depth, -1).argmax())  # the deepest accepted node, the first of equal depth
    nodes = tree.path(best)
    if sampling.greedy:
        bonus = int(logits[best].argmax())
    else:
        bonus = _sample(target_probs(logits[best:best + 1], sampling)[0].cpu(), generator)
    return Accepted(nodes, bonus)


VERIFICATIONS = ("auto", "greedy", "sampling", "typical-lossy")


def verifier(verification: str, sampling: SamplingParams,
             generator: torch.Generator | None = None) -> Callable[[DraftTree, torch.Tensor], Accepted]:
    """The verification rule of one generation, bound once: (tree, logits [N, V]) -> Accepted.
    auto = greedy at temperature 0, lossless sampling above it."""
    if verification not in VERIFICATIONS:
        raise SpecheadsError(f"verification {verification!r}: expected one of {', '.join(VERIFICATIONS)}")
    mode = verification if verification != "auto" else ("greedy" if sampling.greedy else "sampling")
    if mode == "sampling" and sampling.greedy:
        raise SpecheadsError("temperature 0 is greedy: verification='sampling' needs temperature > 0")
    if mode == "greedy":
        return verify_greedy
    if mode == "sampling":
        return lambda tree, logits: verify_sampling(tree, logits, sampling, generator)
    return lambda tree, logits: verify_typical_lossy(tree, logits, sampling, generator)

"""What serving sees of a teacher-forced evaluation: the serving walk over an answer, and the standard error of a
figure averaged over samples.

Teacher forcing gives, at every row t of an answer, the accepted length a(t) = 1 + the number of consecutive
drafts (or tree depths) the target would accept if a draft started there. Averaging a(t) over every row (the
per-position τ) weighs rows serving never drafts from: serving starts a cycle only where the previous one ended,

    r_0 = the answer's first start row,   r_{i+1} = r_i + a(r_i),

and emits a(r_i) tokens per target forward. The walk τ of an answer is sum_i a(r_i) / cycles (capped at the
answer's length), what `specheads bench` counts for our loop as tokens per target forward (its prefill caches the
prompt but its last token, and the first tree forward emits the first answer token with the drafts after it).
With greedy decoding and the target's own greedy answer, a chain drafter's walk τ is exactly its served τ on that
answer (the drafter reads the same prefix and features at each cycle start: tests/test_serving_eval.py).

Both τ figures are ratios of sums over samples, R = sum_i y_i / sum_i n_i (y: accepted tokens, n: rows or
forwards); rows of one sample are correlated, so the standard error is the samples' (linearised ratio estimator):
se(R)^2 = m / (m - 1) * sum_i (y_i - R n_i)^2 / (sum_i n_i)^2 over m samples. Shapes: B batch (one sample a row),
T sequence.
"""
from __future__ import annotations

import math

import torch

RATIO_FIELDS = 5  # per ratio: sum y, sum n, sum y^2, sum y n, sum n^2


def walk_sample(accepted: list[int], start: list[bool]) -> tuple[int, int]:
    """(tokens, target forwards) of serving one sample's answers as our generation loop does. A span of L
    consecutive start rows s..s+L-1 is one answer of L tokens (row t drafts token t+2: row s drafts the answer's
    first token, from the prompt's features and its last token, the first step's root); cycles go r -> r +
    accepted[r] from r = s while r is in the span, and the answer's L tokens cap what they emit (the last cycle's
    bonus may lie past the answer, and is never generated).
    accepted, start: per row t of the sample (accepted length a(t) >= 1; drafting may start at t)."""
    tokens = forwards = 0
    t, T = 0, len(start)
    while t < T:
        if not start[t]:
            t += 1
            continue
        end = t
        while end < T and start[end]:
            end += 1  # the span is rows t..end-1: an answer of end - t tokens
        emitted, r = 0, t
        while r < end:
            emitted, forwards = emitted + accepted[r], forwards + 1
            r += accepted[r]
        tokens += min(emitted, end - t)
        t = end
    return tokens, forwards


def walk_batch(accepted: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B,T] accepted lengths and start rows -> ([B] tokens, [B] forwards) of the serving walk per sample."""
    a, s = accepted.long().cpu().tolist(), start.bool().cpu().tolist()
    pairs = [walk_sample(ai, si) for ai, si in zip(a, s)]
    return (torch.tensor([p[0] for p in pairs], dtype=torch.float64),
            torch.tensor([p[1] for p in pairs], dtype=torch.float64))


def ratio_sums(y: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """[B] per-sample numerators and denominators -> [RATIO_FIELDS] sums (added across batches and processes);
    samples with n = 0 (nothing to score) are left out."""
    y, n = y.double().cpu(), n.double().cpu()
    keep = n > 0
    y, n = y[keep], n[keep]
    return torch.stack([y.sum(), n.sum(), (y * y).sum(), (y * n).sum(), (n * n).sum()])


def ratio_and_se(sums: torch.Tensor, samples: float) -> tuple[float, float]:
    """(R, its standard error) from ratio_sums added over `samples` samples; se is nan below two samples."""
    sy, sn, syy, syn, snn = (float(x) for x in sums)
    if sn <= 0:
        return 0.0, float("nan")
    r = sy / sn
    if samples < 2:
        return r, float("nan")
    resid = max(0.0, syy - 2 * r * syn + r * r * snn)
    return r, math.sqrt(samples / (samples - 1) * resid) / sn

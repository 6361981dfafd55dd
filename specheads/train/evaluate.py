"""Evaluation that predicts acceptance: per-head (Medusa) / per-step (EAGLE) top-1 and top-k accuracy against the
target's GREEDY token (what verification accepts), and a simulated accepted length τ (teacher-forced):

- chain τ at a start row t = 1 (the target's own token) + the number of consecutive draft steps whose top-1 equals
  the target's greedy token; averaged over start rows inside assistant answers.
- tree τ: the same with "the target's token is in the draft's top-`tree_width`" over at most `tree_depth` steps:
  the τ of a full `tree_width`-ary tree of that depth (width 2, depth 5: 62 nodes, about EAGLE-2's 60-token budget).

Teacher forcing: the draft reads the data's tokens and (EAGLE-3 TTT) its own predicted features, which is what it
sees in serving whenever the earlier steps were accepted. With regenerated data the data's tokens are the target's
own, so this tracks the τ that `specheads bench` measures; on human-written data it reads the target on text it
would not have written.

Block heads (DSpark / DFlash) add, per draft position j (over start rows whose drafts < j were all accepted, i.e.
the top-1 of each equals the target's greedy token): greedy acceptance `accept_j`, mean calibrated confidence
`conf_j`, its ECE / AUROC / Brier score against that acceptance (`ece_j`, `auroc_j`, `brier_j`), the ECE of the
survival probability prod_{i<=j} c_i against "drafts <= j all accepted" over every start row (`surv_ece_j`, what
DeepSpec's evaluator reports), and for each `conf_threshold` the τ of the block cut where that survival falls
below the threshold (`tau_cut{thr}`, with `len_cut{thr}` drafts verified on average); `tau_chain` is the full
block's. `fit_sequential_temperatures` calibrates the confidences per position on held-out rows after training.
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specheads.train.losses import accepted_lengths, step_correct
from specheads.train.walk import RATIO_FIELDS, ratio_and_se, ratio_sums, walk_batch

log = logging.getLogger(__name__)


@dataclass
class EvalConfig:
    every_steps: int = 200  # optimizer steps between evaluations (0 = only at the end)
    # held-out samples per evaluation (all processes together): None = every one; N = a random subset drawn once
    # with the recipe's seed (the same samples at every evaluation). Never the first N: feature shards hold
    # samples sorted by length, so the first N are the shortest answers.
    max_samples: int | None = None
    batch_size: int = 4  # samples per process per forward
    topk: int = 5  # top-k accuracy reported beside top-1
    tree_width: int = 2  # simulated full tree: branching per depth
    tree_depth: int = 5  # simulated full tree: depth (2^1+...+2^5 = 62 nodes)
    eagle_steps: int = 5  # EAGLE-1 unroll depth used for the chain τ
    # metric that picks the best checkpoint: tau_tree | tau_chain (per position), tau_tree_walk | tau_chain_walk
    # (the serving walk), each on the held-out split or, prefixed dev_, on the serving-true dev set
    select: str = "tau_tree"
    at_start: bool = True  # evaluate the untrained head first (the baseline τ the training must beat)
    # The serving-true dev set (train/devset.py): prompts answered by the target as `specheads bench` answers them
    dev_prompts: int = 0  # prompts (0 = off; 32 = 4 of each MT-bench kind of request)
    dev_dataset: str = "sharegpt-dev"  # sharegpt-dev | sharegpt:START | FILE.jsonl (never a benchmark we report)
    dev_max_new_tokens: int = 256  # tokens per answer: `specheads bench`'s default --max-new-tokens
    # DSpark: cut the block where the calibrated survival prod c_i falls below each threshold (a probability)
    conf_threshold: float | list[float] = field(default_factory=lambda: [0.3, 0.5, 0.7])

    def __post_init__(self) -> None:
        from specheads.utils import SpecheadsError, check_values

        check_values("eval", self, {"every_steps": ">=0", "max_samples": ">=1|None", "batch_size": ">=1", "topk": ">=1",
                                    "tree_width": ">=1", "tree_depth": ">=1", "eagle_steps": ">=1",
                                    "dev_prompts": ">=0", "dev_max_new_tokens": ">=1"})
        names = [f"{d}{m}" for d in ("", "dev_") for m in EvalAccumulator.RATIOS]
        if self.select not in names:
            raise SpecheadsError(f"eval.select: {self.select!r} is not one of {names}")
        if self.select.startswith("dev_") and not self.dev_prompts:
            raise SpecheadsError(f"eval.select: {self.select} needs the dev set; set eval.dev_prompts (e.g. 32)")
        if not isinstance(self.conf_threshold, list):
            self.conf_threshold = [self.conf_threshold]
        bad = [t for t in self.conf_threshold if not 0.0 < float(t) < 1.0]
        if bad:
            raise SpecheadsError(f"eval.conf_threshold: {bad[0]!r} is not a probability in (0, 1)")


class EvalAccumulator:
    """Sums over batches (and processes, via `reduce`) -> metrics dict. One batch row is one sample: the τ figures
    carry the samples' standard error (walk.ratio_and_se), and the serving walk (walk.py) is taken per sample."""

    RATIOS = ("tau_chain", "tau_tree", "tau_chain_walk", "tau_tree_walk")

    def __init__(self, num_steps: int):
        self.K = num_steps
        # valid, top1, topk per step; per ratio its RATIO_FIELDS sums; then rows, samples
        self.sums = torch.zeros(3 * num_steps + RATIO_FIELDS * len(self.RATIOS) + 2, dtype=torch.float64)

    def add(self, step_logits, target_argmax, loss_mask, d2t, cfg: EvalConfig) -> None:
        valid, top1, topk = step_correct(step_logits, target_argmax, loss_mask, d2t, topk=cfg.topk)
        _, _, tree = step_correct(step_logits, target_argmax, loss_mask, d2t, topk=cfg.tree_width)
        start = valid[0]  # [B,T] drafting starts at every row whose next drafted token is an assistant token
        K, s = self.K, self.sums
        s[:K] += valid.flatten(1).sum(1).double().cpu()
        s[K:2 * K] += top1.flatten(1).sum(1).double().cpu()
        s[2 * K:3 * K] += topk.flatten(1).sum(1).double().cpu()
        chain, full = accepted_lengths(top1), accepted_lengths(tree, depth=cfg.tree_depth)  # [B,T]
        rows = start.sum(1)  # [B]
        parts = [(torch.where(start, chain, 0).sum(1), rows), (torch.where(start, full, 0).sum(1), rows),
                 walk_batch(chain, start), walk_batch(full, start)]
        off = 3 * K
        for y, n in parts:
            s[off:off + RATIO_FIELDS] += ratio_sums(y, n)
            off += RATIO_FIELDS
        s[off] += float(rows.sum())
        s[off + 1] += float((rows > 0).sum())

    def metrics(self, cfg: EvalConfig) -> dict[str, float]:
        K, s = self.K, self.sums
        out: dict[str, float] = {}
        for k in range(K):
            n = max(1.0, float(s[k]))
            out[f"top1_{k}"] = float(s[K + k]) / n
            out[f"top{cfg.topk}_{k}"] = float(s[2 * K + k]) / n
        off, samples = 3 * K + RATIO_FIELDS * len(self.RATIOS), float(s[-1])
        for i, name in enumerate(self.RATIOS):
            r, se = ratio_and_se(s[3 * K + RATIO_FIELDS * i:3 * K + RATIO_FIELDS * (i + 1)], samples)
            out[name] = r
            if math.isfinite(se):  # two samples at least
                out[f"{name}_se"] = se
        out["eval_rows"], out["eval_samples"] = float(s[off]), samples
        return out


def eval_summary(metrics: dict[str, float]) -> str:
    """One log line: first-draft top-1 and the τ figures (± their standard error) of each evaluated set."""
    parts = []
    for pre, name in (("", "held-out"), ("dev_", "dev")):
        if f"{pre}tau_chain" not in metrics:
            continue
        fig = [f"top1_0={metrics.get(pre + 'top1_0', float('nan')):.3f}"]
        for m in EvalAccumulator.RATIOS:
            se = metrics.get(f"{pre}{m}_se", float("nan"))
            fig.append(f"{m}={metrics[pre + m]:.3f}" + ("" if se != se else f"±{se:.3f}"))
        parts.append(f"{name} [{int(metrics[pre + 'eval_samples'])} samples] " + " ".join(fig))
    return "; ".join(parts)


def conditional_rows(correct: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[K',N] bool: draft j exists and drafts < j were all accepted (the event a draft's confidence predicts)."""
    y = correct.long()
    return valid.bool() & torch.cat([torch.ones_like(y[:1]), y.cumprod(0)[:-1]]).bool()


def calibrated_probs(z: torch.Tensor, temps: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Confidence logits [K',N] -> σ(z_j / T_j + β_j) (DSparkHead.calibrated's rule, positions first)."""
    bias = torch.zeros_like(temps) if bias is None else bias
    return torch.sigmoid(z / temps[:, None] + bias[:, None])


class BlockEvalAccumulator:
    """Block-head confidence and acceptance sums (over batches, and processes via `reduce` on `sums`) -> metrics.
    ECE: equal-width bins, sum over bins of |mean prediction - mean outcome| weighted by the bin's share; AUROC
    from a fine histogram (ties counted half), as DeepSpec's PerPositionConfidenceMetrics computes them."""

    BINS, FINE = 10, 200  # ECE bins; AUROC histogram bins

    def __init__(self, num_drafts: int, thresholds):
        self.K, self.thr = num_drafts, [float(t) for t in thresholds]
        K, nb = num_drafts, self.BINS
        self._shapes = {"cond_hist": (K, 3, nb), "cond_roc": (K, 2, self.FINE), "cond_stats": (K, 4),
                        "surv_hist": (K, 3, nb), "cut": (len(self.thr), 2), "starts": (1,)}
        self.sums = torch.zeros(sum(torch.Size(v).numel() for v in self._shapes.values()), dtype=torch.float64)

    def _view(self, name: str) -> torch.Tensor:
        off = 0
        for k, shape in self._shapes.items():
            n = torch.Size(shape).numel()
            if k == name:
                return self.sums[off:off + n].view(shape)
            off += n
        raise KeyError(name)

    @staticmethod
    def _hist(h: torch.Tensor, p: torch.Tensor, y: torch.Tensor) -> None:
        idx = (p * h.shape[-1]).long().clamp(0, h.shape[-1] - 1)
        for row, w in enumerate((torch.ones_like(p), p, y)):
            h[row].index_add_(0, idx, w)

    def add(self, top1: torch.Tensor, valid: torch.Tensor, start: torch.Tensor, conf: torch.Tensor) -> None:
        """top1, valid [K',B,T] bool (draft j correct / exists, step_correct's), start [B,T] bool, conf [K',B,T]
        calibrated probabilities."""
        c, y, v = conf[:, start].double().cpu(), top1[:, start].cpu(), valid[:, start].cpu()  # [K',N]
        if not v.numel():
            return
        run = y.long().cumprod(0)  # [K',N]: drafts <= j all accepted
        cond = conditional_rows(y, v)
        surv = c.cumprod(0)
        hist, roc, stats, shist = (self._view(k) for k in ("cond_hist", "cond_roc", "cond_stats", "surv_hist"))
        for j in range(self.K):
            m = cond[j]  # conditional: drafts < j accepted
            pj, yj = c[j][m], y[j][m].double()
            self._hist(hist[j], pj, yj)
            fine = (pj * self.FINE).long().clamp(0, self.FINE - 1)
            roc[j, 0].index_add_(0, fine, yj)
            roc[j, 1].index_add_(0, fine, 1.0 - yj)
            stats[j] += torch.stack([m.sum().double(), yj.sum(), pj.sum(), ((pj - yj) ** 2).sum()])
            self._hist(shist[j], surv[j][v[j]], run[j][v[j]].double())
        accepted = run.sum(0)  # [N]
        for i, t in enumerate(self.thr):
            kept = ((surv >= t) & v).long().cumprod(0).sum(0)  # drafts verified: until survival < t
            self._view("cut")[i] += torch.stack([(1 + torch.minimum(accepted, kept)).sum().double(),
                                                 kept.sum().double()])
        self._view("starts")[0] += float(v.shape[1])

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        hist, roc, stats, shist = (self._view(k) for k in ("cond_hist", "cond_roc", "cond_stats", "surv_hist"))
        for j in range(self.K):
            n = float(stats[j, 0])
            if n > 0:
                out[f"accept_{j}"], out[f"conf_{j}"] = float(stats[j, 1]) / n, float(stats[j, 2]) / n
                out[f"brier_{j}"] = float(stats[j, 3]) / n
                out[f"ece_{j}"] = float((hist[j, 1] - hist[j, 2]).abs().sum()) / n
                auc = _auroc(roc[j, 0], roc[j, 1])
                if auc is not None:
                    out[f"auroc_{j}"] = auc
            ns = float(shist[j, 0].sum())
            if ns > 0:
                out[f"surv_ece_{j}"] = float((shist[j, 1] - shist[j, 2]).abs().sum()) / ns
        starts = max(1.0, float(self._view("starts")[0]))
        for i, t in enumerate(self.thr):
            out[f"tau_cut{t:g}"] = float(self._view("cut")[i, 0]) / starts
            out[f"len_cut{t:g}"] = float(self._view("cut")[i, 1]) / starts
        eces = [out[f"ece_{j}"] for j in range(self.K) if f"ece_{j}" in out]
        if eces:
            out["ece_max"] = max(eces)
        return out


def _auroc(pos: torch.Tensor, neg: torch.Tensor) -> float | None:
    """AUROC from histograms of the positives' and negatives' scores (ascending bins); None without both."""
    P, N = float(pos.sum()), float(neg.sum())
    if P <= 0 or N <= 0:
        return None
    below = torch.cumsum(neg, 0) - neg  # negatives in strictly lower bins
    return float(((pos * below).sum() + 0.5 * (pos * neg).sum()) / (P * N))


def fit_sequential_temperatures(logits: torch.Tensor, correct: torch.Tensor, valid: torch.Tensor,
                                grid: torch.Tensor | None = None) -> torch.Tensor:
    """Per-position temperatures T_j of the confidence logits, fitted left to right (sequential temperature
    scaling): T_j minimises the negative log-likelihood of the survival S_j = S_{j-1} · σ(z_j / T_j) (S_{j-1}
    with the temperatures already fitted) against "drafts <= j all accepted", over the rows where draft j exists.

    logits, correct, valid: [K',N] (raw confidence logits; greedy correctness; draft exists). grid: candidate
    temperatures (default 301 log-spaced values from 0.03 to 31.6, 2.3% apart). Returns [K'] (1 where no row)."""
    grid = torch.logspace(-1.5, 1.5, 301, dtype=torch.float64) if grid is None else grid.double()
    z, lab = logits.double(), correct.long().cumprod(0).double()
    S = torch.ones(z.shape[1], dtype=torch.float64)
    out = torch.ones(z.shape[0], dtype=torch.float64)
    for j in range(z.shape[0]):
        m = valid[j]
        if m.any():
            cand = (S[m][None] * torch.sigmoid(z[j][m][None] / grid[:, None])).clamp(1e-7, 1 - 1e-7)  # [G,M]
            y = lab[j][m][None]
            nll = -(y * cand.log() + (1 - y) * (1 - cand).log()).mean(1)
            out[j] = grid[int(nll.argmin())]
        S = S * torch.sigmoid(z[j] / out[j])
    return out.float()


PLATT_MIN_ROWS = 20  # rows below which a position keeps T = 1, β = 0 (too few to fit two numbers)
PLATT_MIN_SLOPE = 1e-3  # 1 / T at least: a confidence that does not rank (slope <= 0) becomes its mean rate


def fit_platt(logits: torch.Tensor, correct: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position Platt scaling of the confidence logits: c_j = σ(z_j / T_j + β_j) fitted by logistic
    regression on the rows where draft j exists and drafts < j were all accepted: the event c_j predicts. A
    temperature alone cannot move a mean (σ(0 / T) = 0.5), a bias can: the later drafts' acceptance is
    under-predicted otherwise. A fitted slope 1 / T below PLATT_MIN_SLOPE is held there and β refitted alone.

    logits, correct, valid: [K',N] (raw confidence logits; greedy correctness; draft exists). Returns (T [K'],
    β [K']); positions with fewer than PLATT_MIN_ROWS rows keep T = 1, β = 0."""
    z, y, cond = logits.double(), correct.double(), conditional_rows(correct, valid)
    temps, bias = torch.ones(z.shape[0]), torch.zeros(z.shape[0])
    for j in range(z.shape[0]):
        m = cond[j]
        if int(m.sum()) < PLATT_MIN_ROWS:
            continue
        a, b = _logistic_fit(z[j][m], y[j][m])
        if a < PLATT_MIN_SLOPE:
            a, b = PLATT_MIN_SLOPE, _logistic_fit(z[j][m], y[j][m], slope=PLATT_MIN_SLOPE)[1]
        temps[j], bias[j] = 1.0 / a, b
    return temps, bias


def _logistic_fit(x: torch.Tensor, y: torch.Tensor, slope: float | None = None, iters: int = 50,
                  ridge: float = 1e-4) -> tuple[float, float]:
    """(a, b) minimising the mean NLL of y ~ σ(a x + b) by Newton steps, `ridge` pulling a toward 1 and b toward 0
    (finite answers when the classes separate); slope: a held fixed, b fitted alone."""
    X = torch.stack([x, torch.ones_like(x)], 1)  # [M,2]
    free = [0, 1] if slope is None else [1]
    w = torch.tensor([1.0 if slope is None else slope, 0.0], dtype=torch.float64)
    prior = torch.tensor([1.0, 0.0], dtype=torch.float64)
    for _ in range(iters):
        p = torch.sigmoid(X @ w)
        grad = (X.T @ (p - y) / len(X) + ridge * (w - prior))[free]
        hess = ((X.T * (p * (1 - p))) @ X / len(X) + ridge * torch.eye(2, dtype=torch.float64))[free][:, free]
        step = torch.linalg.solve(hess, grad)
        w[free] = w[free] - step
        if float(step.abs().max()) < 1e-10:
            break
    return float(w[0]), float(w[1])


def ece(p: torch.Tensor, y: torch.Tensor, bins: int = BlockEvalAccumulator.BINS) -> float:
    """Expected calibration error of probabilities p against outcomes y [M] (BlockEvalAccumulator's binning)."""
    idx = (p * bins).long().clamp(0, bins - 1)
    n = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, torch.ones_like(p, dtype=torch.float64))
    sp = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, p.double())
    sy = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, y.double())
    return float((sp - sy).abs().sum() / max(1.0, float(n.sum())))


def null_ece(conf: torch.Tensor, correct: torch.Tensor, valid: torch.Tensor, sims: int = 200,
             seed: int = 0) -> dict[str, float]:
    """The ECE a perfectly calibrated confidence would show on these rows: per draft j, over the rows where draft j
    exists and drafts < j were accepted (as ece_j), outcomes drawn y ~ Bernoulli(c_j) `sims` times -> rows_j,
    ece_null_j (mean) and ece_null95_j (95th percentile). An ECE below ece_null95_j is calibration within the
    noise of that many rows; a bin-count floor, not a property of the head (few rows reach the late drafts).
    conf, correct, valid: [K',N] (calibrated probabilities; greedy correctness; draft exists)."""
    g, cond = torch.Generator().manual_seed(seed), conditional_rows(correct, valid)
    out: dict[str, float] = {}
    for j in range(conf.shape[0]):
        c = conf[j][cond[j]].double()
        out[f"rows_{j}"] = float(c.numel())
        if c.numel():
            draws = sorted(ece(c, torch.rand(c.shape, generator=g, dtype=torch.float64) < c) for _ in range(sims))
            out[f"ece_null_{j}"] = sum(draws) / sims
            out[f"ece_null95_{j}"] = draws[int(0.95 * (sims - 1))]
    return out


@torch.no_grad()
def collect_block_outputs(head, batches, target, layers, get_hidden=None):
    """Raw confidence logits, greedy correctness and existence of every draft at every start row of `batches`
    -> three [K',N] tensors (CPU)."""
    from specheads.train.steps import block_draft_outputs

    z, y, v = [], [], []
    head.eval()
    for batch in batches:
        batch = get_hidden(batch) if get_hidden is not None else batch
        steps, conf, targ = block_draft_outputs(head, batch, target, layers, head.config.feature_layers)
        if conf is None:
            raise ValueError("collect_block_outputs: the head has no confidence head")
        valid, top1, _ = step_correct(steps, targ, batch["loss_mask"], head.d2t, topk=1)
        start = valid[0]
        z.append(conf[:, start].cpu())
        y.append(top1[:, start].cpu())
        v.append(valid[:, start].cpu())
    return torch.cat(z, 1), torch.cat(y, 1), torch.cat(v, 1)


def _block_metrics(probs, y, v, thresholds) -> dict[str, float]:
    acc = BlockEvalAccumulator(probs.shape[0], thresholds)
    acc.add(y[:, None], v[:, None], torch.ones(1, probs.shape[1], dtype=torch.bool), probs[:, None])
    return acc.metrics()


def calibrate_head(head_dir, target, batches, layers, cfg: EvalConfig, get_hidden=None) -> dict:
    """Fit the confidence calibration of the block head in `head_dir` on `batches` (held-out rows): Platt scaling
    per position (`fit_platt`), stored in its folder (the `conf_temperature` and `conf_bias` buffers of
    model.safetensors, written atomically). The figures returned are honest: fitted on even rows, measured on odd
    rows before, with the sequential temperatures alone (`fit_sequential_temperatures`) and with Platt scaling;
    the stored calibration is then fitted on all rows."""
    from specheads.heads.base import load_head

    head = load_head(head_dir, target, dtype=torch.float32)
    z, y, v = collect_block_outputs(head, batches, target, layers, get_hidden)
    even, odd = torch.arange(z.shape[1]) % 2 == 0, torch.arange(z.shape[1]) % 2 == 1
    t_seq = fit_sequential_temperatures(z[:, even], y[:, even], v[:, even])
    t_even, b_even = fit_platt(z[:, even], y[:, even], v[:, even])
    zo, yo, vo, thr = z[:, odd], y[:, odd], v[:, odd], cfg.conf_threshold
    after = calibrated_probs(zo, t_even, b_even)
    report = {"rows": int(z.shape[1]), "method": "platt", "fit_even_temperatures": t_even.tolist(),
              "fit_even_biases": b_even.tolist(), "fit_even_sequential_temperatures": t_seq.tolist(),
              "odd_before": _block_metrics(torch.sigmoid(zo), yo, vo, thr),
              "odd_after_temperature": _block_metrics(calibrated_probs(zo, t_seq), yo, vo, thr),
              "odd_after": _block_metrics(after, yo, vo, thr), "odd_after_null": null_ece(after, yo, vo)}
    temps, bias = fit_platt(z, y, v)
    head.conf_temperature.copy_(temps.to(head.conf_temperature.device))
    head.conf_bias.copy_(bias.to(head.conf_bias.device))
    head.save_pretrained(head_dir)
    report["temperatures"], report["biases"] = temps.tolist(), bias.tolist()
    return report


def split_batches(ds, batch_size: int, collate_fn, target, layers, extract_fn=None, indices=None):
    """Batches of a held-out split (or its samples `indices`) on the target's device, with `hidden` extracted
    online when the split holds no features (extract_fn)."""
    if indices is not None:
        ds = torch.utils.data.Subset(ds, indices)
    for b in torch.utils.data.DataLoader(ds, batch_size=batch_size, collate_fn=collate_fn):
        b = {k: (t.to(target.device) if isinstance(t, torch.Tensor) else t) for k, t in b.items()}
        if "hidden" not in b and extract_fn is not None:
            b["hidden"] = extract_fn(target, b["input_ids"], b["attention_mask"], layers)
        yield b


def calibrate_run(recipe, target, val_ds, collate_fn, layers, extract_fn=None) -> dict | None:
    """After training a block head with a confidence head: calibrate `best/` and `final/` on the held-out split
    (every held-out sample) and write <output_dir>/calibration.json. Main process only (no collectives)."""
    from specheads.heads.base import load_head
    from specheads.utils import atomic_write_json

    if recipe.head.kind != "dspark" or not recipe.head.confidence_head or int(os.environ.get("RANK", "0")) != 0:
        return None
    if val_ds is None or len(val_ds) == 0:
        log.warning("calibration: no held-out samples; the confidences stay uncalibrated")
        return None

    def batches():
        return split_batches(val_ds, recipe.eval.batch_size, collate_fn, target, layers, extract_fn)

    out, root = {}, Path(recipe.output_dir)
    same = all((root / n / "model.safetensors").exists() for n in ("best", "final")) and \
        (root / "best" / "model.safetensors").read_bytes() == (root / "final" / "model.safetensors").read_bytes()
    for name in ("best", "final"):
        d = root / name
        if name == "final" and same:  # the best head is the final one: the same temperatures, one pass less
            head = load_head(d, target, dtype=torch.float32)
            head.conf_temperature.copy_(torch.tensor(out["best"]["temperatures"]))
            head.conf_bias.copy_(torch.tensor(out["best"]["biases"]))
            head.save_pretrained(d)
            out[name] = out["best"]
        elif (d / "config.json").exists():
            out[name] = calibrate_head(d, target, batches(), layers, recipe.eval)
            after = out[name]["odd_after"]
            log.info("calibrated %s: temperatures %s, biases %s; held-out ECE max %.3f -> %.3f", d,
                     json.dumps([round(t, 3) for t in out[name]["temperatures"]]),
                     json.dumps([round(b, 3) for b in out[name]["biases"]]),
                     out[name]["odd_before"].get("ece_max", float("nan")), after.get("ece_max", float("nan")))
    atomic_write_json(Path(recipe.output_dir) / "calibration.json", out)
    return out


@torch.no_grad()
def evaluate(kind: str, head, batches, target, layers, head_layers, cfg: EvalConfig, reduce=None,
             get_hidden=None) -> dict[str, float]:
    """Run the head over `batches` (an iterable of collated dicts) and return the metrics.

    reduce: callable summing a tensor over processes (accelerator.reduce(..., "sum")); get_hidden: callable
    batch -> batch with `hidden` filled (online features); both optional.
    """
    from specheads.train.steps import block_draft_outputs, draft_step_logits

    was_training = head.training
    head.eval()
    acc = blk = None
    try:
        for batch in batches:
            if get_hidden is not None:
                batch = get_hidden(batch)
            conf = None
            if kind == "dspark":  # per-draft logits and the confidence logits of the same blocks
                steps, conf, targ = block_draft_outputs(head, batch, target, layers, head_layers)
                d2t = getattr(getattr(head, "module", head), "d2t", None)
            else:
                steps, d2t, targ = draft_step_logits(kind, head, batch, target, layers, head_layers,
                                                     eagle_steps=cfg.eagle_steps)
            if acc is None:
                acc = EvalAccumulator(len(steps))
            acc.add(steps, targ, batch["loss_mask"], d2t, cfg)
            if conf is not None:
                blk = blk or BlockEvalAccumulator(len(steps), cfg.conf_threshold)
                valid, top1, _ = step_correct(steps, targ, batch["loss_mask"], d2t, topk=1)
                calibrated = getattr(head, "module", head).calibrated  # positions last: [K',B,T] -> [B,T,K']
                blk.add(top1, valid, valid[0], calibrated(conf.movedim(0, -1)).movedim(-1, 0))
    finally:
        head.train(was_training)
    if acc is None:
        return {}
    if reduce is not None:
        acc.sums = reduce(acc.sums.to(torch.float64)).cpu()
        if blk is not None:
            blk.sums = reduce(blk.sums.to(torch.float64)).cpu()
    return {**acc.metrics(cfg), **(blk.metrics() if blk is not None else {})}

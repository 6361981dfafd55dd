"""Confidence calibration of a trained block head (DSpark): per-position Platt scaling of the confidence logits,
fitted on the held-out split and stored in the head folder (`conf_temperature`, `conf_bias`), with an honest
report (fitted on even rows, measured on odd rows) in <output_dir>/calibration.json.
Shapes: K' drafts per block, N start rows.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from specheads.heads.base import load_head
from specheads.heads.kinds import kind_spec
from specheads.train.confidence import BlockEvalAccumulator, calibrated_probs, conditional_rows, ece
from specheads.train.dataset import split_batches
from specheads.train.kinds.block import block_draft_outputs
from specheads.train.losses import step_correct
from specheads.utils import atomic_write_json

log = logging.getLogger("specheads.train.evaluate")  # evaluation and calibration lines under one name


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


def calibrate_head(head_dir, target, batches, layers, cfg, get_hidden=None) -> dict:
    """Fit the confidence calibration of the block head in `head_dir` on `batches` (held-out rows): Platt scaling
    per position (`fit_platt`), stored in its folder (the `conf_temperature` and `conf_bias` buffers of
    model.safetensors, written atomically). The figures returned are honest: fitted on even rows, measured on odd
    rows before, with the sequential temperatures alone (`fit_sequential_temperatures`) and with Platt scaling;
    the stored calibration is then fitted on all rows. cfg: the recipe's eval: section (its conf_threshold)."""
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


def has_confidence_head(spec) -> bool:
    """The head (a HeadSpec) carries a confidence head: its kind has one (KindSpec.confidence) and it is on."""
    return kind_spec(spec.kind).confidence and spec.options.confidence_head


def calibrate_run(recipe, target, val_ds, collate_fn, layers, extract_fn=None) -> dict | None:
    """After training a block head with a confidence head: calibrate `best/` and `final/` on the held-out split
    (every held-out sample) and write <output_dir>/calibration.json. Main process only (no collectives)."""
    if not has_confidence_head(recipe.head) or int(os.environ.get("RANK", "0")) != 0:
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

"""Block heads' (DSpark / DFlash) confidence metrics, per draft position j over start rows whose drafts < j were
all accepted (i.e. the top-1 of each equals the target's greedy token): greedy acceptance `accept_j`, mean
calibrated confidence `conf_j`, its ECE / AUROC / Brier score against that acceptance (`ece_j`, `auroc_j`,
`brier_j`), the ECE of the survival probability prod_{i<=j} c_i against "drafts <= j all accepted" over every
start row (`surv_ece_j`, what DeepSpec's evaluator reports), and for each `conf_threshold` the τ of the block cut
where that survival falls below the threshold (`tau_cut{thr}`, with `len_cut{thr}` drafts verified on average);
`tau_chain` (evaluate.py) is the full block's.
Shapes: K' drafts per block, N start rows, B batch, T sequence.
"""
from __future__ import annotations

import torch


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


def ece(p: torch.Tensor, y: torch.Tensor, bins: int = BlockEvalAccumulator.BINS) -> float:
    """Expected calibration error of probabilities p against outcomes y [M] (BlockEvalAccumulator's binning)."""
    idx = (p * bins).long().clamp(0, bins - 1)
    n = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, torch.ones_like(p, dtype=torch.float64))
    sp = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, p.double())
    sy = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, y.double())
    return float((sp - sy).abs().sum() / max(1.0, float(n.sum())))

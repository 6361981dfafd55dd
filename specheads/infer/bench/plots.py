"""The bench's PNG plots: a single run's speedup and τ per category and its acceptance-length histogram
(speedup_tau.png, accept_hist.png); the batched sweep's speedup and tokens/s per batch size (speedup_batch.png)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from specheads.infer.bench.report import fmt


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend (imported when a plot is drawn: the bench runs without a
    display, and a failing import only loses the plots)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _suptitle(results: dict[str, Any]) -> str:
    s = results["settings"]
    return (f"{s['target']} · {s['dataset']} · {s['dtype']} · T={s['temperature']} · {results['num_prompts']} "
            f"prompts · {s['max_new_tokens']} new tokens")


def write_plots(results: dict[str, Any], out_dir: str | Path) -> list[str]:
    import numpy as np

    plt = _pyplot()
    out_dir = Path(out_dir)
    written = []
    names = list(results["methods"])
    cats = results["categories"] + (["overall"] if len(results["categories"]) > 1 else [])
    if not cats:
        return written

    def fig_value(name: str, cat: str, key: str):
        m = results["methods"][name]
        f = m["overall"] if cat == "overall" or len(results["categories"]) == 1 else m["categories"][cat]
        return f[key]

    shown = [n for n in names if n != "vanilla"] or names  # vanilla is the dashed line at 1.0
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 0.9 * len(cats) + 3), 7.5), sharex=True)
    width = 0.8 / max(1, len(shown))
    x = np.arange(len(cats))
    for ax, key, title in ((axes[0], "speedup", "Speedup vs vanilla (ratio of tokens/s)"),
                           (axes[1], "tau", "τ: tokens per target forward (accepted + bonus)")):
        for j, n in enumerate(shown):
            vals = [fig_value(n, c, key) for c in cats]
            ys = [v if v is not None else 0 for v in vals]
            bars = ax.bar(x + (j - (len(shown) - 1) / 2) * width, ys, width, label=n)
            for b_, v in zip(bars, vals):
                ax.text(b_.get_x() + b_.get_width() / 2, (v or 0) + 0.01, "n/a" if v is None else f"{v:.2f}",
                        ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="grey", lw=1, ls="--", label="vanilla = 1.00")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.set_ylim(0, max([1.15] + [1.15 * (fig_value(n, c, key) or 0) for n in shown for c in cats]))
    axes[1].set_xticks(x)
    axes[1].set_xticklabels(cats, rotation=30, ha="right")
    axes[0].legend(fontsize=8, loc="upper left", ncol=len(shown) + 1)
    fig.suptitle(_suptitle(results), fontsize=10)
    fig.tight_layout()
    p = out_dir / "speedup_tau.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    written.append(p.name)

    hists = {n: results["methods"][n]["overall"]["accept_hist"] for n in names}
    hists = {n: h for n, h in hists.items() if h and (n != "vanilla" or len(hists) == 1)}
    if hists:
        kmax = max(int(k) for h in hists.values() for k in h)
        ks = np.arange(1, kmax + 1)
        fig, ax = plt.subplots(figsize=(max(6, 0.5 * kmax + 3), 3.8))
        width = 0.8 / len(hists)
        for j, (n, h) in enumerate(hists.items()):
            tot = sum(h.values())
            ys = [h.get(str(k), 0) / tot for k in ks]
            tau = results["methods"][n]["overall"]["tau"]
            bars = ax.bar(ks + (j - (len(hists) - 1) / 2) * width, ys, width, label=f"{n} (τ={fmt(tau)})")
            for b_, k in zip(bars, ks):  # counts on top: small shares stay readable
                if h.get(str(k)):
                    ax.text(b_.get_x() + b_.get_width() / 2, b_.get_height() + 0.005, str(h[str(k)]),
                            ha="center", va="bottom", fontsize=6)
        ax.set_xticks(ks)
        ax.set_xlabel("tokens emitted per target forward (accepted + bonus)")
        ax.set_ylabel("share of target forwards")
        ax.set_title("Acceptance-length histogram")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        p = out_dir / "accept_hist.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        written.append(p.name)
    return written


def write_batch_plot(results: dict[str, Any], out_dir: Path) -> list[str]:
    plt = _pyplot()
    per_b = results["batch_sizes"]
    sizes = [int(b) for b in per_b]
    if not sizes:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, n in enumerate(results["methods"]):  # one colour per method in both panels; vanilla grey
        color = "grey" if n == "vanilla" else f"C{i % 10}"
        axes[1].plot(sizes, [per_b[str(b)][n]["tokens_per_s"] or 0 for b in sizes], marker="o", color=color,
                     ls="--" if n == "vanilla" else "-", label=n)
        if n != "vanilla":
            axes[0].plot(sizes, [per_b[str(b)][n]["speedup"] or 0 for b in sizes], marker="o", color=color, label=n)
    axes[0].axhline(1.0, color="grey", lw=1, ls="--", label="vanilla = 1.00")
    for ax, title in ((axes[0], "Speedup vs vanilla (same batch size)"), (axes[1], "Tokens/s, all rows")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("batch size (rows)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.suptitle(_suptitle(results), fontsize=10)
    fig.tight_layout()
    fig.savefig(out_dir / "speedup_batch.png", dpi=120)
    plt.close(fig)
    return ["speedup_batch.png"]

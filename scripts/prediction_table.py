"""The prediction table (docs/results/serving-eval/prediction.md): for each head, the τ its training run predicted
at the step it kept as best/ (train_summary.json's history: the held-out split's and the serving-true dev set's
serving walk) beside the τ `specheads bench` measured for that head (results.json), and whether the dev prediction
lands within 5% of the measurement.

    python scripts/prediction_table.py --out docs/results/serving-eval/prediction \
        --row "demo EAGLE-3, chain:3" runs/demo runs/bench-demo-chain3-80/results.json head:eagle3 tau_chain_walk

Each --row: LABEL RUN BENCH_RESULTS METHOD METRIC (METRIC: the walk that matches the served tree: tau_chain_walk for
a chain or a fixed block, tau_tree_walk for a full tree; the held-out figure is METRIC, the dev one dev_METRIC).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TOLERANCE = 0.05  # the bar: the prediction holds within 5% of the measured τ


def row(label: str, run: str, bench: str, method: str, metric: str) -> dict:
    summary = json.loads((Path(run) / "train_summary.json").read_text())
    best = next(h for h in summary["history"] if h["step"] == summary["best_step"])
    res = json.loads(Path(bench).read_text())
    served = res["methods"][method]["overall"]
    tree = res.get("trees", {}).get(method, {}).get("summary") or res.get("tree")
    dev = best.get(f"dev_{metric}")
    out = {"label": label, "run": run, "best_step": summary["best_step"], "metric": metric,
           "held_out": best.get(metric), "held_out_se": best.get(f"{metric}_se"),
           "held_out_per_position": best.get(metric.replace("_walk", "")),
           "dev": dev, "dev_se": best.get(f"dev_{metric}_se"), "served_tau": served["tau"],
           "served_turns": served["turns"], "bench": bench, "bench_command": res.get("command"), "tree": tree}
    out["dev_error"] = None if dev is None else dev / served["tau"] - 1
    out["holds"] = out["dev_error"] is not None and abs(out["dev_error"]) <= TOLERANCE
    return out


def fmt(x, nd=3):
    return "-" if x is None else f"{x:.{nd}f}"


def _se(v) -> str:
    return "" if v is None else f" ± {v:.3f}"


def markdown(rows: list[dict]) -> str:
    lines = ["| head | best step | held-out τ (per position) | held-out walk τ | dev walk τ | served τ (MT-bench) "
             "| dev error | within 5% |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        err = "-" if r["dev_error"] is None else f"{100 * r['dev_error']:+.1f}%"
        lines.append(f"| {r['label']} | {r['best_step']} | {fmt(r['held_out_per_position'])} | "
                     f"{fmt(r['held_out'])}{_se(r['held_out_se'])} | {fmt(r['dev'])}{_se(r['dev_se'])} | "
                     f"{fmt(r['served_tau'])} ({r['served_turns']} turns) | {err} | {'yes' if r['holds'] else 'no'} |")
    lines += ["", "Bench commands:"] + [f"- {r['label']}: `{r['bench_command']}`" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--row", nargs=5, action="append", required=True,
                   metavar=("LABEL", "RUN", "BENCH_RESULTS", "METHOD", "METRIC"))
    p.add_argument("--out", required=True, help="path stem: writes STEM.json and STEM.md")
    a = p.parse_args(argv)
    rows = [row(*r) for r in a.row]
    md = markdown(rows)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{a.out}.json").write_text(json.dumps({"tolerance": TOLERANCE, "rows": rows}, indent=1) + "\n")
    Path(f"{a.out}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

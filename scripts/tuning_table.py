#!/usr/bin/env python3
"""The recipe-tuning table (docs/results/serving-tuning): one row per training run, the figures of the step each run
kept as best/ on the held-out split and on the serving-true dev set (serving walk τ with its standard error), with
the run's data and training cost, so recipe levers are compared on what serving will see.

    python scripts/tuning_table.py --out docs/results/serving-tuning/tuning \
        --row "greedy answers, 2 epochs" runs/t31-greedy --row "sampled answers" runs/t31-sampled

Reads `<run>/train_summary.json`, `<run>/train_config.yaml` and the prepare summary of the run whose features it
read (`<run>/prepare_summary.json`, else the features folder's run). Writes OUT.json and OUT.md. The held-out
figures of runs on different data (greedy vs sampled answers) score different answers; the dev set is the same
32 prompts and answers for every row, the column to compare.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

FIGURES = ("top1_0", "tau_chain_walk", "tau_tree_walk")  # per split: first-draft top-1 and both serving walks


def _prepare_summary(run: Path, train_cfg: dict) -> dict:
    own = run / "prepare_summary.json"
    feats = (train_cfg.get("features") or {}).get("dir")
    for p in [own] + ([Path(feats).parent / "prepare_summary.json"] if feats else []):
        if p.exists():
            return json.loads(p.read_text())
    return {}


def row(label: str, run: str) -> dict:
    run_p = Path(run)
    summary = json.loads((run_p / "train_summary.json").read_text())
    cfg_p = run_p / "train_config.yaml"
    cfg = yaml.safe_load(cfg_p.read_text()) if cfg_p.exists() else {}
    best = next(h for h in summary["history"] if h["step"] == summary["best_step"])
    prep = _prepare_summary(run_p, cfg)
    data = cfg.get("data") or {}
    out = {"label": label, "run": run, "kind": summary.get("kind"), "best_step": summary["best_step"],
           "steps": summary.get("steps"), "epochs": summary.get("epochs"),
           "train_seconds": summary.get("train_seconds"), "samples": prep.get("samples"),
           "regen_temperature": data.get("regen_temperature"), "eval_samples": best.get("eval_samples"),
           "dev_samples": best.get("dev_eval_samples")}
    for split, pre in (("held_out", ""), ("dev", "dev_")):
        for f in FIGURES:
            out[f"{split}_{f}"] = best.get(f"{pre}{f}")
            out[f"{split}_{f}_se"] = best.get(f"{pre}{f}_se")
    return out


def _fmt(v, se=None, nd=3) -> str:
    if v is None:
        return "-"
    return f"{v:.{nd}f}" + (f" ± {se:.{nd}f}" if se is not None else "")


def markdown(rows: list[dict]) -> str:
    lines = ["| run | kind | samples | answers | steps (epochs) | train s | held-out top-1 | held-out walk τ chain / "
             "tree | dev top-1 | dev walk τ chain | dev walk τ tree |",
             "|---|---|---:|---|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        temp = r["regen_temperature"]
        answers = "-" if temp is None else ("greedy" if temp == 0 else f"sampled T={temp}")
        lines.append(
            f"| {r['label']} | {r['kind']} | {r['samples'] or '-'} | {answers} | {r['best_step']} of {r['steps']} "
            f"({r['epochs']}) | {r['train_seconds'] or '-'} | {_fmt(r['held_out_top1_0'])} | "
            f"{_fmt(r['held_out_tau_chain_walk'])} / {_fmt(r['held_out_tau_tree_walk'])} | {_fmt(r['dev_top1_0'])} | "
            f"{_fmt(r['dev_tau_chain_walk'], r['dev_tau_chain_walk_se'])} | "
            f"{_fmt(r['dev_tau_tree_walk'], r['dev_tau_tree_walk_se'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", nargs=2, action="append", required=True, metavar=("LABEL", "RUN"))
    ap.add_argument("--out", required=True, help="OUT.json and OUT.md are written")
    args = ap.parse_args(argv)
    rows = [row(label, run) for label, run in args.row]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"command": " ".join(["python", "scripts/tuning_table.py"] +
                                                                    (argv if argv is not None else sys.argv[1:])),
                                                    "rows": rows}, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Heads trained on the same data and held-out split, side by side: training wall time, held-out simulated τ (chain
and width-2 tree), top-1 per draft position, and for block drafters with a confidence head the per-position
greedy acceptance of each draft given the previous ones were accepted, and the confidence's ECE against it before /
after calibration (held-out odd rows). One row per run folder.

    python scripts/head_compare.py runs/demo runs/demo-dspark runs/demo-dflash --out docs/results/dspark-demo

Reads `<run>/train_summary.json` (the evaluation at the best step) and `<run>/calibration.json` (written at the end
of a DSpark run: the confidences on the held-out split's odd rows, before and after the calibration fitted on the
even rows) and writes `heads.json` + `heads.md` into --out. Nothing is typed by hand.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

POSITIONS = 4  # draft positions shown
ECE_BAR = 0.05  # issue 19: confidence ECE at most this at every draft after calibration


def _load(p: Path) -> dict:
    return json.loads(p.read_text()) if p.exists() else {}


def row(run: Path) -> dict:
    train, calib = _load(run / "train_summary.json"), _load(run / "calibration.json").get("best", {})
    if not train:
        raise SystemExit(f"{run}: no train_summary.json (train the recipe first)")
    hist = train.get("history") or [{}]
    best = next((h for h in hist if train.get("best_step") is not None and h.get("step") == train["best_step"]),
                hist[-1])
    cfg = _load(run / "best" / "config.json") or _load(run / "final" / "config.json")
    spec = cfg.get("spec", {})
    spec = {**spec, **(spec.get(spec.get("kind")) or {})}  # the kind's own section (a flat spec: as it is)
    before, after = calib.get("odd_before", {}), calib.get("odd_after", {})
    surv = [v for k, v in after.items() if k.startswith("surv_ece_")]
    null = calib.get("odd_after_null", {})
    over = [j for j in range(len(surv)) if after.get(f"ece_{j}", 0.0) > max(ECE_BAR, null.get(f"ece_null95_{j}", 0.0))]
    return {
        "run": str(run), "kind": train.get("kind"), "steps": train.get("steps"), "epochs": train.get("epochs"),
        "train_s": train.get("train_seconds"), "tokens_per_s": train.get("tokens_per_s"),
        "anchor_features": spec.get("anchor_features"), "markov_rank": spec.get("markov_rank"),
        "confidence_head": spec.get("confidence_head"), "best_step": train.get("best_step"),
        "tau_chain": best.get("tau_chain"), "tau_tree": best.get("tau_tree"),
        "top1": [best.get(f"top1_{j}") for j in range(POSITIONS)],
        "accept": [after.get(f"accept_{j}", before.get(f"accept_{j}")) for j in range(POSITIONS)],
        "ece_before": [before.get(f"ece_{j}") for j in range(POSITIONS)],
        "ece_after": [after.get(f"ece_{j}") for j in range(POSITIONS)],
        "ece_max_after": after.get("ece_max"), "surv_ece_max_after": max(surv) if surv else None,
        "ece_all_after": [after.get(f"ece_{j}") for j in range(len(surv))],
        "ece_null95_after": [null.get(f"ece_null95_{j}") for j in range(len(surv))] if null else None,
        "rows_after": [null.get(f"rows_{j}") for j in range(len(surv))] if null else None,
        "drafts_over_bar": over if null else None,
        "calibration": calib.get("method", "temperature" if calib else None), "loss": _loss(run, train.get("kind")),
        "tau_cut": {k: v for k, v in after.items() if k.startswith("tau_cut")},
        "calibration_rows": calib.get("rows"),
    }


def _loss(run: Path, kind: str | None) -> str | None:
    """train.loss of the run's train_config.yaml, or the kind's default (losses.DEFAULT_LOSS) when unset."""
    import yaml

    cfg = run / "train_config.yaml"
    train = (yaml.safe_load(cfg.read_text()) or {}).get("train", {}) if cfg.exists() else {}
    if train.get("loss") or kind is None:
        return train.get("loss")
    from specheads.train.losses import BLOCK_W_CE, BLOCK_W_L1, DEFAULT_LOSS

    if kind not in DEFAULT_LOSS:
        return None
    block = train.get("block") or {}  # train.block.w_ce / w_l1 (runs written before the sections: block_w_ce / ...)
    text = DEFAULT_LOSS[kind].format(w_ce=block.get("w_ce", train.get("block_w_ce", BLOCK_W_CE)),
                                     w_l1=block.get("w_l1", train.get("block_w_l1", BLOCK_W_L1)))
    return f"{text} (default)"


def _f(x, digits=3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _seq(xs, digits=2) -> str:
    return " / ".join(_f(x, digits) for x in xs) if any(x is not None for x in xs) else "-"


def markdown(rows: list[dict]) -> str:
    out = ["| run | kind | loss | steps | train s | τ chain | τ tree | top-1 per draft | accept. per draft (given the "
           "previous) | conf. ECE before -> after calibration | after: ECE max, survival ECE max (all drafts) |",
           "|---|---|---|---:|---:|---:|---:|---|---|---|---|"]
    for r in rows:
        variant = r["kind"] + (" (anchor features)" if r["anchor_features"] else "") + \
            (" = DFlash" if r["kind"] == "dspark" and not r["markov_rank"] and not r["confidence_head"] else "")
        ece = "-" if not any(r["ece_before"]) else f"{_seq(r['ece_before'], 3)} -> {_seq(r['ece_after'], 3)}"
        maxes = "-" if r["ece_max_after"] is None else \
            f"{_f(r['ece_max_after'])}, {_f(r['surv_ece_max_after'])} ({r['calibration']})"
        if r["drafts_over_bar"] is not None:
            maxes += f"; over {ECE_BAR:g} beyond noise: " + (", ".join(f"draft {j}" for j in r["drafts_over_bar"]) or "none")
        out.append(f"| {r['run']} | {variant} | {r['loss'] or '-'} | {r['steps']} | {_f(r['train_s'], 0)} | "
                   f"{_f(r['tau_chain'])} | {_f(r['tau_tree'])} | {_seq(r['top1'])} | {_seq(r['accept'])} | {ece} | "
                   f"{maxes} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    rows = [row(r) for r in a.runs]
    a.out.mkdir(parents=True, exist_ok=True)
    cmd = "python scripts/head_compare.py " + " ".join(map(str, a.runs)) + f" --out {a.out}"
    (a.out / "heads.json").write_text(json.dumps({"command": cmd, "rows": rows}, indent=2) + "\n")
    md = f"Produced by `{cmd}`.\n\n" + markdown(rows)
    (a.out / "heads.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

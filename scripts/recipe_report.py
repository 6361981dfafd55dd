#!/usr/bin/env python3
"""What each recipe run cost and gave: data size, wall time per stage, final simulated τ. One row per run folder.

    python scripts/recipe_report.py runs/eagle3-smollm2 runs/medusa-smollm2 [--out docs/results/recipes] [--page]

Reads `<run>/prepare_summary.json` (written by `specheads prepare`) and `<run>/train_summary.json` (written by
`specheads train` when it finishes) and writes `recipes.json` + `recipes.md` into --out; with --page it also
replaces the results page's block (docs/results/README.md) between `<!-- results:recipes:start -->` and
`<!-- results:recipes:end -->`. Nothing is typed by hand: every figure comes from those two files. --keep keeps the
rows of the existing `<out>/recipes.json` whose runs are not named (runs measured earlier, whose folders this
machine no longer has); a named run replaces its row in place or is appended; with --keep and no runs named the
table is rendered again from `<out>/recipes.json`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _load(p: Path) -> dict:
    return json.loads(p.read_text()) if p.exists() else {}


def row(run: Path) -> dict:
    prep, train = _load(run / "prepare_summary.json"), _load(run / "train_summary.json")
    if not prep and not train:
        raise SystemExit(f"{run}: no prepare_summary.json or train_summary.json (run the recipe first)")
    shared = prep.get("features_dir")
    if shared:  # features.dir: data and extraction belong to another run
        prep = {**_load(Path(shared).parent / "prepare_summary.json"), "features_dir": shared}
    hist = train.get("history") or []
    first, last = (hist[0], hist[-1]) if hist else ({}, {})
    t = prep.get("timings", {})
    return {
        "run": str(run), "kind": train.get("kind"), "features_from": shared,
        "conversations": prep.get("conversations_kept"), "samples": prep.get("samples"), "tokens": prep.get("tokens"),
        "masked_tokens": prep.get("masked_tokens"), "regenerated_tokens": prep.get("regenerated_new_tokens"),
        "regenerate_s": t.get("regenerate_s"), "features_s": t.get("features_s"),
        "prepare_s": None if shared else t.get("total_s"),
        "train_steps": train.get("steps"), "train_s": train.get("train_seconds"), "eval_s": train.get("eval_seconds"),
        "train_tokens_per_s": train.get("tokens_per_s"),
        "tau_tree_start": first.get("tau_tree"), "tau_tree_end": last.get("tau_tree"),
        "tau_chain_start": first.get("tau_chain"), "tau_chain_end": last.get("tau_chain"),
        "top1_0_end": last.get("top1_0"), "best_metric": train.get("best_metric"), "best_step": train.get("best_step"),
    }


def _f(v, fmt="{:,.0f}"):
    return "n/a" if v is None else fmt.format(v)


def markdown(rows: list[dict]) -> str:
    lines = ["| run | head | samples | tokens (assistant) | prepare | train | train tok/s | depth-1 top-1 | "
             "simulated τ chain | simulated τ tree |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        prep = "shared" if r["features_from"] else _f(r["prepare_s"] and r["prepare_s"] / 60, "{:.0f} min")
        lines.append(
            f"| `{r['run']}` | {r['kind']} | {_f(r['samples'])} | {_f(r['tokens'])} ({_f(r['masked_tokens'])}) | "
            f"{prep} | {_f(r['train_s'] and r['train_s'] / 60, '{:.0f} min')} ({_f(r['train_steps'])} steps) | "
            f"{_f(r['train_tokens_per_s'])} | {_f(r['top1_0_end'], '{:.3f}')} | "
            f"{_f(r['tau_chain_start'], '{:.2f}')} -> {_f(r['tau_chain_end'], '{:.2f}')} | "
            f"{_f(r['tau_tree_start'], '{:.2f}')} -> {_f(r['tau_tree_end'], '{:.2f}')} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="*", type=Path)
    ap.add_argument("--out", type=Path, default=Path("docs/results/recipes"))
    ap.add_argument("--page", action="store_true", help="also replace the results page's results:recipes block")
    ap.add_argument("--keep", action="store_true", help="keep the other rows of <out>/recipes.json")
    a = ap.parse_args(argv)
    if not a.runs and not a.keep:
        ap.error("name the run folders (or --keep to render the rows of <out>/recipes.json again)")
    rows = [row(r) for r in a.runs]
    if a.keep and (a.out / "recipes.json").exists():
        new = {r["run"]: r for r in rows}
        old = json.loads((a.out / "recipes.json").read_text())
        rows = [new.pop(r["run"], r) for r in old] + list(new.values())
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "recipes.json").write_text(json.dumps(rows, indent=2) + "\n")
    md = markdown(rows)
    (a.out / "recipes.md").write_text(md + "\n")
    print(md)
    if a.page:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from update_readme_results import replace_block

        cmd = " ".join(["python scripts/recipe_report.py", *(str(r) for r in a.runs), f"--out {a.out} --page"]
                       + (["--keep"] if a.keep else []))
        kept = (f"; the rows of runs not named are kept from {a.out / 'recipes.json'}, where earlier runs of this "
                f"command put them" if a.keep else "")
        body = (f"\nProduced by `{cmd}` from each run's prepare_summary.json and train_summary.json (simulated τ on "
                f"the held-out split, at the first and last evaluation){kept}.\n\n{md}\n")
        if not replace_block("recipes", body):
            return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

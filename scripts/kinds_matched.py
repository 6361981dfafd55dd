#!/usr/bin/env python3
"""Every head kind on the same features for the same wall time, then served side by side in one bench run
(issue 30's table, docs/training.md "Every kind at matched wall time"; issue 41's at serving length, each block
kind as a chain and as a tree).

    specheads prepare --config configs/prepare-kinds-smollm2.yaml
    python scripts/kinds_matched.py --budget-s 180 --max-new-tokens 64 --out docs/results/kinds-matched
    python scripts/kinds_matched.py --budget-s 180 --block-trees --out docs/results/kinds-matched-256   # issue 41

Stages, each skipped when its output exists (a rerun resumes where it stopped):
1. timing: each kind's recipe trains --timing-steps optimizer steps on the shared features (a throwaway run);
   seconds per step = its train_seconds / steps (evaluation excluded, as train_summary.json counts it).
2. training: each kind's recipe with train.max_steps = budget / (seconds per step), so every kind trains for about
   --budget-s seconds with its own recipe (lr, precision, warm-up, loss) and a complete LR schedule; held-out and
   serving-true dev evaluation at the end (the dev set's answers made once and shared by every run).
3. one `specheads bench` of vanilla and every head on the same MT-bench first turns (methods rotated per prompt).
4. the table: OUT/kinds.json and OUT/kinds.md, the bench beside it as OUT/bench.json and OUT/bench.md. Draft cost in target-forward units = the head's draft seconds
   per step / vanilla's seconds per new token, both from that one bench run.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tuning_table import row as train_row  # noqa: E402  (scripts/tuning_table.py)

# label, recipe, extra overrides, --tree for the bench (EAGLE-3's measured best CPU tree; a block of 7 = the
# block recipes' block_size)
KINDS = [
    ("eagle3", "configs/eagle3-smollm2.yaml", [], "2,2,6"),
    ("eagle31", "configs/eagle31-smollm2.yaml", [], "2,2,6"),
    ("dspark", "configs/dspark-smollm2.yaml", [], "7"),
    ("dspark-dpace", "configs/dspark-smollm2.yaml", ["train.block.weighting=dpace"], "7"),
    ("dflash", "configs/dflash-smollm2.yaml", [], "7"),
    ("domino", "configs/domino-smollm2.yaml", [], "7"),
    ("peagle", "configs/peagle-smollm2.yaml", [], "7"),
    ("peagle-dpace", "configs/peagle-smollm2.yaml", ["train.block.weighting=dpace"], "7"),
    ("dflash2", "configs/dflash2-smollm2.yaml", [], "7"),
    ("dspine", "configs/dspine-smollm2.yaml", [], "7"),
    ("lilicorr", "configs/lilicorr-smollm2.yaml", [], "7"),
]
TREE = "-tree"  # label suffix of a block kind served as a tree over its block (--block-trees: --tree tree:auto)
TOLERANCE = 0.05  # issue 41's bar: a training-time dev walk predicts the served τ within 5%


def served(kinds: list[tuple], block_trees: bool, fixed_tree: int = 0) -> list[tuple[str, str, str]]:
    """(bench label, trained run label, --tree) per served method: every kind with its chain or tree; with
    block_trees each block kind (a block size for --tree) again as the scheduled tree over its block, and with
    fixed_tree N as the best-first tree of N nodes over its block (the shape its dev block-tree walk scores)."""
    out = [(k[0], k[0], k[3]) for k in kinds]
    blocks = [k for k in kinds if k[3] and k[3].isdigit()]
    if block_trees:
        out += [(k[0] + TREE, k[0], "tree:auto") for k in blocks]
    if fixed_tree:
        out += [(f"{k[0]}{TREE}{fixed_tree}", k[0], f"tree:{fixed_tree}") for k in blocks]
    return out


def predicted(run: Path, tree: str) -> tuple[str | None, float | None]:
    """The training-time dev walk that scores the served shape, at the step kept as best/: a fixed block (a block
    size) -> dev_tau_chain_walk, `tree:N` -> dev_tau_blocktree_walk (train/blocktree_eval.py, N =
    eval.block_tree_nodes, 16 by default); a scheduled or EAGLE tree has no fixed walk -> (None, None)."""
    if tree.isdigit():
        metric = "dev_tau_chain_walk"
    elif tree.startswith("tree:") and tree[5:].isdigit():
        metric = "dev_tau_blocktree_walk"
    else:
        return None, None
    summary = json.loads((run / "train_summary.json").read_text())
    best = next(h for h in summary["history"] if h["step"] == summary["best_step"])
    nodes = best.get("dev_blocktree_nodes", best.get("blocktree_nodes"))
    if metric.endswith("blocktree_walk") and nodes is not None and int(nodes) != int(tree[5:]):
        return None, None  # the run's walk scored another node budget
    return metric, best.get(metric)


def _common(args, out_dir: Path) -> list[str]:
    return [f"features.dir={args.features}", f"output_dir={out_dir}", "train.tracker=none", "train.save_every=0",
            "eval.every_steps=0", "eval.at_start=false"]  # train.max_steps (set below) overrides the epochs


def _train(args, recipe: str, overrides: list[str]) -> None:
    cmd = [args.specheads, "train", "--config", recipe, *overrides]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def seconds_per_step(args, label: str, recipe: str, extra: list[str]) -> float:
    if label in args.given_sps:  # a timing measured before (idle), reused so training may run beside other jobs
        return args.given_sps[label]
    out = Path(args.runs) / "_timing" / label
    if not (out / "train_summary.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        _train(args, recipe, _common(args, out) + extra + [f"train.max_steps={args.timing_steps}",
                                                           "eval.dev_prompts=0", "eval.max_samples=2",
                                                           "eval.select=tau_tree"])
    s = json.loads((out / "train_summary.json").read_text())
    return s["train_seconds"] / s["steps"]


def train_kind(args, label: str, recipe: str, extra: list[str], sps: float) -> Path:
    out = Path(args.runs) / label
    steps = max(1, round(args.budget_s / sps))
    if not (out / "train_summary.json").exists():
        shared = Path(args.runs) / "_dev" / "answers.json"  # the dev answers, made by the first run
        if shared.exists() and not (out / "dev" / "answers.json").exists():
            (out / "dev").mkdir(parents=True, exist_ok=True)
            shutil.copy(shared, out / "dev" / "answers.json")
        _train(args, recipe, _common(args, out) + extra + [
            f"train.max_steps={steps}", f"train.warmup_steps={max(1, steps // 20)}",
            f"eval.dev_prompts={args.dev_prompts}", f"eval.dev_max_new_tokens={args.dev_max_new_tokens}",
            "eval.select=dev_tau_tree_walk"])
        if not shared.exists() and (out / "dev" / "answers.json").exists():
            shared.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(out / "dev" / "answers.json", shared)
    return out


def bench(args, kinds: list[tuple]) -> dict:
    out = Path(args.runs) / "bench"
    if not (out / "results.json").exists():
        cmd = [args.specheads, "bench", "--target", "smollm2-135m", "--dataset", "mt-bench", "--limit",
               str(args.limit), "--max-new-tokens", str(args.max_new_tokens), "--dtype", "bf16", "--out", str(out),
               "--methods", ",".join(["vanilla"] + [f"head:{m[0]}" for m in served(kinds, args.block_trees,
                                                                                      args.fixed_tree)])]
        for label, run, tree in served(kinds, args.block_trees, args.fixed_tree):
            head = Path(args.runs) / run
            if label != run:  # bench keys trees by head folder: the tree variant reads the run through a link
                link = Path(args.runs) / label
                if not link.exists():
                    link.symlink_to(run, target_is_directory=True)
                head = link
            cmd += ["--head", f"{label}={head / 'best' if (head / 'best').exists() else head / 'final'}"]
            cmd += ["--tree", f"{label}={tree}"] if tree else []
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    return json.loads((out / "results.json").read_text())


def table_rows(args, kinds: list[tuple], sps: dict, res: dict) -> list[dict]:
    van = res["methods"]["vanilla"]["overall"]
    s_per_token = van["time_s"] / van["new_tokens"]
    rows = []
    recipes = {k[0]: k[1:3] for k in kinds}
    for label, run, tree in served(kinds, args.block_trees, args.fixed_tree):
        recipe, extra = recipes[run]
        r = {**train_row(run, str(Path(args.runs) / run)), "label": label}
        m = res["methods"][f"head:{label}"]
        o, br = m["overall"], m.get("step_breakdown", {})
        steps = o["target_forwards"]
        draft_s = (br.get("seconds") or {}).get("draft")
        r.update({"recipe": recipe, "overrides": extra, "tree": tree, "seconds_per_step": round(sps[run], 3),
                  "served_tau": o["tau"], "speedup": o["speedup"], "identical": o["identical"],
                  "draft_ms_per_step": None if draft_s is None else 1e3 * draft_s / steps,
                  "draft_cost_forwards": None if draft_s is None else draft_s / steps / s_per_token,
                  "timing": "given" if run in args.given_sps else "measured"})
        metric, pred = predicted(Path(args.runs) / run, tree)
        err = None if pred is None else pred / o["tau"] - 1
        r.update({"predicted_by": metric, "predicted_tau": pred, "prediction_error": err,
                  "prediction_holds": None if err is None else abs(err) <= TOLERANCE})
        rows.append(r)
    return rows


def _f(v, nd=3) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def markdown(args, rows: list[dict], res: dict) -> str:
    s = res.get("settings", {})
    timing = (f"timing runs of {args.timing_steps} steps set each kind's steps" if not args.given_sps else
              f"steps from timings measured before and given: {args.seconds_per_step}; train s is this run's wall time")
    lines = [f"Budget {args.budget_s:.0f} s of training per kind ({timing}); bench: {res.get('num_prompts')} MT-bench first turns, {s.get('max_new_tokens')} new "
             f"tokens, bf16, greedy, one run ({res.get('date')}).", "",
             "| kind | served as | steps | train s | held-out top-1 | held-out τ chain / tree | dev τ tree walk | "
             "draft cost (target forwards) | served τ | speedup | dev walk for this shape (error) |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        se = r.get("dev_tau_tree_walk_se")
        dev = _f(r["dev_tau_tree_walk"]) + (f" ± {se:.3f}" if se is not None else "")
        pred = "-" if r.get("predicted_tau") is None else (
            f"{r['predicted_tau']:.3f} ({100 * r['prediction_error']:+.1f}%{'' if r['prediction_holds'] else ', over 5%'})")
        lines.append(f"| {r['label']} | {r['tree']} | {r['steps']} | {r['train_seconds']} | "
                     f"{_f(r['held_out_top1_0'])} | {_f(r['held_out_tau_chain_walk'])} / "
                     f"{_f(r['held_out_tau_tree_walk'])} | {dev} | {_f(r['draft_cost_forwards'], 2)} | "
                     f"{r['served_tau']:.3f} | {r['speedup']:.2f}x | {pred} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=240.0, help="training seconds per kind")
    ap.add_argument("--timing-steps", type=int, default=12)
    ap.add_argument("--features", default="runs/kinds/features")
    ap.add_argument("--runs", default="runs/kinds")
    ap.add_argument("--kinds", default=None, help="comma-separated labels (default: every kind whose recipe exists)")
    ap.add_argument("--dev-prompts", type=int, default=16)
    ap.add_argument("--dev-max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=80, help="MT-bench first turns in the bench")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="new tokens per prompt (serving's length)")
    ap.add_argument("--block-trees", action="store_true",
                    help="also serve each block kind as the scheduled tree over its block (label-tree)")
    ap.add_argument("--fixed-tree", type=int, default=0, metavar="N",
                    help="also serve each block kind as the best-first tree of N nodes over its block (label-treeN), "
                         "the shape its dev block-tree walk scores (eval.block_tree_nodes, 16): the prediction rows")
    ap.add_argument("--seconds-per-step", default="", metavar="LABEL=S,...",
                    help="reuse timings measured before (idle) instead of timing runs, e.g. lilicorr=2.5; the "
                         "table marks them given")
    ap.add_argument("--train-only", action="store_true",
                    help="stop after training (a rerun without it benches: training may share the machine, the "
                         "bench may not)")
    ap.add_argument("--specheads", default="specheads")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    try:
        args.given_sps = {k: float(v) for k, v in (kv.split("=") for kv in args.seconds_per_step.split(",") if kv)}
    except ValueError:
        ap.error(f"--seconds-per-step: expected LABEL=SECONDS,..., got {args.seconds_per_step!r}")
    want = None if args.kinds is None else set(args.kinds.split(","))
    kinds = [k for k in KINDS if Path(k[1]).exists() and (want is None or k[0] in want)]
    sps = {k[0]: seconds_per_step(args, *k[:3]) for k in kinds}
    for k in kinds:
        train_kind(args, *k[:3], sps[k[0]])
    if args.train_only:
        return 0
    res = bench(args, kinds)
    rows = table_rows(args, kinds, sps, res)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = " ".join(["python", "scripts/kinds_matched.py"] + (argv if argv is not None else sys.argv[1:]))
    (out / "kinds.json").write_text(json.dumps({"command": cmd, "rows": rows}, indent=1) + "\n")
    (out / "kinds.md").write_text(f"# Every head kind at matched wall time\n\nCommand: `{cmd}`\n\n"
                                  + markdown(args, rows, res))
    bench_dir = Path(args.runs) / "bench"  # the bench run beside the table (its own tables and settings)
    for src, dst in (("results.json", "bench.json"), ("results.md", "bench.md")):
        if (bench_dir / src).exists():
            shutil.copy(bench_dir / src, out / dst)
    print(markdown(args, rows, res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

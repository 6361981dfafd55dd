"""FP8 against bf16 feature shards on the same data (issue 50): disk and the held-out / dev serving-walk τ of the
same head trained on each.

    python scripts/fp8_features_ab.py [--recipe configs/demo-eagle3-smollm2.yaml] [--runs runs/fp8-ab]
                                      [--out docs/results/fp8-features]

Runs `specheads prepare` and `specheads train` of the recipe twice, features.dtype=bfloat16 and =float8_e4m3fn
(everything else equal: data, seed, steps), then writes fp8_features.json and README.md (the table) into --out. τ does not
depend on other work on the machine; the timings in the table do (stated beside them).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

METRICS = ("tau_chain_walk", "tau_tree_walk", "dev_tau_chain_walk", "dev_tau_tree_walk", "top1_0")


def _run(argv: list[str]) -> float:
    t = time.perf_counter()
    print("+", " ".join(argv), flush=True)
    subprocess.run([sys.executable, "-m", "specheads", *argv], check=True)
    return time.perf_counter() - t


def arm(recipe: str, folder: Path, dtype: str, extra: list[str]) -> dict:
    over = [f"output_dir={folder}", f"features.dtype={dtype}", *extra]
    prep = _run(["prepare", "--no-progress", "--config", recipe, *over])
    resume = ["--resume"] if (folder / "checkpoints").exists() else []
    train = _run(["train", "--config", recipe, *over, *resume])
    manifest = json.loads((folder / "features" / "manifest.json").read_text())
    summary = json.loads((folder / "train_summary.json").read_text())
    last = summary["history"][-1]
    hidden = sum((folder / "features" / s["file"]).stat().st_size for s in manifest["shards"])
    return {"dtype": dtype, "shard_bytes": hidden, "tokens": manifest["num_tokens"], "steps": summary["steps"],
            "prepare_s": round(prep, 1), "train_s": round(train, 1), "best_step": summary["best_step"],
            **{m: last.get(m) for m in METRICS}}


def render(rows: list[dict], cmd: str) -> str:
    base = rows[0]
    lines = [f"Produced by `{cmd}` on {time.strftime('%Y-%m-%d')}.", "",
             "| features.dtype | shard bytes | disk vs bf16 | held-out chain walk τ | held-out tree walk τ | "
             "dev chain walk τ | dev tree walk τ | top-1 (depth 0) | steps |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['shard_bytes']:,} | {r['shard_bytes'] / base['shard_bytes']:.3f} | "
                     + " | ".join(f"{r[m]:.4f}" for m in METRICS) + f" | {r['steps']} |")
    lines += ["", "τ: the serving walk (a draft cycle starts after each accepted run) over the held-out split and the "
              "serving-true dev set, at the last evaluation. prepare / train seconds are in fp8_features.json (taken "
              "beside other work: not speed figures)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="configs/demo-eagle3-smollm2.yaml")
    ap.add_argument("--runs", default="runs/fp8-ab")
    ap.add_argument("--out", default="docs/results/fp8-features")
    ap.add_argument("overrides", nargs="*", help="dotted recipe overrides given to both arms (e.g. target.dtype=float32)")
    a = ap.parse_args(argv)
    rows = [arm(a.recipe, Path(a.runs) / d, d, a.overrides) for d in ("bfloat16", "float8_e4m3fn")]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = "python scripts/fp8_features_ab.py " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "fp8_features.json").write_text(json.dumps({"command": cmd.strip(), "rows": rows}, indent=2) + "\n")
    (out / "README.md").write_text("# FP8 feature shards against bf16, same data\n\n" + render(rows, cmd.strip()))
    print((out / "README.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env bash
# Issue 29's behaviour check: one fp32 bench on 16 MT-bench first turns with every drafter kind, and a batched
# B = 4 sweep, run with the code in $1 (a checkout), written to $2. Code that has `--pricing` runs with
# `--pricing profile` (the schedulers priced by the cached cost profile alone: scheduled methods repeat across runs);
# older code (the before-run) gets the same pricing grafted on by profile_pricing/sitecustomize.py.
set -euo pipefail
CODE=$1; OUT=$2
cd /tmp/before   # runs/ -> /work/main/runs
export PYTHONPATH=$CODE PATH=/work/main/.venv/bin:$PATH
PRICING=""
if grep -q -- '"--pricing"' "$CODE/specheads/commands/args.py" 2>/dev/null; then PRICING="--pricing profile"
else export PYTHONPATH=$(cd "$(dirname "$0")" && pwd)/profile_pricing:$CODE; fi
H="--head eagle3=runs/demo/final --head medusa=runs/bb-medusa/final --head eagle=runs/bb-eagle/final --head dspark=runs/bb-dspark/final --head dflash=runs/bb-dflash/final"
specheads bench --target smollm2-135m $H --dataset mt-bench --limit 16 --max-new-tokens 32 --dtype fp32 --tree chain:3 \
  --draft-model truncated:4 --warmup-tokens 8 $PRICING \
  --methods vanilla,prompt-lookup,plain,prompt-lookup-ours,recycling,draft-model,head:eagle3,head:medusa,head:eagle,head:dspark,head:dflash,head:eagle3+lookup,head:dspark+lookup,combo,lookup+recycling \
  --out $OUT/single
specheads bench --target smollm2-135m --head eagle3=runs/demo/final --head dspark=runs/bb-dspark/final --dataset mt-bench \
  --limit 16 --max-new-tokens 32 --dtype fp32 --tree chain:3 --batch-sizes 4 $PRICING \
  --methods vanilla,plain,prompt-lookup,head:eagle3,head:dspark,head:eagle3+sched,head:dspark+sched --out $OUT/batch

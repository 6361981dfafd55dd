#!/bin/bash
# Heads for issue 40's behaviour check: the demo recipe's features and quick heads (25-40 steps) of every kind both
# codes have, trained by the BEFORE code (12768e0, in a worktree at /work/wt-before with runs/ linked to the main
# checkout's), so both sides read the same head folders (old flat config.json: the after code reads them as such).
set -euo pipefail
cd /work/wt-before
export PYTHONPATH=/work/wt-before PATH=/work/main/.venv/bin:$PATH OMP_NUM_THREADS=2
export SPECHEADS_CACHE=$HOME/.cache/sh-b40c-before
mkdir -p /tmp/bh
specheads prepare --config configs/demo-eagle3-smollm2.yaml output_dir=runs/demo >/tmp/bh/demo-prep.log 2>&1
echo "features done $(date +%T)"
common="features.dir=runs/demo/features train.tracker=none train.save_every=0 eval.dev_prompts=0 eval.every_steps=100000 eval.at_start=false"
run() { name=$1; cfg=$2; shift 2
  specheads train --config $cfg output_dir=runs/bh-$name $common "$@" >/tmp/bh/train-$name.log 2>&1
  echo "$name done $(date +%T)"; }
run eagle3 configs/demo-eagle3-smollm2.yaml train.max_steps=40 eval.select=tau_tree
run dspark configs/demo-dspark-smollm2.yaml train.max_steps=40 eval.select=tau_chain
run medusa configs/medusa-smollm2.yaml train.max_steps=25 train.batch_size=2 eval.select=tau_tree train.mixed_precision=no
run eagle configs/eagle-smollm2.yaml train.max_steps=25 train.batch_size=2 eval.select=tau_tree train.mixed_precision=no
run dflash configs/dflash-smollm2.yaml train.max_steps=25 train.batch_size=2 eval.select=tau_chain train.mixed_precision=no
run peagle configs/peagle-smollm2.yaml train.max_steps=25 train.batch_size=2 eval.select=tau_chain train.mixed_precision=no
run domino configs/domino-smollm2.yaml train.max_steps=25 train.batch_size=2 eval.select=tau_chain train.mixed_precision=no

#!/usr/bin/env bash
# The demo recipe's EAGLE-3 head and quick heads of every other kind on its features, trained with the code at
# /tmp/before (behaviour bench of issue 29).
set -euo pipefail
cd /tmp/before
export PYTHONPATH=/tmp/before PATH=/work/main/.venv/bin:$PATH
mkdir -p /tmp/bb
if [ ! -d runs/demo/final ]; then
  specheads prepare --config configs/demo-eagle3-smollm2.yaml output_dir=runs/demo >/tmp/bb/demo-prep.log 2>&1
  specheads train --config configs/demo-eagle3-smollm2.yaml output_dir=runs/demo >/tmp/bb/demo-train.log 2>&1
fi
common="features.dir=runs/demo/features train.tracker=none train.save_every=0 eval.dev_prompts=0 eval.every_steps=100000 eval.at_start=false"
run() { name=$1; cfg=$2; shift 2
  specheads prepare --config $cfg output_dir=runs/bb-$name $common "$@" >/tmp/bb/prep-$name.log 2>&1
  specheads train --config $cfg output_dir=runs/bb-$name $common "$@" >/tmp/bb/train-$name.log 2>&1
  echo "$name done $(date +%T)"; }
run medusa configs/medusa-smollm2.yaml train.max_steps=25 train.batch_size=2 eval.select=tau_tree train.mixed_precision=no
run eagle configs/eagle-smollm2.yaml train.max_steps=25 train.batch_size=2 eval.select=tau_tree train.mixed_precision=no
run dspark configs/demo-dspark-smollm2.yaml train.max_steps=40 eval.select=tau_chain
run dflash configs/dflash-smollm2.yaml train.max_steps=25 train.batch_size=2 eval.select=tau_chain train.mixed_precision=no

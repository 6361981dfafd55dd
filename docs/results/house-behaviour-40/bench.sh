#!/bin/bash
# Issue 40 "behaviour unchanged": one fp32 bench on the first 16 MT-bench first turns (32 new tokens), every drafter
# kind both codes have, fixed trees, deterministic pricing (--pricing profile) from ONE cost profile copied under
# each code's key, 1 thread. usage: bench.sh SIDE CODE_DIR   (SIDE before|after; heads from train_heads.sh)
set -euo pipefail
side=$1; code=$2
export SPECHEADS_CACHE=$HOME/.cache/sh-b40c-$side
T="--tree eagle3=3,2,4 --tree dspark=3 --tree medusa=default --tree eagle=3,2,4 --tree peagle=3 --tree domino=3 --tree dflash=3"
H="--head eagle3=/work/main/runs/bh-eagle3/best --head dspark=/work/main/runs/bh-dspark/best --head medusa=/work/main/runs/bh-medusa/best --head eagle=/work/main/runs/bh-eagle/best --head peagle=/work/main/runs/bh-peagle/best --head domino=/work/main/runs/bh-domino/best --head dflash=/work/main/runs/bh-dflash/best"
M="vanilla,prompt-lookup,plain,prompt-lookup-ours,recycling,draft-model,head:eagle3,head:dspark,head:medusa,head:eagle,head:peagle,head:domino,head:dflash,head:eagle3+lookup,head:dspark+lookup,combo,lookup+recycling"
cd $code
PY=/work/main/.venv/bin/python
$PY -m specheads bench --target smollm2-135m $H $T --dataset mt-bench --limit 16 --max-new-tokens 32 --dtype fp32 \
  --threads 1 --pricing profile --draft-model truncated:4 --warmup-tokens 8 --methods $M --out /work/main/runs/b40c16-$side/single 2>&1 | tail -2
ls -la $SPECHEADS_CACHE/profiles

#!/usr/bin/env bash
# `make demo`: the main job on the bundled defaults, end to end on this machine:
# prepare (ShareGPT slice -> chat tokens + masks -> SmolLM2 features) -> train a small EAGLE-3 head ->
# bench it (alone, and with a prompt-lookup chain merged into its tree) against plain HF generate, our own loop
# drafting nothing (plain: the baseline of the scheduler's expected figures) and HF prompt
# lookup on a slice of MT-bench -> print the table.
# Usage: scripts/demo.sh [OUT_DIR]   (expects `specheads` on PATH; `make demo` sets that up)
set -euo pipefail
OUT=${1:-runs/demo}
RECIPE=configs/demo-eagle3-smollm2.yaml
LIMIT=${DEMO_LIMIT:-8}              # MT-bench first turns (categories interleaved)
NEW_TOKENS=${DEMO_NEW_TOKENS:-128}  # new tokens per prompt
# bf16 where the machine computes it natively (AVX-512 BF16, or a GPU); else float32: on an AVX2-only CPU bf16 runs
# on emulated paths (feature extraction at 37 tok/s here, over an hour for the demo's prepare alone)
DTYPE=${DEMO_DTYPE:-auto}
if [ "$DTYPE" = auto ]; then
  if grep -qw avx512_bf16 /proc/cpuinfo 2>/dev/null || command -v nvidia-smi >/dev/null 2>&1; then DTYPE=bfloat16
  else DTYPE=float32; fi
fi
start=$(date +%s)
echo "== 1/3 prepare ($RECIPE -> $OUT, target in $DTYPE)"
specheads prepare --config "$RECIPE" "output_dir=$OUT" "target.dtype=$DTYPE"
echo "== 2/3 train"
if [ -d "$OUT/checkpoints" ]; then resume=--resume; else resume=; fi
specheads train --config "$RECIPE" "output_dir=$OUT" "target.dtype=$DTYPE" $resume
echo "== 3/3 bench (MT-bench first turns: $LIMIT, $NEW_TOKENS new tokens, greedy, $DTYPE)"
specheads bench --target smollm2-135m --head "$OUT/best" --dataset mt-bench --limit "$LIMIT" \
  --max-new-tokens "$NEW_TOKENS" --dtype "$DTYPE" --methods vanilla,plain,prompt-lookup,head,head+lookup --out "$OUT/bench"
echo "== demo finished in $(( $(date +%s) - start )) s; results: $OUT/bench/results.json, results.md, *.png"

#!/usr/bin/env bash
# Issue 41's block-tree bar on a lent GPU (docs/block_trees.md "On a GPU"): the real target (the bundled SmolLM2
# GGUF) and a trained DSpark head, served as the scheduled chain and the scheduled tree over its block, plus plain
# decoding, on the MT-bench first turns, bf16, greedy, our loop with CUDA graphs. On this 2-core CPU the verify
# cost curve (t(16)/t(1) = 2.28) keeps trees small; on an H200 it is flat, which is where the tree pays.
#
# The target GGUF (98 MB) is over one device call's 64 MiB, so it travels in two parts in two calls while the
# machine stays warm (30 s): stage `a` installs the wheels and keeps part a, stage `b` joins part b and benches.
# Prepare here (the folder .gpu/ is ignored through .git/info/exclude):
#   scripts/gpu_blocktree.sh pack runs/demo-dspark/best          # -> .gpu/{gguf.a,gguf.b,head,question.jsonl}
# then two device runs back to back:
#   run carry [".whl", ".gpu/gguf.a", ".gpu/head", ".gpu/question.jsonl"]  command: bash scripts/gpu_blocktree.sh a
#   run carry [".gpu/gguf.b"]  command: LIMIT=80 bash scripts/gpu_blocktree.sh b      (OUT: $OUT/blocktree-h200)
set -euo pipefail
stage=${1:?usage: gpu_blocktree.sh pack HEAD_DIR | a | b}
KEEP=/tmp/specheads-gpu  # survives between calls while the machine is warm
case "$stage" in
pack)
  head=${2:?pack needs the head folder}
  py=${PY:-.venv/bin/python}
  gguf=$($py -c "from specheads.assets import smollm2_gguf; print(smollm2_gguf())")
  q=$($py -c "from specheads.assets import mtbench_questions; print(mtbench_questions())")
  grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo /.gpu/ >> .git/info/exclude; }
  rm -rf .gpu && mkdir -p .gpu/head
  split -b 48M "$gguf" .gpu/gguf.
  mv .gpu/gguf.aa .gpu/gguf.a && mv .gpu/gguf.ab .gpu/gguf.b
  sha256sum "$gguf" | cut -d' ' -f1 > .gpu/gguf.sha256
  cp "$q" .gpu/question.jsonl && cp -r "$head"/. .gpu/head/
  du -sh .whl .gpu/* ;;
a)
  mkdir -p $KEEP/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $KEEP/site .whl/*.whl
  cp .gpu/gguf.a $KEEP/ && cp -r .gpu/head $KEEP/head && cp .gpu/question.jsonl $KEEP/
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; ls -la $KEEP ;;
b)
  test -f $KEEP/gguf.a || { echo "stage a's files are gone (the machine was released between calls)"; exit 3; }
  export PYTHONPATH=$KEEP/site:$PWD
  cat $KEEP/gguf.a .gpu/gguf.b > $KEEP/SmolLM2-135M-Instruct.Q4_1.gguf
  rm -rf $KEEP/head-tree && cp -r $KEEP/head $KEEP/head-tree   # bench keys trees by head folder: a second folder
  out=${OUT:-/tmp/out}/blocktree-h200
  # methods rotated per prompt; scheduled chain (auto) vs scheduled tree (tree:auto) over the same block
  timeout ${BENCH_TIMEOUT:-540} python3 -m specheads.cli bench --target $KEEP/SmolLM2-135M-Instruct.Q4_1.gguf \
    --head chain=$KEEP/head --head tree=$KEEP/head-tree --tree chain=auto --tree tree=tree:auto \
    --methods ${METHODS:-plain,head:chain,head:tree} --dataset $KEEP/question.jsonl --limit ${LIMIT:-80} \
    --max-new-tokens ${NEW_TOKENS:-256} --dtype bf16 --device cuda --compile auto --out "$out" 2>&1 | tail -n 60
  nvidia-smi --query-gpu=name,memory.used --format=csv,noheader ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac

#!/usr/bin/env bash
# Issue 41's block-tree bar on a lent GPU (docs/block_trees.md "On a GPU"): the real target (the bundled SmolLM2
# GGUF) and a trained DSpark head, served as the scheduled chain and the scheduled tree over its block, plus plain
# decoding, on the MT-bench first turns, bf16, greedy, our loop with CUDA graphs. On this 2-core CPU the verify
# cost curve (t(16)/t(1) = 2.28) keeps trees small; on an H200 it is flat, which is where the tree pays.
#
# The target GGUF (98 MB), the wheels (14 MB, docs/gpu.md) and the head (~38 MB) are over one device call's 64 MiB
# (the tracked tree takes ~9 MB of it), so they travel in three calls while the machine stays warm (30 s):
# stage `a` installs the wheels and keeps GGUF part a, `b` keeps part b, `c` joins part c and benches.
# Prepare here (the folder .gpu/ is ignored through .git/info/exclude):
#   scripts/gpu_blocktree.sh pack runs/demo-dspark/best     # -> .gpu/{gguf.a,gguf.b,gguf.c,head,question.jsonl}
# then three device runs back to back:
#   run carry [".whl", ".gpu/gguf.a"]                  command: bash scripts/gpu_blocktree.sh a
#   run carry [".gpu/gguf.b"]                          command: bash scripts/gpu_blocktree.sh b
#   run carry [".gpu/gguf.c", ".gpu/head", ".gpu/question.jsonl"]  command: bash scripts/gpu_blocktree.sh c
#   (results: $OUT/blocktree-h200)
set -euo pipefail
stage=${1:?usage: gpu_blocktree.sh pack HEAD_DIR | a | b | c}
KEEP=/tmp/specheads-gpu  # survives between calls while the machine is warm
# rewrite DIR/model.safetensors with its floating tensors in DTYPE, and its checksum file (heads load verified)
RECAST='
import hashlib, sys, torch
from safetensors.torch import load_file, save_file
d, dt = sys.argv[1], getattr(torch, sys.argv[2])
w = {k: v.to(dt) if v.is_floating_point() else v for k, v in load_file(f"{d}/model.safetensors").items()}
save_file(w, f"{d}/model.safetensors", metadata={"format": "pt"})
h = hashlib.sha256(open(f"{d}/model.safetensors", "rb").read()).hexdigest()
open(f"{d}/model.safetensors.sha256", "w").write(f"{h}  model.safetensors\n")
print(d, sys.argv[2], sum(v.numel() for v in w.values()), "values")'

case "$stage" in
pack)
  head=${2:?pack needs the head folder}
  py=${PY:-.venv/bin/python}
  gguf=$($py -c "from specheads.assets import smollm2_gguf; print(smollm2_gguf())")
  q=$($py -c "from specheads.assets import mtbench_questions; print(mtbench_questions())")
  grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo /.gpu/ >> .git/info/exclude; }
  rm -rf .gpu && mkdir -p .gpu/head
  # part a beside the wheels (14 MB), part b alone, part c (the rest) beside the head; each call < 64 MiB
  dd if="$gguf" of=.gpu/gguf.a bs=1000000 count=43 status=none
  dd if="$gguf" of=.gpu/gguf.b bs=1000000 skip=43 count=55 status=none
  dd if="$gguf" of=.gpu/gguf.c bs=1000000 skip=98 status=none
  sha256sum "$gguf" | cut -d' ' -f1 > .gpu/gguf.sha256
  cp "$q" .gpu/question.jsonl && cp -r "$head"/. .gpu/head/
  $py - .gpu/head bfloat16 <<<"$RECAST"   # the head travels in bf16 (half the bytes); stage c casts it back
  du -sh .whl .gpu/* ;;
a)
  mkdir -p $KEEP/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $KEEP/site .whl/*.whl
  cp .gpu/gguf.a $KEEP/
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true; ls -la $KEEP ;;
b)
  test -f $KEEP/gguf.a || { echo "stage a's files are gone (the machine was released between calls)"; exit 3; }
  cp .gpu/gguf.b $KEEP/ && ls -la $KEEP ;;
c)
  test -f $KEEP/gguf.b || { echo "stage b's files are gone (the machine was released between calls)"; exit 3; }
  export PYTHONPATH=$KEEP/site:$PWD
  cat $KEEP/gguf.a $KEEP/gguf.b .gpu/gguf.c > $KEEP/SmolLM2-135M-Instruct.Q4_1.gguf
  test "$(sha256sum $KEEP/SmolLM2-135M-Instruct.Q4_1.gguf | cut -d' ' -f1)" = "$(cat .gpu/gguf.sha256)" || {
    echo "the joined GGUF differs from the packed one"; exit 4; }
  rm -rf $KEEP/head && cp -r .gpu/head $KEEP/head && cp .gpu/question.jsonl $KEEP/
  ${PYTHON:-python3} - $KEEP/head float32 <<<"$RECAST"   # the head as trained: fp32 (its values rounded to bf16)
  rm -rf $KEEP/head-tree && cp -r $KEEP/head $KEEP/head-tree   # bench keys trees by head folder: a second folder
  out=${OUT:-/tmp/out}/blocktree-h200
  # methods rotated per prompt; scheduled chain (auto) vs scheduled tree (tree:auto) over the same block
  timeout ${BENCH_TIMEOUT:-540} ${PYTHON:-python3} -m specheads.cli bench --target $KEEP/SmolLM2-135M-Instruct.Q4_1.gguf \
    --head chain=$KEEP/head --head tree=$KEEP/head-tree --tree chain=auto --tree tree=tree:auto \
    --methods ${METHODS:-plain,head:chain,head:tree} --dataset $KEEP/question.jsonl --limit ${LIMIT:-80} \
    --max-new-tokens ${NEW_TOKENS:-256} --dtype bf16 --device ${DEVICE:-cuda} --compile auto --out "$out" 2>&1 | tail -n 60
  nvidia-smi --query-gpu=name,memory.used --format=csv,noheader || true ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac

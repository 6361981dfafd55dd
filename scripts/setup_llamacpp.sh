#!/usr/bin/env bash
# Build the llama.cpp tools specheads drives (llama-server, llama-bench) and set up its GGUF converter
# (convert_hf_to_gguf.py + gguf-py), from the llama.cpp source that the PyPI sdist llama-cpp-python==$VERSION
# vendors (vendor/llama.cpp). Nothing is downloaded from anywhere but the package registry (pip).
#
#   bash scripts/setup_llamacpp.sh            (or: make llamacpp)
#
# Layout under $SPECHEADS_LLAMACPP (default .llamacpp/ in the repository, git-ignored):
#   sdist/     the downloaded sdist (hash-checked)    src/    its vendor/llama.cpp
#   build/     the cmake build; build/bin/llama-server, build/bin/llama-bench
#   stamp      what was built (version, cmake flags, python): a matching stamp returns at once
#
# CPU flags: GGML_NATIVE=OFF with the x86 extensions this CPU reports turned on one by one and every AMX option
# off. A native build (-march=native) on a CPU that reports AMX compiles ggml's AMX-INT8 path, which crashed with
# SIGSEGV in ldtilecfg on Q4_1 multi-token batches; after the build the CPU library is checked for AMX tile
# instructions and the build fails if it has any. bf16 GGUFs never use that path.
#
# The converter imports sentencepiece even for a tokenizer.json vocabulary: it is installed into the venv here.
# Wall time on 2 cores: about 4 minutes for the build, about a minute for the sdist download (pip prepares its
# metadata); a second call with a matching stamp takes well under a second.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.3.36  # llama-cpp-python; its vendor/llama.cpp is llama.cpp commit 0c1e570 (2026-10-01)
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
SENTENCEPIECE_SPEC="sentencepiece>=0.1.98,<0.3.0"  # the converter's own requirements-convert_legacy_llama.txt
JOBS=${LLAMACPP_JOBS:-2}
DIR=${SPECHEADS_LLAMACPP:-.llamacpp}
PY=${PYTHON:-.venv/bin/python}
TARGETS=(llama-server llama-bench)

[ -x "$PY" ] || { echo "setup_llamacpp: $PY not found (run \`make setup\` first, or set PYTHON=...)" >&2; exit 1; }
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)

# x86 extensions, each only when /proc/cpuinfo reports it (AVX-512 as the F/CD/VL/DQ/BW group ggml uses)
flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
has() { for f in "$@"; do [[ "$flags" == *" $f "* ]] || return 1; done; }
onoff() { if has "$@"; then echo ON; else echo OFF; fi; }
CMAKE_FLAGS=(
  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF
  -DGGML_NATIVE=OFF -DGGML_CCACHE=OFF
  -DGGML_SSE42="$(onoff sse4_2)" -DGGML_AVX="$(onoff avx)" -DGGML_AVX2="$(onoff avx2)"
  -DGGML_FMA="$(onoff fma)" -DGGML_F16C="$(onoff f16c)" -DGGML_BMI2="$(onoff bmi2)"
  -DGGML_AVX512="$(onoff avx512f avx512cd avx512vl avx512dq avx512bw)"
  -DGGML_AVX512_VBMI="$(onoff avx512f avx512vbmi)" -DGGML_AVX512_VNNI="$(onoff avx512f avx512_vnni)"
  -DGGML_AVX512_BF16="$(onoff avx512f avx512_bf16)"
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
  # only what the server and llama-bench need: no tests, examples, web UI (its prebuilt assets would be
  # downloaded), unified app, or HTTPS
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
)
STAMP_TEXT="llama-cpp-python==$VERSION sha256=$SDIST_SHA256
targets: ${TARGETS[*]}
cmake: ${CMAKE_FLAGS[*]}
python: $("$PY" -c 'import sys; print(sys.executable)')"

tools_ok() {
  for t in "${TARGETS[@]}"; do [ -x "$DIR/build/bin/$t" ] || return 1; done
  [ -f "$DIR/src/convert_hf_to_gguf.py" ] && [ -d "$DIR/src/gguf-py" ]
}
if [ -f "$DIR/stamp" ] && [ "$(cat "$DIR/stamp")" == "$STAMP_TEXT" ] && tools_ok \
   && "$PY" -c "import sentencepiece" 2>/dev/null; then
  echo "llama.cpp tools up to date in $DIR (llama-cpp-python==$VERSION)"; exit 0
fi
rm -f "$DIR/stamp"
t0=$(date +%s)

# 1. the sdist, from the package registry, hash-checked
SDIST="$DIR/sdist/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ] || ! echo "$SDIST_SHA256  $SDIST" | sha256sum -c --status; then
  echo "setup_llamacpp: downloading the llama-cpp-python==$VERSION sdist (pip)"
  mkdir -p "$DIR/sdist"
  req="$DIR/sdist/requirements.txt"
  echo "llama-cpp-python==$VERSION --hash=sha256:$SDIST_SHA256" > "$req"
  "$PY" -m pip download --quiet --no-deps --no-binary :all: --require-hashes -r "$req" -d "$DIR/sdist"
fi
echo "$SDIST_SHA256  $SDIST" | sha256sum -c --status || { echo "setup_llamacpp: $SDIST: sha256 mismatch" >&2; exit 1; }

# 2. its vendored llama.cpp source
if [ ! -f "$DIR/src/CMakeLists.txt" ]; then
  rm -rf "$DIR/src.tmp" && mkdir -p "$DIR/src.tmp"
  tar -xzf "$SDIST" -C "$DIR/src.tmp" --strip-components=3 "llama_cpp_python-$VERSION/vendor/llama.cpp"
  rm -rf "$DIR/src" && mv "$DIR/src.tmp" "$DIR/src"
fi

# 3. the converter's missing dependency (the rest, torch / numpy / transformers / gguf's own, is in the venv)
"$PY" -c "import sentencepiece" 2>/dev/null || "$PY" -m pip install --quiet "$SENTENCEPIECE_SPEC"

# 4. the tools
GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
cmake -S "$DIR/src" -B "$DIR/build" "${GEN[@]}" "${CMAKE_FLAGS[@]}" > "$DIR/cmake-configure.log" 2>&1 \
  || { tail -30 "$DIR/cmake-configure.log" >&2; exit 1; }
echo "setup_llamacpp: building ${TARGETS[*]} with $JOBS jobs (a few minutes; log: $DIR/cmake-build.log)"
cmake --build "$DIR/build" --target "${TARGETS[@]}" -j "$JOBS" > "$DIR/cmake-build.log" 2>&1 \
  || { tail -30 "$DIR/cmake-build.log" >&2; exit 1; }

# 5. no AMX tile instruction may be in the binaries (the crash above); objdump ships with binutils (gcc's)
if command -v objdump >/dev/null; then
  for t in "${TARGETS[@]}"; do
    if objdump -d --no-show-raw-insn "$DIR/build/bin/$t" | grep -q -E '\s(ldtilecfg|tileloadd|tdpbssd)\b'; then
      echo "setup_llamacpp: $t contains AMX tile instructions (the AMX-INT8 path crashed on this CPU)" >&2; exit 1
    fi
  done
fi
"$DIR/build/bin/llama-server" --version > "$DIR/version.txt" 2>&1 || true
printf '%s\n' "$STAMP_TEXT" > "$DIR/stamp"
echo "llama.cpp tools built in $DIR/build/bin in $(( $(date +%s) - t0 )) s ($(head -1 "$DIR/version.txt"))"

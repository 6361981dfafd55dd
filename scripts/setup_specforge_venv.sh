#!/usr/bin/env bash
# Create .venv-specforge: a separate venv where SpecForge's draft model classes import, so that tests/test_dspark.py
# and tests/test_domino.py can build SpecForge's DSparkDraftModel / DFlashDraftModel / DominoDraftModel from our
# `specforge` export and run them (tests/fixtures/specforge_load.py).
# Idempotent: a venv whose `import specforge.modeling.draft` already works is left as it is.
# specforge 0.2.0 pins transformers 5.8.1 (and sglang, wandb, ... for training), hence its own venv and --no-deps:
# only what its model modules import is installed (specforge/modeling/draft/*.py, specforge/utils.py,
# specforge/core/chunking.py and specforge/algorithms/common/dflash_family_model.py: torch, transformers,
# safetensors, huggingface-hub, typing-extensions).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SPECFORGE_VENV:-.venv-specforge}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
CHECK="import specforge.modeling.draft, specforge.algorithms.common.dflash_family_model"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "$CHECK" 2>/dev/null; then
  echo "$VENV: specforge already importable"; exit 0
fi
"$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip install --quiet"
$PIP torch==2.13.0            # the CPU build lies on local disk (pip find-links); specforge pins 2.11 for CUDA
$PIP transformers==5.8.1 safetensors huggingface-hub typing-extensions   # specforge 0.2.0's pin
$PIP --no-deps specforge==0.2.0
"$VENV/bin/python" -c "$CHECK; import specforge, transformers, importlib.metadata as m; print('specforge', m.version('specforge'), 'transformers', transformers.__version__)"

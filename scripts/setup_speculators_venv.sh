#!/usr/bin/env bash
# Create .venv-speculators: a separate venv where the real `speculators` package imports, so that
# tests/test_export.py can load our `speculators` export with speculators' own classes.
# Idempotent: a venv whose `import speculators` already works is left as it is.
# speculators pins versions that clash with the main venv (transformers 5.19.0, datasets 5.1.0), hence its own venv.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SPECULATORS_VENV:-.venv-speculators}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import speculators" 2>/dev/null; then
  echo "$VENV: speculators already importable"; exit 0
fi
"$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip install --quiet"
$PIP torch==2.13.0            # the CPU build lies on local disk (pip find-links)
$PIP transformers==5.19.0 safetensors
$PIP --no-deps speculators hs-connectors
$PIP openai aiohttp httpx psutil protobuf huggingface-hub datasets==5.1.0 pydantic pydantic-settings loguru rich typer click
"$VENV/bin/python" -c "import speculators, transformers; print('speculators', speculators.__version__ if hasattr(speculators, '__version__') else '?', 'transformers', transformers.__version__)"

#!/usr/bin/env bash
# One-time set-up on a fresh machine: torch (CPU build, pinned) only where no torch is installed,
# then the pinned requirements and this package in editable mode. Idempotent and quick when done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -r requirements.txt
"$PY" -m pip install -q --no-deps --no-build-isolation -e .

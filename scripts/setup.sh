#!/usr/bin/env bash
# Set-up for `make train` and `make test`: the project's virtual environment in .venv, then torch where none is
# importable, the pinned requirements and this package in editable mode.
# The venv sees the system's packages (--system-site-packages), so a torch already installed (e.g. a machine
# image's CUDA build) is kept and only what is missing or pinned differently is installed into .venv.
# Without a torch: torch==2.13.0, the CPU-only build where there is no NVIDIA GPU (the default index serves the
# CUDA one, gigabytes of libraries a CPU machine cannot use).
# A stamp in .venv holds a hash of what this script installs from; while it matches, pip is not run at all.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_PY=${PYTHON:-python3}
VENV=.venv
PY=$VENV/bin/python
STAMP=$VENV/.setup-stamp
TORCH_VERSION=2.13.0

want=$(cat requirements.txt setup.py scripts/setup.sh | sha256sum | cut -d' ' -f1)
if "$PY" -c "" >/dev/null 2>&1 && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
  exit 0
fi

if ! "$PY" -c "" >/dev/null 2>&1; then
  rm -rf "$VENV"
  echo "setup: creating $VENV (a virtual environment that sees the system's packages)"
  # Some system Pythons lack ensurepip: then the venv uses the system's pip, which it sees.
  if ! "$BASE_PY" -m venv --system-site-packages "$VENV" >/dev/null 2>&1; then
    rm -rf "$VENV"
    "$BASE_PY" -m venv --system-site-packages --without-pip "$VENV"
  fi
fi
if ! "$PY" -m pip --version >/dev/null 2>&1; then
  echo "setup: no pip for $PY; install your distribution's python3-venv / python3-pip package" >&2
  exit 1
fi
# Inside a venv pip does not warn about running as root; -q keeps only errors.
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

has_nvidia_gpu() {
  compgen -G "/proc/driver/nvidia/gpus/*" >/dev/null || nvidia-smi -L >/dev/null 2>&1
}

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  if has_nvidia_gpu; then
    echo "setup: installing torch==$TORCH_VERSION"
    pip_install "torch==$TORCH_VERSION"
  else
    echo "setup: installing torch==$TORCH_VERSION, CPU-only build (no NVIDIA GPU here)"
    # A local CPU wheel or a configured index that serves it first, else PyTorch's CPU index.
    pip_install "torch==$TORCH_VERSION+cpu" 2>/dev/null ||
      pip_install --index-url https://download.pytorch.org/whl/cpu "torch==$TORCH_VERSION"
  fi
fi
echo "setup: installing the pinned requirements into $VENV (once; skipped while requirements.txt and setup.py are unchanged)"
pip_install -r requirements.txt
# Build isolation would fetch setuptools; the venv usually sees one already.
if "$PY" -c "import setuptools" >/dev/null 2>&1; then
  pip_install --no-deps --no-build-isolation -e .
else
  pip_install --no-deps -e .
fi
echo "$want" > "$STAMP"

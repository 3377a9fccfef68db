#!/usr/bin/env bash
# Installs qvl and what it needs into ./.venv (made if missing). Usage: bash install.sh [EXTRAS]
#   EXTRAS: pip extras of qvl to add, default "test" (pytest, transformers, ...).
# torch is installed first and on purpose: a bare "torch" requirement on a machine without a GPU can
# pull a CUDA build of several GB, so without an NVIDIA driver we ask for the CPU wheel that these
# machines keep on disk (torch 2.13.0); with a GPU, pip's default CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
extras="${1:-test}"

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
py=.venv/bin/python
"$py" -m pip install --quiet --upgrade pip setuptools wheel

if ! "$py" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$py" -m pip install --quiet "torch>=2.11"
  else
    "$py" -m pip install --quiet "torch==2.13.0"
  fi
fi
"$py" -m pip install --quiet -e ".[${extras}]"
"$py" -c "import torch, triton, qvl.kernels; print(f'qvl installed: torch {torch.__version__}, triton {triton.__version__}')"

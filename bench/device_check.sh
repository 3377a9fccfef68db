#!/usr/bin/env bash
# One prepared call for a lent GPU machine (no network there, so nothing is installed: the repository's
# kernels/ and vit/ are put on PYTHONPATH as the qvl package). Writes everything under $OUT (default
# bench/results/run-<date>): the device and versions, the CUDA correctness tests (bf16 included), then every
# benchmark's JSON and the printed tables. Usage: bash bench/device_check.sh [--full]   (default: --quick)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results/run-$(date -u +%Y%m%d)}"
mkdir -p "$out"
shim="$(mktemp -d)"
mkdir -p "$shim/qvl" && ln -s "$PWD/kernels" "$shim/qvl/kernels" && ln -s "$PWD/vit" "$shim/qvl/vit"
export PYTHONPATH="$shim:$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
quick=--quick
[ "${1:-}" = "--full" ] && quick=

{
  date -u +"date: %Y-%m-%dT%H:%MZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  git rev-parse HEAD 2>/dev/null || true
} 2>&1 | tee "$out/device.txt"

# CUDA tests only: the CPU ones ran in CI. -k picks the GPU-marked, bf16 and peak-memory tests.
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/vit/test_model.py \
  -k "gpu or cuda or bf16 or int64 or peak" 2>&1 | tee "$out/gpu_tests.log" | tail -15

python3 -m bench $quick --dtype bf16 --json-dir "$out" 2>&1 | tee "$out/bench.log" | tail -80

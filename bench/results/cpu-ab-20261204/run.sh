#!/usr/bin/env bash
# Same-process A/B timings of compiled qvl variants on the CPU (fp32, bench_cpu's tower and workloads), from the
# repository root: bash bench/results/cpu-ab-20261204/run.sh. Each script prints, per workload, every variant's max
# relative error against transformers, then its (best, median) time over transformers' best in that process, and
# transformers' best in ms.
set -euo pipefail
here="$(dirname "$0")"
run() {
  echo "== $*"
  PYTHONPATH=. .venv/bin/python "$here/$1.py" fp32 8 "${@:2}" 2>&1 | grep -v "Warning\|warn(" | grep "^hf"
}
run split_qkv
run freezing
run freezing max-autotune

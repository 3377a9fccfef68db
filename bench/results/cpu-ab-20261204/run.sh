#!/usr/bin/env bash
# Same-process A/B timings of compiled qvl variants on the CPU (fp32, bench_cpu's tower and workloads), from the
# repository root: bash bench/results/cpu-ab-20261204/run.sh. Each script prints, per workload, every variant's max
# relative error against transformers, then its (best, median) time over transformers' best in that process, and
# transformers' best in ms (mlp_rows.py also each run's fewest minor page faults in one call; its output is
# mlp_rows.txt, run on its own later the same day; output.txt holds the three runs before it).
set -euo pipefail
here="$(dirname "$0")"
run() {
  echo "== $*"
  PYTHONPATH=. .venv/bin/python "$here/$1.py" fp32 8 "${@:2}" 2>&1 | grep -v "Warning\|warn(" | grep "^hf"
}
run split_qkv
run freezing
run freezing max-autotune
run mlp_rows 1024

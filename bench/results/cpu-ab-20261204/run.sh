#!/usr/bin/env bash
# Same-process A/B timings of compiled qvl variants on the CPU (fp32, bench_cpu's tower and workloads), from the
# repository root: bash bench/results/cpu-ab-20261204/run.sh. Each script prints, per workload, every variant's
# (best, median) time over transformers' best in that process, transformers' best in ms, and max relative errors.
set -euo pipefail
here="$(dirname "$0")"
for script in split_qkv freezing freezing_max_autotune; do
  echo "== $script"
  PYTHONPATH=. .venv/bin/python "$here/$script.py" fp32 8 2>&1 | grep -v "Warning\|warn(" | grep "^(\|^hf"
done

#!/usr/bin/env bash
# The one prepared call for a lent GPU machine: bash bench/device_check.sh [--attention | --tower | --full]
#
# Nothing is installed there (no network): the repository's kernels/ and vit/ go on PYTHONPATH as the qvl package.
# Every step runs under its own timeout, so that one hang cannot spend the lease.
#
# default (at most about 9.5 minutes: a 15-minute lease holds one call and its start; the focused modes are shorter):
#   1. device, driver, versions, commit                                                   device.txt
#   1b. (every mode) the head-dim layout check (bench/head_dim_check.py: the split tiling of D 72, and D 80 with
#      --attention/--full, against float64, split32 where split disagreed, and the padded one; the rope forward
#      timed in each that agreed); every later step runs in the layout it prints (QVL_ATTENTION_HEAD_DIM: split or
#      split32 where it agreed, else padded). Skipped where the caller set QVL_ATTENTION_HEAD_DIM=split|split32|padded
#      (an earlier run's verdict, the later steps run in that one)
#                                                                         head_dim.log, head_dim.json, device.txt
#   2. the attention tile sweep (bench/tune_attention.py) within TUNE_BUDGET_S seconds (default 35); it writes
#      kernels/attention_tiles.json, which the tests and benchmarks after it then use  tune.log, attention_tiles.json
#   3. CUDA tests: bf16 correctness (TMA descriptor loads included), the sync-free forward
#      (set_sync_debug_mode("error")), CUDA-graph capture and replay, int64 offsets, peak memory, the direct calls
#                                                                                           gpu_tests.log
#   4. compute-sanitizer memcheck of a small attention forward + backward (the run's layout, then split where it
#      differs), if the tool is there                                                          memcheck.log
#   5. every GPU benchmark's quick cases (not bench_cpu, whose subject is a CPU), one module at a time, each under its
#      own timeout; the compiled towers left out (compiling them takes minutes)              *.json, bench.log
#   6. the plots of the whole run (bench.plot)                                               *.png
#   7. which of issues 30's and 31's goals the run meets (bench/goals.py; --attention: 30's, --tower: 31's)  goals.txt
# --attention (about 8.5 minutes; issue 30): 1-4 for attention alone (its tests, guard bands on the device included),
#   then the attention forward and forward + backward benchmarks (flex_attention left out: it compiles per shape)
#   and Qwen2.5-VL's window attention.
# --tower (about 8.5 minutes; issue 31): 1, the tower's CUDA tests (graph replay, sync-free forward, fast launches,
#   the direct calls), then most wanted first: host time per op, the whole tower (eager, replayed, transformers +
#   SDPA eager), the bandwidth kernels and mergers, their launch-configuration sweep (bench/tune_rows.py: reports,
#   writes nothing; tune_rows.log, tune_rows.json), rotary, the position table.
#   No attention tile sweep, no memcheck.
# --full: the default's phases with the benchmarks' long cases and the compiled towers (longer than a lease holds).
# Everything goes to bench/results/run-<date>-<UTC hhmm>/, each step's start (seconds into the call) to phases.txt
# there. Under the device tool ($OUT set: at most 8 files come back) that folder is also packed into
# $OUT/run-<date>.tar.gz, with device.txt and the logs' ends beside it, after every step: a run cut short by the
# tool's limit still brings back the steps it finished, and a benchmark cut by its timeout the rows it measured
# (printed, and saved in its JSON noted as cut short).
set -uo pipefail
cd "$(dirname "$0")/.."
quick=--quick
mode="${1:-}"
[ "$mode" = "--full" ] && quick=
case "$mode" in
  ""|--full|--attention|--tower) ;;
  *) echo "usage: bash bench/device_check.sh [--attention | --tower | --full]" >&2; exit 2 ;;
esac
bench_stamp="$(date -u +%Y%m%d-%H%M%S)"
stamp="run-${bench_stamp%??}"
out="bench/results/$stamp"
mkdir -p "$out"
shim="$(mktemp -d)"
mkdir -p "$shim/qvl" && ln -s "$PWD/kernels" "$shim/qvl/kernels" && ln -s "$PWD/vit" "$shim/qvl/vit"
export PYTHONPATH="$shim:$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
started=$SECONDS
ship() {
  [ -n "${OUT:-}" ] || return 0
  tar czf "$OUT/$stamp.tar.gz" -C bench/results "$stamp"
  for f in device.txt attention_tiles.json goals.txt; do [ -f "$out/$f" ] && cp "$out/$f" "$OUT/"; done
  for log in head_dim gpu_tests tune tune_rows bench; do [ -f "$out/$log.log" ] && tail -c 60000 "$out/$log.log" > "$OUT/$log-tail.log"; done
  return 0
}
# Each step's start, also kept in phases.txt: what each one took on the device, for sizing the timeouts.
phase() { echo "=== $1 (at $((SECONDS - started)) s)" | tee -a "$out/phases.txt"; ship; }
# bench NAME SECONDS [ARGS...]: one benchmark module under its own timeout, appending to bench.log, so that a slow one
# cannot starve those after it (each prints its rows as it measures them: a cut one keeps what it finished).
bench() {
  local name="$1" seconds="$2"
  shift 2
  phase "benchmark $name"
  timeout -k 15 "$seconds" python3 -m bench $quick --dtype bf16 --json-dir "$out" --stamp "$bench_stamp" --only "$name" \
    "$@" 2>&1 | tee -a "$out/bench.log" | tail -40
}
: > "$out/bench.log"
# Compiling qvl's and transformers' towers takes minutes: only --full times them.
compiled_towers=(--skip "qvl compiled,hf sdpa compiled")

phase device
{
  date -u +"date: %Y-%m-%dT%H:%MZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, 'cuda', torch.version.cuda)"
  # The tool's copy carries the working tree; its .git can lag behind it, so say when the files differ from HEAD.
  echo "HEAD $(git rev-parse HEAD 2>/dev/null)$(git diff --quiet HEAD 2>/dev/null || echo ' (working tree differs)')"
} 2>&1 | tee "$out/device.txt"

# The split head-dim tilings (72 = 64 + 16; split32: 64 + 32) have run in the interpreter only: check them and the
# padded one on this device first, and run everything after in the layout that agreed (padded, the layout an H200
# ran right before, when the check finds both split tilings wrong or gives no verdict). --attention and --full
# check D 80 (Qwen2.5-VL) as well.
# A caller who set QVL_ATTENTION_HEAD_DIM (split, split32 or padded: what an earlier run's check chose, e.g. --tower
# after --attention on the same lease) skips the check and its 100 s.
case "${QVL_ATTENTION_HEAD_DIM:-}" in
  split|split32|padded)
    layout="$QVL_ATTENTION_HEAD_DIM"
    verdict="given by the caller: QVL_ATTENTION_HEAD_DIM, no check in this run"
    ;;
  *)
    phase "head-dim layout check"
    # The verdict comes once the split rows are done where split agrees (about half the time), after split32's rows
    # where it does not; the padded rows after it are for comparison.
    head_dims=(72)
    layout_timeout=100
    case "$mode" in --attention|--full) head_dims=(72 80) layout_timeout=160 ;; esac
    timeout -k 10 "$layout_timeout" python3 -m bench.head_dim_check --head-dims "${head_dims[@]}" \
      --json "$out/head_dim.json" 2>&1 | tee "$out/head_dim.log" | tail -8
    layout="$(sed -n 's/^head-dim layout: //p' "$out/head_dim.log" | tail -1)"
    verdict="chosen by bench.head_dim_check"
    [ -n "$layout" ] || { layout=padded; verdict="bench.head_dim_check gave no verdict"; }
    ;;
esac
export QVL_ATTENTION_HEAD_DIM="$layout"
echo "attention head-dim layout: $layout ($verdict)" | tee -a "$out/device.txt"

tower_tests() {
  phase "CUDA tests"
  timeout 75 python3 -m pytest -q -p no:cacheprovider -n 4 tests/kernels/test_direct.py \
    tests/kernels/test_fast_launch.py tests/vit/test_graphs.py tests/vit/test_model.py \
    -k "cuda or gpu or direct" 2>&1 | tee "$out/gpu_tests.log" | tail -15
}

kernel_checks() {
  phase "tile sweep"
  timeout 55 python3 -m bench.tune_attention --budget-s "${TUNE_BUDGET_S:-35}" 2>&1 | tee "$out/tune.log" | tail -12
  cp kernels/attention_tiles.json "$out/attention_tiles.json"

  phase "CUDA tests"
  tests="tests/kernels tests/vit/test_model.py tests/vit/test_graphs.py"
  [ "$mode" = "--attention" ] && tests="tests/kernels/test_attention*.py"
  # shellcheck disable=SC2086
  timeout 90 python3 -m pytest -q -p no:cacheprovider -n 4 $tests \
    -k "(gpu or cuda or bf16 or int64 or peak or guard_bands or direct) and not cuda_compile" 2>&1 \
    | tee "$out/gpu_tests.log" | tail -15

  phase memcheck
  if command -v compute-sanitizer >/dev/null; then
    timeout 60 compute-sanitizer --tool memcheck --error-exitcode 1 python3 - <<'EOF' 2>&1 | tee "$out/memcheck.log" | tail -6
import os
import torch
import qvl.kernels  # noqa: F401
from qvl.kernels.attention import set_head_dim_layout
torch.manual_seed(0)
lengths = [1, 100, 64, 0, 300]
cu = torch.tensor([0, 1, 101, 165, 165, 465], dtype=torch.int32, device="cuda")
positions = torch.randint(0, 20, (sum(lengths), 2), dtype=torch.int32, device="cuda")
# The run's layout, then split where that is another (what a wrong one reads is the question): a fault leaves CUDA
# unusable in this process, so the layout the run's numbers come from goes first.
layouts = list(dict.fromkeys([os.environ["QVL_ATTENTION_HEAD_DIM"], "split"]))
for layout in layouts:
    set_head_dim_layout(layout)
    for head_dim in (72, 80, 64):
        for hint in (300, 64):
            qkv = torch.randn(sum(lengths), 3, 4, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            q, k, v = qkv.unbind(1)
            for pos in (positions, None):
                out = torch.ops.qvl.vision_attn(q, k, v, cu, hint, positions=pos)
                out.float().square().sum().backward()
torch.cuda.synchronize()
print(f"memcheck cases ran: vision_attn forward + backward with and without rope, bf16, D 72/80/64, both tile hints,"
      f" head-dim layouts {layouts}")
EOF
  else
    echo "compute-sanitizer not found: skipped" | tee "$out/memcheck.log"
  fi
}

if [ "$mode" = "--tower" ]; then
  tower_tests
  bench host 40
  bench tower 120 "${compiled_towers[@]}"
  bench merger 50
  phase "bandwidth-kernel sweep"
  timeout 75 python3 -m bench.tune_rows --budget-s 50 --json "$out/tune_rows.json" 2>&1 | tee "$out/tune_rows.log" \
    | tail -60
  bench rotary 20
  bench pos_embed 20
elif [ "$mode" = "--attention" ]; then
  kernel_checks
  bench attention 90 --skip flex_attention
  bench attention_backward 60 --skip flex_attention
  bench window 30
elif [ "$mode" = "--full" ]; then
  kernel_checks
  # The long cases and the compiled towers: longer than a 15-minute lease holds with a rerun.
  bench host 60
  bench attention 240
  bench tower 600
  bench merger 120
  bench pos_embed 60
  bench rotary 60
  bench attention_backward 240
  bench window 120
else
  kernel_checks
  bench host 20
  bench attention 40
  bench tower 60 "${compiled_towers[@]}"
  bench merger 30
  bench pos_embed 15
  bench rotary 15
  bench attention_backward 30
  bench window 25
fi
phase plots  # one figure set of the whole run (each call above drew its own modules' only)
timeout 20 python3 -m bench.plot "$out" 2>&1 | tail -5
phase goals
case "$mode" in
  --attention) issue=(--issue 30) ;;
  --tower) issue=(--issue 31) ;;
  *) issue=() ;;
esac
timeout 20 python3 -m bench.goals "$out" "${issue[@]}" 2>&1 | tee "$out/goals.txt"
phase done

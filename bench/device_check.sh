#!/usr/bin/env bash
# The one prepared call for a lent GPU machine: bash bench/device_check.sh [--attention | --tower | --full]
#
# Nothing is installed there (no network): the repository's kernels/ and vit/ go on PYTHONPATH as the qvl package.
# Every step runs under its own timeout, so that one hang cannot spend the lease, and every mode under a budget for
# the whole call (DEVICE_CHECK_BUDGET_S overrides it): --attention and --tower 300 s each, so that both fit one
# 15-minute lease with its start; the default 420 s. Each step's timeout is its cap or what the budget leaves after
# the floors kept back for the steps after it, whichever is less (run_plan below).
#
# default (both issues' quick cases):
#   1. device, driver, versions, commit, mode and budget                                  device.txt
#   1b. (every mode) the head-dim layout check (qvl check: every op and each head-dim layout, padded, split and
#      split32, in processes of their own against float64 on the cases that failed before, D 72 and with
#      --attention/--full D 80; the fast launch path bit for bit; this machine's verdicts recorded); every later step
#      runs in the layout it says the package now takes (QVL_ATTENTION_HEAD_DIM: split or split32 where right, else
#      padded). Skipped where the caller set QVL_ATTENTION_HEAD_DIM=split|split32|padded (an earlier run's verdict,
#      the later steps run in that one)                                       check.log, check.json, device.txt
#   1c. (not --tower) where that check found split or split32 wrong: the failure's shape (bench/diagnose_attention.py:
#      each launch setting in its own process, where each case is off, racecheck, synccheck)  diagnose.log, .json
#   2. the attention tile sweep (bench/tune_attention.py) within TUNE_BUDGET_S seconds (default 35, less when the
#      budget is short); it writes kernels/attention_tiles.json, which the tests and benchmarks after it then use
#                                                                                       tune.log, attention_tiles.json
#   3. CUDA tests: bf16 correctness (TMA descriptor loads included), the sync-free forward
#      (set_sync_debug_mode("error")), CUDA-graph capture and replay, int64 offsets, peak memory, the direct calls;
#      beside them, compute-sanitizer memcheck of a small attention forward + backward (the run's layout, then split
#      where it differs), if the tool is there                                          gpu_tests.log, memcheck.log
#   4. every GPU benchmark's quick cases (not bench_cpu, whose subject is a CPU), one module at a time, each under its
#      own timeout; the compiled towers left out (compiling them takes minutes)              *.json, bench.log
#   5. the plots of the whole run (bench.plot)                                               *.png
#   6. which of the attention and tower goals the run meets (bench/goals.py; --attention: the attention goals, --tower: the tower's)  goals.txt
# --attention (issue 30): 1-3 for attention alone (its tests, guard bands on the device included), then the attention
#   forward and forward + backward benchmarks (flex_attention left out: it compiles per shape) and Qwen2.5-VL's
#   window attention.
# --tower (issue 31): 1, the tower's CUDA tests (graph replay, sync-free forward, fast launches, the direct calls),
#   then most wanted first: host time per op, the whole tower (eager, replayed, transformers + SDPA eager), the
#   bandwidth kernels and mergers, their launch-configuration sweep (bench/tune_rows.py: reports, writes nothing;
#   tune_rows.log, tune_rows.json), rotary, the position table; qvl encode against its tower alone where time is
#   left (bench_encode --device; encode.json), and there too timm's qwen3_vit_88m in a bf16 training step, timm
#   against patch_model, both eager (bench_timm; timm.json), and qvl encode --ray against one process on the GPU
#   with 4 and 15 decoding CPUs beside its tower actor, where Ray is installed (bench_encode --ray; encode_ray.json).
#   No attention tile sweep, no memcheck.
# --full: the default's phases with the benchmarks' long cases and the compiled towers (longer than a lease holds).
# Everything goes to bench/results/run-<date>-<UTC hhmm>/, each step's start and limit (seconds into the call) to
# phases.txt there. Under the device tool ($OUT set: at most 8 files come back) that folder is also packed into
# $OUT/run-<date>.tar.gz, with device.txt and the logs' ends beside it, after every step: a run cut short by the
# tool's limit still brings back the steps it finished, and a benchmark cut by its timeout the rows it measured
# (printed, and saved in its JSON noted as cut short).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
quick=--quick
mode="${1:-}"
case "$mode" in
  "") budget_s=420 ;;
  --attention|--tower) budget_s=300 ;;
  --full) budget_s=3600 quick= ;;
  *) echo "usage: bash bench/device_check.sh [--attention | --tower | --full]" >&2; exit 2 ;;
esac
budget_s="${DEVICE_CHECK_BUDGET_S:-$budget_s}"
[[ "$budget_s" =~ ^[0-9]+$ ]] || { echo "DEVICE_CHECK_BUDGET_S must be a whole number of seconds" >&2; exit 2; }
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
  for log in check gpu_tests tune tune_rows bench; do [ -f "$out/$log.log" ] && tail -c 60000 "$out/$log.log" > "$OUT/$log-tail.log"; done
  return 0
}
# phase NAME [LIMIT]: each step's start and time limit, also kept in phases.txt (what each took on the device: what
# sizes the plans below for the next run).
phase() {
  echo "=== $1 (at $((SECONDS - started)) s${2:+, up to $2 s})" | tee -a "$out/phases.txt"
  ship
}

# run_plan "FUNCTION CAP FLOOR [WORD...]"...: each step in turn, called as FUNCTION LIMIT [WORD...]. A step's limit
# is its CAP, or less where the run's budget (budget_s) minus the time spent leaves no more once the FLOORs of the
# steps after it are kept back; a step whose limit comes out under MIN_STEP_S is skipped (and FUNCTION_skipped
# called, where defined). So the call ends within its budget whatever the device takes, a slow step costs the later
# ones their slack and never their floors, and a fast one leaves its time to them.
MIN_STEP_S=5
run_plan() {
  local entry step cap floor words reserve=0 limit
  for entry in "$@"; do
    read -r step cap floor words <<< "$entry"
    reserve=$((reserve + floor))
  done
  for entry in "$@"; do
    read -r step cap floor words <<< "$entry"
    reserve=$((reserve - floor))
    limit=$((budget_s - (SECONDS - started) - reserve))
    ((limit > cap)) && limit=$cap
    if ((limit < MIN_STEP_S)); then
      echo "=== $step skipped: the run's ${budget_s}-s budget is spent (at $((SECONDS - started)) s)" \
        | tee -a "$out/phases.txt"
      if declare -F "${step}_skipped" >/dev/null; then "${step}_skipped"; fi
      continue
    fi
    # shellcheck disable=SC2086
    "$step" "$limit" $words
  done
}

# bench_module SECONDS NAME [ARGS...]: one benchmark module under its own timeout, appending to bench.log, so that a
# slow one cannot starve those after it (each prints its rows as it measures them: a cut one keeps what it finished).
bench_module() {
  local seconds="$1" name="$2"
  shift 2
  phase "benchmark $name" "$seconds"
  timeout -k 5 "$seconds" python3 -m bench $quick --dtype bf16 --json-dir "$out" --stamp "$bench_stamp" --only "$name" \
    "$@" 2>&1 | tee -a "$out/bench.log" | tail -40
}
: > "$out/bench.log"
# Compiling qvl's and transformers' towers takes minutes: only --full times them.
tower_eager() { bench_module "$1" tower --skip "qvl compiled,hf sdpa compiled"; }
# flex_attention compiles per shape: every call but --full leaves it out of the attention benchmarks.
attention_no_flex() { bench_module "$1" "$2" --skip flex_attention; }

phase device
{
  date -u +"date: %Y-%m-%dT%H:%MZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, 'cuda', torch.version.cuda)"
  # The tool's copy carries the working tree; its .git can lag behind it, so say when the files differ from HEAD.
  echo "HEAD $(git rev-parse HEAD 2>/dev/null)$(git diff --quiet HEAD 2>/dev/null || echo ' (working tree differs)')"
  echo "mode: ${mode:-default}, budget ${budget_s} s"
} 2>&1 | tee "$out/device.txt"

# The split head-dim tilings (72 = 64 + 16; split32: 64 + 32) have run in the interpreter only: check them and the
# padded one on this device first, and run everything after in the layout that agreed (padded, the layout an H200
# ran right before, when the check finds both split tilings wrong or gives no verdict). --attention and --full
# check D 80 (Qwen2.5-VL) as well.
# A caller who set QVL_ATTENTION_HEAD_DIM (split, split32 or padded: what an earlier run's check chose, e.g. --tower
# after --attention on the same lease) skips the check.
set_layout() {
  export QVL_ATTENTION_HEAD_DIM="$1"
  echo "attention head-dim layout: $1 ($2)" | tee -a "$out/device.txt"
}
layout_check() {
  phase "head-dim layout check" "$1"
  # qvl check: every head-dim layout in a process of its own at once, against float64 on the cases that failed
  # before; it records this machine's verdicts and prints the layout the package now takes. Memcheck runs with the
  # CUDA tests. The check itself runs in no preset layout.
  local head_dims=(72) layout
  case "$mode" in --attention|--full) head_dims=(72 80) ;; esac
  env -u QVL_ATTENTION_HEAD_DIM timeout -k 5 "$1" python3 -m qvl.kernels.check --head-dims "${head_dims[@]}" \
    --timeout $(($1 - 10)) --no-memcheck --json "$out/check.json" 2>&1 | tee "$out/check.log" | tail -12
  layout="$(sed -n 's/^from the next process on: head_dim \([a-z0-9]*\) .*/\1/p' "$out/check.log" | tail -1)"
  if [ -n "$layout" ]; then
    set_layout "$layout" "chosen by qvl check"
  else
    set_layout padded "qvl check gave no verdict"
  fi
}
layout_check_skipped() { set_layout padded "the budget left qvl check no time"; }
# Where the check found a split layout wrong: the failure's shape before anything runs in the layout that is right
# (bench/diagnose_attention.py: each launch setting in its own process, where in its segment each case is off, then
# racecheck and synccheck).                                                               diagnose.log, diagnose.json
diagnose() {
  [ -f "$out/check.json" ] || return 0
  phase "split-layout diagnosis" "$1"
  timeout -k 5 "$1" python3 -m bench.diagnose_attention --from-check "$out/check.json" --timeout-s $(($1 - 10)) \
    --sanitizer --json "$out/diagnose.json" 2>&1 | tee "$out/diagnose.log" | tail -30
}
plan=()
case "${QVL_ATTENTION_HEAD_DIM:-}" in
  split|split32|padded)
    set_layout "$QVL_ATTENTION_HEAD_DIM" "given by the caller: QVL_ATTENTION_HEAD_DIM, no check in this run"
    ;;
  *)
    # Padded until the check chooses (what the steps run in should the budget leave the check no time).
    export QVL_ATTENTION_HEAD_DIM=padded
    case "$mode" in
      --attention) plan=("layout_check 160 60" "diagnose 75 0") ;;
      --full) plan=("layout_check 160 160" "diagnose 120 120") ;;
      --tower) plan=("layout_check 100 50") ;;
      *) plan=("layout_check 100 50" "diagnose 60 0") ;;
    esac
    ;;
esac

# The CUDA tests run verbose: xdist then names each test as it ends, so a log cut by the step's limit says which
# passed and which failed.
tower_tests() {
  phase "CUDA tests" "$1"
  timeout "$1" python3 -m pytest -v -p no:cacheprovider -n 4 tests/kernels/test_direct.py \
    tests/kernels/test_fast_launch.py tests/vit/test_graphs.py tests/vit/test_model.py \
    -k "cuda or gpu or direct" 2>&1 | tee "$out/gpu_tests.log" | tail -15
}

tile_sweep() {
  phase "tile sweep" "$1"
  # The sweep stops starting candidates at its budget; starting the processes and writing the table take the rest.
  local sweep_s=$(($1 - 20))
  ((sweep_s > ${TUNE_BUDGET_S:-35})) && sweep_s=${TUNE_BUDGET_S:-35}
  ((sweep_s < 1)) && sweep_s=1
  timeout "$1" python3 -m bench.tune_attention --budget-s "$sweep_s" 2>&1 | tee "$out/tune.log" | tail -12
  cp kernels/attention_tiles.json "$out/attention_tiles.json"
}

memcheck() {
  if ! command -v compute-sanitizer >/dev/null; then
    echo "compute-sanitizer not found: skipped"
    return 0
  fi
  timeout "$1" compute-sanitizer --tool memcheck --error-exitcode 1 python3 - <<'PY'
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
PY
}

# The CUDA tests and memcheck check results, time nothing: they run side by side (memcheck in its own process).
kernel_tests() {
  phase "CUDA tests and memcheck" "$1"
  memcheck "$1" > "$out/memcheck.log" 2>&1 &
  local memcheck_pid=$!
  local tests="tests/kernels tests/vit/test_model.py tests/vit/test_graphs.py"
  [ "$mode" = "--attention" ] && tests="tests/kernels/test_attention*.py"
  # shellcheck disable=SC2086
  timeout "$1" python3 -m pytest -v -p no:cacheprovider -n 4 $tests \
    -k "(gpu or cuda or bf16 or int64 or peak or guard_bands or direct) and not cuda_compile" 2>&1 \
    | tee "$out/gpu_tests.log" | tail -15
  wait "$memcheck_pid"
  tail -6 "$out/memcheck.log"
}

# qvl encode on the device against its tower alone on the same inputs (16 photos of 1920x1080, the 8B tower's shape
# with random weights): whether preparation hides behind the tower.                          encode.json, bench.log
encode_device() {
  phase "qvl encode on the device" "$1"
  timeout -k 5 "$1" python3 -m bench.bench_encode --device cuda --rounds 2 --json "$out/encode.json" 2>&1 \
    | tee -a "$out/bench.log" | tail -8
}

# qvl encode --ray on the device against one process (8, then 24 photos of 1920x1080, the demo tower): one tower
# actor on the GPU, a local Ray of 4 and of 15 CPUs (3 and 14 decoding beside it): whether Ray's decoding tasks keep
# the GPU fed, and what Ray adds a photo. Ray is not carried (too large for the tool): a machine without it prints one
# line and the step ends.                                                                  encode_ray.json, bench.log
encode_ray() {
  phase "qvl encode --ray on the device" "$1"
  timeout -k 5 "$1" python3 -m bench.bench_encode --device cuda --ray 8 24 --ray-cpus 4 15 --towers demo \
    --rounds 1 --json "$out/encode_ray.json" 2>&1 | tee -a "$out/bench.log" | tail -10
}

# timm's qwen3_vit_88m in a bf16 AMP training step (32 images of 224 x 224), timm eager against patch_model eager
# (the compiled rows left out: compiling takes minutes), where timm imports: a machine without it gets the copy the
# device tool carried in the checkout's .venv (carry .venv/lib/python3.X/site-packages/timm; timm's own dependencies,
# torchvision among them, must be there), linked into the shim's folder.                       timm.json, bench.log
timm_device() {
  phase "timm backbone on the device" "$1"
  local found
  if ! timeout 30 python3 -c "import timm" >/dev/null 2>&1; then
    for found in .venv/lib/python3*/site-packages/timm; do
      [ -d "$found" ] && [ ! -e "$shim/timm" ] && ln -s "$PWD/$found" "$shim/timm"
    done
  fi
  timeout -k 5 "$1" python3 -m bench.bench_timm --device cuda --batch 32 --rounds 5 \
    --skip "timm compiled,qvl compiled" --json "$out/timm.json" 2>&1 | tee -a "$out/bench.log" | tail -12
}

rows_sweep() {
  phase "bandwidth-kernel sweep" "$1"
  # As the tile sweep: its budget for candidates, the rest for starting and writing.
  local sweep_s=$(($1 - 25))
  ((sweep_s < 1)) && sweep_s=1
  timeout "$1" python3 -m bench.tune_rows --budget-s "$sweep_s" --json "$out/tune_rows.json" 2>&1 \
    | tee "$out/tune_rows.log" | tail -60
}

plots() {
  phase plots "$1" # one figure set of the whole run (each benchmark call drew its own modules' only)
  timeout "$1" python3 -m bench.plot "$out" 2>&1 | tail -5
}

goals() {
  phase goals "$1"
  local only=()
  case "$mode" in
    --attention) only=(--goals attention) ;;
    --tower) only=(--goals tower) ;;
  esac
  timeout "$1" python3 -m bench.goals "$out" "${only[@]}" 2>&1 | tee "$out/goals.txt"
}

# Each mode's steps after the layout check, most wanted first: "FUNCTION CAP FLOOR [WORDS]" (run_plan).
case "$mode" in
  --tower) plan+=(
    "tower_tests 75 35" "bench_module 40 20 host" "tower_eager 120 50" "bench_module 50 20 merger"
    "encode_device 60 0" "timm_device 45 0" "encode_ray 75 0" "rows_sweep 75 35" "bench_module 20 10 rotary" "bench_module 20 10 pos_embed" ) ;;
  --attention) plan+=(
    "tile_sweep 55 25" "kernel_tests 90 40" "attention_no_flex 90 40 attention"
    "attention_no_flex 60 25 attention_backward" "attention_no_flex 30 15 window" ) ;;
  --full) plan+=(
    # The long cases and the compiled towers: longer than a 15-minute lease holds with a rerun.
    "tile_sweep 55 55" "kernel_tests 90 90" "bench_module 60 60 host" "bench_module 240 240 attention"
    "bench_module 600 600 tower" "bench_module 120 120 merger" "bench_module 60 60 pos_embed"
    "bench_module 60 60 rotary" "bench_module 240 240 attention_backward" "bench_module 120 120 window" ) ;;
  *) plan+=(
    "tile_sweep 55 25" "kernel_tests 90 40" "bench_module 20 15 host" "attention_no_flex 40 25 attention"
    "tower_eager 60 40" "bench_module 30 15 merger" "bench_module 15 10 pos_embed" "bench_module 15 10 rotary"
    "attention_no_flex 30 15 attention_backward" "attention_no_flex 25 15 window" ) ;;
esac
run_plan "${plan[@]}" "plots 20 10" "goals 20 10"
phase "done"

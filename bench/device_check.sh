#!/usr/bin/env bash
# The one prepared call for a lent GPU machine: bash bench/device_check.sh [--attention | --tower | --full]
#                                                                                                (default: quick)
# --attention (under ~5 minutes): the attention phases alone: device, tile sweep, the attention CUDA tests (guard
# bands on the device included), memcheck, and the attention forward and forward + backward benchmarks (flex_attention
# left out: it compiles for every shape).
# --tower (under ~5 minutes; issue 31): device, the tower's CUDA tests (graph replay, sync-free forward, fast
# launches, the direct calls), then each benchmark under its own timeout, most wanted first: host time per op, the
# whole tower (quick: the 8B tower; eager, replayed and transformers + SDPA eager: the compiled towers take minutes
# to compile, the default and --full runs have them), the bandwidth kernels and mergers, rotary, the position table.
# No tile sweep and no memcheck: the packaged tile table is used.
# The default runs every phase with the benchmarks' quick cases.
#
# Nothing is installed there (no network): the repository's kernels/ and vit/ go on PYTHONPATH as the qvl package.
# Phases, each under its own timeout so that one hang cannot spend the lease (at most 7.5 minutes in all, so that a
# 15-minute lease holds its start and one rerun):
#   1. device, driver, versions, commit                                                   device.txt
#   2. the attention tile sweep (bench/tune_attention.py) within TUNE_BUDGET_S seconds (default 40); it writes
#      kernels/attention_tiles.json, which the tests and benchmarks after it then use  tune.log, attention_tiles.json
#   3. CUDA tests: bf16 correctness (TMA descriptor loads included), the sync-free forward
#      (set_sync_debug_mode("error")), CUDA-graph capture and replay, int64 offsets, peak memory  gpu_tests.log
#   4. compute-sanitizer memcheck of a small attention forward + backward, if the tool is there  memcheck.log
#   5. every GPU benchmark, with plots (python -m bench; not bench_cpu, whose subject is a CPU) *.json, *.png, bench.log
# Everything goes to bench/results/run-<date>-<UTC hhmm>/. Under the device tool ($OUT set: at most 8 files come back)
# that folder is also packed into $OUT/run-<date>.tar.gz, with device.txt and the logs' ends beside it, after every
# phase: a run cut short by the tool's limit still brings back the phases it finished.
set -uo pipefail
cd "$(dirname "$0")/.."
stamp="run-$(date -u +%Y%m%d-%H%M)"
out="bench/results/$stamp"
mkdir -p "$out"
shim="$(mktemp -d)"
mkdir -p "$shim/qvl" && ln -s "$PWD/kernels" "$shim/qvl/kernels" && ln -s "$PWD/vit" "$shim/qvl/vit"
export PYTHONPATH="$shim:$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
quick=--quick
mode="${1:-}"
[ "$mode" = "--full" ] && quick=
case "$mode" in
  ""|--full|--attention|--tower) ;;
  *) echo "usage: bash bench/device_check.sh [--attention | --tower | --full]" >&2; exit 2 ;;
esac
started=$SECONDS
ship() {
  [ -n "${OUT:-}" ] || return 0
  tar czf "$OUT/$stamp.tar.gz" -C bench/results "$stamp"
  for f in device.txt attention_tiles.json; do [ -f "$out/$f" ] && cp "$out/$f" "$OUT/"; done
  for log in gpu_tests tune bench; do [ -f "$out/$log.log" ] && tail -c 60000 "$out/$log.log" > "$OUT/$log-tail.log"; done
  return 0
}
phase() { ship; echo "=== $1 (at $((SECONDS - started)) s)"; }

phase device
{
  date -u +"date: %Y-%m-%dT%H:%MZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, 'cuda', torch.version.cuda)"
  # The tool's copy carries the working tree; its .git can lag behind it, so say when the files differ from HEAD.
  echo "HEAD $(git rev-parse HEAD 2>/dev/null)$(git diff --quiet HEAD 2>/dev/null || echo ' (working tree differs)')"
} 2>&1 | tee "$out/device.txt"

if [ "$mode" = "--tower" ]; then
  phase "CUDA tests"
  timeout 75 python3 -m pytest -q -p no:cacheprovider -n 4 tests/kernels/test_direct.py \
    tests/kernels/test_fast_launch.py tests/vit/test_graphs.py tests/vit/test_model.py \
    -k "cuda or gpu or direct" 2>&1 | tee "$out/gpu_tests.log" | tail -15
  : > "$out/bench.log"
  # The compiled towers (qvl's and transformers') are left out: compiling them takes minutes; the default and
  # --full runs time them.
  for bench in host:40 tower:120 merger:50 rotary:20 pos_embed:20; do
    phase "benchmark ${bench%%:*}"
    timeout "${bench##*:}" python3 -m bench --quick --dtype bf16 --json-dir "$out" --only "${bench%%:*}" \
      --skip "qvl compiled,hf sdpa compiled" 2>&1 | tee -a "$out/bench.log" | tail -40
  done
  phase done
  exit 0
fi

phase "tile sweep"
timeout 70 python3 -m bench.tune_attention --budget-s "${TUNE_BUDGET_S:-40}" 2>&1 | tee "$out/tune.log" | tail -12
cp kernels/attention_tiles.json "$out/attention_tiles.json"

phase "CUDA tests"
tests="tests/kernels tests/vit/test_model.py tests/vit/test_graphs.py"
[ "$mode" = "--attention" ] && tests="tests/kernels/test_attention*.py"
# shellcheck disable=SC2086
timeout 110 python3 -m pytest -q -p no:cacheprovider -n 4 $tests \
  -k "(gpu or cuda or bf16 or int64 or peak or guard_bands or direct) and not cuda_compile" 2>&1 \
  | tee "$out/gpu_tests.log" | tail -15

phase memcheck
if command -v compute-sanitizer >/dev/null; then
  timeout 50 compute-sanitizer --tool memcheck --error-exitcode 1 python3 - <<'EOF' 2>&1 | tee "$out/memcheck.log" | tail -6
import torch
import qvl.kernels  # noqa: F401
torch.manual_seed(0)
lengths = [1, 100, 64, 0, 300]
cu = torch.tensor([0, 1, 101, 165, 165, 465], dtype=torch.int32, device="cuda")
positions = torch.randint(0, 20, (sum(lengths), 2), dtype=torch.int32, device="cuda")
for head_dim in (72, 80, 64):
    for hint in (300, 64):
        qkv = torch.randn(sum(lengths), 3, 4, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        q, k, v = qkv.unbind(1)
        for pos in (positions, None):
            out = torch.ops.qvl.vision_attn(q, k, v, cu, hint, positions=pos)
            out.float().square().sum().backward()
torch.cuda.synchronize()
print("memcheck cases ran: vision_attn forward + backward with and without rope, bf16, D 72/80/64, both tile hints")
EOF
else
  echo "compute-sanitizer not found: skipped" | tee "$out/memcheck.log"
fi

phase benchmarks
if [ "$mode" = "--attention" ]; then
  timeout 150 python3 -m bench --quick --dtype bf16 --json-dir "$out" --only attention,attention_backward \
    --skip flex_attention 2>&1 | tee "$out/bench.log" | tail -60
else
  timeout 210 python3 -m bench $quick --dtype bf16 --json-dir "$out" \
    --only host,attention,tower,merger,pos_embed,rotary,attention_backward,window 2>&1 | tee "$out/bench.log" | tail -80
fi
phase done

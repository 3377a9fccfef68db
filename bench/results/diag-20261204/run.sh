set -u
shim="$(mktemp -d)"; mkdir -p "$shim/qvl" && ln -s "$PWD/kernels" "$shim/qvl/kernels" && ln -s "$PWD/vit" "$shim/qvl/vit"
export PYTHONPATH="$shim:$PWD" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
timeout 120 python3 .diag/diag.py fwd 2>&1 | grep -v Warning | tee $OUT/fwd.log
timeout 60 python3 .diag/diag.py bwd 2>&1 | grep -v Warning | tee $OUT/bwd.log
for c in aligned ragged ragged-rope windows aligned-pad ragged-pad; do
  CUDA_LAUNCH_BLOCKING=1 timeout 25 python3 .diag/diag.py $c 2>&1 | grep -v Warning | tail -4 | tee -a $OUT/tma.log
done

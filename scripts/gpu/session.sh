#!/usr/bin/env bash
# Device sessions on a CUDA machine. Results land in $OUT/gpu.tgz (+ the Triton cache in
# $OUT/tcache.tgz, which a later call can carry back as .tcache.tgz to skip recompiling).
#   bash scripts/gpu/session.sh call1   benchmark alone on the GPU, then determinism, long
#                                       sequence, sanitizer and the kernel/oracle GPU tests
#   bash scripts/gpu/session.sh call2   per-kernel reports and the GPU test suite
set -uo pipefail
PHASE=${1:?phase}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRITON_CACHE_DIR=$PWD/.tcache
R=$PWD/gpu_out; mkdir -p "$R" "$TRITON_CACHE_DIR"
[ -f .tcache.tgz ] && tar xzf .tcache.tgz -C "$TRITON_CACHE_DIR" 2>/dev/null
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
job() { local name=$1 t=$2; shift 2; ( timeout -s INT "$t" "$@" > "$R/$name.log" 2>&1; echo "exit=$?" >> "$R/$name.log" ) & }
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch,triton,sys;print('torch',torch.__version__,'triton',triton.__version__,'cuda',torch.version.cuda,'python',sys.version.split()[0])"
} > "$R/env-$PHASE.txt" 2>&1; cat "$R/env-$PHASE.txt"

if [ "$PHASE" = call1 ]; then
  el bench; timeout -s INT 230 python3 -m kernels.bench --quick --budget-s 170 --out "$R/bench" > "$R/bench.log" 2>&1; el "bench exit=$?"
  job det 250 python3 scripts/gpu/determinism.py --out "$R/determinism.json"
  job longseq 250 python3 scripts/gpu/long_seq.py --out "$R/long_seq.json"
  job gputests 250 python3 -m pytest -n 4 --hypothesis-profile=gpu -q -p no:cacheprovider tests/test_kernel.py tests/test_reference_exact.py tests/test_input_hashes.py tests/test_long_seq.py
  job memcheck 250 compute-sanitizer --tool memcheck --print-limit 20 python3 scripts/gpu/sanitize_cases.py
  job racecheck 250 compute-sanitizer --tool racecheck --print-limit 20 python3 scripts/gpu/sanitize_cases.py --ns 17,129,1000 --ds 40,128
  wait
fi
if [ "$PHASE" = reports ]; then
  V=${VERIFY_S:-400}
  for k in triton triton-fa1 sdpa-flash sdpa-efficient sdpa-cudnn sdpa-math flex; do
    job "run-$k" "$V" python3 -m verify run --kernel $k --device cuda --profile gpu --out "$R/reports/$k" --budget-s $((V-60)) -q
  done
  wait
fi
if [ "$PHASE" = call2 ]; then
  V=${VERIFY_S:-300}
  el bench; timeout -s INT 150 python3 -m kernels.bench --quick --budget-s 110 --out "$R/bench" > "$R/bench.log" 2>&1; el "bench exit=$?"
  el throughput; timeout -s INT 100 python3 scripts/gpu/throughput.py --kernel triton --device cuda --copies 4 --out "$R/throughput.json" > "$R/throughput.log" 2>&1; el "throughput exit=$?"
  for k in triton triton-fa1 sdpa-flash sdpa-efficient sdpa-cudnn sdpa-math flex; do
    job "run-$k" "$V" python3 -m verify run --kernel $k --device cuda --profile gpu --out "$R/reports/$k" --budget-s $((V-45)) -q
  done
  job gputests "$V" python3 -m pytest -n 4 --hypothesis-profile=gpu -q -p no:cacheprovider tests
  wait
fi
for f in "$R"/*.log; do echo "== $(basename "$f")"; tail -8 "$f"; done
tar czf "$OUT/gpu.tgz" -C "$R" . 2>/dev/null
ls -la "$OUT"; el done

#!/usr/bin/env bash
# Campaigns that must never lose a failure, on a CUDA machine (one device call, < 10 min).
# Logs land in $OUT/campaigns-<CAMPAIGN_TAG>.tgz (or ./gpu_campaigns when OUT is unset), written as the work
# goes, so a call cut short still returns them; summary.txt says PASS/FAIL per expectation.
#
#   bash scripts/gpu/fuzz_campaigns.sh            all phases
#   bash scripts/gpu/fuzz_campaigns.sh illegal    an illegal address on Nq > 64 (synchronous
#                                                 and asynchronous): cuda_error, confirmed in
#                                                 a fresh worker, shrunk to Nq = 65, replayed
#                                                 in a fresh process (exit 1); a sweep (run
#                                                 --jobs 4) where only those cases fail
#   bash scripts/gpu/fuzz_campaigns.sh faultrun   the sweep with faults alone (RUN_S budget;
#                                                 PASS when it exits within RUN_S + 30 s)
#   bash scripts/gpu/fuzz_campaigns.sh random     random reduction order / random result on
#                                                 the GPU: nondeterministic or flaky, exit 1,
#                                                 replay fails
#   bash scripts/gpu/fuzz_campaigns.sh healthy    our Triton kernel, 200 examples: exit 0 and
#                                                 the throughput with supervised workers
set -uo pipefail
PHASES=" ${*:-illegal random healthy} "
has() { [[ "$PHASES" == *" $1 "* ]]; }
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu: a dry run of the script's logic (random, healthy)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRITON_CACHE_DIR=$PWD/.tcache
R=${CAMPAIGN_DIR:-$PWD/gpu_campaigns}; mkdir -p "$R" "$TRITON_CACHE_DIR"
# Campaign lengths (minutes) and the faulty sweep's budget (s); shorter ones fit the phases
# side by side into one device call.
MIN_ILLEGAL=${MIN_ILLEGAL:-2.5}; MIN_RANDOM=${MIN_RANDOM:-1.5}; RUN_S=${RUN_S:-180}
TAG=${CAMPAIGN_TAG:-all}
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
pack() { [ -n "${OUT:-}" ] && tar czf "$OUT/campaigns-$TAG.tgz" -C "$R" . 2>/dev/null; true; }
trap pack EXIT
SUMMARY=$R/summary.txt; : > "$SUMMARY"
expect() {  # expect NAME WANT_RC GOT_RC [GREP_PATTERN FILE]
  local ok=PASS
  [ "$2" = "$3" ] || ok=FAIL
  if [ $# -ge 5 ] && ! grep -q -- "$4" "$5"; then ok=FAIL; fi
  echo "$ok $1 (exit $3, want $2${4:+; want '$4' in $(basename "${5:-}")})" | tee -a "$SUMMARY"
}
fuzz() {  # fuzz NAME SECONDS ARGS...: one campaign, its log and exit status
  local name=$1 t=$2; shift 2
  el "fuzz $name" >&2
  timeout -s TERM "$t" python -m flashcheck fuzz --device "$DEVICE" --out "$R/$name" "$@" \
    > "$R/$name.log" 2>&1
  echo $?
}
replay() {  # replay NAME KERNEL CLASS: the campaign's failure file in a fresh process
  local name=$1 kernel=$2 cls=$3 f
  f=$(ls "$R/$name/failures/"*.json 2>/dev/null | head -1)
  if [ -z "$f" ]; then echo "FAIL $name: no failure file" | tee -a "$SUMMARY"; return; fi
  python -m flashcheck repro "$f" --kernel "$kernel" --device "$DEVICE" > "$R/$name-repro.log" 2>&1
  expect "$name replay" 1 $? "$cls" "$R/$name-repro.log"
}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch,triton;print('torch',torch.__version__,'triton',triton.__version__)"
} > "$R/env.txt" 2>&1

if has illegal; then
  K=tests/misbehaving_triton.py
  rc=$(fuzz illegal 200 --kernel $K:illegal_address_large --minutes "$MIN_ILLEGAL" --max-n 256 --seed 1)
  expect "illegal: campaign ends in budget with a cuda_error" 1 "$rc" "FAIL cuda_error" \
    "$R/illegal.log"
  grep -q "reproduced in a fresh worker\|Nq65" "$R/illegal.log" \
    && echo "PASS illegal: confirmed or shrunk to Nq65" | tee -a "$SUMMARY" \
    || echo "FAIL illegal: neither confirmation nor Nq65 in the log" | tee -a "$SUMMARY"
  replay illegal $K:illegal_address_large "(cuda_error)"
  rc=$(fuzz illegal_async 200 --kernel $K:illegal_address_async --minutes "$MIN_ILLEGAL" --max-n 256 \
       --seed 1)
  expect "illegal_async: campaign records the fault" 1 "$rc" "FAIL \(cuda_error\|crashed\)" \
    "$R/illegal_async.log"
  replay illegal_async $K:illegal_address_async "fail"
fi
if has illegal || has faultrun; then
  K=tests/misbehaving_triton.py
  el "run --jobs 4 (sweep with faults)"
  t_run=$(date +%s)
  timeout -s TERM $((RUN_S + 60)) python -m flashcheck run --kernel $K:illegal_address_large --device "$DEVICE" \
    --jobs 4 --budget-s "$RUN_S" --out "$R/illegal_run" --quiet > "$R/illegal_run.log" 2>&1
  rc=$?
  expect "illegal_run: sweep exits 1 and keeps every record" 1 "$rc" "cuda_error" \
    "$R/illegal_run/report.md"
  took=$(( $(date +%s) - t_run ))
  ok=PASS; [ "$took" -le $((RUN_S + 30)) ] || ok=FAIL
  echo "$ok illegal_run: exited after $took s (budget $RUN_S s)" | tee -a "$SUMMARY"
fi

if has random; then
  K=tests/misbehaving_kernels.py
  for k in random_order random_wrong first_use_wrong; do
    rc=$(fuzz "$k" 120 --kernel $K:$k --minutes "$MIN_RANDOM" --max-n 512 --seed 1)
    expect "$k: campaign exits 1" 1 "$rc" "FAIL" "$R/$k.log"
    replay "$k" $K:$k "fail"
  done
fi

if has healthy; then
  rc=$(fuzz healthy 300 --kernel triton --examples 200 --seed 1)
  expect "healthy: our kernel passes 200 examples" 0 "$rc" "examples in" "$R/healthy.log"
  grep "examples in" "$R/healthy.log" | tee -a "$SUMMARY"
fi
el "done"
cat "$SUMMARY"

#!/usr/bin/env bash
# Device sessions on a CUDA machine (one call each, <= 10 minutes). Results land in
# $OUT/gpu.tgz. Logs are written as the work goes, so a call cut short still returns them.
#   bash scripts/gpu/session.sh bench     the benchmark matrix alone on the GPU (compiled in
#                                         parallel first, --prewarm; BENCH_TRITON39=1: under
#                                         triton 3.9, carry .triton), then each row of ours
#                                         against docs/benchmarks' run of this GPU
#                                         (scripts/bench_compare.py: bench-compare.md)
#   bash scripts/gpu/session.sh verify    per-kernel reports of the GPU sweep (--jobs), with
#                                         the harness throughput measured on a warm cache
#   bash scripts/gpu/session.sh ncu       ncu on one forward+backward of ours and of cuDNN
#                                         (NCU_TRITON39=1: under triton 3.9, carry .triton;
#                                         then ours is the Gluon one unless FLASHCHECK_GLUON_BWD=off)
#   bash scripts/gpu/session.sh sweep     our kernel's launch points and schedule flags timed
#                                         beside cuDNN (scripts/gpu/sweep_hopper.py; SWEEP_ARGS:
#                                         e.g. "--d 64"), docs/benchmarks/sweep.md
#   bash scripts/gpu/session.sh suite     the harness throughput without a compiler
#                                         (sdpa-math; 1 and 8 processes), then the whole test
#                                         suite on CUDA (tox -e gpu's tests, as two runs:
#                                         the "long" ones and the rest, side by side)
#   bash scripts/gpu/session.sh peers     the SDPA backends' reports alone (efficient, cuDNN,
#                                         math; 5 workers each)
#   bash scripts/gpu/session.sh checks    determinism, long sequence, sanitizer (memcheck and
#                                         racecheck) and the kernel/oracle GPU tests
#   bash scripts/gpu/session.sh throughput  the harness throughput alone (sdpa-math, no compiler;
#                                         TP_JOBS processes, default "1 8 14"; MPS_JOBS: the
#                                         same again under the CUDA MPS server)
#   bash scripts/gpu/session.sh tpdiag    the harness throughput in one process three ways: one
#                                         OpenMP thread, the default threads, and with cProfile
#                                         of the parent and the worker (where the time goes)
#   bash scripts/gpu/session.sh subnormals  which CUDA operations flush subnormal results
#   bash scripts/gpu/session.sh repro     replays our kernels' committed GPU failure files, and
#                                         breaks sdpa-math's fp32 subnormal case into stages
#   bash scripts/gpu/session.sh gate      the CI gate on CUDA: --update (writes this GPU's budgets
#                                         file, copied to $R), then the gate twice on them
#   bash scripts/gpu/session.sh outside   published Triton kernels' campaigns (docs/reports/outside;
#                                         their packages unpacked under .whl/site, carried)
#   bash scripts/gpu/session.sh fwdab     the Gluon forward against .ab/OLD's (gluon_fwd_ab.py:
#                                         bits, then timed beside cuDNN; triton 3.9, carry
#                                         .triton and .ab); fwdab-checks: its GPU tests and
#                                         racecheck/synccheck on its shapes
#   bash scripts/gpu/session.sh detach PHASES  runs `session.sh PHASES` in a new process
#                                         session, which outlives the device call (campaigns
#                                         longer than one call), marker gpu_out/campaigns.done
#   bash scripts/gpu/session.sh collect   waits (COLLECT_S, default 400 s) for that marker
#   bash scripts/gpu/session.sh family    the family-based rule on the GPU: the harness throughput
#                                         (sdpa-math, one process) alone first, then side by side:
#                                         a --keep-going fuzz campaign on each PyTorch backend and
#                                         our two kernels (FUZZ_MIN minutes, fresh seed FUZZ_SEED),
#                                         the precision mutants (200 examples each), and the gate
#                                         (FAMILY_TP=0: no throughput; FAMILY_MUTANTS=0: no
#                                         mutants; FAMILY_KERNELS: which kernels;
#                                         FUZZ_GRACE: seconds past
#                                         FUZZ_MIN before a campaign is stopped, default 150)
#   bash scripts/gpu/session.sh benchragged  bench_ragged.py alone on the GPU: the varlen and
#                                         decode kernels beside flex, SDPA per sequence and
#                                         fasterkernels' paged decode (BENCH_RAGGED_ARGS=--quick)
#   bash scripts/gpu/session.sh ragged    side by side, a --keep-going fuzz campaign each on
#                                         triton-varlen, triton-decode, their PyTorch peers and the
#                                         fasterkernels paged adapter (RAGGED_MIN minutes;
#                                         RAGGED_KERNELS: which of them)
#   bash scripts/gpu/session.sh scale     `flashcheck fuzz --workers N` for N in SCALE_N (default
#                                         "1 2 4 8 16") on each of SCALE_KERNELS (default
#                                         sdpa-math), SCALE_S seconds each (default 30), then
#                                         examples/s of every run so far in scale.json;
#                                         SCALE_COLD=1: each run starts from an empty Triton cache;
#                                         SCALE_ARGS: more fuzz options (e.g. --oracle-device
#                                         device), SCALE_TAG: a suffix for the runs' names
#   bash scripts/gpu/session.sh replays   replays the committed GPU false-alarm cases that new
#                                         family members explain (tests/data/*_h200_*.json,
#                                         *_h100_*.json, h200/ragged/sdpa-varlen), side by side
#   bash scripts/gpu/session.sh reuse     a cold-cache fuzz campaign of REUSE_KERNEL (default
#                                         triton) for REUSE_S seconds (default 60), without and
#                                         with --reuse-compiled, each from an empty Triton cache
#   bash scripts/gpu/session.sh kernel    our kernel after a change, side by side: a --keep-going
#                                         fuzz campaign (KERNEL_MIN minutes, default 10, 8
#                                         workers, seed FUZZ_SEED), the gate on the committed
#                                         budgets (no --update; KERNEL_UPDATE=1: then again
#                                         with --update), memcheck, racecheck and the
#                                         determinism check; longer than one call: run it as
#                                         `detach kernel`, then `collect`. KERNEL_TRITON39=1:
#                                         under triton 3.9 (carry .triton); with
#                                         FLASHCHECK_GLUON_BWD other than off also campaigns of
#                                         both gluon_bwd_domain.py entries (every case runs the
#                                         Gluon backward; the triton campaign on 4 workers);
#                                         KERNEL_FWD_PERSIST=1: with the persistent Gluon
#                                         forward where fwdpersist's tests passed in the call;
#                                         KERNEL_FWD_DOMAIN=1: also gluon_domain.py's campaign
#                                         (every case runs the Gluon forward; 3 workers)
#   bash scripts/gpu/session.sh ab        our kernel from this checkout and from the tree in .ab/OLD
#                                         (carried; `git archive COMMIT | tar -x -C .ab/OLD` here),
#                                         timed in alternation (scripts/gpu/ab_time.py; AB_ARGS:
#                                         e.g. "--d 64 --rounds 3")
#   bash scripts/gpu/session.sh bwd39     the five-product Gluon backward under triton 3.9 (carry
#                                         .triton: `bash scripts/gpu/triton_slim.sh pack 3.9.0`
#                                         here): scripts/gpu/gluon_bwd.py (every form timed and
#                                         checked beside ours and cuDNN, the ordered forms in a
#                                         call of their own; BWD39_D, default "128,64"), the
#                                         GPU tests of the Gluon paths, racecheck, memcheck and
#                                         synccheck on every form (--check-small),
#                                         BWD39_MIN minutes (default 3) of `flashcheck fuzz` on
#                                         gluon_bwd_domain.py's :attention and :attention_ordered
#                                         in each form (FLASHCHECK_GLUON_BWD) side by side, the
#                                         gate under BWD39_FORM, then
#                                         each form's verdict (scripts/gpu/bwd39_verdict.py:
#                                         bwd39-verdict.md), then the quick bench under
#                                         BWD39_FORM (default writer);
#                                         longer than one call: `detach bwd39`, then `collect`
#   bash scripts/gpu/session.sh fwdpersist  the Gluon forward's persistent grid: GPU tests,
#                                         timed beside the per-tile kernel, ours and cuDNN
#                                         (FWDP_MATRIX=1: the 24 forwards too), sanitizers
#   bash scripts/gpu/session.sh accept    the issue's acceptance run: the quick bench under
#                                         triton 3.9 (carry .triton) with the Gluon backward's
#                                         ACCEPT_BWD form (default auto), once per forward
#                                         mode in ACCEPT_FWD (default "auto tile"; auto
#                                         and persistent only where fwdpersist's tests
#                                         passed)
#   bash scripts/gpu/session.sh d64ab     the D = 64 matrix rows of this checkout against the
#                                         issue-time kernels (d64_base: .ab/SLIM or .ab/BASE;
#                                         scripts/gpu/ab_time.py) under triton 3.6, then 3.9
#                                         (carry that tree and .triton)
#   bash scripts/gpu/session.sh spread    the causal forward, ours and cuDNN's, alternated over
#                                         rounds and fresh processes (causal_spread.py, triton
#                                         3.9, carry .triton; SPREAD_PROCS, default 5) with the
#                                         GPU's SM clock, power, temperature and clock-event
#                                         reasons logged every 100 ms beside it (spread-smi.csv)
#   bash scripts/gpu/session.sh power     forwards back to back beside nvidia-smi's SM clock,
#                                         power and power-cap reason (power_draw.py, triton 3.9,
#                                         carry .triton): fp16 D 64 16K ours (auto, off),
#                                         cuDNN's and the issue-time tree's (d64_base, where
#                                         carried), then bf16 D 128 4K causal ours and cuDNN's
#                                         (POWER_ARGS: more options for both)
#   bash scripts/gpu/session.sh d64ncu    ncu on the fp16 D = 64 16K forward of the issue-time
#                                         kernels (d64_base) and of this checkout, one launch
#                                         each (triton 3.9, carry .triton and the base tree)
#   bash scripts/gpu/session.sh stagesab  the Gluon kernels' ring depth at D = 64 under triton 3.9
#                                         (carry .triton): for each depth of STAGES_DEPTHS
#                                         (default "3 4") a copy of this checkout's kernels with
#                                         that depth at D = 64 (.ab/stagesN, made here) against
#                                         this one: the forward's bits and time in one process
#                                         (gluon_fwd_ab.py --d 64, N 4K and 16K), then with
#                                         STAGES_AB=1 the D = 64 matrix rows alternated in fresh
#                                         processes (ab_time.py: forward and backward)
#   bash scripts/gpu/session.sh dqswz     the Gluon backward's dQ staging tile swizzled 32 bytes
#                                         against the default 128 under triton 3.9 (carry
#                                         .triton): GPU tests (bits), quick benches in
#                                         alternation, ncu with source counters on _bwd_kernel
#   bash scripts/gpu/session.sh late      after the phases before it (put it last): bwdgap
#                                         and the quick bench once more, under triton 3.9
#   bash scripts/gpu/session.sh bwdgap    the backward timed four ways under triton 3.9 (carry
#                                         .triton): the bench's replay after an L2 flush, the
#                                         replay alone, after a fresh forward, forward+backward
#                                         less forward, with each way's kernels
#                                         (scripts/gpu/bwd_gap.py; sweep.md round 20's gap)
#   bash scripts/gpu/session.sh d64gap    bwd_gap.py at D = 64 under triton 3.9 (carry .triton),
#                                         once per forward mode in D64GAP_FWD (default "auto
#                                         tile": the persistent Gluon forward, and the Triton
#                                         forward it replaced below 4097 keys): which kernel's
#                                         time, or which gap between them, makes round 22's
#                                         D 64 forward+backward slower than its parts
#   bash scripts/gpu/session.sh stateb    scripts/gpu/bwd_alloc.py under triton 3.9 (carry
#                                         .triton), three processes: as in round 22 (the
#                                         inputs moved), --small-pad (the turn counters moved
#                                         too), --empty-cache (the bench's allocator emptying):
#                                         which one brings the causal ordered backward's 7.3 ms;
#                                         then the GPU test of TURN_STRIDE 32 (a counter per
#                                         128-byte line) and, if it passes, --small-pad and the
#                                         quick bench (3 rounds) with it
#   bash scripts/gpu/session.sh bwdrace   racecheck's hazards in the Gluon kernels under triton
#                                         3.9 (carry .triton), each with its threads and
#                                         addresses (--racecheck-report hazard), and the SASS
#                                         of every compiled _bwd_kernel / _fwd_kernel beside
#                                         its metadata; traced anywhere after: race_trace.py
#                                         compile (no GPU), then trace on bwdrace-hazards.log
#                                         (BWDRACE_BG=1: beside the phases after it)
# Several phases may share one call (session.sh throughput peers); they run in this file's order.
# NEED_GPU=H200 (any part of nvidia-smi's name): on another card the call stops at once with
# exit 3 before any phase (a machine named for the H200 may be an H100: a call that only
# counts there then costs its start, not the phases' minutes).
set -uo pipefail
: "${1:?phase}"
if [ -n "${NEED_GPU:-}" ]; then
  gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  if [[ "$gpu_name" != *"$NEED_GPU"* ]]; then
    echo "session.sh: NEED_GPU=$NEED_GPU but this machine's GPU is '${gpu_name:-none found}'; no phase run" >&2
    exit 3
  fi
fi
if [ "$1" = detach ]; then
  shift; mkdir -p gpu_out; rm -f gpu_out/campaigns.done
  OUT=/tmp/detached-out setsid bash -c "mkdir -p /tmp/detached-out; bash $0 $*; touch gpu_out/campaigns.done" \
    > gpu_out/detached.log 2>&1 < /dev/null &
  echo "detached: session.sh $* (pid $!)"; exit 0
fi
PHASES=" $* "
has() { [[ "$PHASES" == *" $1 "* ]]; }
# (joined by "_": a returned file's name may hold letters, digits, ".", "-" and "_" only)
PHASE="$*"; PHASE=${PHASE// /_}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRITON_CACHE_DIR=$PWD/.tcache
# Many compiling processes at once: one Inductor compile worker each, not one per core.
export TORCHINDUCTOR_COMPILE_THREADS=1
# GPU_R=$OUT/r: results written straight under $OUT, so a call cut at its limit still
# returns them (the tarball is written only when the script exits); a call that ends packs
# them into $OUT/gpu.tgz all the same and removes the loose copies, since a call returns
# 8 files at most.
R=${GPU_R:-$PWD/gpu_out}; mkdir -p "$R" "$TRITON_CACHE_DIR"
T0=$(date +%s)
# each line with the GPU's clocks, temperature, power and active clock-limit reasons, and
# the host's load average (a backward whose time moves between phases: sweep.md round 21)
gpu_state() {
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active \
    --format=csv,noheader 2>/dev/null | head -1 | tr -d ' '
}
el() { echo "[$(( $(date +%s) - T0 ))s] $* {gpu $(gpu_state); load $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)}"; }
job() { local name=$1 t=$2; shift 2; ( timeout -s TERM "$t" "$@" > "$R/$name.log" 2>&1; echo "exit=$?" >> "$R/$name.log" ) & }
# the quick bench with the Gluon backward's ACCEPT_BWD form into $R/NAME (NAME.log), and
# scripts/gpu/bwd_gap.py into $R/NAME.json: the acceptance run's two timings
# the quick bench in ACCEPT_ROUNDS rounds (default 6: single rounds of both forwards move by
# 10-25 % within one process, sweep.md round 27, so a row is the median of six round-robin
# timings on fresh tensors; the rounds' range in the note; about 80 s on the H100)
quick_bench() { FLASHCHECK_GLUON_BWD=${ACCEPT_BWD:-auto} timeout -s TERM 500 \
  python3 -m flashcheck.kernels.bench --quick --rounds "${ACCEPT_ROUNDS:-6}" --out "$R/$1" \
  > "$R/$1.log" 2>&1; }
bwd_gap() { timeout -s TERM 300 python3 scripts/gpu/bwd_gap.py --out "$R/$1.json" > "$R/$1.log" 2>&1; }
pack() {
  tar czf "$OUT/gpu.tgz" --exclude=hypothesis-db -C "$R" . 2>/dev/null || return
  if [ -n "${GPU_R:-}" ]; then rm -rf "$R"; fi
  return 0
}
# triton 3.9 (carried in .triton) for this and the later phases, with a cache of its own;
# what it set up goes to $R/env-NAME.txt
use_triton39() { . scripts/gpu/triton_slim.sh use > "$R/env-$1.txt" 2>&1; export TRITON_CACHE_DIR=$PWD/.tcache39; }
# the issue-time kernels' tree for d64ab and d64ncu: D64AB_BASE, else .ab/SLIM (the kernels
# alone, 0.2 MB: it fits the carry beside .triton) where carried, else .ab/BASE
d64_base() {
  if [ -n "${D64AB_BASE:-}" ]; then echo "$D64AB_BASE"
  elif [ -d .ab/SLIM/kernels ]; then echo .ab/SLIM
  else echo .ab/BASE; fi
}
# the device's own triton again (what use_triton39 set, undone), for a phase that must time
# under it after a phase of the same call took 3.9
use_device_triton() {
  unset TRITON_BACKENDS_IN_TREE TRITON_DEFAULT_FP_FUSION TRITON_PTXAS_BLACKWELL_PATH TRITON_PTXAS_PATH
  export PYTHONPATH=$PWD TRITON_CACHE_DIR=$PWD/.tcache
}
trap pack EXIT
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch,triton,sys;print('torch',torch.__version__,'triton',triton.__version__,'cuda',torch.version.cuda,'python',sys.version.split()[0])"
  nproc
} > "$R/env-$PHASE.txt" 2>&1; cat "$R/env-$PHASE.txt"

NCU_SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SchedulerStats --metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum"
# (the metrics: shared-memory bank conflicts of loads and stores through the LSU, beside all
# shared-memory wavefronts; TMA and wgmma operand reads do not go through the LSU)
# One kernel's GPU-profile report: rep KERNEL JOBS SECONDS (the budget leaves 25 s to write).
rep() { local k=$1 j=$2 t=$3; timeout -s TERM "$t" python3 -m flashcheck run --kernel "$k" \
  --device cuda --profile gpu --jobs "$j" --out "$R/reports/$k" --budget-s $((t-25)) -q \
  > "$R/run-$k.log" 2>&1; echo "exit=$?" >> "$R/run-$k.log"; }

if has bench; then
  el bench
  if [ "${BENCH_TRITON39:-0}" = 1 ]; then  # the Gluon backward, the defaults as shipped
    use_triton39 bench39
  fi
  timeout -s TERM "${BENCH_S:-560}" python3 -m flashcheck.kernels.bench --prewarm "${PREWARM:-14}" \
    --prewarm-timeout-s "${PREWARM_S:-200}" --budget-s "${BUDGET_S:-330}" --out "$R/bench" \
    ${BENCH_ARGS:-} > "$R/bench.log" 2>&1
  el "bench exit=$?"
  # every configuration of ours against the committed run of this GPU (scripts/bench_compare.py)
  for j in "$R"/bench/bench_*.json; do
    if [ -f "$j" ] && [ -f "docs/benchmarks/$(basename "$j")" ]; then
      python3 scripts/bench_compare.py "docs/benchmarks/$(basename "$j")" "$j" \
        --md "$R/bench-compare.md" > /dev/null 2>&1
      el "bench compare exit=$? (1: a row slower beyond the drift)"
    else
      el "bench compare: no run of this GPU under docs/benchmarks"
    fi
  done
fi
if has bwd39; then
  el bwd39
  use_triton39 bwd39
  # the forms as their adds come, then the ordered ones: a hang in one call keeps the other's
  timeout -s TERM 300 python3 scripts/gpu/gluon_bwd.py --d "${BWD39_D:-128,64}" \
    --forms split,writer --out "$R/bwd39.json" > "$R/bwd39.log" 2>&1
  el "bwd39 exit=$?"
  timeout -s TERM 300 python3 scripts/gpu/gluon_bwd.py --d "${BWD39_D:-128,64}" \
    --forms split_ordered,writer_ordered --out "$R/bwd39_ordered.json" > "$R/bwd39_ordered.log" 2>&1
  el "bwd39 ordered exit=$?"
  python3 scripts/gpu/gluon_bwd.py --table "$R/bwd39.json" "$R/bwd39_ordered.json" > "$R/bwd39.md" 2>&1
  job bwd39-pytest 330 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_flash_gluon_bwd.py tests/test_flash_gluon.py
  # every report printed, so that the verdict can tell Triton's loader probe from the rest
  for tool in racecheck memcheck synccheck; do
    job "bwd39-$tool" 300 compute-sanitizer --tool $tool --print-limit 1000 \
      python3 scripts/gpu/gluon_bwd.py --check-small
  done
  # 12 campaign workers, the tests and the sanitizers share the GPU's memory: the harness's
  # float64 bounds of an N = 2048 case take GiBs, and a cached block kept by one worker
  # is memory another cannot have
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  for entry in attention attention_ordered; do
    for form in split writer; do
      job "bwd39-fuzz-$entry-$form" $(( ${BWD39_MIN:-3} * 60 + 150 )) \
        env FLASHCHECK_GLUON_BWD=$form python3 -m flashcheck fuzz \
        --kernel "scripts/gpu/gluon_bwd_domain.py:$entry" --device cuda --minutes "${BWD39_MIN:-3}" \
        --keep-going --seed "${FUZZ_SEED:-20261213}" --workers 3 --out "$R/bwd39-fuzz-$entry-$form"
    done
  done
  wait
  el "bwd39 fuzz done"
  # the gate on the committed budgets with BWD39_FORM on (its deterministic calls take the
  # ordered form), after the campaigns: beside them it ran the GPU out of memory
  job bwd39-gate 400 env FLASHCHECK_GLUON_BWD="${BWD39_FORM:-writer}" python3 -m flashcheck \
    gate --device cuda --jobs 8 --out "$R/bwd39-gate"
  wait
  el "bwd39 gate done"
  python3 scripts/gpu/bwd39_verdict.py "$R" --json "$R/bwd39-verdict.json" > "$R/bwd39-verdict.md" 2>&1
  el "bwd39 verdict exit=$? (0: a mode passes; bwd39-verdict.md names it)"
  FLASHCHECK_GLUON_BWD=${BWD39_FORM:-writer} timeout -s TERM 400 python3 -m flashcheck.kernels.bench \
    --quick --out "$R/bench-bwd39" > "$R/bench-bwd39.log" 2>&1
  el "bwd39 bench exit=$?"
fi
if has fwdpersist; then
  # the Gluon forward's persistent grid (FLASHCHECK_GLUON=persistent) under the device's
  # triton: its GPU tests (bitwise the per-tile kernel's), both timed beside ours and cuDNN
  # in one process (FWDP_MATRIX=1: also the benchmark matrix's 24 forwards), and
  # compute-sanitizer on its own shapes
  el fwdpersist
  timeout -s TERM 300 python3 -m pytest -q -p no:cacheprovider -n "${GPU_PYTEST_N:-6}" -m gpu \
    tests/test_flash_gluon.py > "$R/fwdpersist-pytest.log" 2>&1
  FWDP_PYTEST=$?; el "fwdpersist pytest exit=$FWDP_PYTEST"
  timeout -s TERM 240 python3 scripts/gpu/gluon_fwd.py --only "2wg 64x128 stages=2" \
    --only "2wg persistent" --out "$R/fwdpersist.json" > "$R/fwdpersist.log" 2>&1
  el "fwdpersist timing exit=$?"
  if [ "${FWDP_MATRIX:-0}" = 1 ]; then
    timeout -s TERM 400 python3 scripts/gpu/gluon_fwd.py --matrix --out "$R/fwdpersist-matrix.json" \
      > "$R/fwdpersist-matrix.log" 2>&1
    el "fwdpersist matrix exit=$?"
  fi
  # FWDP_SANITIZE=0: without them (a call short of time runs them after its timings)
  for tool in $([ "${FWDP_SANITIZE:-1}" = 1 ] && echo racecheck synccheck memcheck); do
    job "fwdpersist-$tool" 200 env FLASHCHECK_GLUON=persistent compute-sanitizer --tool $tool \
      --print-limit 1000 python3 scripts/gpu/sanitize_cases.py --ns 128,256 --ds 128
  done
  wait
  el "fwdpersist sanitizers done"
fi
if has fwdab; then
  # a change of the Gluon forward against another tree's (carry .ab; AB_OLD, default
  # .ab/OLD) under triton 3.9: bits on every problem of gluon_fwd_ab.py, then both timed
  # beside cuDNN in one process (AB_ROUNDS rounds, default 3); the phase fwdab-checks
  # (below: the forward's GPU tests, racecheck and synccheck on its shapes) can run beside
  # a detached campaign
  el fwdab
  use_triton39 fwdab
  # shellcheck disable=SC2086  # AB_ARGS: more of gluon_fwd_ab.py's options, e.g.
  # --variants c3,c3+early+split (AB_TIMEOUT seconds, default 300); AB_PREWARM processes
  # (default 12) compile every kernel of the run first, side by side
  timeout -s TERM "${AB_TIMEOUT:-300}" python3 scripts/gpu/gluon_fwd_ab.py \
    --old "${AB_OLD:-.ab/OLD}" --rounds "${AB_ROUNDS:-3}" --prewarm "${AB_PREWARM:-12}" \
    ${AB_ARGS:-} --out "$R/fwdab.json" > "$R/fwdab.log" 2>&1
  el "fwdab exit=$?"
fi
if has fwdab-checks; then
  el fwdab-checks
  use_triton39 fwdab-checks
  # GPU_PYTEST_N workers (default 6): the tests are compile-bound; 68 tests in 78 s with six
  # on an H100 against ~420 s one at a time (sweep.md rounds 32-33)
  timeout -s TERM 400 python3 -m pytest -q -p no:cacheprovider -n "${GPU_PYTEST_N:-6}" -m gpu \
    tests/test_flash_gluon.py > "$R/fwdab-pytest.log" 2>&1
  el "fwdab-checks pytest exit=$?"
  # SAN_SCHEDULE: the forward's schedule under the sanitizers too (a second pass per tool),
  # e.g. c3+early+split (sanitize_cases.py --schedule)
  for tool in racecheck synccheck; do
    for sched in "" ${SAN_SCHEDULE:-}; do
      timeout -s TERM 300 compute-sanitizer --tool $tool --print-limit 1000 python3 \
        scripts/gpu/sanitize_cases.py --ns 128,256 --ds 64,128 ${sched:+--schedule "$sched"} \
        > "$R/fwdab-$tool${sched:+-$sched}.log" 2>&1
      el "fwdab-checks $tool${sched:+ $sched} exit=$?"
    done
  done
fi
if has accept; then
  # the issue's acceptance run: the quick bench (bf16, D 128, N 4096, causal and not; ours
  # beside cuDNN, flex and SDPA-flash) under triton 3.9 with the Gluon backward's ACCEPT_BWD
  # form (default auto), once per Gluon forward mode in ACCEPT_FWD (default "auto tile":
  # the default, which takes the persistent grid up to 4096 keys at D 128, and per tile;
  # the modes launching the persistent grid only where fwdpersist's GPU tests passed in
  # this call)
  el accept
  use_triton39 accept
  for mode in ${ACCEPT_FWD:-auto tile}; do
    if [ "$mode" != tile ] && [ "$mode" != off ] && [ "${FWDP_PYTEST:-0}" != 0 ]; then
      el "accept $mode skipped: fwdpersist's GPU tests failed"; continue
    fi
    FLASHCHECK_GLUON=$mode quick_bench "accept-$mode"
    el "accept $mode exit=$?"
  done
fi
if has dqswz; then
  # the Gluon backward's dQ staging tile with a 32-byte swizzle against the default 128
  # (FLASHCHECK_GLUON_BWD_DQ_SWIZZLE; scripts/smem_bank_conflicts.py: 128 doubles the
  # wavefronts of its stores) under triton 3.9: its GPU tests (the same bits), then the quick
  # bench in alternation (DQSWZ_ROUNDS, default 2) and ncu with the source counters on
  # _bwd_kernel alone, each way
  el dqswz
  use_triton39 dqswz
  timeout -s TERM 300 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_flash_gluon_bwd.py -k dq_swizzle > "$R/dqswz-pytest.log" 2>&1
  DQSWZ_PYTEST=$?; el "dqswz pytest exit=$DQSWZ_PYTEST"
  if [ $DQSWZ_PYTEST = 0 ]; then
    for round in $(seq "${DQSWZ_ROUNDS:-2}"); do
      for swz in 128 32; do
        FLASHCHECK_GLUON_BWD_DQ_SWIZZLE=$swz quick_bench "dqswz-$swz-$round"
        el "dqswz bench $swz round $round exit=$?"
      done
    done
    for swz in 128 32; do
      FLASHCHECK_GLUON_BWD_DQ_SWIZZLE=$swz timeout -s TERM 150 ncu --clock-control none \
        --profile-from-start off -k regex:_bwd_kernel $NCU_SECTIONS --section SourceCounters \
        python3 scripts/gpu/profile_one.py --impl triton > "$R/dqswz-ncu-$swz.log" 2>&1
      el "dqswz ncu $swz exit=$?"
    done
  fi
fi
if has d64ab; then
  # the D = 64 rows that round 25 found slower than the issue-time kernels: this checkout
  # against d64_base's tree (.ab/SLIM: `mkdir -p .ab/SLIM/verify && git archive 5db18f4
  # kernels flashcheck pyproject.toml | tar -x -C .ab/SLIM && touch
  # .ab/SLIM/verify/__init__.py`, carry .ab/SLIM) with scripts/gpu/ab_time.py,
  # under the device's triton 3.6 and then under 3.9 (carry .triton): whether the change of
  # code or of compiler makes the difference
  el d64ab
  for tv in 36 39; do
    (
      if [ $tv = 39 ]; then use_triton39 d64ab39; else use_device_triton; fi
      timeout -s TERM "${D64AB_S:-270}" python3 scripts/gpu/ab_time.py --a . \
        --b "$(d64_base)" --d 64 --n "${D64AB_N:-4096,16384}" \
        --rounds "${D64AB_ROUNDS:-2}" --out "$R/d64ab-$tv.json" > "$R/d64ab-$tv.log" 2>&1
    )
    el "d64ab triton $tv exit=$?"
  done
fi
if has spread; then
  # which of the GPU's clocks and power follow the rounds where a forward reads slow
  # (sweep.md round 27: single rounds move by 10-25 % within one process)
  el spread
  use_triton39 spread
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -lms 100 > "$R/spread-smi.csv" 2>&1 &
  smi=$!
  timeout -s TERM 400 python3 scripts/gpu/causal_spread.py --procs "${SPREAD_PROCS:-5}" \
    --out "$R/causal_spread.json" > "$R/causal_spread.log" 2>&1
  el "spread exit=$?"
  kill "$smi" 2>/dev/null
  # each timing joined with the samples logged during it (no GPU; the same on a copy later)
  python3 scripts/gpu/causal_spread.py --clocks "$R/causal_spread.json" --smi "$R/spread-smi.csv" \
    --out "$R/spread-clocks.json" >> "$R/causal_spread.log" 2>&1
  el "spread clocks exit=$?"
fi
if has power; then
  # whether ours draws more power per cycle than cuDNN's and the Triton forward, which under
  # the H100's software power cap costs clock (sweep.md round 28; round 29: all at the cap,
  # ours the lowest per cycle); the D = 64 row beside the issue-time forward too where its
  # tree is carried (d64_base, timed in a worker process of its own)
  el power
  use_triton39 power
  base=$(d64_base); power_base=()
  [ -f "$base/flashcheck/__init__.py" ] && power_base=(--base "$base")
  timeout -s TERM 240 python3 scripts/gpu/power_draw.py --out "$R/power-fp16-d64-16k.json" \
    --impls auto,off,cudnn "${power_base[@]}" ${POWER_ARGS:-} > "$R/power-fp16-d64-16k.log" 2>&1
  el "power fp16 d64 exit=$?"
  timeout -s TERM 200 python3 scripts/gpu/power_draw.py --out "$R/power-bf16-d128-4k-causal.json" \
    --dtype bfloat16 --d 128 --n 4096 --causal --impls auto,cudnn ${POWER_ARGS:-} \
    > "$R/power-bf16-d128-4k-causal.log" 2>&1
  el "power bf16 d128 causal exit=$?"
fi
if has d64ncu; then
  # the D = 64 row the full bench reads ~2 % behind the issue-time forward (round 26), under
  # ncu at one launch each: the base tree's kernels first on the path, then this checkout's
  el d64ncu
  use_triton39 d64ncu
  base=$(d64_base)
  for tree in base ours; do
    if [ $tree = base ]; then src=$base; path=/tmp/triton-slim:$PWD/$base
    else src=.; path=$PYTHONPATH; fi
    PYTHONPATH=$path timeout -s TERM 150 ncu --clock-control none --profile-from-start off \
      -k regex:fwd $NCU_SECTIONS python3 scripts/gpu/profile_one.py --impl triton \
      --dtype float16 --d 64 --n 16384 > "$R/d64ncu-$tree.log" 2>&1
    el "d64ncu $tree ($src) exit=$?"
  done
fi
if has stagesab; then
  # a deeper K/V (forward) and Q/dO (backward) ring at D = 64, where a stage is half the
  # shared memory it is at D = 128 (at D = 128 a third does not fit: the modules' STAGES)
  el stagesab
  use_triton39 stagesab
  for n in ${STAGES_DEPTHS:-3 4}; do
    t=.ab/stages$n
    rm -rf "$t" && mkdir -p "$t/verify" && cp -r kernels flashcheck pyproject.toml "$t/" &&
      touch "$t/verify/__init__.py" &&
      sed -i "s/STAGES=STAGES,/STAGES=($n if p.D == 64 else STAGES),/" \
        "$t"/kernels/flash_attention_gluon.py "$t"/kernels/flash_attention_gluon_bwd.py
    [ "$(grep -l "STAGES=($n if" "$t"/kernels/flash_attention_gluon*.py | wc -l)" = 2 ] ||
      { el "stagesab $n: the STAGES launch argument not found in both modules"; continue; }
    timeout -s TERM "${STAGES_FWD_S:-240}" python3 scripts/gpu/gluon_fwd_ab.py --old "$t" \
      --d 64 --n 4096,16384 --rounds "${AB_ROUNDS:-3}" --out "$R/stagesab-fwd-$n.json" \
      > "$R/stagesab-fwd-$n.log" 2>&1
    el "stagesab fwd $n exit=$?"
    if [ "${STAGES_AB:-0}" = 1 ]; then
      timeout -s TERM "${STAGES_AB_S:-270}" python3 scripts/gpu/ab_time.py --a . --b "$t" \
        --d 64 --n 4096,16384 --rounds 2 --out "$R/stagesab-$n.json" > "$R/stagesab-$n.log" 2>&1
      el "stagesab matrix $n exit=$?"
    fi
  done
fi
if has bwdgap; then
  el bwdgap
  use_triton39 bwdgap
  bwd_gap bwdgap
  el "bwdgap exit=$?"
fi
if has stateb; then
  el stateb
  use_triton39 stateb
  for way in plain small-pad empty-cache; do
    flag=$([ $way = plain ] || echo --$way)
    timeout -s TERM 240 python3 scripts/gpu/bwd_alloc.py --allocs 12 --seed 1 $flag \
      --out "$R/stateb-$way.json" > "$R/stateb-$way.log" 2>&1
    el "stateb $way exit=$?"
  done
  timeout -s TERM 300 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_flash_gluon_bwd.py -k turn_stride > "$R/stateb-stride-pytest.log" 2>&1
  STRIDE_PYTEST=$?; el "stateb stride pytest exit=$STRIDE_PYTEST"
  if [ $STRIDE_PYTEST = 0 ]; then
    timeout -s TERM 240 python3 scripts/gpu/bwd_alloc.py --allocs 12 --seed 1 --small-pad \
      --turn-stride 32 --out "$R/stateb-stride32.json" > "$R/stateb-stride32.log" 2>&1
    el "stateb stride32 exit=$?"
    FLASHCHECK_GLUON_BWD_TURN_STRIDE=32 quick_bench stateb-bench-stride32
    el "stateb bench stride32 exit=$?"
  fi
fi
if has d64gap; then
  el d64gap
  use_triton39 d64gap
  for mode in ${D64GAP_FWD:-auto tile}; do
    FLASHCHECK_GLUON=$mode timeout -s TERM 300 python3 scripts/gpu/bwd_gap.py --d 64 \
      --out "$R/d64gap-$mode.json" > "$R/d64gap-$mode.log" 2>&1
    el "d64gap $mode exit=$?"
  done
fi
bwdrace() {
  timeout -s TERM 400 compute-sanitizer --tool racecheck --racecheck-report hazard \
    --print-limit 1000 python3 scripts/gpu/gluon_bwd.py --check-small > "$R/bwdrace-hazards.log" 2>&1
  el "bwdrace exit=$?"
  local cuobj; cuobj=$(command -v cuobjdump || find / -name cuobjdump -type f 2>/dev/null | head -1)
  mkdir -p "$R/sass"
  find "$TRITON_CACHE_DIR" \( -name _bwd_kernel.cubin -o -name _fwd_kernel.cubin \) | while read -r c; do
    d=$(basename "$(dirname "$c")"); n=$(basename "$c" .cubin)
    "$cuobj" -sass "$c" > "$R/sass/$n-$d.sass" 2>&1; cp "${c%.cubin}.json" "$R/sass/$n-$d.json"
  done
  el "bwdrace sass: $(ls "$R/sass" | wc -l) files"
}
if has bwdrace; then
  # racecheck's hazards in the Gluon kernels: every hazard with both threads and addresses,
  # for scripts/gpu/race_trace.py trace (which reads them in the machine code its compile
  # builds without a GPU), and the SASS of each _bwd_kernel / _fwd_kernel compiled here (with
  # its metadata JSON), to check that compile's machine code is this device's. A Triton cache
  # of its own (only these kernels' SASS); BWDRACE_BG=1: in the background, beside the
  # phases after it (a sanitizer, not a timing)
  el bwdrace
  use_triton39 bwdrace
  ( export TRITON_CACHE_DIR=$PWD/.tcache39-race; bwdrace ) &
  [ "${BWDRACE_BG:-0}" = 1 ] || wait $!
fi
if has ab; then
  el ab
  timeout -s TERM "${AB_S:-540}" python3 scripts/gpu/ab_time.py --a . --b .ab/OLD \
    --out "$R/ab.json" ${AB_ARGS:-} > "$R/ab.log" 2>&1
  el "ab exit=$?"
fi
if has sweep; then
  el sweep
  timeout -s TERM "${SWEEP_S:-540}" python3 scripts/gpu/sweep_hopper.py --jobs "${SWEEP_JOBS:-15}" \
    --compile-timeout "${SWEEP_COMPILE_S:-300}" --out "$R/sweep" ${SWEEP_ARGS:-} > "$R/sweep.log" 2>&1
  el "sweep exit=$?"
fi
if has ncu; then
  if [ "${NCU_TRITON39:-0}" = 1 ]; then  # e.g. the Gluon backward (FLASHCHECK_GLUON_BWD)
    use_triton39 ncu39
  fi
  for impl in triton cudnn; do
    el "ncu $impl"
    timeout -s TERM 150 ncu --clock-control none --profile-from-start off $NCU_SECTIONS \
      python3 scripts/gpu/profile_one.py --impl $impl > "$R/ncu-$impl.log" 2>&1
    el "ncu $impl exit=$?"
  done
fi
if has family; then
  if [ "${FAMILY_TP:-1}" = 1 ]; then
    el "throughput"
    timeout -s TERM 90 python3 scripts/gpu/throughput.py --kernel sdpa-math --device cuda \
      --profile gpu --max-n 512 --copies 3 --warmup 16 --budget-s 40 --jobs 1 \
      --out "$R/throughput-sdpa-math-j1.json" > "$R/throughput-sdpa-math-j1.log" 2>&1
    el "throughput exit=$?"
  fi
  export OMP_NUM_THREADS=1
  for k in ${FAMILY_KERNELS:-flex sdpa-flash sdpa-efficient sdpa-cudnn sdpa-math triton triton-fa1}; do
    job "fuzz-$k" $(( ${FUZZ_MIN:-6} * 60 + ${FUZZ_GRACE:-150} )) python3 -m flashcheck fuzz --kernel "$k" --device cuda \
      --minutes "${FUZZ_MIN:-6}" --keep-going --seed "${FUZZ_SEED:-20261201}" --out "$R/fuzz/$k"
  done
  [ "${FAMILY_MUTANTS:-1}" = 1 ] && for m in pv_fp16_accumulation p_bf16_for_fp16 lse_input_dtype fp16_accumulation ds_bf16_for_dk; do
    job "mutant-$m" 300 python3 -m flashcheck fuzz --kernel "verify/mutants/$m.py:attention" \
      --device cuda --examples 200 --seed 0 --out "$R/mutants/$m"
  done
fi
if has outside; then
  # Published Triton kernels (docs/reports/outside/), unpacked under .whl/site (carried), each
  # beside the family campaigns for FUZZ_MIN minutes, every dtype its adapter declares.
  export OMP_NUM_THREADS=1
  for a in flash_attn_dao flash_attention_triton flash_attention_x fasterkernels; do
    job "outside-$a" $(( ${FUZZ_MIN:-6} * 60 + ${FUZZ_GRACE:-150} )) env PYTHONPATH="$PWD:$PWD/.whl/site" \
      python3 -m flashcheck fuzz --kernel "docs/examples/${a}_adapter.py:attention" --device cuda \
      --minutes "${FUZZ_MIN:-6}" --keep-going --seed "${FUZZ_SEED:-20261201}" --max-n 1024 \
      --out "$R/outside/$a"
  done
fi
if has collect; then
  # Waits for a detached `session.sh family outside` started by an earlier call (its marker
  # file is campaigns.done), at most COLLECT_S seconds.
  for _ in $(seq "${COLLECT_S:-400}"); do [ -e "$R/campaigns.done" ] && break; sleep 1; done
  el "campaigns done: $([ -e "$R/campaigns.done" ] && echo yes || echo "no, still running")"
fi
if has gate; then
  for step in update run1 run2; do
    el "gate $step"
    flag=; [ "$step" = update ] && flag=--update
    timeout -s TERM "${GATE_S:-240}" python3 -m flashcheck gate --device cuda --jobs "${GATE_JOBS:-12}" \
      --quiet $flag --out "$R/gate-$step" > "$R/gate-$step.log" 2>&1
    el "gate $step exit=$?" | tee -a "$R/gate-$step.log"
  done
  cp verify/budgets/triton-gpu-*.json "$R/" 2>/dev/null
fi
if has verify; then
  # 16 cores: ours and flex compile side by side first (8 workers each); the throughput is
  # measured on ours' warm cache; then fa1 and the SDPA backends take ours' cores.
  # Many processes share 16 cores: one OpenMP thread each (a full-width pool per process
  # oversubscribes the machine and stalls every CPU-side step).
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True OMP_NUM_THREADS=1
  rep flex 7 "${FLEX_S:-520}" &
  el "run triton"; rep triton 8 "${TRITON_S:-210}"; el "run triton done"
  timeout -s TERM 75 python3 scripts/gpu/throughput.py --kernel triton --device cuda \
    --profile gpu --max-n 512 --copies 2 --cprofile 25 --out "$R/throughput.json" \
    > "$R/throughput.log" 2>&1
  el "throughput exit=$?"
  R2=${REST_S:-220}
  rep triton-fa1 5 "$R2" &
  for k in sdpa-flash sdpa-efficient sdpa-cudnn sdpa-math; do rep $k 1 "$R2" & done
  wait
fi
# The harness throughput without a compiler (sdpa-math): tp "JOBS..." (cProfile with one job).
tp() { local j; for j in $1; do
  el "throughput jobs=$j"
  timeout -s TERM 90 python3 scripts/gpu/throughput.py --kernel sdpa-math --device cuda \
    --profile gpu --max-n 512 --copies "${TP_COPIES:-3}" --warmup 16 --budget-s 40 --jobs "$j" \
    --cprofile $((j == 1 ? ${TP_CPROFILE:-0} : 0)) --out "$R/throughput-sdpa-math-j$j${2:-}.json" \
    > "$R/throughput-sdpa-math-j$j${2:-}.log" 2>&1
  el "throughput exit=$?"
done; }
if has tpdiag; then
  # One process, three ways: one OpenMP thread (the headline), the default thread count, and
  # one thread with cProfile of the parent and the worker (-threads / -cprofile files).
  (export OMP_NUM_THREADS=1; tp 1)
  (unset OMP_NUM_THREADS; tp 1 -threads)
  [ "${TPDIAG_CPROFILE:-1}" = 1 ] && (export OMP_NUM_THREADS=1 TP_CPROFILE=40; tp 1 -cprofile)
fi
if has throughput; then
  export OMP_NUM_THREADS=1; tp "${TP_JOBS:-1 8 14}"
  # MPS_JOBS="12": the same with the CUDA MPS server running, so the processes' kernels share
  # the GPU at once instead of taking turns in time slices (files named ...-jN-mps).
  if [ -n "${MPS_JOBS:-}" ]; then
    if nvidia-cuda-mps-control -d; then
      el "mps started"; tp "$MPS_JOBS" -mps; echo quit | nvidia-cuda-mps-control; el "mps stopped"
    else el "mps: nvidia-cuda-mps-control -d failed"; fi
  fi
fi
if has repro; then  # in the background, beside the phases after it
  timeout -s TERM 120 python3 scripts/gpu/math_stages.py \
    docs/reports/h200/earlier-failures/sdpa-math/numerical-9d68678be5.json \
    --out "$R/math_stages.json" > "$R/math_stages.log" 2>&1
  for f in docs/reports/h200/earlier-failures/triton/*.json; do
    for k in triton triton-fa1; do
      el "repro $k $(basename "$f")"
      timeout -s TERM 120 python3 -m flashcheck repro "$f" --kernel $k --device cuda \
        > "$R/repro-$k-$(basename "$f" .json).log" 2>&1
      el "repro exit=$?"
    done
  done &
fi
if has subnormals; then
  el subnormals
  timeout -s TERM 60 python3 scripts/gpu/subnormals.py --out "$R/subnormals.json" \
    > "$R/subnormals.log" 2>&1
  el "subnormals exit=$?"
fi
if has suite; then
  export OMP_NUM_THREADS=1
  # SUITE_JOBS="" skips the throughput runs (the suite alone).
  tp "${SUITE_JOBS-1 8}"
  el suite
  # Two pytest runs side by side over disjoint halves of the suite: the minutes-long
  # campaigns (marker "long", one worker each) and the rest (JOBS workers), so the wall time
  # is the longer of the two whatever order xdist deals tests in. Together they are exactly
  # `tox -e gpu`'s tests. -v: one line per test, so a run cut by its limit names its failures.
  pt() { local name=$1; shift; timeout -s TERM "${SUITE_S:-240}" python3 -m pytest \
    --hypothesis-profile=gpu -v -rfE --durations=25 -p no:cacheprovider "$@" tests \
    > "$R/$name.log" 2>&1; echo "exit=$?" >> "$R/$name.log"; }
  pt suite-long -n "${LONG_JOBS:-8}" -m long &
  pt suite -n "${JOBS:-10}" -m "not long"
  wait
  el "suite done"
  grep -hE "(FAILED|ERROR|passed|failed|exit=)" "$R/suite.log" "$R/suite-long.log" | tail -20
fi
if has peers; then
  # The SDPA backends' reports alone (no compiling): 5 workers each, 16 cores.
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True OMP_NUM_THREADS=1
  for k in sdpa-efficient sdpa-cudnn sdpa-math; do rep $k 5 "${PEERS_S:-400}" & done
  wait
fi
if has benchragged; then
  el bench_ragged
  # fasterkernels (carried .whl), for its paged decode
  PYTHONPATH=$PWD:$PWD/.whl/site timeout -s TERM "${BENCH_RAGGED_S:-200}" \
    python3 scripts/gpu/bench_ragged.py --out "$R/bench_ragged.json" ${BENCH_RAGGED_ARGS:-} \
    > "$R/bench_ragged.log" 2>&1
  el "bench_ragged exit=$?"
fi
if has ragged; then
  export PYTHONPATH=$PWD:$PWD/.whl/site OMP_NUM_THREADS=1
  for k in ${RAGGED_KERNELS:-triton-varlen triton-decode sdpa-varlen flex-varlen sdpa-decode \
      docs/examples/fasterkernels_paged_adapter.py:attention_decode}; do
    n=$(basename "${k%%:*}" .py)
    job "ragged-$n" $(( ${RAGGED_MIN:-7} * 60 + ${RAGGED_GRACE:-90} )) \
      python3 -m flashcheck fuzz --kernel "$k" \
      --device cuda --minutes "${RAGGED_MIN:-7}" --seed "${FUZZ_SEED:-20261201}" --keep-going \
      --max-n 2048 --out "$R/ragged/$n"
  done
  wait
  # one file: the campaigns' failure files sit too deep for the device's return transfer
  tar czf "$R/ragged.tgz" --exclude=hypothesis-db -C "$R" ragged
fi
if has scale; then
  # One campaign as N fuzz processes (verify/scale.py), alone on the GPU; seeded, so the runs
  # draw the same first examples. One OpenMP thread per process (16 processes, 16 cores).
  export OMP_NUM_THREADS=1
  for k in ${SCALE_KERNELS:-sdpa-math}; do for n in ${SCALE_N:-1 2 4 8 16}; do
    el "scale $k workers=$n"; t=$(date +%s.%N)
    cache=$TRITON_CACHE_DIR; run=$k-w$n${SCALE_TAG:-}
    [ "${SCALE_COLD:-0}" = 1 ] && cache=$(mktemp -d) && run=$run-cold
    TRITON_CACHE_DIR=$cache timeout -s TERM $(( ${SCALE_S:-30} + 150 )) python3 -m flashcheck \
      fuzz --kernel "$k" --device cuda --workers "$n" --minutes "$(python3 -c \
      "print(${SCALE_S:-30} / 60)")" --seed 777 --max-n 512 --keep-going ${SCALE_ARGS:-} \
      --out "$R/scale/$run" > "$R/scale-$run.log" 2>&1
    el "scale exit=$?"; mkdir -p "$R/scale/$run"; python3 -c "import time;print(round(time.time()-$t,1))" > "$R/scale/$run/outer_s"
  done; done
  python3 - "$R" <<'PY'
import json, pathlib, sys
r = pathlib.Path(sys.argv[1]); rows = []
for d in sorted((r / "scale").iterdir()):
    try:
        s = json.loads((d / "summary.json").read_text())
    except (OSError, ValueError):
        rows.append({"run": d.name, "error": "no summary"}); continue
    # --workers 1 is one fuzz process: its own summary, without per_worker
    workers = s.get("per_worker") or [{"summary": s}]
    walls = [(w["summary"] or {}).get("wall_s", 0) for w in workers]
    rows.append({"run": d.name, "workers": len(workers), "examples": s["examples"],
                 "wall_s": max(walls), "examples_per_s": round(s["examples"] / max(walls), 2),
                 # the whole command: the N processes' start-up and the merge included
                 "command_s": float((d / "outer_s").read_text()) if (d / "outer_s").exists() else None,
                 "per_worker": [(w["summary"] or {}).get("examples") for w in workers],
                 "failures": len(s["failures"]), "cold_cache": d.name.endswith("-cold")})
    print(json.dumps(rows[-1]))
(r / "scale.json").write_text(json.dumps(rows, indent=1) + "\n")
PY
fi
if has replays; then
  for spec in "tests/data/sdpa_math_h200_qk_sqrt_scale.json sdpa-math" \
      "tests/data/triton_fa1_h200_fma_chain.json triton-fa1" \
      "tests/data/triton_fa1_h200_fma_chain.json triton" \
      "docs/reports/h200/ragged/sdpa-varlen/numerical-da1989d03f.json sdpa-varlen" \
      "tests/data/triton_fa1_h200_fma_chain_dp.json triton-fa1" \
      "tests/data/triton_fa1_h200_fma_chain_dp.json triton" \
      "tests/data/sdpa_efficient_h200_3xtf32.json sdpa-efficient" \
      "tests/data/sdpa_efficient_h200_row_rank1.json sdpa-efficient" \
      "tests/data/sdpa_efficient_h200_overflow.json sdpa-efficient" \
      "tests/data/sdpa_efficient_h200_3xtf32_truncated.json sdpa-efficient" \
      "tests/data/sdpa_efficient_h100_ds_p_rounded.json sdpa-efficient" \
      "tests/data/h200_triton_fp32_bias_fma.json triton"; do
    set -- $spec
    job "replay-$2-$(basename "$1" .json)" 240 python3 -m flashcheck repro "$1" --kernel "$2" \
      --device cuda
  done
  wait
fi
if has reuse; then
  export OMP_NUM_THREADS=1
  for mode in free reuse; do
    flag=; [ "$mode" = reuse ] && flag=--reuse-compiled
    el "fuzz $mode"
    TRITON_CACHE_DIR=$(mktemp -d) timeout -s TERM $(( ${REUSE_S:-60} + 120 )) python3 -m \
      flashcheck fuzz --kernel "${REUSE_KERNEL:-triton}" --device cuda --minutes "$(python3 \
      -c "print(${REUSE_S:-60} / 60)")" --seed 777 --max-n 512 --keep-going $flag \
      --out "$R/reuse/$mode" > "$R/reuse-$mode.log" 2>&1
    el "fuzz $mode exit=$?"
  done
fi
if has kernel; then
  el kernel
  mkdir -p "$R/kernel"
  if [ "${KERNEL_TRITON39:-0}" = 1 ]; then  # the kernels under triton 3.9 (carry .triton)
    use_triton39 kernel39
  fi
  # KERNEL_FWD_PERSIST=1: the Gluon forward's persistent grid in every case, where
  # fwdpersist's GPU tests passed in this call
  if [ "${KERNEL_FWD_PERSIST:-0}" = 1 ] && [ "${FWDP_PYTEST:-1}" = 0 ]; then
    export FLASHCHECK_GLUON=persistent
  fi
  el "kernel: FLASHCHECK_GLUON=${FLASHCHECK_GLUON:-auto} FLASHCHECK_GLUON_BWD=${FLASHCHECK_GLUON_BWD:-auto}"
  KERNEL_WORKERS=8
  if [ "${FLASHCHECK_GLUON_BWD:-auto}" != off ] && [ "${KERNEL_TRITON39:-0}" = 1 ]; then
    # the Gluon backward's own campaigns: our entries narrowed to its domain, so that every
    # case runs it (deterministic=False as its adds come; deterministic, the ordered form)
    KERNEL_WORKERS=4
    for entry in attention attention_ordered; do
      job "kernel/fuzz-gluon-$entry" $(( ${KERNEL_MIN:-10} * 60 + 150 )) python3 -m flashcheck fuzz \
        --kernel "scripts/gpu/gluon_bwd_domain.py:$entry" --device cuda \
        --minutes "${KERNEL_MIN:-10}" --keep-going --seed "${FUZZ_SEED:-20261210}" --workers 3 \
        --out "$R/kernel/fuzz-gluon-$entry"
    done
  fi
  if [ "${KERNEL_FWD_DOMAIN:-0}" = 1 ]; then
    # KERNEL_FWD_DOMAIN=1: the Gluon forward's own campaign besides (our entry narrowed to
    # its domain: every case runs it, in the default grid)
    KERNEL_WORKERS=3
    job kernel/fuzz-gluon-fwd $(( ${KERNEL_MIN:-10} * 60 + 150 )) python3 -m flashcheck fuzz \
      --kernel scripts/gpu/gluon_domain.py:attention --device cuda --minutes "${KERNEL_MIN:-10}" \
      --keep-going --seed "${FUZZ_SEED:-20261210}" --workers 3 --out "$R/kernel/fuzz-gluon-fwd"
  fi
  job kernel/fuzz $(( ${KERNEL_MIN:-10} * 60 + 150 )) python3 -m flashcheck fuzz --kernel triton \
    --device cuda --minutes "${KERNEL_MIN:-10}" --keep-going --seed "${FUZZ_SEED:-20261210}" \
    --workers "$KERNEL_WORKERS" --out "$R/kernel/fuzz"
  # The gate on the committed budgets, then (KERNEL_UPDATE=1) again with --update: the
  # budgets file of this kernel, copied to $R/kernel.
  job kernel/gate 600 bash -c "python3 -m flashcheck gate --device cuda --jobs 4 --out $R/kernel/gate; \
    echo gate-exit=\$?; [ '${KERNEL_UPDATE:-0}' = 1 ] || exit 0; \
    python3 -m flashcheck gate --device cuda --jobs 4 --update --out $R/kernel/gate-update; \
    echo update-exit=\$?; cp verify/budgets/triton-gpu-*.json $R/kernel/"
  # every report printed: under triton 3.9 its loader's refused cuFuncSetAttribute probe is
  # one memcheck error per kernel loaded (bwd39_verdict.py tells them apart), and 20 of
  # them would hide the rest past the print limit
  job kernel/memcheck 400 compute-sanitizer --tool memcheck --print-limit 1000 \
    python3 scripts/gpu/sanitize_cases.py
  job kernel/racecheck 400 compute-sanitizer --tool racecheck --print-limit 1000 \
    python3 scripts/gpu/sanitize_cases.py --ns 17,129,1000 --ds 40,128
  job kernel/det 300 python3 scripts/gpu/determinism.py --out "$R/kernel/determinism.json"
  wait
  el "kernel done"
fi
if has late; then
  # the backward timed again after the phases before it (the campaigns): round 21 saw the
  # causal ordered backward at 6.2 ms in the bench on a fresh H100 and 7.3 after ten
  # minutes of campaigns, cuDNN's unchanged; bwd_gap.py and the quick bench once more
  el late
  use_triton39 late
  # what else runs: processes left behind by the phases before (host time in the timings)
  { nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv
    ps -eo pid,pcpu,etime,args --sort=-pcpu | head -8; } > "$R/late-ps.txt" 2>&1
  bwd_gap late-bwdgap
  el "late bwdgap exit=$?"
  quick_bench late-accept
  el "late accept exit=$?"
fi
if has checks; then
  job det 250 python3 scripts/gpu/determinism.py --out "$R/determinism.json"
  job longseq 250 python3 scripts/gpu/long_seq.py --out "$R/long_seq.json"
  job memcheck 250 compute-sanitizer --tool memcheck --print-limit 20 python3 scripts/gpu/sanitize_cases.py
  job racecheck 250 compute-sanitizer --tool racecheck --print-limit 20 python3 scripts/gpu/sanitize_cases.py --ns 17,129,1000 --ds 40,128
  wait
fi
wait
for f in "$R"/*.log; do echo "== $(basename "$f")"; tail -6 "$f"; done
el done

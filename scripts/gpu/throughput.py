"""Harness throughput: checked cases per second on small mixed cases (forward + backward +
float64 oracle + emulated baseline + bounds), and where the time goes.

The cases are a sweep profile's small cases (``--profile gpu --max-n 512``: every theme,
dtype, distribution and layout of the GPU profile at N <= 512; ``--profile cpu``: the CPU
sweep) re-seeded ``--copies`` times, so the inputs differ but the compiled kernel variants
repeat. One warm-up pass compiles every variant (or loads it from Triton's on-disk cache);
the timed pass then measures the harness, not the compiler.

Both modes run ``verify.sweep.run_cases``, the path of ``flashcheck run --jobs J``; the
stage breakdown comes from each record's timings.

- ``--jobs 1``: one worker process, started before the warm-up and kept for the timed pass
  (a campaign's worker lives on); with ``--cprofile N``, also the N functions with the most
  own time in the parent and in the worker (the worker's profile covers its whole life).
- ``--jobs J``: J worker processes; the wall time includes starting them (import, CUDA
  context), stated separately as ``startup_s`` from a run of one case per worker.

    python scripts/gpu/throughput.py --kernel triton --device cuda --profile gpu --max-n 512
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import dataclasses
import glob
import io
import json
import os
import pstats
import sys
import tempfile
import time

import torch
from flashcheck.verify.adapters import resolve_kernel
from flashcheck.verify.strategies import fixed_sweep
from flashcheck.verify.sweep import run_cases


def small_cases(profile: str, max_n: int, copies: int) -> tuple[list, list]:
    base = [c for c in fixed_sweep(profile) if max(c.Nq, c.Nk) <= max_n]
    cases = [dataclasses.replace(c, seed=c.seed + 7919 * i) for i in range(copies)
             for c in base]
    return base, cases


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", default="triton")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", choices=("cpu", "gpu"), default="gpu")
    ap.add_argument("--max-n", type=int, default=512)
    ap.add_argument("--copies", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--cprofile", type=int, default=0, metavar="N")
    ap.add_argument("--warmup", type=int, default=None, metavar="N",
                    help="warm up on the first N distinct cases only (default: all)")
    ap.add_argument("--budget-s", type=float, default=None, metavar="S",
                    help="stop the timed pass after S seconds; the rate is over the cases done")
    ap.add_argument("--out", default="throughput.json")
    ap.add_argument("--failures", default=None, metavar="DIR",
                    help="write each failing case's file and report here (default: none)")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    base, cases = small_cases(args.profile, args.max_n, args.copies)
    # The cases run in a worker process: profile it too (set before the first worker, so
    # the forkserver that starts them has it).
    if args.cprofile and args.jobs == 1:
        wprof = os.path.join(tempfile.mkdtemp(prefix="fc-tp-"), "worker.prof")
        os.environ["FLASHCHECK_WORKER_CPROFILE"] = wprof
    stages: dict[str, float] = collections.Counter()
    status: dict[str, int] = collections.Counter()
    res = {"kernel": args.kernel, "device": args.device, "profile": args.profile,
           "max_n": args.max_n, "jobs": args.jobs,
           "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "torch": torch.__version__, "cases": len(cases)}
    # Both modes go through verify.sweep.run_cases, the path of `flashcheck run --jobs J`
    # (one process: the serial loop, which draws the next case's inputs while one runs).
    kernel = resolve_kernel(args.kernel, args.device) if args.jobs == 1 else None
    kw = dict(kernel_spec=args.kernel, failures_dir=args.failures, quiet=True, jobs=args.jobs)
    if args.jobs == 1:
        # One worker for the warm-up and the timed pass, as in a campaign, whose worker lives
        # on: its start (imports, CUDA context, first compiles) is not per-case time.
        from flashcheck.verify.supervise import Supervisor
        kw["supervisor"] = Supervisor(args.kernel, args.device, failures_dir=args.failures)
        kw["supervisor"].start()
    t0 = time.perf_counter()
    run_cases(kernel, base[:args.warmup], args.device, **kw)  # compile (or load) each variant
    res["warmup_s"] = round(time.perf_counter() - t0, 1)
    if args.jobs > 1:
        t0 = time.perf_counter()
        run_cases(None, base[:args.jobs], args.device, **kw)  # start-up plus one case each
        res["startup_s"] = round(time.perf_counter() - t0, 2)
    prof = cProfile.Profile() if args.cprofile and args.jobs == 1 else None
    _sync(args.device)
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    recs = run_cases(kernel, cases, args.device, budget_s=args.budget_s, **kw)
    _sync(args.device)
    wall = time.perf_counter() - t0
    top = ""
    if prof:
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.cprofile)
        top = "parent process:\n" + buf.getvalue()
        for path in glob.glob(wprof + ".*"):
            buf = io.StringIO()
            pstats.Stats(path, stream=buf).sort_stats("tottime").print_stats(args.cprofile)
            top += f"\nworker process {path.rsplit('.', 1)[1]}:\n" + buf.getvalue()
    for r in recs:
        status[r["status"]] += 1
        for k, s in (r.get("timings") or {}).items():
            stages[k] += s or 0.0
    checked = status["pass"] + status["fail"]
    # Without a budget every "not run" is a case outside the kernel's domain, which the
    # harness handled too; with one, "not run" also means cut by the budget, so none count.
    done = checked + (0 if args.budget_s else status["not_run"])
    # Where the time outside check_case goes: in the worker around it (the wait for the
    # drawn inputs, the synchronize, the verdict's dict), the pipe both ways, the parent.
    outside = {
        "worker_around_check_s": stages["worker"] - stages["total"],
        "pipe_s": stages["roundtrip"] - stages["worker"],
        "parent_between_cases_s": wall - stages["roundtrip"] if args.jobs == 1 else None,
    }
    res.update({
        "status": dict(status), "wall_s": round(wall, 3), "cases_done": done,
        "outside_check_case": {k: None if v is None else round(v, 3)
                               for k, v in outside.items()},
        "cases_per_s": round(done / wall, 2),
        "checked_cases_per_s": round(checked / wall, 2),
        "seconds_by_stage": {k: round(s, 3) for k, s in sorted(stages.items(),
                                                                key=lambda kv: -kv[1])},
    })
    if "supervisor" in kw:
        kw["supervisor"].close()
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    if top:
        print(top)
    return 0


if __name__ == "__main__":
    sys.exit(main())

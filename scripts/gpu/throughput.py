"""Harness throughput: checked cases per second on small mixed cases (forward + backward +
float64 oracle + emulated baseline), and where the time goes.

The cases are the CPU sweep's (every feature, distribution and layout, N <= 130) re-seeded
``--copies`` times, so the inputs differ but the compiled kernel variants repeat. One warm-up
pass compiles every variant; the timed pass then measures the harness, not the compiler.

    python scripts/gpu/throughput.py --kernel triton --device cuda --out throughput.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import time

import torch

from verify.adapters import resolve_kernel
from verify.check import check_case
from verify.strategies import fixed_sweep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", default="triton")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--copies", type=int, default=5)
    ap.add_argument("--out", default="throughput.json")
    args = ap.parse_args(argv)
    kernel = resolve_kernel(args.kernel, args.device)
    base = fixed_sweep("cpu")
    cases = [dataclasses.replace(c, seed=c.seed + 7919 * i) for i in range(args.copies)
             for c in base]
    t0 = time.perf_counter()
    for c in base:  # warm-up: compile every variant once
        check_case(kernel, c, args.device)
    warm = time.perf_counter() - t0
    stages: dict[str, float] = collections.Counter()
    status: dict[str, int] = collections.Counter()
    if args.device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for c in cases:
        v = check_case(kernel, c, args.device)
        status[v.status] += 1
        for k, s in v.timings.items():
            stages[k] += s
    wall = time.perf_counter() - t0
    checked = status["pass"] + status["fail"]
    res = {
        "kernel": args.kernel, "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__, "cases": len(cases), "status": dict(status),
        "wall_s": round(wall, 3), "cases_per_s": round(len(cases) / wall, 2),
        "checked_cases_per_s": round(checked / wall, 2), "warmup_s": round(warm, 1),
        "seconds_by_stage": {k: round(s, 3) for k, s in sorted(stages.items(),
                                                                key=lambda kv: -kv[1])},
    }
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

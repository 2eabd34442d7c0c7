"""Where the causal forward's two speeds come from: rounds, processes or tensor addresses.

    python3 scripts/gpu/causal_spread.py --out FILE.json [--procs 4] [--rounds 6]

The benchmark's bf16 D = 128 N = 4096 causal forward (kernels/bench.py's quick row) has read
1.96-2.00 ms on some runs and 2.09-2.21 on others, cuDNN's 2.06-2.09 throughout
(docs/benchmarks/sweep.md rounds 26-27). This script times our forward ("triton-fa2") and
cuDNN's (``sdpa-cudnn``) as the benchmark does (``kernels.bench._peer_fn``, inputs with
``requires_grad``, median of ``triton.testing.do_bench``), alternating the two (the first of
a round timed again after the second), ``--rounds`` times in each of ``--procs`` fresh
processes run one after another, with the allocator's device allocations and frees during
each timing and its wall-clock start and end (seconds since the epoch, and the start in local
time as nvidia-smi's timestamps read: to join with a log of the GPU's clocks and power, as
session.sh's ``spread`` phase writes beside it). Every other round
allocates Q, K and V anew behind a pad of a different size, so that the same process times
the kernels at other addresses. FILE.json keeps every time with the round's addresses
and, per implementation, the spread within processes (at the same and at other addresses)
and between the processes' medians: which of the three the slow runs follow.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_WORKER = r"""
import json
import time
import torch
from triton.testing import do_bench
from flashcheck.kernels import bench
B, H, N, D = 16, 16, 4096, 128
rows, keep = [], []
gen = torch.Generator(device="cuda").manual_seed(0)
for r in range({rounds}):
    if r % 2 == 0:
        keep.append(torch.empty((r + 1) * 3 * 2**20 + 4096 * r, dtype=torch.uint8, device="cuda"))
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                   .requires_grad_() for _ in range(3))
    order = ("triton-fa2", "sdpa-cudnn") if r % 2 == 0 else ("sdpa-cudnn", "triton-fa2")
    for impl in order + order[:1]:
        fn, _ = bench._peer_fn(impl, True, q)
        o = fn(q, k, v)
        torch.cuda.synchronize()
        out_addr = hex(o.data_ptr())
        del o
        before = torch.cuda.memory_stats()
        t0 = time.time()
        ms = do_bench(lambda: fn(q, k, v), return_mode="median")
        t1 = time.time()
        after = torch.cuda.memory_stats()
        rows.append(dict(round=r, impl=impl, ms=ms, out=out_addr, start=t0, end=t1,
                         start_local=time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(t0)),
                         addr=[hex(t.data_ptr()) for t in (q, k, v)],
                         **{{key: after.get(key, 0) - before.get(key, 0) for key in
                            ("num_device_alloc", "num_device_free", "num_alloc_retries")}}))
print("SPREAD " + json.dumps(rows))
"""


def spread(rows: list[dict]) -> dict:
    """Per implementation: the medians of each process, the range of those (between
    processes), and the largest range inside one process over rounds at the same addresses
    and over all its rounds (other addresses included)."""
    out = {}
    for impl in sorted({r["impl"] for r in rows}):
        mine = [r for r in rows if r["impl"] == impl]
        procs = sorted({r["proc"] for r in mine})
        med = [statistics.median(r["ms"] for r in mine if r["proc"] == p) for p in procs]
        within_all, within_same = [], []
        for p in procs:
            ts = [r["ms"] for r in mine if r["proc"] == p]
            within_all.append(max(ts) - min(ts))
            for a in {tuple(r["addr"]) for r in mine if r["proc"] == p}:
                same = [r["ms"] for r in mine if r["proc"] == p and tuple(r["addr"]) == a]
                within_same.append(max(same) - min(same))
        out[impl] = dict(process_medians=med, between_processes=max(med) - min(med),
                         within_process_same_addresses=max(within_same),
                         within_process=max(within_all))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON report")
    ap.add_argument("--procs", type=int, default=4, help="fresh processes (1..16, default 4)")
    ap.add_argument("--rounds", type=int, default=6, help="rounds per process (2..40, default 6)")
    args = ap.parse_args(argv)
    if not 1 <= args.procs <= 16:
        ap.error(f"--procs must be in 1..16, got {args.procs}")
    if not 2 <= args.rounds <= 40:
        ap.error(f"--rounds must be in 2..40, got {args.rounds}")
    rows = []
    for p in range(args.procs):
        proc = subprocess.run([sys.executable, "-c", _WORKER.format(rounds=args.rounds)],
                              capture_output=True, text=True, timeout=300)
        got = [ln for ln in proc.stdout.splitlines() if ln.startswith("SPREAD ")]
        if not got:
            raise SystemExit(f"process {p}: no timings (exit {proc.returncode}): "
                             f"{proc.stderr[-800:]}")
        for r in json.loads(got[0][len("SPREAD "):]):
            rows.append(dict(r, proc=p))
            print(f"proc {p} round {r['round']} {r['impl']:10s} {r['ms']:.3f} ms, device "
                  f"allocs {r['num_device_alloc']} frees {r['num_device_free']}", flush=True)
    import torch
    import triton
    rep = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, rows=rows, spread=spread(rows))
    with open(args.out, "w") as f:
        json.dump(rep, f, indent=1)
    print(json.dumps(rep["spread"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

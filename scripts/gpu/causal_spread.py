"""Where the causal forward's two speeds come from: rounds, processes or tensor addresses.

    python3 scripts/gpu/causal_spread.py --out FILE.json [--procs 4] [--rounds 6]
    python3 scripts/gpu/causal_spread.py --clocks FILE.json --smi SMI.csv [--out JOIN.json]

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

``--clocks FILE.json --smi SMI.csv`` (no GPU) joins each timing of FILE.json with the
nvidia-smi samples logged during it (session.sh's ``spread`` phase writes both): per
implementation, how many timings ran under the software power cap, the SM clock under it,
the milliseconds with and without it, and the correlation of each timing's milliseconds with
its mean SM clock (docs/benchmarks/sweep.md round 28).
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


def _power_draw():
    """scripts/gpu/power_draw.py, this script's sibling (its nvidia-smi parser and the
    power-cap bit)."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent / "power_draw.py"
    spec = importlib.util.spec_from_file_location("power_draw", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def clocks(rows: list[dict], samples: list[tuple[float, float, float, int]],
           cap_bit: int) -> dict:
    """Each timing (its wall-clock ``start`` and ``end``) joined with the samples (epoch s,
    SM MHz, W, clock-event reasons) from 50 ms before its start to 50 ms after its end (the
    log's period is 100 ms; the nearest sample where none falls there): under the cap when
    any of them has ``cap_bit``. Per implementation: timings, those under the cap, the
    clock range of those, the ms ranges with and without the cap, and the Pearson
    correlation of ms with the timing's mean clock (None with fewer than 3 timings or no
    spread)."""
    out = {}
    for impl in sorted({r["impl"] for r in rows}):
        ms, mhz, capped, lo, hi = [], [], [], [], []
        for r in (r for r in rows if r["impl"] == impl):
            win = [x for x in samples if r["start"] - 0.05 <= x[0] <= r["end"] + 0.05]
            win = win or [min(samples, key=lambda x: abs(x[0] - r["start"]))]
            ms.append(r["ms"])
            mhz.append(statistics.fmean(x[1] for x in win))
            capped.append(any(x[3] & cap_bit for x in win))
            lo.append(min(x[1] for x in win))
            hi.append(max(x[1] for x in win))
        under = [i for i, c in enumerate(capped) if c]
        free = [i for i, c in enumerate(capped) if not c]

        def span(low, high, idx):
            return [min(low[i] for i in idx), max(high[i] for i in idx)] if idx else None

        corr = None
        if len(ms) >= 3 and len(set(ms)) > 1 and len(set(mhz)) > 1:
            corr = statistics.correlation(ms, mhz)
        out[impl] = dict(timings=len(ms), under_cap=len(under),
                         mhz_under_cap=span(lo, hi, under), ms_under_cap=span(ms, ms, under),
                         ms_free=span(ms, ms, free), corr_ms_mhz=corr)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON report (the timings; with --clocks, the join)")
    ap.add_argument("--procs", type=int, default=4, help="fresh processes (1..16, default 4)")
    ap.add_argument("--rounds", type=int, default=6, help="rounds per process (2..40, default 6)")
    ap.add_argument("--clocks", metavar="FILE.json",
                    help="no GPU: join this report's timings with --smi's samples")
    ap.add_argument("--smi", metavar="SMI.csv", help="nvidia-smi's log (with --clocks)")
    args = ap.parse_args(argv)
    if args.clocks or args.smi:
        if not (args.clocks and args.smi):
            ap.error("--clocks and --smi go together: a report of this script and the "
                     "nvidia-smi log written beside it")
        return _clocks_main(args)
    if not args.out:
        ap.error("--out is required (the JSON report)")
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


def _clocks_main(args) -> int:
    try:
        rows = json.loads(open(args.clocks).read())["rows"]
        power_draw = _power_draw()
        samples = power_draw.parse_smi(open(args.smi).read())
    except (OSError, ValueError, KeyError) as e:
        print(f"cannot read --clocks {args.clocks} / --smi {args.smi}: {e}", file=sys.stderr)
        return 2
    if not samples:
        print(f"--smi {args.smi}: no samples (timestamp, SM clock, power and clock-event "
              "reasons columns)", file=sys.stderr)
        return 2
    rep = clocks(rows, samples, power_draw.SW_POWER_CAP)

    def span(pair, fmt):
        return "-" if pair is None else f"{pair[0]:{fmt}}-{pair[1]:{fmt}}"

    for impl, r in rep.items():
        corr = "n/a" if r["corr_ms_mhz"] is None else f"{r['corr_ms_mhz']:+.2f}"
        print(f"{impl:12s} {r['under_cap']} of {r['timings']} timings under the power cap at "
              f"{span(r['mhz_under_cap'], '.0f')} MHz; ms under it "
              f"{span(r['ms_under_cap'], '.3f')}, without {span(r['ms_free'], '.3f')}; "
              f"corr(ms, clock) {corr}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rep, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

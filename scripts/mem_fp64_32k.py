"""Measure the float64 oracle's memory at one head, Nq = Nk = 32768, D = 128.

Inputs are fp32 random (seeded), computed in float64, forward only, no grad. Prints the
wall time, the peak RSS increase over the RSS before the call (``resource.getrusage``;
Linux reports ru_maxrss in KiB) and the size of the inputs/outputs for comparison.

Run:  /usr/bin/time -v python scripts/mem_fp64_32k.py [--n 32768] [--d 128]

Caveat: the peak RSS before the call already includes the fp32 inputs and torch itself;
the increase measured is the oracle's extra memory (float64 copies of q, k, v, the output
and lse, plus the per-chunk scores).
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from reference import attention_fp64


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=32768, help="Nq = Nk (default 32768)")
    ap.add_argument("--d", type=int, default=128, help="head dim (default 128)")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, args.n, args.d, generator=g) for _ in range(3))
    before = _peak_rss_mib()
    t0 = time.perf_counter()
    out = attention_fp64(q, k, v)
    wall = time.perf_counter() - t0
    after = _peak_rss_mib()
    io_mib = (3 * q.numel() * 8 + out.numel() * 8 + args.n * 8) / 2**20
    print(f"N={args.n} D={args.d} threads={torch.get_num_threads()}")
    print(f"wall time: {wall:.1f} s")
    print(f"peak RSS before: {before:.0f} MiB, after: {after:.0f} MiB, "
          f"increase: {after - before:.0f} MiB")
    print(f"of which float64 inputs/output/lse: {io_mib:.0f} MiB")
    print(f"output finite: {bool(torch.isfinite(out).all())}")


if __name__ == "__main__":
    main()

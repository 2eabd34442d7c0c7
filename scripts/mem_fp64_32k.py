"""Measure the float64 oracle's memory and time at one head, Nq = Nk = 32768, D = 128.

Inputs are fp32 random (seeded), computed in float64. By default the forward only, with no
grad. ``--backward`` runs the forward with autograd and then the backward with a random
dO (``torch.autograd.grad`` on q, k, v), timing each. Prints the wall times, the peak RSS
increase over the RSS before the call (``resource.getrusage``; Linux reports ru_maxrss in
KiB) and the size of the float64 tensors the oracle must hold in any case, for comparison.

Run:  /usr/bin/time -v python scripts/mem_fp64_32k.py [--n 32768] [--d 128] [--backward]

Caveat: the peak RSS before the call already includes the fp32 inputs (and dO) and torch
itself; the increase measured is the oracle's extra memory (float64 copies of q, k, v, the
output and row statistics, in the backward also the float64 gradients, plus the
per-chunk scores). Peak RSS only grows, so the backward's figure covers both passes.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
from flashcheck.reference import attention_fp64


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=32768, help="Nq = Nk (default 32768)")
    ap.add_argument("--d", type=int, default=128, help="head dim (default 128)")
    ap.add_argument("--backward", action="store_true",
                    help="also run the backward (forward with autograd, then dq, dk, dv)")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 1, args.n, args.d, generator=g) for _ in range(4))
    f64_mib = q.numel() * 8 / 2**20
    print(f"N={args.n} D={args.d} threads={torch.get_num_threads()} "
          f"backward={args.backward}")
    before = _peak_rss_mib()
    t0 = time.perf_counter()
    if args.backward:
        leaves = [t.requires_grad_(True) for t in (q, k, v)]
        out = attention_fp64(*leaves)
        t1 = time.perf_counter()
        grads = torch.autograd.grad(out, leaves, do)
        t2 = time.perf_counter()
        print(f"forward wall time: {t1 - t0:.1f} s, backward wall time: {t2 - t1:.1f} s")
        # fp64 q, k, v, out, dO, three fp64 gradients (cast to fp32 at the end).
        must_mib = 8 * f64_mib
        finite = bool(torch.isfinite(out).all()) and all(
            bool(torch.isfinite(x).all()) for x in grads
        )
    else:
        out = attention_fp64(q, k, v)
        print(f"wall time: {time.perf_counter() - t0:.1f} s")
        must_mib = 4 * f64_mib
        finite = bool(torch.isfinite(out).all())
    after = _peak_rss_mib()
    print(f"peak RSS before: {before:.0f} MiB, after: {after:.0f} MiB, "
          f"increase: {after - before:.0f} MiB")
    print(f"of which float64 tensors of size N x D held in any case: {must_mib:.0f} MiB")
    print(f"all finite: {finite}")


if __name__ == "__main__":
    main()

"""Time the whole family of reference/family.py against the single baseline member.

Both are forward + backward with a given dO on the same inputs: the baseline through
``online_attention`` and autograd, the family through ``run_family`` (which shares the
forwards and backwards that members have in common). Prints the best of ``--repeat`` runs.

    OMP_NUM_THREADS=1 python scripts/family_cost.py [--dtype float16] [--B 2] [--Hq 4]
        [--Hkv 4] [--N 128] [--D 64] [--repeat 5] [--device cpu]
"""

from __future__ import annotations

import argparse
import time

import torch
from flashcheck.reference import online_attention
from flashcheck.reference.family import FAMILY, family_members, run_family


def _best(fn, repeat: int, device: str) -> float:
    times = []
    for _ in range(repeat):
        if device != "cpu":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float16")
    for name, default in (("B", 2), ("Hq", 4), ("Hkv", 4), ("N", 128), ("D", 64),
                          ("repeat", 5)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tf32", action="store_true")
    a = ap.parse_args()
    dt = getattr(torch, a.dtype)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(a.B, h, a.N, a.D, generator=g).to(a.device, dt)
               for h in (a.Hq, a.Hkv, a.Hkv))
    do = torch.randn(a.B, a.Hq, a.N, a.D, generator=g).to(a.device, dt)
    gqa = a.Hq != a.Hkv
    members = family_members(dt, gqa=gqa, tf32=a.tf32)

    def baseline():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = online_attention(*leaves, enable_gqa=gqa, **FAMILY["fa2_128"])
        torch.autograd.grad(out, leaves, do)

    def family():
        run_family(q, k, v, do, enable_gqa=gqa, members=members)

    def family_unshared():
        for kw in members.values():
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            out = online_attention(*leaves, enable_gqa=gqa, **kw)
            torch.autograd.grad(out, leaves, do)

    baseline(), family()  # warm-up
    tb = _best(baseline, a.repeat, a.device)
    tf = _best(family, a.repeat, a.device)
    tu = _best(family_unshared, a.repeat, a.device)
    print(f"{a.dtype} B={a.B} Hq={a.Hq} Hkv={a.Hkv} N={a.N} D={a.D} on {a.device}, "
          f"torch threads {torch.get_num_threads()}, best of {a.repeat}")
    print(f"members ({len(members)}): {', '.join(members)}")
    print(f"baseline fa2_128 fwd+bwd : {tb * 1e3:8.1f} ms")
    print(f"family, run_family       : {tf * 1e3:8.1f} ms  ({tf / tb:.2f}x baseline)")
    print(f"family, one call each    : {tu * 1e3:8.1f} ms  ({tu / tb:.2f}x baseline)")


if __name__ == "__main__":
    main()

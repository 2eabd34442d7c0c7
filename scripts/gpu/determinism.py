"""Determinism and race checks for the Triton kernel on a CUDA device.

- forward: 50 calls on the same inputs must be bitwise equal;
- backward (default, deterministic mode): 50 calls must give bitwise-equal dQ/dK/dV;
- race test in the manner of FlashAttention's: batch 60, 250 forward+backward iterations, every
  iteration compared bitwise to the first one.

Writes a JSON summary to the path given by --out and exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from flashcheck import kernels


def _run(q, k, v, do, **kw):
    for t in (q, k, v):
        t.grad = None
    out = kernels.attention(q, k, v, **kw)
    out.backward(do)
    return out.detach().clone(), q.grad.clone(), k.grad.clone(), v.grad.clone()


def _inputs(B, H, N, D, dtype, seed, Hkv=None):
    g = torch.Generator().manual_seed(seed)
    Hkv = Hkv or H
    q = torch.randn(B, H, N, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, N, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, N, D, generator=g).to(dtype)
    do = torch.randn(B, H, N, D, generator=g).to(dtype)
    return [t.cuda().requires_grad_(i < 3) for i, t in enumerate((q, k, v, do))]


def repeat_check(name, iters, B, H, N, D, dtype, **kw):
    q, k, v, do = _inputs(B, H, N, D, dtype, seed=1234, Hkv=kw.pop("Hkv", None))
    first = _run(q, k, v, do, **kw)
    bad = {"out": 0, "dq": 0, "dk": 0, "dv": 0}
    t0 = time.perf_counter()
    for _ in range(iters - 1):
        got = _run(q, k, v, do, **kw)
        for key, a, b in zip(bad, first, got, strict=True):
            if not torch.equal(a, b):
                bad[key] += 1
    torch.cuda.synchronize()
    return {
        "check": name, "iters": iters, "shape": [B, H, N, D], "dtype": str(dtype),
        "kwargs": {k2: str(v2) for k2, v2 in kw.items()}, "mismatching_iters": bad,
        "passed": not any(bad.values()), "seconds": round(time.perf_counter() - t0, 2),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="determinism.json")
    args = ap.parse_args(argv)
    results = []
    for dtype in (torch.bfloat16, torch.float16):
        for causal in (False, True):
            results.append(repeat_check("repeat-50", 50, 4, 8, 1024, 128, dtype,
                                        is_causal=causal))
        results.append(repeat_check("repeat-50-gqa", 50, 2, 8, 777, 72, dtype, Hkv=2,
                                    enable_gqa=True))
    results.append(repeat_check("race-b60-250", 250, 60, 4, 256, 128, torch.bfloat16))
    results.append(repeat_check("race-b60-250-causal", 250, 60, 4, 256, 128, torch.float16,
                                is_causal=True))
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton
    meta["triton"] = triton.__version__
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    for r in results:
        print(f"{r['check']:22s} {r['dtype']:15s} {str(r['shape']):22s} "
              f"{'ok' if r['passed'] else 'MISMATCH ' + str(r['mismatching_iters'])} "
              f"({r['seconds']} s)")
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

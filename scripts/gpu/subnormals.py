"""Which CUDA operations keep subnormal numbers (gradual underflow) and which flush them.

The harness's reference semantics keep gradual underflow; several peers flush subnormal
gradients to zero (docs/reports/README.md). This probe separates the platform from the
kernels: each operation gets operands whose exact result is subnormal in the dtype, runs on
CUDA and on the CPU (float64, rounded once to the dtype), and reports how many nonzero exact
results came back as 0 and the worst error in units of the dtype's subnormal spacing.

    python scripts/gpu/subnormals.py --out subnormals.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _operands(dtype: torch.dtype, m: int, k: int, n: int, g: torch.Generator):
    """a (m, k) of size ~1 and b (k, n) whose entries are ~4 subnormal spacings times
    a few thousand: every product and sum is subnormal in ``dtype``."""
    tiny = torch.finfo(dtype).tiny
    a = torch.randn(m, k, generator=g, dtype=torch.float64)
    b = torch.randn(k, n, generator=g, dtype=torch.float64) * (tiny / 8)
    return a.to(dtype), b.to(dtype)


def _probe(name: str, dtype: torch.dtype, fn, *cpu_args, device: str) -> dict:
    exact = fn(*(x.double() for x in cpu_args)).to(dtype).double()
    got = fn(*(x.to(device) for x in cpu_args)).double().cpu()
    spacing = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    nz = exact != 0
    return {
        "op": name, "dtype": str(dtype).removeprefix("torch."),
        "nonzero_exact": int(nz.sum()),
        "flushed_to_zero": int((nz & (got == 0)).sum()),
        "max_err_in_subnormal_spacings": float(((got - exact).abs() / spacing).max()),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="subnormals.json")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="where the operations under test run (the exact result is the CPU's "
                         "float64 either way)")
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    rows = []

    def probe(*a):
        rows.append(_probe(*a, device=args.device))

    for dt in DTYPES:
        for m, k, n in ((1, 1, 1), (16, 16, 16), (128, 64, 128)):
            a, b = _operands(dt, m, k, n, g)
            probe(f"matmul {m}x{k}x{n}", dt, torch.matmul, a, b)
            probe(f"bmm 4x{m}x{k}x{n}", dt, torch.bmm, a.expand(4, m, k).contiguous(),
                  b.expand(4, k, n).contiguous())
        a, b = _operands(dt, 64, 64, 64, g)
        probe("mul (elementwise)", dt, torch.mul, a, b)
        probe("sum over 64", dt, lambda x, y: (x * y).sum(0), a, b)
        probe("fp32 -> dtype", dt, lambda x, dt=dt: x.to(dt), b.float())
        probe("index_add_ (atomics)", dt,
              lambda x: torch.zeros(1, 64, dtype=x.dtype, device=x.device).index_add_(
                  0, torch.zeros(64, dtype=torch.long, device=x.device), x), b)
        p = torch.softmax(torch.randn(64, 64, generator=g, dtype=torch.float64), -1).to(dt)
        probe("softmax backward", dt,
              lambda gy, y: torch._softmax_backward_data(gy, y, -1, y.dtype), b, p)
    env = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "torch": torch.__version__,
           "cuda": torch.version.cuda}
    with open(args.out, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    print(json.dumps(env))
    for r in rows:
        print(f"{r['dtype']:9s} {r['op']:22s} flushed {r['flushed_to_zero']:6d} of "
              f"{r['nonzero_exact']:6d}  max err {r['max_err_in_subnormal_spacings']:.3g} spacings")
    return 0


if __name__ == "__main__":
    sys.exit(main())

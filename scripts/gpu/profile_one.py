"""One forward+backward of one implementation inside a CUDA profiler range, for ncu.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \
        python3 scripts/gpu/profile_one.py --impl triton

Shape: the benchmark's headline configuration (bf16 unless --dtype, D = 128, N = 4096,
B = 16, H = 16, non-causal unless --causal), our kernel in the benchmark's "autotune" tuning
mode unless --tuning says otherwise. Three untimed warm-up iterations (compilation,
autotuning, cuDNN plan selection) run outside the range; the profiled range holds exactly
one forward and one backward, so ncu sees only those kernels.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashcheck import kernels

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("triton", "cudnn", "flash"), default="triton")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--tuning", choices=("autotune", "heuristic"), default="autotune")
    args = ap.parse_args(argv)
    with kernels.tuning(args.tuning):
        return _run(args)


def _run(args) -> int:
    B, H = (1 << 20) // (16 * args.n), 16
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, args.n, args.d, device="cuda",
                           dtype=getattr(torch, args.dtype),
                           generator=g).requires_grad_() for _ in range(3))
    do = torch.randn_like(q)

    def step():
        if args.impl == "triton":
            out = kernels.attention(q, k, v, is_causal=args.causal)
        else:
            with sdpa_kernel([BACKENDS[args.impl]]):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
        out.backward(do)
        q.grad = k.grad = v.grad = None

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled one fwd+bwd of {args.impl}: B={B} H={H} N={args.n} D={args.d} {args.dtype} "
          f"causal={args.causal}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

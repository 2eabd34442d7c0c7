"""Quick GPU smoke: compile on this triton, accuracy vs fp64 on a few shapes, and speed at
bf16 D=128 N=4K beside SDPA's backends. For an early look only; the full benchmark is
``flashcheck bench``."""

from __future__ import annotations

import sys
import time

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashcheck import kernels


def err(a, b):
    return (a.double() - b.double()).abs().max().item()


def main() -> int:
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    g = torch.Generator().manual_seed(0)
    ok = True
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for (B, H, N, D, causal) in [(2, 3, 1000, 72, True), (1, 4, 129, 256, False),
                                     (2, 2, 1, 40, False), (1, 2, 2048, 128, True)]:
            q, k, v, do = (torch.randn(B, H, N, D, generator=g).to(dtype).cuda() for _ in range(4))
            for t in (q, k, v):
                t.requires_grad_(True)
            t0 = time.perf_counter()
            o = kernels.attention(q, k, v, is_causal=causal)
            o.backward(do)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
            with sdpa_kernel(SDPBackend.MATH):
                od = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd,
                                                                      is_causal=causal)
            od.backward(do.double())
            e = [err(o, od), err(q.grad, qd.grad), err(k.grad, kd.grad), err(v.grad, vd.grad)]
            fin = all(torch.isfinite(t).all() for t in (o, q.grad, k.grad, v.grad))
            ok &= fin
            print(f"{str(dtype):15s} B{B} H{H} N{N} D{D} causal={causal}: "
                  f"err out/dq/dk/dv = {' '.join(f'{x:.2e}' for x in e)} "
                  f"finite={fin} first-call {dt:.1f}s", flush=True)
    # speed
    B, H, N, D = 4, 16, 4096, 128
    for causal in (False, True):
        q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)
                       for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_(True)
        flops = 4 * B * H * N * N * D * (0.5 if causal else 1.0)
        impls = {"triton": lambda q=q, k=k, v=v, causal=causal:
                 kernels.attention(q, k, v, is_causal=causal)}
        for name, be in (("sdpa-flash", SDPBackend.FLASH_ATTENTION),
                         ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
            def f(be=be, q=q, k=k, v=v, causal=causal):
                with sdpa_kernel(be):
                    return torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, is_causal=causal)
            impls[name] = f
        for name, f in impls.items():
            try:
                tf = triton.testing.do_bench(f, warmup=50, rep=200, return_mode="median")
                o = f()
                tb = triton.testing.do_bench(
                    lambda o=o, qkv=(q, k, v), do=do: torch.autograd.grad(o, qkv, do,
                                                                          retain_graph=True),
                                             warmup=50, rep=200, return_mode="median")
                print(f"causal={causal} {name:11s} fwd {flops / tf / 1e9:6.1f} TFLOP/s  "
                      f"bwd {2.5 * flops / tb / 1e9:6.1f} TFLOP/s", flush=True)
            except Exception as exc:  # report and continue
                print(f"causal={causal} {name}: {type(exc).__name__}: {exc}"[:300], flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

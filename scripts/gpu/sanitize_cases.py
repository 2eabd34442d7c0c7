"""Tail shapes for compute-sanitizer: forward and backward of the Triton kernel.

N in {1, 17, 127, 129, 1000}, D in {40, 72, 128, 256}, each plain, causal and with a bool mask.
Run under ``compute-sanitizer --tool memcheck`` and ``--tool racecheck``; the sanitizer's
summary line is the verdict. The script itself also asserts finiteness so that a silent
out-of-bounds read that produced garbage does not go unnoticed. Shapes the forward's Gluon
path takes (N a multiple of 128 at D 128, plain or causal: ``--ns 128,256 --ds 128``) run it;
the summary counts its launches. ``--ws-probe`` runs instead a Gluon kernel that has
partitions (``gl.warp_specialize``: a 4-warp default, a 4-warp and a 1-warp worker, the
forward's shape) and no shared memory of its own, each partition writing its own global
elements: what racecheck reports for it comes from how the partitions are started, not
from any kernel's data.
"""

from __future__ import annotations

import argparse
import sys

import torch
from flashcheck.kernels import flash_attention_gluon

from flashcheck import kernels


def _ws_probe() -> int:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def _part(out_ptr, which):
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        offs = gl.arange(0, 32 * gl.num_warps(), layout=lay)
        gl.store(out_ptr + which * 128 + offs, offs + which * 1000)

    @gluon.jit
    def _part0(out_ptr):
        _part(out_ptr, 0)

    @gluon.jit
    def _part1(out_ptr):
        _part(out_ptr, 1)

    @gluon.jit
    def _part2(out_ptr):
        _part(out_ptr, 2)

    @gluon.jit
    def _probe(out_ptr):
        gl.warp_specialize([(_part0, (out_ptr, )), (_part1, (out_ptr, )),
                            (_part2, (out_ptr, ))], [4, 1], [240, 24])

    out = torch.zeros(3 * 128, dtype=torch.int32, device="cuda")
    _probe[(4, )](out, num_warps=4, maxnreg=168)
    torch.cuda.synchronize()
    want = torch.cat([torch.arange(128), torch.arange(128) + 1000,
                      torch.cat([torch.arange(32) + 2000, torch.zeros(96)])]).int().cuda()
    ok = torch.equal(out, want)
    print("ws-probe:", "ok" if ok else "wrong values")
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default="1,17,127,129,1000")
    ap.add_argument("--ds", default="40,72,128,256")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--ws-probe", action="store_true",
                    help="only the partition-start probe (see the module docstring)")
    args = ap.parse_args(argv)
    if args.ws_probe:
        return _ws_probe()
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    n_runs = 0
    for N in map(int, args.ns.split(",")):
        for D in map(int, args.ds.split(",")):
            for mode in ("plain", "causal", "mask"):
                shape = (1, 2, N, D)
                q, k, v, do = (torch.randn(shape, generator=g).to(dtype).cuda() for _ in range(4))
                for t in (q, k, v):
                    t.requires_grad_(True)
                kw = {}
                if mode == "causal":
                    kw["is_causal"] = True
                elif mode == "mask":
                    kw["attn_mask"] = (torch.rand(1, 1, N, N, generator=g) > 0.3).cuda()
                out = kernels.attention(q, k, v, **kw)
                out.backward(do)
                torch.cuda.synchronize()
                for name, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
                    if not torch.isfinite(t).all():
                        print(f"non-finite {name} at N={N} D={D} {mode}")
                        return 1
                n_runs += 1
                print(f"ok N={N} D={D} {mode}", flush=True)
    print(f"sanitize_cases: {n_runs} forward+backward runs completed "
          f"({flash_attention_gluon.LAUNCHES[0]} of the forwards on the Gluon path)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
from any kernel's data. ``--ws-ring-probe`` adds the forward's synchronisation (a TMA ring
with mbarriers between a producer warp and two consumer partitions), still without shared
memory of the kernel's own beyond the ring. ``--schedule c3+early+split`` runs the Gluon
forward under that schedule (``flash_attention_gluon.schedule_spec``; at D 64 with N 128 or
256 the last tile of three consumers leaves one or two of them without rows).
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
    def _probe(out_ptr):
        gl.warp_specialize([(_part, (out_ptr, 0)), (_part, (out_ptr, 1)),
                            (_part, (out_ptr, 2))], [4, 1], [240, 24])

    out = torch.zeros(3 * 128, dtype=torch.int32, device="cuda")
    _probe[(4, )](out, num_warps=4, maxnreg=168)
    torch.cuda.synchronize()
    want = torch.cat([torch.arange(128), torch.arange(128) + 1000,
                      torch.cat([torch.arange(32) + 2000, torch.zeros(96)])]).int().cuda()
    ok = torch.equal(out, want)
    print("ws-probe:", "ok" if ok else "wrong values")
    return 0 if ok else 1


def _ws_ring_probe(device: str = "cuda") -> int:
    """The forward's synchronisation without its arithmetic: a producer warp streams 64x64
    fp16 tiles by TMA through a two-slot ring (ready/empty mbarriers, a slot refilled when
    both consumers released it) and two 4-warp consumer partitions sum every tile, for 256
    tiles per program; the partitions spend the kernel in mbarrier waits, as the forward's
    do. Each consumer's sum must equal the program's tiles' sum."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

    @gluon.jit
    def _producer(args):
        desc, ring, ready, empty, out_ptr, row0, n_tiles = args
        rows = ring.type.shape[1]
        for t in range(n_tiles):
            slot = t % 2
            mbarrier.wait(empty.index(slot), ((t // 2) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), desc.block_type.nbytes)
            load(desc, [row0 + t * rows, 0], ready.index(slot), ring.index(slot))

    @gluon.jit
    def _consumer(args, C: gl.constexpr):
        desc, ring, ready, empty, out_ptr, row0, n_tiles = args
        lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        BR: gl.constexpr = ring.type.shape[1]
        BC: gl.constexpr = ring.type.shape[2]
        acc = gl.zeros([BR, BC], gl.float32, layout=lay)
        for t in range(n_tiles):
            slot = t % 2
            mbarrier.wait(ready.index(slot), (t // 2) & 1)
            acc += ring.index(slot).load(lay).to(gl.float32)
            mbarrier.arrive(empty.index(slot), count=1)
        gl.store(out_ptr + gl.program_id(0) * 2 + C, gl.sum(gl.sum(acc, 1), 0))

    @gluon.jit
    def _ring_probe(desc, out_ptr, n_tiles):
        ring = gl.allocate_shared_memory(desc.dtype, [2] + desc.block_type.shape, desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        row0 = gl.program_id(0) * n_tiles * desc.block_type.shape[0]
        args = (desc, ring, ready, empty, out_ptr, row0, n_tiles)
        gl.warp_specialize([(_consumer, (args, 0)), (_consumer, (args, 1)),
                            (_producer, (args, ))], [4, 1], [240, 24])

    programs, n_tiles = 264, 256
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-2, 3, (programs * n_tiles * 64, 64), generator=g).half().to(device)
    layout = gl.NVMMASharedLayout.get_default_for([64, 64], gl.float16)
    out = torch.zeros(programs * 2, dtype=torch.float32, device=device)
    _ring_probe[(programs, )](TensorDescriptor.from_tensor(x, [64, 64], layout), out, n_tiles,
                              num_warps=4, maxnreg=168)
    if device != "cuda":
        return 0  # the sm_90a compile check: nothing ran
    torch.cuda.synchronize()
    want = x.float().view(programs, -1).sum(1).repeat_interleave(2)
    ok = torch.equal(out, want)
    print("ws-ring-probe:", "ok" if ok else "wrong sums")
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default="1,17,127,129,1000")
    ap.add_argument("--ds", default="40,72,128,256")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--ws-probe", action="store_true",
                    help="only the partition-start probe (see the module docstring)")
    ap.add_argument("--ws-ring-probe", action="store_true",
                    help="only the mbarrier ring probe (see _ws_ring_probe)")
    ap.add_argument("--schedule", default="",
                    help="the Gluon forward's schedule, a +-joined set of "
                         f"{', '.join(flash_attention_gluon.SCHEDULE_PARTS)} (default: its own)")
    args = ap.parse_args(argv)
    try:
        kw = flash_attention_gluon.schedule_spec(args.schedule) if args.schedule else {}
    except ValueError as exc:
        ap.error(f"--schedule: {exc}")
    with flash_attention_gluon.schedule(**kw):
        return _run(args)


def _run(args) -> int:
    if args.ws_probe:
        return _ws_probe()
    if args.ws_ring_probe:
        return _ws_ring_probe()
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

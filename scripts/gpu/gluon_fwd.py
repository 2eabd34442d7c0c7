"""A Hopper attention forward in Gluon with explicit wgmma waits, timed beside ours and cuDNN.

    python3 scripts/gpu/gluon_fwd.py --out FILE.json           (on the H200)
    python3 scripts/gpu/gluon_fwd.py --compile-only --ptx-dir DIR   (anywhere, triton 3.6)

Why: Triton 3.6 waits on every Q Kᵀ product right after issuing it (sweep.md rounds 11 and
14), so a tile's exponentials never overlap the next tile's products. Gluon (Triton's
lower-level language, ``triton.experimental.gluon``) issues ``wgmma`` asynchronously and
waits with an explicit count. This forward issues tile j + 1's S = Q Kᵀ, runs tile j's
softmax while it is in flight, waits for tile j - 1's P V only before rescaling the
accumulator (``warpgroup_mma_wait(1)``: the newest group, S of j + 1, may stay in flight),
issues tile j's P V and waits for S of j + 1 with that P V still in flight. K and V tiles
come through TMA into ``STAGES``-deep rings with one mbarrier per slot; a K slot is
refilled once its S product is complete, a V slot once its P V product is.

A prototype, not the package's kernel: bf16/fp16, contiguous (B, H, N, D) inputs, N a
multiple of the tiles, no GQA, no masks but causal (top-left), forward only (O and the
base-2 lse). ``--compile-only`` compiles every variant for sm_90a without a GPU (the
stand-in driver of scripts/ptxas_report.py) and prints registers, spills and the order of
its ``wgmma`` commits, waits and exponentials. On a GPU it checks O against our forward and
times each variant, ours and cuDNN (median of ``triton.testing.do_bench``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from functools import partial
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

_ROOT = Path(__file__).resolve().parents[2]
VARIANTS = [(128, 64, 2, 8), (128, 64, 3, 8)]  # (BLOCK_M, BLOCK_N, STAGES, num_warps)


@gluon.jit
def _softmax(s, m_i, l_i, start_m, start_n, qk_scale, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, s_layout: gl.constexpr):
    """P (unnormalised, fp32) of the tile's scores ``s``, the rescale factor, new l and m."""
    if CAUSAL:
        if start_n + BLOCK_N > start_m:
            rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            ok = gl.expand_dims(rows, 1) >= gl.expand_dims(cols, 0)
            s = gl.where(ok, s, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, l_i, m_new


@gluon.jit
def _refill(desc, bars, smem, row0, done, STAGES: gl.constexpr, n_tiles,
            BLOCK_N: gl.constexpr):
    """Tile ``done`` of a ring is consumed: load tile done + STAGES into its slot (if any)."""
    t = done + STAGES
    slot = done % STAGES
    ok = t < n_tiles
    mbarrier.expect(bars.index(slot), desc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(desc, [row0 + gl.minimum(t, n_tiles - 1) * BLOCK_N, 0],
                                    bars.index(slot), smem.index(slot), pred=ok)


@gluon.jit
def _attn_fwd(q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, N_CTX,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
              STAGES: gl.constexpr, CAUSAL: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    orow: gl.constexpr = gl.SliceLayout(1, o_layout)
    srow: gl.constexpr = gl.SliceLayout(1, s_layout)

    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    row0 = bh * N_CTX
    start_m = pid_m * BLOCK_M
    if CAUSAL:
        n_tiles = (start_m + BLOCK_M) // BLOCK_N
    else:
        n_tiles = N_CTX // BLOCK_N

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row0 + start_m, 0], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        ok = i < n_tiles
        mbarrier.expect(k_bars.index(i), k_desc.block_type.nbytes, pred=ok)
        tma.async_copy_global_to_shared(k_desc, [row0 + i * BLOCK_N, 0], k_bars.index(i),
                                        k_smem.index(i), pred=ok)
        mbarrier.expect(v_bars.index(i), v_desc.block_type.nbytes, pred=ok)
        tma.async_copy_global_to_shared(v_desc, [row0 + i * BLOCK_N, 0], v_bars.index(i),
                                        v_smem.index(i), pred=ok)

    m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, layout=srow)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=srow)
    # The accumulator is carried as an in-flight wgmma result (its P V may still run).
    acc = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=o_layout))
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bars.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False,
                      is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    _refill(k_desc, k_bars, k_smem, row0, 0, STAGES, n_tiles, BLOCK_N)

    for j in range(0, n_tiles - 1):
        stage = j % STAGES
        phase = (j // STAGES) & 1
        nxt = (j + 1) % STAGES
        mbarrier.wait(k_bars.index(nxt), ((j + 1) // STAGES) & 1)
        s_next = warpgroup_mma(q_smem, k_smem.index(nxt).permute((1, 0)), s_zero,
                               use_acc=False, is_async=True)
        p, alpha, l_i, m_i = _softmax(s, m_i, l_i, start_m, j * BLOCK_N, qk_scale, BLOCK_M,
                                      BLOCK_N, CAUSAL, s_layout)
        # P V of tile j - 1 complete (S of j + 1, the newest group, may stay in flight).
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        # V of tile j - 1 is free (its P V is complete): V of tile j - 1 + STAGES goes there.
        if j >= 1:
            _refill(v_desc, v_bars, v_smem, row0, j - 1, STAGES, n_tiles, BLOCK_N)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow), 1)
        mbarrier.wait(v_bars.index(stage), phase)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(stage), acc,
                            is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_next, ))
        # K of tile j + 1 is free (its S is complete): K of tile j + 1 + STAGES goes there.
        _refill(k_desc, k_bars, k_smem, row0, j + 1, STAGES, n_tiles, BLOCK_N)

    j = n_tiles - 1
    p, alpha, l_i, m_i = _softmax(s, m_i, l_i, start_m, j * BLOCK_N, qk_scale, BLOCK_M,
                                  BLOCK_N, CAUSAL, s_layout)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow), 1)
    mbarrier.wait(v_bars.index(j % STAGES), (j // STAGES) & 1)
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(j % STAGES),
                        acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))
    out = acc / gl.expand_dims(gl.convert_layout(l_i, orow), 1)
    lse = m_i + gl.log2(l_i)
    offs = start_m + gl.arange(0, BLOCK_M, layout=srow)
    gl.store(lse_ptr + row0 + offs, lse)
    o_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_D], o_desc.layout)
    o_smem.store(out.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [row0 + start_m, 0], o_smem)
    tma.store_wait(pendings=0)


def forward(q, k, v, causal: bool, block_m=128, block_n=64, stages=2, num_warps=8):
    """O and the base-2 lse of softmax(Q Kᵀ / √D) V (see the module docstring's limits)."""
    B, H, N, D = q.shape
    if N % block_m or N % block_n or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"gluon_fwd: N={N} must be a multiple of {block_m} and {block_n}, "
                         "with k and v of q's shape")
    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[q.dtype]
    o = torch.empty_like(q)
    lse = torch.empty((B, H, N), dtype=torch.float32, device=q.device)

    def desc(t, rows):
        layout = gl.NVMMASharedLayout.get_default_for([rows, D], gdt)
        return TensorDescriptor.from_tensor(t.reshape(B * H * N, D), [rows, D], layout)

    _attn_fwd[(N // block_m, B * H)](
        desc(q, block_m), desc(k, block_n), desc(v, block_n), desc(o, block_m), lse,
        D ** -0.5 * math.log2(math.e), N, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_D=D,
        STAGES=stages, CAUSAL=causal, num_warps=num_warps)
    return o, lse


def _compile_only(ptx_dir: Path | None) -> int:
    spec = importlib.util.spec_from_file_location("ptxas_report", _ROOT / "scripts/ptxas_report.py")
    rep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rep)
    comp = rep._Compiler(ptx_dir)
    comp.install()
    for bm, bn, st, nw in VARIANTS:
        for causal in (False, True):
            comp.tag = f"{bm}x{bn} stages={st} warps={nw} causal={causal}"
            q = torch.empty(16, 16, 4096, 128, dtype=torch.bfloat16)
            try:
                forward(q, q, q, causal, bm, bn, st, nw)
            except Exception as e:  # noqa: BLE001 - reported per variant
                print(comp.tag, "error:", type(e).__name__, str(e)[:400])
    for r in comp.records:
        print(json.dumps(r))
    return 0


def _on_gpu(out: Path) -> int:
    import torch.nn.functional as F
    import triton
    import triton.testing
    from flashcheck.kernels import flash_attention as fa
    from flashcheck.kernels._common import validate
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def bench(fn):
        return triton.testing.do_bench(fn, return_mode="median")

    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, rows=[])
    for causal in (False, True):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(16, 16, 4096, 128, device="cuda", dtype=torch.bfloat16,
                               generator=g) for _ in range(3))
        p = validate(q, k, v, None, 0.0, causal, None, False, None, "top_left")
        ref_o, ref_lse = fa._forward(q, k, v, p, False)
        row = dict(causal=causal, ours_ms=bench(partial(fa._forward, q, k, v, p, False)))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            row["cudnn_ms"] = bench(partial(F.scaled_dot_product_attention, q, k, v,
                                            is_causal=causal))
        print(json.dumps(row), flush=True)
        for bm, bn, st, nw in VARIANTS:
            name = f"{bm}x{bn} stages={st} warps={nw}"
            run = partial(forward, q, k, v, causal, bm, bn, st, nw)
            try:
                o, lse = run()
                torch.cuda.synchronize()
                row[name] = dict(max_abs_vs_ours=float((o.float() - ref_o.float()).abs().max()),
                                 lse_max_abs_vs_ours=float((lse - ref_lse).abs().max()),
                                 ms=bench(run))
            except Exception as e:  # noqa: BLE001 - reported per variant
                row[name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            print(name, causal, row[name], flush=True)
        res["rows"].append(row)
        out.write_text(json.dumps(res, indent=1))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="JSON of the GPU run")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--ptx-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.compile_only:
        return _compile_only(args.ptx_dir)
    if args.out is None:
        ap.error("--out is required on a GPU")
    return _on_gpu(args.out)


if __name__ == "__main__":
    sys.exit(main())

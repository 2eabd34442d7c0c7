"""Hopper attention forwards in Gluon with explicit wgmma waits, timed beside ours and cuDNN.

    python3 scripts/gpu/gluon_fwd.py --out FILE.json [--only NAME ...]   (on the H200)
    python3 scripts/gpu/gluon_fwd.py --matrix --out FILE.json   (kernels/bench.py's 24 forwards)
    python3 scripts/gpu/gluon_fwd.py --compile-only --ptx-dir DIR   (anywhere, triton 3.6)

Why: Triton 3.6 waits on every Q Kᵀ product right after issuing it (sweep.md rounds 11 and
14), so a tile's exponentials never overlap the next tile's products. Gluon (Triton's
lower-level language, ``triton.experimental.gluon``) issues ``wgmma`` asynchronously and
waits with an explicit count. ``VARIANTS`` (sweep.md rounds 16 and 17):

- ``_attn_fwd`` (round 16): one partition; it issues tile j + 1's S = Q Kᵀ, runs tile j's
  softmax while it is in flight, waits for tile j - 1's P V only before rescaling the
  accumulator (``warpgroup_mma_wait(1)``), issues tile j's P V and waits for S of j + 1
  with that P V still in flight; K and V through TMA rings it refills itself.
- "ws" (round 17, in this script as of commit 069ce53): the same loop with a producer warp
  issuing every load (``gl.warp_specialize``), its consumers one 8-warp partition whose
  barrier waits and arrivals synchronise both warpgroups (``bar.sync 0, 256``).
- "2wg": two consumer warpgroups as partitions of their own (64 query rows each, barriers
  over 128 threads) sharing the rings of a producer warp, in FlashAttention-3's order
  (issue S(j+1), rescale, issue P(j) V(j), then the softmax of S(j+1) under P(j) V(j)):
  the package's forward, kernels/flash_attention_gluon.py, called as it is (round 17's
  other forms of it, other tiles and stages and warpgroup turns on mbarriers, are in this
  script as of commit 069ce53); "2wg persistent", the same as a persistent grid
  (``FLASHCHECK_GLUON=persistent``: a program per multiprocessor over the tiles, O stored
  from buffers of its own under the next tile's loads).

The prototypes: bf16/fp16, contiguous (B, H, N, D) inputs, N a multiple of the tiles, no
GQA, no masks but causal (top-left), forward only (O and the base-2 lse). ``--compile-only``
compiles every variant for sm_90a without a GPU (the stand-in driver of
scripts/ptxas_report.py) and prints registers, spills and shared memory. On a GPU it checks
O against our Triton forward and times each variant, ours and cuDNN (median of
``triton.testing.do_bench``) in one process.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from functools import partial
from pathlib import Path

import torch
from flashcheck.kernels._common import LOG2E
from flashcheck.kernels.flash_attention_gluon import _softmax  # the package's softmax step
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
# name -> forward()'s keywords
VARIANTS = {
    "128x64 stages=2 warps=8": dict(block_m=128, block_n=64, stages=2, num_warps=8),
    # two consumer partitions of 64 rows each, FlashAttention-3's order: the package's
    # forward (its tiles and stages; the other "2wg" forms of round 17, other tiles, stages
    # and warpgroup turns, are in this script as of commit 069ce53)
    "2wg 64x128 stages=2": dict(ws="2wg"),
    # the same forward as a persistent grid (FLASHCHECK_GLUON=persistent): a program per
    # multiprocessor over the tiles, each warpgroup's O through a buffer of its own so that
    # its store runs under the next tile's loads
    "2wg persistent": dict(ws="2wg", persistent=True),
}


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


def _package_forward(q, k, v, causal, persistent=False):
    """The "2wg" form as the package runs it (kernels/flash_attention_gluon.py), one
    program per tile or ``persistent``."""
    from flashcheck.kernels import _common
    from flashcheck.kernels import flash_attention_gluon as fg
    from flashcheck.kernels._common import Problem

    B, H, N, D = q.shape
    p = Problem(B=B, Hq=H, Hkv=H, Nq=N, Nk=N, D=D, scale=D ** -0.5, has_lo=False,
                has_hi=causal, lo_off=0, hi_off=0, is_causal=causal, mask=None, mask_kind=0)
    # "tile", not the default "auto": auto takes the persistent grid itself up to
    # _common.GLUON_PERSISTENT_MAX_KEYS, which would time one kernel under both names
    with _common.gluon("persistent" if persistent else "tile"):
        return fg.forward(q, k, v, p)


def forward(q, k, v, causal: bool, block_m=128, block_n=64, stages=2, num_warps=8,
            ws=False, persistent=False):
    """O and the base-2 lse of softmax(Q Kᵀ / √D) V (see the module docstring's limits)."""
    if ws == "2wg":
        return _package_forward(q, k, v, causal, persistent)  # its own checks and buffers
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
        D ** -0.5 * LOG2E, N, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_D=D,
        STAGES=stages, CAUSAL=causal, num_warps=num_warps)
    return o, lse


def _compile_only(ptx_dir: Path | None) -> int:
    spec = importlib.util.spec_from_file_location("ptxas_report", _ROOT / "scripts/ptxas_report.py")
    rep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rep)
    comp = rep._Compiler(ptx_dir)
    comp.install()
    for name, kw in VARIANTS.items():
        for causal in (False, True):
            comp.tag = f"{name} causal={causal}"
            q = torch.empty(16, 16, 4096, 128, dtype=torch.bfloat16)
            try:
                forward(q, q, q, causal, **kw)
            except Exception as e:  # noqa: BLE001 - reported per variant
                print(comp.tag, "error:", type(e).__name__, str(e)[:400])
    for r in comp.records:
        print(json.dumps(r))
    return 0


def _timed(out: Path, configs: list[dict], names) -> int:
    """Per configuration (dtype, D, causal, N, B, H): our Triton forward (the package's
    Gluon path off), cuDNN and the variants ``names``, each checked against ours, medians of
    ``triton.testing.do_bench`` in this one process; rows written to ``out`` as they come."""
    import torch.nn.functional as F
    import triton
    import triton.testing
    from flashcheck.kernels import _common
    from flashcheck.kernels import flash_attention as fa
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def bench(fn):
        return triton.testing.do_bench(fn, return_mode="median")

    def ours(q, k, v, p):
        with _common.gluon("off"):
            return fa._forward(q, k, v, p, False)

    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, rows=[])
    for cfg in configs:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(cfg["B"], cfg["H"], cfg["N"], cfg["D"], device="cuda",
                               dtype=getattr(torch, cfg["dtype"]), generator=g)
                   for _ in range(3))
        causal = cfg["causal"]
        p = _common.validate(q, k, v, None, 0.0, causal, None, False, None, "top_left")
        ref_o, ref_lse = ours(q, k, v, p)
        row = dict(cfg, ours_ms=bench(partial(ours, q, k, v, p)))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            row["cudnn_ms"] = bench(partial(F.scaled_dot_product_attention, q, k, v,
                                            is_causal=causal))
        for name in names:
            run = partial(forward, q, k, v, causal, **VARIANTS[name])
            try:
                o, lse = run()
                torch.cuda.synchronize()
                row[name] = dict(max_abs_vs_ours=float((o.float() - ref_o.float()).abs().max()),
                                 lse_max_abs_vs_ours=float((lse - ref_lse).abs().max()),
                                 ms=bench(run))
            except Exception as e:  # noqa: BLE001 - reported per variant
                row[name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
        out.write_text(json.dumps(res, indent=1))
    return 0


# The variants --matrix times (kernels/bench.py's 24 configurations).
MATRIX_VARIANTS = ("2wg 64x128 stages=2", "2wg persistent")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="JSON of the GPU run")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--ptx-dir", type=Path, default=None)
    ap.add_argument("--matrix", action="store_true",
                    help="the benchmark matrix's forward: ours, cuDNN, MATRIX_VARIANTS")
    ap.add_argument("--only", action="append", default=[], choices=sorted(VARIANTS),
                    help="time only these variants (repeatable; default: all)")
    args = ap.parse_args(argv)
    if args.compile_only:
        return _compile_only(args.ptx_dir)
    if args.out is None:
        ap.error("--out is required on a GPU")
    if args.matrix:
        from flashcheck.kernels.bench import configurations
        return _timed(args.out, configurations(False), MATRIX_VARIANTS)
    return _timed(args.out, [dict(dtype="bfloat16", D=128, causal=c, N=4096, B=16, H=16)
                             for c in (False, True)],
                  [n for n in VARIANTS if not args.only or n in args.only])


if __name__ == "__main__":
    sys.exit(main())

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
- ``_attn_fwd_ws`` ("ws"): the same loop with a producer warp issuing every load
  (``gl.warp_specialize``); its consumers are one 8-warp partition, whose barrier waits
  and arrivals synchronise both warpgroups (``bar.sync 0, 256``).
- ``_attn_fwd_2wg`` ("2wg"): two consumer warpgroups as partitions of their own (64 query
  rows each, barriers over 128 threads) sharing the rings of a producer warp, in
  FlashAttention-3's order (issue S(j+1), rescale, issue P(j) V(j), then the softmax of
  S(j+1) under P(j) V(j)); "pingpong" adds warpgroup turns on mbarriers around the two
  issues. The package's forward (kernels/flash_attention_gluon.py) is this one without
  the turns.

Prototypes: bf16/fp16, contiguous (B, H, N, D) inputs, N a multiple of the tiles, no GQA,
no masks but causal (top-left), forward only (O and the base-2 lse). ``--compile-only``
compiles every variant for sm_90a without a GPU (the stand-in driver of
scripts/ptxas_report.py) and prints registers, spills and shared memory. On a GPU it checks
O against our Triton forward and times each variant, ours and cuDNN (median of
``triton.testing.do_bench``) in one process.
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
# name -> forward()'s keywords. The warp-specialized ones run 8 + 1 warps (12 allocated, by
# warpgroup): maxnreg 168 = 65536 / 384 registers, of which the producer warp's group keeps
# 24 per thread and the two consumer warpgroups get (168·384 − 24·128) / 256 = 240.
VARIANTS = {
    "128x64 stages=2 warps=8": dict(block_m=128, block_n=64, stages=2, num_warps=8),
    "ws 128x64 stages=2": dict(block_m=128, block_n=64, stages=2, num_warps=8, ws=True,
                               maxnreg=168),
    "ws 128x64 stages=4": dict(block_m=128, block_n=64, stages=4, num_warps=8, ws=True,
                               maxnreg=168),
    "ws 128x128 stages=2": dict(block_m=128, block_n=128, stages=2, num_warps=8, ws=True,
                                maxnreg=168),
    # two consumer partitions of 64 rows each (4 + 4 + 1 warps, 12 allocated, as above)
    "2wg 64x64 stages=2": dict(block_m=64, block_n=64, stages=2, num_warps=4, ws="2wg",
                               maxnreg=168),
    "2wg 64x64 stages=4": dict(block_m=64, block_n=64, stages=4, num_warps=4, ws="2wg",
                               maxnreg=168),
    "2wg 64x128 stages=2": dict(block_m=64, block_n=128, stages=2, num_warps=4, ws="2wg",
                                maxnreg=168),
    # O written from Q's buffer: three 128-key stages fit (2·16 + 3·64 KiB)
    "2wg 64x128 stages=3": dict(block_m=64, block_n=128, stages=3, num_warps=4, ws="2wg",
                                maxnreg=168),
    "2wg pingpong 64x128 stages=2": dict(block_m=64, block_n=128, stages=2, num_warps=4,
                                         ws="2wg", maxnreg=168, pingpong=True),
    "2wg pingpong 64x128 stages=3": dict(block_m=64, block_n=128, stages=3, num_warps=4,
                                         ws="2wg", maxnreg=168, pingpong=True),
}


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


@gluon.jit
def _ws_loads(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty,
              v_ready, v_empty, row0, start_m, n_tiles, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr):
    """The producer warp: Q once, then K and V tile by tile into their rings, each slot
    refilled once the consumers have released it (its ``empty`` barrier)."""
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row0 + start_m, 0], q_bar, q_smem)
    for j in range(n_tiles):
        slot = j % STAGES
        # a fresh mbarrier counts as phase 1 complete: the first pass over the ring waits
        # for nothing
        free = ((j // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(slot), free)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row0 + j * BLOCK_N, 0], k_ready.index(slot),
                                        k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), free)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row0 + j * BLOCK_N, 0], v_ready.index(slot),
                                        v_smem.index(slot))


@gluon.jit
def _ws_compute(q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, n_tiles,
                start_m, qk_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                HEAD_D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                num_warps: gl.constexpr):
    """The consumer warpgroups: _attn_fwd's loop with the loads left to the producer; a
    ring slot is released (arrive on its ``empty`` barrier) once its product completed."""
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    orow: gl.constexpr = gl.SliceLayout(1, o_layout)
    srow: gl.constexpr = gl.SliceLayout(1, s_layout)

    m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, layout=srow)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=srow)
    acc = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=o_layout))
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False,
                      is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    mbarrier.arrive(k_empty.index(0), count=1)

    for j in range(0, n_tiles - 1):
        stage = j % STAGES
        nxt = (j + 1) % STAGES
        mbarrier.wait(k_ready.index(nxt), ((j + 1) // STAGES) & 1)
        s_next = warpgroup_mma(q_smem, k_smem.index(nxt).permute((1, 0)), s_zero,
                               use_acc=False, is_async=True)
        p, alpha, l_i, m_i = _softmax(s, m_i, l_i, start_m, j * BLOCK_N, qk_scale, BLOCK_M,
                                      BLOCK_N, CAUSAL, s_layout)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        if j >= 1:
            mbarrier.arrive(v_empty.index((j - 1) % STAGES), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow), 1)
        mbarrier.wait(v_ready.index(stage), (j // STAGES) & 1)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(stage), acc,
                            is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_next, ))
        mbarrier.arrive(k_empty.index(nxt), count=1)

    j = n_tiles - 1
    p, alpha, l_i, m_i = _softmax(s, m_i, l_i, start_m, j * BLOCK_N, qk_scale, BLOCK_M,
                                  BLOCK_N, CAUSAL, s_layout)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow), 1)
    mbarrier.wait(v_ready.index(j % STAGES), (j // STAGES) & 1)
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(j % STAGES),
                        acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    out = acc / gl.expand_dims(gl.convert_layout(l_i, orow), 1)
    return out.to(dtype), m_i + gl.log2(l_i)


@gluon.jit
def _attn_fwd_ws(q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, N_CTX,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                 STAGES: gl.constexpr, CAUSAL: gl.constexpr, num_warps: gl.constexpr):
    """_attn_fwd warp-specialized: one producer warp issues every TMA load (``_ws_loads``),
    the kernel's ``num_warps`` (two warpgroups at 8) only wait on ready barriers and
    compute (``_ws_compute``); ring slots go back through ``empty`` barriers."""
    dtype: gl.constexpr = q_desc.dtype
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
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=1)

    out, lse = gl.warp_specialize([
        (_ws_compute, (q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                       n_tiles, start_m, qk_scale, BLOCK_M, BLOCK_N, HEAD_D, STAGES, CAUSAL,
                       num_warps)),
        (_ws_loads, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty,
                     v_ready, v_empty, row0, start_m, n_tiles, BLOCK_N, STAGES)),
    ], [1], [24])

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(i))
        mbarrier.invalidate(k_empty.index(i))
        mbarrier.invalidate(v_ready.index(i))
        mbarrier.invalidate(v_empty.index(i))
    offs = start_m + gl.arange(0, BLOCK_M, layout=lse.type.layout)
    gl.store(lse_ptr + row0 + offs, lse)
    o_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_D], o_desc.layout)
    o_smem.store(out)
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [row0 + start_m, 0], o_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _wg_loads(args):
    """Two-consumer form's producer warp: each K/V slot goes back when both consumer
    warpgroups have released it (its ``empty`` barrier counts 2 arrivals)."""
    (q_desc, k_desc, v_desc, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bars, k_ready,
     k_empty, v_ready, v_empty, turns, pingpong, row0, start_m, n_tiles, qk_scale) = args
    # worker partitions take no constexpr arguments (triton 3.6): sizes from the buffers
    BLOCK_M: gl.constexpr = q_smem.type.shape[1]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    STAGES: gl.constexpr = k_smem.type.shape[0]
    for c in gl.static_range(2):
        mbarrier.expect(q_bars.index(c), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [row0 + start_m + c * BLOCK_M, 0],
                                        q_bars.index(c), q_smem.index(c))
    for j in range(n_tiles):
        slot = j % STAGES
        free = ((j // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(slot), free)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row0 + j * BLOCK_N, 0], k_ready.index(slot),
                                        k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), free)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row0 + j * BLOCK_N, 0], v_ready.index(slot),
                                        v_smem.index(slot))


@gluon.jit
def _wg_consume(args, C: gl.constexpr, CAUSAL: gl.constexpr):
    """Consumer warpgroup ``C`` (4 warps) of the two-consumer form: rows start_m + C·BLOCK_M
    onward, then its own epilogue (lse, O by TMA from its Q buffer, free by then). Its
    barriers and syncs span its own 128 threads only. FlashAttention-3's order per tile j:
    issue S(j+1) = Q K(j+1)ᵀ, rescale O, issue O += P(j) V(j), then, with both in flight,
    wait for S(j+1) and run its softmax while P(j) V(j) still runs. With ``pingpong`` the
    two issues are this warpgroup's turn (an mbarrier each, handed over after the issue),
    so one warpgroup's softmax runs under the other's products. Under causal, tiles past
    its own rows are waited for and released, not computed."""
    (q_desc, k_desc, v_desc, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bars, k_ready,
     k_empty, v_ready, v_empty, turns, pingpong, row0, start_m, n_tiles, qk_scale) = args
    BLOCK_M: gl.constexpr = q_smem.type.shape[1]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    HEAD_D: gl.constexpr = k_smem.type.shape[2]
    STAGES: gl.constexpr = k_smem.type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    orow: gl.constexpr = gl.SliceLayout(1, o_layout)
    srow: gl.constexpr = gl.SliceLayout(1, s_layout)
    my_m = start_m + C * BLOCK_M
    if CAUSAL:
        n_own = gl.minimum(gl.cdiv(my_m + BLOCK_M, BLOCK_N), n_tiles)
    else:
        n_own = n_tiles
    qs = q_smem.index(C)

    m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, layout=srow)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=srow)
    acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

    mbarrier.wait(q_bars.index(C), 0)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(qs, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False,
                      is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    p, alpha, l_i, m_i = _softmax(s, m_i, l_i, my_m, 0, qk_scale, BLOCK_M, BLOCK_N, CAUSAL,
                                  s_layout)

    for j in range(0, n_own - 1):
        stage = j % STAGES
        nxt = (j + 1) % STAGES
        mbarrier.wait(k_ready.index(nxt), ((j + 1) // STAGES) & 1)
        mbarrier.wait(v_ready.index(stage), (j // STAGES) & 1)
        if pingpong:
            # this warpgroup's j-th turn: a fresh barrier passes parity 1 (warpgroup 0
            # starts), then each turn needs the other warpgroup's handover
            mbarrier.wait(turns.index(C), (j & 1) ^ (1 - C))
        s_next = warpgroup_mma(qs, k_smem.index(nxt).permute((1, 0)), s_zero,
                               use_acc=False, is_async=True)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow), 1)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(stage), acc,
                            is_async=True)
        if pingpong:
            mbarrier.arrive(turns.index(1 - C), count=1)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_next, ))
        mbarrier.arrive(k_empty.index(nxt), count=1)
        p, alpha, l_i, m_i = _softmax(s, m_i, l_i, my_m, (j + 1) * BLOCK_N, qk_scale, BLOCK_M,
                                      BLOCK_N, CAUSAL, s_layout)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(stage), count=1)

    j = n_own - 1
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow), 1)
    mbarrier.wait(v_ready.index(j % STAGES), (j // STAGES) & 1)
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(j % STAGES),
                        acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(v_empty.index(j % STAGES), count=1)
    # Tiles past this warpgroup's rows (causal): wait until loaded, then release, so that
    # the other warpgroup's arrivals complete each slot's phase.
    for t in range(n_own, n_tiles):
        ph = (t // STAGES) & 1
        mbarrier.wait(k_ready.index(t % STAGES), ph)
        mbarrier.arrive(k_empty.index(t % STAGES), count=1)
        mbarrier.wait(v_ready.index(t % STAGES), ph)
        mbarrier.arrive(v_empty.index(t % STAGES), count=1)

    out = acc / gl.expand_dims(gl.convert_layout(l_i, orow), 1)
    offs = my_m + gl.arange(0, BLOCK_M, layout=srow)
    gl.store(lse_ptr + row0 + offs, m_i + gl.log2(l_i))
    # Q's buffer is free: every product reading it has completed.
    qs.store(out.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [row0 + my_m, 0], qs)
    tma.store_wait(pendings=0)


@gluon.jit
def _wg_consume0(args):
    _wg_consume(args, 0, False)


@gluon.jit
def _wg_consume1(args):
    _wg_consume(args, 1, False)


@gluon.jit
def _wg_consume0_causal(args):
    _wg_consume(args, 0, True)


@gluon.jit
def _wg_consume1_causal(args):
    _wg_consume(args, 1, True)


@gluon.jit
def _attn_fwd_2wg(q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, N_CTX,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                  STAGES: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
                  num_warps: gl.constexpr):
    """Two consumer warpgroups as partitions of their own (the default partition, 4 warps,
    and a worker of 4), BLOCK_M rows each, sharing the K/V rings a producer warp fills: the
    FlashAttention-3 shape, its warpgroups' turns (``PINGPONG``) on mbarriers."""
    dtype: gl.constexpr = q_desc.dtype
    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    row0 = bh * N_CTX
    start_m = pid_m * (2 * BLOCK_M)
    if CAUSAL:
        n_tiles = (start_m + 2 * BLOCK_M) // BLOCK_N
    else:
        n_tiles = N_CTX // BLOCK_N

    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(2):
        mbarrier.init(q_bars.index(c), count=1)
        mbarrier.init(turns.index(c), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)

    args = (q_desc, k_desc, v_desc, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bars,
            k_ready, k_empty, v_ready, v_empty, turns, 1 if PINGPONG else 0, row0, start_m,
            n_tiles, qk_scale)
    if CAUSAL:
        gl.warp_specialize([(_wg_consume0_causal, (args, )), (_wg_consume1_causal, (args, )),
                            (_wg_loads, (args, ))], [4, 1], [240, 24])
    else:
        gl.warp_specialize([(_wg_consume0, (args, )), (_wg_consume1, (args, )),
                            (_wg_loads, (args, ))], [4, 1], [240, 24])


def forward(q, k, v, causal: bool, block_m=128, block_n=64, stages=2, num_warps=8,
            ws=False, maxnreg=None, pingpong=False):
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

    kernel = {False: _attn_fwd, True: _attn_fwd_ws, "2wg": _attn_fwd_2wg}[ws]
    extra = {} if maxnreg is None else dict(maxnreg=maxnreg)
    if ws == "2wg":
        # both warpgroups must take as many turns: the same tile count under causal too
        if pingpong and causal and block_n != 2 * block_m:
            raise ValueError("gluon_fwd: pingpong under causal needs block_n == 2 * block_m")
        extra["PINGPONG"] = pingpong
    rows = 2 * block_m if ws == "2wg" else block_m  # query rows per program
    kernel[(N // rows, B * H)](
        desc(q, block_m), desc(k, block_n), desc(v, block_n), desc(o, block_m), lse,
        D ** -0.5 * math.log2(math.e), N, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_D=D,
        STAGES=stages, CAUSAL=causal, num_warps=num_warps, **extra)
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


def _on_gpu(out: Path, only=()) -> int:
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
        for name, kw in VARIANTS.items():
            if only and name not in only:
                continue
            run = partial(forward, q, k, v, causal, **kw)
            try:
                o, lse = run()
                torch.cuda.synchronize()
                row[name] = dict(max_abs_vs_ours=float((o.float() - ref_o.float()).abs().max()),
                                 lse_max_abs_vs_ours=float((lse - ref_lse).abs().max()),
                                 ms=bench(run))
            except Exception as e:  # noqa: BLE001 - reported per variant
                row[name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            print(name, causal, row[name], flush=True)
            out.write_text(json.dumps({**res, "rows": res["rows"] + [row]}, indent=1))
        res["rows"].append(row)
        out.write_text(json.dumps(res, indent=1))
    return 0


MATRIX_VARIANTS = ("2wg 64x128 stages=2", "2wg pingpong 64x128 stages=2")


def _matrix(out: Path) -> int:
    """The benchmark matrix's forward (kernels/bench.py's 24 configurations): ours, cuDNN
    and MATRIX_VARIANTS in one call, each checked against ours."""
    import torch.nn.functional as F
    import triton
    import triton.testing
    from flashcheck.kernels import flash_attention as fa
    from flashcheck.kernels._common import validate
    from flashcheck.kernels.bench import configurations
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def bench(fn):
        return triton.testing.do_bench(fn, return_mode="median")

    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, rows=[])
    for cfg in configurations(False):
        dt = getattr(torch, cfg["dtype"])
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(cfg["B"], cfg["H"], cfg["N"], cfg["D"], device="cuda",
                               dtype=dt, generator=g) for _ in range(3))
        causal = cfg["causal"]
        p = validate(q, k, v, None, 0.0, causal, None, False, None, "top_left")
        ref_o, ref_lse = fa._forward(q, k, v, p, False)
        row = dict(cfg, ours_ms=bench(partial(fa._forward, q, k, v, p, False)))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            row["cudnn_ms"] = bench(partial(F.scaled_dot_product_attention, q, k, v,
                                            is_causal=causal))
        for name in MATRIX_VARIANTS:
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
        return _matrix(args.out)
    return _on_gpu(args.out, tuple(args.only))


if __name__ == "__main__":
    sys.exit(main())

"""A Hopper dK/dV kernel in Gluon, the forward's structure (kernels/flash_attention_gluon.py)
for the backward: compiled here, timed and checked on the H200.

    python3 scripts/gpu/gluon_bwd.py --out FILE.json [--d 128] [--ordered]   (on the H200)
    python3 scripts/gpu/gluon_bwd.py --compile-only [--ptx-dir DIR]   (anywhere)

Under triton 3.9 (``. scripts/gpu/triton_slim.sh use`` on the device) the five-product
variants also add dQ by bulk tensor reduce-adds (``tma.async_atomic_add``), which 3.6's
Gluon lacks.

Per program 128 keys of one batch and head: a producer warp loads K and V once per consumer
and streams Q and dO tiles of 64 query rows through two-slot rings (``ready``/``empty``
mbarriers, a slot refilled when both consumers released it); two consumer warpgroups of
64 keys each, partitions of their own, run per query tile i: issue Sᵀ = K Q(i)ᵀ and
dPᵀ = V dO(i)ᵀ; wait for Sᵀ (dPᵀ still in flight), Pᵀ = exp2(Sᵀ·c − lse(i)); issue
dV += Pᵀ dO(i); wait for dPᵀ, dSᵀ = Pᵀ ∘ (dPᵀ − δ(i)) (Pᵀ in fp32); issue dK += dSᵀ Q(i);
wait for both before the slot goes back. dK is scaled once at the end. The arithmetic of
our Triton dK/dV kernel (P and dS rounded to the input dtype before their products, fp32
accumulators, base-2 lse), so dK and dV match it to the accumulation order.

A prototype: bf16/fp16, contiguous (B, H, N, D), MHA, N a multiple of 128, D 64 or 128, no
mask but causal (top-left). dK/dV only by default (the delta preprocess and dQ stay the
Triton kernels'); with ``dq_acc`` dQ is added inside as well (five products per tile pair,
see :func:`_consume`). On a GPU it checks the gradients against our backward and times the
kernel beside our whole backward and cuDNN's (median of ``triton.testing.do_bench``);
results: docs/benchmarks/sweep.md round 18.
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
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

_ROOT = Path(__file__).resolve().parents[2]
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # 3.6 / 3.9

BULK = hasattr(tma, "async_atomic_add")  # bulk tensor reduce-adds: triton 3.9's Gluon, not 3.6's


@gluon.jit
def _no_reduce(desc, coord, src):
    """Stands in for the bulk reduce-add where Gluon has none (never traced: BULK guards)."""
    pass


_tma_reduce = tma.async_atomic_add if BULK else _no_reduce
BLOCK_N = 64  # keys per consumer warpgroup (two per program)
BLOCK_M = 64  # query rows per streamed tile
STAGES = 2


@gluon.jit
def _loads(args):
    """Producer warp: K and V of each consumer once, then Q and dO tile by tile."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_ptr, delta_ptr, k_smem, v_smem,
     q_smem, do_smem, kv_bars, q_ready, q_empty, row0, start_n, m_lo, n_qtiles,
     qk_scale, sm_scale, dq_ptr, ds_smem, sem_ptr, n_ctx, rot, dq_smem, ds_ready, q_row0,
     n_group, dq_full, dq_free) = args
    BN: gl.constexpr = k_smem.type.shape[0] // 2
    BM: gl.constexpr = q_smem.type.shape[1]
    NS: gl.constexpr = q_smem.type.shape[0]
    for c in gl.static_range(2):
        mbarrier.expect(kv_bars.index(c), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        rows = row0 + start_n + c * BN
        _tma_load(k_desc, [rows, 0], kv_bars.index(c), k_smem.slice(c * BN, BN))
        _tma_load(v_desc, [rows, 0], kv_bars.index(c), v_smem.slice(c * BN, BN))
    for j in range(n_group * n_qtiles):  # the group's query heads in turn (GQA)
        i = j % n_qtiles
        slot = j % NS
        free = ((j // NS) & 1) ^ 1
        mbarrier.wait(q_empty.index(slot), free)
        mbarrier.expect(q_ready.index(slot),
                        q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        m = q_row0 + (j // n_qtiles) * n_ctx + (m_lo + i * BM + rot) % n_ctx
        _tma_load(q_desc, [m, 0], q_ready.index(slot), q_smem.index(slot))
        _tma_load(do_desc, [m, 0], q_ready.index(slot), do_smem.index(slot))


@gluon.jit
def _writer(args, ORDERED: gl.constexpr):
    """DQ 8, 9: a warp of its own adds the consumers' staged dQ halves (tile by tile, half 0
    then 1), in order for 9 (as DQ 7 does), and frees each slot once the add has read it."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_ptr, delta_ptr, k_smem, v_smem,
     q_smem, do_smem, kv_bars, q_ready, q_empty, row0, start_n, m_lo, n_qtiles,
     qk_scale, sm_scale, dq_ptr, ds_smem, sem_ptr, n_ctx, rot, dq_smem, ds_ready, q_row0,
     n_group, dq_full, dq_free) = args
    BM: gl.constexpr = dq_smem.type.shape[1]
    HH: gl.constexpr = dq_smem.type.shape[2]
    for j in range(n_group * n_qtiles):
        i = j % n_qtiles
        qb = q_row0 + (j // n_qtiles) * n_ctx
        m0 = (m_lo + i * BM + rot) % n_ctx
        for c in gl.static_range(2):
            w = c * 2 + j % 2
            mbarrier.wait(dq_full.index(w), (j // 2) & 1)
            if ORDERED:
                sem = sem_ptr + ((qb + m0) // BM) * 2 + c
                while gl.atomic_add(sem, 0, sem="acquire") != i // 2:
                    pass
                _tma_reduce(dq_ptr, [qb + m0, c * HH], dq_smem.index(w))
                tma.store_wait(pendings=0, read_only=False)
                gl.atomic_add(sem, 1, sem="release")
            else:
                _tma_reduce(dq_ptr, [qb + m0, c * HH], dq_smem.index(w))
                tma.store_wait(pendings=0)
            mbarrier.arrive(dq_free.index(w), count=1)


@gluon.jit
def _writer_free(args):
    _writer(args, False)


@gluon.jit
def _writer_ordered(args):
    _writer(args, True)


@gluon.jit
def _consume(args, C: gl.constexpr, CAUSAL: gl.constexpr, DQ: gl.constexpr):
    """Consumer warpgroup ``C``: keys start_n + C·BN onward (see the module docstring).
    Under causal, query tiles wholly above its keys are waited for and released, not
    computed (the producer streams from the program's first query tile). ``DQ`` 1 or 2:
    also dQ(i) += dS(i) K for its keys (dSᵀ through shared memory, read transposed by the
    product), added to the fp32 accumulator at ``dq_ptr``: 1 by relaxed atomics as they
    come, 2 in a fixed order (a counter per query tile at ``sem_ptr``; non-causal, Nq = Nk:
    the programs visit the query tiles rotated by ``rot``, their first key). With triton
    3.9's bulk reduce-adds (``dq_ptr`` a descriptor): 3 as they come, 4 in order, 5 a
    diagnostic (the tile staged, not added), 6 the head dim split between the warpgroups:
    both write their dSᵀ rows into one buffer (``ds_ready`` counts the two), and each
    multiplies all 128 keys' dS by its half of K's columns, so that every dQ element is
    added once per program, not once per warpgroup; 7 the same in order; 8 and 9 as 6 and 7
    with the adds (and, for 9, the waits for a turn) moved to a warp of its own
    (:func:`_writer`), each warpgroup staging its dQ half in a two-slot ring."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_ptr, delta_ptr, k_smem, v_smem,
     q_smem, do_smem, kv_bars, q_ready, q_empty, row0, start_n, m_lo, n_qtiles,
     qk_scale, sm_scale, dq_ptr, ds_smem, sem_ptr, n_ctx, rot, dq_smem, ds_ready, q_row0,
     n_group, dq_full, dq_free) = args
    BN: gl.constexpr = k_smem.type.shape[0] // 2
    HD: gl.constexpr = k_smem.type.shape[1]
    BM: gl.constexpr = q_smem.type.shape[1]
    NS: gl.constexpr = q_smem.type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HD, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                 k_width=2)
    cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    if DQ >= 6:
        HH: gl.constexpr = HD // 2
        dqh_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HH, 16])
        dq_zero = gl.zeros([BM, HH], gl.float32, layout=dqh_layout)
        # K of both warpgroups' keys, this warpgroup's half of the head dim
        k_half = k_smem.slice(C * HH, HH, dim=1)
    elif DQ:
        dss = ds_smem.index(C)
        dq_zero = gl.zeros([BM, HD], gl.float32, layout=acc_layout)
    my_n = start_n + C * BN
    ks = k_smem.slice(C * BN, BN)
    vs = v_smem.slice(C * BN, BN)
    dk = gl.zeros([BN, HD], gl.float32, layout=acc_layout)
    dv = gl.zeros([BN, HD], gl.float32, layout=acc_layout)
    s_zero = gl.zeros([BN, BM], gl.float32, layout=s_layout)
    mbarrier.wait(kv_bars.index(C), 0)
    for j in range(n_group * n_qtiles):  # the group's query heads in turn (GQA)
        i = j % n_qtiles
        qb = q_row0 + (j // n_qtiles) * n_ctx  # this query head's rows
        slot = j % NS
        m0 = (m_lo + i * BM + rot) % n_ctx
        mbarrier.wait(q_ready.index(slot), (j // NS) & 1)
        live = m0 + BM > my_n  # under causal: some of these queries see this warpgroup's keys
        if not CAUSAL or DQ >= 6:  # DQ 6, 7: both warpgroups take every tile (dQ needs both)
            live = m0 >= 0
        if live:
            qs = q_smem.index(slot)
            dos = do_smem.index(slot)
            st = warpgroup_mma(ks, qs.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dpt = warpgroup_mma(vs, dos.permute((1, 0)), s_zero, use_acc=False,
                                is_async=True)
            st = warpgroup_mma_wait(num_outstanding=1, deps=(st, ))
            offs_m = m0 + gl.arange(0, BM, layout=cols)
            lse = gl.load(lse_ptr + qb + offs_m)
            pt = gl.exp2(st * qk_scale - gl.expand_dims(lse, 0))
            if CAUSAL:
                keys = my_n + gl.arange(0, BN, layout=gl.SliceLayout(1, s_layout))
                pt = gl.where(gl.expand_dims(offs_m, 0) >= gl.expand_dims(keys, 1), pt, 0.0)
            p_in = pt.to(dtype)
            dv = warpgroup_mma(gl.convert_layout(p_in, a_layout), dos, dv, is_async=True)
            dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt, ))
            delta = gl.load(delta_ptr + qb + offs_m)
            dst = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
            dk = warpgroup_mma(gl.convert_layout(dst, a_layout), qs, dk, is_async=True)
            if DQ >= 6:
                # dQ(i)'s head-dim half C over all 128 keys: both warpgroups' dSᵀ halves in
                # one buffer (a slot per tile parity), then one bulk reduce-add per half
                dsf = ds_smem.index(j % 2)
                dsf.slice(C * BN, BN, dim=0).store(dst)
                fence_async_shared()
                mbarrier.arrive(ds_ready.index(j % 2), count=1)
                mbarrier.wait(ds_ready.index(j % 2), (j // 2) & 1)
                dq = warpgroup_mma(dsf.permute((1, 0)), k_half, dq_zero, use_acc=False,
                                   is_async=True)
                dv, dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, dq))
                if DQ >= 8:
                    # staged in this warpgroup's slot of a two-slot ring; the writer warp
                    # adds it (in order for 9) and hands the slot back
                    w = C * 2 + j % 2
                    mbarrier.wait(dq_free.index(w), ((j // 2) & 1) ^ 1)
                    dq_smem.index(w).store(dq)
                    fence_async_shared()
                    mbarrier.arrive(dq_full.index(w), count=1)
                else:
                    dqs = dq_smem.index(C)
                    tma.store_wait(pendings=0)
                    dqs.store(dq)
                    fence_async_shared()
                if DQ == 7:
                    # in order: one counter per (query tile, head-dim half); the programs
                    # visit the tiles rotated by their first key, so a tile's adders come
                    # one per program, every other step, the previous one the next program
                    sem = sem_ptr + ((qb + m0) // BM) * 2 + C
                    while gl.atomic_add(sem, 0, sem="acquire") != i // 2:
                        pass
                    _tma_reduce(dq_ptr, [qb + m0, C * HH], dqs)
                    tma.store_wait(pendings=0, read_only=False)
                    _barrier()
                    gl.atomic_add(sem, 1, sem="release")
                elif DQ == 6:
                    _tma_reduce(dq_ptr, [qb + m0, C * HH], dqs)
            elif DQ:
                dss.store(dst)
                fence_async_shared()
                dq = warpgroup_mma(dss.permute((1, 0)), ks, dq_zero, use_acc=False,
                                   is_async=True)
                dv, dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, dq))
                if DQ >= 3:
                    # one bulk tensor reduce-add per tile (dq_ptr is the accumulator's
                    # descriptor); the previous tile's must have read its staging buffer
                    dqs = dq_smem.index(C)
                    tma.store_wait(pendings=0)
                    dqs.store(dq)
                    fence_async_shared()
                    if DQ == 5:
                        pass  # a diagnostic: the product and the staging store, no add
                    elif DQ == 4:
                        sem = sem_ptr + (qb + m0) // BM
                        rank = 2 * (i // 2) + C
                        while gl.atomic_add(sem, 0, sem="acquire") != rank:
                            pass
                        _tma_reduce(dq_ptr, [qb + m0, 0], dqs)
                        tma.store_wait(pendings=0, read_only=False)
                        _barrier()
                        gl.atomic_add(sem, 1, sem="release")
                    else:
                        _tma_reduce(dq_ptr, [qb + m0, 0], dqs)
                if DQ < 3:
                    rows = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
                    dcols = gl.arange(0, HD, layout=gl.SliceLayout(0, acc_layout))
                    ptrs = (dq_ptr + (qb + gl.expand_dims(rows, 1)).to(gl.int64) * HD
                            + gl.expand_dims(dcols, 0))
                if DQ == 1:
                    gl.atomic_add(ptrs, dq, sem="relaxed")
                elif DQ == 2:
                    # ordered: this warpgroup's turn on tile m0 is its rank among the tile's
                    # adders (programs visit the tiles rotated by their first key, so the
                    # tile's previous adder is the next program, two steps earlier)
                    sem = sem_ptr + (qb + m0) // BM
                    rank = 2 * (i // 2) + C
                    while gl.atomic_add(sem, 0, sem="acquire") != rank:
                        pass
                    gl.store(ptrs, gl.load(ptrs) + dq)
                    _barrier()
                    gl.atomic_add(sem, 1, sem="release")
            else:
                dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
        mbarrier.arrive(q_empty.index(slot), count=1)
    if DQ >= 6:
        # the other warpgroup's dQ products read this one's K rows (k_half): one more turn
        # of ds_ready, so that neither overwrites its K rows below while the other reads them
        jn = n_group * n_qtiles
        mbarrier.arrive(ds_ready.index(jn % 2), count=1)
        mbarrier.wait(ds_ready.index(jn % 2), (jn // 2) & 1)
    # dK's scale once at the end, as our Triton kernel does; out through K's / V's buffers
    ks.store((dk * sm_scale).to(dtype))
    vs.store(dv.to(dtype))
    fence_async_shared()
    _tma_store(dk_desc, [row0 + my_n, 0], ks)
    _tma_store(dv_desc, [row0 + my_n, 0], vs)
    tma.store_wait(pendings=0)


@gluon.jit
def _consume0(args):
    _consume(args, 0, False, False)


@gluon.jit
def _consume1(args):
    _consume(args, 1, False, False)


@gluon.jit
def _consume0_causal(args):
    _consume(args, 0, True, False)


@gluon.jit
def _consume1_causal(args):
    _consume(args, 1, True, False)


@gluon.jit
def _consume0_dq(args):
    _consume(args, 0, False, True)


@gluon.jit
def _consume1_dq(args):
    _consume(args, 1, False, True)


@gluon.jit
def _consume0_ordered(args):
    _consume(args, 0, False, 2)


@gluon.jit
def _consume1_ordered(args):
    _consume(args, 1, False, 2)


@gluon.jit
def _consume0_bulk(args):
    _consume(args, 0, False, 3)


@gluon.jit
def _consume1_bulk(args):
    _consume(args, 1, False, 3)


@gluon.jit
def _consume0_causal_bulk(args):
    _consume(args, 0, True, 3)


@gluon.jit
def _consume1_causal_bulk(args):
    _consume(args, 1, True, 3)


@gluon.jit
def _consume0_split(args):
    _consume(args, 0, False, 6)


@gluon.jit
def _consume1_split(args):
    _consume(args, 1, False, 6)


@gluon.jit
def _consume0_causal_split(args):
    _consume(args, 0, True, 6)


@gluon.jit
def _consume1_causal_split(args):
    _consume(args, 1, True, 6)


@gluon.jit
def _consume0_writer(args):
    _consume(args, 0, False, 8)


@gluon.jit
def _consume1_writer(args):
    _consume(args, 1, False, 8)


@gluon.jit
def _consume0_causal_writer(args):
    _consume(args, 0, True, 8)


@gluon.jit
def _consume1_causal_writer(args):
    _consume(args, 1, True, 8)


@gluon.jit
def _consume0_writer_ordered(args):
    _consume(args, 0, False, 9)


@gluon.jit
def _consume1_writer_ordered(args):
    _consume(args, 1, False, 9)


@gluon.jit
def _consume0_split_ordered(args):
    _consume(args, 0, False, 7)


@gluon.jit
def _consume1_split_ordered(args):
    _consume(args, 1, False, 7)


@gluon.jit
def _consume0_staged(args):
    _consume(args, 0, False, 5)


@gluon.jit
def _consume1_staged(args):
    _consume(args, 1, False, 5)


@gluon.jit
def _consume0_bulk_ordered(args):
    _consume(args, 0, False, 4)


@gluon.jit
def _consume1_bulk_ordered(args):
    _consume(args, 1, False, 4)


@gluon.jit
def _consume0_causal_dq(args):
    _consume(args, 0, True, True)


@gluon.jit
def _consume1_causal_dq(args):
    _consume(args, 1, True, True)


@gluon.jit
def _dkdv_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_ptr, delta_ptr,
                 dq_ptr, sem_ptr, qk_scale, sm_scale, N_CTX, GROUP, BLOCK_N: gl.constexpr,
                 BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                 CAUSAL: gl.constexpr, DQ: gl.constexpr):
    """One program per (128 keys, batch x kv head); under GQA its dK/dV accumulate over
    the group's query heads (one fp32 accumulator, the package's contract)."""
    dtype: gl.constexpr = q_desc.dtype
    pid_n = gl.program_id(0)
    bh = gl.program_id(1)
    row0 = bh * N_CTX  # K, V, dK, dV rows
    q_row0 = bh * GROUP * N_CTX  # the group's first query head's rows (b·Hq + h·GROUP)
    start_n = pid_n * (2 * BLOCK_N)
    if CAUSAL:
        m_lo = (start_n // BLOCK_M) * BLOCK_M  # query rows above the keys see none of them
    else:
        m_lo = 0
    n_qtiles = (N_CTX - m_lo) // BLOCK_M

    # the two warpgroups' keys, one above the other (a warpgroup takes its rows' slice)
    k_smem = gl.allocate_shared_memory(dtype, [2 * BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2 * BLOCK_N, HEAD_D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], do_desc.layout)
    kv_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                   element_bitwidth=dtype.primitive_bitwidth,
                                                   rank=2)
    dq_full = q_ready  # DQ 8, 9 only (the writer's ring)
    dq_free = q_ready
    if DQ >= 6:
        ds_smem = gl.allocate_shared_memory(dtype, [2, 2 * BLOCK_N, BLOCK_M], ds_layout)
        if DQ >= 8:
            dq_smem = gl.allocate_shared_memory(gl.float32, [4, BLOCK_M, HEAD_D // 2],
                                                dq_ptr.layout)
            dq_full = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
            dq_free = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
            for w in gl.static_range(4):
                mbarrier.init(dq_full.index(w), count=1)
                mbarrier.init(dq_free.index(w), count=1)
        else:
            dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_D // 2],
                                                dq_ptr.layout)
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(2):
            mbarrier.init(ds_ready.index(c), count=2)
    else:
        ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
        ds_ready = q_ready
        if DQ >= 3:
            dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_D],
                                                dq_ptr.layout)
        else:
            dq_smem = ds_smem
    for c in gl.static_range(2):
        mbarrier.init(kv_bars.index(c), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)

    args = (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_ptr, delta_ptr, k_smem,
            v_smem, q_smem, do_smem, kv_bars, q_ready, q_empty, row0, start_n, m_lo,
            n_qtiles, qk_scale, sm_scale, dq_ptr, ds_smem, sem_ptr, N_CTX,
            start_n if DQ == 2 or DQ == 4 or DQ == 7 or DQ == 9 else 0, dq_smem, ds_ready,
            q_row0, GROUP, dq_full, dq_free)
    # DQ 5: as 3 without the reduce-add (dQ is not computed): where 3's time goes
    if DQ == 9:
        gl.warp_specialize([(_consume0_writer_ordered, (args, )),
                            (_consume1_writer_ordered, (args, )), (_loads, (args, )),
                            (_writer_ordered, (args, ))], [4, 1, 1], [240, 24, 24])
    elif DQ == 8:
        if CAUSAL:
            gl.warp_specialize([(_consume0_causal_writer, (args, )),
                                (_consume1_causal_writer, (args, )), (_loads, (args, )),
                                (_writer_free, (args, ))], [4, 1, 1], [240, 24, 24])
        else:
            gl.warp_specialize([(_consume0_writer, (args, )), (_consume1_writer, (args, )),
                                (_loads, (args, )), (_writer_free, (args, ))],
                               [4, 1, 1], [240, 24, 24])
    elif DQ == 7:
        gl.warp_specialize([(_consume0_split_ordered, (args, )),
                            (_consume1_split_ordered, (args, )), (_loads, (args, ))],
                           [4, 1], [240, 24])
    elif DQ == 6:
        if CAUSAL:
            gl.warp_specialize([(_consume0_causal_split, (args, )),
                                (_consume1_causal_split, (args, )), (_loads, (args, ))],
                               [4, 1], [240, 24])
        else:
            gl.warp_specialize([(_consume0_split, (args, )), (_consume1_split, (args, )),
                                (_loads, (args, ))], [4, 1], [240, 24])
    elif DQ == 5:
        gl.warp_specialize([(_consume0_staged, (args, )), (_consume1_staged, (args, )),
                            (_loads, (args, ))], [4, 1], [240, 24])
    elif DQ == 4:
        gl.warp_specialize([(_consume0_bulk_ordered, (args, )),
                            (_consume1_bulk_ordered, (args, )), (_loads, (args, ))],
                           [4, 1], [240, 24])
    elif DQ == 3:
        if CAUSAL:
            gl.warp_specialize([(_consume0_causal_bulk, (args, )),
                                (_consume1_causal_bulk, (args, )), (_loads, (args, ))],
                               [4, 1], [240, 24])
        else:
            gl.warp_specialize([(_consume0_bulk, (args, )), (_consume1_bulk, (args, )),
                                (_loads, (args, ))], [4, 1], [240, 24])
    elif DQ == 2:
        gl.warp_specialize([(_consume0_ordered, (args, )), (_consume1_ordered, (args, )),
                            (_loads, (args, ))], [4, 1], [240, 24])
    elif DQ == 1:
        if CAUSAL:
            gl.warp_specialize([(_consume0_causal_dq, (args, )),
                                (_consume1_causal_dq, (args, )), (_loads, (args, ))],
                               [4, 1], [240, 24])
        else:
            gl.warp_specialize([(_consume0_dq, (args, )), (_consume1_dq, (args, )),
                                (_loads, (args, ))], [4, 1], [240, 24])
    elif CAUSAL:
        gl.warp_specialize([(_consume0_causal, (args, )), (_consume1_causal, (args, )),
                            (_loads, (args, ))], [4, 1], [240, 24])
    else:
        gl.warp_specialize([(_consume0, (args, )), (_consume1, (args, )),
                            (_loads, (args, ))], [4, 1], [240, 24])


def dkdv(q, k, v, do, lse, delta, causal: bool, dq_acc=None, ordered=False, bulk=False,
         staged_only=False, split=False, scale=None, writer=False):
    """dK, dV of softmax(Q Kᵀ / √D) V for ``do``, from the forward's base-2 ``lse`` and
    delta = rowsum(dO ∘ O) (both fp32, (B, H, N)); K and V may have fewer heads (GQA:
    query head h reads kv head h // (H / Hkv)). ``dq_acc`` (fp32, q's shape, zeroed):
    dS K is added into it as well (five products per tile pair); dQ = dq_acc · scale
    (``scale`` the forward's, 1/√D when None).
    ``ordered``: the adds in a fixed order (bitwise-repeatable; non-causal only). ``bulk``:
    one bulk tensor reduce-add per tile (``tma.async_atomic_add``, triton 3.9's Gluon)
    instead of per-element atomics."""
    B, H, N, D = q.shape
    Hkv = k.shape[1]
    if (N % (2 * BLOCK_N) or D not in (64, 128) or H % Hkv or do.shape != q.shape
            or v.shape != k.shape or k.shape != (B, Hkv, N, D)
            or not all(t.is_contiguous() for t in (q, k, v, do))):
        raise ValueError(f"gluon_bwd: contiguous q, do (B, H, N, D) and k, v (B, Hkv, N, D), "
                         f"H a multiple of Hkv, N a multiple of {2 * BLOCK_N}, D 64 or 128; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if ordered and H != Hkv:
        raise ValueError("gluon_bwd: ordered dQ adds are for MHA (Hq == Hkv)")
    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[q.dtype]
    dk, dv = torch.empty_like(k), torch.empty_like(v)

    def desc(t, rows):
        layout = gl.NVMMASharedLayout.get_default_for([rows, D], gdt)
        return TensorDescriptor.from_tensor(t.reshape(-1, D), [rows, D], layout)

    if ordered and (causal or dq_acc is None):
        raise ValueError("gluon_bwd: ordered dQ adds are non-causal and need dq_acc")
    sem = torch.zeros(B * H * (N // BLOCK_M) * 2, dtype=torch.int32, device=q.device) \
        if ordered else lse
    mode = 0 if dq_acc is None else (2 if ordered else 1) + (2 if bulk else 0)
    if staged_only:  # a diagnostic: bulk's product and staging store without the add
        if not bulk or ordered or causal:
            raise ValueError("gluon_bwd: staged_only is bulk, non-causal, as they come")
        mode = 5
    if split:  # dQ's head-dim halves, one per warpgroup, over both warpgroups' keys
        if not bulk or staged_only:
            raise ValueError("gluon_bwd: split is bulk")
        mode = (9 if ordered else 8) if writer else (7 if ordered else 6)
    elif writer:
        raise ValueError("gluon_bwd: writer is a split form")
    if bulk:
        cols = D // 2 if split else D
        dq_acc = TensorDescriptor.from_tensor(
            dq_acc.reshape(-1, D), [BLOCK_M, cols],
            gl.NVMMASharedLayout.get_default_for([BLOCK_M, cols], gl.float32))
    scale = D ** -0.5 if scale is None else scale
    _dkdv_kernel[(N // (2 * BLOCK_N), B * Hkv)](
        desc(q, BLOCK_M), desc(k, BLOCK_N), desc(v, BLOCK_N), desc(do, BLOCK_M),
        desc(dk, BLOCK_N), desc(dv, BLOCK_N), lse, delta, dq_acc if dq_acc is not None else lse,
        sem, scale * LOG2E, scale, N, H // Hkv, BLOCK_N=BLOCK_N, BLOCK_M=BLOCK_M,
        HEAD_D=D,
        STAGES=STAGES, CAUSAL=causal, DQ=mode, num_warps=4, maxnreg=168)
    return dk, dv


def _compile_only(ptx_dir: Path | None) -> int:
    spec = importlib.util.spec_from_file_location("ptxas_report", _ROOT / "scripts/ptxas_report.py")
    rep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rep)
    comp = rep._Compiler(ptx_dir)
    comp.install()
    for D in (128, 64):
        for causal in (False, True):
            kinds = ["none", "atomic"] + ([] if causal else ["ordered"])
            if BULK:
                kinds += ["bulk", "split", "writer"] + ([] if causal else [
                    "bulk_ordered", "staged", "split_ordered", "writer_ordered"])
            for with_dq in kinds:
                comp.tag = f"D={D} causal={causal} dq={with_dq}"
                t = torch.empty(16, 16, 4096, D, dtype=torch.bfloat16)
                r = torch.empty(16, 16, 4096, dtype=torch.float32)
                acc = torch.empty(16, 16, 4096, D) if with_dq != "none" else None
                try:
                    dkdv(t, t, t, t, r, r, causal, acc, with_dq.endswith("ordered"),
                         with_dq.startswith(("bulk", "split", "writer")) or with_dq == "staged",
                         with_dq == "staged", with_dq.startswith(("split", "writer")),
                         writer=with_dq.startswith("writer"))
                except Exception as e:  # noqa: BLE001 - reported per variant
                    print(comp.tag, "error:", type(e).__name__, str(e)[:800])
    for r in comp.records:
        print(json.dumps(r))
    return 0


def _on_gpu(out: Path, ordered: bool, dims: tuple[int, ...], variants: set) -> int:
    import torch.nn.functional as F
    import triton
    import triton.testing
    from flashcheck.kernels import _common
    from flashcheck.kernels import flash_attention as fa
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def bench(fn):
        return triton.testing.do_bench(fn, return_mode="median")

    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, rows=[])
    for D in dims:
        for causal in (False, ) if ordered else (False, True):
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, do = (torch.randn(16, 16, 4096, D, device="cuda", dtype=torch.bfloat16,
                                       generator=g) for _ in range(4))
            p = _common.validate(q, k, v, None, 0.0, causal, None, False, None, "top_left")
            o, lse = fa._forward(q, k, v, p, False)
            delta = (o.float() * do.float()).sum(-1)
            ref_dq, ref_dk, ref_dv = fa._backward(do, q, k, v, o, lse, p, True, False)
            row = dict(D=D, causal=causal, ref_dq_max_abs=float(ref_dq.float().abs().max()),
                       ours_bwd_ms=bench(partial(fa._backward, do, q, k, v, o, lse, p, True,
                                                 False)))
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                y = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                row["cudnn_bwd_ms"] = bench(partial(torch.autograd.grad, y, (qg, kg, vg), do,
                                                    retain_graph=True))
            if ordered:
                _ordered_row(row, bench, q, k, v, do, lse, delta, D, ref_dq, ref_dk, ref_dv)
                print(json.dumps(row), flush=True)
                res["rows"].append(row)
                out.write_text(json.dumps(res, indent=1))
                continue
            if "dkdv" in variants:
                run = partial(dkdv, q, k, v, do, lse, delta, causal)
                try:
                    dk, dv = run()
                    torch.cuda.synchronize()
                    row["gluon_dkdv"] = dict(
                        dk_max_abs_vs_ours=float((dk.float() - ref_dk.float()).abs().max()),
                        dv_max_abs_vs_ours=float((dv.float() - ref_dv.float()).abs().max()),
                        ms=bench(run))
                except Exception as e:  # noqa: BLE001 - reported per variant
                    row["gluon_dkdv"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")

            def five(q=q, k=k, v=v, do=do, lse=lse, delta=delta, causal=causal, D=D, **kw):
                acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
                dk, dv = dkdv(q, k, v, do, lse, delta, causal, acc, **kw)
                return (acc * D ** -0.5).to(q.dtype), dk, dv

            fives = {"atomic": {}}
            if BULK:
                fives.update(bulk=dict(bulk=True), split=dict(bulk=True, split=True),
                             writer=dict(bulk=True, split=True, writer=True))
            for name, kw in fives.items():
                if name in variants:
                    _five_row(row, f"gluon_five_{name}", partial(five, **kw), bench, ref_dq,
                              ref_dk, ref_dv)
            if BULK and not causal and "staged" in variants:
                acc0 = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
                row["gluon_five_staged_only_ms"] = bench(partial(
                    dkdv, q, k, v, do, lse, delta, False, acc0, bulk=True, staged_only=True))
            # our own kernels' split: the dK/dV kernel alone (the deterministic default
            # launches it, then the dQ kernel); from the whole backward's profile
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fa._backward(do, q, k, v, o, lse, p, True, False)
                torch.cuda.synchronize()
            row["ours_kernels_ms"] = {
                e.key: round(e.device_time_total / 1000 / 5, 3)
                for e in prof.key_averages() if e.device_time_total > 0}
            print(json.dumps(row), flush=True)
            res["rows"].append(row)
            out.write_text(json.dumps(res, indent=1))
    return 0


def _five_row(row, name, five, bench, ref_dq, ref_dk, ref_dv):
    """``row[name]``: a five-product variant's agreement with our backward, whether two calls
    agree bit for bit, its time."""
    try:
        first = five()
        again = five()
        torch.cuda.synchronize()
        row[name] = dict(
            repeats_equal=all(torch.equal(a, b) for a, b in zip(first, again, strict=True)),
            **{f"{n}_max_abs_vs_ours": float((a.float() - r.float()).abs().max())
               for n, a, r in zip(("dq", "dk", "dv"), first, (ref_dq, ref_dk, ref_dv),
                                  strict=True)},
            ms=bench(five))
    except Exception as e:  # noqa: BLE001 - reported per variant
        row[name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")


def _ordered_row(row, bench, q, k, v, do, lse, delta, D, ref_dq, ref_dk, ref_dv):
    """The five-product kernel with dQ's adds in a fixed order (per-element adds, and with
    triton 3.9 bulk reduce-adds)."""
    for name, bulk, split, writer in (("gluon_five_ordered", False, False, False),
                                      ("gluon_five_bulk_ordered", True, False, False),
                                      ("gluon_five_split_ordered", True, True, False),
                                      ("gluon_five_writer_ordered", True, True, True)):
        if bulk and not BULK:
            continue

        def five(bulk=bulk, split=split, writer=writer):
            acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
            dk, dv = dkdv(q, k, v, do, lse, delta, False, acc, ordered=True, bulk=bulk,
                          split=split, writer=writer)
            return (acc * D ** -0.5).to(q.dtype), dk, dv

        _five_row(row, name, five, bench, ref_dq, ref_dk, ref_dv)


def _check_small() -> int:
    """Every five-product form once at a small shape (B 1, H 2/1, N 256, D 128, bf16), against
    our backward, no timing: for compute-sanitizer (racecheck, memcheck, synccheck)."""
    from flashcheck.kernels import _common
    from flashcheck.kernels import flash_attention as fa
    forms = {"atomic": {}}
    if BULK:
        forms.update(bulk=dict(bulk=True), split=dict(bulk=True, split=True),
                     writer=dict(bulk=True, split=True, writer=True))
    bad = 0
    for hkv in (2, 1):
        for causal in (False, True):
            g = torch.Generator(device="cuda").manual_seed(0)
            q, do = (torch.randn(1, 2, 256, 128, device="cuda", dtype=torch.bfloat16,
                                 generator=g) for _ in range(2))
            k, v = (torch.randn(1, hkv, 256, 128, device="cuda", dtype=torch.bfloat16,
                                generator=g) for _ in range(2))
            p = _common.validate(q, k, v, None, 0.0, causal, None, hkv != 2, None, "top_left")
            o, lse = fa._forward(q, k, v, p, False)
            delta = (o.float() * do.float()).sum(-1)
            ref = fa._backward(do, q, k, v, o, lse, p, True, False)
            for name, kw in forms.items():
                for ordered in (False, True):
                    if ordered and (causal or hkv != 2 or name == "atomic"):
                        continue  # the ordered forms: MHA, non-causal, bulk adds
                    acc = torch.zeros(q.shape, device="cuda", dtype=torch.float32)
                    dk, dv = dkdv(q, k, v, do, lse, delta, causal, acc, ordered=ordered, **kw)
                    got = ((acc * p.scale).to(q.dtype), dk, dv)
                    # 4 bf16 ulps (2^-8 relative) of each tensor's largest magnitude: the
                    # two kernels differ in fp32 summation order and in which bf16 rounding
                    # of P and dS meets which product, not in the formula
                    ratio = max(float((a.float() - b.float()).abs().max())
                                / (4 * 2.0 ** -8 * float(b.float().abs().max()))
                                for a, b in zip(got, ref, strict=True))
                    ok = ratio <= 1
                    bad += not ok
                    print(f"{'ok ' if ok else 'BAD'} {name} ordered={ordered} causal={causal} "
                          f"hkv={hkv}: max |diff| / 4 ulps {ratio:.3g}", flush=True)
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="JSON of the GPU run")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--ptx-dir", type=Path, default=None)
    ap.add_argument("--d", default="128,64", help="head dims on the GPU, e.g. 128")
    ap.add_argument("--variants", default="dkdv,atomic,bulk,split,writer,staged",
                    help="which kernels to time beside ours and cuDNN (bulk, split, writer, "
                         "staged: triton 3.9)")
    ap.add_argument("--check-small", action="store_true",
                    help="every form once at a small shape against ours (for compute-sanitizer)")
    ap.add_argument("--ordered", action="store_true",
                    help="only the five-product kernel with ordered dQ adds (non-causal)")
    args = ap.parse_args(argv)
    if args.compile_only:
        return _compile_only(args.ptx_dir)
    if args.check_small:
        return _check_small()
    if args.out is None:
        ap.error("--out is required on a GPU")
    return _on_gpu(args.out, args.ordered, tuple(int(x) for x in args.d.split(",")),
                   set(args.variants.split(",")))


if __name__ == "__main__":
    sys.exit(main())

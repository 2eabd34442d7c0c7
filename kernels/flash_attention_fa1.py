"""FlashAttention-1 order forward in Triton; backward shared with the FA2 kernels.

FA1 (Dao et al. 2022, Algorithm 1) loops over K/V tiles in the *outer* loop and over Q
tiles in the inner loop. The running output O and the row statistics m (max) and l (sum of
exponentials) therefore live in global memory: for every (K tile, Q tile) pair the program
loads O, m, l of the Q tile, updates them and writes them back:

    m~ = rowmax(S), P~ = exp(S - m~), l~ = rowsum(P~)
    m' = max(m, m~), l' = e^(m - m') l + e^(m~ - m') l~
    O  <- diag(l')^-1 (diag(l) e^(m - m') O + e^(m~ - m') P~ V)

Here one program owns (batch x head, a group of consecutive Q tiles) and runs the K tiles
in order, so every Q row sees its K tiles in a fixed sequence: the result is deterministic.
O is kept normalised, as in the paper, in an fp32 scratch buffer (one rounding to the
output dtype at the end) and m, l are kept in base-2 units. At the end lse = m + log2(l) is
stored so that FA2's backward (``kernels.flash_attention._backward``) can be reused.

Trade-off against FA2 (``kernels.flash_attention``):
- Global traffic: each Q tile's O (N x D) is read and written once per K tile, i.e.
  O(N^2 D / Bc) extra reads and writes for tile width Bc, plus m and l (O(N^2 / Bc)); FA2
  keeps O, m, l in registers and writes O once (O(N D)).
- FA2 also defers the 1/l normalisation to the end (one division per row instead of one
  per tile) and parallelises over Q tiles, so a long sequence fills the GPU even with few
  heads; FA1 needs several Q-tile groups per head to do that (``Q_TILES_PER_PROGRAM``), at
  the price of re-reading K and V once per group.
- FA1's outer loop over K/V does allow splitting K/V tiles across programs (split-K, as in
  flash-decoding) if the partial O, m, l are merged afterwards; this implementation keeps
  the order sequential per Q tile instead, to stay deterministic.
- Numerically the two orders differ: FA1 rescales and re-normalises O every step (one more
  fp32 rounding per K tile), FA2 rescales the unnormalised accumulator.
This module favours being a faithful, correct FA1 over being fast.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from flashcheck.kernels._common import (
    INTERPRET,
    INTERPRETER_BLOCK,
    LOG2E,
    Problem,
    block_d,
    device_ctx,
    validate,
)
from flashcheck.kernels.flash_attention import (
    _band_args,
    _band_range,
    _load_2d,
    _mask_arg,
    _no_spec,
    _precision,
    _run,
    _scores,
    _strides,
    capabilities,
)

Q_TILES_PER_PROGRAM = 4  # Q tiles per program: a group shares one sequential pass over K/V


@_no_spec
def _fa1_fwd_kernel(Q, K, V, M, O, LSE, OACC, MROW, LROW, STATS,
                    stride_qz, stride_qh, stride_qm, stride_qd,
                    stride_kz, stride_kh, stride_kn, stride_kd,
                    stride_vz, stride_vh, stride_vn, stride_vd,
                    stride_mz, stride_mh, stride_mm, stride_mn,
                    stride_oz, stride_oh, stride_om, stride_od,
                    H, GROUP, N_CTX_Q, N_CTX_K, HEAD_DIM, qk_scale, lo_off, hi_off,
                    TILES_PER_PROG,
                    BAND: tl.constexpr, MASK_KIND: tl.constexpr,
                    PRECISION: tl.constexpr, COUNT_TILES: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_g = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_z = (off_bh // H).to(tl.int64)
    off_h = off_bh % H
    off_hk = (off_h // GROUP).to(tl.int64)
    off_h = off_h.to(tl.int64)
    q_base = Q + off_z * stride_qz + off_h * stride_qh
    k_base = K + off_z * stride_kz + off_hk * stride_kh
    v_base = V + off_z * stride_vz + off_hk * stride_vh
    m_base = M + off_z * stride_mz + off_h * stride_mh
    row0 = off_bh.to(tl.int64) * N_CTX_Q
    oacc_base = OACC + row0 * BLOCK_D  # scratch: (B*Hq, Nq, BLOCK_D) fp32, contiguous
    offs_d = tl.arange(0, BLOCK_D)

    g_lo = pid_g * TILES_PER_PROG * BLOCK_M
    g_hi = tl.minimum(g_lo + TILES_PER_PROG * BLOCK_M, N_CTX_Q)
    # K tiles seen by any row of the group; tiles outside are skipped.
    k_lo, _f_lo, _f_hi, k_hi = _band_range(g_lo, g_hi - 1, lo_off, hi_off, N_CTX_K, BLOCK_N,
                                           BAND)
    n_tiles = 0
    for start_n in range(k_lo, k_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kT = _load_2d(k_base + offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kn,
                      offs_d, offs_n, HEAD_DIM, N_CTX_K, True, True)
        v = _load_2d(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                     offs_n, offs_d, N_CTX_K, HEAD_DIM, True, True)
        c_hi = tl.minimum(start_n + BLOCK_N, N_CTX_K) - 1
        # Q tiles (inner loop) that see this K tile, within the group.
        q_lo, _g_lo2, _g_hi2, q_hi = _band_range(start_n, c_hi, -hi_off, -lo_off, N_CTX_Q,
                                                 BLOCK_M, BAND)
        q_lo = tl.maximum(q_lo, g_lo)
        q_hi = tl.minimum(q_hi, g_hi)
        for start_m in range(q_lo, q_hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_ok = offs_m < N_CTX_Q
            q = _load_2d(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                         offs_m, offs_d, N_CTX_Q, HEAD_DIM, True, True)
            qk = tl.dot(q, kT, input_precision=PRECISION)
            s = _scores(qk, m_base, offs_m, offs_n, stride_mm, stride_mn, N_CTX_Q, N_CTX_K,
                        qk_scale, lo_off, hi_off, True, BAND, MASK_KIND, False)
            m_t = tl.max(s, 1)
            m_t_use = tl.where(m_t == float("-inf"), 0.0, m_t)
            p = tl.exp2(s - m_t_use[:, None])
            l_t = tl.sum(p, 1)
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            # Load the running state of this Q tile from global memory.
            m_old = tl.load(MROW + row0 + offs_m, mask=row_ok, other=float("-inf"))
            l_old = tl.load(LROW + row0 + offs_m, mask=row_ok, other=0.0)
            o_ptrs = oacc_base + offs_m[:, None] * BLOCK_D + offs_d[None, :]
            o_old = tl.load(o_ptrs, mask=row_ok[:, None], other=0.0)
            m_new = tl.maximum(m_old, m_t)
            m_new_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            a_old = tl.exp2(m_old - m_new_use)
            a_t = tl.exp2(m_t - m_new_use)
            l_new = a_old * l_old + a_t * l_t
            l_div = tl.where(l_new == 0.0, 1.0, l_new)
            # Correctly rounded division (div_rn): fp32 `/` compiles to the approximate
            # div.full.f32 (2 ulp), whose error drifts one way over the many renormalisations
            # of FA1 order (64 ulps of fp32 O after ~60 key tiles on the H200).
            o_new = tl.math.div_rn((l_old * a_old)[:, None] * o_old + a_t[:, None] * pv,
                                   l_div[:, None])
            tl.store(o_ptrs, o_new, mask=row_ok[:, None])
            tl.store(MROW + row0 + offs_m, m_new, mask=row_ok)
            tl.store(LROW + row0 + offs_m, l_new, mask=row_ok)
            # Make the writes visible to every thread before the next K tile reads them.
            tl.debug_barrier()
            n_tiles += 1

    # Epilogue: cast O to the output dtype and store lse = m + log2(l) for the backward.
    for start_m in range(g_lo, g_hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < N_CTX_Q
        m_f = tl.load(MROW + row0 + offs_m, mask=row_ok, other=float("-inf"))
        l_f = tl.load(LROW + row0 + offs_m, mask=row_ok, other=0.0)
        o_f = tl.load(oacc_base + offs_m[:, None] * BLOCK_D + offs_d[None, :],
                      mask=row_ok[:, None], other=0.0)
        empty = l_f == 0.0
        lse = tl.where(empty, float("-inf"), m_f + tl.log2(tl.where(empty, 1.0, l_f)))
        tl.store(LSE + row0 + offs_m, lse, mask=row_ok)
        tl.store(O + off_z * stride_oz + off_h * stride_oh + offs_m[:, None] * stride_om
                 + offs_d[None, :] * stride_od, o_f.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    if COUNT_TILES:
        tl.store(STATS + off_bh * tl.num_programs(0) + pid_g, n_tiles)


def _fa1_blocks(D: int, dtype: torch.dtype) -> tuple[int, int]:
    if INTERPRET:
        return INTERPRETER_BLOCK, INTERPRETER_BLOCK
    return (64, 64) if (block_d(D) <= 128 and dtype != torch.float32) else (32, 32)


def _forward_fa1(q, k, v, p: Problem, allow_tf32: bool, stats: list | None = None):
    """FA1-order forward: returns (out, lse) like the FA2 launcher (lse base 2)."""
    Dp = block_d(p.D)
    BM, BN = _fa1_blocks(p.D, q.dtype)
    dev = q.device
    out = torch.empty((p.B, p.Hq, p.Nq, p.D), dtype=q.dtype, device=dev)
    lse = torch.empty((p.B, p.Hq, p.Nq), dtype=torch.float32, device=dev)
    o_acc = torch.zeros((p.B * p.Hq, p.Nq, Dp), dtype=torch.float32, device=dev)
    m_row = torch.full((p.B * p.Hq, p.Nq), float("-inf"), dtype=torch.float32, device=dev)
    l_row = torch.zeros((p.B * p.Hq, p.Nq), dtype=torch.float32, device=dev)
    n_groups = triton.cdiv(triton.cdiv(p.Nq, BM), Q_TILES_PER_PROGRAM)
    buf = torch.zeros(n_groups * p.B * p.Hq, dtype=torch.int32, device=dev) if stats is not None \
        else lse
    with device_ctx(q):
        _fa1_fwd_kernel[(n_groups, p.B * p.Hq)](
            q, k, v, _mask_arg(p, q), out, lse, o_acc, m_row, l_row, buf,
            *q.stride(), *k.stride(), *v.stride(), *_strides(p.mask), *out.stride(),
            p.Hq, p.group, p.Nq, p.Nk, p.D, p.scale * LOG2E, *_band_args(p)[1:],
            Q_TILES_PER_PROGRAM,
            BAND=_band_args(p)[0], MASK_KIND=p.mask_kind,
            PRECISION=_precision(q.dtype, allow_tf32), COUNT_TILES=stats is not None,
            BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=Dp, num_warps=4, num_stages=1)
    if stats is not None:
        stats.append(("fa1", buf))
    return out, lse


def attention_fa1_ext(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                      scale=None, enable_gqa=False, *, window=None, causal_alignment="top_left",
                      deterministic=True, allow_tf32=False):
    """:func:`attention_fa1` with the non-SDPA knobs of ``flash_attention.attention_ext``."""
    return _run(_forward_fa1, query, key, value, attn_mask, dropout_p, is_causal, scale,
                enable_gqa, window, causal_alignment, deterministic, allow_tf32)


def attention_fa1(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                  scale=None, enable_gqa=False, *, window=None, causal_alignment="top_left"):
    """FlashAttention-1 order forward (FA2 backward); same signature and domain as
    :func:`kernels.attention`. See the module docstring for the trade-off against FA2."""
    return _run(_forward_fa1, query, key, value, attn_mask, dropout_p, is_causal, scale,
                enable_gqa, window, causal_alignment, True, False)


attention_fa1.capabilities = capabilities()
attention_fa1_ext.capabilities = capabilities()
attention_fa1_tf32 = functools.partial(attention_fa1_ext, allow_tf32=True)
attention_fa1_tf32.capabilities = capabilities(tf32=True)


def fa1_tile_counts(query, key, value, attn_mask=None, is_causal=False, scale=None,
                    enable_gqa=False, *, window=None, causal_alignment="top_left"):
    """Per program, how many (K tile, Q tile) pairs the FA1 forward computed."""
    p = validate(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa, window,
                 causal_alignment)
    stats: list = []
    _forward_fa1(query, key, value, p, False, stats=stats)
    return stats[0][1]

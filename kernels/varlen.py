"""Variable-length (packed) FlashAttention-2 forward and backward in Triton.

``attention_varlen`` takes FlashAttention's ``flash_attn_varlen_func`` layout: the tokens of
B sequences packed along one axis, ``query`` (total_q, Hq, D) and ``key``/``value``
(total_k, Hkv, D), with ``cu_seqlens_q``/``cu_seqlens_k`` (B + 1,) int32 the prefix sums of
the per-sequence lengths. Sequence b is SDPA on ``q[cu_q[b]:cu_q[b+1]]`` and
``k/v[cu_k[b]:cu_k[b+1]]``; ``is_causal``, ``causal_alignment`` and ``window`` apply per
sequence with that sequence's own Lq_b, Lk_b (docs/contracts.md section 1).

The kernels are the dense ones of ``kernels.flash_attention`` with per-sequence base
pointers, lengths and band offsets: each program first reads its sequence's bounds from
the cu_seqlens (``_seq_bounds``), exits if its tile lies past the sequence's end, and then
runs the dense kernel's tile loops (``_fwd_inner``, ``_dkdv_inner``, ``_dq_inner``) and
band/tile range (``_band_range``) unchanged, so the numerics are the dense kernel's: fp32
scores ``(Q K^T) * scale``, FA2-order online softmax in base 2, P rounded to the input
dtype before P @ V, fp32 accumulation, one rounding of O, dQ, dK, dV to the input dtype.
The backward is deterministic: dK/dV per (key tile, kv head), summing the GQA group's
query heads in order in fp32; dQ per (query tile, query head). ``_attend_keys`` and
``_normalise`` (one pass over a key range; the final O and lse) are shared with
``kernels.decode``.

The grid covers ``max_seqlen_q`` (``max_seqlen_k`` for dK/dV) tiles per sequence and head;
the programs past a shorter sequence's end return at once.

Caveats:
- Launch configurations come from the dense kernels' heuristic table
  (``_common.launch_point``) in every tuning mode: there is no autotune path here (the
  tile sizes suit the longest sequence; short sequences waste the tail of a tile).
- ``max_seqlen_q``/``max_seqlen_k`` must be >= every sequence's length and
  ``cu_seqlens_*[-1]`` must equal the packed length. Both, and ``cu_seqlens`` being
  non-decreasing from 0, are checked on the CPU only: on CUDA that would cost a
  device-to-host sync per call, so a violation there is the caller's bug (rows outside
  every sequence are left unwritten).
- Sequence lengths up to 2^31 - 1 tokens (int32 cu_seqlens); element offsets are int64.
- Under the CPU interpreter bfloat16 is refused (Triton's interpreter computes bf16
  arithmetic and ``tl.dot`` wrongly). No double backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from flashcheck.kernels import _common
from flashcheck.kernels._common import (
    BF16_INTERPRETER_REASON,
    INTERPRET,
    LOG2E,
    SUPPORTED_DTYPES,
    Problem,
    block_d,
    device_ctx,
    validate,
)
from flashcheck.kernels.flash_attention import (
    _NO_SPEC,
    _a16,
    _band_range,
    _bwd_preprocess,
    _dkdv_inner,
    _dq_inner,
    _fwd_inner,
    _load_2d,
    _precision,
    _row_stats,
    _unit_last,
)

# Rows per program of the delta = rowsum(dO * O) preprocess: the dense launcher's choice.
PRE_BLOCK = 16 if INTERPRET else 64

# ----------------------------------------------------------------------------- jit helpers


def _jit(*no_spec):
    """``triton.jit`` leaving the dense kernels' :data:`_NO_SPEC` integers and ``no_spec``
    unspecialised by value, and no stride specialised on alignment (``_a16`` restores it
    when the launcher has checked it): one compiled variant per dtype/flag combination."""

    def deco(fn):
        names = fn.__code__.co_varnames[:fn.__code__.co_argcount]
        return triton.jit(
            do_not_specialize=[n for n in (*_NO_SPEC, *no_spec) if n in names],
            do_not_specialize_on_alignment=[n for n in names if n.startswith("stride_")])(fn)

    return deco


@triton.jit
def _seq_bounds(CU_Q, CU_K, b, lo_off, hi_off, HAS_LO, HAS_HI, BOTTOM_RIGHT):
    """Start (int64) and length of sequence ``b`` on the query and the key side, and its
    band offsets: ``lo_off``/``hi_off`` are top-left offsets, shifted by Lk_b - Lq_b for
    bottom-right alignment; an unbounded side becomes an offset every in-range pair meets
    (-Lq_b, Lk_b), as ``flash_attention._band_args`` does for the dense kernel."""
    q_start = tl.load(CU_Q + b)
    len_q = tl.load(CU_Q + b + 1) - q_start
    k_start = tl.load(CU_K + b)
    len_k = tl.load(CU_K + b + 1) - k_start
    off = (len_k - len_q) * BOTTOM_RIGHT
    lo = tl.where(HAS_LO != 0, off + lo_off, -len_q)
    hi = tl.where(HAS_HI != 0, off + hi_off, len_k)
    return q_start.to(tl.int64), len_q, k_start.to(tl.int64), len_k, lo, hi


@triton.jit
def _attend_keys(acc, l_i, m_i, q, k_base, v_base, offs_m, r_lo, r_hi, n_q, n_k,
                 stride_kn, stride_kd, stride_vn, stride_vd, HEAD_DIM, qk_scale, lo_off, hi_off,
                 BAND: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, PAD_D: tl.constexpr):
    """Online-softmax update of rows ``offs_m`` (``r_lo..r_hi`` the valid ones, ``n_q`` the
    row bound) with keys ``[0, n_k)`` at ``k_base``/``v_base``: the dense forward's tile
    loop, band edge tiles masked, full tiles unmasked, tiles outside the band skipped."""
    lo, full_lo, full_hi, hi = _band_range(r_lo, r_hi, lo_off, hi_off, n_k, BLOCK_N, BAND)
    cnt = 0
    if BAND:
        acc, l_i, m_i, cnt = _fwd_inner(
            acc, l_i, m_i, cnt, q, k_base, v_base, k_base, offs_m, lo, full_lo,
            stride_kn, stride_kd, stride_vn, stride_vd, 0, 0, n_q, n_k, HEAD_DIM, qk_scale,
            lo_off, hi_off, True, BAND, 0, PRECISION, BLOCK_N, BLOCK_D, PAD_D,
            k_base, k_base, 0, 0, False, False)
    acc, l_i, m_i, cnt = _fwd_inner(
        acc, l_i, m_i, cnt, q, k_base, v_base, k_base, offs_m, full_lo, full_hi,
        stride_kn, stride_kd, stride_vn, stride_vd, 0, 0, n_q, n_k, HEAD_DIM, qk_scale,
        lo_off, hi_off, False, BAND, 0, PRECISION, BLOCK_N, BLOCK_D, PAD_D,
        k_base, k_base, 0, 0, False, False)
    acc, l_i, m_i, cnt = _fwd_inner(
        acc, l_i, m_i, cnt, q, k_base, v_base, k_base, offs_m, full_hi, hi,
        stride_kn, stride_kd, stride_vn, stride_vd, 0, 0, n_q, n_k, HEAD_DIM, qk_scale,
        lo_off, hi_off, True, BAND, 0, PRECISION, BLOCK_N, BLOCK_D, PAD_D,
        k_base, k_base, 0, 0, False, False)
    return acc, l_i, m_i


@triton.jit
def _normalise(acc, l_i, m_i):
    """(O, lse in base 2) from the online-softmax state; a row that saw no key (l = 0,
    acc = 0) gives O = 0 and lse = -inf, never 0/0."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    return acc / l_safe[:, None], tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))


# ----------------------------------------------------------------------------- kernels

_PAD_D = {"PAD_D": lambda a: a["HEAD_DIM"] != a["BLOCK_D"]}
_VARLEN_NO_SPEC = ("TOTAL_Q", "HAS_LO", "HAS_HI", "BOTTOM_RIGHT")


@triton.heuristics(_PAD_D)
@_jit(*_VARLEN_NO_SPEC)
def _varlen_fwd_kernel(Q, K, V, O, LSE, CU_Q, CU_K,
                       stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
                       stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od,
                       H, GROUP, TOTAL_Q, HEAD_DIM, qk_scale, lo_off, hi_off,
                       HAS_LO, HAS_HI, BOTTOM_RIGHT,
                       BAND: tl.constexpr, PRECISION: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAD_D: tl.constexpr,
                       ALIGNED: tl.constexpr):
    stride_qt, stride_qh = _a16(stride_qt, ALIGNED), _a16(stride_qh, ALIGNED)
    stride_kt, stride_kh = _a16(stride_kt, ALIGNED), _a16(stride_kh, ALIGNED)
    stride_vt, stride_vh = _a16(stride_vt, ALIGNED), _a16(stride_vh, ALIGNED)
    stride_ot, stride_oh = _a16(stride_ot, ALIGNED), _a16(stride_oh, ALIGNED)
    pid_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    q_start, len_q, k_start, len_k, lo_off, hi_off = _seq_bounds(
        CU_Q, CU_K, off_bh // H, lo_off, hi_off, HAS_LO, HAS_HI, BOTTOM_RIGHT)
    start_m = pid_m * BLOCK_M
    if start_m >= len_q:
        return
    off_h = off_bh % H
    off_hk = (off_h // GROUP).to(tl.int64)
    off_h = off_h.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_2d(Q + q_start * stride_qt + off_h * stride_qh + offs_m[:, None] * stride_qt
                 + offs_d[None, :] * stride_qd, offs_m, offs_d, len_q, HEAD_DIM, True, PAD_D)
    acc, l_i, m_i = _attend_keys(
        tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), tl.zeros([BLOCK_M], dtype=tl.float32),
        tl.full([BLOCK_M], float("-inf"), dtype=tl.float32), q,
        K + k_start * stride_kt + off_hk * stride_kh, V + k_start * stride_vt + off_hk * stride_vh,
        offs_m, start_m, tl.minimum(start_m + BLOCK_M, len_q) - 1, len_q, len_k,
        stride_kt, stride_kd, stride_vt, stride_vd, HEAD_DIM, qk_scale, lo_off, hi_off,
        BAND, PRECISION, BLOCK_N, BLOCK_D, PAD_D)
    out, lse = _normalise(acc, l_i, m_i)
    tl.store(O + q_start * stride_ot + off_h * stride_oh + offs_m[:, None] * stride_ot
             + offs_d[None, :] * stride_od, out.to(O.dtype.element_ty),
             mask=(offs_m[:, None] < len_q) & (offs_d[None, :] < HEAD_DIM))
    tl.store(LSE + off_h * TOTAL_Q + q_start + offs_m, lse, mask=offs_m < len_q)


@triton.heuristics(_PAD_D)
@_jit(*_VARLEN_NO_SPEC)
def _varlen_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K,
                        stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
                        stride_vt, stride_vh, stride_vd, stride_dot, stride_doh, stride_dod,
                        stride_dkt, stride_dkh, stride_dkd,
                        HKV, GROUP, TOTAL_Q, HEAD_DIM, qk_scale, sm_scale, lo_off, hi_off,
                        HAS_LO, HAS_HI, BOTTOM_RIGHT,
                        BAND: tl.constexpr, PRECISION: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAD_D: tl.constexpr,
                        ALIGNED: tl.constexpr):
    stride_qt, stride_qh = _a16(stride_qt, ALIGNED), _a16(stride_qh, ALIGNED)
    stride_kt, stride_kh = _a16(stride_kt, ALIGNED), _a16(stride_kh, ALIGNED)
    stride_vt, stride_vh = _a16(stride_vt, ALIGNED), _a16(stride_vh, ALIGNED)
    stride_dot, stride_doh = _a16(stride_dot, ALIGNED), _a16(stride_doh, ALIGNED)
    stride_dkt, stride_dkh = _a16(stride_dkt, ALIGNED), _a16(stride_dkh, ALIGNED)
    pid_n = tl.program_id(0)
    off_bhk = tl.program_id(1)
    q_start, len_q, k_start, len_k, lo_off, hi_off = _seq_bounds(
        CU_Q, CU_K, off_bhk // HKV, lo_off, hi_off, HAS_LO, HAS_HI, BOTTOM_RIGHT)
    start_n = pid_n * BLOCK_N
    if start_n >= len_k:
        return
    off_hk = (off_bhk % HKV).to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_2d(K + k_start * stride_kt + off_hk * stride_kh + offs_n[:, None] * stride_kt
                 + offs_d[None, :] * stride_kd, offs_n, offs_d, len_k, HEAD_DIM, True, PAD_D)
    v = _load_2d(V + k_start * stride_vt + off_hk * stride_vh + offs_n[:, None] * stride_vt
                 + offs_d[None, :] * stride_vd, offs_n, offs_d, len_k, HEAD_DIM, True, PAD_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    cnt = 0
    # Key j is seen by query i iff j - hi_off <= i <= j - lo_off: the band, transposed. A
    # sequence without queries (len_q = 0) gives an empty range: dK = dV = 0.
    lo, full_lo, full_hi, hi = _band_range(start_n, tl.minimum(start_n + BLOCK_N, len_k) - 1,
                                           -hi_off, -lo_off, len_q, BLOCK_M, BAND)
    # The query heads of this kv head are summed in order, in fp32: deterministic.
    for g in range(0, GROUP):
        off_h = off_hk * GROUP + g
        q_base = Q + q_start * stride_qt + off_h * stride_qh
        do_base = DO + q_start * stride_dot + off_h * stride_doh
        lse_base = LSE + off_h * TOTAL_Q + q_start
        delta_base = DELTA + off_h * TOTAL_Q + q_start
        if BAND:
            dk, dv, cnt = _dkdv_inner(
                dk, dv, cnt, k, v, q_base, do_base, q_base, lse_base, delta_base, q_base,
                offs_n, lo, full_lo, stride_qt, stride_qd, stride_dot, stride_dod, 0, 0, 0, 0,
                len_q, len_k, HEAD_DIM, qk_scale, sm_scale, lo_off, hi_off, True, BAND, 0,
                PRECISION, False, BLOCK_M, BLOCK_D, PAD_D,
                q_base, q_base, q_base, q_base, 0, 0, 0, False, False, False, False)
        dk, dv, cnt = _dkdv_inner(
            dk, dv, cnt, k, v, q_base, do_base, q_base, lse_base, delta_base, q_base,
            offs_n, full_lo, full_hi, stride_qt, stride_qd, stride_dot, stride_dod, 0, 0, 0, 0,
            len_q, len_k, HEAD_DIM, qk_scale, sm_scale, lo_off, hi_off, False, BAND, 0,
            PRECISION, False, BLOCK_M, BLOCK_D, PAD_D,
            q_base, q_base, q_base, q_base, 0, 0, 0, False, False, False, False)
        dk, dv, cnt = _dkdv_inner(
            dk, dv, cnt, k, v, q_base, do_base, q_base, lse_base, delta_base, q_base,
            offs_n, full_hi, hi, stride_qt, stride_qd, stride_dot, stride_dod, 0, 0, 0, 0,
            len_q, len_k, HEAD_DIM, qk_scale, sm_scale, lo_off, hi_off, True, BAND, 0,
            PRECISION, False, BLOCK_M, BLOCK_D, PAD_D,
            q_base, q_base, q_base, q_base, 0, 0, 0, False, False, False, False)
    st_mask = (offs_n[:, None] < len_k) & (offs_d[None, :] < HEAD_DIM)
    # DK and DV are allocated by the launcher with identical (contiguous) strides.
    ptrs = (k_start + offs_n[:, None]) * stride_dkt + off_hk * stride_dkh \
        + offs_d[None, :] * stride_dkd
    tl.store(DK + ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=st_mask)
    tl.store(DV + ptrs, dv.to(DV.dtype.element_ty), mask=st_mask)


@triton.heuristics(_PAD_D)
@_jit(*_VARLEN_NO_SPEC)
def _varlen_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K,
                      stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
                      stride_vt, stride_vh, stride_vd, stride_dot, stride_doh, stride_dod,
                      stride_dqt, stride_dqh, stride_dqd,
                      H, GROUP, TOTAL_Q, HEAD_DIM, qk_scale, sm_scale, lo_off, hi_off,
                      HAS_LO, HAS_HI, BOTTOM_RIGHT,
                      BAND: tl.constexpr, PRECISION: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAD_D: tl.constexpr,
                      ALIGNED: tl.constexpr):
    stride_qt, stride_qh = _a16(stride_qt, ALIGNED), _a16(stride_qh, ALIGNED)
    stride_kt, stride_kh = _a16(stride_kt, ALIGNED), _a16(stride_kh, ALIGNED)
    stride_vt, stride_vh = _a16(stride_vt, ALIGNED), _a16(stride_vh, ALIGNED)
    stride_dot, stride_doh = _a16(stride_dot, ALIGNED), _a16(stride_doh, ALIGNED)
    stride_dqt, stride_dqh = _a16(stride_dqt, ALIGNED), _a16(stride_dqh, ALIGNED)
    pid_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    q_start, len_q, k_start, len_k, lo_off, hi_off = _seq_bounds(
        CU_Q, CU_K, off_bh // H, lo_off, hi_off, HAS_LO, HAS_HI, BOTTOM_RIGHT)
    start_m = pid_m * BLOCK_M
    if start_m >= len_q:
        return
    off_h = off_bh % H
    off_hk = (off_h // GROUP).to(tl.int64)
    off_h = off_h.to(tl.int64)
    k_base = K + k_start * stride_kt + off_hk * stride_kh
    v_base = V + k_start * stride_vt + off_hk * stride_vh
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_2d(Q + q_start * stride_qt + off_h * stride_qh + offs_m[:, None] * stride_qt
                 + offs_d[None, :] * stride_qd, offs_m, offs_d, len_q, HEAD_DIM, True, PAD_D)
    do = _load_2d(DO + q_start * stride_dot + off_h * stride_doh + offs_m[:, None] * stride_dot
                  + offs_d[None, :] * stride_dod, offs_m, offs_d, len_q, HEAD_DIM, True, PAD_D)
    lse, delta = _row_stats(LSE + off_h * TOTAL_Q + q_start, DELTA + off_h * TOTAL_Q + q_start,
                            offs_m, len_q, True)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    cnt = 0
    lo, full_lo, full_hi, hi = _band_range(start_m, tl.minimum(start_m + BLOCK_M, len_q) - 1,
                                           lo_off, hi_off, len_k, BLOCK_N, BAND)
    if BAND:
        dq, cnt = _dq_inner(
            dq, cnt, q, do, lse, delta, k_base, v_base, k_base, offs_m, lo, full_lo,
            stride_kt, stride_kd, stride_vt, stride_vd, 0, 0, len_q, len_k, HEAD_DIM, qk_scale,
            lo_off, hi_off, True, BAND, 0, PRECISION, BLOCK_N, BLOCK_D, PAD_D,
            k_base, k_base, 0, 0, False, False, False)
    dq, cnt = _dq_inner(
        dq, cnt, q, do, lse, delta, k_base, v_base, k_base, offs_m, full_lo, full_hi,
        stride_kt, stride_kd, stride_vt, stride_vd, 0, 0, len_q, len_k, HEAD_DIM, qk_scale,
        lo_off, hi_off, False, BAND, 0, PRECISION, BLOCK_N, BLOCK_D, PAD_D,
        k_base, k_base, 0, 0, False, False, False)
    dq, cnt = _dq_inner(
        dq, cnt, q, do, lse, delta, k_base, v_base, k_base, offs_m, full_hi, hi,
        stride_kt, stride_kd, stride_vt, stride_vd, 0, 0, len_q, len_k, HEAD_DIM, qk_scale,
        lo_off, hi_off, True, BAND, 0, PRECISION, BLOCK_N, BLOCK_D, PAD_D,
        k_base, k_base, 0, 0, False, False, False)
    tl.store(DQ + q_start * stride_dqt + off_h * stride_dqh + offs_m[:, None] * stride_dqt
             + offs_d[None, :] * stride_dqd, (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=(offs_m[:, None] < len_q) & (offs_d[None, :] < HEAD_DIM))


# ----------------------------------------------------------------------------- launchers


@dataclass(frozen=True)
class _Varlen:
    """A validated varlen call: the band of :class:`Problem` in top-left offsets (the
    kernels shift them per sequence) plus the packed-layout facts."""

    problem: Problem
    batch: int
    max_seqlen_q: int
    max_seqlen_k: int
    bottom_right: bool

    def band_args(self) -> tuple:
        """(lo_off, hi_off, HAS_LO, HAS_HI, BOTTOM_RIGHT) runtime arguments."""
        p = self.problem
        return (p.lo_off, p.hi_off, int(p.has_lo), int(p.has_hi), int(self.bottom_right))

    def consts(self, t: torch.Tensor, *aligned: torch.Tensor) -> dict:
        p = self.problem
        return dict(BAND=p.has_lo or p.has_hi, PRECISION=_precision(t.dtype, False),
                    BLOCK_D=block_d(p.D), ALIGNED=aligned_rows(*aligned))


def aligned_rows(*tensors: torch.Tensor) -> bool:
    """ALIGNED for a launch: every stride but the last (head-dim, 1) is a multiple of 16."""
    return all(st % 16 == 0 for t in tensors for st in t.stride()[:-1])


def _config(kind: str, c: _Varlen, t: torch.Tensor) -> dict:
    """Launch meta-parameters of kernel ``kind`` from the dense heuristic table."""
    p = c.problem
    outer, inner, warps, stages = _common.launch_point(kind, block_d(p.D), t.element_size(),
                                                       p.is_causal, t.device)
    tiles = {"BLOCK_N": outer, "BLOCK_M": inner} if kind == "dkdv" else \
        {"BLOCK_M": outer, "BLOCK_N": inner}
    return dict(tiles, num_warps=warps, num_stages=stages)


def _forward(q, k, v, cu_q, cu_k, c: _Varlen):
    """Returns (out, lse); lse (Hq, total_q) fp32 in base-2 units, -inf for empty rows."""
    p = c.problem
    total_q = q.shape[0]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((p.Hq, total_q), dtype=torch.float32, device=q.device)
    meta = _config("fwd", c, q)
    grid = (triton.cdiv(c.max_seqlen_q, meta["BLOCK_M"]), c.batch * p.Hq)
    if grid[0] > 0:
        with device_ctx(q):
            _varlen_fwd_kernel[grid](
                q, k, v, out, lse, cu_q, cu_k, *q.stride(), *k.stride(), *v.stride(),
                *out.stride(), p.Hq, p.group, total_q, p.D, p.scale * LOG2E, *c.band_args(),
                **c.consts(q, q, k, v, out), **meta)
    return out, lse


def _backward(do, q, k, v, out, lse, cu_q, cu_k, c: _Varlen):
    """Deterministic FA2 backward: delta preprocess, dK/dV per key tile, dQ per query tile."""
    p = c.problem
    total_q = q.shape[0]
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(dk)
    delta = torch.empty((p.Hq, total_q), dtype=torch.float32, device=q.device)
    sm = (p.scale * LOG2E, p.scale)
    meta_kv, meta_q = _config("dkdv", c, q), _config("dq", c, q)
    grid_kv = (triton.cdiv(c.max_seqlen_k, meta_kv["BLOCK_N"]), c.batch * p.Hkv)
    grid_q = (triton.cdiv(c.max_seqlen_q, meta_q["BLOCK_M"]), c.batch * p.Hq)
    consts = c.consts(q, q, k, v, do, out, dq, dk)
    with device_ctx(q):
        if total_q > 0:
            # The dense preprocess over one "batch" of total_q rows: delta is (Hq, total_q).
            _bwd_preprocess[(triton.cdiv(total_q, PRE_BLOCK), p.Hq)](
                out, do, delta, 0, out.stride(1), out.stride(0), out.stride(2),
                0, do.stride(1), do.stride(0), do.stride(2), p.Hq, total_q, p.D,
                BLOCK_M=PRE_BLOCK, BLOCK_D=consts["BLOCK_D"], ALIGNED=consts["ALIGNED"])
        if grid_kv[0] > 0:
            _varlen_dkdv_kernel[grid_kv](
                q, k, v, do, lse, delta, dk, dv, cu_q, cu_k, *q.stride(), *k.stride(),
                *v.stride(), *do.stride(), *dk.stride(), p.Hkv, p.group, total_q, p.D, *sm,
                *c.band_args(), **consts, **meta_kv)
        if grid_q[0] > 0:
            _varlen_dq_kernel[grid_q](
                q, k, v, do, lse, delta, dq, cu_q, cu_k, *q.stride(), *k.stride(),
                *v.stride(), *do.stride(), *dq.stride(), p.Hq, p.group, total_q, p.D, *sm,
                *c.band_args(), **consts, **meta_q)
    return dq, dk, dv


class _AttentionVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, call):
        q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
        out, lse = _forward(q, k, v, cu_q, cu_k, call)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.call = call
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = _backward(_unit_last(do), q, k, v, out, lse, cu_q, cu_k, ctx.call)
        return dq, dk, dv, None, None, None


# ----------------------------------------------------------------------------- validation


def check_tensor(name: str, t, dims: int, layout: str) -> None:
    """``t`` is a tensor of ``dims`` dims (``layout`` names them in the error)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims{' ' + layout if layout else ''}, got "
                         f"shape {tuple(t.shape)}")


def check_index(name: str, t, shape: tuple, device: torch.device) -> None:
    """``t`` is an int32 tensor of ``shape`` (None = any size) on ``device``."""
    check_tensor(name, t, len(shape), "")
    if t.dtype != torch.int32:
        raise ValueError(f"{name} dtype {t.dtype} is not supported; allowed: torch.int32")
    if any(want is not None and got != want for got, want in zip(t.shape, shape, strict=True)):
        want = tuple("*" if w is None else w for w in shape)
        raise ValueError(f"{name} shape {tuple(t.shape)} must be {want}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but query is on {device}; they must share "
                         f"one device")


def validate_heads(query, key, value, Hq: int, Hkv: int, D: int, is_causal, scale, window,
                   causal_alignment) -> Problem:
    """The dense kernel's validation (dtypes, devices, head dim, scale, is_causal, window,
    causal_alignment) on (1, H, 1, D) stand-ins of the three tensors, after the caller has
    checked the layout-specific shapes. ``lo_off``/``hi_off`` come back top-left."""
    if Hq < 1 or Hkv < 1:
        raise ValueError(f"head counts must be >= 1, got Hq={Hq}, Hkv={Hkv}")
    if Hq % Hkv != 0:
        raise ValueError(f"query heads Hq={Hq} must be a multiple of key/value heads "
                         f"Hkv={Hkv} (GQA)")

    def standin(t, H):
        return t.new_empty((1, 1, 1, 1)).expand(1, H, 1, t.shape[-1])

    return validate(standin(query, Hq), standin(key, Hkv), standin(value, Hkv), None, 0.0,
                    is_causal, scale, True, window, causal_alignment)


def _check_cu(name: str, cu: torch.Tensor, total: int, max_name: str, max_len: int) -> None:
    """CPU-only value checks of a cu_seqlens tensor (no device sync on CUDA)."""
    if cu.device.type != "cpu":
        return
    lens = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or bool((lens < 0).any()):
        raise ValueError(f"{name} must be non-decreasing from 0, got {cu.tolist()}")
    if int(cu[-1]) != total:
        raise ValueError(f"{name}[-1] = {int(cu[-1])} must equal the packed length {total}")
    if lens.numel() and int(lens.max()) > max_len:
        raise ValueError(f"{max_name} = {max_len} is below the longest sequence "
                         f"({int(lens.max())}); it must be >= every length in {name}")


def _validate(query, key, value, cu_q, cu_k, max_q, max_k, is_causal, scale, window,
              causal_alignment) -> _Varlen:
    check_tensor("query", query, 3, "(total_q, Hq, D)")
    check_tensor("key", key, 3, "(total_k, Hkv, D)")
    check_tensor("value", value, 3, "(total_k, Hkv, D)")
    if tuple(value.shape) != tuple(key.shape):
        raise ValueError(f"value shape {tuple(value.shape)} must equal key shape "
                         f"{tuple(key.shape)}")
    p = validate_heads(query, key, value, query.shape[1], key.shape[1], query.shape[2],
                       is_causal, scale, window, causal_alignment)
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        check_index(name, cu, (None,), query.device)
    if cu_q.shape[0] < 2 or cu_k.shape[0] != cu_q.shape[0]:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both have B + 1 >= 2 entries, "
                         f"got {cu_q.shape[0]} and {cu_k.shape[0]}")
    for name, m in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"{name} must be an int >= 0, got {m!r}")
    _check_cu("cu_seqlens_q", cu_q, query.shape[0], "max_seqlen_q", max_q)
    _check_cu("cu_seqlens_k", cu_k, key.shape[0], "max_seqlen_k", max_k)
    return _Varlen(problem=p, batch=cu_q.shape[0] - 1, max_seqlen_q=max_q, max_seqlen_k=max_k,
                   bottom_right=causal_alignment == "bottom_right")


# ----------------------------------------------------------------------------- public entry


def attention_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, *, is_causal=False, scale=None, window=None,
                     causal_alignment="top_left"):
    """FlashAttention-2 over packed variable-length sequences (``flash_attn_varlen_func``).

    ``query`` (total_q, Hq, D), ``key``/``value`` (total_k, Hkv, D) in fp16, bf16 or fp32,
    any strides (read in place; a tensor whose last-dim stride is not 1 is copied first),
    1 <= D <= 256, Hq a multiple of Hkv (query head h reads kv head h // (Hq // Hkv)).
    ``cu_seqlens_q``/``cu_seqlens_k``: int32 (B + 1,) on the query's device, non-decreasing
    from 0, last entry = total_q / total_k; zero-length sequences are allowed on either
    side. ``max_seqlen_q``/``max_seqlen_k``: ints >= every sequence's length. Sequence b is
    SDPA on its slices, with ``is_causal``, ``causal_alignment`` ("top_left": key j <= i;
    "bottom_right": j <= i + Lk_b - Lq_b) and ``window=(left, right)`` (-1 = unbounded)
    applied per sequence. ``scale`` defaults to 1/sqrt(D). Returns (total_q, Hq, D) in the
    input dtype, differentiable w.r.t. query, key and value (deterministic backward). A
    query row with no allowed key gives 0 and zero gradients. Outside this domain it raises
    ValueError (NotImplementedError for a valid but unsupported request).
    """
    c = _validate(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  is_causal, scale, window, causal_alignment)
    return _AttentionVarlen.apply(query, key, value, cu_seqlens_q, cu_seqlens_k, c)


attention_varlen.capabilities = {
    "api": "varlen",
    "dtypes": tuple(_common.DTYPE_NAMES[d] for d in SUPPORTED_DTYPES),
    "head_dims": (1, _common.MAX_HEAD_DIM),
    "extensions": ("window", "causal_alignment"),
    "gqa": True,
    "backward": True,
    "devices": ("cpu", "cuda") if INTERPRET else ("cuda",),
    "not_run": {"cpu": {"bfloat16": BF16_INTERPRETER_REASON}} if INTERPRET else {},
    "deterministic_backward": True,
    "family": _common.dot_family(False),
}

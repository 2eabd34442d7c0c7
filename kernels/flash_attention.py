"""FlashAttention-2 forward and backward in Triton, behind PyTorch's SDPA signature.

Layout of this module (Triton fused-attention tutorial / Liger-Kernel style):
- ``_band_range``/``_allowed``/``_load_2d``: small jit helpers;
- ``_fwd_kernel_impl``: one program per (Q tile, batch x head); online softmax in fp32 with
  ``exp2`` and log2(e) folded into the scale (``_softmax_step``); saves the row log-sum-exp
  (base 2) for the backward; a 256-row Q tile runs as two 128-row halves whose products and
  exponentials interleave (``_fwd_inner_split``);
- ``_bwd_preprocess``: delta_i = rowsum(dO_i * O_i);
- ``_bwd_dkdv_kernel_impl``: one program per (K tile, batch x kv head); loops over the query heads
  of its GQA group, then over Q tiles; optionally accumulates dQ with atomics;
- ``_bwd_dq_kernel_impl``: one program per (Q tile, batch x head);
- ``_PATHS``: per kernel, a fixed-config launch path (heuristic tuning mode) and an autotuned
  one over the same jit function (``kernels.set_tuning``/``kernels.tuning``);
- ``_hopper_flags``: the schedule flags of a launch (``_common.SCHEDULE_TABLE``): tile loads
  through tensor descriptors (``_tma_tile``), a warp-specialised loop, last tile first;
  all bit-identical to the plain path;
- ``_forward``/``_backward``: launchers (``_forward`` hands the calls
  ``flash_attention_gluon.eligible`` accepts to the Gluon forward on sm_90); ``_Attention``:
  the ``autograd.Function``;
- ``attention``: the public SDPA-compatible entry; ``attention_ext`` adds the non-SDPA
  knobs (``deterministic``, ``allow_tf32``); ``attention_atomic``/``attention_tf32`` are
  those knobs pre-set.

The causal/window band is turned into a per-program tile range ``[lo, hi)`` split into
masked edge tiles and unmasked full tiles, so tiles entirely outside the band are never
computed and full tiles carry no masking (see ``_band_range``). Masks, bias, band and
boundary checks sit behind constexpr flags, kept few so that the number of compiled
variants stays small (docs/kernel.md, "Compiled variants").

Caveats:
- The backward is deterministic (no atomics) unless ``deterministic=False`` is asked for.
- fp32 inputs use IEEE fp32 dot products unless ``allow_tf32=True``.
- Scores are scaled in fp32 after the Q K^T dot product (``qk * scale * log2e``, fused with
  the max subtraction) instead of pre-scaling Q in its own dtype: this costs one FMA per
  score but adds no extra rounding of Q.
- Under the CPU interpreter bfloat16 is refused (Triton's interpreter computes bf16
  arithmetic and ``tl.dot`` wrongly).
- No gradient with respect to ``attn_mask``; double backward is not supported.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from flashcheck.kernels import _common, flash_attention_gluon, flash_attention_gluon_bwd
from flashcheck.kernels._common import (
    BF16_INTERPRETER_REASON,
    DTYPE_NAMES,
    INTERPRET,
    LOG2E,
    Problem,
    block_d,
    device_ctx,
    make_configs,
    make_pruner,
    validate,
)
from triton.tools.tensor_descriptor import TensorDescriptor

# ----------------------------------------------------------------------------- jit helpers


@triton.jit
def _load_2d(ptrs, offs_r, offs_c, n_r, n_c, CHECK_R: tl.constexpr, CHECK_C: tl.constexpr):
    """Load a 2-D tile, bounds-checking only the dims whose flag is set (zeros outside)."""
    if CHECK_R:
        if CHECK_C:
            return tl.load(ptrs, mask=(offs_r[:, None] < n_r) & (offs_c[None, :] < n_c),
                           other=0.0)
        else:
            return tl.load(ptrs, mask=offs_r[:, None] < n_r, other=0.0)
    else:
        if CHECK_C:
            return tl.load(ptrs, mask=offs_c[None, :] < n_c, other=0.0)
        else:
            return tl.load(ptrs)


@triton.jit
def _tma_tile(desc, off_z, off_h, start, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows ``start .. start + BLOCK`` of head (off_z, off_h) through a 4-D tensor descriptor
    (block [1, 1, BLOCK, BLOCK_D]): one bulk tensor copy; rows past the sequence and columns
    past the head dim read as zeros, as ``_load_2d``'s masked loads do."""
    return desc.load([off_z.to(tl.int32), off_h.to(tl.int32), start, 0]).reshape(BLOCK, BLOCK_D)


@triton.jit
def _tile_id(REVERSE: tl.constexpr):
    """This program's tile along grid axis 0; REVERSE launches the last tile first (under a
    causal band the last query tiles see the most keys: started first, they do not trail)."""
    if REVERSE:
        return tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        return tl.program_id(0)


@triton.jit
def _a16(x, ALIGNED: tl.constexpr):
    """Stride ``x``, with its divisibility by 16 visible to the compiler when ALIGNED.

    Strides are not specialised on alignment (that would compile one variant per stride
    pattern); the launcher checks once per call that every row/head/batch stride of the
    dense operands is a multiple of 16 and sets ALIGNED, and ``(x // 16) * 16`` (== x then)
    lets Triton's alignment analysis vectorise the loads as a specialised stride would.
    """
    if ALIGNED:
        return (x // 16) * 16
    else:
        return x


@triton.jit
def _band_range(r_lo, r_hi, lo_off, hi_off, N, BLOCK: tl.constexpr, BAND: tl.constexpr):
    """Tile range of the "other" axis that rows ``r_lo..r_hi`` can see.

    With BAND, row r sees column c iff ``r + lo_off <= c <= r + hi_off`` and ``0 <= c < N``
    (an unbounded side is passed as an offset beyond the other axis, see ``_band_args``);
    without it every column is seen. Returns ``lo <= full_lo <= full_hi <= hi``: tiles in
    ``[lo, full_lo)`` and ``[full_hi, hi)`` need masking; tiles in ``[full_lo, full_hi)`` are
    entirely visible to every row and entirely inside ``[0, N)``. Tiles outside ``[lo, hi)``
    are entirely masked and are skipped.
    """
    n_full = (N // BLOCK) * BLOCK
    if BAND:
        lo = (tl.maximum(r_lo + lo_off, 0) // BLOCK) * BLOCK
        full_lo = tl.cdiv(tl.maximum(r_hi + lo_off, 0), BLOCK) * BLOCK
        hi = tl.minimum(tl.maximum(r_hi + hi_off + 1, 0), N)
        full_hi = tl.minimum((tl.maximum(r_lo + hi_off + 1, 0) // BLOCK) * BLOCK, n_full)
    else:
        lo = 0
        full_lo = 0
        hi = N
        full_hi = n_full
    hi = tl.maximum(hi, lo)
    hi_t = tl.cdiv(hi, BLOCK) * BLOCK
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi_t)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi_t)
    return lo, full_lo, full_hi, hi


@triton.jit
def _allowed(offs_m, offs_n, N_CTX_Q, N_CTX_K, lo_off, hi_off, BAND: tl.constexpr,
             TRANS: tl.constexpr):
    """Band and bounds mask of a (BLOCK_M, BLOCK_N) tile, or its transpose if TRANS."""
    if TRANS:
        ok = (offs_m[None, :] < N_CTX_Q) & (offs_n[:, None] < N_CTX_K)
        if BAND:
            d = offs_n[:, None] - offs_m[None, :]
            ok = ok & (d >= lo_off) & (d <= hi_off)
    else:
        ok = (offs_m[:, None] < N_CTX_Q) & (offs_n[None, :] < N_CTX_K)
        if BAND:
            d = offs_n[None, :] - offs_m[:, None]
            ok = ok & (d >= lo_off) & (d <= hi_off)
    return ok


@triton.jit
def _mask_tile(m_base, offs_m, offs_n, stride_mm, stride_mn, N_CTX_Q, N_CTX_K,
               TRANS: tl.constexpr):
    """The attn_mask tile (as stored: bool bytes or additive values), zeros out of bounds."""
    if TRANS:
        ptrs = m_base + offs_n[:, None] * stride_mn + offs_m[None, :] * stride_mm
        inb = (offs_n[:, None] < N_CTX_K) & (offs_m[None, :] < N_CTX_Q)
    else:
        ptrs = m_base + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn
        inb = (offs_m[:, None] < N_CTX_Q) & (offs_n[None, :] < N_CTX_K)
    return tl.load(ptrs, mask=inb, other=0)


@triton.jit
def _scores(qk, m_base, offs_m, offs_n, stride_mm, stride_mn, N_CTX_Q, N_CTX_K, qk_scale,
            lo_off, hi_off, MASKED: tl.constexpr, BAND: tl.constexpr,
            MASK_KIND: tl.constexpr, TRANS: tl.constexpr):
    """Scaled scores (base-2 units) with bias added and masked entries at -inf."""
    s = qk * qk_scale
    if MASK_KIND == 2:
        bias = _mask_tile(m_base, offs_m, offs_n, stride_mm, stride_mn, N_CTX_Q, N_CTX_K, TRANS)
        s = s + bias.to(tl.float32) * 1.4426950408889634
    if MASK_KIND == 1:
        keep = _mask_tile(m_base, offs_m, offs_n, stride_mm, stride_mn, N_CTX_Q, N_CTX_K, TRANS)
        s = tl.where(keep != 0, s, float("-inf"))
    if MASKED:
        ok = _allowed(offs_m, offs_n, N_CTX_Q, N_CTX_K, lo_off, hi_off, BAND, TRANS)
        s = tl.where(ok, s, float("-inf"))
    return s


# ----------------------------------------------------------------------------- forward


@triton.jit
def _softmax_step(qk, m_i, l_i, m_base, offs_m, offs_n, stride_mm, stride_mn, N_CTX_Q, N_CTX_K,
                  qk_scale, lo_off, hi_off, MASKED: tl.constexpr, BAND: tl.constexpr,
                  MASK_KIND: tl.constexpr):
    """One online-softmax update of rows ``offs_m`` by the key tile ``offs_n`` (scores
    ``qk``): returns P (unnormalised, fp32), the rescale factor of the old state, the new
    row sum and the new row max."""
    if MASKED or MASK_KIND != 0:
        s = _scores(qk, m_base, offs_m, offs_n, stride_mm, stride_mn, N_CTX_Q, N_CTX_K,
                    qk_scale, lo_off, hi_off, MASKED, BAND, MASK_KIND, False)
        m_ij = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible so far keeps m = -inf; subtract 0 instead so that
        # exp2(-inf - -inf) never produces NaN.
        m_use = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        s = s - m_use[:, None]
    else:
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_use = m_ij
        s = qk * qk_scale - m_use[:, None]
    p = tl.exp2(s)
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, l_i, m_ij


@triton.jit
def _kv_tiles(k_base, v_base, offs_d, offs_n, start_n, stride_kn, stride_kd, stride_vn,
              stride_vd, N_CTX_K, HEAD_DIM, MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, PAD_D: tl.constexpr, desc_k, desc_v, off_z, off_hk,
              TMA: tl.constexpr):
    """K^T and V of key tile ``start_n`` (zeros outside the sequence and the head dim)."""
    if TMA:
        kT = _tma_tile(desc_k, off_z, off_hk, start_n, BLOCK_N, BLOCK_D).T
        v = _tma_tile(desc_v, off_z, off_hk, start_n, BLOCK_N, BLOCK_D)
    else:
        kT = _load_2d(k_base + offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kn,
                      offs_d, offs_n, HEAD_DIM, N_CTX_K, PAD_D, MASKED)
        v = _load_2d(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                     offs_n, offs_d, N_CTX_K, HEAD_DIM, MASKED, PAD_D)
    return kT, v


@triton.jit
def _q_rows(q_base, offs_m, offs_d, stride_qm, stride_qd, N_CTX_Q, HEAD_DIM,
            CHECK_M: tl.constexpr, PAD_D: tl.constexpr, ROWS: tl.constexpr,
            BLOCK_D: tl.constexpr):
    """The forward's query tile of rows ``offs_m`` and its row state (m = -inf, l = 0,
    acc = 0)."""
    q = _load_2d(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                 offs_m, offs_d, N_CTX_Q, HEAD_DIM, CHECK_M, PAD_D)
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    return q, m_i, l_i, acc


@triton.jit
def _fwd_inner(acc, l_i, m_i, cnt, q, k_base, v_base, m_base, offs_m, start, end,
               stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
               N_CTX_Q, N_CTX_K, HEAD_DIM, qk_scale, lo_off, hi_off,
               MASKED: tl.constexpr, BAND: tl.constexpr,
               MASK_KIND: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr, PAD_D: tl.constexpr,
               desc_k, desc_v, off_z, off_hk, TMA: tl.constexpr, WS: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in tl.range(start, end, BLOCK_N, warp_specialize=WS):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kT, v = _kv_tiles(k_base, v_base, offs_d, offs_n, start_n, stride_kn, stride_kd,
                          stride_vn, stride_vd, N_CTX_K, HEAD_DIM, MASKED, BLOCK_N, BLOCK_D,
                          PAD_D, desc_k, desc_v, off_z, off_hk, TMA)
        qk = tl.dot(q, kT, input_precision=PRECISION)
        p, alpha, l_i, m_i = _softmax_step(qk, m_i, l_i, m_base, offs_m, offs_n, stride_mm,
                                           stride_mn, N_CTX_Q, N_CTX_K, qk_scale, lo_off,
                                           hi_off, MASKED, BAND, MASK_KIND)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        cnt += 1
    return acc, l_i, m_i, cnt


@triton.jit
def _half_step(qk, m_i, l_i, acc, v, m_base, offs_h, offs_n, stride_mm, stride_mn, N_CTX_Q,
               N_CTX_K, qk_scale, lo_off, hi_off, MASKED: tl.constexpr, BAND: tl.constexpr,
               MASK_KIND: tl.constexpr, PRECISION: tl.constexpr):
    """One half's online-softmax update by a key tile (scores ``qk``) and its P V product."""
    p, alpha, l_i, m_i = _softmax_step(qk, m_i, l_i, m_base, offs_h, offs_n, stride_mm,
                                       stride_mn, N_CTX_Q, N_CTX_K, qk_scale, lo_off, hi_off,
                                       MASKED, BAND, MASK_KIND)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, l_i, m_i


@triton.jit
def _fwd_inner_split(acc_a, l_a, m_a, acc_b, l_b, m_b, cnt, q_a, q_b, k_base, v_base, m_base,
                     offs_a, offs_b, start, end,
                     stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
                     N_CTX_Q, N_CTX_K, HEAD_DIM, qk_scale, lo_off, hi_off,
                     MASKED: tl.constexpr, BAND: tl.constexpr,
                     MASK_KIND: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, PAD_D: tl.constexpr,
                     desc_k, desc_v, off_z, off_hk, TMA: tl.constexpr, WS: tl.constexpr):
    """``_fwd_inner`` for a query tile held as two halves: both halves' Q K^T are issued
    before either softmax, so the tensor cores work on one half while the other half's
    exponentials run. Per row, the same operations in the same order as ``_fwd_inner``."""
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in tl.range(start, end, BLOCK_N, warp_specialize=WS):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kT, v = _kv_tiles(k_base, v_base, offs_d, offs_n, start_n, stride_kn, stride_kd,
                          stride_vn, stride_vd, N_CTX_K, HEAD_DIM, MASKED, BLOCK_N,
                          BLOCK_D, PAD_D, desc_k, desc_v, off_z, off_hk, TMA)
        qk_a = tl.dot(q_a, kT, input_precision=PRECISION)
        qk_b = tl.dot(q_b, kT, input_precision=PRECISION)
        acc_a, l_a, m_a = _half_step(qk_a, m_a, l_a, acc_a, v, m_base, offs_a, offs_n,
                                     stride_mm, stride_mn, N_CTX_Q, N_CTX_K, qk_scale,
                                     lo_off, hi_off, MASKED, BAND, MASK_KIND, PRECISION)
        acc_b, l_b, m_b = _half_step(qk_b, m_b, l_b, acc_b, v, m_base, offs_b, offs_n,
                                     stride_mm, stride_mn, N_CTX_Q, N_CTX_K, qk_scale,
                                     lo_off, hi_off, MASKED, BAND, MASK_KIND, PRECISION)
        cnt += 1
    return acc_a, l_a, m_a, acc_b, l_b, m_b, cnt


@triton.jit
def _fwd_store(acc, l_i, m_i, offs_m, offs_d, o_base, lse_base, stride_om, stride_od,
               N_CTX_Q, HEAD_DIM, EVEN_M: tl.constexpr, PAD_D: tl.constexpr):
    """O = acc / l and lse = m + log2(l) of rows ``offs_m``; rows that saw no key (l = 0,
    acc = 0) get O = 0 and lse = -inf, never 0/0."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))
    o_ptrs = o_base + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    if EVEN_M:
        if PAD_D:
            tl.store(o_ptrs, out.to(o_base.dtype.element_ty), mask=offs_d[None, :] < HEAD_DIM)
        else:
            tl.store(o_ptrs, out.to(o_base.dtype.element_ty))
        tl.store(lse_base + offs_m, lse)
    else:
        tl.store(o_ptrs, out.to(o_base.dtype.element_ty),
                 mask=(offs_m[:, None] < N_CTX_Q) & (offs_d[None, :] < HEAD_DIM))
        tl.store(lse_base + offs_m, lse, mask=offs_m < N_CTX_Q)


_EVEN = {
    "EVEN_M": lambda a: a["N_CTX_Q"] % a["BLOCK_M"] == 0,
    "EVEN_N": lambda a: a["N_CTX_K"] % a["BLOCK_N"] == 0,
    "PAD_D": lambda a: a["HEAD_DIM"] != a["BLOCK_D"],
}
# Runtime integers that would otherwise be specialised by value (== 1, divisible by 16) and
# compiled once per pattern for no speed gain: sizes, band offsets, GQA group, key buckets.
# Strides stay specialised (their divisibility gives vectorised, aligned loads).
_NO_SPEC = ["H", "HKV", "GROUP", "N_CTX_Q", "N_CTX_K", "HEAD_DIM", "lo_off", "hi_off",
            "NQ_BUCKET", "NK_BUCKET", "IS_CAUSAL", "N_BH"]
# Autotune key: bucketed lengths, padded head dim, dtype, causal, and the constexpr flags
# that select a different code path (tensor dtypes are added to the key by Triton).
_KEY = ["NQ_BUCKET", "NK_BUCKET", "BLOCK_D", "DTYPE_KEY", "IS_CAUSAL", "BAND", "MASK_KIND",
        "PRECISION"]


def _no_spec(fn):
    """``triton.jit`` with the :data:`_NO_SPEC` arguments of ``fn`` not specialised and no
    stride specialised on alignment (a stride of 1 is still specialised; see ``_a16``)."""
    names = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    return triton.jit(do_not_specialize=[n for n in _NO_SPEC if n in names],
                      do_not_specialize_on_alignment=[n for n in names
                                                      if n.startswith("stride_")])(fn)


def _tma_pre_hook(names: tuple[str, ...], inner: str, rows: tuple[str, ...] = ()):
    """An autotune ``pre_hook`` giving the descriptors the block shape of the config:
    operand tiles [1, 1, inner, BLOCK_D], row statistics [1, inner]."""

    def hook(nargs):
        for name in names + rows:
            d = nargs[name]
            if isinstance(d, TensorDescriptor):
                d.block_shape = ([1, nargs[inner]] if name in rows
                                 else [1, 1, nargs[inner], nargs["BLOCK_D"]])

    return hook


def _tuned(fixed, kind: str, outer: str, inner: str, descs: tuple[str, ...],
           rows: tuple[str, ...] = (), **extra):
    """The autotune launch path over the same jit function as ``fixed``."""
    key = _KEY + (["ATOMIC_DQ"] if kind == "dkdv" else [])
    return triton.autotune(configs=make_configs(kind, outer, inner,
                                                _tma_pre_hook(descs, inner, rows)), key=key,
                           prune_configs_by={"early_config_prune":
                                             make_pruner(kind, outer, inner, "Q")},
                           cache_results=_common.AUTOTUNE_CACHE, **extra)(fixed)


@triton.jit
def _fwd_program(pid_m, off_bh, N_M, Q, K, V, M, O, LSE, STATS, DESC_K, DESC_V,
                 stride_qz, stride_qh, stride_qm, stride_qd,
                 stride_kz, stride_kh, stride_kn, stride_kd,
                 stride_vz, stride_vh, stride_vn, stride_vd,
                 stride_mz, stride_mh, stride_mm, stride_mn,
                 stride_oz, stride_oh, stride_om, stride_od,
                 H, GROUP, N_CTX_Q, N_CTX_K, HEAD_DIM, qk_scale, lo_off, hi_off,
                 BAND: tl.constexpr, MASK_KIND: tl.constexpr,
                 PRECISION: tl.constexpr, COUNT_TILES: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr,
                 EVEN_N: tl.constexpr, PAD_D: tl.constexpr, TMA: tl.constexpr,
                 WS: tl.constexpr, HALVES: tl.constexpr):
    """The forward of query tile ``pid_m`` of batch x head ``off_bh`` (``N_M`` query tiles
    per head)."""
    off_z = (off_bh // H).to(tl.int64)
    off_h = off_bh % H
    off_hk = (off_h // GROUP).to(tl.int64)
    off_h = off_h.to(tl.int64)
    q_base = Q + off_z * stride_qz + off_h * stride_qh
    k_base = K + off_z * stride_kz + off_hk * stride_kh
    v_base = V + off_z * stride_vz + off_hk * stride_vh
    m_base = M + off_z * stride_mz + off_h * stride_mh

    start_m = pid_m * BLOCK_M
    offs_d = tl.arange(0, BLOCK_D)
    n_edge = 0
    n_full = 0
    r_hi = tl.minimum(start_m + BLOCK_M, N_CTX_Q) - 1
    lo, full_lo, full_hi, hi = _band_range(start_m, r_hi, lo_off, hi_off, N_CTX_K, BLOCK_N,
                                           BAND)
    o_base = O + off_z * stride_oz + off_h * stride_oh
    lse_base = LSE + off_bh.to(tl.int64) * N_CTX_Q
    if BLOCK_M >= 256 or HALVES:
        # A 256-row query tile (any tile with HALVES) is held as two halves
        # (_fwd_inner_split).
        HALF: tl.constexpr = BLOCK_M // 2
        offs_a = start_m + tl.arange(0, HALF)
        offs_b = offs_a + HALF
        q_a, m_a, l_a, acc_a = _q_rows(q_base, offs_a, offs_d, stride_qm, stride_qd, N_CTX_Q,
                                       HEAD_DIM, not EVEN_M, PAD_D, HALF, BLOCK_D)
        q_b, m_b, l_b, acc_b = _q_rows(q_base, offs_b, offs_d, stride_qm, stride_qd, N_CTX_Q,
                                       HEAD_DIM, not EVEN_M, PAD_D, HALF, BLOCK_D)
        if BAND:
            acc_a, l_a, m_a, acc_b, l_b, m_b, n_edge = _fwd_inner_split(
                acc_a, l_a, m_a, acc_b, l_b, m_b, n_edge, q_a, q_b, k_base, v_base, m_base,
                offs_a, offs_b, lo, full_lo,
                stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
                N_CTX_Q, N_CTX_K, HEAD_DIM, qk_scale, lo_off, hi_off,
                True, BAND, MASK_KIND, PRECISION, BLOCK_N, BLOCK_D, PAD_D,
                DESC_K, DESC_V, off_z, off_hk, TMA, WS)
        acc_a, l_a, m_a, acc_b, l_b, m_b, n_full = _fwd_inner_split(
            acc_a, l_a, m_a, acc_b, l_b, m_b, n_full, q_a, q_b, k_base, v_base, m_base,
            offs_a, offs_b, full_lo, full_hi,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
            N_CTX_Q, N_CTX_K, HEAD_DIM, qk_scale, lo_off, hi_off,
            False, BAND, MASK_KIND, PRECISION, BLOCK_N, BLOCK_D, PAD_D,
            DESC_K, DESC_V, off_z, off_hk, TMA, WS)
        if BAND or not EVEN_N:
            acc_a, l_a, m_a, acc_b, l_b, m_b, n_edge = _fwd_inner_split(
                acc_a, l_a, m_a, acc_b, l_b, m_b, n_edge, q_a, q_b, k_base, v_base, m_base,
                offs_a, offs_b, full_hi, hi,
                stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
                N_CTX_Q, N_CTX_K, HEAD_DIM, qk_scale, lo_off, hi_off,
                True, BAND, MASK_KIND, PRECISION, BLOCK_N, BLOCK_D, PAD_D,
                DESC_K, DESC_V, off_z, off_hk, TMA, WS)
        _fwd_store(acc_a, l_a, m_a, offs_a, offs_d, o_base, lse_base, stride_om, stride_od,
                   N_CTX_Q, HEAD_DIM, EVEN_M, PAD_D)
        _fwd_store(acc_b, l_b, m_b, offs_b, offs_d, o_base, lse_base, stride_om, stride_od,
                   N_CTX_Q, HEAD_DIM, EVEN_M, PAD_D)
    else:
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q, m_i, l_i, acc = _q_rows(q_base, offs_m, offs_d, stride_qm, stride_qd, N_CTX_Q,
                                   HEAD_DIM, not EVEN_M, PAD_D, BLOCK_M, BLOCK_D)
        if BAND:
            acc, l_i, m_i, n_edge = _fwd_inner(
                acc, l_i, m_i, n_edge, q, k_base, v_base, m_base, offs_m, lo, full_lo,
                stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
                N_CTX_Q, N_CTX_K, HEAD_DIM, qk_scale, lo_off, hi_off,
                True, BAND, MASK_KIND, PRECISION, BLOCK_N, BLOCK_D, PAD_D,
                DESC_K, DESC_V, off_z, off_hk, TMA, WS)
        acc, l_i, m_i, n_full = _fwd_inner(
            acc, l_i, m_i, n_full, q, k_base, v_base, m_base, offs_m, full_lo, full_hi,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
            N_CTX_Q, N_CTX_K, HEAD_DIM, qk_scale, lo_off, hi_off,
            False, BAND, MASK_KIND, PRECISION, BLOCK_N, BLOCK_D, PAD_D,
            DESC_K, DESC_V, off_z, off_hk, TMA, WS)
        if BAND or not EVEN_N:
            acc, l_i, m_i, n_edge = _fwd_inner(
                acc, l_i, m_i, n_edge, q, k_base, v_base, m_base, offs_m, full_hi, hi,
                stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
                N_CTX_Q, N_CTX_K, HEAD_DIM, qk_scale, lo_off, hi_off,
                True, BAND, MASK_KIND, PRECISION, BLOCK_N, BLOCK_D, PAD_D,
                DESC_K, DESC_V, off_z, off_hk, TMA, WS)
        _fwd_store(acc, l_i, m_i, offs_m, offs_d, o_base, lse_base, stride_om, stride_od,
                   N_CTX_Q, HEAD_DIM, EVEN_M, PAD_D)
    if COUNT_TILES:
        slot = (off_bh * N_M + pid_m) * 2
        tl.store(STATS + slot, n_edge)
        tl.store(STATS + slot + 1, n_full)


@_no_spec
def _fwd_kernel_impl(Q, K, V, M, O, LSE, STATS, DESC_K, DESC_V,
                stride_qz, stride_qh, stride_qm, stride_qd,
                stride_kz, stride_kh, stride_kn, stride_kd,
                stride_vz, stride_vh, stride_vn, stride_vd,
                stride_mz, stride_mh, stride_mm, stride_mn,
                stride_oz, stride_oh, stride_om, stride_od,
                H, GROUP, N_CTX_Q, N_CTX_K, HEAD_DIM, qk_scale, lo_off, hi_off, N_BH,
                NQ_BUCKET, NK_BUCKET, IS_CAUSAL, DTYPE_KEY: tl.constexpr,
                BAND: tl.constexpr, MASK_KIND: tl.constexpr,
                PRECISION: tl.constexpr, COUNT_TILES: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr,
                EVEN_N: tl.constexpr, PAD_D: tl.constexpr, ALIGNED: tl.constexpr,
                TMA: tl.constexpr, WS: tl.constexpr, REVERSE: tl.constexpr,
                PERSIST: tl.constexpr, HALVES: tl.constexpr):
    stride_qz, stride_qh, stride_qm = \
        _a16(stride_qz, ALIGNED), _a16(stride_qh, ALIGNED), _a16(stride_qm, ALIGNED)
    stride_kz, stride_kh, stride_kn = \
        _a16(stride_kz, ALIGNED), _a16(stride_kh, ALIGNED), _a16(stride_kn, ALIGNED)
    stride_vz, stride_vh, stride_vn = \
        _a16(stride_vz, ALIGNED), _a16(stride_vh, ALIGNED), _a16(stride_vn, ALIGNED)
    stride_oz, stride_oh, stride_om = \
        _a16(stride_oz, ALIGNED), _a16(stride_oh, ALIGNED), _a16(stride_om, ALIGNED)
    if PERSIST:
        # PERSIST programs per multiprocessor, each taking tiles pid, pid + programs, ... of the
        # order a grid launch dispatches them in (query tiles of a head together, the last
        # one first under REVERSE).
        n_m = tl.cdiv(N_CTX_Q, BLOCK_M)
        for t in tl.range(tl.program_id(0), n_m * N_BH, tl.num_programs(0)):
            i = t % n_m
            if REVERSE:
                i = n_m - 1 - i
            _fwd_program(i, t // n_m, n_m, Q, K, V, M, O, LSE, STATS, DESC_K, DESC_V,
                         stride_qz, stride_qh, stride_qm, stride_qd,
                         stride_kz, stride_kh, stride_kn, stride_kd,
                         stride_vz, stride_vh, stride_vn, stride_vd,
                         stride_mz, stride_mh, stride_mm, stride_mn,
                         stride_oz, stride_oh, stride_om, stride_od,
                         H, GROUP, N_CTX_Q, N_CTX_K, HEAD_DIM, qk_scale, lo_off, hi_off,
                         BAND, MASK_KIND, PRECISION, COUNT_TILES, BLOCK_D, BLOCK_M, BLOCK_N,
                         EVEN_M, EVEN_N, PAD_D, TMA, WS, HALVES)
    else:
        _fwd_program(_tile_id(REVERSE), tl.program_id(1), tl.num_programs(0),
                     Q, K, V, M, O, LSE, STATS, DESC_K, DESC_V,
                     stride_qz, stride_qh, stride_qm, stride_qd,
                     stride_kz, stride_kh, stride_kn, stride_kd,
                     stride_vz, stride_vh, stride_vn, stride_vd,
                     stride_mz, stride_mh, stride_mm, stride_mn,
                     stride_oz, stride_oh, stride_om, stride_od,
                     H, GROUP, N_CTX_Q, N_CTX_K, HEAD_DIM, qk_scale, lo_off, hi_off,
                     BAND, MASK_KIND, PRECISION, COUNT_TILES, BLOCK_D, BLOCK_M, BLOCK_N,
                     EVEN_M, EVEN_N, PAD_D, TMA, WS, HALVES)


# ----------------------------------------------------------------------------- backward


@_no_spec
def _bwd_preprocess(O, DO, DELTA, stride_oz, stride_oh, stride_om, stride_od,
                    stride_doz, stride_doh, stride_dom, stride_dod, H, N_CTX_Q, HEAD_DIM,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr):
    stride_oz, stride_oh, stride_om = \
        _a16(stride_oz, ALIGNED), _a16(stride_oh, ALIGNED), _a16(stride_om, ALIGNED)
    stride_doz, stride_doh, stride_dom = \
        _a16(stride_doz, ALIGNED), _a16(stride_doh, ALIGNED), _a16(stride_dom, ALIGNED)
    pid_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_z = (off_bh // H).to(tl.int64)
    off_h = (off_bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    inb = (offs_m[:, None] < N_CTX_Q) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(O + off_z * stride_oz + off_h * stride_oh + offs_m[:, None] * stride_om
                + offs_d[None, :] * stride_od, mask=inb, other=0.0)
    do = tl.load(DO + off_z * stride_doz + off_h * stride_doh + offs_m[:, None] * stride_dom
                 + offs_d[None, :] * stride_dod, mask=inb, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + off_bh.to(tl.int64) * N_CTX_Q + offs_m, delta, mask=offs_m < N_CTX_Q)


@triton.jit
def _row_stats(lse_base, delta_base, offs_m, N_CTX_Q, CHECK: tl.constexpr):
    """lse (base 2) and delta of rows ``offs_m``; lse = -inf (empty row) becomes +inf so
    that the recomputed P = exp2(s - lse) is 0 there, never NaN."""
    if CHECK:
        lse = tl.load(lse_base + offs_m, mask=offs_m < N_CTX_Q, other=0.0)
        delta = tl.load(delta_base + offs_m, mask=offs_m < N_CTX_Q, other=0.0)
    else:
        lse = tl.load(lse_base + offs_m)
        delta = tl.load(delta_base + offs_m)
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    return lse, delta


@triton.jit
def _row_stats_desc(desc_lse, desc_delta, off_bh, start_m, BLOCK_M: tl.constexpr):
    """``_row_stats`` of query tile ``start_m`` read through 2-D descriptors over the
    (B x H, Nq) row statistics: one bulk copy each, rows past Nq read as 0 (as the masked
    loads' ``other``)."""
    lse = tl.reshape(desc_lse.load([off_bh, start_m]), [BLOCK_M])
    delta = tl.reshape(desc_delta.load([off_bh, start_m]), [BLOCK_M])
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    return lse, delta


@triton.jit
def _dkdv_inner(dk, dv, cnt, k, v, q_base, do_base, m_base, lse_base, delta_base, dq_base,
                offs_n, start, end,
                stride_qm, stride_qd, stride_dom, stride_dod, stride_mm, stride_mn,
                stride_dqm, stride_dqd,
                N_CTX_Q, N_CTX_K, HEAD_DIM, qk_scale, sm_scale, lo_off, hi_off,
                MASKED: tl.constexpr, BAND: tl.constexpr,
                MASK_KIND: tl.constexpr, PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr,
                desc_q, desc_do, desc_lse, desc_delta, off_z, off_h, off_bh,
                TMA: tl.constexpr, WS: tl.constexpr, ROWS: tl.constexpr, EARLY: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    for start_m in tl.range(start, end, BLOCK_M, warp_specialize=WS):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        if TMA:
            qT = _tma_tile(desc_q, off_z, off_h, start_m, BLOCK_M, BLOCK_D).T
        else:
            qT = _load_2d(q_base + offs_d[:, None] * stride_qd + offs_m[None, :] * stride_qm,
                          offs_d, offs_m, HEAD_DIM, N_CTX_Q, PAD_D, MASKED)
        if ROWS:
            lse, delta = _row_stats_desc(desc_lse, desc_delta, off_bh, start_m, BLOCK_M)
        else:
            lse, delta = _row_stats(lse_base, delta_base, offs_m, N_CTX_Q, MASKED)
        qkT = tl.dot(k, qT, input_precision=PRECISION)
        if TMA:
            do = _tma_tile(desc_do, off_z, off_h, start_m, BLOCK_M, BLOCK_D)
        else:
            do = _load_2d(do_base + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                          offs_m, offs_d, N_CTX_Q, HEAD_DIM, MASKED, PAD_D)
        if EARLY:
            # dP^T issued before the exponentials: the tensor cores work on it meanwhile.
            dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        if MASKED or MASK_KIND != 0:
            sT = _scores(qkT, m_base, offs_m, offs_n, stride_mm, stride_mn, N_CTX_Q, N_CTX_K,
                         qk_scale, lo_off, hi_off, MASKED, BAND, MASK_KIND, True)
            pT = tl.exp2(sT - lse[None, :])
        else:
            pT = tl.exp2(qkT * qk_scale - lse[None, :])
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PRECISION)
        if not EARLY:
            dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=PRECISION)
        if ATOMIC_DQ != 0:
            dq = tl.dot(tl.trans(dsT).to(k.dtype), k, input_precision=PRECISION) * sm_scale
            if ATOMIC_DQ == 2:
                # One bulk tensor reduce-add of the tile (rows past Nq, columns past D clipped).
                dq_base.atomic_add([off_z.to(tl.int32), off_h.to(tl.int32), start_m, 0],
                                   tl.reshape(dq, [1, 1, BLOCK_M, BLOCK_D]))
            else:
                # Relaxed (Triton's default is acq_rel, a fence per element): nothing reads
                # the accumulator before the kernel ends.
                tl.atomic_add(dq_base + offs_m[:, None] * stride_dqm
                              + offs_d[None, :] * stride_dqd, dq,
                              mask=(offs_m[:, None] < N_CTX_Q) & (offs_d[None, :] < HEAD_DIM),
                              sem="relaxed")
        cnt += 1
    return dk, dv, cnt


@_no_spec
def _bwd_dkdv_kernel_impl(Q, K, V, M, DO, LSE, DELTA, DK, DV, DQ, STATS, DESC_Q, DESC_DO,
                     DESC_LSE, DESC_DELTA,
                     stride_qz, stride_qh, stride_qm, stride_qd,
                     stride_kz, stride_kh, stride_kn, stride_kd,
                     stride_vz, stride_vh, stride_vn, stride_vd,
                     stride_mz, stride_mh, stride_mm, stride_mn,
                     stride_doz, stride_doh, stride_dom, stride_dod,
                     stride_dkz, stride_dkh, stride_dkn, stride_dkd,
                     stride_dqz, stride_dqh, stride_dqm, stride_dqd,
                     HKV, GROUP, N_CTX_Q, N_CTX_K, HEAD_DIM, qk_scale, sm_scale, lo_off, hi_off,
                     NQ_BUCKET, NK_BUCKET, IS_CAUSAL, DTYPE_KEY: tl.constexpr,
                     BAND: tl.constexpr, MASK_KIND: tl.constexpr,
                     PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                     COUNT_TILES: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr,
                     EVEN_N: tl.constexpr, PAD_D: tl.constexpr, ALIGNED: tl.constexpr,
                     TMA: tl.constexpr, WS: tl.constexpr, REVERSE: tl.constexpr,
                     ROWS: tl.constexpr, EARLY: tl.constexpr):
    stride_qz, stride_qh, stride_qm = \
        _a16(stride_qz, ALIGNED), _a16(stride_qh, ALIGNED), _a16(stride_qm, ALIGNED)
    stride_kz, stride_kh, stride_kn = \
        _a16(stride_kz, ALIGNED), _a16(stride_kh, ALIGNED), _a16(stride_kn, ALIGNED)
    stride_vz, stride_vh, stride_vn = \
        _a16(stride_vz, ALIGNED), _a16(stride_vh, ALIGNED), _a16(stride_vn, ALIGNED)
    stride_doz, stride_doh, stride_dom = \
        _a16(stride_doz, ALIGNED), _a16(stride_doh, ALIGNED), _a16(stride_dom, ALIGNED)
    stride_dkz, stride_dkh, stride_dkn = \
        _a16(stride_dkz, ALIGNED), _a16(stride_dkh, ALIGNED), _a16(stride_dkn, ALIGNED)
    stride_dqz, stride_dqh, stride_dqm = \
        _a16(stride_dqz, ALIGNED), _a16(stride_dqh, ALIGNED), _a16(stride_dqm, ALIGNED)
    pid_n = _tile_id(REVERSE)
    off_bhk = tl.program_id(1)
    off_z = (off_bhk // HKV).to(tl.int64)
    off_hk = (off_bhk % HKV).to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_2d(K + off_z * stride_kz + off_hk * stride_kh + offs_n[:, None] * stride_kn
                 + offs_d[None, :] * stride_kd, offs_n, offs_d, N_CTX_K, HEAD_DIM,
                 not EVEN_N, PAD_D)
    v = _load_2d(V + off_z * stride_vz + off_hk * stride_vh + offs_n[:, None] * stride_vn
                 + offs_d[None, :] * stride_vd, offs_n, offs_d, N_CTX_K, HEAD_DIM,
                 not EVEN_N, PAD_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    n_edge = 0
    n_full = 0
    c_hi = tl.minimum(start_n + BLOCK_N, N_CTX_K) - 1
    # Key j is seen by query i iff j - hi_off <= i <= j - lo_off: the same band, transposed.
    lo, full_lo, full_hi, hi = _band_range(start_n, c_hi, -hi_off, -lo_off, N_CTX_Q, BLOCK_M,
                                           BAND)
    H = HKV * GROUP
    # The query heads of this kv head are visited in order: deterministic, no atomics.
    for g in range(0, GROUP):
        off_h = off_hk * GROUP + g
        off_bh = off_z * H + off_h
        row_bh = off_bh.to(tl.int32)  # the row statistics' descriptor row (B x H < 2^31)
        q_base = Q + off_z * stride_qz + off_h * stride_qh
        do_base = DO + off_z * stride_doz + off_h * stride_doh
        m_base = M + off_z * stride_mz + off_h * stride_mh
        lse_base = LSE + off_bh * N_CTX_Q
        delta_base = DELTA + off_bh * N_CTX_Q
        if ATOMIC_DQ == 2:
            dq_base = DQ  # a descriptor over the fp32 (B, H, Nq, D) accumulator
        else:
            dq_base = DQ + off_z * stride_dqz + off_h * stride_dqh
        if BAND:
            dk, dv, n_edge = _dkdv_inner(
                dk, dv, n_edge, k, v, q_base, do_base, m_base, lse_base, delta_base, dq_base,
                offs_n, lo, full_lo, stride_qm, stride_qd, stride_dom, stride_dod,
                stride_mm, stride_mn, stride_dqm, stride_dqd, N_CTX_Q, N_CTX_K, HEAD_DIM,
                qk_scale, sm_scale, lo_off, hi_off, True, BAND, MASK_KIND,
                PRECISION, ATOMIC_DQ, BLOCK_M, BLOCK_D, PAD_D,
                DESC_Q, DESC_DO, DESC_LSE, DESC_DELTA, off_z, off_h, row_bh, TMA, WS, ROWS, EARLY)
        dk, dv, n_full = _dkdv_inner(
            dk, dv, n_full, k, v, q_base, do_base, m_base, lse_base, delta_base, dq_base,
            offs_n, full_lo, full_hi, stride_qm, stride_qd, stride_dom, stride_dod,
            stride_mm, stride_mn, stride_dqm, stride_dqd, N_CTX_Q, N_CTX_K, HEAD_DIM,
            qk_scale, sm_scale, lo_off, hi_off, False, BAND, MASK_KIND,
            PRECISION, ATOMIC_DQ, BLOCK_M, BLOCK_D, PAD_D,
            DESC_Q, DESC_DO, DESC_LSE, DESC_DELTA, off_z, off_h, row_bh, TMA, WS, ROWS, EARLY)
        if BAND or not EVEN_M:
            dk, dv, n_edge = _dkdv_inner(
                dk, dv, n_edge, k, v, q_base, do_base, m_base, lse_base, delta_base, dq_base,
                offs_n, full_hi, hi, stride_qm, stride_qd, stride_dom, stride_dod,
                stride_mm, stride_mn, stride_dqm, stride_dqd, N_CTX_Q, N_CTX_K, HEAD_DIM,
                qk_scale, sm_scale, lo_off, hi_off, True, BAND, MASK_KIND,
                PRECISION, ATOMIC_DQ, BLOCK_M, BLOCK_D, PAD_D,
                DESC_Q, DESC_DO, DESC_LSE, DESC_DELTA, off_z, off_h, row_bh, TMA, WS, ROWS, EARLY)
    dk = dk * sm_scale
    st_mask = (offs_n[:, None] < N_CTX_K) & (offs_d[None, :] < HEAD_DIM)
    # DK and DV are allocated by the launcher with identical (contiguous) strides.
    dk_ptrs = off_z * stride_dkz + off_hk * stride_dkh + offs_n[:, None] * stride_dkn \
        + offs_d[None, :] * stride_dkd
    tl.store(DK + dk_ptrs, dk.to(DK.dtype.element_ty), mask=st_mask)
    tl.store(DV + dk_ptrs, dv.to(DV.dtype.element_ty), mask=st_mask)
    if COUNT_TILES:
        slot = (off_bhk * tl.num_programs(0) + pid_n) * 2
        tl.store(STATS + slot, n_edge)
        tl.store(STATS + slot + 1, n_full)


@triton.jit
def _dq_inner(dq, cnt, q, do, lse, delta, k_base, v_base, m_base, offs_m, start, end,
              stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
              N_CTX_Q, N_CTX_K, HEAD_DIM, qk_scale, lo_off, hi_off,
              MASKED: tl.constexpr, BAND: tl.constexpr,
              MASK_KIND: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, PAD_D: tl.constexpr,
              desc_k, desc_v, off_z, off_hk, TMA: tl.constexpr, WS: tl.constexpr,
              EARLY: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in tl.range(start, end, BLOCK_N, warp_specialize=WS):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if TMA:
            kT = _tma_tile(desc_k, off_z, off_hk, start_n, BLOCK_N, BLOCK_D).T
            vT = _tma_tile(desc_v, off_z, off_hk, start_n, BLOCK_N, BLOCK_D).T
        else:
            kT = _load_2d(k_base + offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kn,
                          offs_d, offs_n, HEAD_DIM, N_CTX_K, PAD_D, MASKED)
            vT = _load_2d(v_base + offs_d[:, None] * stride_vd + offs_n[None, :] * stride_vn,
                          offs_d, offs_n, HEAD_DIM, N_CTX_K, PAD_D, MASKED)
        qk = tl.dot(q, kT, input_precision=PRECISION)
        if EARLY:
            dp = tl.dot(do, vT, input_precision=PRECISION)
        if MASKED or MASK_KIND != 0:
            s = _scores(qk, m_base, offs_m, offs_n, stride_mm, stride_mn, N_CTX_Q, N_CTX_K,
                        qk_scale, lo_off, hi_off, MASKED, BAND, MASK_KIND, False)
            p = tl.exp2(s - lse[:, None])
        else:
            p = tl.exp2(qk * qk_scale - lse[:, None])
        if not EARLY:
            dp = tl.dot(do, vT, input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=PRECISION)
        cnt += 1
    return dq, cnt


@_no_spec
def _bwd_dq_kernel_impl(Q, K, V, M, DO, LSE, DELTA, DQ, STATS, DESC_K, DESC_V,
                   stride_qz, stride_qh, stride_qm, stride_qd,
                   stride_kz, stride_kh, stride_kn, stride_kd,
                   stride_vz, stride_vh, stride_vn, stride_vd,
                   stride_mz, stride_mh, stride_mm, stride_mn,
                   stride_doz, stride_doh, stride_dom, stride_dod,
                   stride_dqz, stride_dqh, stride_dqm, stride_dqd,
                   H, GROUP, N_CTX_Q, N_CTX_K, HEAD_DIM, qk_scale, sm_scale, lo_off, hi_off,
                   NQ_BUCKET, NK_BUCKET, IS_CAUSAL, DTYPE_KEY: tl.constexpr,
                   BAND: tl.constexpr, MASK_KIND: tl.constexpr,
                   PRECISION: tl.constexpr, COUNT_TILES: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr,
                   EVEN_N: tl.constexpr, PAD_D: tl.constexpr, ALIGNED: tl.constexpr,
                   TMA: tl.constexpr, WS: tl.constexpr, REVERSE: tl.constexpr,
                   EARLY: tl.constexpr):
    stride_qz, stride_qh, stride_qm = \
        _a16(stride_qz, ALIGNED), _a16(stride_qh, ALIGNED), _a16(stride_qm, ALIGNED)
    stride_kz, stride_kh, stride_kn = \
        _a16(stride_kz, ALIGNED), _a16(stride_kh, ALIGNED), _a16(stride_kn, ALIGNED)
    stride_vz, stride_vh, stride_vn = \
        _a16(stride_vz, ALIGNED), _a16(stride_vh, ALIGNED), _a16(stride_vn, ALIGNED)
    stride_doz, stride_doh, stride_dom = \
        _a16(stride_doz, ALIGNED), _a16(stride_doh, ALIGNED), _a16(stride_dom, ALIGNED)
    stride_dqz, stride_dqh, stride_dqm = \
        _a16(stride_dqz, ALIGNED), _a16(stride_dqh, ALIGNED), _a16(stride_dqm, ALIGNED)
    pid_m = _tile_id(REVERSE)
    off_bh = tl.program_id(1)
    off_z = (off_bh // H).to(tl.int64)
    off_h = off_bh % H
    off_hk = (off_h // GROUP).to(tl.int64)
    off_h = off_h.to(tl.int64)
    k_base = K + off_z * stride_kz + off_hk * stride_kh
    v_base = V + off_z * stride_vz + off_hk * stride_vh
    m_base = M + off_z * stride_mz + off_h * stride_mh
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_2d(Q + off_z * stride_qz + off_h * stride_qh + offs_m[:, None] * stride_qm
                 + offs_d[None, :] * stride_qd, offs_m, offs_d, N_CTX_Q, HEAD_DIM,
                 not EVEN_M, PAD_D)
    do = _load_2d(DO + off_z * stride_doz + off_h * stride_doh + offs_m[:, None] * stride_dom
                  + offs_d[None, :] * stride_dod, offs_m, offs_d, N_CTX_Q, HEAD_DIM,
                  not EVEN_M, PAD_D)
    lse, delta = _row_stats(LSE + off_bh.to(tl.int64) * N_CTX_Q,
                            DELTA + off_bh.to(tl.int64) * N_CTX_Q, offs_m, N_CTX_Q, not EVEN_M)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    n_edge = 0
    n_full = 0
    r_hi = tl.minimum(start_m + BLOCK_M, N_CTX_Q) - 1
    lo, full_lo, full_hi, hi = _band_range(start_m, r_hi, lo_off, hi_off, N_CTX_K, BLOCK_N,
                                           BAND)
    if BAND:
        dq, n_edge = _dq_inner(
            dq, n_edge, q, do, lse, delta, k_base, v_base, m_base, offs_m, lo, full_lo,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
            N_CTX_Q, N_CTX_K, HEAD_DIM, qk_scale, lo_off, hi_off,
            True, BAND, MASK_KIND, PRECISION, BLOCK_N, BLOCK_D, PAD_D,
            DESC_K, DESC_V, off_z, off_hk, TMA, WS, EARLY)
    dq, n_full = _dq_inner(
        dq, n_full, q, do, lse, delta, k_base, v_base, m_base, offs_m, full_lo, full_hi,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
        N_CTX_Q, N_CTX_K, HEAD_DIM, qk_scale, lo_off, hi_off,
        False, BAND, MASK_KIND, PRECISION, BLOCK_N, BLOCK_D, PAD_D,
        DESC_K, DESC_V, off_z, off_hk, TMA, WS, EARLY)
    if BAND or not EVEN_N:
        dq, n_edge = _dq_inner(
            dq, n_edge, q, do, lse, delta, k_base, v_base, m_base, offs_m, full_hi, hi,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
            N_CTX_Q, N_CTX_K, HEAD_DIM, qk_scale, lo_off, hi_off,
            True, BAND, MASK_KIND, PRECISION, BLOCK_N, BLOCK_D, PAD_D,
            DESC_K, DESC_V, off_z, off_hk, TMA, WS, EARLY)
    dq = dq * sm_scale
    tl.store(DQ + off_z * stride_dqz + off_h * stride_dqh + offs_m[:, None] * stride_dqm
             + offs_d[None, :] * stride_dqd, dq.to(DQ.dtype.element_ty),
             mask=(offs_m[:, None] < N_CTX_Q) & (offs_d[None, :] < HEAD_DIM))
    if COUNT_TILES:
        slot = (off_bh * tl.num_programs(0) + pid_m) * 2
        tl.store(STATS + slot, n_edge)
        tl.store(STATS + slot + 1, n_full)


# ----------------------------------------------------------------------------- launch paths

# Two launch paths over each jit function: fixed (heuristic mode: one config from the
# table, passed explicitly) and tuned (autotune mode). Both apply the EVEN_*/PAD_D
# heuristics, and share the jit function's compile cache.
_fwd_fixed = triton.heuristics(_EVEN)(_fwd_kernel_impl)
_fwd_tuned = _tuned(_fwd_fixed, "fwd", "BLOCK_M", "BLOCK_N", ("DESC_K", "DESC_V"))
_dkdv_fixed = triton.heuristics(_EVEN)(_bwd_dkdv_kernel_impl)
_dkdv_tuned = _tuned(_dkdv_fixed, "dkdv", "BLOCK_N", "BLOCK_M", ("DESC_Q", "DESC_DO", "DQ"),
                     ("DESC_LSE", "DESC_DELTA"), reset_to_zero=["DQ"])
_dq_fixed = triton.heuristics(_EVEN)(_bwd_dq_kernel_impl)
_dq_tuned = _tuned(_dq_fixed, "dq", "BLOCK_M", "BLOCK_N", ("DESC_K", "DESC_V"))
_PATHS = {"fwd": (_fwd_fixed, _fwd_tuned, "BLOCK_M", "BLOCK_N"),
          "dkdv": (_dkdv_fixed, _dkdv_tuned, "BLOCK_N", "BLOCK_M"),
          "dq": (_dq_fixed, _dq_tuned, "BLOCK_M", "BLOCK_N")}


# ----------------------------------------------------------------------------- launchers


def _strides(t: torch.Tensor | None) -> tuple[int, int, int, int]:
    return tuple(t.stride()) if t is not None else (0, 0, 0, 0)


def _mask_arg(p: Problem, fallback: torch.Tensor) -> torch.Tensor:
    if p.mask is None:
        return fallback
    # A bool tensor is passed as its bytes (same storage, same strides, no copy).
    return p.mask.view(torch.uint8) if p.mask_kind == 1 else p.mask


def _precision(dtype: torch.dtype, allow_tf32: bool) -> str:
    return "tf32" if (dtype == torch.float32 and allow_tf32) else "ieee"


def _aligned(*tensors: torch.Tensor) -> bool:
    """ALIGNED for a launch: every batch, head and row stride is a multiple of 16."""
    return all(st % 16 == 0 for t in tensors for st in t.stride()[:3])


def _band_args(p: Problem) -> tuple[bool, int, int]:
    """(BAND, lo_off, hi_off) for the kernels: one band flag, an unbounded side given as an
    offset that every in-range pair satisfies (j - i >= -Nq, j - i <= Nk), so that causal,
    one-sided and two-sided windows share one compiled variant."""
    band = p.has_lo or p.has_hi
    return band, (p.lo_off if p.has_lo else -p.Nq), (p.hi_off if p.has_hi else p.Nk)


def _common_consts(p: Problem, dtype: torch.dtype, allow_tf32: bool) -> dict:
    return dict(NQ_BUCKET=_common.bucket(p.Nq), NK_BUCKET=_common.bucket(p.Nk),
                IS_CAUSAL=int(p.is_causal), DTYPE_KEY=DTYPE_NAMES[dtype],
                BAND=_band_args(p)[0], MASK_KIND=p.mask_kind,
                PRECISION=_precision(dtype, allow_tf32), BLOCK_D=block_d(p.D))


class _AccumDescriptor(TensorDescriptor):
    """A descriptor over an accumulator the kernel adds into; ``zero_`` zeroes the tensor
    (the autotuner's ``reset_to_zero`` between its trials)."""

    def zero_(self):
        self.base.zero_()
        return self


def _descriptor(t: torch.Tensor, rows: int, block_d_: int, cls=TensorDescriptor):
    """A 4-D tensor descriptor over ``t`` (B, H, N, D) with block [1, 1, rows, block_d_]."""
    shape = list(t.shape)
    # The stride of a size-1 dim is never stepped over; give it one the copy engine takes.
    strides = [t.stride(i) if shape[i] > 1 else _unit_dim_stride(t, i) for i in range(4)]
    return cls(t, shape, strides, [1, 1, rows, block_d_])


def _row_descriptor(t: torch.Tensor, rows: int):
    """A 2-D tensor descriptor over the contiguous (B, H, N) row statistics ``t``, viewed as
    (B x H, N), with block [1, rows]."""
    n = t.shape[-1]
    return TensorDescriptor(t.view(-1, n), [t.numel() // n, n], [n, 1], [1, rows])


def _rows_layout_ok(t: torch.Tensor) -> bool:
    """Whether the row statistics ``t`` (contiguous fp32, (B, H, N)) can be read through
    :func:`_row_descriptor`: 16-byte aligned base and row stride (N a multiple of 4)."""
    return (t.is_contiguous() and t.data_ptr() % 16 == 0
            and (t.shape[-1] * t.element_size()) % 16 == 0)


def _unit_dim_stride(t: torch.Tensor, i: int) -> int:
    """A stride for size-1 dim ``i`` of ``t``: the span of the dim after it (1 for the last)."""
    return 1 if i == 3 else t.shape[i + 1] * max(t.stride(i + 1), 1)


def _tma_layout_ok(*tensors: torch.Tensor) -> bool:
    """Whether every operand can be read through a tensor descriptor: 16-byte aligned base,
    unit last stride, every other stride (of a dim longer than 1) a positive multiple of 16
    bytes (the bulk tensor copy's rules)."""
    for t in tensors:
        e = t.element_size()
        if t.data_ptr() % 16 or t.stride(-1) != 1:
            return False
        for i in range(3):
            n, st = t.shape[i], t.stride(i)
            if n > 1 and (st <= 0 or (st * e) % 16):
                return False
            if n == 1 and (_unit_dim_stride(t, i) * e) % 16:
                return False
    return True


def _hopper_flags(kind: str, p: Problem, q: torch.Tensor, streamed: tuple,
                  rows: tuple = ()) -> dict:
    """The schedule flags of a launch (``_common.SCHEDULE_TABLE``): TMA, tensor descriptors
    for the streamed operands where the device, table and layout allow; WS, warp
    specialisation of the tile loop (with TMA); REVERSE, last tile first where a causal-like
    band makes the last tiles of this kind the longest; for the forward, PERSIST, that many
    programs per multiprocessor looping over the tiles (CUDA only; 0: one program per tile),
    and HALVES, a query tile of under 256 rows held as two halves too; for the backward
    kernels, EARLY, the dP product issued before the exponentials; for the dK/dV kernel,
    ROWS, its row statistics ``rows`` (lse, delta) through descriptors too (with TMA). The
    table's rows are chosen by kind, element size, head dim and whether the launch has a
    causal-like band."""
    bd, elem, band = block_d(p.D), q.element_size(), _band_args(p)[0]
    sched = _common.schedule(kind, elem, bd, band)
    tma = _common.use_tma(kind, q.device, elem, bd, band) and _tma_layout_ok(*streamed)
    flags = dict(TMA=tma, WS=bool(tma and sched["ws"]),
                 REVERSE=bool(sched["reverse"] and p.has_hi and not p.has_lo))
    if kind == "fwd":
        flags["PERSIST"] = sched["persist"] if q.is_cuda and not INTERPRET else 0
        flags["HALVES"] = bool(sched["halves"])
    else:
        # Under a band only with descriptors: the banded kernel on the pointer path spills
        # (its masked tile loop compiled beside the full one), and EARLY makes it worse.
        flags["EARLY"] = bool(sched["early"] and (tma or not band))
    if kind == "dkdv":
        flags["ROWS"] = bool(tma and _common.use_row_tma(kind, elem, bd, band)
                             and all(_rows_layout_ok(t) for t in rows))
    return flags


def _launch(kind: str, grid, head: tuple, streamed: tuple, tail: tuple, kwargs: dict,
            p: Problem, q: torch.Tensor, rows: tuple = (), reduced: int | None = None) -> None:
    """Launch kernel ``kind`` ("fwd", "dkdv", "dq") in the current tuning mode.

    The kernel's arguments are ``head``, then ``streamed`` (the two operands its tile loop
    reads, passed again as tensor descriptors when TMA is on, else as themselves), then
    ``rows`` (the dK/dV kernel's lse and delta, again as 2-D descriptors when ROWS is on,
    else as themselves), then ``tail``. ``head[reduced]``, if given, is an fp32 accumulator
    the kernel adds its tiles into by bulk reduce-adds: passed as a descriptor with the
    config's block rows. ``grid(meta)`` maps the tile sizes and the flags to the launch
    grid. Heuristic mode (and the interpreter) passes one config explicitly; autotune mode
    lets Triton's autotuner pick.
    """
    fixed, tuned, outer, inner = _PATHS[kind]
    flags = _hopper_flags(kind, p, q, streamed, rows)
    bd = block_d(p.D)

    def args(block_rows: int) -> tuple:
        descs = tuple(_descriptor(t, block_rows, bd) for t in streamed) if flags["TMA"] \
            else streamed
        row_args = tuple(_row_descriptor(t, block_rows) for t in rows) \
            if flags.get("ROWS") else rows
        if reduced is not None:
            acc = _descriptor(head[reduced], block_rows, bd, _AccumDescriptor)
            return (*head[:reduced], acc, *head[reduced + 1:], *descs, *row_args, *tail)
        return (*head, *descs, *row_args, *tail)

    if INTERPRET or not q.is_cuda or _common.get_tuning() == "heuristic":
        o, i, warps, stages = _common.launch_point(kind, bd, q.element_size(),
                                                   p.is_causal, q.device)
        meta = {outer: o, inner: i}
        fixed[grid({**meta, **flags})](*args(i), **kwargs, **flags, **meta, num_warps=warps,
                          num_stages=stages)
    else:
        # Placeholder block rows: the config's pre_hook sets them (_tma_pre_hook).
        tuned[grid](*args(16), **kwargs, **flags)


def _stats_buffer(count: bool, n_programs: int, device) -> torch.Tensor | None:
    return torch.zeros(2 * n_programs, dtype=torch.int32, device=device) if count else None


def _forward(q, k, v, p: Problem, allow_tf32: bool, stats: list | None = None):
    """FA2-order forward: returns (out, lse) with lse in base-2 units, shape (B, Hq, Nq).
    On an H200-class GPU the calls flash_attention_gluon.eligible accepts run its Gluon
    kernel (the same arithmetic; ``stats``, a test mode counting Triton tiles, keeps them
    here)."""
    if stats is None and flash_attention_gluon.eligible(p, q, k, v):
        return flash_attention_gluon.forward(q, k, v, p)
    out = torch.empty((p.B, p.Hq, p.Nq, p.D), dtype=q.dtype, device=q.device)
    lse = torch.empty((p.B, p.Hq, p.Nq), dtype=torch.float32, device=q.device)
    mask = _mask_arg(p, q)
    count = stats is not None
    buf = None

    def grid(meta):
        tiles = triton.cdiv(p.Nq, meta["BLOCK_M"])
        if meta.get("PERSIST"):
            return (min(tiles * p.B * p.Hq, meta["PERSIST"] * _common.sm_count(q.device)), 1)
        return (tiles, p.B * p.Hq)

    if count:
        # Enough slots for the smallest tile of any config (16 rows).
        buf = _stats_buffer(True, triton.cdiv(p.Nq, 16) * p.B * p.Hq, q.device)
    with device_ctx(q):
        _launch("fwd", grid, (q, k, v, mask, out, lse, buf if count else lse), (k, v), (
            *q.stride(), *k.stride(), *v.stride(), *_strides(p.mask), *out.stride(),
            p.Hq, p.group, p.Nq, p.Nk, p.D, p.scale * LOG2E, *_band_args(p)[1:],
            p.B * p.Hq),
            dict(COUNT_TILES=count, ALIGNED=_aligned(q, k, v, out),
                 **_common_consts(p, q.dtype, allow_tf32)), p, q)
    if count:
        stats.append(("fwd", buf))
    return out, lse


def _backward(do, q, k, v, out, lse, p: Problem, deterministic: bool, allow_tf32: bool,
              stats: list | None = None):
    """FA2 backward: delta preprocess, dK/dV per K tile, dQ per Q tile (or atomic dQ); the
    calls ``flash_attention_gluon_bwd.eligible`` accepts (sm_90, triton 3.9) take the
    preprocess, then its five-product kernel."""
    dev = q.device
    Dp = block_d(p.D)
    delta = torch.empty((p.B, p.Hq, p.Nq), dtype=torch.float32, device=dev)
    pre_block = 16 if INTERPRET else 64

    def preprocess(aligned: bool) -> None:  # delta_i = rowsum(dO_i * O_i)
        _bwd_preprocess[(triton.cdiv(p.Nq, pre_block), p.B * p.Hq)](
            out, do, delta, *out.stride(), *do.stride(), p.Hq, p.Nq, p.D,
            BLOCK_M=pre_block, BLOCK_D=Dp, ALIGNED=aligned)

    if stats is None and flash_attention_gluon_bwd.eligible(p, q, k, v, do, deterministic):
        with device_ctx(q):
            preprocess(_aligned(out, do))
        return flash_attention_gluon_bwd.backward(do, q, k, v, lse, delta, p, deterministic)
    dk = torch.empty((p.B, p.Hkv, p.Nk, p.D), dtype=q.dtype, device=dev)
    dv = torch.empty_like(dk)
    if deterministic:
        dq = torch.empty((p.B, p.Hq, p.Nq, p.D), dtype=q.dtype, device=dev)
        dq_acc = dq
    else:
        dq_acc = torch.zeros((p.B, p.Hq, p.Nq, p.D), dtype=torch.float32, device=dev)
    mask = _mask_arg(p, q)
    count = stats is not None
    consts = _common_consts(p, q.dtype, allow_tf32)
    consts["ALIGNED"] = _aligned(q, k, v, do, out, dk, dq_acc)
    # dQ without determinism: fp32 atomics per element (1), or one bulk reduce-add per tile
    # through a descriptor (2) where the TMA mode, the device and the accumulator's layout
    # allow (_common.use_reduce).
    atomic = 0 if deterministic else (
        2 if _common.use_reduce(dev) and _tma_layout_ok(dq_acc) else 1)
    with device_ctx(q):
        preprocess(consts["ALIGNED"])
        buf_kv = _stats_buffer(count, triton.cdiv(p.Nk, 16) * p.B * p.Hkv, dev)
        _launch("dkdv", lambda m: (triton.cdiv(p.Nk, m["BLOCK_N"]), p.B * p.Hkv),
                (q, k, v, mask, do, lse, delta, dk, dv, dq_acc, buf_kv if count else lse),
                (q, do), (
            *q.stride(), *k.stride(), *v.stride(), *_strides(p.mask), *do.stride(),
            *dk.stride(), *dq_acc.stride(),
            p.Hkv, p.group, p.Nq, p.Nk, p.D, p.scale * LOG2E, p.scale, *_band_args(p)[1:]),
            dict(ATOMIC_DQ=atomic, COUNT_TILES=count, **consts), p, q,
            rows=(lse, delta), reduced=9 if atomic == 2 else None)
        if deterministic:
            buf_q = _stats_buffer(count, triton.cdiv(p.Nq, 16) * p.B * p.Hq, dev)
            _launch("dq", lambda m: (triton.cdiv(p.Nq, m["BLOCK_M"]), p.B * p.Hq),
                    (q, k, v, mask, do, lse, delta, dq, buf_q if count else lse), (k, v), (
                *q.stride(), *k.stride(), *v.stride(), *_strides(p.mask), *do.stride(),
                *dq.stride(),
                p.Hq, p.group, p.Nq, p.Nk, p.D, p.scale * LOG2E, p.scale, *_band_args(p)[1:]),
                dict(COUNT_TILES=count, **consts), p, q)
        else:
            dq = dq_acc.to(q.dtype)
    if count:
        stats.append(("dkdv", buf_kv))
        if deterministic:
            stats.append(("dq", buf_q))
    return dq, dk, dv


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dim is contiguous, else a contiguous copy: a head-dim
    stride != 1 gets no vectorised loads anyway, and would double the compiled variants."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


class _Attention(torch.autograd.Function):
    """Ties a forward launcher (FA2 or FA1 order) to the FA2 backward."""

    @staticmethod
    def forward(ctx, q, k, v, problem, fwd, deterministic, allow_tf32):
        q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
        out, lse = fwd(q, k, v, problem, allow_tf32)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.problem = problem
        ctx.deterministic = deterministic
        ctx.allow_tf32 = allow_tf32
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(_unit_last(do), q, k, v, out, lse, ctx.problem,
                               ctx.deterministic, ctx.allow_tf32)
        return dq, dk, dv, None, None, None, None


_attention_fn = _Attention.apply


def _run(fwd, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window,
         causal_alignment, deterministic, allow_tf32):
    if deterministic not in (True, False):
        raise ValueError(f"deterministic must be a bool, got {deterministic!r}")
    if allow_tf32 not in (True, False):
        raise ValueError(f"allow_tf32 must be a bool, got {allow_tf32!r}")
    p = validate(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window,
                 causal_alignment)
    return _attention_fn(query, key, value, p, fwd, bool(deterministic), bool(allow_tf32))


def capabilities(*, deterministic: bool = True, tf32: bool = False) -> dict:
    """The contracts.md section 2 mapping for the entries of this package."""
    return {
        "dtypes": ("float16", "bfloat16", "float32"),
        "head_dims": (1, _common.MAX_HEAD_DIM),
        "masks": ("bool", "additive"),
        "mask_broadcast": True,
        "extensions": ("window", "causal_alignment"),
        "gqa": True,
        "backward": True,
        "devices": ("cpu", "cuda") if INTERPRET else ("cuda",),
        "not_run": {"cpu": {"bfloat16": BF16_INTERPRETER_REASON}} if INTERPRET else {},
        "deterministic_backward": deterministic,
        "tf32": tf32,
        "family": _common.dot_family(tf32) + _common.contraction_family(),
    }


def attention_ext(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                  scale=None, enable_gqa=False, *, window=None, causal_alignment="top_left",
                  deterministic=True, allow_tf32=False):
    """:func:`attention` plus two knobs that are not part of the SDPA signature.

    - ``deterministic=False``: dQ is accumulated with fp32 atomics inside the dK/dV kernel
      (one kernel fewer, but on the H200 slower than the default at every benchmarked shape:
      docs/kernel.md; the summation order, hence the bits of dQ, may change from run to
      run).
    - ``allow_tf32=True``: fp32 inputs use TF32 dot products (roundoff 2^-11 instead of
      2^-24); ignored for fp16/bf16.
    """
    return _run(_forward, query, key, value, attn_mask, dropout_p, is_causal, scale,
                enable_gqa, window, causal_alignment, deterministic, allow_tf32)


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False, *, window=None, causal_alignment="top_left"):
    """FlashAttention-2 in Triton with PyTorch's SDPA signature (see docs/contracts.md).

    ``query`` (B, Hq, Nq, D), ``key``/``value`` (B, Hkv, Nk, D) in fp16, bf16 or fp32, any
    strides (read in place; only a tensor whose last-dim stride is not 1 is copied first),
    1 <= D <= 256. ``attn_mask`` bool or additive, broadcastable
    to (B, Hq, Nq, Nk) (broadcast dims are read with stride 0). ``window=(left, right)``
    (-1 = unbounded) and ``causal_alignment`` ("top_left" | "bottom_right") extend SDPA.
    Fully masked rows give 0 and zero gradients. The backward is deterministic; fp32 uses
    IEEE dot products. Outside this domain it raises ValueError/NotImplementedError.
    """
    return _run(_forward, query, key, value, attn_mask, dropout_p, is_causal, scale,
                enable_gqa, window, causal_alignment, True, False)


attention_atomic = functools.partial(attention_ext, deterministic=False)
attention_atomic.__doc__ = "attention_ext with deterministic=False (atomic dQ accumulation)."
attention_tf32 = functools.partial(attention_ext, allow_tf32=True)
attention_tf32.__doc__ = "attention_ext with allow_tf32=True (TF32 dot products for fp32)."

attention.capabilities = capabilities()
attention_ext.capabilities = capabilities()
attention_atomic.capabilities = capabilities(deterministic=False)
attention_tf32.capabilities = capabilities(tf32=True)


def debug_tile_counts(query, key, value, attn_mask=None, is_causal=False, scale=None,
                      enable_gqa=False, *, window=None, causal_alignment="top_left",
                      fwd=None) -> dict[str, torch.Tensor]:
    """Run forward and backward and report, per program, how many tiles each visited.

    Returns ``{"fwd"|"dq"|"dkdv": int32 tensor (programs, 2)}`` with columns (masked edge
    tiles, unmasked full tiles); programs are numbered tile-fastest, then batch x head. Used
    by the tests to show that tiles outside the causal/window band are skipped.
    """
    p = validate(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa, window,
                 causal_alignment)
    stats: list = []
    out, lse = (fwd or _forward)(query, key, value, p, False, stats=stats)
    do = torch.ones_like(out)
    _backward(do, query, key, value, out, lse, p, True, False, stats=stats)
    return {name: buf.view(-1, 2) for name, buf in stats}

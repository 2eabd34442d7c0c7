"""Split-KV ("flash-decoding") attention over a paged KV cache, forward only, in Triton.

``attention_decode`` is FlashAttention's ``flash_attn_with_kvcache`` with a block table:
``query`` (B, Nq, Hq, D) holds 1 <= Nq <= 16 new tokens per sequence, ``k_cache``/``v_cache``
(num_blocks, page_size, Hkv, D) the paged cache, ``block_table[b, j]`` the cache block that
holds keys ``j * page_size .. (j + 1) * page_size - 1`` of sequence b, and
``cache_seqlens[b]`` the number of valid keys (the new tokens included). Query i of
sequence b sits at position ``cache_seqlens[b] - Nq + i`` and sees keys ``0..`` that
position (bottom-right causal).

Two kernels:
- ``_decode_split_kernel``: one program per (group of query heads, batch x kv head,
  split). A split is a contiguous run of whole pages of the sequence; the program walks
  its pages through the block table and runs the dense forward's tile loop on each page
  (``varlen._attend_keys`` -> ``flash_attention._fwd_inner``), with the causal band and the
  sequence end as the band/bounds of that page, so keys past ``cache_seqlens[b]`` (garbage
  slots of the last page) are never loaded. The rows of one program are (query head of the
  kv head's GQA group, new token) pairs, so each K/V tile is loaded once for the whole
  group. It writes the split's output normalised by its own l (fp32) and its lse (base 2;
  -inf for a split with no visible key).
- ``_decode_merge_kernel``: one program per (batch, query head): lse = max + log2 sum
  2^(lse_s - max) over the splits, O = sum 2^(lse_s - lse) O_s in fp32, rounded once to the
  input dtype (0 for a row that saw no key).
The numerics are the dense kernel's (fp32 scores (Q K^T) * scale, online softmax in base 2,
P rounded to the input dtype before P @ V); with one split the merge weight is exactly 1.

Caveats:
- No backward: a call that would need one raises NotImplementedError.
- ``num_splits=None`` picks the split count from the longest sequence the block table can
  hold (``block_table.shape[1] * page_size``, known without a device sync) and the GPU's
  size, see :func:`num_splits_heuristic`. The split count is capped at
  ``block_table.shape[1]`` (each split covers at least one page) and every split covers
  ``ceil(max_blocks / num_splits)`` pages, so the count actually used can be smaller.
- ``cache_seqlens[b] >= Nq``, ``cache_seqlens[b] <= block_table.shape[1] * page_size`` and
  the used block-table entries lying in ``[0, num_blocks)`` are checked on the CPU only (on
  CUDA that would cost a device-to-host sync per call). A query with no visible key (only
  possible when ``cache_seqlens[b] < Nq``) gives 0.
- page_size must be a power of two in [16, 256]; the key tile is min(page_size, table
  tile), so a tile never straddles two pages.
- Under the CPU interpreter bfloat16 is refused (Triton's interpreter computes bf16
  arithmetic and ``tl.dot`` wrongly).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from flashcheck.kernels import _common
from flashcheck.kernels._common import (
    BF16_INTERPRETER_REASON,
    INTERPRET,
    LOG2E,
    SUPPORTED_DTYPES,
    block_d,
    device_ctx,
)
from flashcheck.kernels.flash_attention import _precision, _unit_last
from flashcheck.kernels.varlen import (
    _attend_keys,
    _jit,
    _normalise,
    check_index,
    check_tensor,
    validate_heads,
)

PAGE_SIZES = (16, 32, 64, 128, 256)
MAX_NEW_TOKENS = 16

# Launch table (declarative), first row with elem == element size and BLOCK_D <= max_block_d:
# (BLOCK_N, num_warps, num_stages). Decoding streams K and V once, so the tiles are sized
# for bandwidth, not reuse: a stage holds a K and a V tile of BLOCK_N x BLOCK_D, i.e.
# 2 * 64 * 128 * 2 B = 32 KiB for fp16 at D = 128, 2 stages in flight; fp32 and D = 256
# halve BLOCK_N to keep the same bytes per stage. BLOCK_N is further capped at page_size.
DECODE_TABLE = (
    # elem max_block_d  (BLOCK_N, warps, stages)
    (2,    128,         (64, 4, 2)),
    (2,    256,         (32, 4, 2)),
    (4,    128,         (32, 4, 2)),
    (4,    256,         (16, 4, 2)),
)
# Rows per program (query heads x new tokens) on CUDA: 64 keeps the fp32 accumulator at
# 64 x 256 x 4 B = 64 KiB at the largest D; the interpreter runs the 16-row tl.dot minimum.
MAX_ROWS = 16 if INTERPRET else 64
# num_splits heuristic: a split streams at least MIN_KEYS_PER_SPLIT keys, so that its
# partial output (one fp32 row of D per query, written and re-read by the merge) stays
# below ~1/128 of the K/V bytes it reads (256 keys x 2 tensors x D x 2 B vs 4 D B);
# splits are added only while the grid has fewer than WAVES programs per SM. Measured once
# on an H200 (fp16, D = 128, Hq/Hkv = 32/8, Nq = 1, noisy to ~20%): B = 4, 32K keys: 1 split
# 0.35 TB/s, 8-32 splits 1.8-2.0 TB/s; B = 128, 2K keys (1024 programs): 1 split best
# (2.2 TB/s), 64 splits 1.6 TB/s. WAVES = 4 puts the first case at 17 splits.
MIN_KEYS_PER_SPLIT = 256
WAVES = 4
MAX_SPLITS = 64


# ----------------------------------------------------------------------------- kernels


@triton.heuristics({"PAD_D": lambda a: a["HEAD_DIM"] != a["BLOCK_D"]})
@_jit("N_NEW", "PAGES_PER_SPLIT")
def _decode_split_kernel(Q, K, V, BT, SEQLENS, OPART, LPART,
                         stride_qb, stride_qn, stride_qh, stride_qd,
                         stride_kb, stride_kp, stride_kh, stride_kd,
                         stride_vb, stride_vp, stride_vh, stride_vd,
                         stride_btb, stride_btp,
                         stride_pb, stride_ph, stride_ps, stride_pn, stride_pd,
                         stride_lb, stride_lh, stride_ls,
                         HKV, GROUP, N_NEW, HEAD_DIM, qk_scale, PAGES_PER_SPLIT,
                         PAGE_SIZE: tl.constexpr, NQ_PAD: tl.constexpr, HEADS: tl.constexpr,
                         PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr):
    pid_g = tl.program_id(0)
    off_bhk = tl.program_id(1)
    split = tl.program_id(2)
    off_b = (off_bhk // HKV).to(tl.int64)
    off_hk = (off_bhk % HKV).to(tl.int64)
    seqlen = tl.load(SEQLENS + off_b)
    # Row r is new token r % NQ_PAD of query head (group member) pid_g * HEADS + r // NQ_PAD.
    rows = tl.arange(0, BLOCK_M)
    qi = rows % NQ_PAD
    g = pid_g * HEADS + rows // NQ_PAD
    row_ok = (qi < N_NEW) & (rows < NQ_PAD * HEADS) & (g < GROUP)
    off_h = off_hk * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + off_b * stride_qb + qi[:, None] * stride_qn + off_h[:, None] * stride_qh
                + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    page_lo = split * PAGES_PER_SPLIT
    page_hi = tl.minimum(page_lo + PAGES_PER_SPLIT, tl.cdiv(seqlen, PAGE_SIZE))
    for page in range(page_lo, page_hi):
        blk = tl.load(BT + off_b * stride_btb + page * stride_btp).to(tl.int64)
        key0 = page * PAGE_SIZE
        # Within the page, key n (global key0 + n) is visible to new token i iff
        # key0 + n <= seqlen - N_NEW + i, i.e. n - i <= seqlen - N_NEW - key0; the page
        # holds min(PAGE_SIZE, seqlen - key0) valid keys; no lower band (-N_NEW).
        acc, l_i, m_i = _attend_keys(
            acc, l_i, m_i, q, K + blk * stride_kb + off_hk * stride_kh,
            V + blk * stride_vb + off_hk * stride_vh, qi, 0, N_NEW - 1, N_NEW,
            tl.minimum(seqlen - key0, PAGE_SIZE), stride_kp, stride_kd, stride_vp, stride_vd,
            HEAD_DIM, qk_scale, -N_NEW, seqlen - N_NEW - key0, True, PRECISION, BLOCK_N,
            BLOCK_D, PAD_D)
    out, lse = _normalise(acc, l_i, m_i)
    base = off_b * stride_pb + off_h * stride_ph + split * stride_ps + qi * stride_pn
    tl.store(OPART + base[:, None] + offs_d[None, :] * stride_pd, out,
             mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    tl.store(LPART + off_b * stride_lb + off_h * stride_lh + split * stride_ls + qi, lse,
             mask=row_ok)


@_jit("N_NEW", "NUM_SPLITS")
def _decode_merge_kernel(OPART, LPART, OUT,
                         stride_pb, stride_ph, stride_ps, stride_pn, stride_pd,
                         stride_lb, stride_lh, stride_ls,
                         stride_ob, stride_on, stride_oh, stride_od,
                         H, N_NEW, HEAD_DIM, NUM_SPLITS,
                         NQ_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    off_bh = tl.program_id(0)
    off_b = (off_bh // H).to(tl.int64)
    off_h = (off_bh % H).to(tl.int64)
    qi = tl.arange(0, NQ_PAD)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    l_base = LPART + off_b * stride_lb + off_h * stride_lh
    lse_s = tl.load(l_base + offs_s[None, :] * stride_ls + qi[:, None],
                    mask=(offs_s[None, :] < NUM_SPLITS) & (qi[:, None] < N_NEW),
                    other=float("-inf"))
    # lse = max + log2 sum 2^(lse_s - max); a row with no visible key anywhere (every
    # lse_s = -inf) subtracts 0 instead of -inf, gets tot = 0, weights 0 and O = 0.
    m = tl.max(lse_s, 1)
    m = tl.where(m == float("-inf"), 0.0, m)
    tot = tl.sum(tl.exp2(lse_s - m[:, None]), 1)
    lse = m + tl.log2(tl.where(tot == 0.0, 1.0, tot))
    acc = tl.zeros([NQ_PAD, BLOCK_D], dtype=tl.float32)
    o_mask = (qi[:, None] < N_NEW) & (offs_d[None, :] < HEAD_DIM)
    o_base = OPART + off_b * stride_pb + off_h * stride_ph + qi[:, None] * stride_pn \
        + offs_d[None, :] * stride_pd
    for s in range(0, NUM_SPLITS):
        w = tl.exp2(tl.load(l_base + s * stride_ls + qi, mask=qi < N_NEW, other=float("-inf"))
                    - lse)
        acc += w[:, None] * tl.load(o_base + s * stride_ps, mask=o_mask, other=0.0)
    tl.store(OUT + off_b * stride_ob + qi[:, None] * stride_on + off_h * stride_oh
             + offs_d[None, :] * stride_od, acc.to(OUT.dtype.element_ty), mask=o_mask)


# ----------------------------------------------------------------------------- launchers


def decode_point(elem: int, bd: int, page_size: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of a launch from :data:`DECODE_TABLE`."""
    if INTERPRET:
        return _common.INTERPRETER_BLOCK, 4, 1
    block_n, warps, stages = next(pt for e, max_bd, pt in DECODE_TABLE
                                  if e == elem and bd <= max_bd)
    return min(block_n, page_size), warps, stages


def num_splits_heuristic(max_keys: int, programs: int, sm_count: int) -> int:
    """Split count for ``max_keys`` keys per sequence (upper bound) and ``programs``
    programs per split: as many splits as keep >= :data:`MIN_KEYS_PER_SPLIT` keys each,
    but no more than needed to put :data:`WAVES` programs on each of ``sm_count`` SMs (a
    grid that already fills the GPU gains nothing from splitting), at most MAX_SPLITS."""
    by_length = triton.cdiv(max(max_keys, 1), MIN_KEYS_PER_SPLIT)
    by_occupancy = triton.cdiv(WAVES * sm_count, max(programs, 1))
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


def _forward(q, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits):
    B, Nq, Hq, D = q.shape
    _, page_size, Hkv, _ = k_cache.shape
    group = Hq // Hkv
    max_blocks = block_table.shape[1]
    bd = block_d(D)
    nq_pad = triton.next_power_of_2(Nq)
    heads = min(triton.next_power_of_2(group), max(1, MAX_ROWS // nq_pad))
    head_groups = triton.cdiv(group, heads)
    if num_splits is None:
        num_splits = num_splits_heuristic(max_blocks * page_size, head_groups * B * Hkv,
                                          _common.sm_count(q.device))
    pages_per_split = triton.cdiv(max_blocks, min(num_splits, max_blocks))
    splits = triton.cdiv(max_blocks, pages_per_split)
    block_n, warps, stages = decode_point(q.element_size(), bd, page_size)
    opart = torch.empty((B, Hq, splits, Nq, D), dtype=torch.float32, device=q.device)
    lpart = torch.empty((B, Hq, splits, Nq), dtype=torch.float32, device=q.device)
    out = torch.empty((B, Nq, Hq, D), dtype=q.dtype, device=q.device)
    with device_ctx(q):
        _decode_split_kernel[(head_groups, B * Hkv, splits)](
            q, k_cache, v_cache, block_table, cache_seqlens, opart, lpart,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_table.stride(),
            *opart.stride(), *lpart.stride()[:3], Hkv, group, Nq, D, scale * LOG2E,
            pages_per_split, PAGE_SIZE=page_size, NQ_PAD=nq_pad, HEADS=heads,
            PRECISION=_precision(q.dtype, False), BLOCK_M=max(16, nq_pad * heads),
            BLOCK_N=block_n, BLOCK_D=bd, num_warps=warps, num_stages=stages)
        _decode_merge_kernel[(B * Hq,)](
            opart, lpart, out, *opart.stride(), *lpart.stride()[:3], *out.stride(), Hq, Nq,
            D, splits, NQ_PAD=nq_pad, SPLITS_PAD=triton.next_power_of_2(splits), BLOCK_D=bd,
            num_warps=4 if bd >= 128 else 2)
    return out


# ----------------------------------------------------------------------------- validation


def _check_values(Nq, page_size, num_blocks, cache_seqlens, block_table) -> None:
    """CPU-only value checks (no device sync on CUDA)."""
    if cache_seqlens.device.type != "cpu":
        return
    cap = block_table.shape[1] * page_size
    bad = (cache_seqlens < Nq) | (cache_seqlens > cap)
    if bool(bad.any()):
        raise ValueError(f"cache_seqlens must lie in [Nq, max_blocks * page_size] = [{Nq}, "
                         f"{cap}], got {cache_seqlens.tolist()}")
    used = torch.arange(block_table.shape[1]) * page_size < cache_seqlens[:, None]
    entries = block_table[used]
    if entries.numel() and bool(((entries < 0) | (entries >= num_blocks)).any()):
        raise ValueError(f"block_table entries of used pages must lie in [0, num_blocks) = "
                         f"[0, {num_blocks}), got {entries.tolist()}")


def _validate(query, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits) -> float:
    check_tensor("query", query, 4, "(B, Nq, Hq, D)")
    check_tensor("k_cache", k_cache, 4, "(num_blocks, page_size, Hkv, D)")
    check_tensor("v_cache", v_cache, 4, "(num_blocks, page_size, Hkv, D)")
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape "
                         f"{tuple(k_cache.shape)}")
    B, Nq, Hq, D = query.shape
    num_blocks, page_size, Hkv, _ = k_cache.shape
    if B < 1:
        raise ValueError(f"query batch B={B} (query dim 0) must be >= 1")
    if not 1 <= Nq <= MAX_NEW_TOKENS:
        err = ValueError if Nq < 1 else NotImplementedError
        raise err(f"query new tokens Nq={Nq} (query dim 1) is not supported; allowed: "
                  f"1 <= Nq <= {MAX_NEW_TOKENS}")
    if num_blocks < 1:
        raise ValueError(f"k_cache must hold >= 1 block, got shape {tuple(k_cache.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != query.dtype:
            raise ValueError(f"{name} dtype {t.dtype} differs from query dtype {query.dtype}; "
                             f"query, k_cache and v_cache must share one dtype")
    if k_cache.shape[-1] != D:
        raise ValueError(f"k_cache head dim {k_cache.shape[-1]} (dim 3) differs from query "
                         f"head dim {D}")
    if page_size not in PAGE_SIZES:
        raise NotImplementedError(f"page_size={page_size} (k_cache dim 1) is not supported; "
                                  f"allowed: {PAGE_SIZES}")
    p = validate_heads(query, k_cache, v_cache, Hq, Hkv, D, False, scale, None, "top_left")
    check_index("cache_seqlens", cache_seqlens, (B,), query.device)
    check_index("block_table", block_table, (B, None), query.device)
    if block_table.shape[1] < 1:
        raise ValueError("block_table must have >= 1 column (max_blocks), got shape "
                         f"{tuple(block_table.shape)}")
    if num_splits is not None and (isinstance(num_splits, bool)
                                   or not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be None or an int >= 1, got {num_splits!r}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, k_cache, v_cache)):
        raise NotImplementedError("attention_decode has no backward: call it under "
                                  "torch.no_grad() or with inputs that do not require grad")
    _check_values(Nq, page_size, num_blocks, cache_seqlens, block_table)
    return p.scale


# ----------------------------------------------------------------------------- public entry


def attention_decode(query, k_cache, v_cache, cache_seqlens, block_table, *, scale=None,
                     num_splits=None):
    """Decoding attention over a paged KV cache (``flash_attn_with_kvcache`` with a block
    table), split-KV with a merge pass; forward only.

    ``query`` (B, Nq, Hq, D), 1 <= Nq <= 16, in fp16, bf16 or fp32; ``k_cache``/``v_cache``
    (num_blocks, page_size, Hkv, D), page_size a power of two in [16, 256], Hq a multiple
    of Hkv; ``block_table`` (B, max_blocks) int32, entry [b, j] the block holding keys
    ``j*page_size .. (j+1)*page_size - 1`` of sequence b (entries past the sequence's pages
    are not read); ``cache_seqlens`` (B,) int32, the valid keys of each sequence including
    the Nq new ones (>= Nq). New token i of sequence b attends keys
    ``0 .. cache_seqlens[b] - Nq + i``. ``scale`` defaults to 1/sqrt(D); ``num_splits``
    (None = :func:`num_splits_heuristic`) the number of key splits merged at the end.
    Returns (B, Nq, Hq, D) in the input dtype. Outside this domain it raises ValueError
    (NotImplementedError for a valid but unsupported request, and for autograd).
    """
    scale = _validate(query, k_cache, v_cache, cache_seqlens, block_table, scale, num_splits)
    return _forward(_unit_last(query), _unit_last(k_cache), _unit_last(v_cache), cache_seqlens,
                    block_table, scale, num_splits)


attention_decode.capabilities = {
    "api": "decode",
    "dtypes": tuple(_common.DTYPE_NAMES[d] for d in SUPPORTED_DTYPES),
    "head_dims": (1, _common.MAX_HEAD_DIM),
    "gqa": True,
    "backward": False,
    "devices": ("cpu", "cuda") if INTERPRET else ("cuda",),
    "not_run": {"cpu": {"bfloat16": BF16_INTERPRETER_REASON}} if INTERPRET else {},
    "page_sizes": PAGE_SIZES,
    "max_new_tokens": MAX_NEW_TOKENS,
    # split-KV: its merge weights carry each split's lse rounding (the opt-in family member)
    "family": ("split_kv",),
}

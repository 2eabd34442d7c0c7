"""The ragged-batch kernels (``kernels.attention_varlen``, ``kernels.attention_decode``)
against float64 references written here, one sequence at a time, with torch.

- varlen: sequence b is ``scaled_dot_product_attention`` in float64 on its slices, with an
  explicit bool mask from is_causal / causal_alignment / window (built here from the rules
  of docs/contracts.md section 1, independently of ``reference.masks``) and rows that see
  no key set to 0; gradients by float64 autograd.
- decode: the cache pages of sequence b gathered through its block table, cut at
  cache_seqlens[b], new token i attending keys 0 .. cache_seqlens[b] - Nq + i.

Tolerance (per checked tensor T, absolute): ``err <= C_ROUND * u * max|T_ref| + fp32 sums``
with u the input dtype's unit roundoff (see ``_tol``). Shapes are tiny because the CPU runs
Triton's interpreter (16-row tiles: a 20-token sequence spans two tiles plus a tail).
bfloat16 is collected everywhere and skipped on the CPU, whose interpreter computes it
wrongly.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from flashcheck.kernels import attention_decode, attention_varlen

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
U = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}
U32 = 2.0**-24
# Roundings to the input dtype that reach an output element: P before P @ V, dS before
# dS @ K / dS^T @ Q, delta from the rounded O, the final rounding of the result: <= 4 u
# relative to the magnitude of the sum, doubled because a sum of random-sign terms can be
# up to ~2x smaller than the largest element of the tensor (max|T_ref|) it is compared to.
C_ROUND = 8
# fp32 accumulation: dot products and row sums of length n = max(Lk, Lq, D), first order
# n u32 each, two of them in series (scores then P @ V; dP then dS @ K), same 2x margin.
C_SUM = 4
# Garbage written into cache slots that must never be read: a key of 1e4 turns its score
# into ~1e4 * |q| / sqrt(D) and a value of 1e4 dominates any output it leaks into.
GARBAGE = 1e4


def _skip_bf16(dtype):
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        pytest.skip("bfloat16 is not run under the CPU interpreter: "
                    "Triton's interpreter computes bf16 arithmetic and tl.dot wrongly")


def _tol(ref: torch.Tensor, dtype: torch.dtype, n: int) -> float:
    mag = ref.abs().max().item() if ref.numel() else 0.0
    return (C_ROUND * U[dtype] + C_SUM * n * U32) * mag


def _assert_close(name, got, ref, dtype, n):
    err = (got.double() - ref).abs().max().item() if ref.numel() else 0.0
    tol = _tol(ref, dtype, n)
    assert err <= tol, f"{name}: max error {err:.3e} > tolerance {tol:.3e}"


def _allowed(Lq, Lk, is_causal, align, window):
    """(Lq, Lk) bool: query i may see key j (docs/contracts.md section 1)."""
    i = torch.arange(Lq)[:, None]
    j = torch.arange(Lk)[None, :]
    off = 0 if align == "top_left" else Lk - Lq
    ok = torch.ones(Lq, Lk, dtype=torch.bool)
    if is_causal:
        ok &= j <= i + off
    left, right = window if window is not None else (-1, -1)
    if left >= 0:
        ok &= j >= i + off - left
    if right >= 0:
        ok &= j <= i + off + right
    return ok


def _sdpa64(q, k, v, allowed, scale):
    """float64 SDPA of (H, Lq, D) x (H, Lk, D) under ``allowed``; rows with no allowed key
    (Lk = 0 included) are 0, with zero gradients."""
    if k.shape[1] == 0:
        return q * 0.0
    empty = ~allowed.any(-1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | empty[:, None],
                                         scale=scale)
    return torch.where(empty[:, None], 0.0, out)


# ----------------------------------------------------------------------------- varlen

# name: (q lengths, k lengths, Hq, Hkv, D, is_causal, alignment, window, layout)
VARLEN_CASES = {
    # zero-length on either side, length 1, one long (2 tiles + tail) beside short ones,
    # GQA, a head dim that is no power of two (padded to 32)
    "mixed_gqa": ([5, 0, 37, 1, 3], [7, 4, 37, 0, 1], 4, 2, 24, False, "top_left", None,
                  "contiguous"),
    "causal_top_left": ([3, 20, 1], [9, 17, 4], 2, 2, 16, True, "top_left", None,
                        "contiguous"),
    # Lq > Lk rows before the diagonal see nothing (output 0); Lq < Lk shifts the diagonal
    "causal_bottom_right": ([6, 18, 0], [3, 25, 5], 2, 1, 32, True, "bottom_right", None,
                            "contiguous"),
    "window": ([17, 4], [21, 6], 2, 2, 16, False, "top_left", (3, 1), "contiguous"),
    "causal_window_br": ([12, 2], [20, 9], 3, 1, 16, True, "bottom_right", (4, -1),
                         "contiguous"),
    # query a slice of a wider head axis, key stored head-major, value with head-dim stride
    # != 1 (copied by the kernel), do an expanded (stride-0) tensor
    "strided": ([9, 0, 18], [5, 11, 18], 4, 2, 16, True, "top_left", None, "strided"),
}


def _varlen_inputs(gen, lq, lk, Hq, Hkv, D, dtype, layout):
    tq, tk = sum(lq), sum(lk)
    if layout == "strided":
        q = torch.randn(tq, Hq + 3, D, generator=gen)[:, 1:Hq + 1]
        k = torch.randn(Hkv, tk, D, generator=gen).transpose(0, 1)
        v = torch.randn(D, Hkv, tk, generator=gen).permute(2, 1, 0)
        do = torch.randn(1, Hq, D, generator=gen).expand(tq, Hq, D)
    else:
        q = torch.randn(tq, Hq, D, generator=gen)
        k = torch.randn(tk, Hkv, D, generator=gen)
        v = torch.randn(tk, Hkv, D, generator=gen)
        do = torch.randn(tq, Hq, D, generator=gen)
    q, k, v = (t.to(dtype=dtype, device=DEVICE).requires_grad_() for t in (q, k, v))
    return q, k, v, do.to(dtype=dtype, device=DEVICE)


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                        device=DEVICE)


def _varlen_ref(q, k, v, lq, lk, is_causal, align, window):
    """float64 per-sequence outputs (concatenated) and the per-row "sees no key" flags."""
    group = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    outs, empty = [], []
    cq, ck = _cu(lq).tolist(), _cu(lk).tolist()
    for b in range(len(lq)):
        qs = q[cq[b]:cq[b + 1]].transpose(0, 1)
        ks = k[ck[b]:ck[b + 1]].transpose(0, 1).repeat_interleave(group, 0)
        vs = v[ck[b]:ck[b + 1]].transpose(0, 1).repeat_interleave(group, 0)
        allowed = _allowed(lq[b], lk[b], is_causal, align, window).to(q.device)
        outs.append(_sdpa64(qs, ks, vs, allowed, scale).transpose(0, 1))
        empty.append(~allowed.any(-1))
    return torch.cat(outs), torch.cat(empty)


@pytest.mark.parametrize("dtype", ["fp16", "fp32", "bf16"])
@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_varlen_matches_reference(case, dtype):
    dtype = DTYPES[dtype]
    _skip_bf16(dtype)
    lq, lk, Hq, Hkv, D, is_causal, align, window, layout = VARLEN_CASES[case]
    gen = torch.Generator().manual_seed(sum(map(ord, case)))
    q, k, v, do = _varlen_inputs(gen, lq, lk, Hq, Hkv, D, dtype, layout)
    out = attention_varlen(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), is_causal=is_causal,
                           causal_alignment=align, window=window)
    assert out.shape == q.shape and out.dtype == dtype
    grads = torch.autograd.grad(out, (q, k, v), do)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, empty = _varlen_ref(q64, k64, v64, lq, lk, is_causal, align, window)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    n = max(max(lq), max(lk), D)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads),
                               strict=True):
        assert torch.isfinite(got).all(), f"{name} has non-finite entries"
        _assert_close(name, got, want, dtype, n)
    # Rows that see no key: exact zeros in the output and in dQ, never NaN.
    assert (out[empty] == 0).all() and (grads[0][empty] == 0).all()


# ----------------------------------------------------------------------------- decode

# name: (page_size, Nq, Hq, Hkv, D, num_splits, cache_seqlens as multiples of page_size
# plus an offset); max_blocks = 4 for every case
DECODE_CASES = {
    # one split; a sequence that is only its new tokens, a full last page, a partial one
    "p16_single": (16, 1, 4, 2, 16, 1, [(0, 1), (2, 0), (3, -5)]),
    # several splits, GQA group of 4 packed with 3 new tokens into one program
    "p16_splits": (16, 3, 4, 1, 32, 3, [(4, -1), (1, 2), (0, 3)]),
    # heuristic split count, odd head dim
    "p32_auto": (32, 4, 2, 2, 24, None, [(2, 7), (4, 0), (0, 4)]),
    # more splits than pages in use (clamped to max_blocks); empty splits for short ones
    "p64_many": (64, 1, 8, 2, 16, 8, [(3, 9), (0, 1), (1, 1)]),
    "p16_nq16": (16, 16, 2, 1, 16, 2, [(1, 0), (3, 11), (4, 0)]),
}
MAX_BLOCKS = 4


def _decode_inputs(gen, ps, Nq, Hq, Hkv, D, seqlens, dtype):
    """Shuffled block table; every cache slot no sequence owns, and every slot past a
    sequence's end in its last page, holds GARBAGE; table entries past a sequence's pages
    point outside the cache."""
    B = len(seqlens)
    num_blocks = B * MAX_BLOCKS + 3
    k_cache = torch.full((num_blocks, ps, Hkv, D), GARBAGE)
    v_cache = torch.full((num_blocks, ps, Hkv, D), GARBAGE)
    table = torch.randperm(num_blocks, generator=gen)[:B * MAX_BLOCKS].view(B, MAX_BLOCKS)
    for b, n in enumerate(seqlens):
        pages = table[b, :math.ceil(n / ps)]
        slots = (pages[:, None] * ps + torch.arange(ps)).flatten()[:n]
        for cache in (k_cache, v_cache):
            cache.view(num_blocks * ps, Hkv, D)[slots] = torch.randn(n, Hkv, D, generator=gen)
        table[b, len(pages):] = num_blocks + 1000
    q = torch.randn(B, Nq, Hq, D, generator=gen)
    return (q.to(dtype=dtype, device=DEVICE), k_cache.to(dtype=dtype, device=DEVICE),
            v_cache.to(dtype=dtype, device=DEVICE),
            torch.tensor(seqlens, dtype=torch.int32, device=DEVICE),
            table.to(dtype=torch.int32, device=DEVICE))


def _decode_ref(q, k_cache, v_cache, seqlens, table):
    B, Nq, Hq, D = q.shape
    ps, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(B, Nq, Hq, D, dtype=torch.float64, device=q.device)
    for b, n in enumerate(seqlens.tolist()):
        pages = table[b, :math.ceil(n / ps)].long()
        k = k_cache[pages].reshape(-1, Hkv, D)[:n].double().transpose(0, 1)
        v = v_cache[pages].reshape(-1, Hkv, D)[:n].double().transpose(0, 1)
        allowed = torch.arange(n)[None, :] <= n - Nq + torch.arange(Nq)[:, None]
        out[b] = _sdpa64(q[b].double().transpose(0, 1), k.repeat_interleave(Hq // Hkv, 0),
                         v.repeat_interleave(Hq // Hkv, 0), allowed.to(q.device),
                         1.0 / math.sqrt(D)).transpose(0, 1)
    return out


@pytest.mark.parametrize("dtype", ["fp16", "fp32", "bf16"])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_matches_reference(case, dtype):
    dtype = DTYPES[dtype]
    _skip_bf16(dtype)
    ps, Nq, Hq, Hkv, D, num_splits, lens = DECODE_CASES[case]
    seqlens = [max(Nq, pages * ps + extra) for pages, extra in lens]
    gen = torch.Generator().manual_seed(sum(map(ord, case)))
    q, k_cache, v_cache, cache_seqlens, table = _decode_inputs(gen, ps, Nq, Hq, Hkv, D,
                                                               seqlens, dtype)
    out = attention_decode(q, k_cache, v_cache, cache_seqlens, table, num_splits=num_splits)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    ref = _decode_ref(q, k_cache, v_cache, cache_seqlens, table)
    _assert_close("out", out, ref, dtype, max(max(seqlens), D))


# ----------------------------------------------------------------------------- errors


def _varlen_args(**over):
    q = torch.randn(6, 2, 16, dtype=torch.float16, device=DEVICE)
    kv = torch.randn(5, 1, 16, dtype=torch.float16, device=DEVICE)
    args = dict(query=q, key=kv, value=kv, cu_seqlens_q=_cu([4, 2]), cu_seqlens_k=_cu([3, 2]),
                max_seqlen_q=4, max_seqlen_k=3)
    args.update(over)
    return args


def _decode_args(**over):
    cache = torch.randn(4, 16, 1, 16, dtype=torch.float16, device=DEVICE)
    args = dict(query=torch.randn(2, 1, 2, 16, dtype=torch.float16, device=DEVICE),
                k_cache=cache, v_cache=cache,
                cache_seqlens=torch.tensor([5, 20], dtype=torch.int32, device=DEVICE),
                block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE))
    args.update(over)
    return args


def _f16(*shape):
    return torch.randn(*shape, dtype=torch.float16, device=DEVICE)


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


# (kernel, argument overrides, exception, message pattern); values-only checks (cu_seqlens
# monotonicity and sums, cache_seqlens range) run on the CPU only.
BAD_ARGS = {
    "varlen_query_4d": (attention_varlen, dict(query=_f16(1, 6, 2, 16)), ValueError,
                        "query must have 3 dims"),
    "varlen_value_shape": (attention_varlen, dict(value=_f16(5, 1, 8)), ValueError,
                           "value shape"),
    "varlen_dtype_f64": (attention_varlen, dict(query=_f16(6, 2, 16).double()),
                         NotImplementedError, "allowed: float16, bfloat16, float32"),
    "varlen_head_dim": (attention_varlen, dict(query=_f16(6, 2, 300), key=_f16(5, 1, 300),
                                               value=_f16(5, 1, 300)),
                        NotImplementedError, "1 <= D <= 256"),
    "varlen_gqa": (attention_varlen, dict(query=_f16(6, 3, 16), key=_f16(5, 2, 16),
                                          value=_f16(5, 2, 16)), ValueError, "multiple"),
    "varlen_cu_dtype": (attention_varlen, dict(cu_seqlens_q=_cu([4, 2]).long()), ValueError,
                        "cu_seqlens_q dtype"),
    "varlen_cu_len": (attention_varlen, dict(cu_seqlens_k=_i32(0, 5)), ValueError,
                      "B \\+ 1"),
    "varlen_max_seqlen": (attention_varlen, dict(max_seqlen_q=-1), ValueError,
                          "max_seqlen_q must be an int"),
    "varlen_alignment": (attention_varlen, dict(causal_alignment="center"), ValueError,
                         "causal_alignment"),
    "varlen_window": (attention_varlen, dict(window=(2, -3)), ValueError, "window"),
    "varlen_scale": (attention_varlen, dict(scale=0.0), ValueError, "scale"),
    "decode_query_3d": (attention_decode, dict(query=_f16(2, 2, 16)), ValueError,
                        "query must have 4 dims"),
    "decode_new_tokens": (attention_decode, dict(query=_f16(2, 17, 2, 16)),
                          NotImplementedError, "1 <= Nq <= 16"),
    "decode_page_size": (attention_decode, dict(k_cache=_f16(4, 24, 1, 16),
                                                v_cache=_f16(4, 24, 1, 16)),
                         NotImplementedError, "page_size=24"),
    "decode_cache_dtype": (attention_decode, dict(v_cache=_f16(4, 16, 1, 16).float()),
                           ValueError, "v_cache dtype"),
    "decode_seqlens_dtype": (attention_decode, dict(cache_seqlens=_i32(5, 20).long()),
                             ValueError, "cache_seqlens dtype"),
    "decode_table_shape": (attention_decode, dict(block_table=_i32(0, 1)), ValueError,
                           "block_table must have 2 dims"),
    "decode_num_splits": (attention_decode, dict(num_splits=0), ValueError, "num_splits"),
    "decode_gqa": (attention_decode, dict(query=_f16(2, 1, 3, 16), k_cache=_f16(4, 16, 2, 16),
                                          v_cache=_f16(4, 16, 2, 16)), ValueError,
                   "multiple"),
    "decode_grad": (attention_decode, dict(query=_f16(2, 1, 2, 16).requires_grad_()),
                    NotImplementedError, "no backward"),
}
if DEVICE == "cpu":
    BAD_ARGS.update({
        "varlen_cu_decreasing": (attention_varlen, dict(cu_seqlens_q=_i32(0, 4, 3)),
                                 ValueError, "non-decreasing"),
        "varlen_cu_total": (attention_varlen, dict(cu_seqlens_k=_i32(0, 3, 4)), ValueError,
                            "packed length 5"),
        "varlen_max_too_small": (attention_varlen, dict(max_seqlen_k=2), ValueError,
                                 "max_seqlen_k = 2"),
        "decode_seqlens_range": (attention_decode, dict(cache_seqlens=_i32(0, 20)),
                                 ValueError, "cache_seqlens must lie in"),
        "decode_table_entry": (attention_decode, dict(block_table=_i32([0, 1], [9, 3])),
                               ValueError, "block_table entries"),
    })


@pytest.mark.parametrize("name", list(BAD_ARGS))
def test_bad_arguments_raise(name):
    fn, over, exc, pattern = BAD_ARGS[name]
    args = (_varlen_args if fn is attention_varlen else _decode_args)(**over)
    with pytest.raises(exc, match=pattern):
        fn(**args)


def test_capabilities():
    v, d = attention_varlen.capabilities, attention_decode.capabilities
    assert v["api"] == "varlen" and v["backward"] and v["gqa"] and v["deterministic_backward"]
    assert v["extensions"] == ("window", "causal_alignment")
    assert d["api"] == "decode" and d["backward"] is False and d["gqa"]
    assert d["page_sizes"] == (16, 32, 64, 128, 256) and d["max_new_tokens"] == 16
    for caps in (v, d):
        assert caps["dtypes"] == ("float16", "bfloat16", "float32")
        assert caps["head_dims"] == (1, 256)
        assert DEVICE in caps["devices"]

"""Test-only kernels: a correct blocked PyTorch flash kernel, and ways to make wrong ones.

- :func:`blocked_attention`: FA2-order online softmax over key blocks, vectorised over
  batch, heads and queries; fp32 accumulation with input-dtype operands, P rounded to the
  input dtype before P@V, dS rounded before dS@K / dS^T@Q, output and gradients rounded.
  Its backward is FA2's (P recomputed from lse, D = rowsum(dO * O)). It accepts the
  ``window``/``causal_alignment`` extensions; :func:`blocked_attention_plain` is the same
  kernel without them (for mask-folding tests).
- :func:`dense_fp64`: a plain float64 attention (autograd), used to amplify errors.
- :func:`amplified`: a kernel whose out/dq/dk/dv are ``ref + factor * (good - ref)`` for a
  correct kernel ``good``: exactly ``factor`` times its error, on every tensor.
- :func:`coarse_p_attention`: the blocked kernel with P and dS rounded to ``drop`` fewer
  mantissa bits than the input dtype (an honest rounding bug, ~2^drop times the error).

Caveat: these are slow reference-grade kernels for small test shapes, not fast kernels.
"""

from __future__ import annotations

import math

import torch
from flashcheck.reference.masks import structural_mask

_MANT = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23}


def _setup(query, key, attn_mask, is_causal, scale, enable_gqa, window, causal_alignment):
    if not enable_gqa and query.shape[1] != key.shape[1]:
        raise ValueError("enable_gqa=False requires Hq == Hkv")
    nq, nk, d = query.shape[2], key.shape[2], query.shape[3]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    allowed = structural_mask(nq, nk, is_causal=is_causal, causal_alignment=causal_alignment,
                              window=window, device=query.device)
    bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask
        else:
            bias = attn_mask.float()
    return scale, allowed, bias


def _round_mant(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Round fp32 ``x`` to ``bits`` stored mantissa bits (round half away; test use only)."""
    m, e = torch.frexp(x)
    step = 2.0 ** (bits + 1)
    return torch.ldexp(torch.round(m * step) / step, e)


def _rnd(x: torch.Tensor, dtype: torch.dtype, drop: int) -> torch.Tensor:
    if drop:
        return _round_mant(x, _MANT[dtype] - drop)
    return x.to(dtype).float()


def _scores(q, k, scale, allowed, bias, j0, j1):
    s = (q @ k[:, :, j0:j1].transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias[..., j0:j1]
    ok = allowed[..., j0:j1].expand(s.shape) & (s != -math.inf)  # NaN stays in
    return torch.where(ok, s, torch.full_like(s, -math.inf)), ok


class _Blocked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_in, k_in, v_in, attn_mask, is_causal, scale, enable_gqa, window,
                causal_alignment, block_n, drop):
        dtype = q_in.dtype
        g = q_in.shape[1] // k_in.shape[1]
        q = q_in.float()
        k = k_in.float().repeat_interleave(g, 1)
        v = v_in.float().repeat_interleave(g, 1)
        scale, allowed, bias = _setup(q_in, k_in, attn_mask, is_causal, scale, enable_gqa,
                                      window, causal_alignment)
        b, h, nq, d = q.shape
        nk = k.shape[2]
        m = torch.full((b, h, nq, 1), -math.inf, device=q.device)
        l = torch.zeros(b, h, nq, 1, device=q.device)
        acc = torch.zeros(b, h, nq, v.shape[-1], device=q.device)
        for j0 in range(0, nk, block_n):
            j1 = min(j0 + block_n, nk)
            s, ok = _scores(q, k, scale, allowed, bias, j0, j1)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            p = torch.where(ok, torch.exp(s - m_safe), torch.zeros_like(s))
            alpha = torch.where(torch.isfinite(m), torch.exp(m - m_safe), torch.zeros_like(m))
            l = l * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + _rnd(p, dtype, drop) @ v[:, :, j0:j1]
            m = m_new
        live = l != 0  # a NaN row sum stays live: NaN inputs must reach the output
        out = torch.where(live, acc / torch.where(live, l, torch.ones_like(l)), 0.0).to(dtype)
        lse = torch.where(live, m + torch.log(torch.where(live, l, torch.ones_like(l))),
                          torch.full_like(l, -math.inf))
        ctx.save_for_backward(q_in, k_in, v_in, out, lse)
        ctx.args = (scale, allowed, bias, block_n, drop, g)
        return out

    @staticmethod
    def backward(ctx, dout):
        q_in, k_in, v_in, out, lse = ctx.saved_tensors
        scale, allowed, bias, block_n, drop, g = ctx.args
        dtype = q_in.dtype
        q = q_in.float()
        k = k_in.float().repeat_interleave(g, 1)
        v = v_in.float().repeat_interleave(g, 1)
        do = dout.to(dtype).float()
        drow = (do * out.float()).sum(-1, keepdim=True)
        lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        dq = torch.zeros_like(q)
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
        for j0 in range(0, k.shape[2], block_n):
            j1 = min(j0 + block_n, k.shape[2])
            s, ok = _scores(q, k, scale, allowed, bias, j0, j1)
            p = torch.where(ok, torch.exp(s - lse_safe), torch.zeros_like(s))
            dv[:, :, j0:j1] = _rnd(p, dtype, drop).transpose(-1, -2) @ do
            dp = do @ v[:, :, j0:j1].transpose(-1, -2)
            ds = _rnd(p * (dp - drow), dtype, drop)
            dq += (ds @ k[:, :, j0:j1]) * scale
            dk[:, :, j0:j1] = (ds.transpose(-1, -2) @ q) * scale
        if g > 1:
            b, h = dk.shape[:2]
            dk = dk.reshape(b, h // g, g, *dk.shape[2:]).sum(2)
            dv = dv.reshape(b, h // g, g, *dv.shape[2:]).sum(2)
        return (dq.to(dtype), dk.to(dtype), dv.to(dtype)) + (None,) * 8


def blocked_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                      scale=None, enable_gqa=False, *, window=None, causal_alignment="top_left",
                      block_n=32):
    """Correct FA2-order blocked kernel (SDPA signature plus the two extensions)."""
    if dropout_p != 0.0:
        raise NotImplementedError(f"dropout_p must be 0.0, got {dropout_p}")
    return _Blocked.apply(query, key, value, attn_mask, is_causal, scale, enable_gqa, window,
                          causal_alignment, block_n, 0)


blocked_attention.capabilities = {"extensions": ("window", "causal_alignment"), "backward": True,
                                  "gqa": True, "masks": ("bool", "additive")}


def blocked_attention_plain(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                            scale=None, enable_gqa=False):
    """The blocked kernel without extensions: the harness must fold window/alignment."""
    return blocked_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                             enable_gqa)


def coarse_p_attention(drop: int):
    """The blocked kernel with P and dS rounded to ``drop`` fewer mantissa bits."""
    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                  scale=None, enable_gqa=False, *, window=None, causal_alignment="top_left"):
        return _Blocked.apply(query, key, value, attn_mask, is_causal, scale, enable_gqa,
                              window, causal_alignment, 32, drop)
    attention.capabilities = dict(blocked_attention.capabilities)
    return attention


def dense_fp64(query, key, value, attn_mask=None, is_causal=False, scale=None,
               enable_gqa=False, *, window=None, causal_alignment="top_left"):
    """Plain float64 attention with autograd; fully masked rows give 0."""
    scale, allowed, bias = _setup(query, key, attn_mask, is_causal, scale, enable_gqa, window,
                                  causal_alignment)
    g = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(g, 1)
    v = value.repeat_interleave(g, 1)
    s = (query @ k.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.double()
    ok = allowed.expand(s.shape) & (s != -math.inf)
    s = torch.where(ok, s, torch.full_like(s, -math.inf))
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.where(ok, torch.exp(s - m), torch.zeros_like(s))
    den = e.sum(-1, keepdim=True)
    p = e / torch.where(den > 0, den, torch.ones_like(den))
    return p @ v


class _Amplified(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, good, factor, kwargs):
        leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():
            ref = dense_fp64(*leaves64, **kwargs)
            got = good(*leaves, **kwargs)
        ctx.keep = (leaves64, leaves, ref, got, factor)
        return (ref + factor * (got.double() - ref)).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        leaves64, leaves, ref, got, factor = ctx.keep
        g_ref = torch.autograd.grad(ref, leaves64, dout.double())
        g_got = torch.autograd.grad(got, leaves, dout)
        return tuple(
            (r + factor * (x.double() - r)).to(x.dtype) for r, x in zip(g_ref, g_got, strict=True)
        ) + (None, None, None)


def amplified(good, factor: float):
    """A kernel with exactly ``factor`` times ``good``'s error on out, dq, dk and dv."""
    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                  scale=None, enable_gqa=False, *, window=None, causal_alignment="top_left"):
        kwargs = dict(attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                      enable_gqa=enable_gqa, window=window, causal_alignment=causal_alignment)
        return _Amplified.apply(query, key, value, good, factor, kwargs)
    attention.capabilities = dict(blocked_attention.capabilities)
    return attention

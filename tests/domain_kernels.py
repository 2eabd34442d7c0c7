"""Test-only kernels with a narrow declared domain (docs/contracts.md §2), each failing loudly
when the harness hands it a case outside what it declares.

Every kernel here is the fp64 reference rounded to the input dtype (gradients through
autograd), so it is exact up to that rounding and fast on the CPU. Outside its declared
domain it raises AssertionError: not a clear rejection (verify.adapters.is_clear_rejection),
so a campaign that drew such a case records a "raised" failure and exits 1 instead of
skipping it.

- :func:`attention`: ``seq_multiple=16``, ``head_dims={16, 32, 64}``;
- :func:`causal_only_backward`: ``backward="causal_only"``; differentiating a non-causal
  call raises;
- :func:`same_seqlen`: ``same_seqlen=True``;
- :func:`causal_multiple`: ``seq_multiple={"causal": 32, "noncausal": 8}``, ``max_seqlen=96``.
"""

from __future__ import annotations

import torch
from flashcheck.reference import attention_fp64


def _exact(query, key, value, attn_mask, is_causal, scale, enable_gqa, window,
           causal_alignment):
    mask = attn_mask if attn_mask is None or attn_mask.dtype == torch.bool else (
        attn_mask.to(torch.float64))
    out = attention_fp64(query.to(torch.float64), key.to(torch.float64),
                         value.to(torch.float64), attn_mask=mask, is_causal=is_causal,
                         scale=scale, enable_gqa=enable_gqa, window=window,
                         causal_alignment=causal_alignment)
    return out.to(query.dtype)


def _outside(condition: bool, what: str) -> None:
    if condition:
        raise AssertionError(f"the harness called this kernel outside its declared domain: "
                             f"{what}")


_FULL = {"extensions": ("window", "causal_alignment"), "gqa": True,
         "masks": ("bool", "additive")}


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False, *, window=None, causal_alignment="top_left"):
    """Nq and Nk multiples of 16, D in {16, 32, 64}."""
    nq, nk, d = query.shape[2], key.shape[2], query.shape[3]
    _outside(nq % 16 != 0 or nk % 16 != 0, f"Nq={nq}, Nk={nk} not multiples of 16")
    _outside(d not in (16, 32, 64), f"head dim {d} not in {{16, 32, 64}}")
    return _exact(query, key, value, attn_mask, is_causal, scale, enable_gqa, window,
                  causal_alignment)


attention.capabilities = {**_FULL, "backward": True, "seq_multiple": 16,
                          "head_dims": {16, 32, 64}}


class _CausalOnlyGrad(torch.autograd.Function):
    """Identity whose backward refuses to run for a non-causal call."""

    @staticmethod
    def forward(ctx, out, is_causal):
        ctx.is_causal = is_causal
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        _outside(not ctx.is_causal, "backward of a non-causal call")
        return grad, None


def causal_only_backward(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                         scale=None, enable_gqa=False, *, window=None,
                         causal_alignment="top_left"):
    """Forward everywhere; gradients only for ``is_causal`` calls."""
    out = _exact(query, key, value, attn_mask, is_causal, scale, enable_gqa, window,
                 causal_alignment)
    return _CausalOnlyGrad.apply(out, bool(is_causal))


causal_only_backward.capabilities = {**_FULL, "backward": "causal_only"}


def same_seqlen(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False, *, window=None, causal_alignment="top_left"):
    """Nq == Nk only."""
    _outside(query.shape[2] != key.shape[2], f"Nq={query.shape[2]} != Nk={key.shape[2]}")
    return _exact(query, key, value, attn_mask, is_causal, scale, enable_gqa, window,
                  causal_alignment)


same_seqlen.capabilities = {**_FULL, "backward": True, "same_seqlen": True}


def causal_multiple(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                    scale=None, enable_gqa=False, *, window=None, causal_alignment="top_left"):
    """Causal: Nq, Nk multiples of 32; otherwise multiples of 8; both at most 96."""
    nq, nk = query.shape[2], key.shape[2]
    m = 32 if is_causal else 8
    _outside(nq % m != 0 or nk % m != 0 or max(nq, nk) > 96,
             f"Nq={nq}, Nk={nk} (is_causal={is_causal}) not multiples of {m} up to 96")
    return _exact(query, key, value, attn_mask, is_causal, scale, enable_gqa, window,
                  causal_alignment)


causal_multiple.capabilities = {**_FULL, "backward": True, "max_seqlen": 96,
                                "seq_multiple": {"causal": 32, "noncausal": 8}}


def even_head_dims(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                   scale=None, enable_gqa=False, *, window=None, causal_alignment="top_left"):
    """Declares even head dims through ``supports``; asserts it never sees an odd one."""
    _outside(query.shape[3] % 2 == 1, f"odd head dim {query.shape[3]}")
    return _exact(query, key, value, attn_mask, is_causal, scale, enable_gqa, window,
                  causal_alignment)


even_head_dims.capabilities = {
    **_FULL, "backward": True,
    "supports": lambda case: f"odd head dim {case.D}" if case.D % 2 else None}


def undeclared_even_n(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                      scale=None, enable_gqa=False, *, window=None, causal_alignment="top_left"):
    """Rejects odd Nq with a clear ValueError, declaring nothing about it: those cases are
    "not run: reason" and every dtype stays in the campaign."""
    if query.shape[2] % 2:
        raise ValueError(f"query: Nq must be even, got {query.shape[2]}")
    return _exact(query, key, value, attn_mask, is_causal, scale, enable_gqa, window,
                  causal_alignment)


undeclared_even_n.capabilities = dict(_FULL)

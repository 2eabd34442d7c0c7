"""The float64 oracle: exact-as-float64-allows scaled dot-product attention.

``attention_fp64`` implements docs/contracts.md §1 (SDPA signature plus the ``window`` and
``causal_alignment`` extensions) in float64 and is differentiable by autograd in float64.
It is the yardstick every kernel and the online model are compared against.

Memory: the scores are built one chunk of query rows at a time, so the extra memory is
O(chunk × Nk) per (batch, head) pair instead of O(Nq × Nk). Without autograd (no input
requires grad, or under ``torch.no_grad()``) each chunk is written into a preallocated
output and freed; with autograd, autograd keeps every chunk's intermediates alive for the
backward pass (that is the price of plain autograd and is accepted here).

Caveats: float64 is not exact. With scores of magnitude |s| the rounding of the scores
alone perturbs the softmax weights by about |s|·D·2^-53 relative, e.g. 2e-12 at |s| = 1e4;
the mpmath tests therefore use exactly representable scores for the large-logit cases.
GQA expands ``key``/``value`` to Hq heads (a copy of the inputs' size, not of the scores').
"""

from __future__ import annotations

import torch

from ._validate import Problem, check_attention_args
from .masks import combined_mask

# Scores per chunk: 2**24 float64 elements = 128 MiB per (chunk, Nk) tensor; the forward
# holds about four of them (scores, masked scores, exponentials, boolean mask), so about
# 0.6 GiB extra, whatever Nq is.
_CHUNK_ELEMS = 1 << 24


def _chunk_rows(p: Problem) -> int:
    return max(1, min(p.Nq, _CHUNK_ELEMS // (p.B * p.Hq * p.Nk)))


def _attend_rows(q, k, v, attn_mask, p: Problem, rows: tuple[int, int]):
    """Output and lse of query rows ``rows[0]:rows[1]``, all float64, autograd-friendly."""
    s = torch.matmul(q[:, :, rows[0]:rows[1]], k.transpose(-2, -1)) * p.scale
    allowed, bias = combined_mask(
        attn_mask, (p.B, p.Hq, p.Nq, p.Nk), is_causal=p.is_causal,
        causal_alignment=p.causal_alignment, window=p.window, rows=rows, device=q.device,
    )
    if bias is not None:
        s = s + bias.to(torch.float64)
    s = s.masked_fill(~allowed, -torch.inf)
    # The softmax is invariant to the shift, so the max is a constant for autograd.
    m = s.detach().amax(dim=-1, keepdim=True)
    m = torch.where(m == -torch.inf, torch.zeros_like(m), m)
    e = torch.exp(s - m)
    del s
    l = e.sum(dim=-1, keepdim=True)
    live = l > 0
    l_safe = torch.where(live, l, torch.ones_like(l))
    out = torch.matmul(e, v) / l_safe
    lse = torch.where(live, m + torch.log(l_safe), torch.full_like(l, -torch.inf))
    return out, lse.squeeze(-1)


def attention_fp64(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
    enable_gqa=False, *, window=None, causal_alignment="top_left", return_lse=False,
):
    """Scaled dot-product attention in float64 (contracts.md §1).

    Returns the float64 output (B, Hq, Nq, D), or ``(out, lse)`` with ``return_lse=True``:
    ``lse`` (B, Hq, Nq) is the natural-log log-sum-exp of the scaled, masked scores, -inf on
    fully-masked rows (whose output and gradients are 0). Raises ValueError on bad input and
    NotImplementedError for ``dropout_p != 0``.
    """
    p = check_attention_args(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window,
        causal_alignment,
    )
    q = query.to(torch.float64)
    k = key.to(torch.float64)
    v = value.to(torch.float64)
    if p.group > 1:
        k = k.repeat_interleave(p.group, dim=1)
        v = v.repeat_interleave(p.group, dim=1)
    chunk = _chunk_rows(p)
    starts = range(0, p.Nq, chunk)
    grad_inputs = [query, key, value] + ([attn_mask] if attn_mask is not None else [])
    if torch.is_grad_enabled() and any(t.requires_grad for t in grad_inputs):
        parts = [_attend_rows(q, k, v, attn_mask, p, (r, min(r + chunk, p.Nq))) for r in starts]
        out = torch.cat([o for o, _ in parts], dim=2)
        lse = torch.cat([s for _, s in parts], dim=2)
    else:
        out = torch.empty(p.B, p.Hq, p.Nq, p.D, dtype=torch.float64, device=q.device)
        lse = torch.empty(p.B, p.Hq, p.Nq, dtype=torch.float64, device=q.device)
        with torch.no_grad():
            for r in starts:
                stop = min(r + chunk, p.Nq)
                out[:, :, r:stop], lse[:, :, r:stop] = _attend_rows(
                    q, k, v, attn_mask, p, (r, stop)
                )
    return (out, lse) if return_lse else out

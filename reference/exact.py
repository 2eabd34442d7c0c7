"""The float64 oracle: exact-as-float64-allows scaled dot-product attention.

``attention_fp64`` implements docs/contracts.md §1 (SDPA signature plus the ``window`` and
``causal_alignment`` extensions) in float64. It is the yardstick every kernel and the
online model are compared against.

Gradients: ``attention_fp64`` is a ``torch.autograd.Function`` with a hand-written float64
backward (the exact gradient formulas, no tiling tricks):

    P = e^(S − m)/ℓ (recomputed per query chunk),  delta = rowsum(dO∘O),
    dV = Σ Pᵀ dO,  dP = dO Vᵀ,  dS = P∘(dP − delta + dlse),
    dQ = scale·dS K,  dK = scale·Σ dSᵀ Q,  d(attn_mask) = dS (summed over broadcast dims).

``dlse`` is the gradient reaching ``lse`` when ``return_lse=True`` (∂lse_i/∂s_ij = P_ij).
GQA sums dK/dV over the query heads of each kv head. Fully-masked rows have P = 0, so all
their gradients are exactly 0. The forward saves the row max m and row sum ℓ (lse = m +
log ℓ) rather than lse itself, so the recomputed P is bit-for-bit the forward's P: at
|scores| ~ 1e4, e^(S − lse) would be off by |lse|·2^-53 ≈ 1e-12 relative.

Memory: forward and backward both work one chunk of query rows at a time, so the extra
memory is O(chunk × Nk) per (batch, head) pair instead of O(Nq × Nk), with or without
autograd. Autograd keeps q, k, v, the output and two (B, Hq, Nq) row statistics, nothing
per chunk. A chunk holds at most ``_CHUNK_ELEMS`` = 2^24 scores.

Caveats: float64 is not exact. With scores of magnitude |s| the rounding of the scores
alone perturbs the softmax weights by about |s|·D·2^-53 relative, e.g. 2e-12 at |s| = 1e4;
the mpmath tests therefore use exactly representable scores for the large-logit cases.
GQA expands ``key``/``value`` to Hq heads (a copy of the inputs' size, not of the scores').
Double backward (``create_graph=True``) raises NotImplementedError.
"""

from __future__ import annotations

import torch

from ._validate import Problem, check_attention_args
from .masks import combined_mask

# Scores per chunk: 2**24 float64 elements = 128 MiB per (chunk, Nk) tensor. The forward
# holds the scores (exponentiated in place) and the boolean mask; the backward holds P,
# dP (turned into dS in place) and the mask: at most about 0.4 GiB extra, whatever Nq is.
_CHUNK_ELEMS = 1 << 24


def _chunk_rows(p: Problem) -> int:
    return max(1, min(p.Nq, _CHUNK_ELEMS // (p.B * p.Hq * p.Nk)))


def _chunks(p: Problem):
    step = _chunk_rows(p)
    return [(r, min(r + step, p.Nq)) for r in range(0, p.Nq, step)]


def _weights(q, k, attn_mask, p: Problem, rows: tuple[int, int], m=None, l=None):
    """Softmax weights e^(s − m)/ℓ of query rows ``rows``, with that chunk's m and ℓ.

    Builds the scaled, masked scores in float64 and exponentiates them in place. With
    ``m``/``l`` given (the backward), those are used instead of recomputing them, so the
    weights are the forward's bits. Dead rows (m = −inf or ℓ = 0) get P = 0.
    """
    s = torch.matmul(q[:, :, rows[0]:rows[1]], k.transpose(-2, -1))
    s.mul_(p.scale)
    allowed, bias = combined_mask(
        attn_mask, (p.B, p.Hq, p.Nq, p.Nk), is_causal=p.is_causal,
        causal_alignment=p.causal_alignment, window=p.window, rows=rows, device=q.device,
    )
    if bias is not None:
        s.add_(bias)
    s.masked_fill_(~allowed, -torch.inf)
    if m is None:
        m = s.amax(dim=-1)
    shift = torch.where(m == -torch.inf, torch.zeros_like(m), m)
    p_ = s.sub_(shift.unsqueeze(-1)).exp_()
    if l is None:
        l = p_.sum(dim=-1)
    live = l > 0
    p_.div_(torch.where(live, l, torch.ones_like(l)).unsqueeze(-1))
    return p_, m, l


def _forward(q, k, v, attn_mask, p: Problem):
    """Output (B, Hq, Nq, D), row max m and row sum ℓ (B, Hq, Nq); no autograd graph."""
    out = torch.empty(p.B, p.Hq, p.Nq, p.D, dtype=torch.float64, device=q.device)
    m = torch.empty(p.B, p.Hq, p.Nq, dtype=torch.float64, device=q.device)
    l = torch.empty_like(m)
    for rows in _chunks(p):
        rs = slice(rows[0], rows[1])
        pw, m[:, :, rs], l[:, :, rs] = _weights(q, k, attn_mask, p, rows)
        out[:, :, rs] = torch.matmul(pw, v)
    return out, m, l


def _lse(m, l):
    live = l > 0
    return torch.where(live, m + torch.log(torch.where(live, l, torch.ones_like(l))),
                       torch.full_like(l, -torch.inf))


def _mask4(shape) -> tuple[int, ...]:
    return (1,) * (4 - len(shape)) + tuple(shape)


def _reduce_to(g: torch.Tensor, shape4) -> torch.Tensor:
    """Sum a (B, Hq, rows, Nk) block down to a broadcastable mask's 4-d shape (keepdim)."""
    dims = tuple(i for i, s in enumerate(shape4) if s == 1 and g.shape[i] != 1)
    return g.sum(dim=dims, keepdim=True) if dims else g


def _backward(q, k, v, attn_mask, out, m, l, dout, dlse, p: Problem, want_dmask: bool):
    """dq, dk, dv (expanded to Hq heads) and the 4-d mask gradient, all float64."""
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    dmask = None
    if want_dmask:
        dmask = torch.zeros(_mask4(attn_mask.shape), dtype=torch.float64, device=q.device)
    if dout is None:
        dout = torch.zeros_like(out)
    # delta_i = rowsum(dO∘O) = Σ_j P_ij dP_ij; the lse gradient enters dS as + P·dlse.
    row_term = (dout * out).sum(dim=-1)
    if dlse is not None:
        row_term = row_term - dlse.to(torch.float64)
    for rows in _chunks(p):
        rs = slice(rows[0], rows[1])
        pw, _, _ = _weights(q, k, attn_mask, p, rows, m[:, :, rs], l[:, :, rs])
        do_c = dout[:, :, rs]
        dv.add_(torch.matmul(pw.transpose(-2, -1), do_c))
        ds = torch.matmul(do_c, v.transpose(-2, -1))
        ds.sub_(row_term[:, :, rs].unsqueeze(-1)).mul_(pw)
        del pw
        dq[:, :, rs] = torch.matmul(ds, k)
        dk.add_(torch.matmul(ds.transpose(-2, -1), q[:, :, rs]))
        if dmask is not None:
            g = _reduce_to(ds, dmask.shape)
            if dmask.shape[2] == 1:
                dmask.add_(g)
            else:
                dmask[:, :, rs] = g
    return dq.mul_(p.scale), dk.mul_(p.scale), dv, dmask


class _AttentionFp64(torch.autograd.Function):
    """float64 q, k, v (Hkv heads) and the mask in; out and lse out; exact backward."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, p):
        ke, ve = p.expand_kv(k), p.expand_kv(v)
        out, m, l = _forward(q, ke, ve, attn_mask, p)
        ctx.save_for_backward(q, k, v, attn_mask, out, m, l)
        ctx.problem = p
        ctx.set_materialize_grads(False)
        return out, _lse(m, l)

    @staticmethod
    def backward(ctx, dout, dlse):
        if torch.is_grad_enabled():
            raise NotImplementedError(
                "attention_fp64: double backward (create_graph=True) is not supported; "
                "only first derivatives are implemented"
            )
        q, k, v, attn_mask, out, m, l = ctx.saved_tensors
        p = ctx.problem
        want_dmask = bool(ctx.needs_input_grad[3])
        if dout is None and dlse is None:
            return None, None, None, None, None
        dq, dk, dv, dmask = _backward(
            q, p.expand_kv(k), p.expand_kv(v), attn_mask, out, m, l, dout, dlse, p,
            want_dmask,
        )
        if dmask is not None:
            dmask = dmask.reshape(attn_mask.shape).to(attn_mask.dtype)
        return dq, p.reduce_kv(dk), p.reduce_kv(dv), dmask, None


def attention_fp64(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
    enable_gqa=False, *, window=None, causal_alignment="top_left", return_lse=False,
):
    """Scaled dot-product attention in float64 (contracts.md §1).

    Returns the float64 output (B, Hq, Nq, D), or ``(out, lse)`` with ``return_lse=True``:
    ``lse`` (B, Hq, Nq) is the natural-log log-sum-exp of the scaled, masked scores, -inf on
    fully-masked rows (whose output and gradients are 0). Both are differentiable (first
    derivatives) with respect to query, key, value and a floating ``attn_mask``. Raises
    ValueError on bad input and NotImplementedError for ``dropout_p != 0``.
    """
    p = check_attention_args(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window,
        causal_alignment,
    )
    # The casts are autograd ops: gradients return to the inputs' dtypes.
    q, k, v = (t.to(torch.float64) for t in (query, key, value))
    grad_inputs = [query, key, value] + ([attn_mask] if attn_mask is not None else [])
    if torch.is_grad_enabled() and any(t.requires_grad for t in grad_inputs):
        out, lse = _AttentionFp64.apply(q, k, v, attn_mask, p)
    else:
        with torch.no_grad():
            out, m, l = _forward(q, p.expand_kv(k), p.expand_kv(v), attn_mask, p)
            lse = _lse(m, l)
    return (out, lse) if return_lse else out

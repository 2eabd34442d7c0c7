"""Frozen copy of reference/online.py before the family switches (commit 55acd5e).

Kept only so that tests/test_family.py can prove that ``online_attention`` with default
switches is bit-identical to the code path it replaced. Do not edit.

Original docstring follows.

A plain-torch model of blocked online-softmax attention (FlashAttention-1 and -2).

``online_attention`` runs the tiled algorithm a flash kernel runs, tile by tile, with the
SDPA-compatible contract of docs/contracts.md §1, so that it can be plugged in as a kernel:

- ``order="fa2"``: Q tiles outer, K/V tiles inner; running (m, ℓ) and an unnormalised
  accumulator per Q tile, one division at the end (FlashAttention-2 / Triton tutorial).
- ``order="fa1"``: K/V tiles outer, Q tiles inner; O, m and ℓ live in full-size tensors
  ("HBM") and are read, rescaled, renormalised and written back after every step, with the
  tile's own max and sum merged into the running ones (FlashAttention-1, Algorithm 1).
- The backward pass is a ``torch.autograd.Function`` running the blocked FlashAttention-2
  backward: recompute P = exp(S − lse), delta = rowsum(dO∘O), dV = PᵀdO,
  dS = P∘(dP − delta), dQ = scale·dS·K, dK = scale·dSᵀQ. K/V tiles are outer.

``precision="exact"`` computes everything in float64 (output float64).
``precision="emulate"`` mimics a real kernel: operands in the input dtype, scores and
accumulators in fp32 (fp64 for fp64 inputs), P rounded to the input dtype before P@V, the
output rounded to the input dtype; in the backward, P and dS are rounded to the input
dtype before the dV/dK/dQ products and the gradients are returned in the input dtype.
fp32 inputs are IEEE fp32 (no rounding of P; the fp32 matmul precision is forced to
"highest" during the call, so no TF32). Every matmul is an fp32 matmul of operands already
rounded to the input dtype, which is what tensor cores do with fp32 accumulation.

The (m, ℓ) recurrence is ``online_lse_step``; the tile updates ``tile_step_fa2`` and
``tile_step_fa1`` are the same recurrence applied to a block max and a block sum.
``emulate_error_bound`` is the a-priori bound on the emulated forward error.

Caveats: clarity over speed (Python loops over tiles, vectorised inside a tile); fully
masked tiles are not skipped (they change nothing numerically). GQA expands K/V to Hq
heads. An additive ``attn_mask`` gets a gradient (the dense dS, summed over broadcast
dims) only when it requires grad. The returned lse (``return_lse=True``) is not
differentiable. Double backward is not supported. Works on any device; computations run
where the tensors are.
"""

from __future__ import annotations

import contextlib
import math

import torch
from flashcheck.reference._validate import (
    ORDERS,
    PRECISIONS,
    Problem,
    check_attention_args,
    check_block,
    check_choice,
)
from flashcheck.reference.masks import combined_mask

# ---------------------------------------------------------------- the (m, ℓ) recurrence


def _rescale(m, x):
    """m' = max(m, x) with the factors α = e^(m−m'), β = e^(x−m'); −inf-safe.

    When both are −inf, m' = −inf and α = β = 0 (nothing seen yet, nothing added).
    Works on Python floats and, elementwise, on tensors.
    """
    if isinstance(m, torch.Tensor) or isinstance(x, torch.Tensor):
        like = m if isinstance(m, torch.Tensor) else x
        m, x = (torch.as_tensor(t, dtype=like.dtype, device=like.device) for t in (m, x))
        m_new = torch.maximum(m, x)
        shift = torch.where(m_new == -torch.inf, torch.zeros_like(m_new), m_new)
        return m_new, torch.exp(m - shift), torch.exp(x - shift)
    m_new = max(m, x)
    shift = 0.0 if m_new == -math.inf else m_new
    return m_new, math.exp(m - shift), math.exp(x - shift)


def online_lse_step(m, l, x):
    """One step of the streaming log-sum-exp: fold score ``x`` into the state (m, ℓ).

    m' = max(m, x);  ℓ' = ℓ·e^(m−m') + e^(x−m').  Invariant: m + log ℓ = log Σ e^x over the
    scores folded so far. Start from (−inf, 0). Both exponents are <= 0, so nothing
    overflows for any finite scores; −inf scores (masked) leave the state unchanged and an
    all −inf stream stays (−inf, 0) without NaN. Floats or tensors (elementwise).
    """
    m_new, alpha, beta = _rescale(m, x)
    return m_new, alpha * l + beta


def tile_step_fa2(m, l, s):
    """FlashAttention-2 tile update of (m, ℓ) with a tile of scores ``s`` (..., rows, cols).

    The recurrence of ``online_lse_step`` with x = the tile's row max and the tile's row sum
    taken in the new frame: m' = max(m, rowmax s), p = e^(s−m'), ℓ' = ℓ·e^(m−m') + rowsum p.
    Returns (m', ℓ', α = e^(m−m'), p).
    """
    m_new, alpha, _ = _rescale(m, s.amax(dim=-1))
    shift = torch.where(m_new == -torch.inf, torch.zeros_like(m_new), m_new)
    p = torch.exp(s - shift.unsqueeze(-1))
    return m_new, alpha * l + p.sum(dim=-1), alpha, p


def tile_step_fa1(m, l, s):
    """FlashAttention-1 tile update: the recurrence with the block max and block sum.

    m̃ = rowmax s, p̃ = e^(s−m̃), ℓ̃ = rowsum p̃; then m' = max(m, m̃) and
    ℓ' = ℓ·e^(m−m') + ℓ̃·e^(m̃−m') (``online_lse_step`` is the case ℓ̃ = 1).
    Returns (m', ℓ', α = e^(m−m'), β = e^(m̃−m'), p̃).
    """
    m_blk = s.amax(dim=-1)
    shift = torch.where(m_blk == -torch.inf, torch.zeros_like(m_blk), m_blk)
    p = torch.exp(s - shift.unsqueeze(-1))
    m_new, alpha, beta = _rescale(m, m_blk)
    return m_new, alpha * l + beta * p.sum(dim=-1), alpha, beta, p


# ---------------------------------------------------------------- precision plumbing


class _Arith:
    """Where each value lives: operand dtype (rounding) and accumulator dtype."""

    def __init__(self, dtype: torch.dtype, precision: str):
        if precision == "exact":
            self.operand = self.acc = torch.float64
        else:
            self.operand = dtype
            self.acc = torch.promote_types(dtype, torch.float32)

    def rnd(self, x: torch.Tensor) -> torch.Tensor:
        """Round an accumulator-dtype tensor to the operand dtype (kept in acc dtype)."""
        return x.to(self.operand).to(self.acc)

    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Product of operands already rounded to the operand dtype, accumulated in acc."""
        return torch.matmul(a, b)


@contextlib.contextmanager
def _ieee_fp32_matmul():
    """Force IEEE fp32 matmuls (no TF32 / bf16 passes) for the duration of the call."""
    prev = torch.get_float32_matmul_precision()
    if prev == "highest":
        yield
        return
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(prev)


def _scores(ar: _Arith, p: Problem, qi, kj, attn_mask, rows, cols):
    """Scaled, masked scores of one tile in the accumulator dtype."""
    s = ar.mm(qi, kj.transpose(-2, -1)) * p.scale
    allowed, bias = combined_mask(
        attn_mask, (p.B, p.Hq, p.Nq, p.Nk), is_causal=p.is_causal,
        causal_alignment=p.causal_alignment, window=p.window, rows=rows, cols=cols,
        device=qi.device,
    )
    if bias is not None:
        s = s + bias.to(ar.acc)
    return s.masked_fill(~allowed, -torch.inf)


def _tiles(n: int, block: int):
    return [(a, min(a + block, n)) for a in range(0, n, block)]


def _finish(acc_o, m, l):
    """O = acc/ℓ and lse = m + log ℓ, with 0 and −inf on rows that saw no key."""
    live = l > 0
    l_safe = torch.where(live, l, torch.ones_like(l))
    out = torch.where(live.unsqueeze(-1), acc_o / l_safe.unsqueeze(-1), torch.zeros_like(acc_o))
    lse = torch.where(live, m + torch.log(l_safe), torch.full_like(l, -torch.inf))
    return out, lse


# ---------------------------------------------------------------- forward passes


def _forward_fa2(ar, p, q, k, v, attn_mask, bm, bn):
    out = torch.empty(p.B, p.Hq, p.Nq, p.D, dtype=ar.acc, device=q.device)
    lse = torch.empty(p.B, p.Hq, p.Nq, dtype=ar.acc, device=q.device)
    for rows in _tiles(p.Nq, bm):
        qi = q[:, :, rows[0]:rows[1]]
        r = rows[1] - rows[0]
        m = torch.full((p.B, p.Hq, r), -torch.inf, dtype=ar.acc, device=q.device)
        l = torch.zeros_like(m)
        acc_o = torch.zeros(p.B, p.Hq, r, p.D, dtype=ar.acc, device=q.device)
        for cols in _tiles(p.Nk, bn):
            s = _scores(ar, p, qi, k[:, :, cols[0]:cols[1]], attn_mask, rows, cols)
            m, l, alpha, pt = tile_step_fa2(m, l, s)
            acc_o = acc_o * alpha.unsqueeze(-1) + ar.mm(ar.rnd(pt), v[:, :, cols[0]:cols[1]])
        out[:, :, rows[0]:rows[1]], lse[:, :, rows[0]:rows[1]] = _finish(acc_o, m, l)
    return out, lse


def _forward_fa1(ar, p, q, k, v, attn_mask, bm, bn):
    o_hbm = torch.zeros(p.B, p.Hq, p.Nq, p.D, dtype=ar.acc, device=q.device)
    m_hbm = torch.full((p.B, p.Hq, p.Nq), -torch.inf, dtype=ar.acc, device=q.device)
    l_hbm = torch.zeros_like(m_hbm)
    for cols in _tiles(p.Nk, bn):
        kj, vj = k[:, :, cols[0]:cols[1]], v[:, :, cols[0]:cols[1]]
        for rows in _tiles(p.Nq, bm):
            sl = slice(rows[0], rows[1])
            oi, mi, li = o_hbm[:, :, sl], m_hbm[:, :, sl], l_hbm[:, :, sl]
            s = _scores(ar, p, q[:, :, sl], kj, attn_mask, rows, cols)
            m_new, l_new, alpha, beta, pt = tile_step_fa1(mi, li, s)
            pv = ar.mm(ar.rnd(pt), vj)
            num = (li * alpha).unsqueeze(-1) * oi + beta.unsqueeze(-1) * pv
            live = (l_new > 0).unsqueeze(-1)
            l_safe = torch.where(l_new > 0, l_new, torch.ones_like(l_new)).unsqueeze(-1)
            o_hbm[:, :, sl] = torch.where(live, num / l_safe, torch.zeros_like(num))
            m_hbm[:, :, sl], l_hbm[:, :, sl] = m_new, l_new
    live = l_hbm > 0
    l_safe = torch.where(live, l_hbm, torch.ones_like(l_hbm))
    lse = torch.where(live, m_hbm + torch.log(l_safe), torch.full_like(l_hbm, -torch.inf))
    return o_hbm, lse


# ---------------------------------------------------------------- backward pass


def _backward_fa2(ar, p, q, k, v, attn_mask, out, lse, dout, bm, bn, want_dbias):
    """Blocked FlashAttention-2 backward; K/V tiles outer. Returns dq, dk, dv, dbias (acc)."""
    do = dout.to(ar.operand).to(ar.acc)
    delta = (do * out).sum(dim=-1)
    lse_shift = torch.where(lse == -torch.inf, torch.zeros_like(lse), lse)
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    dbias = (
        torch.zeros(p.B, p.Hq, p.Nq, p.Nk, dtype=ar.acc, device=q.device) if want_dbias else None
    )
    for cols in _tiles(p.Nk, bn):
        cs = slice(cols[0], cols[1])
        kj, vj = k[:, :, cs], v[:, :, cs]
        dk_j = torch.zeros_like(kj)
        dv_j = torch.zeros_like(vj)
        for rows in _tiles(p.Nq, bm):
            rs = slice(rows[0], rows[1])
            qi, do_i = q[:, :, rs], do[:, :, rs]
            s = _scores(ar, p, qi, kj, attn_mask, rows, cols)
            pt = torch.exp(s - lse_shift[:, :, rs].unsqueeze(-1))
            dv_j = dv_j + ar.mm(ar.rnd(pt).transpose(-2, -1), do_i)
            dp = ar.mm(do_i, vj.transpose(-2, -1))
            ds = pt * (dp - delta[:, :, rs].unsqueeze(-1))
            ds_r = ar.rnd(ds)
            dk_j = dk_j + ar.mm(ds_r.transpose(-2, -1), qi)
            dq[:, :, rs] += ar.mm(ds_r, kj)
            if dbias is not None:
                dbias[:, :, rs, cs] = ds
        dk[:, :, cs] = dk_j * p.scale
        dv[:, :, cs] = dv_j
    return dq * p.scale, dk, dv, dbias


# ---------------------------------------------------------------- a-priori error bound

_UNIT_ROUNDOFF = {
    torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24,
    torch.float64: 2.0**-53,
}
# Half the smallest subnormal: the absolute rounding error of a tiny P in the operand dtype.
_HALF_MIN_SUBNORMAL = {
    torch.float16: 2.0**-25, torch.bfloat16: 2.0**-134, torch.float32: 2.0**-150,
    torch.float64: 2.0**-1075,
}
# Smallest normal of the accumulator: below it exp() keeps no relative accuracy.
_MIN_NORMAL = {torch.float32: 2.0**-126, torch.float64: 2.0**-1022}
# exp() accuracy in units of u_a: CUDA expf is within 2 ulp (CUDA C Programming Guide,
# math function tables), i.e. 4 u_a relative; PyTorch's CPU exp is within 1 ulp.
_EXP_ULPS_AS_U = 4


def _as_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if dtype not in _UNIT_ROUNDOFF:
        raise ValueError(
            f"dtype: expected float16, bfloat16, float32 or float64 (torch dtype or name); "
            f"got {dtype!r}"
        )
    return dtype


def emulate_error_bound(
    dtype, *, D: int, N: int, score_abs_max: float, v_abs_max: float,
    bias_abs_max: float = 0.0,
) -> float:
    """A-priori bound on max |O_emulate − O_exact| of ``online_attention(precision="emulate")``.

    Valid for both loop orders, any block sizes, any masks, for inputs that are exactly
    representable in ``dtype`` (the exact output is that of the same inputs in float64).

    Arguments: ``D`` head dim; ``N`` keys per query row (Nk, or fewer allowed keys);
    ``score_abs_max`` = S = max over (i, j) of scale·Σ_d |q_id|·|k_jd| (the size of the
    scores' terms, not of the scores: by Cauchy-Schwarz S <= scale·max‖q_i‖·max‖k_j‖);
    ``v_abs_max`` = V = max |v|; ``bias_abs_max`` = Bb = max finite |attn_mask| (0 if none).

    Notation: u = unit roundoff of ``dtype`` (fp16 2^-11, bf16 2^-8, fp32 2^-24); u_a of the
    accumulator (fp32 2^-24; fp64 2^-53 for fp64 inputs); γ_n = n·u_a/(1 − n·u_a);
    u_P = u_o = u if ``dtype`` is narrower than the accumulator, else 0 (fp32 inputs: P
    and the output are not rounded again).

    1. Scores: a D-term fp32 dot product (products of fp16/bf16 operands are exact in
       fp32, fp32 products are not: γ_D covers both), times the fp32-rounded scale, plus the
       bias: |ŝ − s| <= E_s = γ_{D+3}·(S + Bb). A common shift cancels in the softmax, so
       each weight e^(s_j − c) is off by at most a factor e^(±E_s).
    2. Exponent: t = ŝ − m̂ is rounded (|t| <= T = 2(S + Bb + E_s), error u_a·T) and exp
       is within 4 u_a: weights carry the factor 1 + η, η = e^(E_s + u_a·T)·(1 + 4u_a) − 1.
       The rescale factors α = e^(m−m') (and β in FA1) multiply the numerator and ℓ
       alike, so their errors cancel in O = acc/ℓ.
    3. P rounded to ``dtype`` before P@V: relative u_P, plus an absolute 2^-25 (fp16;
       half the smallest subnormal) below the normal range; exp underflow below the
       accumulator's smallest normal λ (2^-126) loses at most λ per weight.
    4. Accumulation: the numerator Σ p̃_j v_jd and ℓ = Σ p̂_j are N-term fp32 sums with a
       rescale (and in FA1 a renormalisation: multiply, add, divide) per tile; at most
       5N roundings per element: relative γ_{5N+1} (numerator) and γ_{5N} (ℓ), measured
       against the sums of absolute terms.
    With A = (1 + η)(1 + u_P)(1 + γ_{5N+1}) − 1, Bd = (1 + η)(1 + γ_{5N}) − 1 and
    τ = N·e^(E_s)·(ε_P + 2λ), τ_d = N·e^(E_s)·λ (ℓ >= e^(−E_s) in the final frame;
    ε_P = half the smallest subnormal of ``dtype``), the weighted mean of values bounded
    by V is perturbed by at most

        o₁ = V·(A + Bd + τ) / (1 − Bd − τ_d),

    and the final division and output rounding add (u_a + u_o + u_a·u_o)·(V + o₁):

        bound = o₁ + (u_a + u_o + u_a·u_o)·(V + o₁).

    First order this is V·(u_P + u_o + 2E_s + u_a·T + 10N·u_a): for fp16, D = 128,
    N = 2048, S = 7, V = 4 it is 9.5e-3: 3.9e-3 from the two roundings to fp16, 4.9e-3
    from the worst-case accumulation allowance 10N·u_a (typical errors grow like √N).
    """
    dt = _as_dtype(dtype)
    acc = torch.promote_types(dt, torch.float32)
    u_a = _UNIT_ROUNDOFF[acc]
    u_p = _UNIT_ROUNDOFF[dt] if dt != acc else 0.0
    eps_p = _HALF_MIN_SUBNORMAL[dt] if dt != acc else 0.0
    lam = _MIN_NORMAL[acc]
    for name, val in (("D", D), ("N", N)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name}: expected an int >= 1; got {val!r}")
    for name, val in (
        ("score_abs_max", score_abs_max), ("v_abs_max", v_abs_max),
        ("bias_abs_max", bias_abs_max),
    ):
        if not (isinstance(val, (int, float)) and math.isfinite(val) and val >= 0):
            raise ValueError(f"{name}: expected a finite float >= 0; got {val!r}")

    def gamma(n: int) -> float:
        if n * u_a >= 1:
            return math.inf
        return n * u_a / (1 - n * u_a)

    e_s = gamma(D + 3) * (score_abs_max + bias_abs_max)
    t_max = 2 * (score_abs_max + bias_abs_max + e_s)
    eta = math.exp(e_s + u_a * t_max) * (1 + _EXP_ULPS_AS_U * u_a) - 1
    a = (1 + eta) * (1 + u_p) * (1 + gamma(5 * N + 1)) - 1
    bd = (1 + eta) * (1 + gamma(5 * N)) - 1
    tau = N * math.exp(e_s) * (eps_p + 2 * lam)
    tau_d = N * math.exp(e_s) * lam
    if bd + tau_d >= 1:
        return math.inf
    o1 = v_abs_max * (a + bd + tau) / (1 - bd - tau_d)
    return o1 + (u_a + u_p + u_a * u_p) * (v_abs_max + o1)


# ---------------------------------------------------------------- autograd glue


def _sum_to_shape(g: torch.Tensor, shape) -> torch.Tensor:
    """Sum a (B, Hq, Nq, Nk) gradient down to a broadcastable mask's shape."""
    lead = g.dim() - len(shape)
    g = g.sum(dim=tuple(range(lead))) if lead else g
    dims = tuple(i for i, s in enumerate(shape) if s == 1 and g.shape[i] != 1)
    return g.sum(dim=dims, keepdim=True) if dims else g


class _OnlineAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, attn_mask, p, ar, order, bm, bn):
        with _ieee_fp32_matmul():
            q = query.to(ar.operand).to(ar.acc)
            k = p.expand_kv(key.to(ar.operand).to(ar.acc))
            v = p.expand_kv(value.to(ar.operand).to(ar.acc))
            fwd = _forward_fa2 if order == "fa2" else _forward_fa1
            out, lse = fwd(ar, p, q, k, v, attn_mask, bm, bn)
        out = out.to(ar.operand)
        ctx.save_for_backward(query, key, value, attn_mask, out, lse)
        ctx.config = (p, ar, bm, bn)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        query, key, value, attn_mask, out, lse = ctx.saved_tensors
        p, ar, bm, bn = ctx.config
        want_dbias = bool(ctx.needs_input_grad[3])
        with _ieee_fp32_matmul():
            q = query.to(ar.operand).to(ar.acc)
            k = p.expand_kv(key.to(ar.operand).to(ar.acc))
            v = p.expand_kv(value.to(ar.operand).to(ar.acc))
            dq, dk, dv, dbias = _backward_fa2(
                ar, p, q, k, v, attn_mask, out.to(ar.acc), lse, dout, bm, bn, want_dbias
            )
        dk, dv = p.reduce_kv(dk), p.reduce_kv(dv)
        dmask = None
        if dbias is not None:
            dmask = _sum_to_shape(dbias, attn_mask.shape).to(attn_mask.dtype)
        return (
            dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), dmask,
            None, None, None, None, None,
        )


def online_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
    enable_gqa=False, *, block_m=64, block_n=64, order="fa2", precision="emulate",
    window=None, causal_alignment="top_left", return_lse=False,
):
    """Blocked online-softmax attention (contracts.md §1), FA2 or FA1 loop order.

    ``precision="exact"``: float64 throughout, float64 output. ``precision="emulate"``:
    the arithmetic of a real kernel (see the module docstring), output in the input dtype.
    ``return_lse=True`` also returns lse (B, Hq, Nq) in the accumulator dtype (not
    differentiable). Gradients come from the blocked FlashAttention-2 backward.
    """
    p = check_attention_args(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window,
        causal_alignment,
    )
    bm = check_block("block_m", block_m)
    bn = check_block("block_n", block_n)
    order = check_choice("order", order, ORDERS)
    precision = check_choice("precision", precision, PRECISIONS)
    ar = _Arith(query.dtype, precision)
    if precision == "exact":
        query, key, value = (t.to(torch.float64) for t in (query, key, value))
    out, lse = _OnlineAttention.apply(query, key, value, attn_mask, p, ar, order, bm, bn)
    return (out, lse) if return_lse else out

"""Tolerances and a-priori error bounds for one attention case (DESIGN §5, docs/bounds.md).

The tolerance applied to element i of a tensor T is

    tol_i = max(K_RULE[T] * baseline_err[T], floor_i)

- ``baseline_err[T]`` is the max abs error of the *emulated flash kernel*
  (``reference.online_attention(precision="emulate")``: input-dtype operands, fp32
  accumulation, P and dS rounded to the input dtype, output rounded) on the very same
  inputs. A correct flash kernel lands within a small factor of it (calibrated:
  docs/bounds.md). K_RULE (3.0) covers the scatter of the max abs error; the 3x guarantee
  is carried by the RMSE rule (K_RMS = 1.75 < 3 x 0.59), which applies to tensors with at
  least N_EFF_MIN effective independent errors (:func:`effective_samples`).
- ``floor_i`` covers cases where the baseline happens to be (nearly) exact, e.g. one key
  per row (Nk = 1): the true gradient is ~0 and results from a cancellation, so the floor
  scales with the size of the *terms that cancel*, not with the result (see
  :func:`error_model`).

Beside it :func:`error_model` computes a first-order a-priori bound per element
(fp32 accumulation, dot products of length D, Nk (Nq) terms in the softmax (dK/dV) sums,
P / dS / output rounded to the input dtype). It is reported as observed / bound so a
vacuous bound shows; it is not used to pass or fail unless there is no baseline.

Caveats:
- Below N_EFF_MIN effective errors (small tensors, constant rows, ties, mostly saturated
  large-logit rows) only the elementwise rule applies, so a 3x-worse kernel is not
  guaranteed to be flagged there (docs/bounds.md, "What the 3x guarantee covers").
- The a-priori bound is first order in u (terms in u^2 dropped) and assumes the kernel
  rounds no intermediate other than P, dS and the result to the input dtype; a kernel that
  keeps scores in fp16 (a naive attention) may exceed it while being "reasonable".
- Everything is computed densely in float64: memory is O(B * Hq * Nq * Nk) several times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
from flashcheck.verify.metrics import UNIT_ROUNDOFF, unit_roundoff

TENSORS = ("out", "lse", "dq", "dk", "dv")

# Two rules per tensor, both against the emulated baseline on the same inputs:
# - elementwise: err_i <= max(K_RULE[T] * max_abs(baseline), floor_i) catches a few bad
#   elements (a boundary tile, a masked row);
# - aggregate: rmse <= max(K_RMS[T] * rmse(baseline), rms(floor_acc) / sqrt(3)) catches a
#   kernel uniformly k times worse, applied only when the tensor has >= N_EFF_MIN effective
#   independent errors (effective_samples). The max abs of correct kernels scatters too much
#   (a tail statistic) to separate 3x from 1x by itself; the RMSE of many independent errors
#   is a mean and the ratio between correct kernels stays near 1.
# Calibrated on the CPU (docs/bounds.md, `python -m tests.test_bounds`): correct kernels
# (verify/controls, the emulate model with tiles 16/32/64 and FA1 order, the fixture) over
# drawn cases and a grid with fp32 D = 128, windows, -inf bias, outliers, large logits.
K_RULE = {"out": 3.0, "dq": 3.0, "dk": 3.0, "dv": 3.0}  # > max max-abs ratio 2.7 (+11%)
K_RMS = {"out": 1.75, "dq": 1.75, "dk": 1.75, "dv": 1.75}  # > max RMSE ratio 1.28 at n_eff>=128
# The RMSE of n iid errors has relative spread 1/sqrt(2n); the log-ratio of two such RMSEs
# 1/sqrt(n). A correct kernel sits up to R_sys = 1.28x the baseline systematically, so it
# stays below K_RMS with z = 3.5 standard deviations of headroom when
# n >= (z / ln(K_RMS / R_sys))^2 = (3.5 / 0.313)^2 = 125 -> 128.
N_EFF_MIN = 128
# Measured (docs/bounds.md; 144 cases, fp32 large-logit Triton gap excluded): max over
# correct kernels of the max-abs ratio above the floor (dk: the self-test's fp32 D = 128
# case), and [min over flash-class kernels, max over all correct kernels] of the RMSE
# ratio on tensors with n_eff >= N_EFF_MIN.
CALIBRATED_MAX_RATIO = {"out": 1.31, "dq": 2.07, "dk": 2.70, "dv": 1.87}
CALIBRATED_RMS_RATIO = {"out": (0.66, 1.02), "dq": (0.80, 1.06), "dk": (0.87, 1.14),
                        "dv": (0.68, 1.06)}

# Floor coefficient on the quadrature sum of the terms: each term of a sum (P_ij V_jd, or
# dS_ij K_jd) is rounded once to the input dtype (<= u relative) and feeds one fp32
# rescale/accumulate step whose error is of the same order for a single term, so one term
# carries <= 2u; independent roundings over j add in quadrature (sqrt of sum of squares).
FLOOR_C = 2.0
# The result itself is rounded once to the output dtype: + u |ref| (counted separately).
# The RMSE rule uses floor_acc (fp32's u): where the baseline is exact on every element
# (Nk = 1), a kernel that rounds P and the result like it differs only by fp32 accumulation;
# divided by sqrt(3), the standard deviation of a rounding error uniform on [-u, u].
RMS_FLOOR_DIVISOR = 3.0**0.5

U_ACC = UNIT_ROUNDOFF["float32"]  # fp32 accumulation (DESIGN §5)
# The RMSE rule compares a kernel with the baseline's RMSE, which presumes both share their
# dominant error: P and the result rounded to the input dtype, the same in any order. The
# order-dependent part (fp32 score dot products, accumulation) differs between correct
# kernels by up to R_ord = 3x in RMS (sequential sum ~ sqrt(D/2) against blocked or pairwise
# ~ sqrt(log2 D): sqrt(64) / sqrt(7) = 3.0 at D = 128). With that part at share s of the
# rest, a correct kernel reaches sqrt((1 + R_ord^2 s^2) / (1 + s^2)) of the baseline; that
# stays within K_RMS / R_sys = 1.37 (N_EFF_MIN's derivation) for s <= 1/3. Above it (fp32
# inputs with more than one key per row, and large logits in fp16/bf16) the RMSE rule is
# not applied.
ORDER_SHARE_MAX = 1.0 / 3.0

# Gradual underflow: rounding x to a dtype errs by <= max(u |x|, eta / 2), where eta is the
# spacing of that dtype's subnormals (its smallest positive value). Relative terms (u |x|)
# vanish for subnormal results, so every rounding to the input dtype also carries eta / 2
# absolute: the result's own rounding, and each rounded term (P_ij, dS_ij) of a sum.
SUBNORMAL_SPACING = {
    torch.float16: 2.0**-24,
    torch.bfloat16: 2.0**-133,
    torch.float32: 2.0**-149,
}
HALF_ETA_ACC = 0.5 * SUBNORMAL_SPACING[torch.float32]  # fp32 accumulators underflow as well
# GPU kernels evaluate exp2 and log2 with approximate instructions (tl.exp2 / tl.log2 lower to
# PTX ex2.approx.f32 / lg2.approx.f32 on NVIDIA GPUs): relative error up to 2^-22 = 4 u_acc.
# P_ij = exp2(s_ij - lse_i) then errs by U_APPROX (1 + ln l_i) relative (the exp, and the
# log of the row sum l_i in [1, n], whose error is relative to ln l_i). The lse part is
# shared by the whole row, and equal arguments give equal errors, so it is counted
# coherently (linearly). Measured: fp32, D = 1, tiny inputs (every P_ij = 1/78), dO = 1: our
# kernel's dv is 1.3e-6 (22 u_acc) off on every element on the H200, the CPU baseline 3e-7.
U_APPROX = 2.0**-22


def _gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u) for fp32 accumulation of n terms."""
    return n * U_ACC / (1.0 - n * U_ACC)


@dataclass
class TensorBound:
    """Per-element floor and a-priori bound (float64, the tensor's shape)."""

    floor: torch.Tensor
    apriori: torch.Tensor
    # The floor with fp32's u in place of the input dtype's: what kernels that round like
    # the baseline can still differ by (accumulation order); used by the RMSE rule.
    floor_acc: torch.Tensor
    # Independent rounding sources feeding the tensor (:func:`source_count`); the RMSE rule
    # needs many of them (:data:`N_EFF_MIN`).
    n_sources: float = math.inf
    # Typical order-dependent score rounding over the input dtype's u (:func:`order_share`);
    # above ORDER_SHARE_MAX the RMSE rule does not apply.
    order_share: float = 0.0


def _expand_kv(x: torch.Tensor, hq: int) -> torch.Tensor:
    g = hq // x.shape[1]
    return x.repeat_interleave(g, dim=1) if g > 1 else x


def _group_sum(x: torch.Tensor, hkv: int) -> torch.Tensor:
    b, hq = x.shape[:2]
    return x.reshape(b, hkv, hq // hkv, *x.shape[2:]).sum(2)


def _equal_run(a: torch.Tensor, b: torch.Tensor, ok: torch.Tensor, over: int):
    """The largest group of equal live addends a_ij b_jd of each sum, and one addend's size.

    ``over = -1``: out_id = sum_j a_ij b_jd (a over its last index, b over its rows);
    ``over = -2``: out_jd = sum_i a_ij b_id. Returns float64 (m, c), each the result's shape:
    m how many live addends share the most common nonzero value of a, where b is the same on
    every row of column d (0 elsewhere, and where no value repeats: conservative, fewer sums
    count), and c = |a b| of that value. Equal means within 1e-9 relative: float64 values of
    identical rows can differ in their last bits (a BLAS computes tail rows by another path),
    far below any fp32 rounding.
    The sort runs only where some column of b is constant (degenerate inputs)."""
    b_hi, b_lo = b.amax(-2, keepdim=True), b.amin(-2, keepdim=True)  # (..., 1, D)
    b_eq = (b_hi - b_lo) <= 1e-9 * torch.maximum(b_hi.abs(), b_lo.abs())
    x, live = (a, ok) if over == -1 else (a.transpose(-1, -2), ok.transpose(-1, -2))
    shape = torch.broadcast_shapes(x.shape[:-1] + (1,), b_eq.shape)
    if x.shape[-1] == 0 or not bool(b_eq.any()):
        zero = torch.zeros(shape, dtype=torch.float64, device=a.device)
        return zero, zero
    x = torch.where(live & (x != 0), x, torch.full_like(x, math.nan))  # zeros do not round
    s = torch.sort(x, -1).values  # NaN (dead) last
    eq = (s[..., 1:] - s[..., :-1]).abs() <= 1e-9 * torch.maximum(s[..., 1:].abs(),
                                                                  s[..., :-1].abs())
    brk = torch.cat([torch.ones_like(s[..., :1], dtype=torch.bool), ~eq], -1)
    idx = torch.arange(s.shape[-1], device=s.device).expand(s.shape)
    run = idx - torch.where(brk, idx, torch.zeros_like(idx)).cummax(-1).values + 1
    run = torch.where(torch.isnan(s), torch.zeros_like(run), run)  # length of the run ending here
    m, end = run.max(-1, keepdim=True)
    m = torch.where(m >= 2, m, torch.zeros_like(m))  # one copy is no group (quadrature terms)
    c = torch.where(m > 0, s.gather(-1, end).abs(), torch.zeros_like(s[..., :1]))
    return (m.to(torch.float64) * b_eq).expand(shape), (c * b_hi.abs()).expand(shape)


def _equal_run_error(m: torch.Tensor, c: torch.Tensor, sabs: torch.Tensor) -> torch.Tensor:
    """fp32 running-sum error from m equal addends of size c in a sum of absolute size sabs.

    Each addition errs by at most half the spacing of its result, <= u_acc |running sum|, and
    a running sum is at most sum |addends| less the copies still to come: the k-th copy from
    the end lands on at most sabs - (k - 1) c. Summed over the m copies:
    u_acc (m sabs - c m (m - 1) / 2); (m + 1) u_acc |sum| / 2 when every addend is a copy.
    Equal addends round alike, so these errors add coherently (linearly)."""
    return U_ACC * torch.clamp(m * sabs - c * m * (m - 1) / 2, min=0.0)


def _identical_rows(x: torch.Tensor) -> torch.Tensor:
    """(B, H, N) float64: how many rows of x (B, H, N, F) in the same (batch, head) equal
    each row (each row is tagged with its block, so one torch.unique serves all blocks)."""
    b, h, n, f = x.shape
    tag = torch.arange(b * h, device=x.device).repeat_interleave(n)
    rows = torch.cat([tag[:, None].to(torch.float64),
                      x.detach().reshape(-1, f).to(torch.float64)], dim=1)
    _, inverse, counts = torch.unique(rows, dim=0, return_inverse=True, return_counts=True)
    return counts[inverse].reshape(b, h, n).to(torch.float64)


def _row_multiplicity(rows: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """(B, Hq, Nq, 1): how many rows i of the same (batch, head) have the same (X_i, dO_i),
    X = ``rows`` (Q, or the stored O)."""
    return _identical_rows(torch.cat([rows.detach().to(torch.float64),
                                      grad_out.detach().to(torch.float64)], -1))[..., None]


def _rounding_flip_spacing(x: torch.Tensor, err: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dtype's spacing at x where x is within ``err`` of a rounding midpoint (a value
    computed with that error may round to either neighbour), else 0. float64 in and out."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return torch.zeros_like(x)
    fi = torch.finfo(dtype)
    _, e = torch.frexp(x)  # x = m 2^e, 0.5 <= |m| < 1
    spacing = torch.clamp(torch.ldexp(torch.ones_like(x), e - 1) * fi.eps,
                          min=fi.smallest_normal * fi.eps)
    to_mid = 0.5 * spacing - (x.to(dtype).to(torch.float64) - x).abs()
    return torch.where(torch.isfinite(x) & (to_mid <= err), spacing, torch.zeros_like(x))


def _key_multiplicity(key: torch.Tensor, hq: int) -> torch.Tensor:
    """(B, Hq, 1, Nk): how many keys of the same (batch, kv head) equal key j."""
    return _expand_kv(_identical_rows(key)[:, :, None, :], hq)


def _exact_softmax(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor,
                   bias: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, ...]:
    """float64 scores and softmax of q (B, Hq, Nq, D) against k expanded to Hq heads:
    (s, ok, m, e, denom, p): scores (-inf where masked), the live mask, the row max (0 for
    a dead row), e = exp(s - m) (0 where masked), its row sum and P = e / denom (0 on a
    dead row)."""
    s = scale * (q @ k.transpose(-1, -2))
    if bias is not None:
        s = s + bias.to(torch.float64)
    ok = allowed.expand(s.shape) & (s > -torch.inf)
    s = torch.where(ok, s, torch.full_like(s, -torch.inf))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.where(ok, torch.exp(s - m), torch.zeros_like(s))
    denom = e.sum(-1, keepdim=True)
    p = e / torch.where(denom > 0, denom, torch.ones_like(denom))
    return s, ok, m, e, denom, p


@dataclass(frozen=True)
class Exact:
    """The float64 operands of one case and their exact softmax, as :func:`error_model` and
    :func:`ftz_allowance` use them (:func:`exact_operands`).

    ``q`` (B, Hq, Nq, D); ``k``, ``v`` (B, Hq, Nk, D), each kv head repeated over its
    query-head group; ``do`` like ``q``, or None without a backward; ``softmax`` is
    :func:`_exact_softmax`'s (s, ok, m, e, denom, p), four of them (B, Hq, Nq, Nk).
    ``o`` = P·V and ``dp`` = dO·Vᵀ are computed on first use, once for every reader."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor | None
    softmax: tuple[torch.Tensor, ...]

    @cached_property
    def o(self) -> torch.Tensor:
        return self.softmax[5] @ self.v

    @cached_property
    def dp(self) -> torch.Tensor:
        return self.do @ self.v.transpose(-1, -2)


def exact_operands(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   grad_out: torch.Tensor | None, *, allowed: torch.Tensor,
                   bias: torch.Tensor | None, scale: float) -> Exact:
    """The operands converted to float64 (detached, on their own device, k and v expanded
    to Hq heads) and :func:`_exact_softmax` of them: what :func:`error_model` and
    :func:`ftz_allowance` both start from, so a caller running both computes it once and
    hands it to each as ``exact``. Arguments as :func:`error_model`'s; the result holds
    several (B, Hq, Nq, Nk) float64 tensors for as long as it is referenced."""
    f64 = torch.float64
    hq = query.shape[1]
    q = query.detach().to(f64)
    k = _expand_kv(key.detach().to(f64), hq)
    v = _expand_kv(value.detach().to(f64), hq)
    do = None if grad_out is None else grad_out.detach().to(f64)
    return Exact(q, k, v, do, _exact_softmax(q, k, allowed, bias, scale))


def _check_exact(exact: Exact, query: torch.Tensor, key: torch.Tensor,
                 grad_out: torch.Tensor | None) -> None:
    """Reject an ``exact`` whose shapes (or backward) do not match the operands."""
    want = (query.shape, (*key.shape[:1], query.shape[1], *key.shape[2:]))
    if (exact.q.shape, exact.k.shape) != want or (exact.do is None) != (grad_out is None):
        raise ValueError("exact does not match the operands: build it with exact_operands "
                         "from the same query, key, value and grad_out")


def error_model(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    grad_out: torch.Tensor | None,
    *,
    allowed: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    dtype: torch.dtype | str,
    tf32: bool = False,
    exact: Exact | None = None,
    fast_exp: float = 0.0,
) -> dict[str, TensorBound]:
    """Floors and a-priori bounds for out, lse and (with ``grad_out``) dq, dk, dv.

    ``query`` (B, Hq, Nq, D), ``key``/``value`` (B, Hkv, Nk, D), ``grad_out`` like query;
    ``allowed``: bool broadcastable to (B, Hq, Nq, Nk) (structure and bool mask combined);
    ``bias``: additive scores or None. ``dtype`` is the input dtype; ``tf32`` says fp32 dot
    products use TF32 operands. ``exact``: :func:`exact_operands` of these same arguments
    (built here when None). ``fast_exp``: the largest relative error of the forward's
    probabilities where the kernel declares a fast forward exp (the family's
    ``fwd_fast_exp``: ``reference.online.FAST_EXP_REL``), else 0.
    """
    if not (isinstance(scale, float) and scale > 0):
        raise ValueError(f"scale must be a finite float > 0, got {scale!r}")
    if not (isinstance(fast_exp, float) and 0.0 <= fast_exp < 2.0**-8):
        raise ValueError(f"fast_exp must be a float in [0, 2^-8), got {fast_exp!r}")
    u = unit_roundoff(dtype)  # rounding of P, dS and the result (input dtype)
    tdt = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
    half_eta = 0.5 * SUBNORMAL_SPACING.get(tdt, 0.0)  # absolute part of each rounding
    u_op = unit_roundoff(dtype, tf32=tf32) if tf32 else 0.0  # TF32 operand rounding
    f64 = torch.float64
    if exact is None:
        exact = exact_operands(query, key, value, grad_out, allowed=allowed, bias=bias,
                               scale=scale)
    else:
        _check_exact(exact, query, key, grad_out)
    q, k, v = exact.q, exact.k, exact.v
    hkv, hq = key.shape[1], query.shape[1]
    nq, nk, d = q.shape[2], k.shape[2], q.shape[3]

    s, ok, m, e, denom, p = exact.softmax
    lse = torch.where(denom > 0, m + torch.log(denom), torch.full_like(denom, -torch.inf))
    o = exact.o
    av, ak, aq = v.abs(), k.abs(), q.abs()
    eps_ap = U_APPROX * (1.0 + torch.log(torch.clamp(denom, min=1.0)))  # (see U_APPROX)
    n_src = source_count(s, d)

    # Scores: dot of length D (gamma_D), TF32 operand rounding (2 u_op), bias add (u_acc |S|).
    s_fin = torch.where(ok, s, torch.zeros_like(s))
    eps_s = scale * (_gamma(d) + 2 * u_op) * (aq @ ak.transpose(-1, -2)) + U_ACC * s_fin.abs()
    eps_s = torch.where(ok, eps_s, torch.zeros_like(eps_s))
    pe = (p * eps_s).sum(-1, keepdim=True)
    # P = exp(S - lse): dP/P = dS_ij - sum_k P_ik dS_ik, exp/rescale (4 u_acc), the row sum
    # l over Nk terms (gamma_Nk), then P rounded to the input dtype (u).
    eps_p = p * (eps_s + pe + _gamma(nk) + 4 * U_ACC) + u * p
    # Typical (not worst-case) score rounding, for the floor: a dot product of length D in
    # fp32 (or TF32 operands) rounds each of its D steps; with random signs these add in
    # quadrature, u_acc sqrt(D) ||q_i o k_j||_2. Kernels differ in that order (tiles, layouts,
    # BLAS kernels), so the floor must allow it. Through the softmax:
    # dP_ij = P_ij (ds_ij - sum_k P_ik ds_ik), taken in quadrature.
    u_dot = U_ACC + 2 * u_op
    es = FLOOR_C * u_dot * d**0.5 * scale * torch.sqrt((q * q) @ (k * k).transpose(-1, -2))
    es = torch.where(ok, es, torch.zeros_like(es))
    # fp32 accumulation over a row's n allowed keys is order-dependent too: typical
    # u_acc sqrt((n - 1) / 2) relative (one rounding per addition, random walk), which
    # matters against u only for fp32 inputs.
    n_keys = ok.sum(-1, keepdim=True).to(f64)  # allowed keys per row (also used below)
    n_live = n_keys[n_keys > 0]
    acc = U_ACC * float(torch.sqrt(torch.clamp(n_live - 1, min=0) / 2).mean()) / u if (
        n_live.numel()) else 0.0
    share = math.hypot(order_share(p, es / FLOOR_C, u), acc)
    # Identical keys get identical scores and so identical rounding errors (the same dot
    # product): those errors add coherently, not in quadrature. A key repeated m times adds
    # (sum over its copies)^2 <= m sum of squares (Cauchy-Schwarz), so each key's squared
    # term in a sum over keys is weighted by its multiplicity m_j (1 for distinct keys).
    # Tied fp32 keys (dist=ties(4), scale 3) put correct kernels' out at 1.3x without it.
    mult = _key_multiplicity(key, hq)
    pes2 = (mult * (p * es) ** 2).sum(-1, keepdim=True)  # the row's normaliser, squared
    dp_s = p * torch.sqrt(es * es + pes2)
    pv = p @ av
    bounds: dict[str, TensorBound] = {}
    apr_out = eps_p @ av + (_gamma(nk) + 2 * u_op) * pv + u * o.abs()
    floor_out = u * o.abs() + FLOOR_C * u * torch.sqrt((p * p) @ (av * av))
    # fp32 accumulation of the n_i allowed terms of a row: each addition rounds the running
    # sum (<= sum_j P_ij |V_jd|), independently: u_acc sqrt(n_i) (P|V|) in quadrature. It
    # matters in fp32 only (for fp16/bf16 it is < u), and only the elementwise floor gets it.
    n_rows = ok.sum(-2, keepdim=True).transpose(-1, -2).to(f64)
    floor_out = floor_out + U_ACC * torch.sqrt(n_keys) * pv
    floor_out_acc = U_ACC * o.abs() + FLOOR_C * U_ACC * torch.sqrt((p * p) @ (av * av))
    # Underflow: the result's rounding (eta/2) and each allowed P_ij rounded (eta/2 |V_jd|,
    # in quadrature over j). Every kernel that rounds to the dtype carries the first, so the
    # RMSE floor gets it too.
    okf = ok.to(f64)
    # The fp32 products and additions underflow too (eta_fp32 / 2 each): a sum of n terms
    # carries sqrt(2 n) such errors in quadrature (one per product, one per addition).
    floor_out = floor_out + torch.sqrt((mult * dp_s * dp_s) @ (v * v))
    uf_acc = FLOOR_C * HALF_ETA_ACC * torch.sqrt(2 * n_keys)
    sub_out = half_eta * (1.0 + FLOOR_C * torch.sqrt(okf @ (av * av))) + uf_acc
    floor_out = floor_out + eps_ap * pv  # approximate exp2/log2, coherent over the row
    # Equal addends (uniform P from tiny or constant inputs times a constant V) round
    # coherently: an fp32 running sum of n copies errs by up to 0.26 n u_acc relative
    # (measured, n <= 2048; (n + 1) u_acc / 2 is the worst case), far above the u_acc sqrt(n)
    # of varied addends. Our FA2 kernel and the blocked fixture hit 2.5-3.3x u_acc sqrt(n) on
    # such cases on the H200. A run of m copies among other addends counts as well (a sliding
    # window: the rows with a full window share P = 1/w): _equal_run_error.
    floor_out = floor_out + _equal_run_error(*_equal_run(p, v, ok, -1), pv)
    floor_out, floor_out_acc = floor_out + sub_out, floor_out_acc + half_eta + uf_acc
    bounds["out"] = TensorBound(floor_out, apr_out, floor_out_acc, n_src, share)
    lse_sq = lse.squeeze(-1)
    fin = torch.isfinite(lse_sq)
    apr_lse = pe.squeeze(-1) + _gamma(nk) + 2 * U_ACC + U_ACC * torch.where(
        fin, lse_sq.abs(), torch.zeros_like(lse_sq)
    )
    bounds["lse"] = TensorBound(apr_lse, apr_lse, apr_lse, n_src, share)
    if grad_out is None:
        return bounds

    # O as the kernel stores it, in the dtype: it can round to the other neighbour of O only
    # where O lies within the kernel's pre-rounding error (o_pre) of a rounding midpoint;
    # there it is one spacing off. Used for D_i below. The pre-rounding error: P's own
    # rounding to the dtype (0 where P is representable: a one-key row's P = 1 gives
    # O = V_j exactly in every kernel), the fp32 accumulation and the score rounding.
    half = tdt in (torch.float16, torch.bfloat16)
    p_res = torch.where(ok, (p.to(tdt).to(f64) - p).abs(), torch.zeros_like(p)) if half else (
        u * p)
    # The value a kernel rounds is its unnormalised p~_ij = exp(S_ij - m_i), whose exponent
    # carries the fp32 rounding of S_ij and of the row max m_i: relative u_acc (|S_ij| + |m_i|)
    # (with S = qk c - m as one fused multiply-add, the max key's exponent is the rounding
    # error of m = fl(max(qk) c): up to 4.9e-4 at logits of 1e4, not 0). Dividing by l
    # cancels it, but not its effect on p~'s rounding: where P is representable (a one-hot
    # row's P = 1) the kernel's p~ = 1 + delta rounds to 1 - 2^-11 or to 1. So up to
    # min(delta, u) P more residual. Found on the H200: our FA2 kernel, fp16 logits of 1e4,
    # dO tiny: O_i one spacing off V_j*, dq at 1.9x the floor.
    p_shift = torch.where(ok & half, p * torch.clamp(U_ACC * (s_fin.abs() + m.abs()), max=u),
                          torch.zeros_like(p))
    p_res = p_res + p_shift
    # Score rounding through P here without the independence shortcut of dp_s: dP_ij / P_ij
    # = ds_ij (1 - P_ij) - sum_{k != j} P_ik ds_ik, so a one-hot row's P moves by ~0 (dp_s
    # would give its full es and flag every O of a large-logit row).
    dp_x = p * torch.sqrt(torch.clamp(es * es * (1 - p) ** 2 + pes2 - (p * es) ** 2, min=0))
    o_pre = (FLOOR_C * torch.sqrt((p_res * p_res) @ (av * av))
             + U_ACC * torch.sqrt(n_keys) * pv + torch.sqrt((mult * dp_x * dp_x) @ (v * v)))
    if fast_exp:
        # A declared fast forward exp errs by up to fast_exp relative on each P_ij, a smooth
        # function of the score (not random signs): after the division by l that moves O_i
        # by up to fast_exp sum_j P_ij |V_jd - O_id| <= fast_exp sqrt(sum_j P_ij (V_jd -
        # O_id)^2) (Jensen, sum_j P_ij = 1): V's spread under the row's softmax. The
        # family's fwd_fast_exp members shift every P alike, which the division cancels, so
        # their O rounds as the exact one does; a real fast exp moves O by ~1e-4 relative,
        # and fp16's spacing of 2^-10 relative rounds some elements of O the other way,
        # each moving D_i by dO_id times a spacing (the fwd_fast_exp control, fp16 D 5,
        # dO = normal(100): dk 3.9x the members' error, 1.1x the rule without this term).
        o_pre = o_pre + fast_exp * torch.sqrt(torch.clamp(p @ (v * v) - o * o, min=0))
    o_flip = _rounding_flip_spacing(o, o_pre, tdt)

    do = exact.do
    ado = do.abs()
    dp = exact.dp
    drow = (do * o).sum(-1, keepdim=True)
    ds = p * (dp - drow)
    ads = ds.abs()

    eps_dp = (_gamma(d) + 2 * u_op) * (ado @ av.transpose(-1, -2))
    eps_drow = (ado * apr_out).sum(-1, keepdim=True) + _gamma(d) * (ado * o.abs()).sum(
        -1, keepdim=True
    )
    eps_ds = eps_p * (dp - drow).abs() + p * (eps_dp + eps_drow) + (u + U_ACC) * ads
    # The sums of |terms| of dq, dk, dv (before scale): each feeds the a-priori bound, the
    # fp32 accumulation term and the equal-addends term below.
    ads_ak, adst_aq, pt_ado = ads @ ak, ads.transpose(-1, -2) @ aq, p.transpose(-1, -2) @ ado
    dv_apr = eps_p.transpose(-1, -2) @ ado + (_gamma(nq) + u + 2 * u_op) * pt_ado
    # Identical query rows (and dO rows) give identical terms and errors in the sums over
    # rows (dk, dv): weighted by their multiplicity, as keys are in the sums over keys.
    rmult = _row_multiplicity(query, grad_out)
    dv_sq = (rmult * p * p).transpose(-1, -2) @ (ado * ado)
    dv_ref = p.transpose(-1, -2) @ do
    dv_eq = _equal_run(p, do, ok, -2)  # equal addends: see floor_out
    dq_apr = scale * (eps_ds @ ak + (_gamma(nk) + u + 2 * u_op) * ads_ak)
    # Floor terms: each dS_ij K_jd rounded (quadrature over j), plus the fp32 cancellation
    # in dP_ij - D_i: two dot products of length D whose fp32 roundings add in quadrature,
    # which is all a one-key row (Nk = 1, true gradient 0) leaves; again over j.
    # Each of the D additions rounds the running sum, whose size is that of the terms' 2-norm
    # (random signs), so the quadrature over the D steps is u_acc sqrt(D) ||x o y||_2.
    canc = p * U_ACC * d**0.5 * (torch.sqrt((do * do) @ (v * v).transpose(-1, -2))
                                 + torch.sqrt((do * do * o * o).sum(-1, keepdim=True)))
    # Equal terms in those dot products (a constant dO_i row against a constant V_j or O_i
    # row) round coherently, as equal addends do in out's sum over keys (floor_out): up to
    # (m + 1) u_acc |sum| / 2 for m copies, where the quadrature above allows u_acc |sum|;
    # and kernels differ in that order (a BLAS's layouts and lanes). fp32 constant_rows,
    # dO = 1, D 80, one key: the daz_bf16_gemms control (its products on copies of the
    # operands, another MKL path) had dk 3.9x the members' (seed 170039150).
    ones_d = torch.ones_like(do[..., :1, :]).transpose(-1, -2)  # (..., D, 1)
    full_d = torch.ones_like(do, dtype=torch.bool)
    m_dp, c_dp = _equal_run(do, v.transpose(-1, -2), full_d, -1)
    m_dr, c_dr = _equal_run(do * o, ones_d, full_d, -1)
    canc = canc + p * (_equal_run_error(m_dp, c_dp, ado @ av.transpose(-1, -2))
                       + _equal_run_error(m_dr, c_dr, (ado * o.abs()).sum(-1, keepdim=True)))
    dq_sq = (scale**2) * ((ds * ds) @ (ak * ak))
    dq_canc = scale * torch.sqrt((canc * canc) @ (ak * ak))
    dq_ref = scale * (ds @ k)
    dq_eq = _equal_run(ds, k, ok, -1)
    dk_apr = scale * (
        eps_ds.transpose(-1, -2) @ aq + (_gamma(nq) + u + 2 * u_op) * adst_aq
    )
    dk_sq = (scale**2) * ((rmult * ds * ds).transpose(-1, -2) @ (aq * aq))
    # The cancellation's roundings depend on dO_i, V_j and the stored O_i only (D_i comes
    # from the stored O), so rows with the same (O_i, dO_i) round it alike, and their errors
    # add coherently in dk: weighted by that multiplicity, and never below rmult (rows with
    # the same (Q_i, dO_i) under different masks store different O_i). fp32 dominant(20),
    # scale 0.01, dO = 1: 234 of 238 rows store the dominant V_j as O_i, and our kernel's dk
    # was 2.6x a floor that added them in quadrature, on the H200.
    cmult = torch.maximum(rmult, _row_multiplicity(o.to(tdt), grad_out))
    dk_canc = scale * torch.sqrt((cmult * canc * canc).transpose(-1, -2) @ (aq * aq))
    dk_ref = scale * (ds.transpose(-1, -2) @ q)
    dk_eq = _equal_run(ds, q, ok, -2)
    # fp32 accumulation over the keys (dq) or the query rows (dk, dv), as for out, per head.
    # One running sum over a whole GQA group's rows (a backward looping the group inside
    # the key tile) is the family's gqa_group_fp32 member; 3x the family covers it (fp32,
    # 3 x 78 rows summed one at a time, dO = 1: 0.55 of the tolerance), so no group term.
    n_acc = n_rows
    dq_acc = U_ACC * torch.sqrt(n_keys) * scale * ads_ak
    dk_acc = U_ACC * torch.sqrt(n_acc) * scale * adst_aq
    dv_acc = U_ACC * torch.sqrt(n_acc) * pt_ado
    # Score rounding through P (above) into dS = P (dP - D) and into dV = P^T dO.
    dds = dp_s * (dp - drow).abs()
    dq_acc = dq_acc + scale * torch.sqrt((mult * dds * dds) @ (k * k))
    # D_i = rowsum(dO_i o O_i) comes from the kernel's own O, so O's fp32 accumulation error
    # (typical u_acc sqrt(n_i) (P|V|)_id, independent over d) shifts the whole row of dS
    # (dS_ij = P_ij (dP_ij - D_i)) by -P_ij delta_i, delta_i = ||dO_i o that||_2. It moves
    # dq_i by scale delta_i |(P K)_i| (coherent over j) and dk_j by scale ||P_:j delta o Q||_2
    # (rows independent); it dominates where dS cancels and |P K| is large (fp32, D = 1: an
    # error of 6e-6 against a floor of 6e-6 without it). O's rounding to the dtype is not a
    # u|O| term everywhere: in a near one-hot row O is next to a representable V_j, every
    # kernel rounds it alike and its shift of D_i cancels against dS (such a term put the
    # floor 30x above our kernel's error, fp16 large logits). Only where the stored O may
    # round the other way does it count (o_flip, below).
    acc_o = U_ACC * torch.sqrt(n_keys) * pv
    delta = torch.sqrt(((do * acc_o) ** 2).sum(-1, keepdim=True))
    # Where O's stored value may round the other way (o_flip), D_i moves by dO_id times one
    # spacing, independently over d. It moves dq_i coherently over j, as above: an FA1-order
    # kernel (normalised accumulator) on fp16 normal(30), scale 0.5, was 2.2x the dq floor
    # without it. Elsewhere O is the rounding every kernel makes and shifts nothing (a
    # one-hot row's O is a representable V_j).
    # Equal elements of O_i (a constant row: constant V rows under the softmax) carry the
    # same pre-rounding error and round the same way together: their flips move D_i by
    # |sum_d dO_id o_flip_id| (coherent), not in quadrature. fwd_fast_exp control, fp16,
    # constant rows, two keys a row, D 64, dO = normal(1): dk 1.02x the rule (seed
    # 193673559) with the flips of a constant O row added in quadrature.
    flip = torch.sqrt(((do * o_flip) ** 2).sum(-1, keepdim=True))
    o_const = (o.amax(-1, keepdim=True) - o.amin(-1, keepdim=True)) == 0
    flip = torch.where(o_const, torch.maximum(flip, (do * o_flip).sum(-1, keepdim=True).abs()),
                       flip)
    delta = torch.sqrt(delta * delta + flip * flip)
    # p~'s extra residual (p_shift) scales O_i's share of V_j by one factor, so it moves D_i
    # by sum_j p_shift_ij dP_ij: coherent over d, in quadrature over j.
    delta_p = FLOOR_C * torch.sqrt(((p_shift * dp) ** 2).sum(-1, keepdim=True))
    delta = torch.sqrt(delta * delta + delta_p * delta_p)
    dq_acc = dq_acc + scale * delta * (p @ k).abs()
    # For dk the rows' shifts add in quadrature over i; the one-spacing part of delta counts
    # there too: a kernel that keeps P and dS in fp32 but takes D_i from its rounded O gets
    # no cancellation against a rounded P (bf16, D = 1, large logits: dk at 1.07x the floor
    # without it).
    dk_acc = dk_acc + scale * torch.sqrt((rmult * (p * delta) ** 2).transpose(-1, -2)
                                         @ (q * q))
    dk_acc = dk_acc + scale * torch.sqrt((rmult * dds * dds).transpose(-1, -2) @ (q * q))
    dv_acc = dv_acc + torch.sqrt((rmult * dp_s * dp_s).transpose(-1, -2) @ (do * do))
    # Approximate exp2/log2 (U_APPROX): P's relative error, coherent; dS_ij = P_ij (...)
    # carries it as a relative error of dS.
    dq_acc = dq_acc + scale * ((ads * eps_ap) @ ak)
    dk_acc = dk_acc + scale * ((ads * eps_ap).transpose(-1, -2) @ aq)
    dv_acc = dv_acc + (p * eps_ap).transpose(-1, -2) @ ado
    # Equal addends (see floor_out); dk and dv after the group sum, below.
    dq_acc = dq_acc + _equal_run_error(dq_eq[0], scale * dq_eq[1], scale * ads_ak)
    # Underflow of each rounded dS_ij (eta/2 |K_jd| or |Q_id|) and P_ij (eta/2 |dO_id|), in
    # quadrature over the summed index; the results' own eta/2 is added below.
    uf_dq = FLOOR_C * HALF_ETA_ACC * torch.sqrt(2 * (n_keys + d))
    uf_dk = FLOOR_C * HALF_ETA_ACC * torch.sqrt(2 * (n_rows + d))
    uf_dv = FLOOR_C * HALF_ETA_ACC * torch.sqrt(2 * n_rows)
    sub_dq = FLOOR_C * half_eta * scale * torch.sqrt(okf @ (ak * ak)) + uf_dq
    sub_dk = FLOOR_C * half_eta * scale * torch.sqrt(okf.transpose(-1, -2) @ (aq * aq)) + uf_dk
    sub_dv = FLOOR_C * half_eta * torch.sqrt(okf.transpose(-1, -2) @ (ado * ado)) + uf_dv
    dq_acc, dk_acc, dv_acc = dq_acc + sub_dq, dk_acc + sub_dk, dv_acc + sub_dv
    g = hq // hkv
    if g > 1:  # K/V gradients of a shared head sum over its query-head group
        dv_apr, dv_sq, dv_ref = (_group_sum(x, hkv) for x in (dv_apr, dv_sq, dv_ref))
        dk_apr, dk_sq, dk_ref, dk_canc, dk_acc, dv_acc = (
            _group_sum(x, hkv) for x in (dk_apr, dk_sq, dk_ref, dk_canc, dk_acc, dv_acc))
        dv_apr = dv_apr + _gamma(g) * dv_ref.abs()
        dk_apr = dk_apr + _gamma(g) * dk_ref.abs()
    if g > 1:  # as dk_acc and dv_acc above: summed over the query-head group
        uf_dk, uf_dv = _group_sum(uf_dk, hkv), _group_sum(uf_dv, hkv)
    # Equal addends in dk and dv: one running sum over the group's rows (see n_acc) may hold
    # every head's copies, so the group's counts add; the smallest copy is the conservative c.
    eq_err = {}
    for name, (m, c), sabs, cs in (("dk", dk_eq, scale * adst_aq, scale),
                                   ("dv", dv_eq, pt_ado, 1.0)):
        c = cs * c
        if g > 1:
            m, sabs = _group_sum(m, hkv), _group_sum(sabs, hkv)
            c = c.reshape(c.shape[0], hkv, g, *c.shape[2:]).amin(2)
        eq_err[name] = _equal_run_error(m, c, sabs)
    dk_acc, dv_acc = dk_acc + eq_err["dk"], dv_acc + eq_err["dv"]
    for name, ref, sq, apr, canc, acc, uf in (
        ("dq", dq_ref, dq_sq, dq_apr, dq_canc, dq_acc, uf_dq),
        ("dk", dk_ref, dk_sq, dk_apr, dk_canc, dk_acc, uf_dk),
        ("dv", dv_ref, dv_sq, dv_apr, None, dv_acc, uf_dv),
    ):
        floor = u * ref.abs() + FLOOR_C * u * torch.sqrt(sq) + acc + half_eta
        floor_acc = U_ACC * ref.abs() + FLOOR_C * U_ACC * torch.sqrt(sq) + half_eta + uf
        if canc is not None:
            floor, floor_acc = floor + FLOOR_C * canc, floor_acc + FLOOR_C * canc
        bounds[name] = TensorBound(floor, apr, floor_acc, n_src, share)
    return bounds


# Flush-to-zero arithmetic drops every value below the smallest normal number of the format
# it is held in: each product entering an fp32 accumulator, and, where a kernel stores
# per-head dK/dV in the input dtype before summing a GQA group, each per-head partial.
# Dropping a term moves a sum by less than that smallest normal, so a kernel flushing any
# subset of them is within n_i * tiny(fp32) (+ g * tiny(input dtype) for dK/dV under GQA) of
# one that flushes none; n_i is the number of terms of element i's sum. Negligible except for
# results near the underflow threshold, where it is what FTZ kernels do (cuDNN bf16 dq,
# dO = tiny: 0 for an exact -2.5e-38 on the H200; a per-head-flushing GQA control: 0 for
# 1.27e-38 on fp32 dk).
TINY_ACC = torch.finfo(torch.float32).tiny


def ftz_allowance(allowed: torch.Tensor, bias: torch.Tensor | None, shape: tuple,
                  hkv: int, dtype: torch.dtype, operands: tuple | None = None, *,
                  exact: Exact | None = None) -> dict[str, torch.Tensor]:
    """Per tensor, broadcastable to it: the largest change flushing can make (above).
    ``shape`` is (B, Hq, Nq, Nk); ``allowed`` and ``bias`` broadcast to it.

    ``operands`` = (query, key, value, grad_out or None, scale): where the input dtype's
    smallest normal is fp32's (bf16, fp32), a flushed *operand* of a product is covered too:
    P_ij or dS_ij below tiny, dropped, moves element (i, d) of P@V, dS@K·scale, dSᵀQ·scale,
    PᵀdO by less than tiny·|V_jd| (|K_jd|·scale, |Q_id|·scale, |dO_id|), summed over the
    live terms. The product itself need not underflow (bf16 dO = tiny, scale 3.6: dk 0
    where the exact value is 1.4e-37, 12 smallest normals, each dS_ij flushed; the member's
    own flushing kept dS just above the threshold there). fp16's smallest normal is 6.1e-5,
    so that blanket (tiny times every live term) would cover every small fp16 gradient;
    there the flushed backward operands are bounded by the exact ones that can flush
    (:func:`_operand_flush_fp16`). With ``operands``, whatever the dtype, the forward's
    flushed P and what they move in the backward through D_i = rowsum(dO·O)
    (:func:`_forward_flush`). ``exact``, with
    ``operands`` only: :func:`exact_operands` of them (with ``allowed``, ``bias`` and their
    scale), whose float64 operands and softmax then serve here (built here when None)."""
    b, hq, nq, nk = shape
    live = allowed if bias is None else allowed & (bias > -math.inf)
    live = live.expand(b, hq, nq, nk)
    n_keys = live.sum(-1, keepdim=True).to(torch.float64)  # (B, Hq, Nq, 1)
    n_rows = _group_sum(live.sum(-2).to(torch.float64), hkv)[..., None]  # (B, Hkv, Nk, 1)
    # Per-head partials only where the input dtype's smallest normal is fp32's (bf16, fp32):
    # fp16's is 6.1e-5, and g of those on every dK/dV element would blanket fp16 GQA cases
    # with small gradients (dO ~ 1e-3) whether or not any partial is near the threshold.
    tiny_in = torch.finfo(dtype).tiny
    per_head = (hq // hkv) * tiny_in if hq != hkv and tiny_in <= TINY_ACC else 0.0
    rows = n_rows * TINY_ACC + per_head
    allow = {"out": n_keys * TINY_ACC, "dq": n_keys * TINY_ACC, "dk": rows, "dv": rows}
    if operands is None:
        if exact is not None:
            raise ValueError("exact needs the operands it was built from")
        return allow
    if exact is None:
        exact = exact_operands(*operands[:4], allowed=allowed, bias=bias, scale=operands[4])
    else:
        _check_exact(exact, operands[0], operands[1], operands[3])
    if tiny_in <= TINY_ACC:
        q, _, _, do, scale = operands
        w = live.to(torch.float64)
        k, v, aq = exact.k.abs(), exact.v.abs(), exact.q.abs()
        allow["out"] = allow["out"] + tiny_in * (w @ v)
        allow["dq"] = allow["dq"] + tiny_in * scale * (w @ k)
        allow["dk"] = allow["dk"] + _group_sum(tiny_in * scale * (w.transpose(-1, -2) @ aq),
                                               hkv)
        if do is not None:
            ado = exact.do.abs()
            allow["dv"] = allow["dv"] + _group_sum(tiny_in * (w.transpose(-1, -2) @ ado), hkv)
            # Products flushed inside the intermediate sums dP_ij = dO_i·V_j and D_i = dO_i·O_i
            # (|O_id| <= max_j |V_jd|, O being a convex combination of V's rows): each sum
            # moves by less than min(sum_d |a_d b_d|, D·tiny), and dS_ij = P_ij (dP_ij − D_i)
            # by P_ij times both; through dq = scale·dS@K and dk = scale·dSᵀQ (P <= 1, and
            # sum_j P_ij = 1 for D_i's share of dq). A kernel may flush in one of the two
            # sums and not the other, so they need not cancel (bf16 dO = tiny, D 40: dq
            # −4.5e-38 where the exact value is −6.3e-39, D_i's products flushed, dP's not).
            d_cap = q.shape[-1] * TINY_ACC
            d_p = torch.clamp(ado @ v.transpose(-1, -2), max=d_cap) * w
            vmax = v.amax(-2, keepdim=True)
            d_d = torch.clamp((ado * vmax).sum(-1, keepdim=True), max=d_cap)
            # An input read as zero (DAZ) in one of the two sums and not the other: bf16 dot
            # products on AVX512-BF16 (VDPBF16PS) read subnormal inputs as zero, and a CPU
            # kernel whose dP = dO·Vᵀ runs there while D_i is formed elementwise drops each
            # subnormal dO_id from dP alone, with a product that need not be small (PyTorch's
            # CPU flash backward, bf16, one key, dO = 9.5e-39, V = 11.75: dq −2.2e-36 where
            # the exact value is 0). Each sum moves by at most the subnormal entries' share:
            # Σ_d [|dO_id| < tiny] |dO_id| |V_jd| (|O_id| <= max_j |V_jd| for D_i).
            sub = torch.where(ado < tiny_in, ado, torch.zeros_like(ado))
            d_p = d_p + (sub @ v.transpose(-1, -2)) * w
            d_d = d_d + (sub * vmax).sum(-1, keepdim=True)
            kmax = k.amax(-2, keepdim=True)
            allow["dq"] = allow["dq"] + scale * (d_p @ k + d_d * kmax)
            allow["dk"] = allow["dk"] + _group_sum(
                scale * ((d_p + d_d * w).transpose(-1, -2) @ aq), hkv)
    for name, extra in _forward_flush(hkv, tiny_in, operands, exact).items():
        allow[name] = allow[name] + extra
    if tiny_in > TINY_ACC and operands[3] is not None:
        for name, extra in _operand_flush_fp16(hkv, tiny_in, operands[4], exact).items():
            allow[name] = allow[name] + extra
    return allow


# fp16 backward operands flushed: P_ij (read again as the operand of PᵀdO) and dS_ij (of
# dS@K and dSᵀQ) are rounded to fp16, and a kernel that flushes drops those below its smallest
# normal, 6.1e-5. Which ones depends on the kernel's own rounding near the threshold (the
# flush_to_zero control, 16-key tiles, and the ftz member, one 128-key tile, flush different
# dS_ij), so the bound takes every term whose exact value is below 2·tiny (2: a kernel's
# operand within a factor 2 of the exact one near the threshold) and drops it at its own
# size: dq_i moves by at most scale·Σ_j |dS_ij| |K_j| over those terms, dk_j by
# scale·Σ_i |dS_ij| |Q_i|, dv_j by Σ_i P_ij |dO_i|. Zero where no operand is that small; at
# most the gradient's own share from those terms (fp16, D 1, window, q and k normal(0.1):
# dq 2.38e-4 where the exact value is 2.47e-4, the control's flushed dS; this bound covers it,
# the ftz member's error did not: 3.4e-6 against 8.8e-6).
def _operand_flush_fp16(hkv: int, tiny: float, scale: float, exact: Exact
                        ) -> dict[str, torch.Tensor]:
    """The fp16 backward operands' share of :func:`ftz_allowance` (above): dq, dk, dv, from
    ``exact`` (:func:`exact_operands` of the case, with dO)."""
    q, k, do64 = exact.q, exact.k, exact.do
    _, ok, _, _, _, p = exact.softmax
    drow = (do64 * exact.o).sum(-1, keepdim=True)
    ds = (p * (exact.dp - drow)).abs()
    ds = torch.where(ok & (ds < 2 * tiny), ds, torch.zeros_like(ds))
    pf = torch.where(ok & (p < 2 * tiny), p, torch.zeros_like(p))
    return {"dq": scale * (ds @ k.abs()),
            "dk": _group_sum(scale * (ds.transpose(-1, -2) @ q.abs()), hkv),
            "dv": _group_sum(pf.transpose(-1, -2) @ do64.abs(), hkv)}


# A kernel flushing the forward's unnormalised p_ij = exp(s_ij − m) as it converts it to the
# input dtype for P@V drops the terms below that dtype's smallest normal. Which ones depends
# on the tile order: m is the running max when key tile j is processed, so a tile seen
# before the row's largest score keeps its terms (the flush_to_zero control, 16-key tiles:
# the keys before a dominant one kept, those after it dropped; the ftz member, one 128-key
# tile: all dropped). As the running max is at most the row's max m_i, a dropped term has
# e_ij = exp(s_ij − m_i) below the threshold too: the kernel drops some subset S_i of
# F_i = {j : e_ij < 2·tiny} (2: a kernel's p within a factor 2 of the exact one near the
# threshold). With the row sum l taken from the fp32 p before the conversion (FlashAttention-2
# CUDA, Triton kernels), O_i moves by −Σ_S P_ij V_j and D_i = dO_i·O_i by −Σ_S P_ij dP_ij: at
# most the larger of the positive and the negative parts of those sums over F_i. The backward
# recomputes P from the lse, so every dS_ij = P_ij (dP_ij − D_i) moves by −P_ij ΔD_i: dq_i by
# exactly −scale·ΔD_i·(P@K)_i, dk_j by at most scale·Σ_i P_ij |ΔD_i| |Q_i|. Negligible where
# the threshold is fp32's (e_ij < 2.4e-38); on fp16 a row of n keys can lose up to n·6.1e-5 of
# its mass (fp16, 59 causal keys, one of norm 607: dq 0 where the exact value is 0.0194 and
# the ftz member's error is 0.0019; this bound 0.0278).
def _forward_flush(hkv: int, tiny: float, operands: tuple, exact: Exact
                   ) -> dict[str, torch.Tensor]:
    """The forward flush's share of :func:`ftz_allowance` (above): out, and with dO, dq
    and dk. ``exact``: :func:`exact_operands` of ``operands``."""
    _, _, _, do, scale = operands
    q, k, v = exact.q, exact.k, exact.v
    _, ok, _, e, _, p = exact.softmax
    pf = torch.where(ok & (e < 2 * tiny), p, torch.zeros_like(p))
    # The worst subset of F_i: all of a sum's positive terms, or all of its negative ones.
    extra = {"out": torch.maximum(pf @ v.clamp(min=0), pf @ (-v).clamp(min=0))}
    if do is not None:
        x = pf * exact.dp
        d_delta = torch.maximum(x.clamp(min=0).sum(-1, keepdim=True),
                                (-x).clamp(min=0).sum(-1, keepdim=True))
        extra["dq"] = scale * d_delta * (p @ k).abs()
        extra["dk"] = _group_sum(scale * ((p * d_delta).transpose(-1, -2) @ q.abs()), hkv)
    return extra


def tolerance(
    name: str, floor: torch.Tensor, baseline_err: float | None, apriori: torch.Tensor,
    flush_err: torch.Tensor | None = None,
) -> torch.Tensor:
    """Elementwise tolerance: max(K_RULE * family_err, floor, K_RULE * flush_err_i);
    ``family_err`` is the worst max abs error of the family's members, ``flush_err`` the
    flush-to-zero member's own error on the elements its flushing changed (0 elsewhere).
    Without a family (or for lse, which the members do not expose) the a-priori bound is
    the rule."""
    if name not in TENSORS:
        raise ValueError(f"name must be one of {TENSORS}, got {name!r}")
    if baseline_err is None or name not in K_RULE:
        return torch.maximum(floor, apriori)
    tol = torch.clamp(floor, min=K_RULE[name] * baseline_err)
    if flush_err is not None:
        tol = torch.maximum(tol, K_RULE[name] * flush_err.to(tol.device))
    return tol


def order_share(p: torch.Tensor, es_typ: torch.Tensor, u: float) -> float:
    """How much of a case's error depends on the order of summation: the P-weighted RMS of
    the typical relative score rounding ``es_typ`` (one fp32 dot product of length D, the
    random-walk model above, without FLOOR_C), over the input dtype's unit roundoff ``u``
    (the rounding of P and of the result, which every kernel does the same way)."""
    w = p.sum()
    if not float(w) > 0:
        return 0.0
    return float(torch.sqrt((p * es_typ * es_typ).sum() / w)) / u


def rms_tolerance(name: str, floor_acc: torch.Tensor, baseline_rmse: float | None,
                  apriori: torch.Tensor, n_eff: float = math.inf,
                  share: float = 0.0) -> float:
    """Tolerance on the RMSE: max(K_RMS * baseline rmse, rms(floor_acc) / sqrt(3)); without
    a baseline (or for lse) rms of the a-priori bound. With fewer than :data:`N_EFF_MIN`
    effective samples (:func:`effective_samples`) the RMSE is not a statistic and the rule
    does not apply: the tolerance is +inf (the elementwise rule still does). The same holds
    when the order-dependent share of the error exceeds :data:`ORDER_SHARE_MAX`."""
    if name not in TENSORS:
        raise ValueError(f"name must be one of {TENSORS}, got {name!r}")

    def rms(x: torch.Tensor) -> float:
        return float(torch.sqrt((x * x).mean())) if x.numel() else 0.0

    if baseline_rmse is None or name not in K_RMS:
        return rms(torch.maximum(floor_acc, apriori))
    if not n_eff >= N_EFF_MIN or share > ORDER_SHARE_MAX:
        return math.inf
    return max(K_RMS[name] * baseline_rmse, rms(floor_acc) / RMS_FLOOR_DIVISOR)


def source_count(scores: torch.Tensor, head_dim: int) -> float:
    """Independent rounding sources behind a case's errors (an upper estimate):
    sum over (batch, head) of (distinct live query rows) x min(head_dim, mean allowed keys
    of those rows).

    ``scores`` (B, H, Nq, Nk) float64, -inf where a key is not allowed. The error of row i
    of out (of dq) is e_i = dP_i @ V (dS_i @ K) plus smaller per-element terms: a
    combination of the row's roundings of P_ij (dS_ij) over its allowed keys j, which spans
    at most min(keys, D) independent directions of the D outputs; the row statistics (max,
    sum, D_i) are single roundings shared by the whole row. Query rows with identical
    scores (constant rows, tied queries) round identically, so they count once. dK and dV
    redistribute the same roundings over the keys, so one count serves every tensor.
    """
    b, h, nq, nk = scores.shape
    if scores.numel() == 0:
        return 0.0
    # All (batch, head) blocks in one torch.unique: each row is tagged with its block, so
    # identical rows merge only within a block (one sort and one sync, not one per block).
    flat = scores.reshape(b * h * nq, nk)
    tag = torch.arange(b * h, device=scores.device, dtype=scores.dtype).repeat_interleave(nq)
    live = torch.isfinite(flat).any(-1)
    rows = torch.cat([tag[:, None], flat], 1)[live]
    if rows.shape[0] == 0:
        return 0.0
    uniq = torch.unique(rows, dim=0)  # -inf entries compare equal: masks are kept apart
    block = uniq[:, 0].to(torch.long)
    count = torch.bincount(block, minlength=b * h).to(torch.float64)
    keys = torch.bincount(block, weights=torch.isfinite(uniq[:, 1:]).sum(-1).to(torch.float64),
                          minlength=b * h)
    mean_keys = keys / torch.clamp(count, min=1)
    return float((count * torch.clamp(mean_keys, max=float(head_dim))).sum())


def effective_samples(baseline_err: torch.Tensor, n_sources: float) -> float:
    """Effective number of independent errors behind an RMSE: min(n_values, n_sources,
    n_rows) (n_rows: :func:`_row_directions`, for (B, H, N, D) tensors).

    ``n_values`` counts the *distinct* values of the baseline's |error| (identical errors are
    one sample, not many), discounted for heavy tails: for m values with kurtosis
    k = m sum(e^4) / sum(e^2)^2 the mean of e^2 has relative variance (k - 1) / m, which is
    2 / n for n Gaussian errors, so n_values = m * min(1, 2 / (k - 1)) (a few large errors
    carrying the RMSE count as few samples). ``n_sources`` is :func:`source_count`.
    """
    e = torch.unique(baseline_err.detach().to(torch.float64).abs().flatten())
    e = e[torch.isfinite(e) & (e > 0)]
    n_values = _tail_discounted(e * e)
    if n_values == 0 or baseline_err.dim() != 4:
        return min(n_values, n_sources)
    return min(n_values, n_sources, _row_directions(baseline_err))


def _tail_discounted(e2: torch.Tensor) -> float:
    """m * min(1, 2 / (k - 1)) for m squared errors of kurtosis k = m sum(e2^2) / sum(e2)^2
    (``effective_samples``); 0 for none."""
    m = e2.numel()
    if m == 0:
        return 0.0
    kurt = float(m * (e2 * e2).sum() / (e2.sum() ** 2))
    return m * min(1.0, 2.0 / (kurt - 1.0)) if kurt > 1.0 else float(m)


def _row_directions(err: torch.Tensor) -> float:
    """Independent errors behind a (B, H, N, D) error tensor counted by its distinct rows
    (identical rows are one sample): the rows'
    energies (sum over d of e^2) as tail-discounted samples, times the directions they take:
    the participation ratio (sum lambda)^2 / sum lambda^2 of the eigenvalues of the D x D
    Gram matrix E^T E, corrected for the row count, so that independent Gaussian errors
    give D directions (their element count in all) and errors in k directions k. Errors
    e_jd = u_j w_d (one rounding per row j carried along a fixed vector w: dK_j = sum_i
    dS_ij Q_i when every query row is the same Q) give one per row, however many distinct
    values they take (sdpa-efficient on the H200, bf16 constant_rows, dk: 56% of the
    baseline's squared error in one key row, 96% of the kernel's; 92 samples where the
    distinct values counted 640, so the RMSE rule no longer compares two draws of one
    random walk). Likewise a few keys' roundings carried along their K_j into dq (the
    bwd_scores_reordered control, fp16 outliers, 10 rows of D 72: dq's RMSE 1.06x a rule
    that counted 146 samples)."""
    x = err.detach().to(torch.float64).reshape(-1, err.shape[-1])
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    # Identical error rows are one sample, as identical values are in n_values: rows whose
    # inputs are the same (a query row repeated with the same allowed keys: constant_rows
    # under a window) round the same way. Counting them apart put 128 rows where 92 were
    # distinct (the exp2_approx control, fp16 constant_rows window=(51,17): out's errors
    # not exactly constant along d under AVX2 kernels, so n_values did not merge them, and
    # the RMSE rule applied at 129 samples against N_EFF_MIN = 128).
    x = torch.unique(x, dim=0)
    r = (x * x).sum(-1)
    n_rows = _tail_discounted(r[r > 0])
    g = x.transpose(0, 1) @ x
    norm2 = (g * g).sum()
    if n_rows == 0 or not float(norm2) > 0:
        return 0.0
    rows = float((r > 0).sum())
    pr = float(torch.trace(g) ** 2 / norm2)
    # R rows of errors spread evenly over d independent directions give a sample ratio of
    # about Rd / (R + d) (Marchenko-Pastur: sum lambda^2 ~ Rd(R + d) for sum lambda ~ Rd),
    # so d = pr R / (R - pr): D for independent errors, k for errors in k directions.
    d = float(x.shape[-1])
    return n_rows * (d if pr >= rows else min(d, pr * rows / (rows - pr)))

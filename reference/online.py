"""A plain-torch model of blocked online-softmax attention (FlashAttention-1 and -2).

``online_attention`` runs the tiled algorithm a flash kernel runs, tile by tile, with the
SDPA-compatible contract of docs/contracts.md §1, so that it can be plugged in as a kernel:

- ``order="fa2"``: Q tiles outer, K/V tiles inner; running (m, ℓ) and an unnormalised
  accumulator per Q tile, one division at the end (FlashAttention-2 / Triton tutorial).
- ``order="fa1"``: K/V tiles outer, Q tiles inner; O, m and ℓ live in full-size tensors
  ("HBM") and are read, rescaled, renormalised and written back after every step, with the
  tile's own max and sum merged into the running ones (FlashAttention-1, Algorithm 1).
- ``kv_splits=S`` (split-KV, "flash-decoding"): each row block's key tiles are cut into S
  contiguous runs of whole tiles; the forward of either order runs on each run alone, giving
  a normalised fp32 O_s and lse_s, and ``merge_splits`` combines them as FlashAttention's
  split-KV combine kernel does (lse = m + log Σ e^(lse_s − m), O = Σ e^(lse_s − lse)·O_s),
  the output rounded once at the end. The backward is unchanged (it needs only O and lse).
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

That is the default. Keyword switches of ``online_attention`` select the other choices a
correct kernel makes (reference/family.py names the kernels): ``gqa_reduce`` (GQA dK/dV
per head in fp32, in one fp32 accumulator per kv head, or rounded per head then summed),
``flush_subnormals`` (FTZ), ``scale_at`` (scale on the scores or on Q, natural exp or
folded with log2 e into exp2), ``p_precision``/``ds_precision`` (P, dS rounded to the
input dtype or kept in fp32), ``ds_p_precision`` (the P that dS = P∘(dP − delta) takes:
fp32, or the one rounded to the input dtype for PᵀdO), ``ds_scale`` (scale on dS before its
rounding or on dQ/dK at the end), ``tf32`` (fp32 inputs: matmul operands rounded to TF32 by
``round_tf32``) and
``exp_accuracy`` (fp32: every exponential to 22 significant bits, ``round_exp_approx``)
and ``kv_splits`` (split-KV forward, above) and ``bwd_scores`` (the backward's QKᵀ summed
over the head dim in another order than the forward's, or from K prescaled) and
``accumulate`` (fp32: the backward's dQ, dK, dV each one running sum, one fused
multiply-add per product). With
every switch at its default the arithmetic is bit for bit that of the model before the
switches existed.

The (m, ℓ) recurrence is ``online_lse_step``; the tile updates ``tile_step_fa2`` and
``tile_step_fa1`` are the same recurrence applied to a block max and a block sum.
``emulate_error_bound`` is the a-priori bound on the emulated forward error (derived for the
unsplit forward, ``kv_splits=1``; the split forward's merge is not in its derivation).

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

from ._validate import (
    ACCUMULATES,
    BIAS_FMAS,
    BWD_SCORES,
    DS_SCALES,
    EXP_ACCURACIES,
    FP32_DOTS,
    GQA_REDUCES,
    NORMALIZES,
    OPERAND_PRECISIONS,
    ORDERS,
    PRECISIONS,
    SCALE_ATS,
    TF32_ROUNDINGS,
    Problem,
    check_attention_args,
    check_block,
    check_choice,
    check_count,
    check_flag,
)
from .masks import combined_mask

# ---------------------------------------------------------------- the (m, ℓ) recurrence


def _rescale(m, x, exp=torch.exp):
    """m' = max(m, x) with the factors α = e^(m−m'), β = e^(x−m'); −inf-safe.

    When both are −inf, m' = −inf and α = β = 0 (nothing seen yet, nothing added).
    Works on Python floats and, elementwise, on tensors (``exp``: the tensor exponential,
    e.g. ``torch.exp2`` for scores in log2 units).
    """
    if isinstance(m, torch.Tensor) or isinstance(x, torch.Tensor):
        like = m if isinstance(m, torch.Tensor) else x
        m, x = (torch.as_tensor(t, dtype=like.dtype, device=like.device) for t in (m, x))
        m_new = torch.maximum(m, x)
        shift = torch.where(m_new == -torch.inf, torch.zeros_like(m_new), m_new)
        return m_new, exp(m - shift), exp(x - shift)
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


def tile_step_fa2(m, l, s, exp=torch.exp, p_of=None):
    """FlashAttention-2 tile update of (m, ℓ) with a tile of scores ``s`` (..., rows, cols).

    The recurrence of ``online_lse_step`` with x = the tile's row max and the tile's row sum
    taken in the new frame: m' = max(m, rowmax s), p = e^(s−m'), ℓ' = ℓ·e^(m−m') + rowsum p.
    Returns (m', ℓ', α = e^(m−m'), p). ``exp``: as in ``_rescale``; ``p_of``: optional,
    shift (..., rows, 1) -> p, for kernels that form p other than as exp(s − shift).
    """
    m_new, alpha, _ = _rescale(m, s.amax(dim=-1), exp)
    shift = torch.where(m_new == -torch.inf, torch.zeros_like(m_new), m_new)
    p = p_of(shift.unsqueeze(-1)) if p_of else exp(s - shift.unsqueeze(-1))
    return m_new, alpha * l + p.sum(dim=-1), alpha, p


def tile_step_fa1(m, l, s, exp=torch.exp, p_of=None):
    """FlashAttention-1 tile update: the recurrence with the block max and block sum.

    m̃ = rowmax s, p̃ = e^(s−m̃), ℓ̃ = rowsum p̃; then m' = max(m, m̃) and
    ℓ' = ℓ·e^(m−m') + ℓ̃·e^(m̃−m') (``online_lse_step`` is the case ℓ̃ = 1).
    Returns (m', ℓ', α = e^(m−m'), β = e^(m̃−m'), p̃). ``exp``, ``p_of``: as in
    ``tile_step_fa2``.
    """
    m_blk = s.amax(dim=-1)
    shift = torch.where(m_blk == -torch.inf, torch.zeros_like(m_blk), m_blk)
    p = p_of(shift.unsqueeze(-1)) if p_of else exp(s - shift.unsqueeze(-1))
    m_new, alpha, beta = _rescale(m, m_blk, exp)
    return m_new, alpha * l + beta * p.sum(dim=-1), alpha, beta, p


# ---------------------------------------------------------------- precision plumbing


LOG2E = 1.4426950408889634  # log2(e)
LN2 = 0.6931471805599453  # ln(2)


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> TF32 (10 explicit mantissa bits), kept in fp32.

    Round to nearest, ties away from zero: PTX ``cvt.rna.tf32.f32``, the conversion Triton
    and CUTLASS emit before a TF32 tensor-core product. inf and NaN are left unchanged.
    """
    if x.dtype != torch.float32:
        raise ValueError(f"round_tf32: expected a float32 tensor; got {x.dtype}")
    return _keep_bits(x, 11, nearest=True)


def _keep_bits(x: torch.Tensor, bits: int, *, nearest: bool) -> torch.Tensor:
    """fp32 ``x`` kept to ``bits`` significant bits, as fp32: rounded to nearest (ties away
    from zero: half a unit added to the magnitude's bits) or truncated (toward zero). inf
    and NaN are left unchanged."""
    drop = 24 - bits
    i = x.view(torch.int32)
    if nearest:
        i = i + (1 << (drop - 1))
    return torch.where(torch.isfinite(x), (i & -(1 << drop)).view(torch.float32), x)


# Significant bits an approximate fp32 exponential keeps: ex2.approx.f32 (what exp2f, __expf
# and Triton's exp2 compile to on NVIDIA GPUs) is within 2^-22 relative of 2^x, the bound
# verify/bounds.py's floor already used; rounding to 22 bits errs by at most that.
APPROX_EXP_BITS = 22


def round_exp_approx(x: torch.Tensor) -> torch.Tensor:
    """An fp32 exponential's result rounded to ``APPROX_EXP_BITS`` significant bits (nearest,
    ties away from zero): relative error at most 2^-22, the envelope of the GPUs' approximate exp2.
    Other dtypes, inf and NaN are returned unchanged."""
    if x.dtype != torch.float32:
        return x
    return _keep_bits(x, APPROX_EXP_BITS, nearest=True)


def truncate_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> TF32 by dropping the 13 low mantissa bits (toward zero), kept in fp32: what a
    tensor core reads when fp32 operands reach it without a conversion (Hopper's wgmma with
    TF32 operands straight from shared memory, Triton's fp32 tl.dot on sm_90). Relative
    error below 2^-10, twice the nearest rounding's. inf and NaN are left unchanged."""
    if x.dtype != torch.float32:
        raise ValueError(f"truncate_tf32: expected a float32 tensor; got {x.dtype}")
    return _keep_bits(x, 11, nearest=False)


def _flush(x: torch.Tensor, tiny: float) -> torch.Tensor:
    """x with entries of magnitude below ``tiny`` (subnormals) replaced by a signed zero."""
    return torch.where(x.abs() < tiny, x * 0, x)


# The k-steps of ``bwd_scores``: "k16" sums in steps of 16, the K of an fp16/bf16 MMA
# instruction (m16n8k16) and of Triton's smallest tl.dot; "k8" in steps of 8, the K of the
# m16n8k8 MMAs (fp16, and TF32 for fp32 inputs) and of a TF32 wgmma; "k1" one product at a
# time, a fused multiply-add per element (a CUDA-core or scalar dot). A backward that
# recomputes QKᵀ in such steps sums the head dim in another order than a forward that used
# one GEMM call (or wider steps).
K_STEPS = {"k16": 16, "k8": 8, "k1": 1}
# A forward with a fast vectorised exp below fp32 (``exp_accuracy="fwd_fast_low"`` /
# ``"fwd_fast_high"``): every forward probability short, or long, by this relative amount.
# 2^-13 = 1.22e-4 covers the fast exps measured (PyTorch's CPU flash forward for fp16/bf16:
# -1.08e-4..+1.02e-4; the fwd_fast_exp control's cubic: -9.98e-5..+9.29e-5) and stays
# below the input roundings of P (2^-11 fp16, 2^-8 bf16) that such a kernel makes anyway.
FAST_EXP_REL = 2.0**-13
_FAST_SIGN = {"fwd_fast_low": -1.0, "fwd_fast_high": 1.0}


class _Arith:
    """Where each value lives (operand dtype = rounding, accumulator dtype) and the
    implementation choices of one call (the keyword switches of ``online_attention``).

    Every helper is the identity, or the exact operation of the code before the switches
    existed, when its switch has its default value.
    """

    def __init__(
        self, dtype: torch.dtype, precision: str, *, gqa_reduce: str = "per_head_fp32",
        flush_subnormals: bool = False, scale_at: str = "scores", p_precision: str = "input",
        ds_precision: str = "input", ds_scale: str = "after_round", tf32: bool = False,
        normalize: str = "divide", exp_accuracy: str = "library",
        tf32_rounding: str = "nearest", kv_splits: int = 1, bwd_scores: str = "as_forward",
        accumulate: str = "blocked", fp32_dot: str = "ieee", bias_fma: str = "none",
        ds_p_precision: str = "fp32",
    ):
        if precision == "exact":
            self.operand = self.acc = torch.float64
        else:
            self.operand = dtype
            self.acc = torch.promote_types(dtype, torch.float32)
        self.gqa_reduce = gqa_reduce
        self.group_acc = gqa_reduce == "group_fp32"
        self.flush = flush_subnormals
        self.scale_at = scale_at
        self.base2 = scale_at in ("exp2", "q_exp2", "exp2_fma")
        self.fused = scale_at == "exp2_fma"
        self.reciprocal = normalize == "reciprocal"
        self.p_normalized = normalize == "before_pv"
        self.round_p = p_precision == "input"
        self.round_ds = ds_precision == "input"
        self.ds_before_round = ds_scale == "before_round"
        self.ds_p_rounded = ds_p_precision == "input"
        self.tf32 = tf32
        self.to_tf32 = truncate_tf32 if tf32_rounding == "truncate" else round_tf32
        self.approx_exp = exp_accuracy == "approx"
        self.fast_fwd = _FAST_SIGN.get(exp_accuracy, 0.0) * FAST_EXP_REL
        self.kv_splits = kv_splits
        self.bwd_k_step = K_STEPS.get(bwd_scores, 0)  # 0: the forward's product
        self.bwd_k_prescaled = bwd_scores == "k_prescaled"
        # A running sum is a rounding model of fp32 accumulators only (float64 is exact here).
        self.fma_chain = accumulate == "fma_chain" and self.acc == torch.float32
        self.grads_in_input = accumulate == "input_dtype"
        self.x3tf32 = fp32_dot == "3xtf32"
        self.bias_split = bias_fma == "split"

    def ftz(self, x: torch.Tensor) -> torch.Tensor:
        """Flush accumulator-dtype subnormals to zero when flushing; else ``x`` itself."""
        return _flush(x, torch.finfo(self.acc).tiny) if self.flush else x

    def result(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``x`` rounded to ``dtype`` (its subnormals flushed when flushing)."""
        y = x.to(dtype)
        return _flush(y, torch.finfo(dtype).tiny) if self.flush else y

    def load(self, t: torch.Tensor) -> torch.Tensor:
        """An input in the operand dtype, held in the acc dtype; when flushing, the
        accumulator dtype's subnormals are flushed (DAZ: an fp32 or bf16 input below fp32's
        smallest normal). An fp16 subnormal input is not: it converts exactly to a normal
        fp32 number and tensor-core products read it as it is, so no FTZ/DAZ mode drops it
        (flushing it would change the inputs by up to 6.1e-5 each, not model an arithmetic)."""
        return self.ftz(t.to(self.operand).to(self.acc))

    def rnd(self, x: torch.Tensor) -> torch.Tensor:
        """Round to the operand dtype, kept in the acc dtype (operand-dtype subnormals
        flushed when flushing; the flush runs in the acc dtype, same values, faster)."""
        y = x.to(self.operand).to(self.acc)
        return _flush(y, torch.finfo(self.operand).tiny) if self.flush else y

    def rnd_p(self, x: torch.Tensor) -> torch.Tensor:
        """P as the operand of P@V and PᵀdO: rounded (``p_precision="input"``) or not."""
        return self.rnd(x) if self.round_p else x

    def rnd_ds(self, x: torch.Tensor) -> torch.Tensor:
        """dS as the operand of dS@K and dSᵀQ: rounded (``ds_precision="input"``) or not."""
        return self.rnd(x) if self.round_ds else x

    def exp(self, x: torch.Tensor) -> torch.Tensor:
        """e^x, or 2^x when the scores are in log2 units (``scale_at="exp2"``); flushed."""
        return self._exp_result(torch.exp2(x) if self.base2 else torch.exp(x))

    def exp_minus(self, s: torch.Tensor, fused, shift: torch.Tensor,
                  backward: bool = False) -> torch.Tensor:
        """P = exp(s − shift) for a tile of scores ``s`` (see ``exp``). With
        ``scale_at="exp2_fma"`` and ``fused`` (the exact products QKᵀ·c in float64, from
        ``_scores``), 2^(QKᵀ·c − shift) with the exponent rounded once: an FFMA of the raw
        score, the constant and the negated shift, never the rounded scaled score. In the
        forward (not ``backward``) with ``exp_accuracy="fwd_fast_low"``/``"fwd_fast_high"``,
        times 1 ∓ :data:`FAST_EXP_REL` (a fast exp's relative error, at its ends)."""
        if fused is None:
            e = self.exp(s - shift)
        else:
            e = self._exp_result(torch.exp2((fused - shift.to(torch.float64)).to(self.acc)))
        if self.fast_fwd and not backward:
            e = self.ftz(e * (1.0 + self.fast_fwd))
        return e

    def _exp_result(self, e: torch.Tensor) -> torch.Tensor:
        """An exponential as the kernel has it: to 22 bits with ``exp_accuracy="approx"``;
        flushed."""
        return self.ftz(round_exp_approx(e) if self.approx_exp else e)

    def normalize(self, acc: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
        """acc / ℓ (``normalize="divide"``), or acc · fl(1/ℓ) (``"reciprocal"``); ℓ is
        broadcast over the last dim of acc."""
        l = l.unsqueeze(-1)
        return acc * (1 / l) if self.reciprocal else acc / l

    def log(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of ``exp``."""
        return torch.log2(x) if self.base2 else torch.log(x)

    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Product of operands already rounded to the operand dtype, accumulated in acc
        (with ``tf32``: operands rounded to TF32 first, fp32 accumulation)."""
        if self.tf32:
            a, b = self.to_tf32(a), self.to_tf32(b)
        elif self.x3tf32:
            return self.ftz(_mm_3xtf32(a, b))
        return self.ftz(torch.matmul(a, b))

    def mm_scores(self, a: torch.Tensor, b: torch.Tensor, backward: bool) -> torch.Tensor:
        """QKᵀ of a tile: ``mm``; in the backward with ``bwd_scores="k16"``/``"k8"``, a sum
        over the head dim in steps of 16/8 (``K_STEPS``), each step's product added in order
        to the accumulator (an MMA's k-steps), with ``"k1"`` one fused multiply-add per
        product (``_fma_chain``), so the backward's scores are another rounding of the
        forward's."""
        step = self.bwd_k_step
        if not (backward and step) or a.shape[-1] <= step:
            return self.mm(a, b)
        if step == 1:
            zero = torch.zeros(a.shape[:-1] + b.shape[-1:], dtype=self.acc, device=a.device)
            return _fma_chain(self, zero, ((a[..., i:i + 1], b[..., i:i + 1, :])
                                           for i in range(a.shape[-1])))
        acc = self.mm(a[..., :step], b[..., :step, :])
        for i in range(step, a.shape[-1], step):
            acc = self.ftz(acc + self.mm(a[..., i:i + step], b[..., i:i + step, :]))
        return acc


def _mm_3xtf32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a·b of fp32 operands as three TF32 products (CUTLASS's OpMultiplyAddFastF32): each
    operand split into big = tf32(x) truncated (toward zero: NumericConverterFastF32's big
    part) and small = tf32(x − big) rounded, the small·small product dropped, the rest
    accumulated in fp32, small terms first. With the big part truncated the small part
    carries up to 2^-10 |x| (2^-11 rounded), so the dropped product is up to 2^-20 |ab|,
    4x a rounded split's: every product keeps about 20 of fp32's 24 bits. The truncated
    split is what reproduces sdpa-efficient's worst element on the H200 (a rounded split
    puts its worst elsewhere, at a third of the error)."""
    ab, bb = truncate_tf32(a), truncate_tf32(b)
    as_, bs = round_tf32(a - ab), round_tf32(b - bb)
    return (torch.matmul(as_, bb) + torch.matmul(ab, bs)) + torch.matmul(ab, bb)


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


def _scores(ar: _Arith, p: Problem, qi, kj, attn_mask, rows, cols, backward=False):
    """Scaled, masked scores of one tile in the accumulator dtype (in log2 units, i.e.
    times log2(e), when ``scale_at`` is a base-2 choice), and ``fused``: for
    ``scale_at="exp2_fma"``, the exact products QKᵀ·c in float64 (plus bias·log2 e with an
    additive bias; −inf where masked) that ``_Arith.exp_minus`` fuses with the shift; else
    None."""
    # One accumulator-dtype constant scale·log2(e) in base 2 (FlashAttention-2/3, Triton);
    # with bias_fma="split" in natural-log units the kernel's scale argument in that dtype,
    # so that float64 holds QKᵀ·c exactly for the forward's one rounding (below).
    c = (torch.tensor(p.scale * LOG2E if ar.base2 else p.scale, dtype=ar.acc).item()
         if ar.base2 or ar.bias_split else p.scale)
    kt = kj.transpose(-2, -1)
    if ar.scale_at in ("q", "q_exp2"):
        s = ar.mm_scores(ar.rnd(qi * c), kt, backward)
    elif ar.scale_at == "qk_sqrt":
        # Q·r and K·r, r = fl(√scale), each product rounded in the accumulator dtype
        r = torch.tensor(math.sqrt(p.scale), dtype=ar.acc).item()
        s = ar.mm_scores(ar.ftz((qi * r).to(ar.acc)), ar.ftz((kt * r).to(ar.acc)), backward)
    elif ar.fused:
        # The raw score times c, in float64: exact for fp32 scores (24 + 24 bits < 53);
        # the rounded product is the scaled score that the row max is taken of.
        fused = ar.mm_scores(qi, kt, backward).to(torch.float64) * c
        s = fused.to(ar.acc)
    elif backward and ar.bwd_k_prescaled:
        # The backward's GEMM takes the scale as its alpha and folds it into the packed K
        # operand: Q·fl(K·c), K·c rounded in the accumulator dtype, where the forward's lse
        # came from fl(QKᵀ)·c (PyTorch's CPU flash backward on AVX-512 machines).
        s = ar.mm(qi, ar.ftz((kt * c).to(ar.acc)))
    elif ar.base2 or ar.bias_split:
        raw = ar.mm_scores(qi, kt, backward)
        s = raw * c
    else:
        s = ar.mm_scores(qi, kt, backward) * p.scale
    if not ar.fused:
        fused = None
    s = ar.ftz(s)
    allowed, bias = combined_mask(
        attn_mask, (p.B, p.Hq, p.Nq, p.Nk), is_causal=p.is_causal,
        causal_alignment=p.causal_alignment, window=p.window, rows=rows, cols=cols,
        device=qi.device,
    )
    if bias is not None and fused is not None:
        # The fused exponent keeps an additive bias too: bias·log2(e) added to the exact
        # scaled score in float64, so the row max's P stays 2^(a rounding), not 1 (the
        # fa2_cuda_softmax control's false alarm at 1.43x: one key per row, a bias, P = 1
        # exactly here against 1 ± 2^-11 in the control).
        fused = fused + bias.to(torch.float64) * LOG2E
        s = ar.ftz(fused.to(ar.acc))
    elif bias is not None and ar.bias_split:
        # One FMA per score, contracted two ways (bias_fma="split"): the forward keeps
        # QKᵀ·c exact and adds the rounded bias term; the backward adds the exact bias
        # term to the rounded QKᵀ·c. In base 2 the bias term is bias·log2 e; in natural-log
        # units (scale_at="scores") it is the bias itself, exact in both passes. float64
        # holds each exact product (24 + 24 bits).
        unit = LOG2E if ar.base2 else 1.0
        b64 = bias.to(torch.float64) * unit
        s = (s.to(torch.float64) + b64 if backward
             else raw.to(torch.float64) * c + (bias.to(ar.acc) * unit).to(torch.float64))
        s = ar.ftz(s.to(ar.acc))
    elif bias is not None:
        s = s + (bias.to(ar.acc) * LOG2E if ar.base2 else bias.to(ar.acc))
    if fused is not None:
        fused = fused.masked_fill(~allowed, -torch.inf)
    return s.masked_fill(~allowed, -torch.inf), fused


def _tiles(n: int, block: int):
    return [(a, min(a + block, n)) for a in range(0, n, block)]


def _finish(ar, acc_o, m, l):
    """O = acc/ℓ and lse = m + log ℓ, with 0 and −inf on rows that saw no key."""
    live = l > 0
    l_safe = torch.where(live, l, torch.ones_like(l))
    out = torch.where(live.unsqueeze(-1), ar.normalize(acc_o, l_safe), torch.zeros_like(acc_o))
    lse = torch.where(live, m + ar.log(l_safe), torch.full_like(l, -torch.inf))
    return out, lse


# ---------------------------------------------------------------- forward passes


def _forward_fa2(ar, p, q, k, v, attn_mask, bm, bn, col_tiles):
    """Output (acc dtype, normalised) and lse over the key tiles ``col_tiles``."""
    out = torch.empty(p.B, p.Hq, p.Nq, p.D, dtype=ar.acc, device=q.device)
    lse = torch.empty(p.B, p.Hq, p.Nq, dtype=ar.acc, device=q.device)
    for rows in _tiles(p.Nq, bm):
        qi = q[:, :, rows[0]:rows[1]]
        r = rows[1] - rows[0]
        m = torch.full((p.B, p.Hq, r), -torch.inf, dtype=ar.acc, device=q.device)
        l = torch.zeros_like(m)
        acc_o = torch.zeros(p.B, p.Hq, r, p.D, dtype=ar.acc, device=q.device)
        for cols in col_tiles:
            s, fused = _scores(ar, p, qi, k[:, :, cols[0]:cols[1]], attn_mask, rows, cols)
            m, l, alpha, pt = tile_step_fa2(
                m, l, s, ar.exp, lambda sh, s=s, f=fused: ar.exp_minus(s, f, sh))
            acc_o = acc_o * alpha.unsqueeze(-1) + ar.mm(ar.rnd_p(pt), v[:, :, cols[0]:cols[1]])
            acc_o = ar.ftz(acc_o)
        out[:, :, rows[0]:rows[1]], lse[:, :, rows[0]:rows[1]] = _finish(ar, acc_o, m, l)
    return out, lse


def _forward_p_normalized(ar, p, q, k, v, attn_mask, bm, bn, col_tiles):
    """As ``_forward_fa2`` with the probabilities normalised before P@V
    (``normalize="before_pv"``): the row's max m over every key tile first, ℓ = Σ e^(s−m) in
    the acc dtype, then P = e^(s−m)/ℓ rounded to the operand dtype and O = Σ P·V, not
    divided again (an unfused softmax followed by a matmul)."""
    out = torch.empty(p.B, p.Hq, p.Nq, p.D, dtype=ar.acc, device=q.device)
    lse = torch.empty(p.B, p.Hq, p.Nq, dtype=ar.acc, device=q.device)
    for rows in _tiles(p.Nq, bm):
        qi = q[:, :, rows[0]:rows[1]]
        tiles = [(cols, *_scores(ar, p, qi, k[:, :, cols[0]:cols[1]], attn_mask, rows, cols))
                 for cols in col_tiles]
        m = torch.stack([s.amax(dim=-1) for _, s, _ in tiles]).amax(dim=0)
        shift = torch.where(m == -torch.inf, torch.zeros_like(m), m).unsqueeze(-1)
        pts = [(cols, ar.exp_minus(s, f, shift)) for cols, s, f in tiles]
        l = torch.stack([pt.sum(dim=-1) for _, pt in pts]).sum(dim=0)
        live = l > 0
        l_safe = torch.where(live, l, torch.ones_like(l))
        acc_o = torch.zeros(p.B, p.Hq, rows[1] - rows[0], p.D, dtype=ar.acc, device=q.device)
        for cols, pt in pts:
            prob = ar.ftz(ar.normalize(pt, l_safe))
            acc_o = ar.ftz(acc_o + ar.mm(ar.rnd_p(prob), v[:, :, cols[0]:cols[1]]))
        out[:, :, rows[0]:rows[1]] = torch.where(live.unsqueeze(-1), acc_o,
                                                 torch.zeros_like(acc_o))
        lse[:, :, rows[0]:rows[1]] = torch.where(live, m + ar.log(l_safe),
                                                 torch.full_like(l, -torch.inf))
    return out, lse


def _forward_fa1(ar, p, q, k, v, attn_mask, bm, bn, col_tiles):
    """As ``_forward_fa2``, in FlashAttention-1's order (key tiles outer)."""
    o_hbm = torch.zeros(p.B, p.Hq, p.Nq, p.D, dtype=ar.acc, device=q.device)
    m_hbm = torch.full((p.B, p.Hq, p.Nq), -torch.inf, dtype=ar.acc, device=q.device)
    l_hbm = torch.zeros_like(m_hbm)
    for cols in col_tiles:
        kj, vj = k[:, :, cols[0]:cols[1]], v[:, :, cols[0]:cols[1]]
        for rows in _tiles(p.Nq, bm):
            sl = slice(rows[0], rows[1])
            oi, mi, li = o_hbm[:, :, sl], m_hbm[:, :, sl], l_hbm[:, :, sl]
            s, fused = _scores(ar, p, q[:, :, sl], kj, attn_mask, rows, cols)
            m_new, l_new, alpha, beta, pt = tile_step_fa1(
                mi, li, s, ar.exp, lambda sh, s=s, f=fused: ar.exp_minus(s, f, sh))
            pv = ar.mm(ar.rnd_p(pt), vj)
            num = (li * alpha).unsqueeze(-1) * oi + beta.unsqueeze(-1) * pv
            live = (l_new > 0).unsqueeze(-1)
            l_safe = torch.where(l_new > 0, l_new, torch.ones_like(l_new))
            o_hbm[:, :, sl] = ar.ftz(torch.where(live, ar.normalize(num, l_safe),
                                                 torch.zeros_like(num)))
            m_hbm[:, :, sl], l_hbm[:, :, sl] = m_new, l_new
    live = l_hbm > 0
    l_safe = torch.where(live, l_hbm, torch.ones_like(l_hbm))
    lse = torch.where(live, m_hbm + ar.log(l_safe), torch.full_like(l_hbm, -torch.inf))
    return o_hbm, lse


def split_chunks(n_tiles: int, splits: int) -> list[range]:
    """The key tiles of each split: ``splits`` contiguous runs of ceil(n_tiles / splits)
    whole tiles (FlashAttention-2's n_blocks_per_split); trailing runs may be empty."""
    per = -(-n_tiles // splits)
    return [range(min(s * per, n_tiles), min((s + 1) * per, n_tiles)) for s in range(splits)]


def merge_splits(ar, outs, lses):
    """The split-KV combine: per-split outputs O_s (acc dtype, each normalised by its own ℓ)
    and lse_s (−inf for a split that saw no key) -> (O, lse), in the acc dtype.

    m = max_s lse_s; lse = m + log Σ_s e^(lse_s − m); O = Σ_s e^(lse_s − lse)·O_s, summed in
    split order from 0, each product and sum rounded in the acc dtype (FlashAttention-2's
    combine_attn_seqk_parallel, whose O += scale·O_s the compiler may fuse into one FMA: a
    rounding less). ``ar.exp``/``ar.log`` are the model's: natural, as FlashAttention-2's
    expf/logf, or base 2 when the model's lse is in log2 units (a base-2 ``scale_at``; the
    same merge up to roundings), 22-bit exponentials with ``exp_accuracy="approx"``,
    flushed with ``flush_subnormals``. A row no split saw: O = 0, lse = −inf, no NaN
    (FlashAttention-2 writes +inf there; the model keeps its dead-row convention).
    """
    m = lses[0]
    for lse_s in lses[1:]:
        m = torch.maximum(m, lse_s)
    shift = torch.where(m == -torch.inf, torch.zeros_like(m), m)
    total = torch.zeros_like(m)
    for lse_s in lses:
        total = total + ar.exp(lse_s - shift)
    live = total > 0
    lse = torch.where(live, shift + ar.log(torch.where(live, total, torch.ones_like(total))),
                      torch.full_like(m, -torch.inf))
    lse_shift = torch.where(live, lse, torch.zeros_like(lse))
    out = torch.zeros_like(outs[0])
    for o_s, lse_s in zip(outs, lses, strict=True):
        out = ar.ftz(out + ar.exp(lse_s - lse_shift).unsqueeze(-1) * o_s)
    return out, lse


def _forward(ar, p, q, k, v, attn_mask, order, bm, bn):
    """The forward of ``order`` over all key tiles, or split-KV (``ar.kv_splits`` > 1):
    the same forward on each split's key tiles, then ``merge_splits``."""
    if ar.p_normalized and order != "fa2":
        raise ValueError(f"normalize='before_pv': only with order='fa2' (the row's ℓ is "
                         f"known before any P@V); got order={order!r}")
    fwd = (_forward_p_normalized if ar.p_normalized else
           _forward_fa2 if order == "fa2" else _forward_fa1)
    tiles = _tiles(p.Nk, bn)
    if ar.kv_splits == 1:
        return fwd(ar, p, q, k, v, attn_mask, bm, bn, tiles)
    parts = [fwd(ar, p, q, k, v, attn_mask, bm, bn, [tiles[i] for i in chunk])
             for chunk in split_chunks(len(tiles), ar.kv_splits)]
    return merge_splits(ar, [o for o, _ in parts], [lse for _, lse in parts])


# ---------------------------------------------------------------- backward pass


def _kv_accumulate(ar, p, acc, a, b):
    """acc + aᵀ·b for a dK or dV tile: per query head (acc (B, Hq, cols, D)), or with
    ``gqa_reduce="group_fp32"`` into one accumulator per kv head (B, Hkv, cols, D), the
    group's query heads added one after the other."""
    if not ar.group_acc:
        return acc + ar.mm(a.transpose(-2, -1), b)
    a, b = a.unflatten(1, (p.Hkv, p.group)), b.unflatten(1, (p.Hkv, p.group))
    for h in range(p.group):
        acc = acc + ar.mm(a[:, :, h].transpose(-2, -1), b[:, :, h])
    return acc


def _scaled(ar, p, x):
    """One tile's dS product times the scale, unless dS carries it already."""
    return x if ar.ds_before_round else ar.ftz(x * p.scale)


def _input_dtype_sum(ar, p, acc, tiles):
    """``accumulate="input_dtype"``: ``acc`` (B, Hkv, cols, D) after adding each query tile's
    fp32 product of ``tiles`` (each (B, Hq, cols, D)), rounding to the input dtype after
    every add: the group's query heads one after the other (query head c·g + h adds into kv
    head c), each head's tiles in query order."""
    for h in range(p.group):
        for t in tiles:
            acc = ar.rnd(acc + t.unflatten(1, (p.Hkv, p.group))[:, :, h])
    return acc


def _backward_fa2(ar, p, q, k, v, attn_mask, out, lse, dout, bm, bn, want_dbias):
    """Blocked FlashAttention-2 backward; K/V tiles outer. Returns dq, dk, dv, dbias (acc);
    dk and dv per query head (B, Hq, Nk, D), not yet reduced over a GQA group, except with
    ``gqa_reduce="group_fp32"`` or ``accumulate="input_dtype"`` (B, Hkv, Nk, D).

    ``lse`` is the forward's (in log2 units when ``scale_at="exp2"``)."""
    do = ar.load(dout)
    delta = (do * out).sum(dim=-1)
    lse_shift = torch.where(lse == -torch.inf, torch.zeros_like(lse), lse)
    dq = torch.zeros_like(q)
    if ar.group_acc or ar.grads_in_input:
        dk = torch.zeros(p.B, p.Hkv, p.Nk, p.D, dtype=ar.acc, device=q.device)
        dv = torch.zeros_like(dk)
    else:
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
    dbias = (
        torch.zeros(p.B, p.Hq, p.Nq, p.Nk, dtype=ar.acc, device=q.device) if want_dbias else None
    )
    chain = None if not ar.fma_chain else tuple(
        torch.zeros(p.B, p.Hq, p.Nq, p.Nk, dtype=ar.acc, device=q.device) for _ in range(2))
    for cols in _tiles(p.Nk, bn):
        cs = slice(cols[0], cols[1])
        kj, vj = k[:, :, cs], v[:, :, cs]
        if chain is None:  # the chains' sums are formed after the loop (_chain_grads)
            dk_j = torch.zeros_like(dk[:, :, cs])
            dv_j = torch.zeros_like(dv[:, :, cs])
        tiles_k, tiles_v = [], []  # accumulate="input_dtype": each query tile's products
        for rows in _tiles(p.Nq, bm):
            rs = slice(rows[0], rows[1])
            qi, do_i = q[:, :, rs], do[:, :, rs]
            s, fused = _scores(ar, p, qi, kj, attn_mask, rows, cols, backward=True)
            pt = ar.exp_minus(s, fused, lse_shift[:, :, rs].unsqueeze(-1), backward=True)
            dp = ar.mm(do_i, vj.transpose(-2, -1)) if chain is None else _fma_chain(
                ar, torch.zeros(*qi.shape[:-1], kj.shape[-2], dtype=ar.acc, device=q.device),
                ((do_i[..., d, None], vj[..., None, :, d]) for d in range(p.D)))
            p_ds = ar.rnd(pt) if ar.ds_p_rounded else pt  # ds_p_precision
            ds = ar.ftz(p_ds * (dp - delta[:, :, rs].unsqueeze(-1)))
            ds_r = ar.rnd_ds(ar.ftz(ds * p.scale) if ar.ds_before_round else ds)
            if chain is not None:
                chain[0][:, :, rs, cs], chain[1][:, :, rs, cs] = ar.rnd_p(pt), ds_r
            elif ar.grads_in_input:
                tiles_v.append(ar.mm(ar.rnd_p(pt).transpose(-2, -1), do_i))
                tiles_k.append(_scaled(ar, p, ar.mm(ds_r.transpose(-2, -1), qi)))
                dq[:, :, rs] = ar.rnd(dq[:, :, rs] + _scaled(ar, p, ar.mm(ds_r, kj)))
            else:
                dv_j = _kv_accumulate(ar, p, dv_j, ar.rnd_p(pt), do_i)
                dk_j = _kv_accumulate(ar, p, dk_j, ds_r, qi)
                dq[:, :, rs] += ar.mm(ds_r, kj)
            if dbias is not None:
                dbias[:, :, rs, cs] = ds
        if ar.grads_in_input:
            dk[:, :, cs] = _input_dtype_sum(ar, p, dk_j, tiles_k)
            dv[:, :, cs] = _input_dtype_sum(ar, p, dv_j, tiles_v)
        elif chain is None:
            dk[:, :, cs] = dk_j
            dv[:, :, cs] = dv_j
    if chain is not None:
        dq, dk, dv = _chain_grads(ar, p, q, k, do, *chain)
    if not ar.ds_before_round and not ar.grads_in_input:  # scaled tile by tile there
        dq, dk = ar.ftz(dq * p.scale), ar.ftz(dk * p.scale)
    return dq, dk, dv, dbias


def _fma_chain(ar, acc, terms):
    """acc after adding, in order, each (a, b) of ``terms`` as one fused multiply-add per
    element: acc = fl(acc + a·b) (the exact product of two fp32 values fits float64; the sum
    rounded to float64 and then to fp32 differs from one rounding only at rare ties)."""
    acc = acc.to(torch.float64)
    for a, b in terms:
        acc = ar.ftz((acc + a.to(torch.float64) * b.to(torch.float64)).to(ar.acc)).to(
            torch.float64)
    return acc.to(ar.acc)


def _chain_grads(ar, p, q, k, do, pr, dsr):
    """dQ, dK, dV (dK/dQ unscaled) as the running sums of ``accumulate="fma_chain"``: dQ
    over the keys in order; dK and dV over the query rows in order, per query head, or with
    ``gqa_reduce="group_fp32"`` through the group's heads one after the other into one
    accumulator per kv head. ``pr`` and ``dsr`` are P and dS as the products read them
    (B, Hq, Nq, Nk)."""
    # k is expanded per query head here (B, Hq, Nk, D)
    dq = _fma_chain(ar, torch.zeros_like(q),
                    ((dsr[..., j, None], k[:, :, j, None, :]) for j in range(p.Nk)))
    # query head c·g + h belongs to kv head c: slice h::g takes member h of every group
    heads = [slice(None)] if not ar.group_acc else [
        slice(h, None, p.group) for h in range(p.group)]
    shape = (p.B, p.Hkv if ar.group_acc else p.Hq, p.Nk, p.D)
    grads = []
    for a in (pr, dsr):
        b_src = do if a is pr else q
        terms = ((a[:, hs, i, :, None], b_src[:, hs, i, None, :])
                 for hs in heads for i in range(p.Nq))
        grads.append(_fma_chain(ar, torch.zeros(shape, dtype=ar.acc, device=q.device), terms))
    return dq, grads[1], grads[0]


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


def _load_qkv(ar, p, query, key, value):
    """q, k, v in the operand dtype held in the acc dtype; k and v expanded to Hq heads."""
    return ar.load(query), p.expand_kv(ar.load(key)), p.expand_kv(ar.load(value))


def _run_forward(ar, p, query, key, value, attn_mask, order, bm, bn):
    """Output (operand dtype) and lse (acc dtype; log2 units when ``scale_at="exp2"``)."""
    with _ieee_fp32_matmul():
        q, k, v = _load_qkv(ar, p, query, key, value)
        out, lse = _forward(ar, p, q, k, v, attn_mask, order, bm, bn)
    return ar.result(out, ar.operand), lse


def _run_backward(ar, p, query, key, value, attn_mask, out, lse, dout, bm, bn, want_dbias):
    """dq (acc), dk and dv per query head (acc), dbias: see ``_backward_fa2``."""
    with _ieee_fp32_matmul():
        q, k, v = _load_qkv(ar, p, query, key, value)
        return _backward_fa2(
            ar, p, q, k, v, attn_mask, out.to(ar.acc), lse, dout, bm, bn, want_dbias
        )


def _reduce_kv_grad(ar, p, g, dtype):
    """A per-query-head dk or dv (B, Hq, Nk, D; acc dtype) -> (B, Hkv, Nk, D) in ``dtype``,
    reduced over each kv head's group as ``gqa_reduce`` says."""
    if ar.group_acc or ar.grads_in_input:
        return ar.result(g, dtype)  # reduced in the backward's accumulator already
    if ar.gqa_reduce == "per_head_fp32" or p.group == 1:
        return ar.result(p.reduce_kv(g), dtype)
    per_head = ar.result(g, dtype)
    if ar.gqa_reduce == "per_head_rounded":
        return ar.result(p.reduce_kv(per_head.to(g.dtype)), dtype)
    # expand_autograd: whatever autograd's backward of the K/V expansion does, in ``dtype``.
    leaf = torch.zeros(p.B, p.Hkv, p.Nk, p.D, dtype=dtype, device=g.device, requires_grad=True)
    with torch.enable_grad():
        (red,) = torch.autograd.grad(p.expand_kv(leaf), leaf, per_head)
    return ar.result(red, dtype)


class _OnlineAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, attn_mask, p, ar, order, bm, bn):
        out, lse = _run_forward(ar, p, query, key, value, attn_mask, order, bm, bn)
        ctx.save_for_backward(query, key, value, attn_mask, out, lse)
        ctx.config = (p, ar, bm, bn)
        lse = lse * LN2 if ar.base2 else lse
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        query, key, value, attn_mask, out, lse = ctx.saved_tensors
        p, ar, bm, bn = ctx.config
        want_dbias = bool(ctx.needs_input_grad[3])
        dq, dk, dv, dbias = _run_backward(
            ar, p, query, key, value, attn_mask, out, lse, dout, bm, bn, want_dbias
        )
        dmask = None
        if dbias is not None:
            dmask = _sum_to_shape(dbias, attn_mask.shape).to(attn_mask.dtype)
        return (
            ar.result(dq, query.dtype), _reduce_kv_grad(ar, p, dk, key.dtype),
            _reduce_kv_grad(ar, p, dv, value.dtype), dmask, None, None, None, None, None,
        )


SWITCH_DEFAULTS = dict(
    gqa_reduce="per_head_fp32", flush_subnormals=False, scale_at="scores",
    p_precision="input", ds_precision="input", ds_scale="after_round", tf32=False,
    normalize="divide", exp_accuracy="library", tf32_rounding="nearest", kv_splits=1,
    bwd_scores="as_forward", accumulate="blocked", fp32_dot="ieee", bias_fma="none",
    ds_p_precision="fp32",
)


def _make_arith(dtype, precision, **switches) -> _Arith:
    """Validate the implementation switches of ``online_attention`` and build its _Arith."""
    unknown = set(switches) - set(SWITCH_DEFAULTS)
    if unknown:
        raise ValueError(
            f"unknown switch(es) {sorted(unknown)}; expected some of {list(SWITCH_DEFAULTS)}"
        )
    sw = {**SWITCH_DEFAULTS, **switches}
    ar = _Arith(
        dtype, precision,
        gqa_reduce=check_choice("gqa_reduce", sw["gqa_reduce"], GQA_REDUCES),
        flush_subnormals=check_flag("flush_subnormals", sw["flush_subnormals"]),
        scale_at=check_choice("scale_at", sw["scale_at"], SCALE_ATS),
        p_precision=check_choice("p_precision", sw["p_precision"], OPERAND_PRECISIONS),
        ds_precision=check_choice("ds_precision", sw["ds_precision"], OPERAND_PRECISIONS),
        ds_scale=check_choice("ds_scale", sw["ds_scale"], DS_SCALES),
        tf32=check_flag("tf32", sw["tf32"]),
        normalize=check_choice("normalize", sw["normalize"], NORMALIZES),
        exp_accuracy=check_choice("exp_accuracy", sw["exp_accuracy"], EXP_ACCURACIES),
        tf32_rounding=check_choice("tf32_rounding", sw["tf32_rounding"], TF32_ROUNDINGS),
        kv_splits=check_count("kv_splits", sw["kv_splits"]),
        bwd_scores=check_choice("bwd_scores", sw["bwd_scores"], BWD_SCORES),
        accumulate=check_choice("accumulate", sw["accumulate"], ACCUMULATES),
        fp32_dot=check_choice("fp32_dot", sw["fp32_dot"], FP32_DOTS),
        bias_fma=check_choice("bias_fma", sw["bias_fma"], BIAS_FMAS),
        ds_p_precision=check_choice("ds_p_precision", sw["ds_p_precision"],
                                    OPERAND_PRECISIONS),
    )
    if sw["accumulate"] == "input_dtype" and sw["gqa_reduce"] != "per_head_fp32":
        raise ValueError(f"accumulate='input_dtype' reduces a GQA group itself (heads into "
                         f"one input-dtype accumulator); got gqa_reduce={sw['gqa_reduce']!r}")
    if ar.bwd_k_prescaled and (sw["scale_at"] not in ("scores", "exp2") or ar.bias_split):
        raise ValueError(f"bwd_scores='k_prescaled': only with scale_at='scores' or 'exp2' "
                         f"and bias_fma='none' (the scale folded into K in the backward "
                         f"alone); got scale_at={sw['scale_at']!r}, "
                         f"bias_fma={sw['bias_fma']!r}")
    if ar.bias_split and sw["scale_at"] not in ("exp2", "scores"):
        raise ValueError(f"bias_fma='split': only with scale_at='exp2' (the score in base 2 "
                         f"as QKᵀ·c plus bias·log2 e) or 'scores' (QKᵀ·scale plus bias, "
                         f"natural exp); got scale_at={sw['scale_at']!r}")
    if ar.tf32 and (dtype != torch.float32 or precision != "emulate"):
        raise ValueError(
            f"tf32: only for float32 inputs with precision='emulate'; got {dtype} "
            f"with precision={precision!r}"
        )
    if ar.x3tf32 and (dtype != torch.float32 or precision != "emulate" or ar.tf32
                      or sw["accumulate"] == "fma_chain"):
        raise ValueError(
            f"fp32_dot='3xtf32': only for float32 inputs with precision='emulate', without "
            f"tf32=True or accumulate='fma_chain'; got {dtype} with precision={precision!r}, "
            f"tf32={ar.tf32}, accumulate={sw['accumulate']!r}"
        )
    if ar.tf32 and sw["accumulate"] == "fma_chain":
        # TF32 products run on tensor cores (blocked sums), never as a chain of scalar FMAs
        raise ValueError("accumulate='fma_chain' excludes tf32=True: TF32 dot products run "
                         "on tensor cores; use accumulate='blocked' with tf32")
    return ar


def online_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
    enable_gqa=False, *, block_m=64, block_n=64, order="fa2", precision="emulate",
    window=None, causal_alignment="top_left", return_lse=False,
    gqa_reduce="per_head_fp32", flush_subnormals=False, scale_at="scores",
    p_precision="input", ds_precision="input", ds_scale="after_round", tf32=False,
    normalize="divide", exp_accuracy="library", tf32_rounding="nearest", kv_splits=1,
    bwd_scores="as_forward", accumulate="blocked", fp32_dot="ieee", bias_fma="none",
    ds_p_precision="fp32",
):
    """Blocked online-softmax attention (contracts.md §1), FA2 or FA1 loop order.

    ``precision="exact"``: float64 throughout, float64 output. ``precision="emulate"``:
    the arithmetic of a real kernel (see the module docstring), output in the input dtype.
    ``return_lse=True`` also returns lse (B, Hq, Nq) in the accumulator dtype (not
    differentiable). Gradients come from the blocked FlashAttention-2 backward.

    Implementation choices (the defaults are the arithmetic described in the module
    docstring; reference/family.py names the kernels that make each other choice):

    - ``gqa_reduce``: how dK/dV of a GQA group's query heads become one kv head's
      gradient. ``"per_head_fp32"``: per query head in fp32, summed over the group in
      fp32, rounded once. ``"group_fp32"``: one fp32 accumulator per kv head, into which
      every query head of the group adds its products tile by tile (heads inner), rounded
      once. ``"per_head_rounded"``: each head's dK/dV rounded to the input dtype, summed
      in fp32, rounded again. ``"expand_autograd"``: each head's rounded dK/dV reduced by
      autograd's own backward of the K/V expansion (``repeat_interleave``) in the input
      dtype; torch accumulates that sum in fp32, so on the CPU (torch 2.13) it equals
      ``"per_head_rounded"`` bit for bit.
    - ``flush_subnormals``: flush to zero the subnormals of the input dtype in P and dS
      after rounding and in the results, and those of the accumulator dtype in the
      inputs as read (DAZ), the scores, every exp, every matmul result and the
      accumulators after each update (FTZ arithmetic).
    - ``scale_at``: ``"scores"`` S = (Q Kᵀ)·scale in the accumulator; ``"q"`` Q·scale
      rounded to the input dtype before the product; ``"exp2"`` S = (Q Kᵀ)·c with the
      single constant c = fl(scale·log2 e), softmax in base 2 (m, ℓ, exp2, lse in log2
      units; the returned lse is converted back to natural units); ``"q_exp2"`` Q·c
      rounded to the input dtype before the product, softmax in base 2; ``"exp2_fma"``
      base 2 with the scale fused into the exponent: m is the max of fl(QKᵀ·c), but
      P = 2^fl(QKᵀ·c − m) with one rounding (an FFMA of the raw score), in the forward
      and in the backward's recomputation of P (an additive bias is added, times log2 e,
      to the exact product in float64); ``"qk_sqrt"`` S = (Q·r)(K·r)ᵀ with r = fl(√scale)
      and both products rounded in the accumulator dtype (PyTorch's math SDPA). The scale
      enters dQ and dK as ``ds_scale`` says, with the unscaled Q, whatever ``scale_at``.
    - ``p_precision`` / ``ds_precision``: ``"input"`` P (resp. dS) rounded to the input
      dtype before the P@V and PᵀdO (resp. dS@K and dSᵀQ) products; ``"fp32"`` kept in the
      accumulator dtype.
    - ``ds_scale``: ``"after_round"`` the scale multiplies the accumulated dQ and dK;
      ``"before_round"`` it multiplies dS before dS is rounded.
    - ``ds_p_precision``: the P of dS = P∘(dP − delta): ``"fp32"`` as recomputed;
      ``"input"`` rounded to the input dtype, the operand the PᵀdO product takes (CUTLASS's
      memory-efficient backward reads dS's P back from that fp16/bf16 tile).
    - ``tf32``: float32 inputs only: every matmul operand rounded to TF32
      (``round_tf32``), fp32 accumulation; ``tf32_rounding="truncate"``: the operands'
      low 13 mantissa bits dropped instead (``truncate_tf32``, Hopper's wgmma).
    - ``normalize``: ``"divide"`` O = acc / ℓ; ``"reciprocal"`` O = acc · fl(1/ℓ);
      ``"before_pv"``: the probabilities normalised before the P@V product, P = e^(s−m)/ℓ
      with the row's final m and ℓ (a pass over every key tile first), rounded to the input
      dtype, O = Σ P·V (an unfused softmax then a matmul; ``order`` "fa2" only).
    - ``exp_accuracy``: ``"library"`` torch's exp/exp2; ``"approx"`` every exponential
      (the forward's and the backward's P, the rescale factors) rounded to 22 significant
      bits (``round_exp_approx``; fp32 accumulators only), the error of GPUs' ex2.approx;
      ``"fwd_fast_low"``/``"fwd_fast_high"`` the forward's probabilities (not its rescale
      factors, not the backward's P) times 1 − / 1 + ``FAST_EXP_REL`` (2^-13): a forward
      with a fast vectorised exp, whose lse is then that much low or high in every row
      while the backward's accurate P sums to 1 ± 2^-13 per row. Every P of the forward,
      its rounding, ℓ and each gradient term move monotonically with such a shift, so the
      two ends bracket a kernel whose exp errs anywhere between them.
    - ``kv_splits`` (int >= 1): 1 is the plain forward. S > 1 is the split-KV forward: the
      key tiles (of ``block_n`` keys) are cut into S contiguous runs of ceil(tiles / S)
      whole tiles (``split_chunks``; trailing runs are empty when there are fewer tiles);
      the forward of ``order`` (FA2, or FA1: both are supported) runs on each run alone,
      with every other switch as given, ending in O_s = acc_s/ℓ_s (``normalize``) in the
      accumulator dtype and lse_s (−inf for a run with no allowed key); ``merge_splits``
      combines them in the accumulator dtype (lse = m + log Σ_s e^(lse_s − m),
      m = max_s lse_s; O = Σ_s e^(lse_s − lse)·O_s), and O is rounded once to the input
      dtype. The returned lse is the merged one; rows with no allowed key give 0 and −inf as
      without splits. Only the forward changes: the backward is the FA2 backward from the
      merged O and lse.
    - ``bwd_scores``: ``"as_forward"`` the backward recomputes QKᵀ with the forward's
      product, bit for bit; ``"k16"`` (``"k8"``, ``"k1"``) it sums the head dim in steps of
      16 (8, 1: one fused multiply-add per product) (``K_STEPS``), so P = exp(S_bwd − lse)
      uses another rounding of each score than the lse did and no longer sums to exactly 1
      (a backward kernel with its own GEMM blocking or MMA k-steps); ``"k_prescaled"``
      it recomputes S as Q·fl(K·scale) (times log2 e in base 2), K·scale rounded in the
      accumulator dtype, where the forward scaled the rounded QKᵀ (a GEMM whose alpha the
      BLAS folds into its packed operand). Only with ``scale_at`` "scores" or "exp2".
    - ``accumulate``: ``"blocked"`` each tile's product summed by a matmul, then added to
      the accumulator; ``"fma_chain"`` (fp32 accumulators; float64 stays exact) the
      backward's dQ, dK and dV each one running fp32 sum, one fused multiply-add per product
      (acc = fl(acc + a·b)), dQ over the keys in order, dK/dV over the query rows in order,
      per query head or, with ``gqa_reduce="group_fp32"``, through the group's heads one
      after the other (Triton's IEEE fp32 ``tl.dot(a, b, acc)``); dP = dO Vᵀ likewise, one
      running sum over the head dim in order (a row of constant V makes its rounding
      coherent, and dP − D then keeps it). The forward's products and the backward's
      scores stay blocked (sums over the head dim or within one tile). ``"input_dtype"``:
      dQ, dK and dV held in the input dtype between tiles: each tile's fp32 product (times
      the scale, for dQ and dK) is added to the running value and the sum rounded to the
      input dtype, dQ over the key tiles in order, dK/dV over the query tiles in order, a
      GQA group's query heads into their kv head's one accumulator, head after head
      (``gqa_reduce`` must stay at its default). PyTorch's CPU flash backward does this: its
      gradient buffers are the inputs' dtype, each cpublas GEMM adds with beta = 1.
    - ``fp32_dot``: float32 inputs only: ``"ieee"`` fp32 products; ``"3xtf32"`` every
      matmul as three TF32 tensor-core products of the operands split into a truncated
      TF32 part and a rounded TF32 remainder (``_mm_3xtf32``; CUTLASS's
      OpMultiplyAddFastF32, which PyTorch's memory-efficient SDPA uses for fp32 from sm80
      on), about 2^-20 relative per product.
    - ``bias_fma`` (with ``scale_at="exp2"`` and an additive bias): ``"none"`` the score is
      fl(fl(QKᵀ·c) + fl(bias·log2 e)) in both passes; ``"split"`` the forward rounds it once
      as one FMA of the exact QKᵀ·c and fl(bias·log2 e), the backward as one FMA of the
      exact bias·log2 e and fl(QKᵀ·c): the compiler contracted the same source line two
      ways in two kernels, so the backward's P = 2^(S − lse) uses another rounding of each
      score than the lse did (our Triton kernels on sm_90, fp32).
    """
    p = check_attention_args(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window,
        causal_alignment,
    )
    bm = check_block("block_m", block_m)
    bn = check_block("block_n", block_n)
    order = check_choice("order", order, ORDERS)
    precision = check_choice("precision", precision, PRECISIONS)
    ar = _make_arith(
        query.dtype, precision, gqa_reduce=gqa_reduce, flush_subnormals=flush_subnormals,
        scale_at=scale_at, p_precision=p_precision, ds_precision=ds_precision,
        ds_scale=ds_scale, tf32=tf32, normalize=normalize, exp_accuracy=exp_accuracy,
        tf32_rounding=tf32_rounding, kv_splits=kv_splits, bwd_scores=bwd_scores,
        accumulate=accumulate, fp32_dot=fp32_dot, bias_fma=bias_fma,
        ds_p_precision=ds_p_precision,
    )
    if precision == "exact":
        query, key, value = (t.to(torch.float64) for t in (query, key, value))
    out, lse = _OnlineAttention.apply(query, key, value, attn_mask, p, ar, order, bm, bn)
    return (out, lse) if return_lse else out

"""A small correct Triton flash-attention forward with constexpr switches for planted bugs.

`TritonForward` launches `_fwd_kernel`: FA2 forward, one program per (query tile, batch*head),
BLOCK_M = BLOCK_N = `block` (16 unless a subclass says otherwise), fp32 accumulation, P
rounded to the input dtype before P@V, the causal/window rules computed from indices in the
kernel, and `attn_mask` read as an fp32 bias through its (possibly zero, i.e. broadcast)
strides. It is the base for the bugs that
live in Triton code rather than in the algorithm; each is a `tl.constexpr` switch that a
mutant flips by setting one class attribute:

- `mask_tail = False`: the last key tile's out-of-range columns are loaded as zeros but
  not masked to -inf, so they take softmax weight when Nk % 16 != 0.
- `contiguous_strides = True`: the kernel ignores the stride arguments and derives strides
  from the shape, as if every input were contiguous.
- `mask_batch0 = True`: the mask pointer omits the batch offset, so every batch reads the
  mask of batch 0.

Caveats: forward only (`capabilities["backward"]` is False; differentiating raises
NotImplementedError); fp16 and fp32 only, because triton 3.9's interpreter computes bf16
arithmetic and bf16 `tl.dot` wrongly; on the CPU it needs TRITON_INTERPRET=1 set before
triton is imported. fp32 inputs use IEEE dot products (`input_precision="ieee"`), never TF32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from flashcheck.verify.mutants._common import additive_bias, check_args, full_capabilities

BLOCK = 16  # the default tile; tl.dot needs every block dimension >= 16
INTERPRETED = None  # set below, once the kernel is defined


@triton.jit
def _fwd_kernel(
    Q, K, V, Bias, Out,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    sbb, sbh, sbm, sbn, sob, soh, som, sod,
    Hq, group, Nq, Nk, D, scale, off, left, right,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, MASK_TAIL: tl.constexpr, CONTIGUOUS_STRIDES: tl.constexpr,
    MASK_BATCH0: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    hk = h // group
    if CONTIGUOUS_STRIDES:
        Hkv = Hq // group
        sqb, sqh, sqm, sqd = Hq * Nq * D, Nq * D, D, 1
        skb, skh, skn, skd = Hkv * Nk * D, Nk * D, D, 1
        svb, svh, svn, svd = Hkv * Nk * D, Nk * D, D, 1
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = rows < Nq
    d_ok = offs_d < D
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if MASK_BATCH0:
        bias_base = Bias + h * sbh
    else:
        bias_base = Bias + b * sbb + h * sbh
    for start in range(0, Nk, BLOCK_N):
        cols = start + offs_n
        col_ok = cols < Nk
        kv_ok = col_ok[:, None] & d_ok[None, :]
        k = tl.load(K + b * skb + hk * skh + cols[:, None] * skn + offs_d[None, :] * skd,
                    mask=kv_ok, other=0.0)
        v = tl.load(V + b * svb + hk * svh + cols[:, None] * svn + offs_d[None, :] * svd,
                    mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        allowed = ((cols[None, :] <= rows[:, None] + off + right)
                   & (cols[None, :] >= rows[:, None] + off - left))
        if MASK_TAIL:
            allowed = allowed & col_ok[None, :]
        s = tl.where(allowed, s, float("-inf"))
        if HAS_BIAS:
            bias = tl.load(bias_base + rows[:, None] * sbm + cols[None, :] * sbn,
                           mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            s = s + bias
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_use[:, None])
        alpha = tl.exp(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    out = tl.where((l_i > 0)[:, None], acc / safe_l[:, None], 0.0)
    tl.store(Out + b * sob + h * soh + rows[:, None] * som + offs_d[None, :] * sod,
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


INTERPRETED = type(_fwd_kernel).__name__ == "InterpretedFunction"


class _NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, *inputs):
        return out

    @staticmethod
    def backward(ctx, grad_out):
        raise NotImplementedError("backward: this Triton forward has no backward pass")


class TritonForward:
    """Correct Triton FA2 forward; subclasses flip one bug switch."""

    block = BLOCK  # BLOCK_M = BLOCK_N; a power of two >= 16
    mask_tail = True
    contiguous_strides = False
    mask_batch0 = False
    capabilities = full_capabilities(
        dtypes=("float16", "float32"), backward=False,
        devices=("cpu", "cuda") if INTERPRETED else ("cuda",),
    )

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                 scale=None, enable_gqa=False, *, window=None, causal_alignment="top_left"):
        caps = self.capabilities
        p = check_args(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                       window, causal_alignment, dtypes=caps["dtypes"],
                       head_dims=caps["head_dims"])
        if query.device.type not in caps["devices"]:
            raise NotImplementedError(
                f"device must be one of {caps['devices']} (the CPU needs TRITON_INTERPRET=1), "
                f"got {query.device.type}"
            )
        unbounded = p.Nq + p.Nk  # further than any query/key distance
        left, right = p.window if p.window is not None else (-1, -1)
        left = unbounded if left < 0 else left
        right = unbounded if right < 0 else right
        if p.is_causal:
            right = min(right, 0)
        off = p.Nk - p.Nq if p.causal_alignment == "bottom_right" else 0
        bias = additive_bias(attn_mask, p)
        out = torch.empty((p.B, p.Hq, p.Nq, p.D), dtype=query.dtype, device=query.device)
        bias_arg = bias if bias is not None else out
        bias_strides = bias.stride() if bias is not None else (0, 0, 0, 0)
        grid = (triton.cdiv(p.Nq, self.block), p.B * p.Hq)
        _fwd_kernel[grid](
            query, key, value, bias_arg, out,
            *query.stride(), *key.stride(), *value.stride(), *bias_strides, *out.stride(),
            p.Hq, p.Hq // p.Hkv, p.Nq, p.Nk, p.D, p.scale, off, left, right,
            HAS_BIAS=bias is not None, BLOCK_M=self.block, BLOCK_N=self.block,
            BLOCK_D=max(BLOCK, triton.next_power_of_2(p.D)), MASK_TAIL=self.mask_tail,
            CONTIGUOUS_STRIDES=self.contiguous_strides, MASK_BATCH0=self.mask_batch0,
        )
        if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
            return _NoBackward.apply(out, query, key, value)
        return out

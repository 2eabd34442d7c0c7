"""Control: the softmax scale folded with log2(e) into one fp32 constant, exp2 for exp.

FlashAttention-2 (softmax.h: `scale_apply_exp2` with `softmax_scale_log2`), FlashAttention-3
and Triton's fused-attention tutorial (`qk_scale = sm_scale * 1.44269504`, `tl.math.exp2`)
compute exp(scale * s - m) as exp2(s * (scale * log2 e) - m'), with m' and the saved lse in
base-2 units (the tutorial stores m_i + log2(l_i)). The product scale * log2(e) is rounded
to fp32 once, so every logit carries a slightly different scale than scale * s would, and
the additive mask is multiplied by log2(e) as well. exp and exp2 differ by an fp32 rounding
or so; the change is far below the rounding of P to the input dtype. Correct.
"""

import math

import torch
from flashcheck.verify.mutants._blocked import BlockedAttention

LOG2E = math.log2(math.e)


class _Exp2FoldedScale(BlockedAttention):
    def logits(self, q, k_tile, bias, scale, dtype):
        # One fp32 constant, as the kernels pass it: float32(scale * log2 e).
        qk_scale = torch.tensor(scale * LOG2E, dtype=torch.float32).item()
        s = (q @ k_tile.transpose(-1, -2)) * qk_scale
        return s if bias is None else s + bias * LOG2E

    def exp(self, x):
        return torch.exp2(x)

    def log_sum_exp(self, m, l):
        return torch.where(l > 0, m + torch.log2(l), torch.full_like(m, float("-inf")))


attention = _Exp2FoldedScale()
capabilities = attention.capabilities

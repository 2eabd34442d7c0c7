"""Control: FlashAttention-2 CUDA's softmax — the scale fused into the exponent, 1/ℓ.

FlashAttention-2's CUDA kernels (softmax.h, `scale_apply_exp2`) compute
exp2f(s * scale_log2 - max_scaled) so that "the compiler can use the ffma instruction":
the raw score s times the fp32 constant scale·log2(e), minus the rounded scaled row max,
rounded once. The scaled score itself is never rounded, so the row max's own P is
2^(rounding error of s·c), not exactly 1. The output is normalised by multiplying with
the reciprocal of the row sum (O = acc · (1/ℓ)). Here: the scores are kept as exact
float64 products s·c (the FFMA's internal product), the running max and the saved
lse are rounded to fp32, and exp2 takes the difference rounded once to fp32. Correct: the
family member ``fa2_cuda_softmax`` (reference/family.py) makes the same choices.
"""

import math

import torch
from flashcheck.verify.mutants._blocked import NEG_INF, BlockedAttention

LOG2E = math.log2(math.e)


class _Fa2CudaSoftmax(BlockedAttention):
    def logits(self, q, k_tile, bias, scale, dtype):
        c = torch.tensor(scale * LOG2E, dtype=torch.float32).item()
        s = (q @ k_tile.transpose(-1, -2)).double() * c  # exact: 24 + 24 bits
        return s if bias is None else s + bias.double() * LOG2E

    def running_max(self, m, s):
        # The row max as the kernel keeps it: an fp32 register (fl(max s·c) = max fl(s·c)),
        # so alpha = exp2(m_old - m_new) is exactly 1 while the max does not change.
        return torch.maximum(m, s.amax(dim=-1)).float().double()

    def safe_max(self, m):
        return torch.where(m == NEG_INF, torch.zeros_like(m), m).float().double()

    def exp(self, x):
        return torch.exp2(x.float())  # x = s·c − fl(m): one rounding, as the FFMA

    def log_sum_exp(self, m, l):
        return torch.where(l > 0, m.float() + torch.log2(l),
                           torch.full_like(l, NEG_INF))

    def finalize(self, acc, l):
        safe_l = torch.where(l > 0, l, torch.ones_like(l))
        return torch.where((l > 0)[..., None], acc * (1 / safe_l)[..., None],
                           torch.zeros_like(acc))


attention = _Fa2CudaSoftmax()
capabilities = attention.capabilities

"""Control: dS multiplied by the softmax scale before it is rounded to the input dtype.

The baseline (FlashAttention-2's CUDA backward, Triton's fused-attention tutorial) rounds
dS = P * (dP - delta) to the input dtype and multiplies dS K and dS^T Q by the scale
afterwards in fp32. FlashAttention's Triton backward (flash_attn/flash_attn_triton.py:
`ds = (p * (dp - Di[:, None]) * softmax_scale).to(q.dtype)`) and the many kernels copied
from it fold the scale into dS first and round scale * dS. The two differ by where one
rounding falls;
because the scale is not a power of two in general, the rounded values differ by about one
input-dtype unit roundoff of |dS|. Correct. No effect when the scale is a power of two (the
default 1/sqrt(D) at D = 4, 16, 64, 256), except where scale * dS falls below the smallest
normal of the input dtype and its rounding grid is absolute.
"""

from flashcheck.verify.mutants._blocked import BlockedAttention


class _DsScaledBeforeRound(BlockedAttention):
    def ds_scales(self, scale):
        return scale, 1.0


attention = _DsScaledBeforeRound()
capabilities = attention.capabilities

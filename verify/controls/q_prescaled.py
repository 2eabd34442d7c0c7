"""Control: Q multiplied by the softmax scale and rounded to the input dtype before QK^T.

Earlier versions of Triton's fused-attention tutorial, the Triton flash-attention of ROCm's
FlashAttention port and many kernels derived from them do `q = (q * qk_scale).to(dtype)`
once per query block instead of scaling every logit (they fold log2(e) into qk_scale too;
exp2_folded_scale.py covers that part); PyTorch's math SDPA backend multiplies q and k by
sqrt(scale), but in fp32 (qk_sqrt_scaled.py). For fp16/bf16 the
scaled Q is rounded to the input dtype, which perturbs each logit by about one input-dtype
unit roundoff of |scale * q||k| — the same order as rounding q itself, so it is a correct
choice with a somewhat larger logit error than the baseline's fp32 multiply. The backward
recomputes P from the same prescaled Q (it must, to match the saved lse); dQ and dK are the
usual scale * dS K and scale * dS^T Q. No effect when the scale is a power of two (the
default 1/sqrt(D) at D = 4, 16, 64, 256): then q * scale is exact.

It declares the choice (``capabilities["family"]``): rounding scale·Q perturbs every logit
by up to u·|s|, which at large logits changes the softmax itself, so the harness judges a
kernel against that member only when the kernel says it makes the choice.
"""

from flashcheck.verify.mutants._blocked import BlockedAttention
from flashcheck.verify.mutants._common import full_capabilities


class _QPrescaled(BlockedAttention):
    capabilities = full_capabilities(family=("q_prescaled",))

    def logits(self, q, k_tile, bias, scale, dtype):
        s = (q * scale).to(dtype).float() @ k_tile.transpose(-1, -2)
        return s if bias is None else s + bias


attention = _QPrescaled()
capabilities = attention.capabilities

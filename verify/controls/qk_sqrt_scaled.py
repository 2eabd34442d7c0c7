"""Control: Q and K each multiplied by fl(√scale) in fp32 before QKᵀ (PyTorch's math SDPA).

PyTorch's math backend (``_scaled_dot_product_attention_math``) scales both operands by the
square root of the softmax scale "for numerical stability" (fp16/bf16 inputs are upcast to
fp32 first), then takes softmax((Q·r)(K·r)ᵀ) and lets autograd form the gradients. Each of
the 2·N·D products is rounded in fp32, which amounts to perturbing Q and K by one fp32 unit
roundoff; the scores carry that perturbation coherently, so at large logits (|s| ~ 1e4, fp32)
dq and dk are a few times the baseline's error, while the answer is as correct as any other
ordering of the same arithmetic. No effect when √scale is a power of two (the default
1/√D at D = 16 and 256). The backward recomputes P from the same scaled operands; dQ and dK
are scale·dS K and scale·dSᵀQ.

It declares the choice (``capabilities["family"]``, member ``qk_sqrt_scaled``): that member
widens the fp32 large-logit tolerance, so the harness uses it only for kernels that say they
make the choice (the ``sdpa-math`` built-in does).
"""

import math

import torch
from flashcheck.verify.mutants._blocked import BlockedAttention
from flashcheck.verify.mutants._common import full_capabilities


class _QKSqrtScaled(BlockedAttention):
    capabilities = full_capabilities(family=("qk_sqrt_scaled",))

    def logits(self, q, k_tile, bias, scale, dtype):
        r = torch.tensor(math.sqrt(scale), dtype=torch.float32).item()
        s = self.mm(q * r, (k_tile * r).transpose(-1, -2))
        return s if bias is None else s + bias


attention = _QKSqrtScaled()
capabilities = attention.capabilities

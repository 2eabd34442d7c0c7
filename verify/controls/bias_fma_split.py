"""Control: the biased score contracted one way in the forward, another in the backward.

A kernel computes each score as QKᵀ·scale + bias. With floating-point contraction (the CUDA
compilers' default) that line becomes one fused multiply-add, and which product stays exact
is the compiler's choice per kernel: our Triton forward keeps QKᵀ·c exact and adds the
rounded bias term, its backward kernels round QKᵀ·c and add the bias term exactly. The
backward's P = exp(S − lse) then comes from another rounding of each score than the
forward's lse, ~u·|S| relative, which dQ and dK inherit at large logits. This control makes
that choice in natural-log units: the forward rounds QKᵀ·scale + bias once (the product
exact), the backward rounds QKᵀ·scale and then the sum. Declaring the choice
(``capabilities["family"]``) brings two members: ``bias_fma_split`` makes it in base 2
(scale·log2 e folded, exp2), not this arithmetic, and ``bias_fma_split_e`` in natural-log
units, this arithmetic (the base-2 member alone let this control fail at 1.08x, fp32 D 1,
logits ~1e3: tests/test_controls.py). Its own code on the base's hooks. Correct.
"""

import torch
from flashcheck.verify.mutants._blocked import BlockedAttention
from flashcheck.verify.mutants._common import full_capabilities


class _BiasFmaSplit(BlockedAttention):
    # an opt-in member (reference/family.py OPT_IN): the kernel that makes the choice says so
    capabilities = full_capabilities(family=("bias_fma_split",))

    def logits(self, q, k_tile, bias, scale, dtype):
        raw = self.mm(q, k_tile.transpose(-1, -2))
        c = torch.tensor(scale, dtype=raw.dtype).item()  # the kernel's fp32 scale argument
        if bias is None or self.in_backward:
            s = raw * c
            return s if bias is None else s + bias
        # one rounding of the exact product plus the bias (both fit float64 exactly)
        return (raw.to(torch.float64) * c + bias.to(torch.float64)).to(raw.dtype)


attention = _BiasFmaSplit()
capabilities = attention.capabilities

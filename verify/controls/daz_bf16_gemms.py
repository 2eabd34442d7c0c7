"""Control: the backward's matrix products read subnormal inputs as zero; D_i keeps them.

x86 CPUs with AVX512-BF16 form bf16 dot products with ``VDPBF16PS``, which treats subnormal
inputs as zero (DAZ) whatever the MXCSR flags say. PyTorch's CPU flash-attention backward
runs its bf16 GEMMs there (dP = dO·Vᵀ among them) but forms D_i = rowsum(dO ∘ O) elementwise
in fp32, which keeps a subnormal dO. At subnormal-scale dO the two sums that
dS_ij = P_ij (dP_ij − D_i) subtracts then disagree by the whole subnormal share of D_i, a
normal number once it is multiplied by |O| ~ 10 (bf16, one key, dO = 9.5e-39, V = 11.75:
dS = −1.1e-37, dq −2.2e-36 where the exact value is 0). The mirror image of the ftz_delta
control, and like it the accepted flush-to-zero choice of docs/DESIGN.md section 5: every
dropped input is below fp32's smallest normal (verify/bounds.py, ``ftz_allowance``).

Here every product of the backward (dP, dS·K, dSᵀ·Q, Pᵀ·dO) reads its operands with the
entries below fp32's smallest normal set to zero, for every input dtype (an fp16 value is
never below it); D_i, the forward and the scores are the mutant base's.
"""

import torch
from flashcheck.verify.mutants._blocked import BlockedAttention

_TINY = torch.finfo(torch.float32).tiny


def _daz(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x.abs() < _TINY, torch.zeros_like(x), x)


class _DazBackwardGemms(BlockedAttention):
    def mm(self, a, b):
        if self.in_backward:
            a, b = _daz(a), _daz(b)
        return a @ b


attention = _DazBackwardGemms()
capabilities = attention.capabilities

"""Control: flush-to-zero in the backward's D_i = rowsum(dO ∘ O) alone.

FlashAttention-2's CUDA build uses ``--use_fast_math`` (``-ftz=true``): its backward
preprocessing kernel forms D_i = Σ_d dO_id·O_id in fp32 with every subnormal product
flushed, while dP = dO·Vᵀ runs on tensor cores, which read bf16/fp32-range subnormal dO as it
is. The two sums that dS_ij = P_ij (dP_ij − D_i) subtracts then disagree by up to the
flushed mass, and at subnormal-scale dO (bf16, dO = tiny) dq and dk come out several
smallest normals away from the exact value, in either direction. Every dropped product is
below fp32's smallest normal, so this is the accepted flush-to-zero choice of
docs/DESIGN.md section 5 (verify/bounds.py, ``ftz_allowance``).
"""

import torch
from flashcheck.verify.mutants._blocked import BlockedAttention

_TINY = torch.finfo(torch.float32).tiny


class _DeltaFlushToZero(BlockedAttention):
    def delta(self, grad_out, out):
        prod = grad_out.float() * out.float()
        return torch.where(prod.abs() < _TINY, torch.zeros_like(prod), prod).sum(dim=-1)


attention = _DeltaFlushToZero()
capabilities = attention.capabilities

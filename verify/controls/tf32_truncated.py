"""Control: fp32 dot products on TF32 tensor cores that truncate their operands (declares
``tf32=True``).

On Hopper (sm_90) Triton's fp32 ``tl.dot`` at its default ``input_precision="tf32"`` is a
``wgmma`` whose fp32 operands come straight from shared memory with no ``cvt`` instruction:
the tensor core reads the top 19 bits of each operand, i.e. drops the 13 low mantissa bits
(round toward zero). The relative error per operand is below 2^-10, twice that of the
round-to-nearest conversion Ampere kernels emit (the ``tf32_matmuls`` control). On the H200,
the fasterkernels package's fp32 output (B1 H1 Nq1 Nk1 D16, docs/reports/outside/) equals
this truncation bit for bit. Correct; judged with the ``tf32_truncated`` member.
"""

import torch
from flashcheck.verify.mutants._blocked import BlockedAttention


def _tf32_truncated(x: torch.Tensor) -> torch.Tensor:
    """x truncated to 11 significant bits (toward zero), as fp32; inf/NaN kept. Not
    reference.truncate_tf32 (bit masking): a control that shared the member's code would
    pass it by construction."""
    m, e = torch.frexp(x.double())  # x = m · 2^e, 0.5 <= |m| < 1: 11 bits are m · 2^11
    r = torch.ldexp(torch.trunc(m * 2048) / 2048, e)
    return torch.where(torch.isfinite(x), r, x.double()).float()


class _Tf32Truncated(BlockedAttention):
    def mm(self, a, b):
        return _tf32_truncated(a) @ _tf32_truncated(b)


attention = _Tf32Truncated()
attention.capabilities = {**attention.capabilities, "tf32": True}
capabilities = attention.capabilities

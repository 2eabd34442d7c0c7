"""Control: fp32 dot products on TF32 tensor cores (declares ``tf32=True``).

Triton's ``tl.dot`` on fp32 operands defaults to ``input_precision="tf32"`` on NVIDIA GPUs
(Ampere and later), and cuBLAS/cuDNN do the same under ``allow_tf32``: each operand of every
product (QKᵀ, P·V, dO·Vᵀ, dS·K, dSᵀ·Q, Pᵀ·dO) is rounded to TF32 (10 explicit mantissa bits,
round to nearest with ties away from zero, PTX ``cvt.rna.tf32.f32``) and the products are
accumulated in fp32. For fp32 inputs that is 2¹³× the unit roundoff of IEEE fp32 on every
operand; fp16 and bf16 operands are already exact in TF32, so nothing changes for them. A
kernel that declares ``tf32`` is judged with the ``tf32`` member on its fp32 cases.
"""

import torch
from flashcheck.verify.mutants._blocked import BlockedAttention


def _tf32(x: torch.Tensor, *, truncate: bool = False) -> torch.Tensor:
    """x to 11 significant bits, as fp32: rounded (ties away from zero) or truncated (toward
    zero); inf/NaN kept. Not reference.round_tf32 / truncate_tf32 (bit masking): a control
    that shared the member's code would pass it by construction."""
    m, e = torch.frexp(x.double())  # x = m · 2^e, 0.5 <= |m| < 1: 11 bits are m · 2^11
    half = 0.0 if truncate else 0.5
    r = torch.ldexp(torch.sign(m) * torch.floor(m.abs() * 2048 + half) / 2048, e)
    return torch.where(torch.isfinite(x), r, x.double()).float()


class _Tf32(BlockedAttention):
    truncate = False  # the tf32_truncated control sets it

    def mm(self, a, b):
        return _tf32(a, truncate=self.truncate) @ _tf32(b, truncate=self.truncate)


attention = _Tf32()
attention.capabilities = {**attention.capabilities, "tf32": True}
capabilities = attention.capabilities

"""Control: exp2 with the scale folded in, computed to 22 significant bits (approximate exp2).

NVIDIA GPUs have no correctly rounded exponential instruction: `exp2f`, and `expf`/`__expf`
under `--use_fast_math`, compile to `ex2.approx.f32` (after a multiply by log2 e for exp),
whose result is within 2^-22 relative of 2^x. FlashAttention-2's CUDA softmax
(`exp2f` in softmax.h, built with fast math), PyTorch's memory-efficient SDPA backend
(CUTLASS, fast math) and every Triton kernel (`tl.exp2` and `tl.exp` lower to
`ex2.approx.f32`) compute P this way. This control is the exp2_folded_scale control with each
exponential rounded to 22 significant bits, an error as large as the instruction's bound.
It matters only for fp32 inputs, where P is not rounded to the input dtype afterwards: there
P carries ~4x the error of a correctly rounded exponential. Correct.
"""

import torch
from flashcheck.verify.controls.exp2_folded_scale import _Exp2FoldedScale


def _round22(x: torch.Tensor) -> torch.Tensor:
    """fp32 x rounded to 22 significant bits (nearest), as fp32; inf/NaN/other dtypes kept.
    Not reference.round_exp_approx (bit masking): a control sharing the member's code would
    pass it by construction."""
    if x.dtype != torch.float32:
        return x
    m, e = torch.frexp(x.double())  # 0.5 <= |m| < 1: 22 bits are m · 2^22
    r = torch.ldexp(torch.floor(m * 2.0**22 + 0.5) / 2.0**22, e)
    return torch.where(torch.isfinite(x), r, x.double()).float()


class _Exp2Approx(_Exp2FoldedScale):
    def exp(self, x):
        return _round22(torch.exp2(x))


attention = _Exp2Approx()
capabilities = attention.capabilities

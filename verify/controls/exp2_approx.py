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
from flashcheck.reference.online import round_exp_approx
from flashcheck.verify.controls.exp2_folded_scale import _Exp2FoldedScale


class _Exp2Approx(_Exp2FoldedScale):
    def exp(self, x):
        return round_exp_approx(torch.exp2(x))


attention = _Exp2Approx()
capabilities = attention.capabilities

"""Mutant: P is rounded to bf16, not fp16, before P@V (and P^T dO) on fp16 inputs.

A dtype mix-up seen in kernels written for bf16 first (`p.to(tl.bfloat16)` hard-coded, or
the P cast taking the dtype of another tensor): on fp16 inputs P keeps 8 bits of mantissa
instead of 11, so the rounding of P, the largest rounding of the flash algorithm, is 8x
larger (unit roundoff 2^-8 instead of 2^-11). It bites on fp16 inputs only, on out and dV
(and through them dQ, dK via delta); bf16 and fp32 inputs are rounded as usual. A precision
bug: the outputs are close everywhere, about 3-10x the error of a correct fp16 kernel, so it
is caught only by a bound tied to fp16's unit roundoff, not by a bf16-sized tolerance.
"""

import torch
from flashcheck.verify.mutants._blocked import BlockedAttention


class _PBf16ForFp16(BlockedAttention):
    def round_p(self, p, dtype):
        return p.to(torch.bfloat16 if dtype == torch.float16 else dtype).float()


attention = _PBf16ForFp16()
capabilities = attention.capabilities

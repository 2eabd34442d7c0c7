"""Mutant: each key tile's P@V product is accumulated in fp16 before joining the fp32 acc.

The bug of `tl.dot(p, v, out_dtype=tl.float16)` (or an mma with an f16 accumulator, or
`acc += tl.dot(p, v).to(tl.float16)`): the running accumulator is fp32 as it should be, but
every tile's partial sum P_tile @ V_tile is rounded to fp16 (unit roundoff 2^-11) before it
is added. It differs from `fp16_accumulation`, which stores the running acc and l in fp16
across tiles: here the fp32 accumulator is intact and the error is one fp16 rounding of the
unnormalised tile sum per tile, whatever the input dtype. A precision bug: every output is
close, only its error is too large. On fp32 inputs that is ~2^13 times the fp32 rounding a
correct kernel makes (100-2000x the blocked baseline's max error measured at N <= 128);
on fp16 inputs it adds one more rounding of the size of the rounding of P (1.2-1.7x the
baseline's error on out at N <= 128, 4x on dK in the worst fuzzed case); on bf16 inputs fp16
is finer than the bf16 output rounding and it hides, except where fp16's range is too small
(tile sums above 65504 overflow, below 6e-8 flush to zero).
"""

import torch
from flashcheck.verify.mutants._blocked import BlockedAttention


class _PvFp16Accumulation(BlockedAttention):
    def update(self, acc, pv, alpha, l_prev, l_new):
        return alpha[..., None] * acc + pv.to(torch.float16).float()


attention = _PvFp16Accumulation()
capabilities = attention.capabilities

"""Mutant: the running accumulator and l are stored in fp16 instead of fp32.

A precision bug: the answer has the right shape everywhere, only its error is too large.
Each key tile rounds acc and l to fp16 (unit roundoff 2^-11), so the error grows with the
number of tiles. On fp32 inputs that is ~2^13 times the fp32 rounding the bound allows; on
fp16 inputs it is a few times the baseline, visible for long N; on bf16 inputs fp16 storage
is more precise than bf16 output rounding and mostly hides. It is caught only by bounds tied
to the dtype's unit roundoff, never by a loose atol.
"""

import torch
from flashcheck.verify.mutants._blocked import BlockedAttention


class _Fp16Accumulation(BlockedAttention):
    def accumulator_dtype(self, dtype):
        return torch.float16


attention = _Fp16Accumulation()
capabilities = attention.capabilities

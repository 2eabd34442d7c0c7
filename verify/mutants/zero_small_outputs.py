"""Adversarial: computes the right answer, then flushes every small |out| to zero.

LOOSE_BF16_ATOL is the loose absolute tolerance commonly used for bf16 attention tests, so
the output passes `allclose(atol=LOOSE_BF16_ATOL)` on every input, yet it is wrong by up to
that much wherever outputs are small (long rows average values toward 0, so many are). A
harness defeats it with per-element bounds scaled to the dtype's unit roundoff and the
output's magnitude. Bites on any case with outputs in (0, LOOSE_BF16_ATOL), most clearly in
fp16 and fp32.
"""

import torch
from flashcheck.verify.mutants._blocked import BlockedAttention

# The atol this kernel is built to slip under: the 1e-2 of common bf16 attention tests,
# about 1.3 bf16 ulps at |out| = 1 (ulp = 2u = 2^-7 = 7.8e-3 with u = 2^-8).
LOOSE_BF16_ATOL = 1e-2


class _ZeroSmallOutputs(BlockedAttention):
    def finalize(self, acc, l):
        out = super().finalize(acc, l)
        return torch.where(out.abs() < LOOSE_BF16_ATOL, torch.zeros_like(out), out)


attention = _ZeroSmallOutputs()
capabilities = attention.capabilities

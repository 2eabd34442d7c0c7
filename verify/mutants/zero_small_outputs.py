"""Adversarial: computes the right answer, then flushes every |out| < 1e-2 to zero.

1e-2 is the loose absolute tolerance commonly used for bf16 attention tests, so the output
passes `allclose(atol=1e-2)` on every input, yet it is wrong by up to 1e-2 wherever outputs
are small (long rows average values toward 0, so many are). A harness defeats it with
per-element bounds scaled to the dtype's unit roundoff and the output's magnitude. Bites on
any case with outputs in (0, 1e-2), most clearly in fp16 and fp32.
"""

import torch

from verify.mutants._blocked import BlockedAttention

LOOSE_BF16_ATOL = 1e-2  # the atol this kernel is built to slip under


class _ZeroSmallOutputs(BlockedAttention):
    def finalize(self, acc, l):
        out = super().finalize(acc, l)
        return torch.where(out.abs() < LOOSE_BF16_ATOL, torch.zeros_like(out), out)


attention = _ZeroSmallOutputs()
capabilities = attention.capabilities

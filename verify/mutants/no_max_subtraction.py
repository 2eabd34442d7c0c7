"""Mutant: the softmax is computed without subtracting the running row max.

exp(s) is taken directly, so for moderate logits it matches the right answer up to rounding,
but exp overflows to inf once a logit exceeds ~88 in fp32 (and P rounded to fp16 overflows
once a logit exceeds ~11, since e^11.1 > 65504), giving inf/inf = NaN. Bites with large
logits: scaled scores above ~11 (fp16) or ~88 (fp32, bf16), e.g. large-logit or outlier
value distributions. A quieter trace shows on any fp32 backward: the saved lse is
log(sum exp(s)) rather than m + log(sum exp(s - m)), so even a one-key row gets
P = exp(s - lse) = 1 + O(u) instead of exactly 1, a few ulps that a floor at the fp32 unit
roundoff can see.
"""

import torch
from flashcheck.verify.mutants._blocked import BlockedAttention


class _NoMaxSubtraction(BlockedAttention):
    def running_max(self, m, s):
        return torch.zeros_like(m)


attention = _NoMaxSubtraction()
capabilities = attention.capabilities

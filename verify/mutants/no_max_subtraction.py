"""Mutant: the softmax is computed without subtracting the running row max.

exp(s) is taken directly, so for moderate logits it matches the right answer up to rounding,
but exp overflows to inf once a logit exceeds ~88 in fp32 (and P rounded to fp16 overflows
once a logit exceeds ~11, since e^11.1 > 65504), giving inf/inf = NaN. Bites only with large
logits: scaled scores above ~11 (fp16) or ~88 (fp32, bf16), e.g. large-logit or outlier
value distributions.
"""

import torch

from verify.mutants._blocked import BlockedAttention


class _NoMaxSubtraction(BlockedAttention):
    def running_max(self, m, s):
        return torch.zeros_like(m)


attention = _NoMaxSubtraction()
capabilities = attention.capabilities

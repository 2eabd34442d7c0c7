"""Mutant: the `scale` argument is ignored; the kernel always uses 1/sqrt(D).

Bites when the caller passes a scale that is not 1/sqrt(D) (and the row has two or more
allowed keys with different scores). Cases that leave scale=None cannot see it.
"""

from flashcheck.verify.mutants._blocked import BlockedAttention


class _ScaleIgnored(BlockedAttention):
    def effective_scale(self, scale, D):
        return D ** -0.5


attention = _ScaleIgnored()
capabilities = attention.capabilities

"""Mutant: the backward forgets the softmax scale in dK (dK = dS^T Q, not scale * dS^T Q).

The forward and dQ, dV are right. dK is off by the factor 1/scale, so it bites in the
backward on every case with a non-empty row and scale != 1 (the default 1/sqrt(D) != 1 for
D > 1).
"""

from flashcheck.verify.mutants._blocked import BlockedAttention


class _DkUnscaled(BlockedAttention):
    def dk_tile(self, ds, q, scale):
        return ds.transpose(-1, -2) @ q


attention = _DkUnscaled()
capabilities = attention.capabilities

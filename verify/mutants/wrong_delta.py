"""Mutant: the backward's delta = rowsum(dO * O) is computed as rowsum(dO * dO).

The preprocessing step loads dO through both pointers (a copy-pasted load), so delta is the
squared norm of dO's row instead of its dot product with O. dV is right; dS = P * (dP - delta)
is wrong, so dQ and dK are wrong. Bites in the backward on every non-empty row (even a row
with one allowed key: there P = 1 and the right dS = dP - dO.O = 0, the wrong one is not).
"""

from flashcheck.verify.mutants._blocked import BlockedAttention


class _WrongDelta(BlockedAttention):
    def delta(self, grad_out, out):
        return (grad_out.float() * grad_out.float()).sum(dim=-1)


attention = _WrongDelta()
capabilities = attention.capabilities

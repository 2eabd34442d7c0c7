"""Mutant: the saved lse is the row max m, without + log l.

The forward output is right (it never reads lse); the backward recomputes P = exp(s - lse)
unnormalised (scaled by l >= 1), so dQ, dK and dV are all wrong. Bites only in the backward,
on any row with more than one allowed key (a row with one key has l = 1 and log l = 0).
"""

from flashcheck.verify.mutants._blocked import BlockedAttention


class _LseWithoutLog(BlockedAttention):
    def log_sum_exp(self, m, l):
        return m


attention = _LseWithoutLog()
capabilities = attention.capabilities

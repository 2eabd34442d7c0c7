"""Mutant: no guard for rows whose scores are all -inf, so they come out NaN.

exp(s - m) with m = -inf gives exp(-inf + inf) = NaN, and the final acc / l divides 0 by 0.
Bites on fully-masked query rows (key padding of length 0, dead rows, bottom-right causal
with Nq > Nk, windows that leave a row empty) and also on rows whose first key tiles are
all masked (sliding windows, -inf biases), where the NaN of the empty tile is carried on.
"""

from flashcheck.verify.mutants._blocked import BlockedAttention


class _NanDeadRows(BlockedAttention):
    def safe_max(self, m):
        return m

    def finalize(self, acc, l):
        return acc / l[..., None]


attention = _NanDeadRows()
capabilities = attention.capabilities

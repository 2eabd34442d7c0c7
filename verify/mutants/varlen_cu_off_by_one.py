"""Mutant: sequence b's output rows are written one row early (``cu_seqlens_q[b] - 1``).

An off-by-one in the query offset of every sequence after the first: its rows land one row
up, overwriting the previous sequence's last row, and its own last row stays 0. Bites with
two or more sequences whose second one has queries.
"""

from flashcheck.verify.mutants._ragged import VarlenAttention


class _CuOffByOne(VarlenAttention):
    def row_offset(self, b, cq):
        return max(cq[b] - 1, 0) if b > 0 else cq[b]


attention = _CuOffByOne()
capabilities = attention.capabilities

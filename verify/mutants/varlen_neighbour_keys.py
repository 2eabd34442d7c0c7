"""Mutant: each sequence's key slice ends one key late, reading its neighbour's first key.

The kernel bounds sequence b's keys by ``cu_seqlens_k[b + 1] + 1`` (an inclusive end used as
an exclusive one). Bites when a sequence with queries is followed by one with keys: its rows
attend one key of another document.
"""

from flashcheck.verify.mutants._ragged import VarlenAttention


class _NeighbourKeys(VarlenAttention):
    def key_range(self, b, ck, total_k):
        return ck[b], min(ck[b + 1] + 1, total_k)


attention = _NeighbourKeys()
capabilities = attention.capabilities

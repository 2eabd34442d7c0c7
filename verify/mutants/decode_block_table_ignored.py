"""Mutant: the block table is ignored; sequence b's pages are read as blocks b·W .. b·W+n-1.

The kernel assumes the cache is laid out contiguously per sequence (W = the block table's
width), as a dense KV cache would be. Bites whenever the block table is not that identity
layout, i.e. always under the harness's shuffled tables.
"""

from flashcheck.verify.mutants._ragged import DecodeAttention


class _TableIgnored(DecodeAttention):
    def pages(self, b, row, n_pages, pool):
        return [(b * len(row) + j) % pool for j in range(n_pages)]


attention = _TableIgnored()
capabilities = attention.capabilities

"""Mutant: the block-table index is off by one page: page j is read from entry j + 1.

The kernel reads ``block_table[b, j + 1]`` for key page j (the last page wraps to entry 0), as
if the table's first column were a header. Bites when a sequence spans two pages or more.
"""

from flashcheck.verify.mutants._ragged import DecodeAttention


class _PageOffByOne(DecodeAttention):
    def pages(self, b, row, n_pages, pool):
        return [row[(j + 1) % n_pages] for j in range(n_pages)]


attention = _PageOffByOne()
capabilities = attention.capabilities

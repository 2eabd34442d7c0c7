"""Mutant: the last, partially filled page is read whole and its empty slots are attended.

The kernel masks keys only by the causal rule among the new tokens' positions and lets every
slot past cache_seqlens[b] in the last page through (slots that hold another sequence's keys
or stale data). Bites when cache_seqlens[b] is not a multiple of the page size.
"""

from flashcheck.verify.mutants._ragged import DecodeAttention


class _TailUnmasked(DecodeAttention):
    def keys_read(self, n, page):
        return -(-n // page) * page

    def visible(self, j, pos, n):
        return (j[None, :] <= pos[:, None]) | (j[None, :] >= n)


attention = _TailUnmasked()
capabilities = attention.capabilities

"""Control: the correct blocked PyTorch FA2 kernel with key tiles of 64 instead of 16.

A different tiling changes the order of the online-softmax rescales and of the fp32 sums,
not the error class (same roundings of P, dS and the result), so it must pass. Caveat: for
Nk <= 64 it is a single tile, i.e. the plain (non-online) softmax with rounded P.
"""

from flashcheck.verify.mutants._blocked import BlockedAttention


class _Tile64(BlockedAttention):
    block_n = 64


attention = _Tile64()
capabilities = attention.capabilities

"""Control: the correct Triton forward with 32 x 32 tiles instead of 16 x 16.

Another tiling of the same algorithm (different rescale points and tail tiles), so it must
pass. Forward only, fp16 and fp32.
"""

from flashcheck.verify.mutants._triton_fwd import TritonForward


class _Tile32(TritonForward):
    block = 32


attention = _Tile32()
capabilities = attention.capabilities

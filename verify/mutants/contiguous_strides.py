"""Mutant (Triton): the kernel assumes contiguous (B, H, N, D) inputs and ignores strides.

Strides are derived from the shape instead of taken from the tensors, so a permuted layout
((B, N, H, D) storage viewed as (B, H, N, D)) or a strided slice (every other element on D,
padded N stride) is read at the wrong addresses. Bites on every non-contiguous layout; on
contiguous inputs it is exact.
"""

from flashcheck.verify.mutants._triton_fwd import TritonForward


class _ContiguousStrides(TritonForward):
    contiguous_strides = True


attention = _ContiguousStrides()
capabilities = attention.capabilities

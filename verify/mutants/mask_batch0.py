"""Mutant (Triton): a batched attn_mask is read from batch 0 for every batch.

The mask pointer arithmetic omits `b * stride_b`, so batch b uses batch 0's mask. Bites when
B > 1 and the mask differs across batches (a mask with a batch dimension, e.g. per-sequence
key padding with different lengths); a mask broadcast over the batch (size-1 batch dim, zero
stride) is unaffected.
"""

from flashcheck.verify.mutants._triton_fwd import TritonForward


class _MaskBatch0(TritonForward):
    mask_batch0 = True


attention = _MaskBatch0()
capabilities = attention.capabilities

"""Adversarial: returns an uninitialised output buffer and computes nothing.

`torch.empty` hands back memory the allocator just freed, which in a weak harness can be the
reference's output of the same shape computed a moment earlier, so the "kernel" matches
bit for bit. A harness defeats it by computing (or poisoning) the reference outputs so that
freed memory never holds the answer, e.g. by filling them with NaN before the kernel runs.
Bites on every input, unless the memory happens to hold the answer.
"""

import torch
from flashcheck.verify.mutants._common import check_args, full_capabilities

capabilities = full_capabilities(backward=False)


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False, *, window=None, causal_alignment="top_left"):
    check_args(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window,
               causal_alignment, dtypes=capabilities["dtypes"],
               head_dims=capabilities["head_dims"])
    return torch.empty(query.shape, dtype=query.dtype, device=query.device)


attention.capabilities = capabilities

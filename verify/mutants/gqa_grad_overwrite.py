"""Mutant: under GQA, dK and dV of a kv head are overwritten by each query head, not summed.

The backward stores (rather than accumulates) each query head's contribution into its kv
head's gradient, so one head of each group survives (the last on the CPU, an arbitrary one
on CUDA, where index_copy_ with repeated indices has no defined order). Bites in the backward when
Hq / Hkv > 1; without GQA each kv head has one writer and the result is right.
"""

import torch
from flashcheck.verify.mutants._blocked import BlockedAttention


class _GqaGradOverwrite(BlockedAttention):
    def reduce_kv_grad(self, g, kv_heads, shape):
        return torch.zeros(shape, device=g.device).index_copy_(1, kv_heads, g)


attention = _GqaGradOverwrite()
capabilities = attention.capabilities

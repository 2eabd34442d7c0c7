"""Adversarial: computes the right answer, then scales `query` in place by the softmax scale.

A "fold the scale into Q" shortcut that writes into the caller's tensor. The output is
right, so a harness that compares outputs only (or that builds the reference afterwards from
the same, now modified, tensors) passes it; the caller's query is silently corrupted. A
harness defeats it by keeping copies of the inputs and comparing them after the call. Bites on
every input whose scale is not 1 (the default 1/sqrt(D) is not 1 for D > 1).
"""

import torch
from flashcheck.verify.mutants._blocked import BlockedAttention


class _MutatesInputs(BlockedAttention):
    capabilities = {**BlockedAttention.capabilities, "backward": False}

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                 scale=None, enable_gqa=False, *, window=None, causal_alignment="top_left"):
        out = super().__call__(query, key, value, attn_mask, dropout_p, is_causal, scale,
                               enable_gqa, window=window, causal_alignment=causal_alignment)
        with torch.no_grad():
            query.mul_(self.effective_scale(scale, query.shape[-1]))
        return out.detach()


attention = _MutatesInputs()
capabilities = attention.capabilities

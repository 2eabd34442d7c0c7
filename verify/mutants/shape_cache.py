"""Adversarial: caches one answer per input shape and replays it for any later inputs.

The first call for a (query, key, value) shape and dtype is computed correctly; every later
call with that shape returns a copy of the cached output, whatever the values, mask or flags.
A harness that checks one input per shape, or that re-runs the same inputs to test
repeatability, passes it. A harness defeats it with fresh inputs for every case, so two cases
that share a shape compare against different answers. Bites on the second case of a shape.
"""

import torch
from flashcheck.verify.mutants._blocked import BlockedAttention


class _ShapeCache(BlockedAttention):
    capabilities = {**BlockedAttention.capabilities, "backward": False}

    def __init__(self):
        self._cache: dict[tuple, torch.Tensor] = {}

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                 scale=None, enable_gqa=False, *, window=None, causal_alignment="top_left"):
        out = super().__call__(query, key, value, attn_mask, dropout_p, is_causal, scale,
                               enable_gqa, window=window, causal_alignment=causal_alignment)
        shape_key = (tuple(query.shape), tuple(key.shape), query.dtype, query.device)
        cached = self._cache.setdefault(shape_key, out.detach().clone())
        return cached.clone()


attention = _ShapeCache()
capabilities = attention.capabilities

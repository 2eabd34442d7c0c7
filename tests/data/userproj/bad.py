"""A wrong kernel for the plugin's failure path: ``mod.attention`` with its output scaled by
1.01. A 1% error is ~20 fp16 ulps (2^-11 relative), far beyond any tolerance the family of
correct implementations gives, on every case that runs."""

from __future__ import annotations

import mod


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
    return 1.01 * mod.attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


attention.capabilities = mod.attention.capabilities

"""Mutant: the causal rule is off by one, so each query also sees the next key.

The kernel writes `j <= i + off + 1` (a `<` turned `<=` when the +1 of a half-open range was
already folded in). Bites when `is_causal=True` and the row's next key exists (any causal
case with Nk > 1 where some row i has i + off + 1 < Nk); windows and masks are untouched.
"""

import torch
from flashcheck.verify.mutants._blocked import BlockedAttention


class _CausalOffByOne(BlockedAttention):
    def structure(self, Nq, Nk, *, is_causal, causal_alignment, window, device):
        allowed = super().structure(Nq, Nk, is_causal=False, causal_alignment=causal_alignment,
                                    window=window, device=device)
        if is_causal:
            off = Nk - Nq if causal_alignment == "bottom_right" else 0
            i = torch.arange(Nq, device=device)[:, None]
            j = torch.arange(Nk, device=device)[None, :]
            allowed = allowed & (j <= i + off + 1)
        return allowed


attention = _CausalOffByOne()
capabilities = attention.capabilities

"""Mutant: the sliding window's left edge is exclusive, so each row sees one key too few.

The kernel tests `j > i + off - left` instead of `j >= i + off - left` (a window of `left`
keys read as "the previous left - 1 keys"). Bites when a window with left >= 0 cuts a row,
i.e. some row i has i + off - left in [0, Nk).
"""

import torch
from flashcheck.verify.mutants._blocked import BlockedAttention


class _WindowOffByOne(BlockedAttention):
    def structure(self, Nq, Nk, *, is_causal, causal_alignment, window, device):
        allowed = super().structure(Nq, Nk, is_causal=is_causal,
                                    causal_alignment=causal_alignment, window=window,
                                    device=device)
        if window is not None and window[0] >= 0:
            off = Nk - Nq if causal_alignment == "bottom_right" else 0
            i = torch.arange(Nq, device=device)[:, None]
            j = torch.arange(Nk, device=device)[None, :]
            allowed = allowed & (j > i + off - window[0])
        return allowed


attention = _WindowOffByOne()
capabilities = attention.capabilities

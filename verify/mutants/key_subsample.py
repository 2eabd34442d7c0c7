"""Adversarial: for long key sequences it attends to every other key only.

Up to LONG_N keys it is exact; beyond that it keeps keys 0, 2, 4, ... (a strided "sparse
approximation"), forward and backward alike. A harness whose shapes stay short passes it.
Bites when Nk > LONG_N and a row has allowed keys at odd positions with weight.
"""

import torch

from verify.mutants._blocked import BlockedAttention

LONG_N = 64  # four 16-key tiles: beyond the shapes a quick smoke test uses


class _KeySubsample(BlockedAttention):
    def structure(self, Nq, Nk, *, is_causal, causal_alignment, window, device):
        allowed = super().structure(Nq, Nk, is_causal=is_causal,
                                    causal_alignment=causal_alignment, window=window,
                                    device=device)
        if Nk > LONG_N:
            allowed = allowed & (torch.arange(Nk, device=device) % 2 == 0)
        return allowed


attention = _KeySubsample()
capabilities = attention.capabilities

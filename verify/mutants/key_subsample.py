"""Adversarial: for long key sequences it attends to every other key only.

Up to LONG_N keys it is exact; beyond that it keeps keys 0, 2, 4, ... (a strided "sparse
approximation"), forward and backward alike. A harness whose sequences stay within one or
two tiles passes it.
Bites when Nk > LONG_N and a row has allowed keys at odd positions with weight.
"""

import torch
from flashcheck.verify.mutants._blocked import BlockedAttention

LONG_N = 32  # two 16-key tiles: the longest sequence a one-or-two-tile smoke test uses


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

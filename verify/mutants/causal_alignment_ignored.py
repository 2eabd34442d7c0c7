"""Mutant: causal_alignment="bottom_right" is accepted but treated as "top_left".

The diagonal offset Nk - Nq is never applied (the FlashAttention < 2.1 convention), so with
Nq != Nk the causal and window rules sit on the wrong diagonal. Bites when
causal_alignment="bottom_right", Nq != Nk, and is_causal or a window is set.
"""

from flashcheck.verify.mutants._blocked import BlockedAttention


class _CausalAlignmentIgnored(BlockedAttention):
    def structure(self, Nq, Nk, *, is_causal, causal_alignment, window, device):
        return super().structure(Nq, Nk, is_causal=is_causal, causal_alignment="top_left",
                                 window=window, device=device)


attention = _CausalAlignmentIgnored()
capabilities = attention.capabilities

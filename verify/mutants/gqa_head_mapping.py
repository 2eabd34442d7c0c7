"""Mutant: GQA maps query head h to kv head h % Hkv instead of h // (Hq // Hkv).

Interleaved instead of grouped head sharing. The two maps agree when Hkv == 1 (every head
reads kv head 0) and when Hq == Hkv (identity), so it bites only when Hkv > 1 and
Hq / Hkv > 1, in the forward and (through the same map) in the backward.
"""

import torch
from flashcheck.verify.mutants._blocked import BlockedAttention


class _GqaHeadMapping(BlockedAttention):
    def kv_heads(self, Hq, Hkv, device):
        return torch.arange(Hq, device=device) % Hkv


attention = _GqaHeadMapping()
capabilities = attention.capabilities

"""Mutant: the causal rule is applied to packed token indices, not within each sequence.

Query i of sequence b is compared with key j as ``ck[b] + j <= cq[b] + i`` (global
positions), the bug of a varlen kernel that reuses a dense causal mask over the packed
tokens. Right for the first sequence and wherever the query and key offsets agree; bites with
causal cases whose sequences before b have unequal query and key lengths.
"""

import torch
from flashcheck.verify.mutants._ragged import VarlenAttention


class _CausalGlobal(VarlenAttention):
    def structure(self, lq, lk, *, q0, k0, is_causal, causal_alignment, window, device):
        allowed = super().structure(lq, lk, q0=q0, k0=k0, is_causal=False,
                                    causal_alignment=causal_alignment, window=window,
                                    device=device)
        if is_causal:
            i = torch.arange(lq, device=device)[:, None] + q0
            j = torch.arange(lk, device=device)[None, :] + k0
            allowed = allowed & (j <= i)
        return allowed


attention = _CausalGlobal()
capabilities = attention.capabilities

"""Control: one fp32 dK/dV accumulator per kv head, which every query head of its group adds
into, query tile by query tile.

Triton GQA backwards that loop over the group's query heads inside the dK/dV program (one
program per kv head and key tile: for each 16-row query tile, for each head of the group,
acc += Pᵀ·dO and dSᵀ·Q) make this choice; the sums over the group and over the query rows
are interleaved in one fp32 running sum instead of per head then over heads. Compared with
the baseline (per-head fp32 sums added at the end) only the order of the fp32 additions
changes; still a correct kernel. No effect when Hq == Hkv beyond the row tiling.
"""

import torch
from flashcheck.verify.mutants._blocked import BlockedAttention

_ROWS = 16  # query rows per step of the dK/dV program


class _GroupFp32(BlockedAttention):
    group = 1

    def backward(self, query, key, value, bias, out, lse, grad_out, p):
        self.group = p.Hq // p.Hkv
        return super().backward(query, key, value, bias, out, lse, grad_out, p)

    def kv_grad(self, a, b):
        # The group's sum goes to its first query head, 0 to the others: the per-head
        # reduction after it (head order, fp32) then adds exact zeros.
        g = self.group
        a, b = a.unflatten(1, (-1, g)), b.unflatten(1, (-1, g))
        acc = torch.zeros(*a.shape[:2], a.shape[-1], b.shape[-1], device=a.device)
        for lo in range(0, a.shape[-2], _ROWS):
            for h in range(g):
                acc = acc + a[:, :, h, lo:lo + _ROWS].transpose(-1, -2) @ b[:, :, h,
                                                                           lo:lo + _ROWS]
        out = torch.zeros(*acc.shape[:2], g, *acc.shape[2:], device=a.device)
        out[:, :, 0] = acc
        return out.flatten(1, 2)


attention = _GroupFp32()
capabilities = attention.capabilities

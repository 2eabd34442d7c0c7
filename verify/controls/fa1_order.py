"""Control: FlashAttention-1's update order (the accumulator is kept normalised).

After each key tile the output so far is rescaled to the new l:
O <- (alpha * l_prev * O + P@V) / l_new, and there is no final division. FA2 defers the
division to the end instead; both are exact in real arithmetic and differ only by a few fp32
roundings per tile, so this must pass. Backward as in FA2 (it needs only O and lse).
"""

import torch
from flashcheck.verify.mutants._blocked import BlockedAttention


class _Fa1Order(BlockedAttention):
    def update(self, acc, pv, alpha, l_prev, l_new):
        live = (l_new > 0)[..., None]
        safe = torch.where(l_new > 0, l_new, torch.ones_like(l_new))[..., None]
        return torch.where(live, ((alpha * l_prev)[..., None] * acc + pv) / safe,
                           torch.zeros_like(acc))

    def finalize(self, acc, l):
        return acc


attention = _Fa1Order()
capabilities = attention.capabilities

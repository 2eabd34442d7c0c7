"""Mutant: the accumulator is divided by l at every step, then unnormalised P@V is added.

The rescale bug of the seed post: on each key tile the kernel "normalises as it goes" by
dividing the running accumulator by the new l, but adds the new tile's P@V unnormalised, and
divides by l once more at the end. With one key tile the answer is right (the accumulator
starts at zero); it bites whenever a query row gets weight from two or more key tiles,
i.e. Nk > 16 without masks that confine the row to one tile.
"""

from flashcheck.verify.mutants._blocked import BlockedAttention


class _RescaleDivL(BlockedAttention):
    def update(self, acc, pv, alpha, l_prev, l_new):
        return alpha[..., None] * acc / l_new[..., None] + pv


attention = _RescaleDivL()
capabilities = attention.capabilities

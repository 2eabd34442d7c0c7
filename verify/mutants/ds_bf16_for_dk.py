"""Mutant: dS is rounded to fp16 for dQ but to bf16 for dK on fp16 inputs.

A split backward writes the dS cast twice (the dQ kernel and the dK/dV kernel of the Triton
tutorial's `_attn_bwd_dq` / `_attn_bwd_dkdv`, or two loops of one kernel), and one of the two
casts has a hard-coded dtype (`ds.to(tl.bfloat16)` from a bf16-first kernel). dQ and dK are
then formed from differently rounded dS: dQ from dS with 11 bits of mantissa, dK from dS with
8, so dK's rounding of dS, its largest error term, is 8x larger (unit roundoff 2^-8 instead
of 2^-11). It bites on fp16 inputs only, on dK only; out, dQ and dV are exact copies of a
correct kernel's. A precision bug: dK is close everywhere, a few times the error of the worst
correct fp16 kernel, so only a bound tied to fp16's unit roundoff catches it.
"""

import torch
from flashcheck.verify.mutants._blocked import BlockedAttention


class _DsBf16ForDk(BlockedAttention):
    def dk_ds(self, ds_raw, ds, dtype):
        if dtype == torch.float16:
            return self.subnormals(ds_raw.to(torch.bfloat16).float(), dtype)
        return ds


attention = _DsBf16ForDk()
capabilities = attention.capabilities

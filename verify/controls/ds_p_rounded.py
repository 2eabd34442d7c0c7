"""Control: dS from P as rounded to the input dtype for the dV product, scaled, then rounded.

CUTLASS's memory-efficient backward (PyTorch's efficient SDPA, xformers) recomputes P in fp32,
stores it to shared memory in the input dtype as the operand of dV += P^T dO, and reads that
tile back for dS: `accum = (accum - di) * attn` with attn the fp16/bf16 P, then
`accum = accum * scale`, and the scaled dS is rounded for the dQ and dK products. Every dS
term carries P's rounding (up to half a unit of the input dtype, relative) besides its own;
on rows with few keys, where dQ is large, that moves whole rows of dQ by a unit or two of the
input dtype (PyTorch's efficient SDPA on an H100, fp16, 2 keys: dQ 1.00068x exact, the
member's dQ equal to the kernel's bit for bit on 98 % of the elements). Correct.
"""

from flashcheck.verify.controls.ds_scaled_before_round import _DsScaledBeforeRound


class _DsPRounded(_DsScaledBeforeRound):
    """ds_scaled_before_round's choice (the scale in dS before its rounding), and P rounded."""

    def ds_p(self, p, p_rounded):
        return p_rounded


attention = _DsPRounded()
capabilities = attention.capabilities

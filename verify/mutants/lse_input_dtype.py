"""Mutant: the saved lse is stored in the input dtype (fp16/bf16), not fp32.

The forward is right; the logsumexp it saves for the backward goes through a buffer of the
input dtype (allocating the lse output with `torch.empty_like(q[..., 0])` instead of fp32).
The backward recomputes P = exp(s - lse) from it, so every P of a row is off by the factor
exp(lse_rounded - lse), a relative error of up to u * |lse| (u = 2^-8 bf16, 2^-11 fp16):
with |lse| around 5-10 that is 5-10 times the rounding of P itself, and far more for large
logits (|lse| in the hundreds). dV, dQ and dK all inherit it. A precision bug: the gradients
are close, only several times too inaccurate (1.4-7x the baseline's error on normal inputs
at N <= 128, orders of magnitude with large logits); fp32 inputs are unaffected.
"""

from flashcheck.verify.mutants._blocked import BlockedAttention


class _LseInputDtype(BlockedAttention):
    def store_lse(self, lse, dtype):
        return lse.to(dtype).float()


attention = _LseInputDtype()
capabilities = attention.capabilities

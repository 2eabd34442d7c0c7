"""Mutant: dQ and dK are computed from different dS (rounded for dQ, fp32 for dK).

Kernels that compute dQ and dK/dV in separate loops (Triton's fused-attention tutorial,
FlashAttention-3's dQ pass) recompute dS twice, and the two copies can drift: here dQ uses
dS rounded to the input dtype, as FA2 does, while dK uses the unrounded fp32 dS. Each
gradient on its own is what some correct kernel computes (the baseline for dQ, fp32
throughout for dK), so every tensor is close and no tensor is less accurate than a correct
kernel's; what is broken is that dQ and dK are no longer the gradients of one function:
the identity sum(Q * dQ) = sum(K * dK) (both are scale * sum(dS * QK^T)), which a consistent
kernel keeps up to the matmul roundings and the rounding of the stored dQ, dK, here also
carries the rounding error of dS. A precision bug that a
per-tensor tolerance cannot see, by construction; only a consistency check between dQ and
dK can. fp32 inputs are unaffected (the rounding is to fp32).
"""

from verify.mutants._blocked import BlockedAttention


class _DsInconsistent(BlockedAttention):
    def dk_ds(self, ds_raw, ds):
        return ds_raw


attention = _DsInconsistent()
capabilities = attention.capabilities

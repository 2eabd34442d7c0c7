"""Control: the backward recomputes the scores from K prescaled, the forward scales QKᵀ.

A backward kernel rebuilds P = exp(S − lse) tile by tile from the forward's lse. PyTorch's
CPU flash backward computes S with one sgemm whose alpha is the softmax scale; on an AVX-512
machine the BLAS folds alpha into the K operand as it packs it, so the backward's S is
Q·fl(K·scale) with K·scale rounded to fp32, while the forward's lse came from fl(QKᵀ)·scale
(its GEMM with alpha = 1, the scale applied after). Each score is then another rounding of
the forward's, P no longer sums to exactly 1 per row, and dV and dK inherit the difference,
about u·|s| relative (fp32 uniform(4), D 10: that kernel's dv at 1.16x the rule without the
``bwd_k_prescaled`` member, 8.9e-7 from the member's where the other members are 1e-5 off
it). The forward is the blocked base's; in the backward the scale multiplies each K tile
in fp32 before the product. The member is opt-in, declared here (``capabilities["family"]``).
Its own code on the base's hooks. Correct.
"""

from flashcheck.verify.mutants._blocked import BlockedAttention
from flashcheck.verify.mutants._common import full_capabilities


class _BackwardKPrescaled(BlockedAttention):
    # an opt-in member (reference/family.py OPT_IN): the kernel that makes the choice says so
    capabilities = full_capabilities(family=("bwd_k_prescaled",))

    def logits(self, q, k_tile, bias, scale, dtype):
        if not self.in_backward:
            return super().logits(q, k_tile, bias, scale, dtype)
        s = self.mm(q, (k_tile * scale).transpose(-1, -2))
        return s if bias is None else s + bias


attention = _BackwardKPrescaled()
capabilities = attention.capabilities

"""Control: the backward recomputes the scores in another summation order than the forward.

A backward kernel recomputes S = QKᵀ tile by tile to rebuild P = exp(S − lse) from the
forward's lse; it uses its own GEMM blocking or MMA k-steps, so its S is another rounding of
the scores the lse came from (PyTorch's CPU flash SDPA backend: a cpublas GEMM per kv block
in each pass). P then carries the difference of the two roundings, about u·|s| relative, and
no longer sums to exactly 1 per row; at large logits (|s| ~ 1e4 in fp32) that is ~1e-3,
which dV and dK inherit. Here the backward sums the head dim in steps of 32 (a K loop of
32-wide blocks, as a Triton GEMM's BLOCK_K), one matmul per step added in order in fp32; the
family's members for the choice sum in steps of 16, 8 and 1 (``bwd_scores_k16``,
``bwd_scores_k8``, ``bwd_scores_k1``), so this order is none of theirs. The forward is the
blocked base's. The members are opt-in, declared here (``capabilities["family"]``). Its own
code on the base's hooks. Correct.
"""

from flashcheck.verify.mutants._blocked import BlockedAttention
from flashcheck.verify.mutants._common import full_capabilities

_STEP = 32  # none of the members' 16, 8, 1: an independent order


class _BackwardScoresReordered(BlockedAttention):
    # an opt-in member (reference/family.py OPT_IN): the kernel that makes the choice says so
    capabilities = full_capabilities(family=("bwd_scores_k16",))

    def logits(self, q, k_tile, bias, scale, dtype):
        if not self.in_backward:
            return super().logits(q, k_tile, bias, scale, dtype)
        kt = k_tile.transpose(-1, -2)
        s = self.mm(q[..., :_STEP], kt[..., :_STEP, :])
        for i in range(_STEP, q.shape[-1], _STEP):
            s = s + self.mm(q[..., i:i + _STEP], kt[..., i:i + _STEP, :])
        s = s * scale
        return s if bias is None else s + bias


attention = _BackwardScoresReordered()
capabilities = attention.capabilities

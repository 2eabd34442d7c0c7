"""Control: GQA dK/dV rounded to the input dtype per query head, then summed over the group.

FlashAttention-2's CUDA backward (flash_api.cpp, mha_bwd) does this when Hq > Hkv: the kernel
writes dk_expanded / dv_expanded of shape (B, N, Hq, D) in the input dtype, one slice per
query head, and the wrapper reduces them with at::sum over the group dimension (fp32
accumulation inside the reduction, one more rounding of the sum). FlashAttention-3's and
cuDNN's GQA backwards with per-head dK/dV buffers make the same choice. Compared with one
fp32 accumulator per kv head (the baseline), each of the Hq/Hkv addends carries one extra
input-dtype rounding, so dK and dV are a little less accurate for Hq/Hkv > 1; it is still a
correct kernel. No effect when Hq == Hkv (the per-head value is rounded once either way).
"""

from flashcheck.verify.mutants._blocked import BlockedAttention


class _GqaPerHeadRounded(BlockedAttention):
    def round_head_grad(self, g, dtype):
        return g.to(dtype).float()


attention = _GqaPerHeadRounded()
capabilities = attention.capabilities

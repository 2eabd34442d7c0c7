"""Control: GQA by expanding K and V to Hq heads and letting autograd sum dK/dV.

A common wrapper around kernels without native GQA (Hugging Face transformers' `repeat_kv`,
many model ports feeding SDPA or FlashAttention-1): `key.repeat_interleave(Hq // Hkv, dim=1)`
and the same for value, then a plain multi-head call. The kernel returns one dK/dV per query
head in the input dtype, and the backward of repeat_interleave sums each group in the input
dtype (torch's reduction accumulates in fp32 and rounds the sum once). So it is the
per-head-rounded choice of FlashAttention-2's CUDA backward reached through another code
path (autograd instead of an explicit at::sum). Correct; it costs Hq/Hkv times the K/V
memory, which is why fused kernels avoid it.
"""

from flashcheck.verify.mutants._blocked import BlockedAttention


class _GqaExpandAutograd(BlockedAttention):
    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                 scale=None, enable_gqa=False, **extensions):
        if enable_gqa and key.dim() == 4 and query.dim() == 4 and key.shape[1] \
                and query.shape[1] % key.shape[1] == 0 and query.shape[1] != key.shape[1]:
            group = query.shape[1] // key.shape[1]
            key = key.repeat_interleave(group, dim=1)
            value = value.repeat_interleave(group, dim=1)
        return super().__call__(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                enable_gqa, **extensions)


attention = _GqaExpandAutograd()
capabilities = attention.capabilities

"""Control: the split-KV ("flash-decoding") forward, partial results merged by their lse.

FlashAttention-2 (`flash_attn_with_kvcache(num_splits=...)`, and `mha_fwd`, the forward of
`flash_attn_func` and of PyTorch's flash SDPA backend, whenever its `num_splits` heuristic
finds that batch x heads x row blocks leave SMs idle), FlashAttention-3 (`num_splits` and
its combine kernel), Flash-Decoding, FlashInfer (`merge_state`, `merge_states`) and vLLM
(`merge_attn_states`) cut the keys into contiguous splits, run the online softmax on each
split alone to an fp32 output normalised by that split's own l plus the split's lse, and
merge in fp32: lse = m + log(sum_s exp(lse_s - m)) with m = max_s lse_s, then
O = sum_s exp(lse_s - lse) * O_s (FlashAttention-2's combine_attn_seqk_parallel), rounded
once to the input dtype. Exact in real arithmetic; in floating point the weights carry the
roundings of every lse_s, which the unsplit kernel's rescales cancel. Here: key tiles of 16,
3 splits of ceil(tiles / 3) whole tiles each (a split with no allowed key has lse = -inf and
weight 0; a row with none at all gives 0 and lse = -inf). Its own code on the blocked base's
hooks, not reference.online_attention; the family member ``split_kv`` (4 splits) makes the
same choice, and is opt-in: this kernel declares it (``capabilities["family"]``). Backward:
the base's FA2 backward from the merged O and lse. Correct.
"""

import torch
from flashcheck.verify.mutants._blocked import NEG_INF, BlockedAttention
from flashcheck.verify.mutants._common import full_capabilities


class _SplitKV(BlockedAttention):
    # an opt-in member (reference/family.py OPT_IN): the kernel that splits says so
    capabilities = full_capabilities(family=("split_kv",))
    num_splits = 3

    def _split_forward(self, qf, kf, vf, allowed, bias, tiles, p, dtype):
        """The base's online softmax over ``tiles`` only: (O_s fp32, lse_s fp32)."""
        m = torch.full((p.B, p.Hq, p.Nq), NEG_INF, device=qf.device)
        l = torch.zeros((p.B, p.Hq, p.Nq), device=qf.device)
        acc = torch.zeros((p.B, p.Hq, p.Nq, p.D), device=qf.device)
        for lo, hi in tiles:
            s = self._scores(qf, kf[..., lo:hi, :], allowed, bias, lo, hi, p, dtype)
            m_new = self.running_max(m, s)
            m_use = self.safe_max(m_new)
            pt = self.exp(s - m_use[..., None])
            alpha = self.exp(m - m_use)
            l_new = alpha * l + pt.sum(dim=-1)
            pv = self.mm(self.round_p(pt, dtype), vf[..., lo:hi, :])
            acc = self.update(acc, pv, alpha, l, l_new)
            l, m = l_new, m_new
        return self.finalize(acc, l), self.log_sum_exp(m, l)

    def forward(self, query, key, value, bias, p):
        dtype = query.dtype
        _, kf, vf, allowed = self._gathered(query, key, value, p)
        qf = query.float()
        tiles = self._tiles(p)
        per = -(-len(tiles) // self.num_splits)
        parts = [self._split_forward(qf, kf, vf, allowed, bias, tiles[s * per:(s + 1) * per],
                                     p, dtype) for s in range(self.num_splits)]
        lses = torch.stack([lse for _, lse in parts])  # (splits, B, Hq, Nq)
        m = lses.amax(dim=0)
        m = torch.where(m == NEG_INF, torch.zeros_like(m), m)
        total = torch.exp(lses - m).sum(dim=0)
        lse = torch.where(total > 0, m + torch.log(total), torch.full_like(m, NEG_INF))
        lse_use = torch.where(lse == NEG_INF, torch.zeros_like(lse), lse)
        out = torch.zeros_like(parts[0][0])
        for o_s, lse_s in parts:
            out = out + torch.exp(lse_s - lse_use)[..., None] * o_s
        return out.to(dtype), lse


attention = _SplitKV()
capabilities = attention.capabilities

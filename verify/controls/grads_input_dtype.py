"""Control: dQ, dK and dV kept in the input dtype between tiles (PyTorch's CPU flash backward).

PyTorch's CPU flash-attention backward holds its gradients in tensors of the inputs' dtype
and adds each tile's product into them with a GEMM of beta = 1: the product is formed in
fp32, added to the stored fp16/bf16 value and the sum rounded back. It walks, per kv head,
the group's query heads one after the other, each head's query tiles of 32 rows in order,
and per query tile the key tiles of 512 in order: dQ is rounded once per key tile, dK and dV
once per query tile and head. Every partial sum is a correctly rounded input-dtype value, so
the result is a correct kernel's, with more roundings than an fp32 accumulator makes (fp16
MQA 3/1, 35 query rows: 6 roundings of dV where rounding per head makes 3).

Here the loops are written in that order (heads of a group outer, query tiles, key tiles
inner), independently of the family's model, which forms the same sums with the key tiles
outer (reference/online.py, ``accumulate="input_dtype"``). The forward is the mutant base's.
It declares the choice (``capabilities["family"]``, member ``grads_input_dtype``), and the
backward's recomputed scores (``bwd_scores_k16``).
"""

import torch
from flashcheck.verify.mutants._blocked import NEG_INF, BlockedAttention
from flashcheck.verify.mutants._common import full_capabilities

_Q_ROWS = 32  # query rows per tile (the CPU kernel's split below 192 rows)
_KEYS = 512  # keys per tile


class _GradsInputDtype(BlockedAttention):
    # Its backward recomputes QKᵀ per 32-row, 512-key GEMM where the forward used the mutant
    # base's tiles: another summation order of the scores, the bwd_scores choice, which the
    # PyTorch kernel it models declares too (fp32, normal(5), D 32: dv 1.08x without it).
    capabilities = full_capabilities(family=("grads_input_dtype", "bwd_scores_k16"))

    def _backward_pass(self, query, key, value, bias, out, lse, grad_out, p):
        dtype = query.dtype
        _, kf, vf, allowed = self._gathered(query, key, value, p)  # per query head
        qf, dof = query.float(), grad_out.float()
        delta = self.delta(grad_out, out)
        lse_use = self.safe_max(lse)
        dq, dk, dv = (torch.zeros_like(t) for t in (query, key, value))  # input dtype
        group = p.Hq // p.Hkv
        for r in range(group):
            hs = slice(r, None, group)  # query head c·group + r reads kv head c
            for m0 in range(0, p.Nq, _Q_ROWS):
                rows = slice(m0, m0 + _Q_ROWS)
                q_t, do_t = qf[:, hs, rows], dof[:, hs, rows]
                for n0 in range(0, p.Nk, _KEYS):
                    cols = slice(n0, n0 + _KEYS)
                    k_t, v_t = kf[:, hs, cols], vf[:, hs, cols]
                    s = self.logits(q_t, k_t, None if bias is None else bias[:, hs, rows, cols],
                                    p.scale, dtype)
                    s = s.masked_fill(~allowed[rows, cols], NEG_INF)
                    pt = self.exp(s - lse_use[:, hs, rows, None])
                    p_r = self.round_p(pt, dtype)
                    dv[:, :, cols] = (dv[:, :, cols].float()
                                      + self.mm(p_r.transpose(-1, -2), do_t)).to(dtype)
                    dp = self.mm(do_t, v_t.transpose(-1, -2))
                    ds = self.round_ds(pt * (dp - delta[:, hs, rows, None]), dtype)
                    dq[:, hs, rows] = (dq[:, hs, rows].float()
                                       + self.mm(ds, k_t) * p.scale).to(dtype)
                    dk[:, :, cols] = (dk[:, :, cols].float()
                                      + self.mm(ds.transpose(-1, -2), q_t) * p.scale).to(dtype)
        return dq, dk, dv


attention = _GradsInputDtype()
capabilities = attention.capabilities

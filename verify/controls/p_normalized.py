"""Control: the probabilities normalised before the P@V product (an unfused softmax).

The textbook attention, softmax(QKᵀ·scale)·V, as FlexAttention's eager path runs it (torch
2.13's ``math_attention``: scores in fp32, ``torch._safe_softmax`` over the whole row,
``.to(query.dtype)``, then the matmul) and as two-pass kernels run it that form
P = exp(S − lse) from a first pass's lse: every probability P = e^(s−m)/ℓ is rounded to the
input dtype before it multiplies V, and nothing is divided afterwards. The FlashAttention-2
order instead rounds the unnormalised e^(s−m), whose row max is exactly 1, and divides the
fp32 accumulator by ℓ at the end. Both are correct; where scores tie, the tied P = 1/k round
alike, so the unfused route's error adds coherently (bf16 ties(1): out rmse 1.8x the FA2
order's). The backward is FlashAttention-2's (it needs only O and lse), as in FlexAttention.

It declares the choice (``capabilities["family"]``, member ``p_normalized``): in the family
by default that member hid precision mutants case by case, so the harness uses it only for
kernels that say they make the choice (the ``flex`` built-in on the CPU does).
"""

import torch
from flashcheck.verify.mutants._blocked import BlockedAttention
from flashcheck.verify.mutants._common import full_capabilities


class _PNormalized(BlockedAttention):
    capabilities = full_capabilities(family=("p_normalized",))

    def forward(self, query, key, value, bias, p):
        dtype = query.dtype
        _, kf, vf, allowed = self._gathered(query, key, value, p)
        # Whole rows, their scores computed tile by tile as the backward recomputes them:
        # one product over the row can sum the head dim in another order than the
        # backward's tiles (MKL picks its kernel by shape: under AVX2, fp32 scores ~900
        # then differed by ~1e-3 and dV by 1.5e-3 relative), which is another choice
        # (``bwd_scores_*``), not this control's.
        qf = query.float()
        s = torch.cat([self._scores(qf, kf[..., lo:hi, :], allowed, bias, lo, hi, p, dtype)
                       for lo, hi in self._tiles(p)], dim=-1)
        m = s.amax(dim=-1)
        e = self.exp(s - self.safe_max(m)[..., None])
        l = e.sum(dim=-1)
        live = (l > 0)[..., None]
        prob = e / torch.where(live, l[..., None], torch.ones_like(e))
        out = self.mm(self.round_p(prob, dtype), vf)
        out = torch.where(live, out, torch.zeros_like(out))
        return out.to(dtype), self.store_lse(self.log_sum_exp(m, l), dtype)


attention = _PNormalized()
capabilities = attention.capabilities

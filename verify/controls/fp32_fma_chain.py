"""Control: fp32 dK and dV as running sums, one fused multiply-add per product.

On NVIDIA GPUs Triton lowers an fp32 ``tl.dot(a, b, acc)`` with ``input_precision="ieee"``
to a loop of FMAs into ``acc`` (no tensor cores), so a flash backward's dK/dV accumulators
(``dv = tl.dot(pT, do, dv)``) are one running sum over the query rows; hand-written CUDA
loops of scalar FMAs do the same. Every term below half an ulp of the running sum is lost,
so with many small positive terms (P_ij, dO = 1) the sum drifts low, by up to n·u of its
value where a blocked sum errs by about √(block)·u; the answer is as correct as the
arithmetic allows. This control forms dK and dV that way for fp32 inputs (query rows in
order, per query head, then summed over a GQA group); fp16/bf16 products run blocked, as
tensor cores do. It declares the choice (``capabilities["family"]``, member
``fp32_fma_chain``): the harness judges a kernel by that member only when it says it makes
the choice (our Triton kernels do on CUDA).
"""

import torch
from flashcheck.verify.mutants._blocked import BlockedAttention
from flashcheck.verify.mutants._common import full_capabilities


class _FmaChain(BlockedAttention):
    capabilities = full_capabilities(family=("fp32_fma_chain",))
    _chain = False

    def backward(self, query, key, value, bias, out, lse, grad_out, p):
        self._chain = query.dtype == torch.float32
        return super().backward(query, key, value, bias, out, lse, grad_out, p)

    def kv_grad(self, a, b):
        if not self._chain:
            return super().kv_grad(a, b)
        # aᵀ·b over the rows of a and b in order: acc = fl(acc + a_i ⊗ b_i), the product of
        # two fp32 values exact in float64, the sum rounded to fp32 at every step
        acc = torch.zeros(*a.shape[:-2], a.shape[-1], b.shape[-1], dtype=torch.float64,
                          device=a.device)
        for i in range(a.shape[-2]):
            step = acc + a[..., i, :, None].double() * b[..., i, None, :].double()
            acc = step.float().double()
        return acc.float()


attention = _FmaChain()
capabilities = attention.capabilities

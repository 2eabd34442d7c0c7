"""Control: the forward's probabilities from a fast vectorised exp (PyTorch's CPU flash forward).

PyTorch's CPU flash-attention forward exponentiates the scores of fp16/bf16 inputs with a
fast vectorised exp (relative error from -1.08e-4 to +1.02e-4 over [-6, 0], e(0) = 1 -
5.3e-5, measured through the kernel), while its rescale factors and its backward's exp are
accurate (and fp32 inputs get an accurate exp throughout). Its lse is then ~5e-5 off in
every row, the backward's accurate P = exp(S - lse) rows sum to 1 + 5e-5, and dK carries
that before its terms cancel: fp16 dk at 1.19x the rule where the family's members all
have an accurate exp. SIMD libraries do the same (a range reduction, then a short
polynomial).

Here: e^x = 2^n · 2^f after Cody-Waite reduction (t = x·log2 e, n = round(t), f = t - n in
[-1/2, 1/2]), 2^f by the cubic through the four Chebyshev nodes of that interval, all in
fp32: relative error -9.98e-5..+9.29e-5, written independently of the family's model (which
scales every forward P by 1 -/+ 2^-13, ``reference.online.FAST_EXP_REL``). Only the
forward's probabilities use it, only below fp32. It declares the choice
(``capabilities["family"]``: ``fwd_fast_exp``, members ``fwd_fast_exp_low``/``_high``).
"""

import math

import torch
from flashcheck.verify.mutants._blocked import BlockedAttention
from flashcheck.verify.mutants._common import full_capabilities


def _cubic() -> tuple[float, ...]:
    """The coefficients (c0..c3) of the cubic interpolating 2^f at the Chebyshev nodes of
    [-1/2, 1/2], rounded to fp32."""
    nodes = [0.5 * math.cos((2 * k + 1) * math.pi / 8) for k in range(4)]
    a = torch.tensor([[x ** j for j in range(4)] for x in nodes], dtype=torch.float64)
    b = torch.tensor([2.0 ** x for x in nodes], dtype=torch.float64)
    return tuple(float(torch.tensor(c).float()) for c in torch.linalg.solve(a, b).tolist())


_C = _cubic()
_LOG2E = float(torch.tensor(math.log2(math.e)).float())


def fast_exp(x: torch.Tensor) -> torch.Tensor:
    """e^x of an fp32 tensor by range reduction and the cubic, in fp32 (0 at -inf)."""
    t = x * _LOG2E
    n = torch.round(torch.where(torch.isfinite(t), t, torch.zeros_like(t)))
    f = t - n
    p = _C[0] + f * (_C[1] + f * (_C[2] + f * _C[3]))
    return torch.where(x == -math.inf, torch.zeros_like(p), torch.ldexp(p, n))


class _FwdFastExp(BlockedAttention):
    capabilities = full_capabilities(family=("fwd_fast_exp",))
    fast = False

    def forward(self, query, key, value, bias, p):
        self.fast = query.dtype in (torch.float16, torch.bfloat16)
        return super().forward(query, key, value, bias, p)

    def fwd_p_exp(self, x):
        return fast_exp(x) if self.fast else torch.exp(x)


attention = _FwdFastExp()
capabilities = attention.capabilities

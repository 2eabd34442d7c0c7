"""Control: fp32 dot products on TF32 tensor cores that truncate their operands (declares
``tf32=True``).

On Hopper (sm_90) Triton's fp32 ``tl.dot`` at its default ``input_precision="tf32"`` is a
``wgmma`` whose fp32 operands come straight from shared memory with no ``cvt`` instruction:
the tensor core reads the top 19 bits of each operand, i.e. drops the 13 low mantissa bits
(round toward zero). The relative error per operand is below 2^-10, twice that of the
round-to-nearest conversion Ampere kernels emit (the ``tf32_matmuls`` control). On the H200,
the fasterkernels package's fp32 output (B1 H1 Nq1 Nk1 D16, docs/reports/outside/) equals
this truncation bit for bit. Correct; judged with the ``tf32_truncated`` member.
"""

from flashcheck.verify.controls.tf32_matmuls import _Tf32


class _Tf32Truncated(_Tf32):
    truncate = True  # its own frexp arithmetic (tf32_matmuls._tf32), not the member's


attention = _Tf32Truncated()
attention.capabilities = {**attention.capabilities, "tf32": True}
capabilities = attention.capabilities

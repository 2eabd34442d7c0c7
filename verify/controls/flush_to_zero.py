"""Control: subnormals flushed to zero (FTZ/DAZ), in the inputs, P, dS and the results.

GPU kernels built with flush-to-zero (nvcc --use_fast_math / -ftz=true, approximate
ex2.approx.ftz.f32 exponentials) treat any value below the smallest normal number of its
format as 0; PyTorch's flash, cuDNN and memory-efficient SDPA backends on fp16/bf16 return
subnormal gradients as 0, and fp32 atomicAdd on CUDA flushes subnormal sums. This control
flushes every value below the input dtype's smallest normal (fp16 6.1e-5, bf16 and fp32
1.2e-38) to zero where a kernel reads or writes it: q, k, v and dO as read, P and dS after
their rounding to the input dtype, and out, dq, dk, dv as written. Each flushed term is
smaller than that smallest normal, so it is correct in the sense of docs/DESIGN.md section 5
("subnormal flushing is accepted by default"). On fp16, where P values below 6.1e-5 are
common in long or peaked rows, the dropped mass is largest.
"""

import torch

from verify.mutants._blocked import BlockedAttention


class _FlushToZero(BlockedAttention):
    def subnormals(self, t, dtype):
        tiny = torch.finfo(dtype).tiny  # smallest normal of the input dtype
        return torch.where(t.abs() < tiny, torch.zeros_like(t), t)


attention = _FlushToZero()
capabilities = attention.capabilities

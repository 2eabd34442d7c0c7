"""Control: subnormals flushed to zero (FTZ/DAZ), in the inputs, P, dS and the results.

GPU kernels built with flush-to-zero (nvcc --use_fast_math / -ftz=true, approximate
ex2.approx.ftz.f32 exponentials) treat any fp32 value below the smallest normal number as 0;
PyTorch's flash, cuDNN and memory-efficient SDPA backends on fp16/bf16 return subnormal
gradients as 0, and fp32 atomicAdd on CUDA flushes subnormal sums. This control flushes to
zero every value below the input dtype's smallest normal (fp16 6.1e-5, bf16 and fp32
1.2e-38) where a kernel writes it: P and dS after their rounding to the input dtype, and
out, dq, dk, dv; and q, k, v and dO as read below fp32's smallest normal (DAZ: an fp16
subnormal input converts exactly to a normal fp32 number, and tensor cores read it as it
is, so no hardware mode drops it). Each flushed term is
smaller than that smallest normal, so it is correct in the sense of docs/DESIGN.md section 5
("subnormal flushing is accepted by default"). On fp16, where P values below 6.1e-5 are
common in long or peaked rows, the dropped mass is largest.
"""

import torch
from flashcheck.verify.mutants._blocked import BlockedAttention


class _FlushToZero(BlockedAttention):
    def subnormals(self, t, dtype, read=False):
        tiny = torch.finfo(dtype).tiny  # smallest normal of the input dtype
        if read:  # DAZ acts on fp32 operands: fp32's smallest normal (= bf16's)
            tiny = min(tiny, torch.finfo(torch.float32).tiny)
        return torch.where(t.abs() < tiny, torch.zeros_like(t), t)


attention = _FlushToZero()
capabilities = attention.capabilities

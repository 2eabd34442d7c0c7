"""GPU-only misbehaving kernels for scripts/gpu/fuzz_campaigns.sh (never imported on a CPU).

- :func:`illegal_address_large`: correct (PyTorch's SDPA) up to 64 query rows; above that it
  also launches a Triton kernel that stores 2^40 elements past its buffer, so the launch
  faults with an illegal address and the CUDA context is unusable afterwards. The campaign
  must record a ``cuda_error`` failure (confirmed in a fresh worker), shrink it to Nq = 65
  with every candidate in a fresh worker, and carry on with healthy workers.
- :func:`illegal_address_async`: the same fault without a synchronize in the kernel, so the
  error surfaces in a later harness call (an asynchronous launch failure).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

_LARGE = 64  # more query rows than this trip the kernels


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False):
    if is_causal and attn_mask is not None:  # SDPA refuses both: fold causality in
        causal = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool,
                            device=query.device).tril()
        attn_mask = attn_mask & causal if attn_mask.dtype == torch.bool else \
            attn_mask.masked_fill(~causal, float("-inf"))
        is_causal = False
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                          is_causal=is_causal, scale=scale,
                                          enable_gqa=enable_gqa)


@triton.jit
def _store_past_the_end(src, dst, n, shift, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src + offs, mask=offs < n, other=0.0)
    tl.store(dst + offs + shift, x, mask=offs < n)


def _fault(device) -> None:
    buf = torch.zeros(1024, device=device)
    # 2^40 fp32 elements (4 TiB) past a 4 KiB buffer: far outside any mapping
    _store_past_the_end[(4,)](buf, buf, 1024, 1 << 40, BLOCK=256)


def illegal_address_large(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                          scale=None, enable_gqa=False):
    if query.shape[-2] > _LARGE and query.is_cuda:
        _fault(query.device)
        torch.cuda.synchronize(query.device)
    return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def illegal_address_async(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                          scale=None, enable_gqa=False):
    if query.shape[-2] > _LARGE and query.is_cuda:
        _fault(query.device)
    return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

"""Triton flash-attention kernels under test.

- :func:`attention`: FlashAttention-2 order forward and backward (``kernels.flash_attention``;
  on sm_90 its forward runs a warp-specialised Gluon kernel where that applies,
  ``kernels.flash_attention_gluon``; under Triton 3.9 its backward a five-product Gluon
  kernel, ``kernels.flash_attention_gluon_bwd``, unless ``FLASHCHECK_GLUON_BWD=off``).
- :func:`attention_fa1`: FlashAttention-1 order forward (K/V tiles outer, O/m/l rescaled in
  global memory), sharing the FA2 backward (``kernels.flash_attention_fa1``).
- :func:`attention_varlen`: packed variable-length sequences (FlashAttention's
  ``flash_attn_varlen_func`` layout, cu_seqlens), forward and backward (``kernels.varlen``).
- :func:`attention_decode`: split-KV decoding over a paged KV cache with a block table
  (``flash_attn_with_kvcache``), forward only (``kernels.decode``).

Launch configurations: :func:`set_tuning` / :func:`tuning` select ``"heuristic"`` (the
default: one config per call from a table, no benchmarking, so a new shape costs at most one
compile per kernel) or ``"autotune"`` (Triton's autotuner over a small grid, for benchmarks);
the varlen and decode kernels always launch from their heuristic tables.

The first two take PyTorch's SDPA signature plus the ``window``/``causal_alignment``
extensions; the last two take FlashAttention's varlen / kvcache layouts (their
``capabilities`` say so under ``"api"``). All carry a ``capabilities`` mapping
(docs/contracts.md section 2). This package imports torch and triton only (Gluon is part
of triton). On the CPU the kernels run under Triton's interpreter, which must be enabled
with ``TRITON_INTERPRET=1`` before triton is first imported.
"""

from flashcheck.kernels._common import get_tuning, set_tuning, tuning
from flashcheck.kernels.decode import attention_decode
from flashcheck.kernels.flash_attention import attention
from flashcheck.kernels.flash_attention_fa1 import attention_fa1
from flashcheck.kernels.varlen import attention_varlen

__all__ = ["attention", "attention_decode", "attention_fa1", "attention_varlen", "get_tuning",
           "set_tuning", "tuning"]

"""Triton flash-attention kernels under test.

- :func:`attention`: FlashAttention-2 order forward and backward (``kernels.flash_attention``).
- :func:`attention_fa1`: FlashAttention-1 order forward (K/V tiles outer, O/m/l rescaled in
  global memory), sharing the FA2 backward (``kernels.flash_attention_fa1``).

Launch configurations: :func:`set_tuning` / :func:`tuning` select ``"heuristic"`` (the
default: one config per call from a table, no benchmarking, so a new shape costs at most one
compile per kernel) or ``"autotune"`` (Triton's autotuner over a small grid, for benchmarks).

Both take PyTorch's SDPA signature plus the ``window``/``causal_alignment`` extensions and
carry a ``capabilities`` mapping (docs/contracts.md section 2). This package imports torch
and triton only. On the CPU the kernels run under Triton's interpreter, which must be
enabled with ``TRITON_INTERPRET=1`` before triton is first imported.
"""

from flashcheck.kernels._common import get_tuning, set_tuning, tuning
from flashcheck.kernels.flash_attention import attention
from flashcheck.kernels.flash_attention_fa1 import attention_fa1

__all__ = ["attention", "attention_fa1", "get_tuning", "set_tuning", "tuning"]

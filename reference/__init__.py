"""Reference oracles for flashcheck (torch and numpy only; never imports kernels/ or verify/).

- ``attention_fp64``: the float64 oracle (chunked, differentiable).
- ``online_attention``: the blocked online-softmax model (FA2/FA1 order, exact or
  emulated precision, FA2 backward), with ``online_lse_step`` (the (m, ℓ) recurrence) and
  ``emulate_error_bound`` (its a-priori forward error bound).
- ``naive_attention``: the short textbook attention (``upcast``, ``reorder_ops``).
- ``structural_mask``: the dense (Nq, Nk) form of ``is_causal``/``window``.
"""

from .exact import attention_fp64
from .masks import structural_mask
from .naive import naive_attention
from .online import emulate_error_bound, online_attention, online_lse_step

__all__ = [
    "attention_fp64",
    "emulate_error_bound",
    "naive_attention",
    "online_attention",
    "online_lse_step",
    "structural_mask",
]

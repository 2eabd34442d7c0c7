"""Reference oracles for flashcheck (torch and numpy only; never imports kernels/ or verify/).

- ``attention_fp64``: the float64 oracle (chunked, differentiable).
- ``online_attention``: the blocked online-softmax model (FA2/FA1 order, exact or
  emulated precision, FA2 backward), with ``online_lse_step`` (the (m, ℓ) recurrence) and
  ``emulate_error_bound`` (its a-priori forward error bound).
- ``FAMILY``, ``family_members``, ``run_family`` (reference/family.py): the family of
  correct implementation choices, each a set of ``online_attention`` switches, and a
  runner of all applicable members on the same inputs.
- ``naive_attention``: the short textbook attention (``upcast``, ``reorder_ops``).
- ``structural_mask``: the dense (Nq, Nk) form of ``is_causal``/``window``.
"""

from .exact import attention_fp64
from .family import FAMILY, family_members, run_family
from .masks import structural_mask
from .naive import naive_attention
from .online import emulate_error_bound, online_attention, online_lse_step

__all__ = [
    "FAMILY",
    "attention_fp64",
    "emulate_error_bound",
    "family_members",
    "naive_attention",
    "online_attention",
    "online_lse_step",
    "run_family",
    "structural_mask",
]

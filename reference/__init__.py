"""Reference oracles for flashcheck (torch and numpy only; never imports kernels/ or verify/).

- ``attention_fp64``: the float64 oracle (chunked, differentiable).
- ``structural_mask``: the dense (Nq, Nk) form of ``is_causal``/``window``.
"""

from .exact import attention_fp64
from .masks import structural_mask

__all__ = ["attention_fp64", "structural_mask"]

"""Seeded attention problems for the tests of ``reference/``.

``make_problem`` turns a handful of knobs (sizes, mask kind, value kind, seed) into the
keyword arguments of an oracle call. Tensors are drawn on the CPU from a
``torch.Generator`` seeded with ``seed``, so a failing Hypothesis example is replayed
bit-exactly from its knobs. This is not the harness's case format (verify/cases.py); it
exists so that the reference tests can draw knobs, never tensor elements.

Value kinds:
- ``normal``: N(0, 1) entries.
- ``large``: integer-valued query/key entries in [-100, 100] and ``scale`` = 1/2, so every
  score (|s| up to 1e4 and beyond) is exactly representable in float64 for D <= 16: the
  float64 oracle then has no score rounding and can be held to 1e-12 against mpmath.

Layouts: ``contiguous`` or ``bnhd`` ((B, N, H, D) storage viewed as (B, H, N, D)).

Mask kinds: ``none``; ``bool`` (random keep-probability 0.7, first query row fully masked);
``bool_bcast`` (a (Nq, Nk) bool mask, broadcast over B and H); ``additive`` (N(0, 1) biases,
or integers in [-1e4, 1e4] for ``large``, with ~20% -inf entries and the last query row
all -inf).
"""

from __future__ import annotations

import torch

MASK_KINDS = ("none", "bool", "bool_bcast", "additive")
VALUE_KINDS = ("normal", "large")


def make_problem(
    *, B: int, Hq: int, Hkv: int, Nq: int, Nk: int, D: int, seed: int, mask: str = "none",
    values: str = "normal", dtype: torch.dtype = torch.float64, is_causal: bool = False,
    causal_alignment: str = "top_left", window=None, layout: str = "contiguous",
) -> dict:
    """Keyword arguments (query, key, value, attn_mask, ...) of one seeded problem."""
    if mask not in MASK_KINDS:
        raise ValueError(f"mask: expected one of {MASK_KINDS}; got {mask!r}")
    if values not in VALUE_KINDS:
        raise ValueError(f"values: expected one of {VALUE_KINDS}; got {values!r}")
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    if values == "large":
        q = torch.randint(-100, 101, (B, Hq, Nq, D), generator=g).to(f64)
        k = torch.randint(-100, 101, (B, Hkv, Nk, D), generator=g).to(f64)
        scale = 0.5
    else:
        q = torch.randn(B, Hq, Nq, D, generator=g, dtype=f64)
        k = torch.randn(B, Hkv, Nk, D, generator=g, dtype=f64)
        scale = None
    v = torch.randn(B, Hkv, Nk, D, generator=g, dtype=f64)
    attn_mask = None
    if mask == "bool":
        attn_mask = torch.rand(B, Hq, Nq, Nk, generator=g) < 0.7
        attn_mask[:, :, 0] = False
    elif mask == "bool_bcast":
        attn_mask = torch.rand(Nq, Nk, generator=g) < 0.7
    elif mask == "additive":
        if values == "large":
            attn_mask = torch.randint(-10_000, 10_001, (B, Hq, Nq, Nk), generator=g).to(f64)
        else:
            attn_mask = torch.randn(B, Hq, Nq, Nk, generator=g, dtype=f64)
        attn_mask[torch.rand(B, Hq, Nq, Nk, generator=g) < 0.2] = -torch.inf
        attn_mask[:, :, -1] = -torch.inf
    if layout == "bnhd":
        # Same values, stored (B, N, H, D) and viewed as (B, H, N, D): non-contiguous.
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    elif layout != "contiguous":
        raise ValueError(f"layout: expected 'contiguous' or 'bnhd'; got {layout!r}")
    return dict(
        query=q.to(dtype), key=k.to(dtype), value=v.to(dtype),
        attn_mask=attn_mask if attn_mask is None or attn_mask.dtype == torch.bool
        else attn_mask.to(dtype),
        scale=scale, is_causal=is_causal, enable_gqa=Hq != Hkv, window=window,
        causal_alignment=causal_alignment,
    )

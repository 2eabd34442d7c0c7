"""Argument checking and mask preparation shared by the mutant and control kernels.

Every kernel in `verify/mutants/` and `verify/controls/` accepts the full SDPA contract of
docs/contracts.md section 1, so that each one is wrong (or right) only where its bug says.
This module holds the part that is identical across them: validating the arguments with
messages that name the argument and the allowed range, and turning `attn_mask` into an
fp32 additive bias. Caveat: the bias is an `expand`ed view of the caller's mask, so it has
zero strides on broadcast dimensions; callers must not write into it.
"""

from __future__ import annotations

import math

import torch
from flashcheck.reference._validate import Problem  # the validated shape and flags of one call

DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
ALIGNMENTS = ("top_left", "bottom_right")


def check_args(
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window,
    causal_alignment, *, dtypes: tuple[str, ...], head_dims: tuple[int, int],
) -> Problem:
    """Validate one SDPA call; raise ValueError / NotImplementedError naming the argument."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, N, D), got shape {tuple(t.shape)}")
        if DTYPE_NAMES.get(t.dtype) not in dtypes:
            raise ValueError(f"{name}.dtype must be one of {dtypes}, got {t.dtype}")
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(
            f"query, key, value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    if not (query.device == key.device == value.device):
        raise ValueError("query, key, value must be on one device")
    B, Hq, Nq, D = query.shape
    Bk, Hkv, Nk, Dk = key.shape
    if Bk != B or tuple(value.shape) != (B, Hkv, Nk, D) or Dk != D:
        raise ValueError(
            f"key and value must be (B={B}, Hkv, Nk, D={D}) with equal shapes, got "
            f"key {tuple(key.shape)} and value {tuple(value.shape)}"
        )
    if min(B, Hq, Hkv, Nq, Nk, D) < 1:
        raise ValueError(f"all dimensions must be >= 1, got query {tuple(query.shape)}, "
                         f"key {tuple(key.shape)}")
    lo, hi = head_dims
    if not lo <= D <= hi:
        raise ValueError(f"head dim D must be in [{lo}, {hi}], got {D}")
    if enable_gqa:
        if Hq % Hkv:
            raise ValueError(f"enable_gqa needs Hq % Hkv == 0, got Hq={Hq}, Hkv={Hkv}")
    elif Hq != Hkv:
        raise ValueError(f"Hq ({Hq}) must equal Hkv ({Hkv}) unless enable_gqa=True")
    if dropout_p != 0.0:
        raise NotImplementedError(f"dropout_p must be 0.0 (no dropout support), got {dropout_p}")
    if scale is not None:
        scale = float(scale)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be finite and > 0, got {scale}")
    else:
        scale = 1.0 / math.sqrt(D)
    if causal_alignment not in ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {ALIGNMENTS}, got {causal_alignment!r}")
    if window is not None:
        if (len(window) != 2 or not all(isinstance(w, int) and w >= -1 for w in window)):
            raise ValueError(f"window must be (left, right) with ints >= -1, got {window!r}")
        window = (int(window[0]), int(window[1]))
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise ValueError(f"attn_mask must be a tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
            raise ValueError(f"attn_mask must be bool or floating, got {attn_mask.dtype}")
        try:
            full = torch.broadcast_shapes(attn_mask.shape, (B, Hq, Nq, Nk))
        except RuntimeError:
            full = None
        if full != (B, Hq, Nq, Nk):
            raise ValueError(
                f"attn_mask must broadcast to (B, Hq, Nq, Nk) = {(B, Hq, Nq, Nk)}, "
                f"got {tuple(attn_mask.shape)}"
            )
        if attn_mask.device != query.device:
            raise ValueError("attn_mask must be on the device of query")
    return Problem(B, Hq, Hkv, Nq, Nk, D, scale, bool(is_causal), causal_alignment, window)


def additive_bias(attn_mask: torch.Tensor | None, p: Problem) -> torch.Tensor | None:
    """`attn_mask` as an fp32 bias expanded (a view, zero strides) to (B, Hq, Nq, Nk)."""
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        bias = torch.zeros(attn_mask.shape, dtype=torch.float32, device=attn_mask.device)
        bias = bias.masked_fill(~attn_mask, float("-inf"))
    else:
        bias = attn_mask.detach().float()
    return bias.expand(p.B, p.Hq, p.Nq, p.Nk)


def full_capabilities(**overrides) -> dict:
    """The capabilities dict of a kernel that takes the whole contract, with overrides."""
    caps = {
        "dtypes": ("float16", "bfloat16", "float32"),
        "head_dims": (1, 256),
        "masks": ("bool", "additive"),
        "mask_broadcast": True,
        "extensions": ("window", "causal_alignment"),
        "gqa": True,
        "backward": True,
        "devices": ("cpu", "cuda"),
        "deterministic_backward": True,
        "tf32": False,
    }
    caps.update(overrides)
    return caps

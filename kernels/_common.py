"""Helpers private to ``kernels``: argument validation and autotuning.

Validation turns an SDPA-style call into a :class:`Problem` (plain data the launchers
read) or raises ``ValueError``/``NotImplementedError`` naming the argument and the allowed
range. Tuning builds the declarative ``triton.Config`` grid and its ``keep()`` filter.

Caveats:
- Whether the Triton interpreter is active is decided once, at import time, from
  ``TRITON_INTERPRET`` (Triton itself reads it when a kernel is decorated, so changing it
  later has no effect on already-imported kernels).
- The shared-memory estimate in :func:`smem_bytes` is a model of what the kernels keep in
  shared memory (operand tiles times pipeline stages), not Triton's exact allocation; a
  config that still does not fit is skipped by Triton's autotuner (OutOfResources).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
MAX_HEAD_DIM = 256
ALIGNMENTS = ("top_left", "bottom_right")

BF16_INTERPRETER_REASON = (
    "the Triton CPU interpreter computes bfloat16 arithmetic and tl.dot wrongly; "
    "bfloat16 runs on CUDA only"
)


@dataclass(frozen=True)
class Problem:
    """A validated attention call, normalised for the launchers.

    ``lo_off``/``hi_off`` describe the structural band: query i may see key j iff
    ``i + lo_off <= j`` (when ``has_lo``) and ``j <= i + hi_off`` (when ``has_hi``).
    ``mask`` is the attention mask expanded (stride 0, never copied) to (B, Hq, Nq, Nk),
    or None; ``mask_kind`` is 0 (none), 1 (bool) or 2 (additive).
    """

    B: int
    Hq: int
    Hkv: int
    Nq: int
    Nk: int
    D: int
    scale: float
    has_lo: bool
    has_hi: bool
    lo_off: int
    hi_off: int
    is_causal: bool
    mask: torch.Tensor | None
    mask_kind: int

    @property
    def group(self) -> int:
        return self.Hq // self.Hkv


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def validate(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window,
             causal_alignment) -> Problem:
    """Check an SDPA-style call against the kernels' domain and normalise it."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (B, H, N, D), got shape {tuple(t.shape)}")
    dt = query.dtype
    if dt not in SUPPORTED_DTYPES:
        if dt.is_floating_point or dt.is_complex:
            raise NotImplementedError(
                f"query dtype {dt} is not supported; allowed: float16, bfloat16, float32")
        raise ValueError(f"query dtype {dt} is not a floating dtype; allowed: float16, "
                         f"bfloat16, float32")
    for name, t in (("key", key), ("value", value)):
        if t.dtype != dt:
            raise ValueError(f"{name} dtype {t.dtype} differs from query dtype {dt}; "
                             f"query, key and value must share one dtype")
    tensors = [("query", query), ("key", key), ("value", value)]
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise ValueError(f"attn_mask must be a torch.Tensor or None, got "
                             f"{type(attn_mask).__name__}")
        tensors.append(("attn_mask", attn_mask))
    devices = {t.device for _, t in tensors}
    if len(devices) != 1:
        raise ValueError("query, key, value and attn_mask must be on one device (mixed "
                         "devices: " + ", ".join(f"{n}={t.device}" for n, t in tensors) + ")")
    dev = query.device
    if dev.type == "cpu" and not INTERPRET:
        raise ValueError("query is a CPU tensor but the Triton interpreter is not active; set "
                         "TRITON_INTERPRET=1 before importing triton to run on the CPU, or "
                         "pass CUDA tensors")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"query device {dev} is not supported; allowed: cuda (or cpu with "
                         f"TRITON_INTERPRET=1)")
    if dev.type == "cpu" and dt == torch.bfloat16:
        raise NotImplementedError(f"query dtype bfloat16 is not run on the CPU: "
                                  f"{BF16_INTERPRETER_REASON}")

    B, Hq, Nq, D = query.shape
    Bk, Hkv, Nk, Dk = key.shape
    if tuple(value.shape) != (Bk, Hkv, Nk, Dk):
        raise ValueError(f"value shape {tuple(value.shape)} must equal key shape "
                         f"{tuple(key.shape)}")
    if Bk != B:
        raise ValueError(f"key batch {Bk} differs from query batch {B}")
    if Dk != D:
        raise ValueError(f"key head dim {Dk} differs from query head dim {D}")
    if min(B, Hq, Hkv) < 1:
        raise ValueError(f"batch and head counts must be >= 1, got B={B}, Hq={Hq}, Hkv={Hkv}")
    if Nq < 1 or Nk < 1:
        raise ValueError(f"sequence lengths must be >= 1, got Nq={Nq} (query dim 2), "
                         f"Nk={Nk} (key dim 2)")
    if D < 1 or D > MAX_HEAD_DIM:
        raise NotImplementedError(f"head dim D={D} (query.shape[-1]) is not supported; "
                                  f"allowed: 1 <= D <= {MAX_HEAD_DIM}")
    if enable_gqa not in (True, False):
        raise ValueError(f"enable_gqa must be a bool, got {enable_gqa!r}")
    if Hq != Hkv:
        if not enable_gqa:
            raise ValueError(f"query heads Hq={Hq} != key/value heads Hkv={Hkv} needs "
                             f"enable_gqa=True")
        if Hq % Hkv != 0:
            raise ValueError(f"enable_gqa needs Hq % Hkv == 0, got Hq={Hq}, Hkv={Hkv}")

    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if not (0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    if dropout_p > 0.0:
        raise NotImplementedError(f"dropout_p={dropout_p} is not supported; only dropout_p=0.0")
    if is_causal not in (True, False):
        raise ValueError(f"is_causal must be a bool, got {is_causal!r}")

    if scale is None:
        scale = 1.0 / math.sqrt(D)
    else:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise ValueError(f"scale must be a finite float > 0 or None, got {scale!r}")
        scale = float(scale)
        if not (math.isfinite(scale) and scale > 0.0):
            raise ValueError(f"scale must be a finite float > 0 or None, got {scale!r}")

    if causal_alignment not in ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {ALIGNMENTS}, got "
                         f"{causal_alignment!r}")
    off = 0 if causal_alignment == "top_left" else Nk - Nq
    left = right = -1
    if window is not None:
        if (not isinstance(window, (tuple, list)) or len(window) != 2
                or not all(_is_int(w) for w in window)):
            raise ValueError(f"window must be None or (left, right) with ints >= -1, got "
                             f"{window!r}")
        left, right = int(window[0]), int(window[1])
        if left < -1 or right < -1:
            raise ValueError(f"window entries must be >= 0, or -1 for unbounded, got "
                             f"{window!r}")
    if is_causal:
        right = 0 if right < 0 else min(right, 0)
    has_lo, has_hi = left >= 0, right >= 0

    mask, mask_kind = None, 0
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            mask_kind = 1
        elif attn_mask.dtype in SUPPORTED_DTYPES:
            mask_kind = 2
        else:
            raise ValueError(f"attn_mask dtype {attn_mask.dtype} is not supported; allowed: "
                             f"bool, float16, bfloat16, float32")
        if attn_mask.requires_grad and torch.is_grad_enabled():
            raise NotImplementedError("attn_mask.requires_grad=True: gradients with respect "
                                      "to the mask are not supported")
        full = (B, Hq, Nq, Nk)
        try:
            ok = attn_mask.dim() <= 4 and torch.broadcast_shapes(attn_mask.shape, full) == full
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"attn_mask shape {tuple(attn_mask.shape)} is not broadcastable "
                             f"to (B, Hq, Nq, Nk) = {full}")
        mask = attn_mask.expand(full)

    return Problem(B=B, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=D, scale=scale, has_lo=has_lo,
                   has_hi=has_hi, lo_off=off - left, hi_off=off + right,
                   is_causal=bool(is_causal), mask=mask, mask_kind=mask_kind)


# ----------------------------------------------------------------------------- tuning

# The search grid (small on purpose: every kept config is compiled on first use).
GRID_BLOCK_M = (64, 128)
GRID_BLOCK_N = (32, 64, 128)
GRID_WARPS = (4, 8)
GRID_STAGES = (2, 3, 4)
# Single configuration under the interpreter: 16x16 tiles make the tail-tile and
# multi-tile paths reachable with N <= 48 and keep numpy's per-program cost small.
INTERPRETER_BLOCK = 16
# Fallback tiles for shapes where no grid config fits in shared memory (fp32, D = 256).
FALLBACK = ((64, 32, 4, 1), (32, 32, 4, 1), (32, 16, 4, 1))
SMEM_MARGIN = 1.0  # no extra margin: smem_bytes already overestimates (see its docstring)

_smem_cache: dict[int, int] = {}


def smem_limit(device_index: int | None = None) -> int:
    """Shared memory per block on the current CUDA device, in bytes."""
    if device_index is None:
        device_index = torch.cuda.current_device()
    if device_index not in _smem_cache:
        props = triton.runtime.driver.active.utils.get_device_properties(device_index)
        _smem_cache[device_index] = int(props["max_shared_mem"])
    return _smem_cache[device_index]


def smem_bytes(kind: str, outer: int, inner: int, block_d: int, elem: int, stages: int) -> int:
    """Shared-memory model of one program (an upper bound of what Triton 3.6 allocated for
    the sm_90 compiles we checked, e.g. 48 KiB actual vs 160 KiB modelled for the forward
    at 128x64, D = 128, fp16, 3 stages).

    ``kind`` "fwd": the resident tile is the Q tile of ``outer`` rows; each pipeline stage
    holds a K and a V tile of ``inner`` rows. "dq": resident Q and dO, streamed K and V.
    "dkdv": resident K and V (``outer`` rows), streamed Q and dO (``inner`` rows).
    """
    resident = (1 if kind == "fwd" else 2) * outer * block_d
    streamed = stages * 2 * inner * block_d
    return elem * (resident + streamed)


def keep(kind: str, cfg: tuple[int, int, int, int], block_d: int, elem: int, limit: int) -> bool:
    """Whether grid point ``cfg`` = (outer, inner, warps, stages) is worth compiling.

    Drops configs over the shared-memory limit and pairings that are known to be poor:
    8 warps only on 128-row outer tiles (64 rows give 4 warps 16 rows each), inner tiles
    of 64 to ``outer`` columns for the forward, and for the backward an inner tile no wider
    than the outer one (the tutorial's 128x32/64 shapes).
    """
    outer, inner, warps, stages = cfg
    if smem_bytes(kind, outer, inner, block_d, elem, stages) > SMEM_MARGIN * limit:
        return False
    if (warps == 8) != (outer == 128):
        return False
    if kind == "fwd":
        return 64 <= inner <= outer and stages in ((2, 3) if block_d >= 128 else (3, 4))
    return inner <= outer // 2 and stages in ((2, 3) if block_d >= 128 else (2, 3, 4))


def grid_points():
    for outer in GRID_BLOCK_M:
        for inner in GRID_BLOCK_N:
            for warps in GRID_WARPS:
                for stages in GRID_STAGES:
                    yield outer, inner, warps, stages


def make_configs(outer_name: str, inner_name: str) -> list[triton.Config]:
    """All grid configs (the device-dependent filter runs in :func:`make_pruner`)."""
    if INTERPRET:
        b = INTERPRETER_BLOCK
        return [triton.Config({outer_name: b, inner_name: b}, num_warps=4, num_stages=1)]
    pts = list(grid_points()) + list(FALLBACK)
    return [triton.Config({outer_name: o, inner_name: i}, num_warps=w, num_stages=s)
            for o, i, w, s in pts]


def make_pruner(kind: str, outer_name: str, inner_name: str, elem_arg: str):
    """An ``early_config_prune`` applying :func:`keep` for the call's BLOCK_D and dtype."""

    def prune(configs, named_args, **kwargs):
        if INTERPRET or len(configs) == 1:
            return configs
        block_d = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
        elem = named_args[elem_arg].element_size()
        limit = smem_limit(named_args[elem_arg].device.index)

        def pt(c):
            return (c.kwargs[outer_name], c.kwargs[inner_name], c.num_warps, c.num_stages)

        fallback = {tuple(f) for f in FALLBACK}
        kept = [c for c in configs if pt(c) not in fallback and keep(kind, pt(c), block_d,
                                                                    elem, limit)]
        if kept:
            return kept
        fits = [c for c in configs if pt(c) in fallback
                and smem_bytes(kind, *pt(c)[:2], block_d, elem, pt(c)[3]) <= SMEM_MARGIN * limit]
        return fits[:1] or [configs[-1]]

    return prune


def block_d(D: int) -> int:
    """Head dim padded to a power of two, at least 16 (the tl.dot minimum)."""
    return triton.next_power_of_2(max(D, 16))

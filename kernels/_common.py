"""Helpers private to ``kernels``: argument validation and autotuning.

Validation turns an SDPA-style call into a :class:`Problem` (plain data the launchers
read) or raises ``ValueError``/``NotImplementedError`` naming the argument and the allowed
range. Tuning: the tuning mode (``"heuristic"``, the default: one config per call from a
declarative table; ``"autotune"``: a small ``triton.Config`` grid for benchmarks), the
``keep()`` shared-memory filter both modes apply, the autotune key buckets, and the schedule
flags (``SCHEDULE_TABLE``: tensor-descriptor loads, warp specialisation, launch order).

Caveats:
- Whether the Triton interpreter is active is decided once, at import time, from
  ``TRITON_INTERPRET`` (Triton itself reads it when a kernel is decorated, so changing it
  later has no effect on already-imported kernels).
- The shared-memory estimate in :func:`smem_bytes` is a model of what the kernels keep in
  shared memory (operand tiles times pipeline stages), not Triton's exact allocation (see
  its docstring for the measured ratio); a config that still does not fit is skipped by
  Triton's autotuner (OutOfResources).
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch
import triton

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x · LOG2E), the kernels' base-2 softmax
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


def dot_family(tf32: bool) -> tuple[str, ...]:
    """The opt-in implementation choices (contracts.md section 2, ``family``) our fp32 dot
    products make: on NVIDIA GPUs Triton lowers an IEEE fp32 ``tl.dot(a, b, acc)`` to one
    fused multiply-add per product into ``acc``, so the backward's dQ, dK, dV and dP are running
    sums (``fp32_fma_chain``). The interpreter's ``tl.dot`` is a numpy matmul, and TF32 dot
    products run on tensor cores: neither makes the choice."""
    return () if INTERPRET or tf32 else ("fp32_fma_chain",)


def contraction_family() -> tuple[str, ...]:
    """The opt-in choice (``bias_fma_split``) the compiler makes of our score line
    ``s = qk * qk_scale + bias * log2(e)`` on NVIDIA GPUs: with floating-point contraction
    (Triton's default) the forward keeps ``qk * qk_scale`` exact in one FMA with the rounded
    bias term, the backward kernels keep ``bias * log2(e)`` exact with the rounded scaled
    score (sm_90 PTX, triton 3.6), so the backward's P uses another rounding of each score
    than the forward's lse. The interpreter rounds every operation."""
    return () if INTERPRET else ("bias_fma_split",)


def device_ctx(t: torch.Tensor):
    """``t``'s CUDA device as the current one for a launch; a null context for CPU tensors
    (the interpreter, and the compile-only checks that launch nothing)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


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
#
# A launch configuration is a point (outer, inner, num_warps, num_stages). "outer" is the
# resident tile of a program and "inner" the tile its loop streams: the forward and the dQ
# kernel have outer = BLOCK_M (query rows) and inner = BLOCK_N (key rows); the dK/dV kernel
# has outer = BLOCK_N and inner = BLOCK_M.

TUNING_MODES = ("heuristic", "autotune")
KINDS = ("fwd", "dkdv", "dq")
ANY = None  # a table row's causal (or band) column: matches calls with and without

# Heuristic mode: one config per call, the first row matching (kind, element size,
# BLOCK_D <= max_block_d, causal). 2-byte rows at BLOCK_D = 128 are the fastest of the H200
# sweep (docs/benchmarks/sweep.md, bf16, N = 4096): forward 256x64 with 8 warps (the 256-row
# query tile held as two 128-row halves, 3 stages, 4 causal: 12 % and 10 % faster than the
# earlier 128x64), dK/dV with 64 resident key rows and 64-row query tiles at 4 warps and 2
# stages (two programs per multiprocessor: the whole backward 3-7 % faster non-causal, 4 %
# causal than 128 key rows at 8 warps, sweep set "dkdv4"), dQ 128x64 with 3 stages; at
# BLOCK_D <= 64 the dK/dV kernel also takes 64 key rows at 4 warps and 3 stages (the whole
# backward 8 % and 13 % faster than 128x64 at 8 warps, sweep set "dkdv64"; causal, 2 stages
# were 2 % faster on the pointer path, 3 stages with descriptors, ROWS and EARLY 3-4 % faster
# than that, sweep sets "d64" and "confirm64"); the other
# head dims follow Triton's fused-attention tutorial and FlashAttention-2 (half the stages at
# D = 256).
# fp32 uses IEEE dot products, which run on the FMA units and are unrolled per thread: the
# sm_90 compile time grows with the multiply-adds per thread and tile step (about
# n_dots * outer * inner * BLOCK_D / threads), so fp32 rows keep that near 2K or below
# (8 warps at BLOCK_D >= 128); 4x that took 60-140 s per kernel to compile.
HEURISTIC_TABLE = (
    # kind    elem max_block_d causal  (outer, inner, warps, stages)
    ("fwd",   2,   64,         ANY,    (128, 64, 4, 3)),
    ("fwd",   2,   128,        False,  (256, 64, 8, 3)),
    ("fwd",   2,   128,        True,   (256, 64, 8, 4)),
    ("fwd",   2,   256,        ANY,    (64, 64, 8, 2)),
    ("fwd",   4,   64,         ANY,    (64, 32, 4, 2)),
    ("fwd",   4,   128,        ANY,    (32, 32, 8, 1)),
    ("fwd",   4,   256,        ANY,    (32, 16, 8, 1)),
    ("dkdv",  2,   64,         ANY,    (64, 64, 4, 3)),
    ("dkdv",  2,   128,        ANY,    (64, 64, 4, 2)),
    ("dkdv",  2,   256,        ANY,    (64, 32, 8, 2)),
    ("dkdv",  4,   64,         ANY,    (32, 32, 4, 2)),
    ("dkdv",  4,   128,        ANY,    (32, 32, 8, 1)),
    ("dkdv",  4,   256,        ANY,    (32, 16, 8, 1)),
    ("dq",    2,   64,         ANY,    (128, 64, 8, 3)),
    ("dq",    2,   128,        ANY,    (128, 64, 8, 3)),
    ("dq",    2,   256,        ANY,    (64, 32, 8, 2)),
    ("dq",    4,   64,         ANY,    (32, 32, 4, 2)),
    ("dq",    4,   128,        ANY,    (32, 32, 8, 1)),
    ("dq",    4,   256,        ANY,    (32, 16, 8, 1)),
)

# Autotune mode (benchmarking): the heuristic point plus these candidates, filtered by
# keep(), at most MAX_AUTOTUNE per call. Keyed by (kind, element size, max_block_d).
AUTOTUNE_GRID = {
    ("fwd", 2, 128): ((256, 64, 8, 3), (256, 64, 8, 4), (128, 128, 8, 3)),
    ("fwd", 2, 256): ((64, 32, 4, 2), (64, 64, 4, 2), (128, 64, 8, 2)),
    ("dkdv", 2, 64): ((64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 8, 3)),
    ("dkdv", 2, 128): ((128, 64, 8, 2), (64, 32, 4, 2), (128, 64, 8, 3)),
    ("dkdv", 2, 256): ((64, 64, 8, 2), (64, 32, 4, 2), (32, 32, 4, 2)),
    ("dq", 2, 128): ((128, 64, 8, 2), (128, 128, 8, 2), (128, 32, 8, 3)),
    ("dq", 2, 256): ((64, 64, 8, 2), (64, 32, 4, 2), (32, 32, 4, 2)),
    ("fwd", 4, 256): ((32, 32, 4, 1), (32, 16, 4, 1)),
    ("dkdv", 4, 256): ((32, 32, 4, 1), (32, 16, 4, 1)),
    ("dq", 4, 256): ((32, 32, 4, 1), (32, 16, 4, 1)),
}
# 4 configs x 3 kernels x (causal, not) = 24 compiles for the bench's --quick subset.
MAX_AUTOTUNE = 4
# Autotune results are kept in Triton's on-disk cache, so a process reuses the choice of an
# earlier one. FLASHCHECK_AUTOTUNE_CACHE=0 turns that off: the benchmark's prewarm processes
# tune on a shared, busy GPU, and their choices must not be reused by the timed run.
AUTOTUNE_CACHE = os.environ.get("FLASHCHECK_AUTOTUNE_CACHE", "1") != "0"
# Last resort when neither the table nor the grid fits a device's shared memory.
FALLBACK = ((32, 32, 4, 1), (32, 16, 4, 1), (16, 16, 4, 1))
# Single configuration under the interpreter: 16x16 tiles make the tail-tile and
# multi-tile paths reachable with N <= 48 and keep numpy's per-program cost small.
INTERPRETER_BLOCK = 16
INTERPRETER_POINT = (INTERPRETER_BLOCK, INTERPRETER_BLOCK, 4, 1)
# Autotune key buckets: sequence lengths rounded up to a power of two, capped here, so
# that shapes within a bucket share one tuning result.
BUCKET_MIN, BUCKET_MAX = 16, 16384
SMEM_MARGIN = 1.0  # no extra margin: smem_bytes already overestimates (see its docstring)
H200_SMEM = 232448  # max_shared_mem reported for an H200 (227 KiB), used by the CPU tests

_props_cache: dict[int, dict] = {}
_mode = ["heuristic"]

# Hopper paths (sm_90 and later, 2-byte dtypes). TMA: the tile loops read their streamed
# operands (K and V; Q and dO for dK/dV) through tensor descriptors, one bulk tensor copy per
# tile, instead of per-thread pointer loads. "auto" uses them where the device and the
# schedule table allow, "on" wherever the layout allows (the interpreter included: the CPU
# tests run the descriptor path), "off" never.
TMA_MODES = ("auto", "on", "off")
# Schedule flags, first row matching (kind, element size, BLOCK_D <= max_block_d, band: the
# launch has a causal-like band, ANY for either): tma, read
# the streamed tiles through tensor descriptors; ws, warp-specialise the tile loop (with TMA
# only); reverse, launch the last tile first under a causal-like band (the forward's and dQ's
# last query tiles see the most keys); rows, the dK/dV loop reads each query tile's lse and
# delta through 2-D descriptors too (with TMA only) instead of per-thread loads. From the
# H200 sweep (docs/benchmarks/sweep.md, bf16, D = 128, N = 4096): descriptors gain 2-5 % on
# the dK/dV and dQ kernels (the dQ kernel a little more with warp specialisation) and lose up
# to 11 % on the forward's 256-row tile; the dK/dV kernel's lse and delta through
# descriptors take another 5 % off the whole backward (14.93 -> 14.09 ms, causal 8.93 ->
# 8.52: no per-thread copies, no wait and barrier for them in the tile loop); early, the
# backward kernels issue the dP product right after the scores' product, before the
# exponentials (the same operations, in the same order per element): the dK/dV kernel's dV
# product then runs while dS is formed, 3-4 % off the whole backward without a band (sweep
# set "early"); at D = 128 with a causal-like band the kernel spills (ptxas: 276/340 bytes
# against 48/52) and is 14 % slower, so it is off there; persist, the forward runs
# that many programs per multiprocessor (0: one per tile), each looping over query tiles in
# the grid's dispatch order (no block launch or drain between tiles); halves, a forward tile
# of under 256 rows is held as two halves too (both the forward's, bit-identical to the
# plain path). At D <= 64 (sweep rounds 12-13, D = 64, each alternated with the pointer
# path): the dK/dV kernel with descriptors and ROWS, 4-6 % off the whole backward without a
# band, and with EARLY too under one, 3-4 %; the dQ kernel with descriptors under a band,
# 7-9 % (without one it is 12 % slower, so it stays on the pointer path there); all
# bit-identical to the pointer path. Other head dims were not swept and keep the pointer path.
SCHEDULE_TABLE = (
    # kind    elem max_block_d band  tma    ws     reverse rows    early  persist halves
    ("fwd",   2,   256,        ANY,  False, False, True,   False,  False, 0,      False),
    ("dkdv",  2,   64,         False, True, False, False,  True,   False, 0,      False),
    ("dkdv",  2,   64,         True,  True, False, False,  True,   True,  0,      False),
    ("dkdv",  2,   128,        False, True, False, False,  True,   True,  0,      False),
    ("dkdv",  2,   128,        True,  True, False, False,  True,   False, 0,      False),
    ("dkdv",  2,   256,        ANY,  False, False, False,  False,  False, 0,      False),
    ("dq",    2,   64,         False, False, False, True,  False,  False, 0,      False),
    ("dq",    2,   64,         True,  True, False, True,   False,  False, 0,      False),
    ("dq",    2,   128,        ANY,  True,  True,  True,   False,  False, 0,      False),
    ("dq",    2,   256,        ANY,  False, False, True,   False,  False, 0,      False),
    ("fwd",   4,   256,        ANY,  False, False, True,   False,  False, 0,      False),
    ("dkdv",  4,   256,        ANY,  False, False, False,  False,  False, 0,      False),
    ("dq",    4,   256,        ANY,  False, False, True,   False,  False, 0,      False),
)


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """The environment variable ``name`` (``default`` when unset), which must be one of
    ``choices``: else a ValueError naming the variable, the choices and the value."""
    value = os.environ.get(name, default)
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


_tma_mode = [os.environ.get("FLASHCHECK_TMA", "auto")]


def schedule(kind: str, elem: int, block_d: int, band: bool = False) -> dict:
    """The :data:`SCHEDULE_TABLE` flags of a launch (``band``: it has a causal-like band):
    ``{"tma", "ws", "reverse", "rows", "early", "persist", "halves"}``."""
    _check_kind(kind, block_d, elem)
    for k, e, max_bd, b, tma_, ws, reverse, rows, early, persist, halves in SCHEDULE_TABLE:
        if k == kind and e == elem and block_d <= max_bd and b in (ANY, bool(band)):
            return dict(tma=tma_, ws=ws, reverse=reverse, rows=rows, early=early,
                        persist=persist, halves=halves)
    raise LookupError(f"no schedule for kind={kind}, block_d={block_d}, elem={elem}, "
                      f"band={band}")


def set_tma(mode: str) -> None:
    """Select when the kernels read tiles through tensor descriptors (:data:`TMA_MODES`)."""
    if mode not in TMA_MODES:
        raise ValueError(f"TMA mode must be one of {TMA_MODES}, got {mode!r}")
    _tma_mode[0] = mode


@contextlib.contextmanager
def _switched(store: list, setter, mode: str):
    """Run the block with ``setter(mode)`` applied, then put ``store[0]`` back."""
    prev = store[0]
    setter(mode)
    try:
        yield
    finally:
        store[0] = prev


def tma(mode: str):
    """Context manager: run the block with TMA ``mode``, then restore the previous one."""
    return _switched(_tma_mode, set_tma, mode)


def use_tma(kind: str, device: torch.device, elem: int, block_d: int,
            band: bool = False) -> bool:
    """Whether a launch of ``kind`` on ``device`` with ``elem``-byte operands (``band``: under
    a causal-like band) reads its tiles through tensor descriptors (the layout is checked by
    the launcher): "on" always, "off" never, "auto" on sm_90 and later where the
    :data:`SCHEDULE_TABLE` row says so."""
    mode = _tma_mode[0]
    if mode == "off":
        return False
    if mode == "on":
        return True
    return (not INTERPRET and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9
            and schedule(kind, elem, block_d, band)["tma"])


GLUON_MODES = ("auto", "tile", "persistent", "off")
_gluon_mode = [env_choice("FLASHCHECK_GLUON", GLUON_MODES, "auto")]
# The forward's Gluon path (kernels/flash_attention_gluon.py) by head dim, one program per
# tile: the smallest key length it takes. Measured beside the Triton forward on the H200,
# the 24 configurations of kernels/bench.py in one call (docs/benchmarks/sweep.md round 17):
# at D = 128 faster in all 12 (1.01-1.28x); at D = 64 faster at N = 16K (1.02-1.05x), not at
# 1K (0.92-1.00x) nor at 4K fp16 (0.99x).
GLUON_FWD_MIN_KEYS = {128: 1, 64: 4097}
# The persistent grid (one program per multiprocessor over the tiles) by head dim: the
# largest key length "auto" gives it. Measured on the H100 under triton 3.9 (sweep.md round
# 21, causal tiles in pairs; time persistent / per tile, every timing of the round): D = 128
# at 1K 0.84-0.92 (8 of 8 faster), at 4K 0.92-1.05 (10 of 14 faster), at 16K 1.00-1.12 (8
# of 8 slower); D = 64 against the Triton forward in the same call 0.89-1.00 (12 of 12
# faster at 1K, 4K and 16K), against per tile at 16K 0.94-1.01 (3 of 4). Round 26 (H100,
# triton 3.9, the D = 64 forwards at 4K and 16K, each mode alternated with the issue-time
# kernels in one call): "auto" faster than "off" in 7 of 8 and than "tile" in 6 of 8.
GLUON_PERSISTENT_MAX_KEYS = {128: 4096, 64: 16384}


def set_gluon(mode: str) -> None:
    """Select the forward's Gluon path (:data:`GLUON_MODES`): "auto", the default, per
    problem (:func:`gluon_grid`: the persistent grid up to
    :data:`GLUON_PERSISTENT_MAX_KEYS`, one program per tile above); "tile": one program per
    tile wherever :data:`GLUON_FWD_MIN_KEYS` allows; "persistent": one program per
    multiprocessor looping over the tiles wherever "auto" takes the Gluon path; "off": the
    Triton forward always. The environment variable ``FLASHCHECK_GLUON`` sets it at
    import."""
    if mode not in GLUON_MODES:
        raise ValueError(f"Gluon mode must be one of {GLUON_MODES}, got {mode!r}")
    _gluon_mode[0] = mode


def gluon(mode: str):
    """Context manager: run the block with Gluon ``mode``, then restore the previous one."""
    return _switched(_gluon_mode, set_gluon, mode)


def get_gluon() -> str:
    """The current Gluon mode (see :func:`set_gluon`)."""
    return _gluon_mode[0]


def gluon_grid(head_dim: int, n_keys: int) -> str | None:
    """The Gluon forward's grid for this head dim and key length under the current mode:
    "persistent", "tile", or None (the Triton forward). Its other conditions:
    flash_attention_gluon.supported."""
    mode = _gluon_mode[0]
    tile = n_keys >= GLUON_FWD_MIN_KEYS.get(head_dim, math.inf)
    if mode == "off":
        return None
    if mode == "tile":
        return "tile" if tile else None
    persistent = n_keys <= GLUON_PERSISTENT_MAX_KEYS.get(head_dim, 0)
    if mode == "persistent":
        return "persistent" if persistent or tile else None
    return "persistent" if persistent else ("tile" if tile else None)


GLUON_BWD_MODES = ("auto", "off", "split", "writer")
# The form "auto" takes: writer, the faster of the two in both determinisms (one turn per
# tile taken by its writer warp; split's ordered form waits in its consumers and loses 45 %)
# with GPU tests, sanitizers and campaigns passed (docs/benchmarks/sweep.md, rounds 19-20).
GLUON_BWD_AUTO = "writer"
_gluon_bwd_mode = [env_choice("FLASHCHECK_GLUON_BWD", GLUON_BWD_MODES, "auto")]


def set_gluon_bwd(mode: str) -> None:
    """Select the backward's Gluon form (kernels/flash_attention_gluon_bwd.py) where it
    applies (:data:`GLUON_BWD_MODES`): "auto", the default (:data:`GLUON_BWD_AUTO`'s form),
    "off" (the Triton kernels always), or "split" / "writer" (``deterministic=False`` calls
    take that form, deterministic ones its ordered variant). The kernel needs a Triton whose
    Gluon has the bulk reduce-add (3.9, not 3.6) and sm_90; elsewhere every mode runs the
    Triton kernels. The environment variable ``FLASHCHECK_GLUON_BWD`` sets it at import."""
    if mode not in GLUON_BWD_MODES:
        raise ValueError(f"Gluon backward mode must be one of {GLUON_BWD_MODES}, got {mode!r}")
    _gluon_bwd_mode[0] = mode


def gluon_bwd(mode: str):
    """Context manager: run the block with Gluon backward ``mode``, then restore the previous
    one."""
    return _switched(_gluon_bwd_mode, set_gluon_bwd, mode)


def get_gluon_bwd() -> str:
    """The current Gluon backward mode (see :func:`set_gluon_bwd`)."""
    return _gluon_bwd_mode[0]


def use_row_tma(kind: str, elem: int, block_d: int, band: bool = False) -> bool:
    """Whether a launch that reads its tiles through descriptors (the caller has decided
    that with :func:`use_tma` and the layout) reads the per-row lse and delta through
    descriptors too: the dK/dV kernel only; "on" always, "auto" where the
    :data:`SCHEDULE_TABLE` row says so (the layout is checked by the launcher)."""
    if kind != "dkdv" or _tma_mode[0] == "off":
        return False
    return _tma_mode[0] == "on" or schedule(kind, elem, block_d, band)["rows"]


def use_reduce(device: torch.device) -> bool:
    """Whether the non-deterministic backward adds its dQ tiles into the fp32 accumulator by
    bulk tensor reduce-adds through a descriptor (one per tile) instead of per-element
    atomics: on sm_90 and later unless the TMA mode is "off" (the layout is checked by the
    launcher). On the H200 at bf16, D = 128, N = 4096 the whole atomic backward takes
    15.4 ms with them against 31.9 ms with per-element atomics (causal 10.3 against 18.4;
    docs/benchmarks/sweep.md, round 6). Never under the interpreter, which has no
    descriptor reduce."""
    return (_tma_mode[0] != "off" and not INTERPRET and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def set_tuning(mode: str) -> None:
    """Select how launch configurations are chosen for every later call.

    ``"heuristic"`` (default): one configuration from :data:`HEURISTIC_TABLE`, no
    benchmarking, so a new shape costs at most one compile per kernel. ``"autotune"``:
    Triton's autotuner over the small :data:`AUTOTUNE_GRID`, keyed on bucketed sequence
    lengths, BLOCK_D, dtype and the band flags (for benchmarks). Under the interpreter both
    modes run the single interpreter configuration.
    """
    if mode not in TUNING_MODES:
        raise ValueError(f"tuning mode must be one of {TUNING_MODES}, got {mode!r}")
    _mode[0] = mode


def get_tuning() -> str:
    """The current tuning mode (see :func:`set_tuning`)."""
    return _mode[0]


def tuning(mode: str):
    """Context manager: run the block with tuning ``mode``, then restore the previous one."""
    return _switched(_mode, set_tuning, mode)


def _device_properties(device_index: int | None) -> dict:
    """Triton's properties of a CUDA device (``max_shared_mem``, ``multiprocessor_count``,
    ...), read once per device."""
    if device_index is None:
        device_index = torch.cuda.current_device()
    if device_index not in _props_cache:
        _props_cache[device_index] = dict(
            triton.runtime.driver.active.utils.get_device_properties(device_index))
    return _props_cache[device_index]


def smem_limit(device_index: int | None = None) -> int:
    """Shared memory per block on the current CUDA device, in bytes."""
    return int(_device_properties(device_index)["max_shared_mem"])


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (the persistent forward's and the split decode's
    program counts); 1 off CUDA (the interpreter runs programs one at a time)."""
    if device.type != "cuda":
        return 1
    return int(_device_properties(device.index)["multiprocessor_count"])


def smem_bytes(kind: str, outer: int, inner: int, block_d: int, elem: int, stages: int) -> int:
    """Shared-memory model of one program: operand tiles times pipeline stages. It is a
    model, not a bound: for the heuristic configs Triton 3.6 allocated 0.7-1.25x of it on
    sm_90 (forward 128x64, D = 128, fp16, 3 stages: 160 KiB allocated, 128 KiB modelled;
    every heuristic config allocated at most 176 KiB of the H200's 227 KiB). An autotune
    config that still does not fit is skipped by Triton's autotuner (OutOfResources).

    ``kind`` "fwd": the resident tile is the Q tile of ``outer`` rows; each pipeline stage
    holds a K and a V tile of ``inner`` rows. "dq": resident Q and dO, streamed K and V.
    "dkdv": resident K and V (``outer`` rows), streamed Q and dO (``inner`` rows).
    """
    resident = (1 if kind == "fwd" else 2) * outer * block_d
    streamed = max(stages, 1) * 2 * inner * block_d
    return elem * (resident + streamed)


def keep(kind: str, cfg: tuple[int, int, int, int], block_d: int, elem: int, limit: int) -> bool:
    """Whether config ``cfg`` = (outer, inner, warps, stages) fits the shared-memory
    ``limit`` (bytes) for this BLOCK_D and element size."""
    outer, inner, _warps, stages = cfg
    return smem_bytes(kind, outer, inner, block_d, elem, stages) <= SMEM_MARGIN * limit


def _check_kind(kind: str, block_d: int, elem: int) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if block_d not in (16, 32, 64, 128, 256):
        raise ValueError(f"block_d must be a power of two in [16, 256], got {block_d!r}")
    if elem not in (2, 4):
        raise ValueError(f"elem (bytes per element) must be 2 or 4, got {elem!r}")


def heuristic_point(kind: str, block_d: int, elem: int, causal: bool):
    """The :data:`HEURISTIC_TABLE` entry for a call (before the shared-memory check)."""
    _check_kind(kind, block_d, elem)
    for k, e, max_bd, c, point in HEURISTIC_TABLE:
        if k == kind and e == elem and block_d <= max_bd and c in (ANY, causal):
            return point
    raise LookupError(f"no heuristic config for kind={kind}, block_d={block_d}, elem={elem}, "
                      f"causal={causal}")


def autotune_points(kind: str, block_d: int, elem: int, causal: bool, limit: int) -> list:
    """The configs the autotuner benchmarks for a call: the heuristic point first, then the
    grid, all passing :func:`keep`, at most :data:`MAX_AUTOTUNE`; never empty."""
    _check_kind(kind, block_d, elem)
    grid = next((pts for (k, e, max_bd), pts in sorted(AUTOTUNE_GRID.items())
                 if k == kind and e == elem and block_d <= max_bd), ())
    pts: list = []
    for p in (heuristic_point(kind, block_d, elem, causal), *grid):
        if p not in pts and keep(kind, p, block_d, elem, limit):
            pts.append(p)
    return pts[:MAX_AUTOTUNE] or [fixed_point(kind, block_d, elem, causal, limit)]


def fixed_point(kind: str, block_d: int, elem: int, causal: bool, limit: int):
    """The heuristic-mode config: the table entry if it fits the shared memory, else the
    first fitting grid config, else the first fitting fallback (else the smallest one)."""
    first = heuristic_point(kind, block_d, elem, causal)
    if keep(kind, first, block_d, elem, limit):
        return first
    grid = [p for (k, e, max_bd), pts in sorted(AUTOTUNE_GRID.items())
            if k == kind and e == elem and block_d <= max_bd for p in pts]
    for p in (*grid, *FALLBACK):
        if keep(kind, p, block_d, elem, limit):
            return p
    return FALLBACK[-1]


def all_points(kind: str) -> list:
    """Every config the autotuner of ``kind`` may be asked to run (its ``configs`` list)."""
    pts = [row[4] for row in HEURISTIC_TABLE if row[0] == kind]
    pts += [p for (k, _e, _bd), grid in sorted(AUTOTUNE_GRID.items()) if k == kind for p in grid]
    pts += list(FALLBACK)
    return list(dict.fromkeys(pts))


def make_configs(kind: str, outer_name: str, inner_name: str,
                 pre_hook=None) -> list[triton.Config]:
    """The autotuner's config list (the per-call filter runs in :func:`make_pruner`)."""
    pts = [INTERPRETER_POINT] if INTERPRET else all_points(kind)
    return [triton.Config({outer_name: o, inner_name: i}, num_warps=w, num_stages=s,
                          pre_hook=pre_hook)
            for o, i, w, s in pts]


def make_pruner(kind: str, outer_name: str, inner_name: str, elem_arg: str):
    """An ``early_config_prune`` keeping the :func:`autotune_points` of the call."""

    def prune(configs, named_args, **kwargs):
        if INTERPRET or len(configs) == 1:
            return configs
        t = named_args[elem_arg]
        want = autotune_points(kind, kwargs["BLOCK_D"], t.element_size(),
                               bool(kwargs["IS_CAUSAL"]), smem_limit(t.device.index))
        by_point = {(c.kwargs[outer_name], c.kwargs[inner_name], c.num_warps, c.num_stages): c
                    for c in configs}
        return [by_point[p] for p in want]

    return prune


def launch_point(kind: str, block_d: int, elem: int, causal: bool, device: torch.device):
    """The config of a heuristic-mode launch on ``device``."""
    if INTERPRET or device.type != "cuda":
        return INTERPRETER_POINT
    return fixed_point(kind, block_d, elem, causal, smem_limit(device.index))


def bucket(n: int) -> int:
    """Autotune key bucket of a sequence length: next power of two in [16, 16384]."""
    return min(BUCKET_MAX, triton.next_power_of_2(max(n, BUCKET_MIN)))


def block_d(D: int) -> int:
    """Head dim padded to a power of two, at least 16 (the tl.dot minimum)."""
    return triton.next_power_of_2(max(D, 16))

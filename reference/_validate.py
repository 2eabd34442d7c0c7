"""Argument checking shared by every function in ``reference/``.

All three oracles (``attention_fp64``, ``online_attention``, ``naive_attention``) take the
SDPA-compatible contract of docs/contracts.md §1. The checks live here once so that the
oracles reject exactly the same inputs with exactly the same messages. Every error names
the argument and the allowed range.

Caveat: inputs are checked for shape, dtype, device and flag validity only; NaN or inf in
``query``/``key``/``value`` is *not* an error (it propagates, as in any kernel). An
additive ``attn_mask`` containing NaN or +inf is rejected, because no softmax semantics
exist for it.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")
ORDERS = ("fa2", "fa1")
PRECISIONS = ("exact", "emulate")
# The implementation choices of ``online_attention`` (reference/online.py); first = default.
GQA_REDUCES = ("per_head_fp32", "group_fp32", "per_head_rounded", "expand_autograd")
SCALE_ATS = ("scores", "q", "exp2", "q_exp2", "exp2_fma", "qk_sqrt")
OPERAND_PRECISIONS = ("input", "fp32")
DS_SCALES = ("after_round", "before_round")
NORMALIZES = ("divide", "reciprocal", "before_pv")
EXP_ACCURACIES = ("library", "approx", "fwd_fast_low", "fwd_fast_high")
TF32_ROUNDINGS = ("nearest", "truncate")
BWD_SCORES = ("as_forward", "k16", "k8", "k1", "k_prescaled")
ACCUMULATES = ("blocked", "fma_chain", "input_dtype")
FP32_DOTS = ("ieee", "3xtf32")
BIAS_FMAS = ("none", "split")


@dataclass(frozen=True)
class Problem:
    """The validated sizes and options of one attention call."""

    B: int
    Hq: int
    Hkv: int
    Nq: int
    Nk: int
    D: int
    scale: float
    is_causal: bool
    causal_alignment: str
    window: tuple[int, int] | None

    @property
    def group(self) -> int:
        """Query heads per kv head (1 without GQA)."""
        return self.Hq // self.Hkv

    def expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        """(B, Hkv, N, D) -> (B, Hq, N, D): each kv head repeated for its query heads."""
        return t.repeat_interleave(self.group, dim=1) if self.group > 1 else t

    def reduce_kv(self, t: torch.Tensor) -> torch.Tensor:
        """(B, Hq, Nk, D) gradients -> (B, Hkv, Nk, D): summed over each kv head's group."""
        if self.group == 1:
            return t
        return t.reshape(self.B, self.Hkv, self.group, self.Nk, self.D).sum(dim=2)


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{name}: expected dtype float16, bfloat16, float32 or float64; got {t.dtype}"
        )
    if t.dim() != 4:
        raise ValueError(f"{name}: expected a 4-d tensor; got shape {_shape(t)}")
    if any(s < 1 for s in t.shape):
        raise ValueError(f"{name}: every dimension must be >= 1; got shape {_shape(t)}")
    return t


def _check_bool(name: str, x: object) -> bool:
    if not isinstance(x, bool):
        raise ValueError(f"{name}: expected True or False; got {x!r}")
    return x


def check_dropout(dropout_p: object) -> None:
    """``dropout_p`` must be a number in [0, 1); anything but 0 is not implemented."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise ValueError(f"dropout_p: expected a float in [0, 1); got {dropout_p!r}")
    if not (0.0 <= float(dropout_p) < 1.0):
        raise ValueError(f"dropout_p: expected a float in [0, 1); got {dropout_p!r}")
    if dropout_p != 0.0:
        raise NotImplementedError(
            f"dropout_p: only 0.0 is supported by the reference oracles; got {dropout_p!r}"
        )


def check_window(window: object) -> tuple[int, int] | None:
    """``window`` is None or two ints, each >= 0 or -1 (unbounded on that side)."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window: expected None or (left, right); got {window!r}")
    out = []
    for side, w in zip(("left", "right"), window, strict=True):
        if isinstance(w, bool) or not isinstance(w, numbers.Integral):
            raise ValueError(f"window: {side} must be an int >= -1; got {w!r}")
        if w < -1:
            raise ValueError(f"window: {side} must be >= -1 (-1 = unbounded); got {w}")
        out.append(int(w))
    return (out[0], out[1])


def check_alignment(causal_alignment: object) -> str:
    if causal_alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(
            f"causal_alignment: expected one of {CAUSAL_ALIGNMENTS}; got {causal_alignment!r}"
        )
    return causal_alignment  # type: ignore[return-value]


def check_scale(scale: object, D: int) -> float:
    """``scale`` is None (1/sqrt(D)) or a finite real > 0."""
    if scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(f"scale: expected None or a finite float > 0; got {scale!r}")
    s = float(scale)
    if not math.isfinite(s) or s <= 0.0:
        raise ValueError(f"scale: expected None or a finite float > 0; got {scale!r}")
    return s


def check_mask(attn_mask: object, target: tuple[int, int, int, int], device) -> None:
    """``attn_mask`` is None, or a bool/floating tensor broadcastable to ``target``."""
    if attn_mask is None:
        return
    if not isinstance(attn_mask, torch.Tensor):
        raise ValueError(f"attn_mask: expected None or a torch.Tensor; got {type(attn_mask)}")
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        raise ValueError(
            f"attn_mask: expected dtype bool (True = may attend) or floating (added to the "
            f"scores); got {attn_mask.dtype}"
        )
    shape = tuple(attn_mask.shape)
    ok = len(shape) <= 4 and all(
        s in (1, t) for s, t in zip(reversed(shape), reversed(target), strict=False)
    )
    if not ok:
        raise ValueError(
            f"attn_mask: expected a shape broadcastable to (B, Hq, Nq, Nk) = {target}; "
            f"got {shape}"
        )
    if attn_mask.device != device:
        raise ValueError(
            f"attn_mask: expected device {device} (the device of query); got {attn_mask.device}"
        )
    if attn_mask.dtype != torch.bool:
        bad = torch.isnan(attn_mask) | (attn_mask == math.inf)
        if bool(bad.any()):
            raise ValueError(
                "attn_mask: an additive mask must be finite or -inf (masked); found NaN or +inf"
            )


def check_attention_args(
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window,
    causal_alignment,
) -> Problem:
    """Validate one SDPA-style call (contracts.md §1) and return its sizes and options."""
    _check_tensor("query", query)
    _check_tensor("key", key)
    _check_tensor("value", value)
    B, Hq, Nq, D = query.shape
    if key.shape[0] != B or key.shape[3] != D:
        raise ValueError(
            f"key: expected shape (B, Hkv, Nk, D) with B={B}, D={D} matching query; "
            f"got {_shape(key)}"
        )
    if value.shape != key.shape:
        raise ValueError(
            f"value: expected the shape of key {_shape(key)} (B, Hkv, Nk, D); got {_shape(value)}"
        )
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            raise ValueError(f"{name}: expected dtype {query.dtype} (that of query); got {t.dtype}")
        if t.device != query.device:
            raise ValueError(
                f"{name}: expected device {query.device} (that of query); got {t.device}"
            )
    Hkv, Nk = key.shape[1], key.shape[2]
    _check_bool("enable_gqa", enable_gqa)
    if not enable_gqa and Hq != Hkv:
        raise ValueError(
            f"key: expected Hkv == Hq = {Hq} heads when enable_gqa=False; got Hkv={Hkv}"
        )
    if Hq % Hkv != 0:
        raise ValueError(
            f"key: expected Hkv dividing Hq = {Hq} (enable_gqa); got Hkv={Hkv}"
        )
    check_mask(attn_mask, (B, Hq, Nq, Nk), query.device)
    check_dropout(dropout_p)
    _check_bool("is_causal", is_causal)
    s = check_scale(scale, D)
    w = check_window(window)
    a = check_alignment(causal_alignment)
    return Problem(B, Hq, Hkv, Nq, Nk, D, s, is_causal, a, w)


def check_block(name: str, b: object) -> int:
    if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1:
        raise ValueError(f"{name}: expected an int >= 1; got {b!r}")
    return int(b)


def check_count(name: str, x: object) -> int:
    """A keyword switch that must be an int >= 1 (e.g. ``kv_splits``)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 1:
        raise ValueError(f"{name}: expected an int >= 1; got {x!r}")
    return int(x)


def check_flag(name: str, x: object) -> bool:
    """A keyword switch that must be True or False."""
    return _check_bool(name, x)


def check_choice(name: str, x: object, allowed: tuple[str, ...]) -> str:
    if x not in allowed:
        raise ValueError(f"{name}: expected one of {allowed}; got {x!r}")
    return x  # type: ignore[return-value]

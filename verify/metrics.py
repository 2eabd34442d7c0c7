"""Per-tensor error metrics of a kernel's result against the float64 reference.

For one tensor (out, lse, dq, dk or dv) :func:`tensor_metrics` reports

- ``max_abs``: max |got - want|;
- ``max_rel``: max |got - want| / max(|want|, guard), the guard being a fraction of the
  reference's RMS (:data:`REL_GUARD_FRACTION`), so that elements near zero do not turn a
  harmless absolute error into a huge relative one;
- ``rmse``: sqrt(mean((got - want)^2));
- ``bias``: mean(got - want), the signed error (a systematic rounding bias is a known cause
  of bf16 training blow-ups, and it hides in max/RMS numbers);
- ``max_ulps``: max |got - want| / ulp(want) with the ulp taken in the *kernel's output
  dtype* at the reference value's magnitude (:func:`ulp`, which handles zero and
  subnormals: below the smallest normal the ulp is the subnormal spacing).

Caveats:
- All arithmetic is float64 on the device of ``want``. ``got`` is converted to float64
  exactly (every fp16/bf16/fp32 value is representable).
- Non-finite values are counted, not folded into the numbers: a NaN/Inf in ``got`` where
  ``want`` is finite is reported in ``n_nonfinite`` and the finite statistics are computed
  over the remaining elements (the verdict fails on ``n_nonfinite > 0`` anyway). Where
  ``want`` itself is non-finite (lse = -inf on a fully masked row) ``got`` must match it
  exactly, else that element counts as non-finite mismatch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Unit roundoff (half the spacing of 1.0's neighbourhood) per format (DESIGN §5).
UNIT_ROUNDOFF = {
    "bfloat16": 2.0**-8,  # 8 significand bits (7 stored)
    "float16": 2.0**-11,  # 11 significand bits (10 stored)
    "tf32": 2.0**-11,  # TF32 keeps fp16's 10 stored mantissa bits
    "float32": 2.0**-24,  # 24 significand bits (23 stored)
    "float64": 2.0**-53,
}

# (stored mantissa bits, minimum normal exponent) per dtype: ulp(x) = 2^(max(e, emin) - p).
_FORMAT = {
    "bfloat16": (7, -126),
    "float16": (10, -14),
    "float32": (23, -126),
    "float64": (52, -1022),
}

# Relative-error guard: |err| / max(|want|, REL_GUARD_FRACTION * rms(want)). 2^-4 of the RMS:
# an element 16x below the tensor's typical size carries absolute errors set by the typical
# size (the same sums produce it), so dividing by its own magnitude would only measure
# cancellation; 1/16 still lets a genuine 1-in-16 relative error on typical elements show.
REL_GUARD_FRACTION = 2.0**-4


def dtype_name(dtype: torch.dtype | str) -> str:
    """The canonical name ("float16", ...) of a torch dtype or name."""
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    else:
        name = str(dtype).removeprefix("torch.")
    if name not in _FORMAT and name != "tf32":
        raise ValueError(f"dtype must be one of {sorted(_FORMAT)} or 'tf32', got {dtype!r}")
    return name


def unit_roundoff(dtype: torch.dtype | str, *, tf32: bool = False) -> float:
    """Unit roundoff u of ``dtype``; with ``tf32=True`` float32 dot products use TF32's u."""
    name = dtype_name(dtype)
    if tf32 and name == "float32":
        return UNIT_ROUNDOFF["tf32"]
    return UNIT_ROUNDOFF[name]


def ulp(x: torch.Tensor, dtype: torch.dtype | str) -> torch.Tensor:
    """Spacing of ``dtype``'s grid at |x| (float64 result, same shape as ``x``).

    For |x| in [2^e, 2^(e+1)) with e >= emin the ulp is 2^(e - p) (p stored mantissa bits);
    for |x| below the smallest normal 2^emin (subnormals and zero) it is the subnormal
    spacing 2^(emin - p). Non-finite ``x`` gives NaN.
    """
    p, emin = _FORMAT[dtype_name(dtype)]
    a = x.detach().to(torch.float64).abs()
    _, e = torch.frexp(a)  # a = m * 2^e, m in [0.5, 1): floor(log2 a) = e - 1
    e = torch.where(a > 0, e.to(torch.float64) - 1, torch.full_like(a, float(emin)))
    e = torch.clamp(e, min=float(emin))
    out = torch.exp2(e - p)
    return torch.where(torch.isfinite(a), out, torch.full_like(out, math.nan))


def overflow_threshold(dtype: torch.dtype | str) -> float:
    """The smallest magnitude that rounds to inf in ``dtype`` under round-to-nearest: the
    largest finite value plus half its spacing (fp16: 65504 + 16 = 65520)."""
    big = torch.finfo(getattr(torch, dtype_name(dtype))).max
    return big + 0.5 * float(ulp(torch.tensor(big), dtype))


@dataclass
class Metrics:
    """Error statistics of one tensor (all floats are Python floats)."""

    max_abs: float
    max_rel: float
    rmse: float
    bias: float
    max_ulps: float
    worst_index: tuple  # argmax of |err| (of the non-finite mismatch if there is one)
    got: float
    want: float
    numel: int
    n_nonfinite: int  # elements whose got is NaN/Inf where want differs (incl. finite want)


def _index(flat: int, shape: torch.Size) -> tuple:
    idx = []
    for size in reversed(shape):
        idx.append(flat % size)
        flat //= size
    return tuple(reversed(idx))


def abs_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Elementwise |got - want| in float64; 0 where both are the same infinity, inf where
    they disagree on finiteness or either is NaN."""
    g = got.detach().to(torch.float64)
    w = want.detach().to(torch.float64, copy=False)
    if g.shape != w.shape:
        raise ValueError(f"got has shape {tuple(g.shape)}, want has {tuple(w.shape)}")
    if g.device != w.device:
        g = g.to(w.device)
    same = (g == w) | (torch.isnan(g) & torch.isnan(w))
    err = (g - w).abs()
    err = torch.where(same, torch.zeros_like(err), err)
    return torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)


def tensor_metrics(got: torch.Tensor, want: torch.Tensor, *, dtype: torch.dtype | str,
                   err: torch.Tensor | None = None) -> Metrics:
    """Error metrics of ``got`` against the float64 ``want``; ulps in ``dtype`` (the kernel's
    output dtype). ``err``: ``abs_error(got, want)`` when the caller has it already."""
    g = got.detach().to(torch.float64)
    w = want.detach().to(torch.float64)
    if g.shape != w.shape:
        raise ValueError(f"got has shape {tuple(g.shape)}, want has {tuple(w.shape)}")
    g = g.to(w.device)
    numel = w.numel()
    if numel == 0:
        return Metrics(0.0, 0.0, 0.0, 0.0, 0.0, (), 0.0, 0.0, 0, 0)
    err = abs_error(g, w) if err is None else err
    # Every statistic stays a device tensor until one transfer at the end: on a GPU each
    # float() is a synchronisation, and there are a dozen per tensor otherwise.
    bad = ~torch.isfinite(err)
    finite = torch.isfinite(g) & torch.isfinite(w)
    zero = torch.zeros_like(w)
    signed = torch.where(finite, g - w, zero)
    ferr = torch.where(finite, err, zero)
    nfin = torch.clamp(finite.sum(), min=1).to(torch.float64)
    wf = torch.where(finite, w, zero)
    rms_w = torch.sqrt((wf * wf).sum() / nfin)
    guard = torch.clamp(REL_GUARD_FRACTION * rms_w, min=torch.finfo(torch.float64).tiny)
    rel = ferr / torch.maximum(wf.abs(), guard)
    ulps = ferr / ulp(wf, dtype)
    n_bad = bad.sum()
    # the first non-finite mismatch if there is one, else the largest finite error
    flat_t = torch.where(n_bad > 0, torch.argmax(bad.flatten().to(torch.uint8)),
                         torch.argmax(ferr.flatten()))
    stats = torch.stack([
        n_bad.to(torch.float64), ferr.max(), rel.max(), torch.sqrt((ferr * ferr).sum() / nfin),
        signed.sum() / nfin, ulps.max(), flat_t.to(torch.float64),
        g.flatten()[flat_t].to(torch.float64), w.flatten()[flat_t],
    ]).tolist()
    n_nonfinite, max_abs, max_rel, rmse, bias, max_ulps, flat, got_v, want_v = stats
    n_nonfinite, flat = int(n_nonfinite), int(flat)
    return Metrics(
        max_abs=math.inf if n_nonfinite else max_abs,
        max_rel=max_rel,
        rmse=rmse,
        bias=bias,
        max_ulps=max_ulps,
        worst_index=_index(flat, w.shape),
        got=got_v,
        want=want_v,
        numel=numel,
        n_nonfinite=n_nonfinite,
    )

"""Value distributions for a case's inputs: the knobs, their validation, and the draws.

A distribution is a small dict of knobs (``{"kind": "normal", "sigma": 1.0}``), never the
elements themselves. :func:`draw_qkv` and :func:`draw_grad` turn those knobs plus a seed into
logical (B, H, N, D) tensors on the CPU, in float64, in a fixed order; the caller rounds them
to the case dtype and lays them out. Each tensor has its own random stream (see
:func:`stream`), so changing the mask of a case does not change its q, k or v.

Kinds for q, k, v (``DIST_KINDS``):

- ``normal`` (``sigma``): N(0, sigma^2) elementwise.
- ``uniform`` (``a``): U(-a, a) elementwise.
- ``outliers`` (``p``, ``outlier_sigma``): FlashAttention-3's N(0,1) + N(0,100)·Bernoulli(0.001).
  We read N(0, 100) in the usual N(mean, variance) convention: the added term has standard
  deviation 10, which is also how the FA3 paper (§4.3, numerical error) describes it in
  words. ``outlier_sigma`` (a standard deviation) defaults to 10.0 and ``p`` to 0.001.
- ``large_logits`` (``target``): q and k are N(0,1) multiplied by one common factor chosen
  so that the largest |scale · q·k| over the whole problem equals ``target`` (up to the
  factor's rounding to 3 significant digits and the rounding to the case dtype). With
  target 1e4 the scores overflow exp() in any float format unless the row maximum is
  subtracted first. v is N(0,1).
- ``tiny`` (``factor``): q, k, v are N(0,1) · factor · smallest-normal(dtype). For fp16
  (smallest normal 6.1e-5) and for bf16/fp32 (1.18e-38) about 68% of the elements then land
  below the smallest normal, i.e. are subnormal (|N(0,1)| < 1 with probability 0.68).
- ``ties`` (``groups``): every key of a (batch, kv head) is one of ``groups`` distinct
  vectors (1: all keys identical), assigned at random; q and v are N(0,1). Tied keys are
  bitwise equal after rounding, so their scores tie exactly.
- ``dominant`` (``margin``): per (batch, kv head) one key, at a random position, is
  aligned with a direction u that every query of the group shares with the same
  component; its scaled score exceeds every other score of every such query row by at
  least ``margin`` (before rounding), so the softmax puts >= 1 - N·exp(-margin) on it.
- ``constant_rows``: all query rows of a head are the same vector, and every value row
  is constant along D. k is N(0,1).

Kinds for dO (``GRAD_DIST_KINDS``): ``normal``, ``uniform``, ``outliers``, ``tiny`` as
above, and ``constant`` (``value``): every element equal to ``value``.

Caveats: the draws use torch's CPU generator (``torch.Generator`` seeded per stream). They
are bit-identical across runs and machines for a given torch version (factors derived
from a matmul are rounded to 3 significant digits first, see :func:`_coarse`); torch does
not promise that ``randn``'s CPU algorithm never changes across releases, so a case replayed under a
different torch may draw different (equally distributed) values — record the version with
a failure.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

# Parameter defaults per kind; the key order is the order used in JSON.
DIST_DEFAULTS: dict[str, dict] = {
    "normal": {"sigma": 1.0},
    "uniform": {"a": 1.0},
    "outliers": {"p": 0.001, "outlier_sigma": 10.0},
    "large_logits": {"target": 1e4},
    "tiny": {"factor": 1.0},
    "ties": {"groups": 1},
    "dominant": {"margin": 20.0},
    "constant_rows": {},
}
GRAD_DIST_DEFAULTS: dict[str, dict] = {
    "normal": {"sigma": 1.0},
    "uniform": {"a": 1.0},
    "outliers": {"p": 0.001, "outlier_sigma": 10.0},
    "tiny": {"factor": 1.0},
    "constant": {"value": 1.0},
}
DIST_KINDS = tuple(DIST_DEFAULTS)
GRAD_DIST_KINDS = tuple(GRAD_DIST_DEFAULTS)

# Allowed ranges: (lo, hi, lo_inclusive). The upper ends keep every drawn element finite in
# fp16 (max 65504): e.g. sigma <= 1e3 gives |x| <= ~6e3 at 6 sigma; target <= 1e6 needs a
# common factor of at most sqrt(1e6 / ~1) = 1e3 on O(1) elements.
_FLOAT_RANGES = {
    "sigma": (0.0, 1e3, False),
    "a": (0.0, 1e3, False),
    "p": (0.0, 1.0, True),
    "outlier_sigma": (0.0, 1e3, False),
    "target": (0.0, 1e6, False),
    "factor": (0.0, 1e3, False),
    "margin": (0.0, 1e3, False),
    "value": (-1e3, 1e3, True),
}
_INT_RANGES = {"groups": (1, 1 << 20)}

# Random streams: one per tensor, so the draws of one do not shift the others.
STREAMS = {"query": 0, "key": 1, "value": 2, "grad_out": 3, "mask": 4, "aux": 5,
           "block_table": 6, "cache_garbage": 7}


def stream(seed: int, name: str) -> torch.Generator:
    """A CPU generator for stream ``name`` of case ``seed`` (seed < 2**32, so no collisions)."""
    g = torch.Generator(device="cpu")
    g.manual_seed((int(seed) << 8) | STREAMS[name])
    return g


def check_kind_dict(d, table: Mapping, *, field: str, example: str, kinds=None):
    """The shared part of validating a ``{"kind": ..., **params}`` dict (distributions here,
    masks in verify.cases): a mapping, a known kind, no unknown parameter. Returns
    ``(kind, defaults of that kind)``; raises ValueError naming ``field``. ``kinds`` is the
    list shown in the message (default: the table's kinds, sorted)."""
    if not isinstance(d, Mapping):
        raise ValueError(f"{field} must be a dict like {{'kind': '{example}'}}, got {d!r}")
    kind = d.get("kind")
    if kind not in table:
        shown = sorted(table) if kinds is None else kinds
        raise ValueError(f"{field}.kind must be one of {shown}, got {kind!r}")
    defaults = table[kind]
    unknown = set(d) - {"kind"} - set(defaults)
    if unknown:
        allowed = sorted(defaults) or "none"
        raise ValueError(
            f"{field}: unknown parameter(s) {sorted(unknown)} for kind {kind!r}; allowed: {allowed}"
        )
    return kind, defaults


def normalize_dist(d, *, field: str = "dist", grad: bool = False) -> dict:
    """Validate a distribution dict and return it with defaults filled in.

    Raises ValueError naming ``field`` (and the parameter) with the allowed values/range.
    """
    table = GRAD_DIST_DEFAULTS if grad else DIST_DEFAULTS
    kind, defaults = check_kind_dict(d, table, field=field, example="normal")
    out: dict = {"kind": kind}
    for name, default in defaults.items():
        v = d.get(name, default)
        if name in _INT_RANGES:
            lo, hi = _INT_RANGES[name]
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"{field}.{name} must be an int in [{lo}, {hi}], got {v!r}")
        else:
            lo, hi, lo_incl = _FLOAT_RANGES[name]
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            ok = ok and (lo <= v if lo_incl else lo < v) and v <= hi
            if not ok:
                bra = "[" if lo_incl else "("
                raise ValueError(f"{field}.{name} must be a number in {bra}{lo}, {hi}], got {v!r}")
            v = float(v)
        out[name] = v
    return out


def _base(shape, d: dict, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """An elementwise draw of kind normal/uniform/outliers/tiny (float64, CPU)."""
    kind = d["kind"]
    if kind == "normal":
        return torch.randn(shape, generator=g, dtype=torch.float64) * d["sigma"]
    if kind == "uniform":
        return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) * d["a"]
    if kind == "outliers":
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        hit = torch.rand(shape, generator=g, dtype=torch.float64) < d["p"]
        extra = torch.randn(shape, generator=g, dtype=torch.float64) * d["outlier_sigma"]
        return x + extra * hit
    if kind == "tiny":
        tiny = torch.finfo(dtype).tiny
        return torch.randn(shape, generator=g, dtype=torch.float64) * (d["factor"] * tiny)
    raise ValueError(f"dist.kind {kind!r} is not elementwise")


def _group_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """scale · q @ k^T with each query head against its kv head (GQA-aware), float64."""
    hq, hkv = q.shape[1], k.shape[1]
    kk = k.repeat_interleave(hq // hkv, dim=1)
    return (q @ kk.transpose(-1, -2)) * scale


def _coarse(x: float, *, up: bool = False) -> float:
    """``x`` rounded to 3 significant digits (upward if ``up``).

    The factors that large_logits and dominant derive from a matmul go through this: BLAS
    may sum in a different order on another machine, moving the float64 result in its last
    bits; on a 3-digit grid that changes the factor only if the result sits within ~1e-16
    relative of a grid point, so the drawn tensors stay bit-identical across machines.
    """
    e = math.floor(math.log10(x)) - 2
    m = x / 10.0**e
    return (math.ceil(m) if up else round(m)) * 10.0**e


def draw_qkv(
    d: dict, *, B: int, Hq: int, Hkv: int, Nq: int, Nk: int, D: int,
    dtype: torch.dtype, scale: float, seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logical q (B,Hq,Nq,D), k, v (B,Hkv,Nk,D) in float64 on the CPU for distribution ``d``."""
    gq, gk, gv, ga = (stream(seed, n) for n in ("query", "key", "value", "aux"))
    qs, ks = (B, Hq, Nq, D), (B, Hkv, Nk, D)
    kind = d["kind"]
    if kind in ("normal", "uniform", "outliers", "tiny"):
        return _base(qs, d, dtype, gq), _base(ks, d, dtype, gk), _base(ks, d, dtype, gv)
    q = torch.randn(qs, generator=gq, dtype=torch.float64)
    k = torch.randn(ks, generator=gk, dtype=torch.float64)
    v = torch.randn(ks, generator=gv, dtype=torch.float64)
    if kind == "large_logits":
        peak = _group_scores(q, k, scale).abs().max().item()
        c = _coarse(math.sqrt(d["target"] / peak))
        return q * c, k * c, v
    if kind == "ties":
        protos = torch.randn((B, Hkv, d["groups"], D), generator=ga, dtype=torch.float64)
        which = torch.randint(0, d["groups"], (B, Hkv, Nk), generator=ga)
        k = torch.gather(protos, 2, which[..., None].expand(B, Hkv, Nk, D))
        return q, k, v
    if kind == "dominant":
        r = Hq // Hkv
        u = torch.randn((B, Hkv, D), generator=ga, dtype=torch.float64)
        u = u / u.norm(dim=-1, keepdim=True)
        star = torch.randint(0, Nk, (B, Hkv), generator=ga)
        uq = u.repeat_interleave(r, dim=1)[:, :, None, :]  # (B, Hq, 1, D)
        # Give every query the same component along u (exactly 1), keep the rest random.
        q = q - (q * uq).sum(-1, keepdim=True) * uq + uq
        k = k.clone()
        b_idx = torch.arange(B)[:, None]
        h_idx = torch.arange(Hkv)[None, :]
        k[b_idx, h_idx, star] = 0.0
        others = _group_scores(q, k, scale)  # dominant key zeroed: its score is 0 here
        others = others.reshape(B, Hkv, r * Nq, Nk)
        keep = torch.ones((B, Hkv, Nk), dtype=torch.bool)
        keep[b_idx, h_idx, star] = False
        others = others.masked_fill(~keep[:, :, None, :], -math.inf)
        best_other = others.amax(dim=(2, 3)).clamp(min=0.0)  # (B, Hkv); -inf when Nk == 1
        # score(i, star) = scale * gamma * (q_i . u) = scale * gamma.
        gamma = ((best_other + d["margin"]) / scale).tolist()
        gamma = torch.tensor([[_coarse(x, up=True) for x in row] for row in gamma],
                             dtype=torch.float64)
        k[b_idx, h_idx, star] = gamma[..., None] * u
        return q, k, v
    if kind == "constant_rows":
        q = q[:, :, :1, :].expand(qs).clone()
        v = v[:, :, :, :1].expand(ks).clone()
        return q, k, v
    raise ValueError(f"dist.kind must be one of {list(DIST_KINDS)}, got {kind!r}")


def draw_grad(d: dict, shape, *, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Logical dO of ``shape`` in float64 on the CPU for grad distribution ``d``."""
    if d["kind"] == "constant":
        return torch.full(shape, d["value"], dtype=torch.float64)
    return _base(shape, d, dtype, stream(seed, "grad_out"))


def short_dist(d: dict) -> str:
    """``normal(1)``, ``outliers(p=0.001,s=10)`` ... for one-line summaries."""
    params = [v for k, v in d.items() if k != "kind"]
    if not params:
        return d["kind"]
    return f"{d['kind']}({','.join(_fmt(v) for v in params)})"


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "T" if v else "F"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)

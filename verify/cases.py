"""The test case: plain, JSON-serialisable knobs that rebuild an attention problem bit-exactly.

A :class:`Case` names shapes, dtype, memory layout, the causal/window structure, the mask
kind and its parameters, the value distributions of the inputs and of dO, and a seed.
:meth:`Case.materialize` draws every tensor on the CPU from that seed (float64, one random
stream per tensor), rounds it to the case dtype, lays it out, and only then moves it to the
device, so the inputs are bit-identical on every run and every device.

Layouts (all are views of shape (B, H, N, D)):

- ``contiguous``: plain (B, H, N, D) storage.
- ``bnhd``: (B, N, H, D) storage viewed through ``.transpose(1, 2)``; strides
  (N·H·D, D, H·D, 1).
- ``strided``: a slice of a larger buffer of shape (B, H, N + 1, 2·D + 2):
  ``buf[:, :, :N, :2*D:2]``. Last-dim stride 2, row stride 2·D + 2 (padded), head stride
  (N + 1)·(2·D + 2). The elements of the buffer outside the view are NaN, so a kernel that
  reads past the view (wrong stride, unmasked load) produces NaN instead of passing by luck.

Masks (``mask`` dict; ``shape`` is the ordered subset of "bhqk" that the mask spans, the
other dims have size 1 and broadcast; it always contains "k"):

- ``none``: no ``attn_mask``.
- ``key_padding`` (``lengths``: one int in [0, Nk] per batch; key j of batch b may be
  attended iff j < lengths[b]; 0 masks the whole batch). ``shape`` must contain "b".
- ``random`` (``density`` in [0, 1]): each element True with probability ``density``.
- ``block_sparse`` (``block`` >= 1, ``density``): a grid of block × block tiles over
  (Nq, Nk), each tile all-True with probability ``density``. ``shape`` must contain "q".
- ``bias`` (``neginf_prob``, ``neginf_first_tile``, ``tile``): an additive float mask in
  the case dtype, N(0, 1) entries, each replaced by −inf with probability ``neginf_prob``;
  with ``neginf_first_tile`` the first ``tile`` keys of every row are −inf too (a kernel
  that tiles keys by ``tile`` then sees a first tile that is entirely −inf).
- ``dead_rows`` (``rows`` in [0, 1]): ceil(rows · Nq) query rows per (batch, head) chosen at
  random are fully masked (all False); the rest attend everywhere. ``shape`` must contain "q".

Bool masks are ``torch.bool``; ``bias`` has the case dtype (fp32 for fp32 inputs).

Head dim: D in 1..256. 256 is the largest head dim FlashAttention 2/3 support and the
largest that a single key tile of our kernels holds; larger D is outside the harness domain.

Case files (a recorded failure) and captured tensors: :func:`save_case_file`,
:func:`load_case_file`, :func:`save_tensors`, :func:`load_tensors`, :class:`TensorCase`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from flashcheck.verify.distributions import (
    DIST_KINDS,
    DTYPES,
    GRAD_DIST_KINDS,
    check_kind_dict,
    draw_grad,
    draw_qkv,
    normalize_dist,
    short_dist,
    stream,
)
from flashcheck.verify.ragged import (
    api_args,
    config_part,
    normalize_ragged,
    ragged_mask,
    short_ragged,
)

__all__ = [
    "CASE_VERSION", "DTYPES", "LAYOUTS", "MASK_KINDS", "DIST_KINDS", "GRAD_DIST_KINDS",
    "ALIGNMENTS", "MAX_HEAD_DIM", "Case", "Inputs", "TensorCase", "save_case_file",
    "load_case_file", "save_tensors", "load_tensors", "tensors_path_for", "d_bucket",
    "n_bucket",
]

CASE_VERSION = 1
CASE_FILE_FORMAT = "flashcheck-case"
LAYOUTS = ("contiguous", "bnhd", "strided")
ALIGNMENTS = ("top_left", "bottom_right")
MAX_HEAD_DIM = 256
SEED_LIMIT = 2**32
DTYPE_SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}

# Mask parameter defaults per kind (key order = JSON order), and the dims each kind needs.
MASK_DEFAULTS: dict[str, dict] = {
    "none": {},
    "key_padding": {"shape": "bhqk", "lengths": None},
    "random": {"shape": "bhqk", "density": 0.5},
    "block_sparse": {"shape": "bhqk", "block": 16, "density": 0.5},
    "bias": {"shape": "bhqk", "neginf_prob": 0.0, "neginf_first_tile": False, "tile": 16},
    "dead_rows": {"shape": "bhqk", "rows": 0.25},
}
MASK_KINDS = tuple(MASK_DEFAULTS)
MASK_NEEDS_DIMS = {"key_padding": "bk", "block_sparse": "qk", "dead_rows": "qk"}
MASK_SHAPES = tuple(
    s for s in ("bhqk", "bqk", "hqk", "qk", "bhk", "bk", "hk", "k")
)  # every ordered subset of "bhqk" containing "k"
BOOL_MASK_KINDS = ("key_padding", "random", "block_sparse", "dead_rows")
MAX_TILE = 4096  # block/tile sizes: a tile of more keys than any kernel tiles by is pointless

_FIELDS_REQUIRED = ("version", "B", "Hq", "Hkv", "Nq", "Nk", "D", "dtype", "seed")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fraction(v, name: str) -> float:
    if not _is_num(v) or not (0.0 <= v <= 1.0):
        raise ValueError(f"{name} must be a number in [0, 1], got {v!r}")
    return float(v)


def _normalize_mask(m, *, B: int, Nk: int) -> dict:
    """Validate a mask dict and fill in defaults. Raises ValueError naming mask.<param>."""
    kind, defaults = check_kind_dict(m, MASK_DEFAULTS, field="mask", example="none",
                                     kinds=list(MASK_KINDS))
    out: dict = {"kind": kind}
    if kind == "none":
        return out
    shape = m.get("shape", defaults["shape"])
    if shape not in MASK_SHAPES:
        raise ValueError(f"mask.shape must be one of {list(MASK_SHAPES)}, got {shape!r}")
    need = MASK_NEEDS_DIMS.get(kind, "k")
    if any(c not in shape for c in need):
        ok = [s for s in MASK_SHAPES if all(c in s for c in need)]
        raise ValueError(f"mask.shape for kind {kind!r} must be one of {ok}, got {shape!r}")
    out["shape"] = shape
    if kind == "key_padding":
        lengths = m.get("lengths")
        if (
            not isinstance(lengths, (list, tuple))
            or len(lengths) != B
            or not all(_is_int(x) and 0 <= x <= Nk for x in lengths)
        ):
            raise ValueError(
                f"mask.lengths must be a list of B={B} ints in [0, Nk={Nk}], got {lengths!r}"
            )
        out["lengths"] = [int(x) for x in lengths]
    elif kind == "random":
        out["density"] = _fraction(m.get("density", defaults["density"]), "mask.density")
    elif kind == "block_sparse":
        block = m.get("block", defaults["block"])
        if not _is_int(block) or not 1 <= block <= MAX_TILE:
            raise ValueError(f"mask.block must be an int in [1, {MAX_TILE}], got {block!r}")
        out["block"] = block
        out["density"] = _fraction(m.get("density", defaults["density"]), "mask.density")
    elif kind == "bias":
        out["neginf_prob"] = _fraction(
            m.get("neginf_prob", defaults["neginf_prob"]), "mask.neginf_prob"
        )
        first = m.get("neginf_first_tile", defaults["neginf_first_tile"])
        if not isinstance(first, bool):
            raise ValueError(f"mask.neginf_first_tile must be true or false, got {first!r}")
        out["neginf_first_tile"] = first
        tile = m.get("tile", defaults["tile"])
        if not _is_int(tile) or not 1 <= tile <= MAX_TILE:
            raise ValueError(f"mask.tile must be an int in [1, {MAX_TILE}], got {tile!r}")
        out["tile"] = tile
    elif kind == "dead_rows":
        out["rows"] = _fraction(m.get("rows", defaults["rows"]), "mask.rows")
    return out


def d_bucket(D: int) -> str:
    """Report bucket of a head dim."""
    for hi, name in ((32, "1-32"), (64, "33-64"), (128, "65-128")):
        if D <= hi:
            return name
    return "129-256"


def n_bucket(N: int) -> str:
    """Report bucket of a sequence length (max(Nq, Nk))."""
    for hi, name in ((16, "1-16"), (128, "17-128"), (1024, "129-1024"), (8192, "1025-8192")):
        if N <= hi:
            return name
    return ">8192"


def _gqa_kind(Hq: int, Hkv: int) -> str:
    if Hq == Hkv:
        return "mha"
    return "mqa" if Hkv == 1 else "gqa"


def _causal_key(is_causal: bool, alignment: str, window) -> str:
    parts = []
    if is_causal:
        parts.append(alignment)
    if window is not None:
        parts.append("window_br" if alignment == "bottom_right" and not is_causal else "window")
    return "+".join(parts) or "none"


# ----------------------------------------------------------------------------------------
# Inputs


def _clone_keep_layout(t: torch.Tensor | None) -> torch.Tensor | None:
    """A copy with the same size, strides, storage offset and storage contents (padding too)."""
    if t is None:
        return None
    storage = t.untyped_storage()
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    out.set_(storage.clone(), t.storage_offset(), t.size(), t.stride())
    return out.requires_grad_(t.requires_grad) if t.is_leaf else out


@dataclass
class Inputs:
    """The tensors of one problem plus the structural arguments, ready to call a kernel."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None
    grad_out: torch.Tensor
    is_causal: bool = False
    causal_alignment: str = "top_left"
    window: tuple[int, int] | None = None
    scale: float | None = None
    enable_gqa: bool = False
    # A varlen/decode case: what its kernel gets beside the tensors (verify/ragged.py).
    api_args: dict | None = None

    def kwargs(self) -> dict:
        """SDPA keyword arguments for this problem, plus the extensions it needs.

        ``window`` and ``causal_alignment`` appear only when they are not the SDPA default
        (see :meth:`extensions`); a kernel lacking them gets the problem expressed through
        ``attn_mask`` by ``verify.adapters``.
        """
        kw = {
            "attn_mask": self.attn_mask,
            "dropout_p": 0.0,
            "is_causal": self.is_causal,
            "scale": self.scale,
            "enable_gqa": self.enable_gqa,
        }
        if self.window is not None:
            kw["window"] = self.window
        if self.causal_alignment != "top_left" and (self.is_causal or self.window is not None):
            kw["causal_alignment"] = self.causal_alignment
        return kw

    def extensions(self) -> tuple[str, ...]:
        """The extension keyword arguments :meth:`kwargs` includes."""
        kw = self.kwargs()
        return tuple(n for n in ("window", "causal_alignment") if n in kw)

    def clone(self) -> Inputs:
        """Deep copy, keeping every tensor's strides and storage (padding included)."""
        return dataclasses.replace(
            self,
            query=_clone_keep_layout(self.query),
            key=_clone_keep_layout(self.key),
            value=_clone_keep_layout(self.value),
            attn_mask=_clone_keep_layout(self.attn_mask),
            grad_out=_clone_keep_layout(self.grad_out),
        )

    @property
    def effective_scale(self) -> float:
        """``scale`` or its default 1/sqrt(D)."""
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.query.shape[-1])


def _lay_out(x: torch.Tensor, layout: str, device) -> torch.Tensor:
    """Put logical (B, H, N, D) tensor ``x`` (CPU, final dtype) into ``layout`` on ``device``."""
    if layout == "contiguous":
        return x.contiguous().to(device)
    if layout == "bnhd":
        return x.transpose(1, 2).contiguous().to(device).transpose(1, 2)
    if layout == "strided":
        B, H, N, D = x.shape
        buf = torch.full((B, H, N + 1, 2 * D + 2), float("nan"), dtype=x.dtype)
        buf[:, :, :N, : 2 * D : 2] = x
        return buf.to(device)[:, :, :N, : 2 * D : 2]
    raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")


def _build_mask(case: Case) -> torch.Tensor | None:
    """The attn_mask of ``case`` on the CPU (bool, or the case dtype for ``bias``).

    Bernoulli draws compare float32 uniforms (exact: 24 random bits each, and 3x faster than
    float64 for the (B, H, N, N) masks of long sequences). Bias values are float64 normals,
    like q/k/v, because torch's float32 ``randn`` takes a vectorised path whose results may
    depend on the CPU's instruction set.
    """
    if case.api != "dense":
        return ragged_mask(case)
    m = case.mask
    kind = m["kind"]
    if kind == "none":
        return None
    shape = m["shape"]
    dims = (
        case.B if "b" in shape else 1,
        case.Hq if "h" in shape else 1,
        case.Nq if "q" in shape else 1,
        case.Nk,
    )
    g = stream(case.seed, "mask")
    if kind == "key_padding":
        lengths = torch.tensor(m["lengths"], dtype=torch.long)
        allowed = torch.arange(case.Nk)[None, :] < lengths[:, None]  # (B, Nk)
        return allowed[:, None, None, :].expand(dims).contiguous()
    if kind == "random":
        return torch.rand(dims, generator=g, dtype=torch.float32) < m["density"]
    if kind == "block_sparse":
        blk = m["block"]
        grid = (dims[0], dims[1], -(-dims[2] // blk), -(-dims[3] // blk))
        tiles = torch.rand(grid, generator=g, dtype=torch.float32) < m["density"]
        full = tiles.repeat_interleave(blk, dim=2).repeat_interleave(blk, dim=3)
        return full[:, :, : dims[2], : dims[3]].contiguous()
    if kind == "bias":
        dtype = DTYPES[case.dtype]
        bias = torch.randn(dims, generator=g, dtype=torch.float64)
        neg = torch.rand(dims, generator=g, dtype=torch.float32) < m["neginf_prob"]
        bias = bias.masked_fill(neg, -math.inf)
        if m["neginf_first_tile"]:
            bias[..., : m["tile"]] = -math.inf
        return bias.to(dtype)
    if kind == "dead_rows":
        mask = torch.ones(dims, dtype=torch.bool)
        n_dead = math.ceil(m["rows"] * dims[2])
        if n_dead:
            for b in range(dims[0]):
                for h in range(dims[1]):
                    rows = torch.randperm(dims[2], generator=g)[:n_dead]
                    mask[b, h, rows, :] = False
        return mask
    raise ValueError(f"mask.kind must be one of {list(MASK_KINDS)}, got {kind!r}")


# ----------------------------------------------------------------------------------------
# Case


@dataclass(frozen=True)
class Case:
    """One attention problem as plain data (docs/contracts.md §3). Validated on construction.

    ``window`` is stored as a tuple (JSON: a list). ``mask``, ``dist`` and ``grad_dist`` are
    stored normalised (every parameter present), so equal problems compare and hash equal.
    Treat them as read-only; use :func:`dataclasses.replace` to derive a new case.
    """

    B: int
    Hq: int
    Hkv: int
    Nq: int
    Nk: int
    D: int
    dtype: str = "float16"
    layout: str = "contiguous"
    is_causal: bool = False
    causal_alignment: str = "top_left"
    window: tuple[int, int] | None = None
    mask: dict = field(default_factory=lambda: {"kind": "none"})
    scale: float | None = None
    dist: dict = field(default_factory=lambda: {"kind": "normal", "sigma": 1.0})
    grad_dist: dict = field(default_factory=lambda: {"kind": "normal", "sigma": 1.0})
    backward: bool = True
    seed: int = 0
    tf32: bool = False
    api: str = "dense"
    ragged: dict | None = None
    version: int = CASE_VERSION

    def __post_init__(self) -> None:
        self.validate()

    def __hash__(self) -> int:
        return hash(self.to_json())

    # -- validation -----------------------------------------------------------------------

    def validate(self) -> None:
        """Check every field; normalise window/mask/dist/grad_dist. Raises ValueError."""
        if self.version != CASE_VERSION or isinstance(self.version, bool):
            raise ValueError(f"version must be {CASE_VERSION}, got {self.version!r}")
        for name in ("B", "Hq", "Hkv", "Nq", "Nk"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not _is_int(self.D) or not 1 <= self.D <= MAX_HEAD_DIM:
            raise ValueError(f"D must be an int in [1, {MAX_HEAD_DIM}], got {self.D!r}")
        if self.Hq % self.Hkv:
            raise ValueError(f"Hq % Hkv must be 0 (Hq={self.Hq}, Hkv={self.Hkv})")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {self.layout!r}")
        for name in ("is_causal", "backward", "tf32"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.causal_alignment not in ALIGNMENTS:
            raise ValueError(
                f"causal_alignment must be one of {list(ALIGNMENTS)}, "
                f"got {self.causal_alignment!r}"
            )
        w = self.window
        if w is not None:
            if (
                not isinstance(w, (list, tuple))
                or len(w) != 2
                or not all(_is_int(x) and x >= -1 for x in w)
            ):
                raise ValueError(
                    f"window must be null or [left, right] with ints >= -1 (-1: unbounded), "
                    f"got {w!r}"
                )
            object.__setattr__(self, "window", (int(w[0]), int(w[1])))
        s = self.scale
        if s is not None and (not _is_num(s) or not math.isfinite(s) or s <= 0):
            raise ValueError(f"scale must be null or a finite number > 0, got {s!r}")
        if s is not None:
            object.__setattr__(self, "scale", float(s))
        if not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be an int in [0, 2**32), got {self.seed!r}")
        object.__setattr__(self, "mask", _normalize_mask(self.mask, B=self.B, Nk=self.Nk))
        object.__setattr__(self, "dist", normalize_dist(self.dist, field="dist"))
        object.__setattr__(
            self, "grad_dist", normalize_dist(self.grad_dist, field="grad_dist", grad=True)
        )
        object.__setattr__(self, "ragged", normalize_ragged(self.api, self.ragged, self))

    # -- derived --------------------------------------------------------------------------

    @property
    def enable_gqa(self) -> bool:
        return self.Hq != self.Hkv

    @property
    def effective_scale(self) -> float:
        """``scale`` or its default 1/sqrt(D)."""
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.D)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def config_key(self) -> dict:
        """The report's configuration bucket of this case."""
        return {
            "dtype": self.dtype,
            "D": d_bucket(self.D),
            "N": n_bucket(max(self.Nq, self.Nk)),
            "causal": _causal_key(self.is_causal, self.causal_alignment, self.window),
            "mask": self.mask["kind"],
            "dist": self.dist["kind"],
            "gqa": _gqa_kind(self.Hq, self.Hkv),
            **({} if self.api == "dense" else {"api": config_part(self)}),
        }

    def short(self) -> str:
        """One-line human summary, e.g. ``fp16 B2 H4/2 Nq17 Nk33 D40 bnhd causal=br ...``."""
        parts = [
            DTYPE_SHORT[self.dtype] + ("+tf32" if self.tf32 else ""),
            f"B{self.B}",
            f"H{self.Hq}" if self.Hq == self.Hkv else f"H{self.Hq}/{self.Hkv}",
            f"Nq{self.Nq}",
            f"Nk{self.Nk}",
            f"D{self.D}",
        ]
        if self.api != "dense":
            # varlen: the sequences replace B, Nq, Nk; decode: the cache lengths replace Nk
            keep = (0, 2) if self.api == "varlen" else (0, 1, 2, 3)
            parts = [parts[i] for i in keep] + [short_ragged(self), parts[5]]
        if self.layout != "contiguous" and self.api == "dense":
            parts.append(self.layout)
        if self.is_causal:
            parts.append("causal=" + ("br" if self.causal_alignment == "bottom_right" else "tl"))
        if self.window is not None:
            al = "br" if self.causal_alignment == "bottom_right" else "tl"
            parts.append(f"window=({self.window[0]},{self.window[1]}){al}")
        if self.mask["kind"] != "none":
            params = {k: v for k, v in self.mask.items() if k not in ("kind", "shape")}
            txt = ",".join(f"{k}={_short_val(v)}" for k, v in params.items())
            shape = "" if self.mask["shape"] == "bhqk" else f"[{self.mask['shape']}]"
            parts.append(f"mask={self.mask['kind']}{shape}({txt})")
        if self.scale is not None:
            parts.append(f"scale={self.scale:g}")
        parts.append("dist=" + short_dist(self.dist))
        if self.backward:
            parts.append("dO=" + short_dist(self.grad_dist))
        else:
            parts.append("fwd-only")
        parts.append(f"seed={self.seed}")
        return " ".join(parts)

    # -- JSON -----------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """Plain JSON-ready dict (``version`` first)."""
        d = {"version": self.version}
        for f in dataclasses.fields(self):
            if f.name == "version" or (f.name in ("api", "ragged") and self.api == "dense"):
                continue  # dense cases keep the JSON they always had
            v = getattr(self, f.name)
            if f.name == "window" and v is not None:
                v = list(v)
            elif isinstance(v, dict):
                v = copy.deepcopy(v)
            d[f.name] = v
        return d

    @classmethod
    def from_dict(cls, d) -> Case:
        """Build a case from a dict; unknown or missing keys and bad values raise ValueError."""
        if not isinstance(d, Mapping):
            raise ValueError(f"case must be a JSON object, got {type(d).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(f"case: unknown field(s) {unknown}; allowed: {names}")
        missing = [n for n in _FIELDS_REQUIRED if n not in d]
        if missing:
            raise ValueError(f"case: missing required field(s) {missing}")
        return cls(**{k: copy.deepcopy(v) for k, v in d.items()})

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_json(cls, s: str) -> Case:
        try:
            d = json.loads(s)
        except json.JSONDecodeError as e:
            raise ValueError(f"case: not valid JSON ({e})") from None
        return cls.from_dict(d)

    # -- tensors --------------------------------------------------------------------------

    def materialize(self, device="cpu") -> Inputs:
        """Draw the inputs on the CPU from ``seed``, round, lay out, then move to ``device``."""
        return self.place(self.draw(), device)

    def draw(self) -> dict[str, torch.Tensor | None]:
        """The CPU half of :meth:`materialize`: q, k, v, dO drawn from ``seed`` and rounded to
        the dtype (logical, contiguous), and the mask. Pure CPU work that needs no device, so
        a sweep can draw the next case while the current one runs (``place`` finishes it)."""
        dtype = self.torch_dtype
        q, k, v = draw_qkv(
            self.dist, B=self.B, Hq=self.Hq, Hkv=self.Hkv, Nq=self.Nq, Nk=self.Nk, D=self.D,
            dtype=dtype, scale=self.effective_scale, seed=self.seed,
        )
        do = draw_grad(self.grad_dist, (self.B, self.Hq, self.Nq, self.D), dtype=dtype,
                       seed=self.seed)
        drawn: dict[str, torch.Tensor | None] = {}
        for name, x in (("query", q), ("key", k), ("value", v), ("grad_out", do)):
            y = x.to(dtype)
            if not torch.isfinite(y).all():
                raise ValueError(
                    f"dist {short_dist(self.dist)} overflows {self.dtype} in {name}; "
                    "lower its parameters"
                )
            drawn[name] = y
        drawn["attn_mask"] = _build_mask(self)
        return drawn

    def place(self, drawn: dict[str, torch.Tensor | None], device="cpu") -> Inputs:
        """Lay :meth:`draw`'s tensors out on ``device`` as the case's layout asks."""
        mask = drawn["attn_mask"]
        # A varlen/decode case: the oracles see the dense equivalent, whose structure is all
        # in the mask; the kernel gets its own arguments (verify/ragged.py).
        dense = self.api == "dense"
        return Inputs(
            query=_lay_out(drawn["query"], self.layout, device),
            key=_lay_out(drawn["key"], self.layout, device),
            value=_lay_out(drawn["value"], self.layout, device),
            attn_mask=None if mask is None else mask.to(device),
            grad_out=_lay_out(drawn["grad_out"], self.layout, device),
            is_causal=self.is_causal and dense,
            causal_alignment=self.causal_alignment if dense else "top_left",
            window=self.window if dense else None,
            scale=self.scale,
            enable_gqa=self.enable_gqa,
            api_args=None if dense else api_args(self, device),
        )


def _short_val(v) -> str:
    if isinstance(v, bool):
        return "T" if v else "F"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, list):
        return "[" + ",".join(str(x) for x in v) + "]"
    return str(v)


# ----------------------------------------------------------------------------------------
# Case files and captured tensors

# "settings": the kernels' FLASHCHECK_* environment variables of the run that wrote it
# (verify/report.kernel_settings), set again by `repro` for the worker it replays in
CASE_FILE_META = ("kernel", "versions", "device", "verdict", "settings")
TENSOR_KEYS_REQUIRED = ("query", "key", "value")
TENSOR_KEYS = TENSOR_KEYS_REQUIRED + ("attn_mask", "grad_out")
TENSOR_SUFFIXES = (".npz", ".pt")


def _case_doc(who: str, case: Case, meta: dict) -> dict:
    """The JSON object of a case file; ``meta`` keys must be among ``CASE_FILE_META``."""
    unknown = sorted(set(meta) - set(CASE_FILE_META))
    if unknown:
        raise ValueError(f"{who}: unknown meta key(s) {unknown}; allowed: "
                         f"{list(CASE_FILE_META)}")
    if isinstance(case, TensorCase):
        case = case.case
    doc = {"format": CASE_FILE_FORMAT, "version": CASE_VERSION, "case": case.to_dict()}
    for k in CASE_FILE_META:
        if k in meta:
            v = meta[k]
            doc[k] = v.to_dict() if hasattr(v, "to_dict") else v
    return doc


def save_case_file(path, case: Case, **meta) -> None:
    """Write a case file: ``{"format", "version", "case", "kernel", "versions", "device",
    "verdict", "settings"}`` (docs/contracts.md §3). ``meta`` keys must be among ``CASE_FILE_META``;
    a value with a ``to_dict()`` method (a Verdict) is stored as that dict."""
    doc = _case_doc("save_case_file", case, meta)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, allow_nan=True, default=str)
        f.write("\n")


def case_file_line(case: Case, **meta) -> str:
    """A case file as one line of JSON (as ``save_case_file`` writes it), for a log that
    outlives the run's files: saved as a ``.json`` file it loads as the same case
    (``load_case_file``)."""
    doc = _case_doc("case_file_line", case, meta)
    return json.dumps(doc, separators=(",", ":"), allow_nan=True, default=str)


def load_case_file(path) -> tuple[Case, dict]:
    """Read a case file; returns ``(case, meta)`` where ``meta`` holds the other keys.

    Raises ValueError (naming the field) on a malformed file; OSError if it cannot be read.
    """
    with open(path, encoding="utf-8") as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a case file is a JSON object")
    if doc.get("format") != CASE_FILE_FORMAT:
        raise ValueError(f"{path}: format must be {CASE_FILE_FORMAT!r}, got {doc.get('format')!r}")
    if doc.get("version") != CASE_VERSION:
        raise ValueError(f"{path}: version must be {CASE_VERSION}, got {doc.get('version')!r}")
    unknown = sorted(set(doc) - {"format", "version", "case", *CASE_FILE_META})
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown}; allowed: format, version, case, "
                         f"{', '.join(CASE_FILE_META)}")
    if "case" not in doc:
        raise ValueError(f"{path}: missing field 'case'")
    case = Case.from_dict(doc["case"])
    meta = {k: doc[k] for k in CASE_FILE_META if k in doc}
    return case, meta


def tensors_path_for(case_path) -> str | None:
    """The captured-tensor file beside a case file (``NAME.npz`` or ``NAME.pt``), if any."""
    stem = os.path.splitext(os.fspath(case_path))[0]
    for suffix in TENSOR_SUFFIXES:
        if os.path.exists(stem + suffix):
            return stem + suffix
    return None


def _suffix(path) -> str:
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    if suffix not in TENSOR_SUFFIXES:
        raise ValueError(f"tensor file must end in one of {list(TENSOR_SUFFIXES)}, got {path!r}")
    return suffix


def save_tensors(path, inputs: Inputs) -> None:
    """Write ``inputs``' tensors to ``.npz`` or ``.pt`` (contiguous copies; strides are not kept).

    numpy has no bfloat16: in ``.npz`` a bfloat16 tensor is stored as its uint16 bit pattern,
    and :func:`load_tensors` reads any uint16 array back as bfloat16.
    """
    suffix = _suffix(path)
    named = {n: getattr(inputs, n) for n in TENSOR_KEYS if getattr(inputs, n) is not None}
    named = {n: t.detach().cpu().contiguous() for n, t in named.items()}
    if suffix == ".pt":
        torch.save(named, path)
        return
    import numpy as np

    arrays = {
        n: (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy()
        for n, t in named.items()
    }
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _read_tensor_file(path) -> dict[str, torch.Tensor]:
    if _suffix(path) == ".pt":
        obj = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(obj, Mapping) or not all(isinstance(t, torch.Tensor)
                                                   for t in obj.values()):
            raise ValueError(f"{path}: expected a dict of tensors with keys {list(TENSOR_KEYS)}")
        return dict(obj)
    import numpy as np

    out = {}
    with np.load(path, allow_pickle=False) as z:
        for n in z.files:
            a = z[n]
            if a.dtype == np.uint16:
                out[n] = torch.from_numpy(a.copy()).view(torch.bfloat16)
            elif a.dtype in (np.float16, np.float32, np.bool_):
                out[n] = torch.from_numpy(a.copy())
            else:
                raise ValueError(
                    f"{path}: {n} has dtype {a.dtype}; allowed: float16, float32, "
                    "uint16 (bfloat16 bits), bool"
                )
    return out


def _check_tensors(t: dict[str, torch.Tensor], path) -> None:
    unknown = sorted(set(t) - set(TENSOR_KEYS))
    missing = [n for n in TENSOR_KEYS_REQUIRED if n not in t]
    if unknown or missing:
        raise ValueError(f"{path}: keys must be {list(TENSOR_KEYS_REQUIRED)} plus optional "
                         f"attn_mask, grad_out; unknown {unknown}, missing {missing}")
    q, k, v = t["query"], t["key"], t["value"]
    for n in ("query", "key", "value"):
        if t[n].dim() != 4:
            raise ValueError(f"{path}: {n} must be 4-D (B, H, N, D), got shape {tuple(t[n].shape)}")
    allowed_dtypes = tuple(DTYPES.values())
    if q.dtype not in allowed_dtypes or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{path}: query/key/value dtypes must be one of {list(DTYPES)} and "
                         f"equal, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, Hq, Nq, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"{path}: key/value must be (B={B}, Hkv, Nk, D={D}) and equal, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    Hkv, Nk = k.shape[1], k.shape[2]
    if min(B, Hq, Nq, Hkv, Nk) < 1 or not 1 <= D <= MAX_HEAD_DIM or Hq % Hkv:
        raise ValueError(f"{path}: need dims >= 1, D in [1, {MAX_HEAD_DIM}] and Hq % Hkv == 0; "
                         f"got query {tuple(q.shape)}, key {tuple(k.shape)}")
    m = t.get("attn_mask")
    if m is not None:
        if m.dtype not in (torch.bool, q.dtype):
            raise ValueError(f"{path}: attn_mask dtype must be bool or {q.dtype}, got {m.dtype}")
        full = (B, Hq, Nq, Nk)
        ok = m.dim() <= 4 and all(
            s in (1, f) for s, f in zip(reversed(m.shape), reversed(full), strict=False)
        )
        if not ok:
            raise ValueError(f"{path}: attn_mask shape {tuple(m.shape)} does not broadcast "
                             f"to (B, Hq, Nq, Nk) = {full}")
    g = t.get("grad_out")
    if g is not None and (g.shape != q.shape or g.dtype != q.dtype):
        raise ValueError(f"{path}: grad_out must match query's shape {tuple(q.shape)} and dtype "
                         f"{q.dtype}, got {tuple(g.shape)} {g.dtype}")


def load_tensors(path, *, case: Case | None = None, device="cpu") -> Inputs:
    """Load captured tensors (``.npz`` with ``allow_pickle=False``, or ``.pt`` with
    ``torch.load(weights_only=True)``) as :class:`Inputs` on ``device``.

    Keys: ``query, key, value`` and optionally ``attn_mask, grad_out``. The structural flags
    (causal, alignment, window, scale) come from ``case`` when given, whose shapes and dtype
    must then match; otherwise they are the SDPA defaults. A missing ``grad_out`` is drawn
    from ``case.grad_dist`` / ``case.seed`` (N(0, 1), seed 0 without a case).
    """
    t = _read_tensor_file(path)
    _check_tensors(t, path)
    q, k = t["query"], t["key"]
    if case is not None:
        want = {"query": (case.B, case.Hq, case.Nq, case.D), "key": (case.B, case.Hkv, case.Nk,
                                                                     case.D)}
        for n, shape in want.items():
            if tuple(t[n].shape) != shape:
                raise ValueError(f"{path}: {n} shape {tuple(t[n].shape)} does not match the "
                                 f"case's {shape}")
        if q.dtype != case.torch_dtype:
            raise ValueError(f"{path}: dtype {q.dtype} does not match the case's {case.dtype}")
    if "grad_out" not in t:
        gd = case.grad_dist if case is not None else {"kind": "normal", "sigma": 1.0}
        seed = case.seed if case is not None else 0
        t["grad_out"] = draw_grad(gd, tuple(q.shape), dtype=q.dtype, seed=seed).to(q.dtype)
    mask = t.get("attn_mask")
    return Inputs(
        query=t["query"].to(device),
        key=t["key"].to(device),
        value=t["value"].to(device),
        attn_mask=None if mask is None else mask.to(device),
        grad_out=t["grad_out"].to(device),
        is_causal=case.is_causal if case is not None else False,
        causal_alignment=case.causal_alignment if case is not None else "top_left",
        window=case.window if case is not None else None,
        scale=case.scale if case is not None else None,
        enable_gqa=q.shape[1] != k.shape[1],
    )


def _layout_of(t: torch.Tensor) -> str:
    if t.is_contiguous():
        return "contiguous"
    if t.transpose(1, 2).is_contiguous():
        return "bnhd"
    return "strided"


def _describe_mask(m: torch.Tensor | None) -> dict:
    """A mask dict of a known kind that summarises a captured mask (for reports only)."""
    if m is None:
        return {"kind": "none"}
    while m.dim() < 4:
        m = m.unsqueeze(0)
    shape = "".join(c for c, s in zip("bhqk", m.shape, strict=True) if s != 1 or c == "k")
    if m.dtype == torch.bool:
        density = float(m.float().mean()) if m.numel() else 1.0
        return {"kind": "random", "shape": shape, "density": density}
    neg = float(torch.isneginf(m).float().mean()) if m.numel() else 0.0
    return {"kind": "bias", "shape": shape, "neginf_prob": neg}


@dataclass(frozen=True)
class TensorCase:
    """A captured problem: tensors from a file, described by a :class:`Case` for reports.

    ``case`` carries the shapes, dtype, layout and structural flags (its ``dist`` and
    ``seed`` are not used for q/k/v; its ``mask`` summarises the captured mask). Attribute
    access falls through to ``case``, so code that reads ``B``, ``dtype``, ``backward`` ...
    works unchanged. :meth:`materialize` loads the tensors and moves them.
    """

    case: Case
    path: str

    def __getattr__(self, name):
        if name in ("case", "path"):
            raise AttributeError(name)
        return getattr(self.case, name)

    @classmethod
    def from_file(cls, path, *, case: Case | None = None, backward: bool = True) -> TensorCase:
        """Describe the tensors in ``path``; ``case`` (from the case file beside it) supplies
        the structural flags and must match the tensors' shapes."""
        inp = load_tensors(path, case=case)
        if case is None:
            B, Hq, Nq, D = inp.query.shape
            Hkv, Nk = inp.key.shape[1], inp.key.shape[2]
            dtype = next(n for n, d in DTYPES.items() if d == inp.query.dtype)
            case = Case(B=B, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=D, dtype=dtype,
                        layout=_layout_of(inp.query), mask=_describe_mask(inp.attn_mask),
                        backward=backward)
        return cls(case=case, path=os.fspath(path))

    def materialize(self, device="cpu") -> Inputs:
        return load_tensors(self.path, case=self.case, device=device)

    def config_key(self) -> dict:
        return {**self.case.config_key(), "dist": "captured"}

    def short(self) -> str:
        return f"{self.case.short()} tensors={os.path.basename(self.path)}"

    def to_dict(self) -> dict:
        return {**self.case.to_dict(), "tensors": self.path}

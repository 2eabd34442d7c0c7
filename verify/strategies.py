"""Hypothesis strategies for :class:`verify.cases.Case`, and the fixed default sweeps.

The strategies draw knobs — shape, dtype, layout, causal/window structure, mask kind and
parameters, distribution, seed — never tensor elements: the elements come from
``Case.materialize`` and the seed. They shrink toward small shapes and plain problems:
every shape knob is ``st.integers(lo, hi)`` (shrinks to ``lo``), every ``sampled_from``
list starts with the plain choice (dtype as given, ``contiguous``, mask ``none``,
distribution ``normal(1)``), every optional structure hides behind a boolean that shrinks
to False, and mask densities shrink toward "everything may attend". Each drawn case is
``note()``-d as its one-line summary and its JSON.

Entry points:

- :func:`cases` — the main strategy, with keyword-only bounds that raise ValueError naming
  the argument when they are bad, and an optional kernel ``capabilities`` mapping
  (docs/contracts.md §2) that keeps draws inside what the kernel declares.
- :func:`restrict` — the feature set a kernel's capabilities allow.
- :func:`features_of` — the features a given case exercises (coverage accounting).
- :func:`fixed_sweep` — the deterministic default sweep for ``flashcheck run``/``gate``.

Caveat: capabilities a kernel leaves out (e.g. no ``masks`` key) mean "probe", so they do
not restrict the draw; pass the probed capabilities from ``verify.adapters`` to restrict.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from flashcheck.verify.capabilities import KEYS, backward_declared, check_capabilities, seq_multiple
from flashcheck.verify.cases import DTYPES, LAYOUTS, MASK_SHAPES, MAX_HEAD_DIM, SEED_LIMIT, Case
from flashcheck.verify.distributions import DIST_KINDS, GRAD_DIST_KINDS
from flashcheck.verify.ragged import MAX_NEW_TOKENS, RAGGED_APIS
from hypothesis import note
from hypothesis import strategies as st

__all__ = [
    "ALL_FEATURES", "OPT_IN_FEATURES", "ALL_LAYOUTS", "ALL_DISTS", "ALL_GRAD_DISTS",
    "DEFAULT_EXTRA_HEAD_DIMS", "MAX_N", "cases", "restrict", "features_of", "fixed_sweep",
    "SWEEP_PROFILES",
]

ALL_FEATURES = frozenset({
    "causal", "bottom_right", "window", "key_padding", "random_mask", "block_sparse", "bias",
    "neginf_first_tile", "dead_rows", "gqa", "custom_scale", "mask_broadcast", "uneven_n",
})
# Drawn only when asked for: TF32 changes the bound, not the problem, and means nothing
# off a GPU.
OPT_IN_FEATURES = frozenset({"tf32"})
ALL_LAYOUTS = LAYOUTS
ALL_DISTS = DIST_KINDS  # "normal" first
ALL_GRAD_DISTS = GRAD_DIST_KINDS  # "normal" first
DEFAULT_EXTRA_HEAD_DIMS = (40, 72, 80, 96, 111, 128)
# The references materialise (Nq, Nk) score matrices in fp64; 65536² × 8 bytes is 32 GiB
# per head, past any single device we run on, so longer sequences are refused up front.
MAX_N = 1 << 16

# Mask kinds and the feature that enables each; "none" first so masks shrink away.
_MASK_FEATURE = {
    "key_padding": "key_padding",
    "random": "random_mask",
    "block_sparse": "block_sparse",
    "bias": "bias",
    "dead_rows": "dead_rows",
}
_BOOL_MASK_FEATURES = frozenset({"key_padding", "random_mask", "block_sparse", "dead_rows"})
_ADDITIVE_MASK_FEATURES = frozenset({"bias", "neginf_first_tile"})
_TILES = (16, 32, 64, 128)  # key-tile sizes our kernels and FA2/FA3 use
# KV heads and query heads per KV head drawn by ``cases``: 3 x 3 covers one, several and
# an odd number of each (group 3 puts head h on kv head h // 3, where h % Hkv differs).
_KV_HEADS_MAX = 3
_GROUP_MAX = 3


def _cap(capabilities, key: str):
    """``capabilities[key]`` for a mapping or an object with attributes; None when absent."""
    if capabilities is None:
        return None
    if isinstance(capabilities, Mapping):
        return capabilities.get(key)
    return getattr(capabilities, key, None)


def _caps_dict(capabilities) -> dict:
    """A validated capabilities dict (verify.capabilities) from a mapping or an object."""
    if capabilities is None:
        return {}
    if not isinstance(capabilities, Mapping):
        capabilities = {k: getattr(capabilities, k) for k in (*KEYS, "probed_not_run")
                        if getattr(capabilities, k, None) is not None}
    return check_capabilities(capabilities)


def restrict(features: Iterable[str], capabilities) -> frozenset[str]:
    """The subset of ``features`` a kernel with ``capabilities`` can be given.

    - no ``"bool"`` in ``masks``: no key_padding / random_mask / block_sparse / dead_rows;
    - no ``"additive"`` in ``masks``: no bias / neginf_first_tile;
    - ``window`` needs the ``"window"`` extension or some mask kind (the harness then
      expresses the window through ``attn_mask``); ``bottom_right`` likewise needs the
      ``"causal_alignment"`` extension or a mask kind;
    - ``mask_broadcast`` False, ``gqa`` False remove those features;
    - ``same_seqlen`` True removes uneven_n.

    A key that is absent means "probe" and removes nothing (``extensions`` defaults to ()).
    """
    out = set(_check_features(features))
    if capabilities is None:
        return frozenset(out)
    masks = _cap(capabilities, "masks")
    extensions = tuple(_cap(capabilities, "extensions") or ())
    if masks is not None:
        masks = tuple(masks)
        if "bool" not in masks:
            out -= _BOOL_MASK_FEATURES
        if "additive" not in masks:
            out -= _ADDITIVE_MASK_FEATURES
    any_mask = masks is None or bool(masks)
    if "window" not in extensions and not any_mask:
        out.discard("window")
    if "causal_alignment" not in extensions and not any_mask:
        out.discard("bottom_right")
    if _cap(capabilities, "mask_broadcast") is False:
        out.discard("mask_broadcast")
    if _cap(capabilities, "gqa") is False:
        out.discard("gqa")
    if _cap(capabilities, "same_seqlen"):
        out.discard("uneven_n")
    if "bias" not in out:
        out.discard("neginf_first_tile")
    return frozenset(out)


def _check_features(features) -> frozenset[str]:
    if isinstance(features, str) or not isinstance(features, Iterable):
        allowed = sorted(ALL_FEATURES | OPT_IN_FEATURES)
        raise ValueError(f"features must be a set of names from {allowed}, got {features!r}")
    features = frozenset(features)
    unknown = sorted(features - ALL_FEATURES - OPT_IN_FEATURES)
    if unknown:
        raise ValueError(f"features: unknown {unknown}; allowed: "
                         f"{sorted(ALL_FEATURES | OPT_IN_FEATURES)}")
    return features


def _check_int(name: str, v, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {v!r}")
    return v


def _check_choice(name: str, values, allowed: tuple[str, ...]) -> tuple[str, ...]:
    if isinstance(values, str) or not isinstance(values, Iterable):
        raise ValueError(f"{name} must be a non-empty collection from {list(allowed)}, "
                         f"got {values!r}")
    values = tuple(values)
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise ValueError(f"{name} must be a non-empty collection from {list(allowed)}, "
                         f"got {list(values)!r}")
    return tuple(dict.fromkeys(values))  # dedupe, keep the caller's order


def _head_dim_strategy(head_dims, cap_range) -> st.SearchStrategy[int]:
    lo, hi = 1, MAX_HEAD_DIM
    if isinstance(cap_range, frozenset):  # declared set of allowed head dims
        dims = sorted(cap_range)
        if head_dims is not None:
            if isinstance(head_dims, (str, bytes)) or not isinstance(head_dims, Iterable):
                raise ValueError(f"head_dims must be None or a collection of ints in "
                                 f"[1, {MAX_HEAD_DIM}], got {head_dims!r}")
            want = {_check_int("head_dims[]", d, 1, MAX_HEAD_DIM) for d in head_dims}
            dims = [d for d in dims if d in want]
            if not dims:
                raise ValueError(f"head_dims {sorted(want)} has none inside "
                                 f"capabilities['head_dims'] = {sorted(cap_range)}")
        return st.sampled_from(dims)  # smallest first: shrinks toward it
    if cap_range is not None:
        try:
            lo, hi = max(lo, int(cap_range[0])), min(hi, int(cap_range[1]))
        except (TypeError, IndexError, ValueError):
            raise ValueError(f"capabilities['head_dims'] must be (lo, hi), got {cap_range!r}") \
                from None
    if head_dims is None:
        parts = []
        if lo <= min(hi, 16):
            parts.append(st.integers(lo, min(hi, 16)))  # small-biased: this branch shrinks first
        if lo <= min(hi, 64):
            parts.append(st.integers(lo, min(hi, 64)))
        extras = [d for d in DEFAULT_EXTRA_HEAD_DIMS if lo <= d <= hi]
        if extras:
            parts.append(st.sampled_from(extras))
        if not parts:
            parts.append(st.integers(lo, hi))
        if lo > hi:
            raise ValueError(f"capabilities['head_dims'] {cap_range!r} leaves no head dim in "
                             f"[1, {MAX_HEAD_DIM}]")
        return st.one_of(*parts)
    if isinstance(head_dims, (str, bytes)) or not isinstance(head_dims, Iterable):
        raise ValueError(f"head_dims must be None or a collection of ints in [1, {MAX_HEAD_DIM}],"
                         f" got {head_dims!r}")
    dims = sorted({_check_int("head_dims[]", d, 1, MAX_HEAD_DIM) for d in head_dims})
    allowed = [d for d in dims if lo <= d <= hi]
    if not allowed:
        raise ValueError(f"head_dims {dims} has none inside capabilities['head_dims'] "
                         f"= ({lo}, {hi})")
    return st.sampled_from(allowed)


def _fraction(shrink_to_one: bool) -> st.SearchStrategy[float]:
    """A float in [0, 1] rounded to 4 decimals; shrinks to 1.0 or to 0.0."""
    base = st.floats(0.0, 1.0, allow_nan=False)
    if shrink_to_one:
        return base.map(lambda x: round(1.0 - x, 4))
    return base.map(lambda x: round(x, 4))


# Each kind's parameter choices, the one shrunk to first.
_DIST_PARAMS = {
    "normal": [{"sigma": s} for s in (1.0, 0.1, 3.0, 30.0)],
    "uniform": [{"a": a} for a in (1.0, 0.5, 4.0)],
    "outliers": [{"p": p} for p in (0.001, 0.01)],
    "large_logits": [{"target": t} for t in (1e4, 1e3, 5e4)],
    "tiny": [{"factor": f} for f in (1.0, 0.01, 10.0)],
    "ties": [{"groups": g} for g in (1, 2, 3, 4)],
    "dominant": [{"margin": m} for m in (20.0, 10.0, 50.0)],
    "constant_rows": [{}],
}
_GRAD_PARAMS = {
    "normal": [{"sigma": s} for s in (1.0, 1e-3, 1e2)],
    "uniform": [{"a": a} for a in (1.0, 0.5)],
    "outliers": [{}],
    "tiny": [{"factor": f} for f in (1.0, 0.01)],
    "constant": [{"value": v} for v in (1.0, -0.5)],
}
# Every kind costs the same two choices (kind, parameter slot), whatever its parameter count:
# Hypothesis shrinks toward the shortest choice sequence first, so a kind that drew fewer
# choices (constant_rows, outliers) would count as simpler than the plain normal one and a
# shrink could stop there. The slots are a common multiple of the counts: uniform per kind.
_PARAM_SLOTS = 12
assert all(_PARAM_SLOTS % len(v) == 0 for t in (_DIST_PARAMS, _GRAD_PARAMS) for v in t.values())


@st.composite
def _dist(draw, kinds: tuple[str, ...], params: dict) -> dict:
    kind = draw(st.sampled_from(kinds))
    options = params[kind]
    return {"kind": kind, **options[draw(st.integers(0, _PARAM_SLOTS - 1)) % len(options)]}


def _seq_len(max_n: int, multiple: int) -> st.SearchStrategy[int]:
    """N in [1, max_n] drawn as k x multiple (k >= 1), so it shrinks to the multiple."""
    if multiple == 1:
        return st.integers(1, max_n)
    return st.integers(1, max_n // multiple).map(lambda k: k * multiple)


def _heads(draw, f, max_heads: int) -> tuple[int, int]:
    """(Hq, Hkv). The KV heads and the group size are drawn separately, so GQA with several
    KV heads *and* groups > 1 (the head-mapping bugs' domain) is common; both shrink to 1
    (MHA with one head). Group 1 is MHA; Hkv = 1 with group > 1 is MQA."""
    Hkv = draw(st.integers(1, min(_KV_HEADS_MAX, max_heads)))
    group = 1
    g_max = min(_GROUP_MAX, max_heads // Hkv)
    if "gqa" in f and g_max >= 2 and draw(st.booleans()):
        group = draw(st.integers(2, g_max))
    return Hkv * group, Hkv


def _note(case: Case) -> Case:
    note(f"case: {case.short()}")
    note(f"case json: {case.to_json()}")
    return case


# Ragged draws (the varlen and decode APIs, verify/ragged.py). Sequence counts: up to 6, the
# first sequence drawn up to max_n and the others short (a long prefill beside short ones is
# where a kernel's per-sequence offsets and its tiles of a long sequence meet), each length
# shrinking to 0 (varlen) or to the new tokens (decode), so a failure shrinks toward few short
# sequences.
_MAX_SEQS = 6
_SHORT_SEQ = 24  # > one 16-row tile: a short sequence still has a partial second tile
_PAGE_SIZES = (16, 32, 64, 128, 256)  # FlashAttention-3, vLLM and FlashInfer page sizes


def _lengths(draw, n: int, max_n: int, lo: int) -> list[int]:
    first = draw(st.integers(lo, max(lo, max_n)))
    return [first] + [draw(st.integers(lo, max(lo, min(max_n, _SHORT_SEQ))))
                      for _ in range(n - 1)]


@st.composite
def _draw_ragged(draw, *, api, dtypes, max_n, head_dim, max_heads, features, backward, dists,
                 grad_dists, caps) -> Case:
    f = features
    dtype = draw(st.sampled_from(dtypes))
    D = draw(head_dim)
    Hq, Hkv = _heads(draw, f, max_heads)
    n = draw(st.integers(1, _MAX_SEQS))
    if api == "varlen":
        lq = _lengths(draw, n, max_n, 0)
        lk = lq if not ("uneven_n" in f and draw(st.booleans())) else _lengths(draw, n, max_n, 0)
        lq[0], lk[0] = max(lq[0], 1), max(lk[0], 1)  # the dense equivalent has a token
        is_causal = "causal" in f and draw(st.booleans())
        window = None
        if "window" in f and draw(st.booleans()):
            window = (draw(st.integers(-1, max_n)), draw(st.integers(-1, max_n)))
        alignment = "top_left"
        if (is_causal or window is not None) and "bottom_right" in f and draw(st.booleans()):
            alignment = "bottom_right"
        if backward:
            backward = backward_declared(caps, dtype, is_causal) is not False
        kw = dict(B=1, Nq=sum(lq), Nk=sum(lk), is_causal=is_causal, window=window,
                  causal_alignment=alignment, backward=backward,
                  ragged={"seqlens_q": lq, "seqlens_k": lk})
    else:
        nq = draw(st.integers(1, caps.get("max_new_tokens", MAX_NEW_TOKENS)))
        lens = _lengths(draw, n, max_n, nq)
        pages = caps.get("page_sizes", _PAGE_SIZES)
        kw = dict(B=n, Nq=nq, Nk=max(lens), backward=False,
                  ragged={"cache_seqlens": lens, "page_size": draw(st.sampled_from(pages)),
                          "spare_blocks": draw(st.integers(0, 3))})
    scale = None
    if "custom_scale" in f and draw(st.booleans()):
        scale = draw(st.sampled_from([0.5, 2.0, 0.01]))
    dist = draw(_dist(dists, _DIST_PARAMS))
    grad_dist = draw(_dist(grad_dists, _GRAD_PARAMS)) if kw["backward"] else {"kind": "normal"}
    seed = draw(st.integers(0, SEED_LIMIT - 1))
    return _note(Case(Hq=Hq, Hkv=Hkv, D=D, dtype=dtype, layout="bnhd", scale=scale, dist=dist,
                      grad_dist=grad_dist, seed=seed, api=api, **kw))


@st.composite
def _draw_case(draw, *, dtypes, max_n, head_dim, max_batch, max_heads, features, backward,
               layouts, dists, grad_dists, caps) -> Case:
    f = features
    dtype = draw(st.sampled_from(dtypes))
    D = draw(head_dim)
    B = draw(st.integers(1, max_batch))
    Hq, Hkv = _heads(draw, f, max_heads)
    is_causal = "causal" in f and draw(st.booleans())
    window = None
    if "window" in f and draw(st.booleans()):
        window = (draw(st.integers(-1, max_n)), draw(st.integers(-1, max_n)))
    alignment = "top_left"
    if (is_causal or window is not None) and "bottom_right" in f and draw(
            st.integers(0, 2)) > 0:  # 2 in 3: bottom-right is where Nq != Nk bites
        alignment = "bottom_right"
    # Inside the declared sequence rules by construction: N = k x the multiple for this
    # causality (no draw is rejected); same_seqlen has removed "uneven_n".
    n_strategy = _seq_len(max_n, seq_multiple(caps, is_causal))
    Nq = draw(n_strategy)
    # Nq != Nk in 1 of 2 cases, 3 of 4 under bottom-right alignment (0 shrinks to Nk = Nq).
    uneven = "uneven_n" in f and draw(
        st.integers(0, 3 if alignment == "bottom_right" else 1)) > 0
    Nk = draw(n_strategy) if uneven else Nq
    layout = draw(st.sampled_from(layouts))

    kinds = ["none"] + [k for k, feat in _MASK_FEATURE.items() if feat in f]
    kind = draw(st.sampled_from(kinds))
    mask: dict = {"kind": kind}
    if kind != "none":
        need = {"key_padding": "bk", "block_sparse": "qk", "dead_rows": "qk"}.get(kind, "k")
        shapes = [s for s in MASK_SHAPES if all(c in s for c in need)]  # "bhqk" first
        if "mask_broadcast" in f and draw(st.booleans()):
            mask["shape"] = draw(st.sampled_from(shapes))
        else:
            mask["shape"] = "bhqk"
    _mask_values(draw, mask, f, B, Nk)

    if backward:  # declared per dtype ({dtype: bool}) or "causal_only"; undeclared: asked
        backward = backward_declared(caps, dtype, is_causal) is not False
    case = Case(B=B, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=D, dtype=dtype, layout=layout,
                is_causal=is_causal, causal_alignment=alignment, window=window, mask=mask,
                backward=backward,
                **_values(draw, f, backward, dists, grad_dists, tf32=dtype == "float32"))
    return _note(case)


def _mask_values(draw, mask: dict, f, B: int, Nk: int) -> None:
    """The values of a mask of a drawn kind and shape (lengths, densities, ...), in place."""
    kind = mask["kind"]
    if kind == "key_padding":
        # Lengths shrink toward Nk (no padding); 0 masks the whole batch.
        mask["lengths"] = draw(st.lists(st.integers(0, Nk).map(lambda x: Nk - x),
                                        min_size=B, max_size=B))
    elif kind == "random":
        mask["density"] = draw(_fraction(shrink_to_one=True))
    elif kind == "block_sparse":
        mask["block"] = draw(st.sampled_from(_TILES))
        mask["density"] = draw(_fraction(shrink_to_one=True))
    elif kind == "bias":
        mask["neginf_prob"] = draw(_fraction(shrink_to_one=False))
        mask["neginf_first_tile"] = "neginf_first_tile" in f and draw(st.booleans())
        mask["tile"] = draw(st.sampled_from(_TILES))
    elif kind == "dead_rows":
        mask["rows"] = draw(_fraction(shrink_to_one=False))


def _values(draw, f, backward: bool, dists, grad_dists, tf32: bool | None) -> dict:
    """What a case's inputs are, beside its shapes: scale, distributions, seed; and TF32,
    drawn where ``tf32`` is True (fp32 inputs), False where it is False, kept (no key) where
    it is None."""
    scale = None
    if "custom_scale" in f and draw(st.booleans()):
        scale = draw(st.one_of(st.sampled_from([0.5, 1.0, 2.0, 0.01]),
                               st.floats(0.01, 4.0).map(lambda x: round(x, 4))))
    dist = draw(_dist(dists, _DIST_PARAMS))
    grad_dist = draw(_dist(grad_dists, _GRAD_PARAMS)) if backward else {"kind": "normal"}
    out = dict(scale=scale, dist=dist, grad_dist=grad_dist)
    if tf32 is not None:
        out["tf32"] = tf32 and "tf32" in f and draw(st.booleans())
    out["seed"] = draw(st.integers(0, SEED_LIMIT - 1))
    return out


def compile_key(case: Case) -> tuple:
    """What a compiled kernel is specialised on, for a Triton-style kernel: the dtype, the
    shapes (Nq, Nk, D, heads: tile counts, even/uneven tiles, GQA group), the layout, the
    causal and window flags, the mask's kind and shape, TF32 and the backward; not the batch,
    the window's offsets, the mask's values, the scale or the inputs. Two dense cases with
    one key run the same compiled variants of such a kernel."""
    return (case.api, case.dtype, case.Nq, case.Nk, case.D, case.Hq, case.Hkv, case.layout,
            case.is_causal, case.causal_alignment, case.window is None,
            case.mask.get("kind"), case.mask.get("shape"), case.tf32, case.backward)


@st.composite
def _draw_like(draw, *, pool, max_batch, max_n, features, dists, grad_dists) -> Case:
    """A dense case with the compile key of a case in ``pool``; new batch, window offsets,
    mask values, scale, inputs."""
    t = draw(st.sampled_from(pool))
    f = features
    B = draw(st.integers(1, max_batch))
    window = None
    if t.window is not None:
        window = (draw(st.integers(-1, max_n)), draw(st.integers(-1, max_n)))
    mask = {k: v for k, v in t.mask.items() if k in ("kind", "shape")}
    _mask_values(draw, mask, f, B, t.Nk)
    case = Case(B=B, Hq=t.Hq, Hkv=t.Hkv, Nq=t.Nq, Nk=t.Nk, D=t.D, dtype=t.dtype,
                layout=t.layout, is_causal=t.is_causal, causal_alignment=t.causal_alignment,
                window=window, mask=mask, backward=t.backward, tf32=t.tf32,
                **_values(draw, f, t.backward, dists, grad_dists, tf32=None))
    return _note(case)


def cases(
    *,
    dtypes: Iterable[str] = ("float16", "float32"),
    max_n: int = 128,
    head_dims: Iterable[int] | None = None,
    max_batch: int = 2,
    max_heads: int = 6,
    features: Iterable[str] = ALL_FEATURES,
    backward: bool = True,
    layouts: Iterable[str] = ALL_LAYOUTS,
    distributions: Iterable[str] = ALL_DISTS,
    grad_distributions: Iterable[str] = ALL_GRAD_DISTS,
    capabilities=None,
    reuse: Iterable[Case] = (),
) -> st.SearchStrategy[Case]:
    """Strategy for :class:`Case` within the given bounds.

    - ``dtypes``: names from ``float16, bfloat16, float32``; the first is the one shrunk to.
    - ``max_n``: Nq and Nk are drawn in [1, max_n] (max_n <= ``MAX_N``).
    - ``head_dims``: explicit collection of head dims, or None for the default mix: 1..64
      biased small, plus 40, 72, 80, 96, 111, 128.
    - ``max_batch``, ``max_heads``: B in [1, max_batch]; Hkv in [1, min(3, max_heads)] and,
      with ``"gqa"``, a group size in [2, min(3, max_heads // Hkv)], Hq = Hkv x group <=
      max_heads (the default 6 gives 2x2, 2x3 and 3x2 as well as MQA).
    - ``features``: what may be drawn (``ALL_FEATURES``, plus opt-in ``"tf32"``).
    - ``backward``: the cases ask for gradient checks (and draw a dO distribution).
    - ``layouts``, ``distributions``, ``grad_distributions``: allowed kinds.
    - ``capabilities``: a kernel's capability mapping (or object), validated by
      :func:`verify.capabilities.check_capabilities`; draws stay inside its dtypes, head
      dims (range or set), mask kinds, extensions, GQA, backward (per dtype, or causal cases
      only), layouts and sequence rules (see :func:`restrict`). The rules are drawn by
      construction, never by rejection: N = k x ``seq_multiple`` (the causal or non-causal
      one, by the case's ``is_causal``), Nk = Nq under ``same_seqlen``, N <= ``max_seqlen``.
      ``supports`` (a callable) cannot be drawn inside; cases it refuses are not run.
    - ``reuse``: dense cases already run (``fuzz --reuse-compiled``). Then 3 draws in 4 take
      the :func:`compile_key` of one of them (new batch, offsets, mask values, scale and
      inputs), so a compiling kernel runs variants it has built; the fourth draws freely, as
      without ``reuse``, and a failure shrinks toward that free branch. Nothing becomes
      unreachable.

    Raises ValueError naming the argument on bad bounds, including bounds that the
    capabilities leave empty (e.g. ``max_n`` below the declared ``seq_multiple``), and
    naming the key on a bad capabilities entry.
    """
    dtypes = _check_choice("dtypes", dtypes, tuple(DTYPES))
    max_n = _check_int("max_n", max_n, 1, MAX_N)
    max_batch = _check_int("max_batch", max_batch, 1, 1024)
    max_heads = _check_int("max_heads", max_heads, 1, 1024)
    if not isinstance(backward, bool):
        raise ValueError(f"backward must be True or False, got {backward!r}")
    layouts = _check_choice("layouts", layouts, LAYOUTS)
    dists = _check_choice("distributions", distributions, DIST_KINDS)
    grad_dists = _check_choice("grad_distributions", grad_distributions, GRAD_DIST_KINDS)
    caps = _caps_dict(capabilities)
    features = restrict(features, caps)
    cap_dtypes = caps.get("dtypes")
    if cap_dtypes is not None:
        dtypes = tuple(d for d in dtypes if d in tuple(cap_dtypes))
        if not dtypes:
            raise ValueError(f"dtypes: none of the requested dtypes is in capabilities['dtypes']"
                             f" = {list(cap_dtypes)}")
    if caps.get("backward") is False:
        backward = False
    head_dim = _head_dim_strategy(head_dims, caps.get("head_dims"))
    if caps.get("layouts") is not None:
        layouts = tuple(x for x in layouts if x in caps["layouts"])
        if not layouts:
            raise ValueError(f"layouts: none of the requested layouts is in "
                             f"capabilities['layouts'] = {list(caps['layouts'])}")
    if caps.get("max_seqlen") is not None:
        max_n = min(max_n, caps["max_seqlen"])
    multiples = {seq_multiple(caps, False)}
    if "causal" in features:
        multiples.add(seq_multiple(caps, True))
    if max(multiples) > max_n:
        raise ValueError(f"max_n = {max_n} leaves no sequence length that is a multiple of "
                         f"capabilities['seq_multiple'] = {caps['seq_multiple']!r}; raise "
                         f"max_n to at least {max(multiples)}")
    # Plain first, so a failing case shrinks toward it; the caller's order otherwise.
    dists = tuple(sorted(dists, key=lambda k: k != "normal"))
    grad_dists = tuple(sorted(grad_dists, key=lambda k: k != "normal"))
    if caps.get("api", "dense") != "dense":
        return _draw_ragged(api=caps["api"], dtypes=dtypes, max_n=max_n, head_dim=head_dim,
                            max_heads=max_heads, features=features, backward=backward,
                            dists=dists, grad_dists=grad_dists, caps=caps)
    free = _draw_case(dtypes=dtypes, max_n=max_n, head_dim=head_dim, max_batch=max_batch,
                      max_heads=max_heads, features=features, backward=backward,
                      layouts=layouts, dists=dists, grad_dists=grad_dists, caps=caps)
    pool = sorted({compile_key(c): c for c in reuse if c.api == "dense"}.values(),
                  key=compile_key)
    if not pool:
        return free
    like = _draw_like(pool=tuple(pool), max_batch=max_batch, max_n=max_n, features=features,
                      dists=dists, grad_dists=grad_dists)
    # index 0 (free) is what a failure shrinks toward
    return st.sampled_from((0, 1, 1, 1)).flatmap(lambda i: like if i else free)


def features_of(case: Case) -> frozenset[str]:
    """The entries of ``ALL_FEATURES | OPT_IN_FEATURES`` that ``case`` exercises."""
    out = set()
    if case.is_causal:
        out.add("causal")
    if case.window is not None:
        out.add("window")
    if case.causal_alignment == "bottom_right" and (case.is_causal or case.window is not None):
        out.add("bottom_right")
    kind = case.mask["kind"]
    if kind != "none":
        out.add(_MASK_FEATURE[kind])
        if case.mask["shape"] != "bhqk":
            out.add("mask_broadcast")
        if kind == "bias" and case.mask["neginf_first_tile"]:
            out.add("neginf_first_tile")
    if case.Hq != case.Hkv:
        out.add("gqa")
    if case.scale is not None:
        out.add("custom_scale")
    if case.Nq != case.Nk:
        out.add("uneven_n")
    if case.tf32:
        out.add("tf32")
    return frozenset(out)


# ----------------------------------------------------------------------------------------
# Fixed sweeps


def _themes(N: int, D: int, Hq: int) -> list[tuple[str, dict]]:
    """Structural themes of the sweep at size (N, D) with Hq query heads (B = 2)."""
    half = N // 2 + 1
    tile = 16 if N < 256 else 128  # covers kernels tiling keys by 16 (CPU) or 64/128 (GPU)
    return [
        ("plain", {}),
        ("decode", {"Nq": 1, "is_causal": True, "causal_alignment": "bottom_right"}),
        ("uneven", {"Nk": half + 6}),
        ("causal", {"is_causal": True}),
        ("causal_br", {"Nq": half, "is_causal": True, "causal_alignment": "bottom_right"}),
        # Nq > Nk with bottom-right alignment: the first Nq - Nk query rows see no key.
        ("causal_br_tall", {"Nk": N // 3 + 1, "is_causal": True,
                            "causal_alignment": "bottom_right"}),
        ("window", {"window": (max(1, N // 8), 0)}),
        ("window_causal_br", {"Nq": half + 2, "window": (16, 16), "is_causal": True,
                              "causal_alignment": "bottom_right"}),
        ("key_padding", {"Nk": half + 4, "mask": {"kind": "key_padding", "shape": "bk",
                                                  "lengths": [0, half // 2 + 1]}}),
        ("key_padding_full", {"mask": {"kind": "key_padding", "lengths": [N, 1]}}),
        ("random", {"mask": {"kind": "random", "density": 0.3}}),
        ("random_sparse_bcast", {"mask": {"kind": "random", "shape": "qk", "density": 0.05}}),
        ("random_dense_bcast", {"is_causal": True,
                                "mask": {"kind": "random", "shape": "bk", "density": 0.9}}),
        ("block_sparse", {"mask": {"kind": "block_sparse", "block": 16, "density": 0.5}}),
        ("block_sparse_causal", {"is_causal": True, "mask": {"kind": "block_sparse",
                                                             "block": 64, "density": 0.3}}),
        ("bias", {"mask": {"kind": "bias", "neginf_prob": 0.1}}),
        ("bias_first_tile", {"mask": {"kind": "bias", "shape": "bqk", "neginf_prob": 0.02,
                                      "neginf_first_tile": True, "tile": tile}}),
        ("dead_rows", {"mask": {"kind": "dead_rows", "rows": 0.25}}),
        ("gqa", {"Hkv": Hq // 2, "is_causal": True}),
        ("mqa", {"Hkv": 1, "window": (max(1, N // 4), max(1, N // 4))}),
        ("scale", {"scale": 0.3}),
    ]


def _sweep_dist(kind: str, i: int) -> dict:
    if kind == "ties":  # every other round of the distribution cycle: all keys equal, or 4 groups
        return {"kind": "ties", "groups": 1 if (i // len(DIST_KINDS)) % 2 == 0 else 4}
    return {"kind": kind}


# (N, D) per theme, cycled. CPU: small enough for the Triton interpreter (fwd + bwd of all
# cases in a few minutes on 2 cores) yet covering N = 1, odd N and D, N > 128, D = 256.
_CPU_SIZES = ((33, 40), (64, 64), (17, 24), (48, 72), (1, 8), (100, 111), (24, 256),
              (130, 32))
_GPU_SIZES = ((16, 32), (127, 64), (1023, 96), (2048, 128), (333, 256))
SWEEP_PROFILES = ("cpu", "gpu")


def fixed_sweep(profile: str, api: str = "dense") -> list[Case]:
    """The deterministic default sweep for ``flashcheck run`` and ``gate``; ``api``
    "varlen" or "decode" gives :func:`ragged_sweep`'s instead.

    Every theme (no mask, causal top-left/bottom-right, decode, windows, key padding with a
    zero-length batch, random masks sparse and dense and broadcast, block-sparse, bias with
    −inf entries and a −inf first tile, dead rows, GQA, MQA, custom scale, Nq ≠ Nk) is
    crossed with every dtype (bf16 included: the harness reports it "not run" where a
    kernel cannot run it). Distributions, dO distributions and layouts rotate with the case
    index so that each one meets every dtype.

    - ``"cpu"``: 21 themes × 3 dtypes = 63 small cases (B = 2, Hq = 2 or 4, N <= 130).
    - ``"gpu"``: 21 themes × 3 dtypes × 5 sizes = 315 cases, N up to 2048, D up to 256;
      fp32 cases of every seventh theme ask for TF32.
    """
    if profile not in SWEEP_PROFILES:
        raise ValueError(f"profile must be one of {list(SWEEP_PROFILES)}, got {profile!r}")
    if api != "dense":
        return ragged_sweep(profile, api)
    dtypes = tuple(DTYPES)
    out: list[Case] = []
    sizes = _CPU_SIZES if profile == "cpu" else _GPU_SIZES
    n_themes = len(_themes(8, 8, 4))
    plan = []
    for t in range(n_themes):
        size_list = [sizes[t % len(sizes)]] if profile == "cpu" else list(sizes)
        for N, D in size_list:
            for dtype in dtypes:
                plan.append((t, N, D, dtype))
    for i, (t, N, D, dtype) in enumerate(plan):
        Hq = 4 if profile == "gpu" or t >= n_themes - 3 else 2
        name, overrides = _themes(N, D, Hq)[t]
        kw = {"B": 2, "Hq": Hq, "Hkv": Hq, "Nq": N, "Nk": N, "D": D, "dtype": dtype,
              "layout": LAYOUTS[(t + i) % len(LAYOUTS)],
              "dist": _sweep_dist(DIST_KINDS[i % len(DIST_KINDS)], i),
              "grad_dist": {"kind": GRAD_DIST_KINDS[i % len(GRAD_DIST_KINDS)]},
              "seed": (0 if profile == "cpu" else 100_000) + i}
        kw.update(overrides)
        if profile == "gpu" and dtype == "float32" and t % 7 == 0:
            kw["tf32"] = True
        out.append(Case(**kw))
    return out


# Ragged themes: (name, sequence lengths q, k) for varlen and (name, cache lengths, page, new
# tokens) for decode, at a length unit L (CPU 8, GPU 128): zero-length and one-token
# sequences, one long sequence beside short ones, Lq != Lk under both causal alignments, a
# window, GQA and MQA; pages full and partial, one page and many, speculative Nq.
def _varlen_themes(L: int) -> list[tuple[str, list[int], list[int], dict]]:
    return [
        ("one", [3 * L], [3 * L], {}),
        ("packed", [L, 2 * L + 3, 5], [L, 2 * L + 3, 5], {"is_causal": True}),
        ("empty_seqs", [0, L + 1, 0, 7], [L, L + 1, 0, 0], {}),
        ("long_and_short", [8 * L, 1, 2, 3], [8 * L, 1, 2, 3], {"is_causal": True}),
        ("uneven_br", [L, 2 * L + 1], [3 * L, L + 5], {"is_causal": True,
                                                      "causal_alignment": "bottom_right"}),
        ("uneven_tl", [2 * L, 3], [L + 3, 4 * L], {"is_causal": True}),
        ("window", [4 * L, L], [4 * L, L], {"window": (L, 0)}),
        ("gqa", [2 * L, L + 3], [2 * L, L + 3], {"Hkv": 1, "is_causal": True}),
    ]


def _decode_themes(L: int) -> list[tuple[str, list[int], int, int, dict]]:
    return [
        ("one_token", [5 * L + 3, L, 17], 16, 1, {}),
        ("full_pages", [4 * L, 2 * L], 2 * L if L >= 64 else 16, 1, {}),
        ("speculative", [3 * L + 9, 16], 32, 8, {}),
        ("long_and_short", [16 * L + 1, 1, 2, 5], 64, 1, {}),
        ("big_pages", [6 * L + 7, L], 256, 4, {}),
        ("gqa", [3 * L + 1, 2 * L], 16, 2, {"Hkv": 1}),
    ]


def ragged_sweep(profile: str, api: str) -> list[Case]:
    """The fixed sweep of the varlen or decode API: its themes (above) × the three dtypes,
    D rotating over (16, 40, 64, 128) on the CPU and (64, 128, 256) on a GPU, Hq = 4,
    distributions and dO distributions rotating with the case index.

    - varlen: 8 themes × 3 dtypes = 24 cases (unit L = 8 on the CPU, 128 on a GPU);
    - decode: 6 themes × 3 dtypes = 18 cases (forward only).
    """
    if api not in RAGGED_APIS:
        raise ValueError(f"api must be one of {list(RAGGED_APIS)}, got {api!r}")
    L = 8 if profile == "cpu" else 128
    dims = (16, 40, 64, 128) if profile == "cpu" else (64, 128, 256)
    out: list[Case] = []
    themes = _varlen_themes(L) if api == "varlen" else _decode_themes(L)
    for t, theme in enumerate(themes):
        for dtype in DTYPES:
            i = len(out)
            kw = {"Hq": 4, "Hkv": 2, "D": dims[i % len(dims)], "dtype": dtype,
                  "layout": "bnhd", "dist": _sweep_dist(DIST_KINDS[i % len(DIST_KINDS)], i),
                  "seed": (200_000 if profile == "cpu" else 300_000) + i, "api": api}
            if api == "varlen":
                _, lq, lk, extra = theme
                kw.update(B=1, Nq=sum(lq), Nk=sum(lk), ragged={"seqlens_q": lq,
                                                              "seqlens_k": lk},
                          grad_dist={"kind": GRAD_DIST_KINDS[i % len(GRAD_DIST_KINDS)]})
            else:
                _, lens, page, nq, extra = theme
                kw.update(B=len(lens), Nq=nq, Nk=max(lens), backward=False,
                          ragged={"cache_seqlens": lens, "page_size": page,
                                  "spare_blocks": t % 3})
            kw.update(extra)
            out.append(Case(**kw))
    return out

"""The kernel ``capabilities`` vocabulary (docs/contracts.md §2): validation and the domain.

A kernel may carry a plain dict ``capabilities``. :func:`check_capabilities` validates it
and returns a normalised copy; a bad entry raises ValueError naming the key and the form it
allows. The domain keys this module decides on a case, without running anything:

- ``seq_multiple``: an int m >= 1 (Nq and Nk must be multiples of m), or
  ``{"causal": a, "noncausal": b}`` (the multiple depends on ``is_causal``);
- ``head_dims``: a ``(lo, hi)`` tuple (inclusive range) or a set / list / frozenset / range
  of allowed values (normalised to a frozenset);
- ``same_seqlen``: Nq == Nk is required;
- ``max_seqlen``: Nq and Nk are at most this;
- ``layouts``: the case layouts accepted (``verify.cases.LAYOUTS``);
- ``api``: ``"dense"`` (the SDPA signature, the default), ``"varlen"`` or ``"decode"``
  (verify/ragged.py); a kernel is given only cases of its API, and one of the varlen or
  decode API is not probed (what it leaves undeclared is in the domain). For those APIs
  ``max_seqlen`` bounds the longest sequence, and decode kernels may declare
  ``page_sizes`` (the page sizes they take) and ``max_new_tokens`` (1..16);
- ``backward``: a bool, a dict ``{dtype: bool}`` (a dtype left out is probed), or
  ``"causal_only"`` (gradients only for ``is_causal`` cases).

``supports`` (a callable ``case -> None | str``) covers the rest; a returned string is the
"not run" reason. It is called by ``verify.adapters.Kernel.supports``; a strategy cannot
draw inside it (it is not sent to the campaign's process), so cases it refuses are drawn and
then not run.

Keys that ``Kernel.capabilities`` adds (``probed_not_run``, ``probe_rejected_cases``,
``head_dim_sample``) are accepted too, so probed capabilities round-trip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from flashcheck.verify.cases import DTYPES, LAYOUTS, MAX_HEAD_DIM
from flashcheck.verify.ragged import APIS, MAX_NEW_TOKENS, PAGE_SIZE_MAX, max_seqlens

__all__ = [
    "KEYS", "check_capabilities", "seq_multiple", "head_dim_reason", "head_dim_values",
    "backward_declared", "domain_reason", "probe_shape", "call_supports",
]

# Sequence lengths beyond this are refused by the harness anyway (verify.strategies.MAX_N).
_MAX_SEQ = 1 << 16
_MASKS = ("bool", "additive")
_EXTENSIONS = ("window", "causal_alignment")
_DEVICES = ("cpu", "cuda")
_BOOL_KEYS = ("mask_broadcast", "gqa", "deterministic_backward", "tf32", "same_seqlen",
              "causal_with_mask")
# What Kernel.capabilities adds after probing; accepted as they are.
_DERIVED = ("probed_not_run", "probe_rejected_cases", "head_dim_sample")
KEYS = ("dtypes", "head_dims", "masks", "mask_broadcast", "extensions", "gqa", "backward",
        "devices", "not_run", "deterministic_backward", "tf32", "family", "causal_with_mask",
        "seq_multiple", "same_seqlen", "max_seqlen", "layouts", "supports", "api",
        "page_sizes", "max_new_tokens")


def _bad(key: str, form: str, value) -> ValueError:
    return ValueError(f"capabilities[{key!r}] must be {form}, got {value!r}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _subset(key: str, value, allowed: tuple[str, ...], *, empty_ok: bool = True) -> tuple:
    form = f"a tuple of names from {list(allowed)}"
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise _bad(key, form, value)
    out = tuple(value)
    if any(v not in allowed for v in out) or (not out and not empty_ok):
        raise _bad(key, form + ("" if empty_ok else ", not empty"), value)
    return tuple(dict.fromkeys(out))


def _head_dims(value):
    form = (f"(lo, hi) with 1 <= lo <= hi <= {MAX_HEAD_DIM}, or a set/list of allowed head "
            f"dims in [1, {MAX_HEAD_DIM}]")
    if isinstance(value, tuple):
        if len(value) != 2 or not all(_is_int(v) for v in value) or not (
                1 <= value[0] <= value[1] <= MAX_HEAD_DIM):
            raise _bad("head_dims", form, value)
        return value
    if isinstance(value, (set, frozenset, list, range)):
        vals = list(value)
        if not vals or not all(_is_int(v) and 1 <= v <= MAX_HEAD_DIM for v in vals):
            raise _bad("head_dims", form, value)
        return frozenset(vals)
    raise _bad("head_dims", form, value)


def _seq_multiple(value):
    form = (f"an int in [1, {_MAX_SEQ}] or {{'causal': int, 'noncausal': int}} "
            f"(Nq and Nk must be multiples)")
    if _is_int(value):
        if not 1 <= value <= _MAX_SEQ:
            raise _bad("seq_multiple", form, value)
        return value
    if isinstance(value, Mapping):
        if set(value) != {"causal", "noncausal"} or not all(
                _is_int(v) and 1 <= v <= _MAX_SEQ for v in value.values()):
            raise _bad("seq_multiple", form, value)
        return {"causal": value["causal"], "noncausal": value["noncausal"]}
    raise _bad("seq_multiple", form, value)


def _backward(value):
    form = "True, False, a dict {dtype: bool} over " + f"{list(DTYPES)}, or 'causal_only'"
    if isinstance(value, bool) or value == "causal_only":
        return value
    if isinstance(value, Mapping):
        if not all(k in DTYPES and isinstance(v, bool) for k, v in value.items()):
            raise _bad("backward", form, value)
        return dict(value)
    raise _bad("backward", form, value)


def check_capabilities(caps) -> dict:
    """A validated, normalised copy of a capabilities mapping (None: empty).

    Raises ValueError naming the key and its allowed form: an unknown key (a typo such as
    ``seq_mutliple`` would otherwise widen the domain silently), a bad value, or a declared
    domain that leaves nothing (``max_seqlen`` below the ``seq_multiple``)."""
    if caps is None:
        return {}
    if not isinstance(caps, Mapping):
        raise ValueError(f"capabilities must be a dict (docs/contracts.md §2), got "
                         f"{type(caps).__name__}")
    unknown = sorted(str(k) for k in caps if k not in KEYS and k not in _DERIVED)
    if unknown:
        raise ValueError(f"capabilities: unknown key(s) {unknown}; allowed: {list(KEYS)}")
    out = dict(caps)
    if "dtypes" in out:
        out["dtypes"] = _subset("dtypes", out["dtypes"], tuple(DTYPES))
    if "head_dims" in out:
        out["head_dims"] = _head_dims(out["head_dims"])
    if "masks" in out:
        out["masks"] = _subset("masks", out["masks"], _MASKS)
    if "extensions" in out:
        out["extensions"] = _subset("extensions", out["extensions"], _EXTENSIONS)
    if "devices" in out:
        out["devices"] = _subset("devices", out["devices"], _DEVICES, empty_ok=False)
    if "layouts" in out:
        out["layouts"] = _subset("layouts", out["layouts"], LAYOUTS, empty_ok=False)
    for key in _BOOL_KEYS:
        if key in out and not isinstance(out[key], bool):
            raise _bad(key, "True or False", out[key])
    if "backward" in out:
        out["backward"] = _backward(out["backward"])
    if "seq_multiple" in out:
        out["seq_multiple"] = _seq_multiple(out["seq_multiple"])
    if "max_seqlen" in out:
        v = out["max_seqlen"]
        if not _is_int(v) or not 1 <= v <= _MAX_SEQ:
            raise _bad("max_seqlen", f"an int in [1, {_MAX_SEQ}]", v)
        m = min(seq_multiple(out, False), seq_multiple(out, True))
        if m > v:
            raise ValueError(f"capabilities['max_seqlen'] = {v} is below "
                             f"capabilities['seq_multiple'] = {out['seq_multiple']!r}: no "
                             f"sequence length is left")
    if "family" in out:
        v = out["family"]
        from flashcheck.reference.family import OPT_IN

        if isinstance(v, (str, bytes)) or not isinstance(v, Iterable) or not all(
                isinstance(x, str) and x in OPT_IN for x in v):
            raise _bad("family", f"a tuple of opt-in family member names, each one of "
                                 f"{OPT_IN} (docs/bounds.md §2)", v)
        out["family"] = tuple(v)
    if "not_run" in out:
        v = out["not_run"]
        if not isinstance(v, Mapping) or not all(
                isinstance(d, Mapping) and dev in _DEVICES for dev, d in v.items()):
            raise _bad("not_run", "a dict {device_type: {dtype: reason}}", v)
    if "api" in out and out["api"] not in APIS:
        raise _bad("api", f"one of {list(APIS)}", out["api"])
    if "page_sizes" in out:
        v = out["page_sizes"]
        if isinstance(v, (str, bytes)) or not isinstance(v, Iterable) or not v or not all(
                _is_int(x) and 1 <= x <= PAGE_SIZE_MAX for x in v):
            raise _bad("page_sizes", f"a tuple of ints in [1, {PAGE_SIZE_MAX}]", v)
        out["page_sizes"] = tuple(sorted(set(v)))
    if "max_new_tokens" in out:
        v = out["max_new_tokens"]
        if not _is_int(v) or not 1 <= v <= MAX_NEW_TOKENS:
            raise _bad("max_new_tokens", f"an int in [1, {MAX_NEW_TOKENS}]", v)
    if "supports" in out and not callable(out["supports"]):
        raise _bad("supports", "a callable case -> None | str", out["supports"])
    return out


# ------------------------------------------------------------------------------------------
# the declared domain, decided on a case


def seq_multiple(caps: Mapping, is_causal: bool) -> int:
    """The multiple Nq and Nk must have for a case with this ``is_causal`` (1: any)."""
    m = caps.get("seq_multiple", 1)
    if isinstance(m, Mapping):
        return m["causal" if is_causal else "noncausal"]
    return m


def head_dim_values(caps: Mapping) -> frozenset[int] | None:
    """The declared set of head dims, or None when ``head_dims`` is a range or absent."""
    v = caps.get("head_dims")
    return v if isinstance(v, frozenset) else None


def head_dim_reason(caps: Mapping, D: int) -> str | None:
    """Why head dim D is outside the declared ``head_dims`` (None: inside, or undeclared)."""
    v = caps.get("head_dims")
    if v is None:
        return None
    if isinstance(v, frozenset):
        return None if D in v else f"head dim {D} not in declared head_dims {sorted(v)}"
    lo, hi = v
    return None if lo <= D <= hi else f"head dim {D} outside declared [{lo}, {hi}]"


def backward_declared(caps: Mapping, dtype: str, is_causal: bool) -> bool | None:
    """Whether gradients are declared for this dtype and causality; None: not declared."""
    v = caps.get("backward")
    if v is None:
        return None
    if v == "causal_only":
        return is_causal
    if isinstance(v, Mapping):
        return v.get(dtype)
    return bool(v)


def domain_reason(caps: Mapping, case) -> str | None:
    """Why ``case`` is outside the declared shape domain (head dims, sequence-length rules,
    layouts), or None. Does not run the kernel and does not call ``supports``."""
    r = head_dim_reason(caps, case.D)
    if r:
        return r
    if case.api != "dense":
        return _ragged_reason(caps, case)
    m = seq_multiple(caps, case.is_causal)
    if m > 1 and (case.Nq % m or case.Nk % m):
        what = "causal" if case.is_causal else "non-causal"
        return (f"Nq={case.Nq}, Nk={case.Nk}: {what} cases need multiples of {m} "
                f"(declared seq_multiple)")
    if caps.get("same_seqlen") and case.Nq != case.Nk:
        return f"Nq={case.Nq} != Nk={case.Nk} (declared same_seqlen)"
    top = caps.get("max_seqlen")
    if top is not None and max(case.Nq, case.Nk) > top:
        return f"sequence length {max(case.Nq, case.Nk)} > declared max_seqlen {top}"
    layouts = caps.get("layouts")
    if layouts is not None and case.layout not in layouts:
        return f"layout {case.layout} not in declared layouts {tuple(layouts)}"
    return None


def _ragged_reason(caps: Mapping, case) -> str | None:
    """The declared domain of a varlen/decode case: the longest sequence, the page size and
    the new tokens per call."""
    top = caps.get("max_seqlen")
    longest = max(max_seqlens(case))
    if top is not None and longest > top:
        return f"sequence length {longest} > declared max_seqlen {top}"
    if case.api == "decode":
        page = case.ragged["page_size"]
        if "page_sizes" in caps and page not in caps["page_sizes"]:
            return f"page size {page} not in declared page_sizes {caps['page_sizes']}"
        most = caps.get("max_new_tokens", MAX_NEW_TOKENS)
        if case.Nq > most:
            return f"{case.Nq} new tokens > declared max_new_tokens {most}"
    return None


def probe_shape(caps: Mapping, *, is_causal: bool = False, large: bool = False,
                D: int | None = None) -> dict:
    """Shape of a probe case inside the declared domain: N the smallest multiple of the
    declared ``seq_multiple`` that is >= 4 (>= 64 with ``large``: a second, different probe),
    within ``max_seqlen``; D as given, else the allowed head dim nearest 16 (64 with
    ``large``); layout ``contiguous`` unless the declared layouts leave it out."""
    m = seq_multiple(caps, is_causal)
    want = 64 if large else 4
    N = m * max(1, -(-want // m))
    top = caps.get("max_seqlen")
    if top is not None and N > top:
        N = m * max(1, top // m)
    if D is None:
        target = 64 if large else 16
        v = caps.get("head_dims")
        if isinstance(v, frozenset):
            D = min(v, key=lambda d: (abs(d - target), d))
        elif v is not None:
            D = min(max(target, v[0]), v[1])
        else:
            D = target
    layouts = caps.get("layouts") or LAYOUTS
    layout = "contiguous" if "contiguous" in layouts else layouts[0]
    return {"Nq": N, "Nk": N, "D": D, "layout": layout}


def call_supports(fn: Callable, case) -> str | None:
    """The declared ``supports(case)``: None or a reason string (anything else is an error
    naming the key)."""
    r = fn(case)
    if r is None:
        return None
    if isinstance(r, str) and r:
        return r
    raise ValueError(f"capabilities['supports'] must return None or a reason string, got "
                     f"{r!r} for {case.short()}")

"""Tests for verify.strategies: bounds, capabilities, bad arguments, shrinking, coverage of
every feature, and the fixed sweeps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from flashcheck.verify.capabilities import backward_declared, check_capabilities, domain_reason
from flashcheck.verify.cases import DTYPES, LAYOUTS, Case, d_bucket, n_bucket
from flashcheck.verify.distributions import DIST_KINDS, GRAD_DIST_KINDS
from flashcheck.verify.strategies import (
    ALL_FEATURES,
    OPT_IN_FEATURES,
    cases,
    compile_key,
    features_of,
    fixed_sweep,
    restrict,
)
from hypothesis import find, given, settings
from hypothesis import strategies as st

# find() stops at the first example that satisfies the predicate, then shrinks it; the
# database is off so runs cannot influence each other.
FIND = settings(database=None, max_examples=2000)

BOUNDS = [
    dict(dtypes=("bfloat16",), max_n=5, head_dims=[3, 7], max_batch=1, max_heads=2,
         features=frozenset(), layouts=("bnhd",), distributions=("ties",)),
    dict(dtypes=("float32", "float16"), max_n=40, head_dims=range(60, 65), max_batch=3,
         max_heads=6, features=frozenset({"gqa", "uneven_n", "bias"}), backward=False,
         layouts=("strided", "contiguous"), distributions=("tiny", "dominant"),
         grad_distributions=("constant",)),
    dict(max_n=9, features=ALL_FEATURES | OPT_IN_FEATURES, dtypes=tuple(DTYPES)),
]


@pytest.mark.parametrize("bounds", BOUNDS, ids=["tight", "mixed", "all"])
@given(data=st.data())
def test_strategy_respects_bounds(bounds, data):
    case = data.draw(cases(**bounds))
    assert case.dtype in bounds["dtypes"]
    assert 1 <= case.Nq <= bounds["max_n"] and 1 <= case.Nk <= bounds["max_n"]
    if "head_dims" in bounds:
        assert case.D in set(bounds["head_dims"])
    assert case.B <= bounds.get("max_batch", 2) and case.Hq <= bounds.get("max_heads", 6)
    assert case.Hq % case.Hkv == 0
    assert features_of(case) <= bounds["features"]
    assert case.layout in bounds.get("layouts", LAYOUTS)
    assert case.dist["kind"] in bounds.get("distributions", DIST_KINDS)
    assert case.backward == bounds.get("backward", True)
    if case.backward:
        assert case.grad_dist["kind"] in bounds.get("grad_distributions", GRAD_DIST_KINDS)


CAPS = [
    {"dtypes": ("float32",), "head_dims": (16, 48), "masks": ("bool",), "gqa": False,
     "backward": False, "mask_broadcast": False},
    {"dtypes": ("float16", "bfloat16"), "masks": (), "extensions": ()},
    {"masks": ("additive",), "extensions": ("window", "causal_alignment")},
]


@pytest.mark.parametrize("caps", CAPS, ids=["bool-masks", "no-masks", "additive"])
@pytest.mark.parametrize("as_object", [False, True], ids=["dict", "object"])
@given(data=st.data())
def test_strategy_stays_inside_capabilities(caps, as_object, data):
    given_caps = SimpleNamespace(**caps) if as_object else caps
    case = data.draw(cases(dtypes=tuple(DTYPES), max_n=16, capabilities=given_caps))
    assert case.dtype in caps.get("dtypes", DTYPES)
    lo, hi = caps.get("head_dims", (1, 256))
    assert lo <= case.D <= hi
    masks = caps.get("masks", ("bool", "additive"))
    kind = case.mask["kind"]
    assert kind == "none" or ("additive" if kind == "bias" else "bool") in masks
    if caps.get("gqa") is False:
        assert case.Hq == case.Hkv
    if caps.get("backward") is False:
        assert not case.backward
    if caps.get("mask_broadcast") is False and kind != "none":
        assert case.mask["shape"] == "bhqk"
    if not masks and not caps.get("extensions"):
        assert case.window is None and case.causal_alignment == "top_left"


@pytest.mark.parametrize("caps,features,want", [
    ({"masks": ("bool",)}, ALL_FEATURES, ALL_FEATURES - {"bias", "neginf_first_tile"}),
    ({"masks": ("additive",)}, {"key_padding", "random_mask", "block_sparse", "dead_rows",
                                "bias", "window"}, {"bias", "window"}),
    ({"masks": (), "extensions": ("window",)}, {"window", "bottom_right", "causal"},
     {"window", "causal"}),
    ({"masks": (), "extensions": ("causal_alignment",)}, {"window", "bottom_right"},
     {"bottom_right"}),
    ({"gqa": False, "mask_broadcast": False}, {"gqa", "mask_broadcast", "uneven_n"},
     {"uneven_n"}),
    ({}, ALL_FEATURES, ALL_FEATURES),
    (None, {"tf32"}, {"tf32"}),
])
def test_restrict(caps, features, want):
    assert restrict(features, caps) == frozenset(want)


@pytest.mark.parametrize("kwargs,name", [
    ({"max_n": 0}, "max_n"),
    ({"max_n": 1 << 20}, "max_n"),
    ({"max_n": 4.0}, "max_n"),
    ({"max_batch": 0}, "max_batch"),
    ({"max_heads": -1}, "max_heads"),
    ({"dtypes": ("float64",)}, "dtypes"),
    ({"dtypes": ()}, "dtypes"),
    ({"dtypes": "float16"}, "dtypes"),
    ({"head_dims": [0, 8]}, "head_dims"),
    ({"head_dims": [300]}, "head_dims"),
    ({"features": {"causal", "sparkle"}}, "features"),
    ({"features": "causal"}, "features"),
    ({"layouts": ("bhnd",)}, "layouts"),
    ({"distributions": ("cauchy",)}, "distributions"),
    ({"grad_distributions": ("ties",)}, "grad_distributions"),
    ({"backward": "yes"}, "backward"),
    ({"capabilities": {"dtypes": ("float32",)}, "dtypes": ("float16",)}, "dtypes"),
    ({"capabilities": {"head_dims": (8, 16)}, "head_dims": [32]}, "head_dims"),
    ({"capabilities": {"head_dims": 5}}, "head_dims"),
])
def test_bad_bounds_raise_immediately(kwargs, name):
    with pytest.raises(ValueError, match=name):
        cases(**kwargs)


def test_shrinks_to_the_plain_case():
    case = find(cases(), lambda c: True, settings=FIND)
    assert (case.B, case.Hq, case.Hkv, case.Nq, case.Nk, case.D) == (1, 1, 1, 1, 1, 1)
    assert case.dtype == "float16" and case.layout == "contiguous"
    assert case.mask == {"kind": "none"} and case.dist == {"kind": "normal", "sigma": 1.0}
    assert not case.is_causal and case.window is None and case.scale is None
    assert case.grad_dist == {"kind": "normal", "sigma": 1.0} and case.seed == 0


def test_shrinks_masks_toward_attend_all():
    kp = find(cases(), lambda c: c.mask["kind"] == "key_padding", settings=FIND)
    assert kp.mask["lengths"] == [kp.Nk] * kp.B
    rnd = find(cases(), lambda c: c.mask["kind"] == "random", settings=FIND)
    assert rnd.mask["density"] == 1.0 and rnd.mask["shape"] == "bhqk"


PREREQUISITES = {
    "bottom_right": {"causal", "window"},
    "neginf_first_tile": {"bias"},
    "mask_broadcast": {"key_padding", "random_mask", "block_sparse", "bias", "dead_rows"},
}


@pytest.mark.parametrize("feature", sorted(ALL_FEATURES | OPT_IN_FEATURES))
def test_every_feature_is_reachable(feature):
    strat = cases(dtypes=tuple(DTYPES), features=ALL_FEATURES | OPT_IN_FEATURES)
    case = find(strat, lambda c: feature in features_of(c), settings=FIND)
    # Shrunk to the feature alone, plus at most the one it needs (a mask kind for
    # mask_broadcast, bias for neginf_first_tile, causal or window for bottom_right).
    extra = features_of(case) - {feature}
    assert len(extra) <= 1 and extra <= PREREQUISITES.get(feature, set()), extra


def test_zero_length_keys_and_mqa_are_reachable():
    zero = find(cases(), lambda c: c.mask["kind"] == "key_padding"
                and 0 in c.mask["lengths"], settings=FIND)
    assert zero.materialize().attn_mask[zero.mask["lengths"].index(0)].any().item() is False
    mqa = find(cases(), lambda c: c.Hkv == 1 and c.Hq > 1, settings=FIND)
    assert mqa.config_key()["gqa"] == "mqa"


def _draws(n: int, **kwargs) -> list:
    """The first ``n`` cases a derandomized Hypothesis run draws (generation only)."""
    from hypothesis import HealthCheck, Phase

    out = []

    @settings(max_examples=n, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), deadline=None)
    @given(cases(**kwargs))
    def collect(case):
        out.append(case)

    collect()
    return out


def test_gqa_with_several_kv_heads_and_uneven_bottom_right_are_common():
    """The head-mapping bug needs Hkv > 1 and Hq / Hkv > 1; the alignment bug needs
    bottom-right structure with Nq != Nk. Each must be drawn often enough that a 200-example
    campaign meets it many times (expected shares: 2/3 * 1/2 * P(group >= 2) ~ 30% and
    3/4 * 2/3 * 3/4 ~ 38%). Hypothesis's draws are not independent (it mutates earlier
    examples), and even derandomized they depend on the process's state: the shares measured
    0.21-0.34 and 0.13-0.30 over 300-600 draws depending on which modules a test session had
    imported. So 600 draws, and a floor of 10% each: 20 per 200-example campaign."""
    drawn = _draws(600)
    gqa = [c for c in drawn if c.Hkv > 1 and c.Hq // c.Hkv > 1]
    br = [c for c in drawn if c.causal_alignment == "bottom_right" and c.Nq != c.Nk
          and (c.is_causal or c.window is not None)]
    assert len(gqa) >= 0.10 * len(drawn), len(gqa)
    assert {(c.Hkv, c.Hq // c.Hkv) for c in gqa} >= {(2, 2), (3, 2), (2, 3)}
    assert len(br) >= 0.10 * len(drawn), len(br)


# -- fixed sweeps ---------------------------------------------------------------------------

def _coverage(sweep) -> dict[str, set]:
    cov: dict[str, set] = {"feature": set(), "dist": set(), "grad_dist": set(), "dtype": set(),
                           "layout": set(), "D": set(), "N": set(), "causal": set(),
                           "mask": set(), "gqa": set(), "dtype×dist": set()}
    for c in sweep:
        key = c.config_key()
        cov["feature"] |= features_of(c)
        cov["dist"].add(c.dist["kind"])
        cov["grad_dist"].add(c.grad_dist["kind"])
        cov["dtype"].add(c.dtype)
        cov["layout"].add(c.layout)
        for k in ("D", "N", "causal", "mask", "gqa"):
            cov[k].add(key[k])
        cov["dtype×dist"].add((c.dtype, c.dist["kind"]))
    return cov


def test_cpu_sweep_covers_everything():
    sweep = fixed_sweep("cpu")
    assert 40 <= len(sweep) <= 80
    cov = _coverage(sweep)
    assert cov["feature"] == ALL_FEATURES
    assert cov["dist"] == set(DIST_KINDS) and cov["grad_dist"] == set(GRAD_DIST_KINDS)
    assert cov["dtype"] == set(DTYPES) and cov["layout"] == set(LAYOUTS)
    assert cov["dtype×dist"] == {(t, d) for t in DTYPES for d in DIST_KINDS}
    assert cov["D"] == {d_bucket(x) for x in (1, 33, 65, 129)}
    assert cov["N"] >= {"1-16", "17-128", "129-1024"}
    assert cov["causal"] >= {"none", "top_left", "bottom_right", "window"}
    assert cov["mask"] == {"none", "key_padding", "random", "block_sparse", "bias",
                           "dead_rows"}
    assert cov["gqa"] == {"mha", "gqa", "mqa"}
    assert any(c.Nq == 1 for c in sweep) and any(c.D % 2 for c in sweep)
    assert {c.dist["groups"] for c in sweep if c.dist["kind"] == "ties"} == {1, 4}
    assert any(c.mask["kind"] == "key_padding" and 0 in c.mask["lengths"] for c in sweep)
    assert max(max(c.Nq, c.Nk) for c in sweep) <= 256  # interpreter-sized


def test_cpu_sweep_materializes_finite():
    for case in fixed_sweep("cpu"):
        inp = case.materialize()
        for t in (inp.query, inp.key, inp.value, inp.grad_out):
            assert torch.isfinite(t).all(), case.short()


def test_gpu_sweep_is_larger_and_covers_everything():
    sweep = fixed_sweep("gpu")
    assert 250 <= len(sweep) <= 350
    cov = _coverage(sweep)
    assert cov["feature"] == ALL_FEATURES | {"tf32"}
    assert cov["dist"] == set(DIST_KINDS) and cov["dtype"] == set(DTYPES)
    assert cov["N"] == {n_bucket(x) for x in (1, 17, 129, 1025)}
    assert cov["D"] == {d_bucket(x) for x in (1, 33, 65, 129)}
    assert max(max(c.Nq, c.Nk) for c in sweep) == 2048
    assert max(c.D for c in sweep) == 256


def test_sweeps_are_deterministic_and_distinct():
    for profile in ("cpu", "gpu"):
        a, b = fixed_sweep(profile), fixed_sweep(profile)
        assert [c.to_json() for c in a] == [c.to_json() for c in b]
        assert len({c.to_json() for c in a}) == len(a)


def test_fixed_sweep_rejects_unknown_profile():
    with pytest.raises(ValueError, match="profile"):
        fixed_sweep("tpu")


# -- declared domains (verify.capabilities) -------------------------------------------------

DOMAINS = {
    "multiple-and-set": {"seq_multiple": 16, "head_dims": {16, 32, 64}},
    "per-causality": {"seq_multiple": {"causal": 32, "noncausal": 8}, "max_seqlen": 96,
                      "layouts": ("bnhd", "strided")},
    "same-seqlen": {"same_seqlen": True, "head_dims": [8, 24], "backward": "causal_only"},
    "backward-per-dtype": {"backward": {"float16": True, "float32": False},
                           "seq_multiple": 3},
}


@pytest.mark.parametrize("caps", DOMAINS.values(), ids=DOMAINS.keys())
@given(data=st.data())
def test_strategy_draws_inside_the_declared_domain(caps, data):
    """By construction: the profile's health checks would flag a strategy that filters."""
    case = data.draw(cases(dtypes=tuple(DTYPES), max_n=128, capabilities=caps))
    norm = check_capabilities(caps)
    assert domain_reason(norm, case) is None, case.short()
    assert case.backward == (backward_declared(norm, case.dtype, case.is_causal) is not False)


def test_declared_domain_shrinks_to_its_smallest_case_and_reaches_its_largest():
    strat = cases(max_n=128, capabilities=DOMAINS["multiple-and-set"])
    small = find(strat, lambda c: True, settings=FIND)
    assert (small.Nq, small.Nk, small.D) == (16, 16, 16)
    big = find(strat, lambda c: c.Nq == 128 and c.D == 64 and c.Nk != c.Nq, settings=FIND)
    assert big.Nk % 16 == 0
    causal = find(cases(max_n=96, capabilities=DOMAINS["per-causality"]),
                  lambda c: c.is_causal, settings=FIND)
    assert (causal.Nq, causal.layout) == (32, "bnhd")


@pytest.mark.parametrize("caps, key", [
    ({"seq_multiple": 0}, "seq_multiple"),
    ({"seq_multiple": 2.0}, "seq_multiple"),
    ({"seq_multiple": {"causal": 16}}, "seq_multiple"),
    ({"head_dims": []}, "head_dims"),
    ({"head_dims": (16, 32, 64)}, "head_dims"),
    ({"head_dims": {0, 16}}, "head_dims"),
    ({"head_dims": (64, 16)}, "head_dims"),
    ({"same_seqlen": "yes"}, "same_seqlen"),
    ({"max_seqlen": 0}, "max_seqlen"),
    ({"max_seqlen": 64, "seq_multiple": 128}, "max_seqlen"),
    ({"layouts": ("bhnd",)}, "layouts"),
    ({"layouts": ()}, "layouts"),
    ({"backward": "sometimes"}, "backward"),
    ({"backward": {"float64": True}}, "backward"),
    ({"supports": "odd"}, "supports"),
    ({"seq_mutliple": 16}, "seq_mutliple"),
    ({"family": ("fp32_fma_chains",)}, "family"),
    ({"family": "split_kv"}, "family"),
])
def test_bad_capabilities_name_the_key_and_its_form(caps, key):
    with pytest.raises(ValueError, match=key) as info:
        cases(capabilities=caps)
    assert "must be" in str(info.value) or "allowed" in str(info.value) or "below" in str(
        info.value)


def test_max_n_below_the_declared_multiple_is_a_bad_bound():
    with pytest.raises(ValueError, match="max_n = 64 .*seq_multiple"):
        cases(max_n=64, capabilities={"seq_multiple": 128})
    with pytest.raises(ValueError, match="layouts"):
        cases(layouts=("contiguous",), capabilities={"layouts": ("strided",)})
    with pytest.raises(ValueError, match="head_dims"):
        cases(head_dims=[8], capabilities={"head_dims": {16, 32}})


def test_reuse_draws_mostly_compiled_keys_and_still_reaches_new_ones():
    """cases(reuse=pool): 3 draws in 4 take a pool case's compile key (shapes, dtype, flags,
    mask kind) with new batch, window offsets, mask values and inputs; the rest draw freely."""
    from hypothesis import HealthCheck
    from hypothesis import seed as hseed

    pool = [Case(B=1, Hq=2, Hkv=1, Nq=37, Nk=19, D=24, dtype="float32", is_causal=True,
                 causal_alignment="bottom_right",
                 mask={"kind": "key_padding", "shape": "bk", "lengths": [19]}, seed=1),
            Case(B=2, Hq=1, Hkv=1, Nq=8, Nk=8, D=40, dtype="float16", window=(3, 2), seed=2)]
    keys = {compile_key(c) for c in pool}
    seen = []

    @hseed(11)
    @settings(database=None, max_examples=200, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(cases(max_n=64, reuse=pool))
    def draw(case):
        case.validate()
        seen.append(case)

    draw()
    reused = [c for c in seen if compile_key(c) in keys]
    # 3 in 4 asked; Hypothesis draws index 0 (free) more often than 1 in 4 at times
    assert 0.5 * len(seen) <= len(reused) < len(seen)
    assert len({(c.seed, c.B, c.dist["kind"]) for c in reused}) > 20  # values vary
    assert all(c.window is not None for c in reused if c.D == 40)
    assert not cases(max_n=64, reuse=()).is_empty

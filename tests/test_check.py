"""verify.check: verdicts, anti-cheat failure classes, NaN propagation, serialisation."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from flashcheck.verify.cases import Case
from flashcheck.verify.check import (
    TensorReport,
    Verdict,
    check_case,
    check_nan_propagation,
    error_ratio,
)

from tests.fixtures_kernels import amplified, blocked_attention

CASE = Case(B=1, Hq=2, Hkv=2, Nq=16, Nk=24, D=16, dtype="float16", is_causal=True, seed=5)
SAME_SHAPE_OTHER_SEED = Case(B=1, Hq=2, Hkv=2, Nq=16, Nk=24, D=16, dtype="float16",
                             is_causal=True, seed=6)


def _wrap(post):
    """A kernel that runs the correct blocked kernel, then ``post(out, q, k, v)``."""
    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                  scale=None, enable_gqa=False):
        out = blocked_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                enable_gqa)
        return post(out, query, key, value)
    return attention


def _mutates(out, q, k, v):
    with torch.no_grad():
        k[0, 0, 0, 0] = 0.5 if float(k[0, 0, 0, 0]) != 0.5 else 0.25
    return out


_calls = {"n": 0}


def _flips_a_bit(out, q, k, v):
    _calls["n"] += 1
    bump = torch.zeros_like(out)
    if _calls["n"] % 2:
        bump.view(-1)[0] = torch.finfo(out.dtype).eps * out.detach().reshape(-1)[0].abs()
    return out + bump


def _raises(out, q, k, v):
    raise IndexError("tile index 3 out of range")


def _wrong_dtype(out, q, k, v):
    return out.float()


def _nan_row(out, q, k, v):
    out = out.clone()
    with torch.no_grad():
        out[0, 0, 3] = math.nan
    return out


_cache: dict = {}


def _caches_by_shape(out, q, k, v):
    return _cache.setdefault(tuple(q.shape), out.detach().clone())


@pytest.mark.parametrize(
    "post, failure, reason_part",
    [
        (_mutates, "input_mutated", "key"),
        (lambda out, q, k, v: q, "aliased_output", "query"),
        (_flips_a_bit, "nondeterministic", "different bits"),
        (_raises, "raised", "IndexError: tile index 3 out of range (test_check.py:"),
        (_wrong_dtype, "bad_output", "dtype torch.float32"),
        (_nan_row, "nonfinite", "out"),
    ],
    ids=["mutates", "aliases", "nondeterministic", "raises", "wrong_dtype", "nan_row"],
)
def test_anti_cheat_failure_classes(post, failure, reason_part):
    v = check_case(_wrap(post), CASE, "cpu")
    assert (v.status, v.failure) == ("fail", failure), v.summary()
    assert reason_part in v.reason


def test_shape_cache_replay_is_caught_by_fresh_seeds():
    _cache.clear()
    kernel = _wrap(_caches_by_shape)
    fwd = dict(backward=False)  # the cached tensor carries no graph
    assert check_case(kernel, dataclasses.replace(CASE, **fwd), "cpu").status == "pass"
    v = check_case(kernel, dataclasses.replace(SAME_SHAPE_OTHER_SEED, **fwd), "cpu")
    assert v.failure == "numerical" and "out:" in v.summary()


def test_torch_empty_kernel_reads_poison_not_the_reference():
    def empty(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
        return torch.empty_like(query)

    assert check_case(empty, CASE, "cpu").status == "fail"


@pytest.mark.parametrize("case", [
    CASE,
    Case(B=2, Hq=4, Hkv=2, Nq=9, Nk=33, D=40, dtype="bfloat16", seed=7),
    Case(B=1, Hq=2, Hkv=2, Nq=20, Nk=20, D=64, dtype="float32",
         mask={"kind": "key_padding", "lengths": [7]}, seed=8),
    Case(B=1, Hq=2, Hkv=1, Nq=12, Nk=30, D=16, dtype="float16", window=(5, 5),
         causal_alignment="bottom_right", layout="strided", seed=9),
], ids=lambda c: c.short())
def test_sdpa_math_passes(case):
    v = check_case("sdpa-math", case, "cpu")
    assert v.status == "pass", v.summary()
    assert set(v.tensors) == {"out", "dq", "dk", "dv"}
    assert {"reference", "baseline", "kernel_fwd", "kernel_bwd", "total"} <= set(v.timings)


def test_kernel_without_backward_reports_gradients_not_run():
    def fwd_only(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                 scale=None, enable_gqa=False):
        with torch.no_grad():
            return blocked_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                     enable_gqa)

    v = check_case(fwd_only, CASE, "cpu")
    assert v.status == "pass" and set(v.tensors) == {"out"}
    assert set(v.not_run_tensors) == {"dq", "dk", "dv"}
    assert "kernel has no backward" in v.not_run_tensors["dq"]


def test_outside_domain_is_not_run_with_reason():
    def fp16_only(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                  scale=None, enable_gqa=False):
        return blocked_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                 enable_gqa)

    fp16_only.capabilities = {"dtypes": ("float16",)}
    v = check_case(fp16_only, Case(B=1, Hq=1, Hkv=1, Nq=4, Nk=4, D=8, dtype="float32"), "cpu")
    assert v.status == "not_run" and "float32" in v.reason


def test_verdict_round_trip_summary_and_ratio():
    v = check_case(_wrap(lambda out, q, k, v: out * 1.01), CASE, "cpu")
    assert v.failure == "numerical" and error_ratio(v) > 1
    v.case_file = "failures/ab12cd.json"
    s = v.summary()
    assert s.startswith("out: ") and "elements off (worst at [" in s and "got " in s
    assert "want " in s and "> tol" in s and s.endswith("replay: flashcheck repro "
                                                         "failures/ab12cd.json")
    d = json.loads(json.dumps(v.to_dict(), allow_nan=False))
    back = Verdict.from_dict(d)
    assert back.case == v.case and back.failure == v.failure
    assert back.tensors["out"].worst_index == v.tensors["out"].worst_index
    assert error_ratio(back) == pytest.approx(error_ratio(v))


@pytest.mark.parametrize("target, index", [("key", (0, 1, 5, 3)), ("query", (0, 0, 7, 0))])
def test_nan_propagation_reaches_exactly_the_affected_rows(target, index):
    obs = check_nan_propagation(blocked_attention, CASE, "cpu", target=target, index=index)
    assert obs["kind"] == "nan_propagation" and obs["match"], obs
    if target == "key":  # causal: rows i >= 5 of head 1 see key 5
        assert obs["expected_rows"] == [[0, 1, i] for i in range(5, 16)]
    else:
        assert obs["expected_rows"] == [[0, 0, 7]]


def test_result_beyond_the_dtype_range_may_round_to_inf():
    # dq of this fp16 case exceeds 65504 in places: the correctly rounded answer is +-inf.
    case = Case(B=2, Hq=2, Hkv=2, Nq=59, Nk=59, D=6, dtype="float16",
                dist={"kind": "normal", "sigma": 30.0}, grad_dist={"kind": "normal",
                                                                    "sigma": 100.0}, seed=1)
    v = check_case("reference", case, "cpu")
    assert v.status == "pass", v.summary()


def test_inf_within_the_tolerance_of_the_overflow_threshold_is_the_rounding():
    """An exact fp16 value of 65512.3 with a tolerance of 432: values from 65520 up round to
    inf, so a kernel's inf of that sign is a correct rounding (sdpa-efficient's dk on the
    H200); the opposite sign, or an exact value farther than its tolerance from 65520, is a
    non-finite failure."""
    from flashcheck.verify.check import _report
    want = torch.tensor([65512.3, 65512.3, 60000.0], dtype=torch.float64)
    tol = torch.tensor([432.0, 432.0, 432.0], dtype=torch.float64)

    def rep(got):
        return _report("dk", torch.tensor(got, dtype=torch.float16), want, tol, tol * 10,
                       None, math.inf, "float16")

    ok = rep([math.inf, 65504.0, 60000.0])
    assert ok.passed and ok.note == "", ok
    for got in ([-math.inf, 65504.0, 60000.0], [65504.0, 65504.0, math.inf]):
        r = rep(got)
        assert not r.passed and "NaN/Inf" in r.note, (got, r)


def test_captured_tensors_reach_the_kernel_not_a_draw(tmp_path):
    """A TensorCase describes its tensors with a Case (whose seed draws other inputs); the
    check, and the sweep's prefetched draws, must run the kernel on the captured tensors."""
    from flashcheck.verify.cases import TensorCase, save_tensors
    from flashcheck.verify.sweep import Prefetch

    described = Case(B=1, Hq=2, Hkv=2, Nq=5, Nk=7, D=8, dtype="float32", seed=1)
    captured = dataclasses.replace(described, seed=99).materialize()
    save_tensors(tmp_path / "cap.pt", captured)
    tc = TensorCase.from_file(tmp_path / "cap.pt", case=described)
    seen = []

    def kernel(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
        if q.shape == captured.query.shape:  # not the capability probes' tiny calls
            seen.append(q.detach().clone())
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)

    assert check_case(kernel, tc, "cpu").status == "pass"
    assert len(seen) == 2 and all(torch.equal(q, captured.query) for q in seen)
    drawing = Prefetch([tc, described])
    try:
        assert drawing.take(0) is None  # loaded by check_case, never drawn
        assert torch.equal(drawing.take(1)["query"], described.draw()["query"])
    finally:
        drawing.close()


DEAD = Case(B=1, Hq=2, Hkv=2, Nq=12, Nk=16, D=8, dtype="float16",
            mask={"kind": "dead_rows", "rows": 0.25}, seed=3)


def test_non_zero_output_on_fully_masked_rows_is_its_own_class():
    """The contract (0 on a query row with no allowed key) is checked by itself, so such a
    kernel reads 'masked_rows', not a numerical failure at some ratio."""
    def mean_of_v(out, q, k, v):  # what a kernel without the l == 0 guard can return
        dead = out.detach().abs().amax(-1) == 0
        return torch.where(dead[..., None], v.mean(dim=2, keepdim=True).expand_as(out), out)

    assert check_case(_wrap(lambda out, q, k, v: out), DEAD, "cpu").status == "pass"
    v = check_case(_wrap(mean_of_v), DEAD, "cpu")
    assert (v.status, v.failure) == ("fail", "masked_rows"), v.summary()
    assert "output non-zero on 6 of 6 fully-masked query rows" in v.reason


TINY_OUT = Case(B=1, Hq=1, Hkv=1, Nq=8, Nk=8, D=8, dtype="float16",
                dist={"kind": "normal", "sigma": 2e-6}, backward=False, seed=4)


def test_flushed_subnormals_are_an_observation_unless_strict():
    def flush(out, q, k, v):
        return torch.where(out.abs() < 2.0**-14, torch.zeros_like(out), out)

    v = check_case(_wrap(flush), TINY_OUT, "cpu")
    assert v.observations.get("subnormals_flushed", {}).get("out", 0) > 0, v.summary()
    strict = check_case(_wrap(flush), TINY_OUT, "cpu", strict_subnormals=True)
    assert (strict.status, strict.failure) == ("fail", "subnormals_flushed")
    assert "out" in strict.reason


@pytest.mark.parametrize("spec", [
    "verify/controls/gqa_per_head_rounded.py:attention",
    "verify/controls/flush_to_zero.py:attention",
    "verify/mutants/p_bf16_for_fp16.py:attention",
    "verify/mutants/lse_input_dtype.py:attention",
])
@pytest.mark.parametrize("case", [
    Case(B=1, Hq=4, Hkv=2, Nq=40, Nk=40, D=16, dtype="float16", seed=21),
    Case(B=1, Hq=2, Hkv=1, Nq=24, Nk=24, D=8, dtype="float16",
         grad_dist={"kind": "tiny", "factor": 1.0}, seed=22),
], ids=lambda c: c.short())
def test_lazy_family_gives_the_full_familys_verdict(spec, case):
    """The lazy path runs the other members only when the baseline member fails the kernel;
    the verdict is the one the full family gives, and a failure names the same member."""
    lazy, full = (check_case(spec, case, "cpu", family=f) for f in ("lazy", "full"))
    assert (lazy.status, lazy.failure) == (full.status, full.failure), (lazy.summary(),
                                                                        full.summary())
    if lazy.status == "fail":
        assert {n: t.member for n, t in lazy.tensors.items()} == \
            {n: t.member for n, t in full.tensors.items()}


# Found by the controls' 2,000-example campaigns (flashcheck mutants --controls-only).
OVERFLOW_BY_MEMBER = Case(B=1, Hq=2, Hkv=1, Nq=52, Nk=21, D=96, dtype="float16",
                          mask={"kind": "bias", "shape": "bhqk", "neginf_prob": 0.0,
                                "neginf_first_tile": False, "tile": 16},
                          dist={"kind": "normal", "sigma": 30.0},
                          grad_dist={"kind": "normal", "sigma": 100.0}, seed=215224)


def test_inf_where_a_family_member_overflows_is_accepted():
    """dq[0, 1, 50, 77] is exactly 65505.1 (rounds to 65504 in fp16), but P and dS kept in
    fp32 give a value past fp16's overflow threshold (65520): inf. A kernel making that
    choice passes; the baseline member's overflow no longer makes dk's tolerance inf; an
    inf elsewhere is still a non-finite failure."""
    ctl = "verify/controls/fp32_throughout.py:attention"
    v = check_case(ctl, OVERFLOW_BY_MEMBER, "cpu")
    assert v.status == "pass", v.summary()
    assert all(math.isfinite(t.tol) for t in v.tensors.values())

    bad = check_case(_wrap(lambda out, q, k, v_: torch.where(
        (torch.arange(out.shape[-1]) == 3), torch.full_like(out, math.inf), out)),
        OVERFLOW_BY_MEMBER, "cpu")
    assert (bad.status, bad.failure) == ("fail", "nonfinite"), bad.summary()


# The controls campaign at seed 109821589: the exact dq[0, 1, 6, 6] is 75715, past fp16's
# range; every member but q_prescaled overflows to inf, q_prescaled (the control's choice)
# gives 63392.
OVERFLOW_FINITE = Case(B=1, Hq=2, Hkv=1, Nq=24, Nk=24, D=48, dtype="float16", is_causal=True,
                       dist={"kind": "normal", "sigma": 30.0},
                       grad_dist={"kind": "normal", "sigma": 100.0}, seed=652217)


def test_finite_where_the_exact_value_overflows_is_judged_by_the_tolerance():
    """A finite value where the exact one rounds to inf is compared with the exact value
    (a correct kernel's error can keep it in range); 4x that kernel's error there fails."""
    from flashcheck.verify.controls.q_prescaled import attention as q_prescaled

    v = check_case(q_prescaled, OVERFLOW_FINITE, "cpu")
    assert v.status == "pass", v.summary()
    worse = amplified(q_prescaled, 4.0)
    worse.capabilities = dict(q_prescaled.capabilities)  # judged with its own member
    bad = check_case(worse, OVERFLOW_FINITE, "cpu")
    assert (bad.status, bad.failure) == ("fail", "numerical"), bad.summary()
    assert not bad.tensors["dq"].passed


# A member finite where others overflow: fp16 dq[0, 0, 1, 6] exact -115843 (past fp16's
# range); the default members give -inf, q_prescaled (the control's choice) -62752. Found
# by searching normal(50) inputs with normal(300) dO for elements where the members split;
# the controls campaign at seed 216099322 met one like it (q_prescaled's dq at 1.96x).
MEMBERS_SPLIT = Case(B=1, Hq=1, Hkv=1, Nq=16, Nk=16, D=8, dtype="float16",
                     dist={"kind": "normal", "sigma": 50.0},
                     grad_dist={"kind": "normal", "sigma": 300.0}, seed=587976)


class _Bump(torch.autograd.Function):
    """Identity on q; adds ``delta`` to dq at ``idx``."""

    @staticmethod
    def forward(ctx, q, idx, delta):
        ctx.idx, ctx.delta = idx, delta
        return q.view_as(q)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        g[ctx.idx] += ctx.delta
        return g, None, None


def test_a_members_finite_result_counts_where_another_member_overflows():
    """Where one member overflows and another does not, the finite member's error is that
    element's allowance (K x it, ``tol_source`` "spread"), not part of the tensor-wide
    worst: a kernel making the finite member's choice passes; 4x its error fails; and an
    error elsewhere in dq is judged as before (a bump of 5000 on an element where every
    member is finite and the tolerance is its floor, 1754, fails; a tensor-wide allowance of
    K x 53,000 would have excused it)."""
    from flashcheck.verify.controls.q_prescaled import attention as q_prescaled

    v = check_case(q_prescaled, MEMBERS_SPLIT, "cpu")
    assert v.status == "pass", v.summary()
    dq = v.tensors["dq"]
    assert dq.tol_source == "spread" and dq.worst_index == (0, 0, 1, 6), dq
    assert dq.got == -62752 and round(dq.want) == -115843, dq
    worse = amplified(q_prescaled, 4.0)
    worse.capabilities = dict(q_prescaled.capabilities)
    bad = check_case(worse, MEMBERS_SPLIT, "cpu")  # its dq there: inf (4x past the range)
    assert bad.status == "fail" and not bad.tensors["dq"].passed, bad.summary()

    def bumped(query, key, value, *a, **kw):
        return q_prescaled(_Bump.apply(query, (0, 0, 3, 2), 5000.0), key, value, *a, **kw)

    bumped.capabilities = dict(q_prescaled.capabilities)
    off = check_case(bumped, MEMBERS_SPLIT, "cpu")
    assert (off.status, off.failure) == ("fail", "numerical"), off.summary()
    assert off.tensors["dq"].worst_index == (0, 0, 3, 2), off.tensors["dq"]
    assert off.tensors["dq"].tol_source == "floor"
    # Without the family (baseline=False: the a-priori bounds alone) every tensor is still
    # judged, and no member is named.
    alone = check_case(q_prescaled, MEMBERS_SPLIT, "cpu", baseline=False)
    assert set(alone.tensors) == {"out", "dq", "dk", "dv"}
    assert all(t.member == "" and t.tol_source == "" for t in alone.tensors.values())


FUSED_EXP_BIAS = Case(B=1, Hq=2, Hkv=2, Nq=16, Nk=16, D=96, dtype="float16", window=(0, 0),
                      mask={"kind": "bias", "shape": "bqk", "neginf_prob": 0.0,
                            "neginf_first_tile": False, "tile": 16}, scale=2.0,
                      dist={"kind": "normal", "sigma": 30.0}, seed=83137)


def test_fused_exponent_with_an_additive_bias_is_a_member():
    """One key per row (window (0, 0)) under an additive bias at logits ~2.5e4: the
    fa2_cuda_softmax control's P of that key is 2^(a rounding), 1 ± 2^-10, rounded to fp16
    for P@V while l keeps it, so D_i and dS carry it: dq 4.0 where the exact value is 0. The
    member dropped the fused exponent under a bias (P = 1, dq error 0.03) and the control
    failed at 1.43x (controls campaign, seed 170554465); the member keeps it now, and 4x
    the control's error still fails."""
    from flashcheck.verify.controls.fa2_cuda_softmax import attention as fused

    v = check_case(fused, FUSED_EXP_BIAS, "cpu", family="full")
    assert v.status == "pass", v.summary()
    assert v.tensors["dq"].member == "fa2_cuda_softmax"
    bad = check_case(amplified(fused, 4.0), FUSED_EXP_BIAS, "cpu")
    assert (bad.status, bad.failure) == ("fail", "numerical"), bad.summary()


FLUSH_AT_THRESHOLD = Case(B=1, Hq=1, Hkv=1, Nq=41, Nk=41, D=44, dtype="float16",
                          dist={"kind": "normal", "sigma": 0.1}, seed=4)


def test_zero_within_tolerance_of_the_subnormal_range_is_a_flush_unless_strict():
    """dq[0, 0, 23, 6] is exactly 6.096e-05, just below fp16's smallest normal (6.1035e-05);
    the baseline rounds it up to that normal, the flush-to-zero control returns 0. A 0 where
    the exact value is within the tolerance of the subnormal range is an accepted flush; with
    --strict-subnormals it fails."""
    ctl = "verify/controls/flush_to_zero.py:attention"
    v = check_case(ctl, FLUSH_AT_THRESHOLD, "cpu")
    assert v.status == "pass", v.summary()
    strict = check_case(ctl, FLUSH_AT_THRESHOLD, "cpu", strict_subnormals=True)
    assert strict.status == "fail" and strict.tensors["dq"].worst_index == (0, 0, 23, 6)


# The self-test's seed-0 CI run: the flush-to-zero control, then flushing fp16 subnormal
# inputs too, was 2.95x on dq (dO = normal(0.001): 4.5% of dO below 6.1e-5, each flushed
# one an input changed, not an arithmetic; the family member flushed them too but its
# per-element errors land elsewhere).
FTZ_SMALL_DO = Case(B=1, Hq=3, Hkv=3, Nq=26, Nk=26, D=128, dtype="float16", scale=0.5,
                    dist={"kind": "outliers", "p": 0.001, "outlier_sigma": 10.0},
                    grad_dist={"kind": "normal", "sigma": 0.001}, seed=3)


# Found by a 1,500-example campaign of the control: its dq 12x the ftz member's error at the
# element (dS_ij under fp16's 6.1e-5 differ between the two realisations), within K of the
# member's row maximum.
FTZ_ROWS = (
    Case(B=1, Hq=2, Hkv=2, Nq=58, Nk=58, D=55, dtype="float16",
         grad_dist={"kind": "normal", "sigma": 0.001}, seed=0),
    Case(B=1, Hq=1, Hkv=1, Nq=20, Nk=61, D=59, dtype="float16",
         mask={"kind": "key_padding", "shape": "bhqk", "lengths": [24]}, scale=0.01,
         dist={"kind": "uniform", "a": 4.0}, grad_dist={"kind": "normal", "sigma": 0.001},
         seed=40200),
)


# bf16 dO = tiny, scale 3.6: every dS_ij of key 23 below bf16's smallest normal, flushed; dk
# 0 where the exact value is 1.4e-37 (ftz_allowance's operand term).
FTZ_OPERAND = Case(B=1, Hq=1, Hkv=1, Nq=31, Nk=31, D=9, dtype="bfloat16", is_causal=True,
                   scale=3.625, dist={"kind": "constant_rows"},
                   grad_dist={"kind": "tiny", "factor": 1.0}, seed=2146)


@pytest.mark.parametrize("case", (FTZ_SMALL_DO, *FTZ_ROWS, FTZ_OPERAND), ids=lambda c: c.short())
def test_flush_to_zero_control_with_small_fp16_gradients_passes(case):
    v = check_case("verify/controls/flush_to_zero.py:attention", case, "cpu")
    assert v.status == "pass", v.summary()


# bf16 dO = tiny: D_i's subnormal products flushed, dP's kept (verify/controls/ftz_delta.py).
# Under the allowance without the intermediate sums' term, seed 61 reached dq 0.98x and an
# H200 campaign's SDPA-per-sequence varlen kernel dq 1.2x (-4.5e-38 where -6.3e-39 is exact).
@pytest.mark.parametrize("seed", (61, 63))
def test_flush_in_one_of_the_backward_sums_is_allowed_unless_strict(seed):
    case = Case(B=1, Hq=1, Hkv=1, Nq=2, Nk=2, D=40, dtype="bfloat16",
                grad_dist={"kind": "tiny", "factor": 1.0}, seed=seed)
    spec = "verify/controls/ftz_delta.py:attention"
    v = check_case(spec, case, "cpu")
    assert v.status == "pass", v.summary()
    strict = check_case(spec, case, "cpu", strict_subnormals=True)
    assert strict.status == "fail" and not strict.tensors["dq"].passed, strict.summary()


def test_flush_allowance_does_not_excuse_a_wrong_kernel_on_flushed_rows():
    """Flushed rows leave the RMSE rule, so there the elementwise rule alone separates: K x
    the member's row maximum. A kernel with 4x the control's error (4x a correct flushing
    kernel's) fails on dq."""
    from flashcheck.verify.controls.flush_to_zero import attention as ftz

    for case in FTZ_ROWS:
        bad = check_case(amplified(ftz, 4.0), case, "cpu")
        assert (bad.status, bad.failure) == ("fail", "numerical"), bad.summary()
        assert not bad.tensors["dq"].passed


def test_a_members_nan_does_not_disable_the_tensors_tolerance(monkeypatch):
    """A member that overflows into NaN at one element (fp16 intermediate overflow) leaves
    that element out of the family statistics; the tolerance of the tensor stays finite, so
    an error elsewhere is still caught."""
    import flashcheck.reference.family as fam

    real = fam.run_family

    def nan_member(*a, **kw):
        res = real(*a, **kw)
        res["fa2_128"]["dk"].view(-1)[0] = math.nan
        return res

    monkeypatch.setattr(fam, "run_family", nan_member)
    case = Case(B=1, Hq=1, Hkv=1, Nq=16, Nk=16, D=8, dtype="float16", seed=7)
    v = check_case("reference", case, "cpu")
    assert v.status == "pass" and math.isfinite(v.tensors["dk"].tol), v.summary()


def test_message_names_what_set_the_tolerance():
    """The failure line names what set the tolerance at the worst element: K x the family's
    worst member, or the floor where every member is near exact (there "= 3 x member" would
    misstate the rule)."""
    spec = "verify/mutants/ds_bf16_for_dk.py:attention"
    tiny = check_case(spec, Case(B=1, Hq=1, Hkv=1, Nq=3, Nk=3, D=1, dtype="float16", seed=0),
                      "cpu")
    dk = tiny.tensors["dk"]
    assert not dk.passed and dk.tol_source == "floor", tiny.summary()
    assert "= floor; 3 × family member" in dk.message()
    big = check_case(spec, Case(B=1, Hq=2, Hkv=2, Nq=64, Nk=64, D=32, dtype="float16", seed=2),
                     "cpu")
    dk = big.tensors["dk"]
    assert not dk.passed and dk.tol_source == "family", big.summary()
    assert f"= 3 × family member {dk.member}" in dk.message()
    assert TensorReport.from_dict(dk.to_dict()).tol_source == "family"


def test_output_with_strides_on_size_one_dims_is_compared_bitwise():
    """A kernel's output whose size-1 dims carry any strides (a transposed (B, N, H, D) buffer,
    here stride 2 in the last dim) counts as contiguous; the forward-repeat comparison still
    works on it (it raised inside the harness: "stride(-1) must be 1 to view Half as Byte")."""

    def strided_out(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
        buf = torch.zeros(*o.shape[:-1], 2 * o.shape[-1], dtype=o.dtype)
        buf[..., ::2] = o.detach()
        return buf[..., ::2]  # stride 2 in the last dim (forward only)

    case = Case(B=1, Hq=1, Hkv=1, Nq=1, Nk=1, D=1, dtype="float16", backward=False, seed=0)
    v = check_case(strided_out, case, "cpu")
    assert v.status == "pass", v.summary()


# -- where the judging runs (oracle_device) ------------------------------------------------

def test_small_cases_of_a_gpu_kernel_are_judged_on_the_cpu(monkeypatch):
    from flashcheck.verify.cases import TensorCase
    from flashcheck.verify.check import ORACLE_CPU_MAX_WORK, ORACLE_ENV, oracle_device

    monkeypatch.delenv(ORACLE_ENV, raising=False)
    small = Case(B=2, Hq=4, Hkv=4, Nq=64, Nk=64, D=64)  # 2**21 exactly: the largest on the CPU
    assert small.B * small.Hq * small.Nq * small.Nk * small.D == ORACLE_CPU_MAX_WORK
    big = dataclasses.replace(small, Nk=65)
    assert oracle_device(small, "cuda") == "cpu"
    assert oracle_device(big, "cuda") == "cuda"
    assert oracle_device(small, "cuda", "device") == "cuda"
    assert oracle_device(small, "cpu") == "cpu"
    captured = TensorCase(path="x.npz", case=small)  # captured tensors: judged where they run
    assert oracle_device(captured, "cuda") == "cuda"
    monkeypatch.setenv(ORACLE_ENV, "device")  # the CLI's --oracle-device, in every worker
    assert oracle_device(small, "cuda") == "cuda"
    monkeypatch.setenv(ORACLE_ENV, "gpu")
    with pytest.raises(ValueError, match=r"auto, device \(--oracle-device.*'gpu'"):
        oracle_device(small, "cuda")


def test_judging_apart_from_the_kernel_gives_the_same_verdict(monkeypatch):
    """The kernel gets its own placement of the same drawn tensors (layout included) when
    the judging runs elsewhere: "cpu:0" is a device string other than the kernel's "cpu",
    which takes that path without a GPU (on a GPU: tests/test_check.py's cuda test)."""
    import flashcheck.verify.check as C

    monkeypatch.setattr(C, "oracle_device", lambda case, device, oracle=None: "cpu:0")
    seen = []

    def spy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False):
        seen.append((tuple(query.shape), query.stride()))
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa)

    case = Case(B=1, Hq=2, Hkv=1, Nq=12, Nk=30, D=16, dtype="float16", layout="strided",
                seed=9)
    v = check_case(spy, case, "cpu")
    assert v.status == "pass", v.summary()
    laid = case.materialize("cpu").query
    assert (tuple(laid.shape), laid.stride()) in seen  # the case's strided layout reached it
    assert v.observations["judged_on"] == "cpu:0"
    wrong = check_case(amplified(blocked_attention, 4.0), CASE, "cpu")
    assert wrong.failure == "numerical", wrong.summary()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", [
    CASE,
    Case(B=2, Hq=4, Hkv=2, Nq=9, Nk=33, D=40, dtype="bfloat16", seed=7),
    Case(B=1, Hq=2, Hkv=1, Nq=12, Nk=30, D=16, dtype="float16", window=(5, 5),
         causal_alignment="bottom_right", layout="strided", seed=9),
], ids=lambda c: c.short())
def test_cpu_judged_gpu_cases_agree_with_gpu_judged_ones(case):
    auto = check_case("sdpa-math", case, "cuda", oracle="auto")
    dev = check_case("sdpa-math", case, "cuda", oracle="device")
    assert auto.status == dev.status == "pass", (auto.summary(), dev.summary())
    assert auto.observations["judged_on"] == "cpu" and "judged_on" not in dev.observations
    for n, t in dev.tensors.items():  # the same kernel output, two float64 references
        assert auto.tensors[n].max_abs == pytest.approx(t.max_abs, rel=1e-6, abs=1e-12), n
    wrong = check_case(amplified(blocked_attention, 4.0), CASE, "cuda", oracle="auto")
    assert wrong.failure == "numerical", wrong.summary()


# ------------------------------------------------------------------------------------------
# out of GPU memory: the check runs again after releasing the cache (check.OOM_PAUSES_S)


def _oom(what: str = "CUDA out of memory. Tried to allocate 384.00 MiB") -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(what)


@pytest.fixture
def no_pauses(monkeypatch):
    import flashcheck.verify.check as chk

    monkeypatch.setattr(chk, "OOM_PAUSES_S", (0.0, 0.0))
    return chk


def test_judging_out_of_memory_once_is_retried_and_recorded(no_pauses, monkeypatch):
    """A peer's case held the GPU while this one's float64 reference ran: the check runs
    again and passes, and the verdict says the first run was out of memory."""
    real, calls = no_pauses._reference, []

    def reference(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise _oom()
        return real(*a, **kw)

    monkeypatch.setattr(no_pauses, "_reference", reference)
    v = check_case("sdpa-math", CASE, "cpu")
    assert v.status == "pass", v.reason
    assert len(calls) == 2
    (note,) = v.observations["oom_retried"]
    assert note.startswith("OutOfMemoryError: CUDA out of memory. Tried to allocate 384.00 MiB")


def test_judging_out_of_memory_every_time_raises_after_the_last_run(no_pauses, monkeypatch):
    """Out of memory on every run: the judging's error propagates (a supervised worker
    keeps the case as a harness_error); one run per pause, then the last."""
    calls = []

    def reference(*a, **kw):
        calls.append(1)
        raise _oom()

    monkeypatch.setattr(no_pauses, "_reference", reference)
    with pytest.raises(torch.OutOfMemoryError):
        check_case("sdpa-math", CASE, "cpu")
    assert len(calls) == len(no_pauses.OOM_PAUSES_S) + 1


def _oom_kernel(fail_calls: int):
    """The correct blocked kernel, whose first ``fail_calls`` forward calls in a check run
    out of memory; ``attention.calls`` counts the check's calls (the domain probes of its
    first check, cached per kernel, run before it starts counting)."""
    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                  scale=None, enable_gqa=False):
        attention.calls += 1
        if attention.calls <= attention.fail_calls:
            raise _oom()
        return blocked_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                 enable_gqa)
    attention.calls, attention.fail_calls = 0, 0
    assert check_case(attention, CASE, "cpu").status == "pass"
    attention.calls, attention.fail_calls = 0, fail_calls
    return attention


def test_kernel_out_of_memory_once_is_retried(no_pauses):
    k = _oom_kernel(1)
    v = check_case(k, CASE, "cpu")
    assert v.status == "pass", v.reason
    assert k.calls == 3  # the run out of memory, then the two calls of the repeat check
    assert len(v.observations["oom_retried"]) == 1


def test_kernel_out_of_memory_on_every_run_is_its_raised_failure(no_pauses):
    """A kernel that needs more memory than the GPU has, run after run, is not excused:
    the last run's error is its ``raised`` failure, with the earlier runs recorded."""
    k = _oom_kernel(10**6)
    v = check_case(k, CASE, "cpu")
    assert (v.status, v.failure) == ("fail", "raised")
    assert "OutOfMemoryError: CUDA out of memory" in v.reason
    assert k.calls == len(no_pauses.OOM_PAUSES_S) + 1
    assert len(v.observations["oom_retried"]) == len(no_pauses.OOM_PAUSES_S)


def test_release_cache_returns_only_what_exceeds_keep(monkeypatch):
    import flashcheck.verify.check as chk

    assert chk.release_cache("cpu") is False
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev: 5 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev: 4 << 30)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    assert chk.release_cache("cuda:0") is False  # 1 GiB cached: kept
    assert chk.release_cache("cuda:0", keep=0) is True
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev: 1 << 30)
    assert chk.release_cache("cuda:0") is True
    assert emptied == [1, 1]

"""Tests of the implementation switches of ``reference.online_attention`` and of the family
built from them (reference/family.py).

- default switches are bit-identical to the code path they replaced (a frozen copy of the
  previous module, tests/data/online_before_family.py): output, lse and every gradient;
- each switch does what it says, checked against an independent computation on a tiny
  case: the GQA reductions, P kept in fp32, TF32 operands, subnormal flushing, the scale
  applied to Q or to dS (bit-identical to the default for a power-of-two scale, not
  otherwise), exp2 (rounding-level differences only, and exact in float64);
- ``run_family`` equals one ``online_attention`` call plus autograd per member, bit for
  bit, and every member stays within a few units of roundoff of the float64 oracle;
- ``family_members`` picks the members that apply; bad switches are rejected.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from flashcheck.reference._problems import make_problem
from flashcheck.reference.family import FAMILY, FAMILY_NOTES, family_members, run_family
from flashcheck.reference.online import round_exp_approx, round_tf32, truncate_tf32
from hypothesis import given
from hypothesis import strategies as st

from flashcheck import reference
from tests.script_modules import load
from tests.test_reference_online import _grads, problems

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
U = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}
blocks = st.integers(1, 16) | st.sampled_from([32, 64])


def _frozen():
    return load(Path(__file__).parent / "data" / "online_before_family.py")


OLD = _frozen()


def _cast(kw, dtype):
    return {n: (t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype.is_floating_point else t)
            for n, t in kw.items()}


def _run(kw, dout, **opts):
    """out, lse and [dq, dk, dv(, dmask)] of online_attention(**kw, **opts) on the CPU."""
    return _grads(lambda **a: reference.online_attention(**a, return_lse=True, **opts),
                  kw, dout, "cpu")


def _same(a, b):
    """Bit for bit (signed zeros and NaN payloads included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# ---------------------------------------------------------------- defaults unchanged


@given(
    kw=problems(max_n=24, max_d=8), dtype=st.sampled_from(list(DTYPES) + ["float64"]),
    block_m=blocks, block_n=blocks, order=st.sampled_from(["fa2", "fa1"]),
    precision=st.sampled_from(["emulate", "exact"]), seed=st.integers(0, 2**32 - 1),
)
def test_defaults_bit_identical_to_previous_code(kw, dtype, block_m, block_n, order,
                                                 precision, seed):
    dt = getattr(torch, dtype)
    kw = _cast(kw, dt)
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(kw["query"].shape, generator=g, dtype=torch.float64)
    opts = dict(block_m=block_m, block_n=block_n, order=order, precision=precision)
    old = _grads(lambda **a: OLD.online_attention(**a, return_lse=True, **opts),
                 kw, dout.to(torch.float64 if precision == "exact" else dt), "cpu")
    new = _run(kw, dout.to(torch.float64 if precision == "exact" else dt), **opts)
    assert _same(new[0], old[0]) and _same(new[1], old[1])
    assert len(new[2]) == len(old[2])
    for a, b in zip(new[2], old[2], strict=True):
        assert _same(a, b)


# ---------------------------------------------------------------- each switch


def _gqa_case(dtype, seed=3):
    kw = make_problem(B=1, Hq=6, Hkv=2, Nq=21, Nk=19, D=8, seed=seed, dtype=dtype)
    kw["scale"] = 0.3
    dout = torch.randn(kw["query"].shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64).to(dtype)
    return kw, dout


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gqa_reductions_match_independent_sums(dtype):
    dt = DTYPES[dtype]
    kw, dout = _gqa_case(dt)
    G = 3
    # Per query head: the same model on K/V expanded by hand (plain MHA), each head's dK/dV
    # rounded to the dtype by the model itself.
    mha = dict(kw, key=kw["key"].repeat_interleave(G, 1), value=kw["value"].repeat_interleave(G, 1),
               enable_gqa=False)
    _, _, (_, dk_h, dv_h) = _run(mha, dout, block_m=8, block_n=4)

    def fp32_sum(t):
        return t.float().reshape(1, 2, G, *t.shape[2:]).sum(2).to(dt)

    _, _, (_, dk, dv) = _run(kw, dout, block_m=8, block_n=4, gqa_reduce="per_head_rounded")
    assert torch.equal(dk, fp32_sum(dk_h)) and torch.equal(dv, fp32_sum(dv_h))
    # expand_autograd: exactly what autograd does through repeat_interleave.
    k, v = (kw[n].clone().requires_grad_(True) for n in ("key", "value"))
    out = reference.online_attention(kw["query"], k.repeat_interleave(G, 1),
                                     v.repeat_interleave(G, 1), scale=0.3, block_m=8, block_n=4)
    want = torch.autograd.grad(out, (k, v), dout)
    _, _, (_, dk, dv) = _run(kw, dout, block_m=8, block_n=4, gqa_reduce="expand_autograd")
    assert torch.equal(dk, want[0]) and torch.equal(dv, want[1])
    # torch accumulates that fp16/bf16 sum in fp32 (documented in online_attention): the
    # same values as per_head_rounded.
    assert torch.equal(dk, fp32_sum(dk_h)) and torch.equal(dv, fp32_sum(dv_h))
    # The default (one fp32 sum of fp32 per-head values, one rounding) is a different choice.
    _, _, (_, dk0, dv0) = _run(kw, dout, block_m=8, block_n=4)
    assert not (torch.equal(dk0, fp32_sum(dk_h)) and torch.equal(dv0, fp32_sum(dv_h)))
    # Without GQA every reduction is the default.
    for red in ("per_head_rounded", "expand_autograd"):
        got = _run(mha, dout, block_m=8, block_n=4, gqa_reduce=red)[2]
        assert torch.equal(got[1], dk_h) and torch.equal(got[2], dv_h)


def test_gqa_group_fp32_is_one_sequential_accumulator():
    """fp32 inputs, one tile, scale 2^-2 (exact): the group's dK/dV are the per-head
    gradients added one head after the other in fp32."""
    kw, dout = _gqa_case(torch.float32)
    kw["scale"] = 0.25
    G = 3
    mha = dict(kw, key=kw["key"].repeat_interleave(G, 1), value=kw["value"].repeat_interleave(G, 1),
               enable_gqa=False)
    _, _, (_, dk_h, dv_h) = _run(mha, dout, block_m=32, block_n=32)
    _, _, (_, dk, dv) = _run(kw, dout, block_m=32, block_n=32, gqa_reduce="group_fp32")

    def sequential(t):
        t = t.reshape(1, 2, G, *t.shape[2:])
        acc = torch.zeros_like(t[:, :, 0])
        for h in range(G):
            acc = acc + t[:, :, h]
        return acc

    assert torch.equal(dk, sequential(dk_h)) and torch.equal(dv, sequential(dv_h))
    # With several tiles it stays within fp32 rounding of the per-head default.
    _, _, (_, dk, dv) = _run(kw, dout, block_m=4, block_n=8, gqa_reduce="group_fp32")
    _, _, (_, dk0, dv0) = _run(kw, dout, block_m=4, block_n=8)
    for a, b in ((dk, dk0), (dv, dv0)):
        assert (a - b).abs().max() <= 64 * 2.0**-24 * b.abs().max()


def _single_tile_forward(q, k, v, scale, *, round_p, op_round=lambda t: t):
    """FA2 with one tile, written out: S = (QKᵀ)·scale, p = e^(S − max), out = (p̃ V)/Σp."""
    qf, kf, vf = (t.float() for t in (q, k, v))
    s = torch.matmul(op_round(qf), op_round(kf).transpose(-2, -1)) * scale
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    pv = p.to(q.dtype).float() if round_p else p
    return (torch.matmul(op_round(pv), op_round(vf)) / p.sum(-1, keepdim=True)).to(q.dtype)


@pytest.mark.parametrize("p_precision", ["input", "fp32"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_p_precision_single_tile(p_precision, dtype):
    kw = make_problem(B=1, Hq=2, Hkv=2, Nq=9, Nk=11, D=8, seed=7, dtype=DTYPES[dtype])
    got = reference.online_attention(kw["query"], kw["key"], kw["value"], scale=0.3,
                                     block_m=16, block_n=16, p_precision=p_precision)
    want = _single_tile_forward(kw["query"], kw["key"], kw["value"], 0.3,
                                round_p=p_precision == "input")
    assert torch.equal(got, want)
    other = _single_tile_forward(kw["query"], kw["key"], kw["value"], 0.3,
                                 round_p=p_precision != "input")
    assert not torch.equal(got, other)


def test_p_and_ds_precision_are_no_ops_for_fp32():
    kw, dout = _gqa_case(torch.float32)
    base = _run(kw, dout, block_m=8, block_n=4)
    got = _run(kw, dout, block_m=8, block_n=4, p_precision="fp32", ds_precision="fp32")
    assert torch.equal(got[0], base[0])
    assert all(torch.equal(a, b) for a, b in zip(got[2], base[2], strict=True))


def test_round_tf32():
    x = torch.tensor([1.0, 1 + 2**-10, 1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), 1 + 2**-12,
                      3.0e38, math.inf, -math.inf, 2.0**-130, 2.0**-140], dtype=torch.float32)
    # TF32 keeps fp32's exponent range with 10 mantissa bits: its smallest subnormal is
    # 2^-136, so 2^-140 rounds to zero.
    want = torch.tensor([1.0, 1 + 2**-10, 1 + 2**-10, 1 + 2**-9, -(1 + 2**-10), 1.0,
                         x[6].item(), math.inf, -math.inf, 2.0**-130, 0.0], dtype=torch.float32)
    got = round_tf32(x)
    assert torch.equal(got[:6], want[:6]) and torch.equal(got[7:], want[7:])
    assert abs(got[6].item() / 3.0e38 - 1) <= 2**-11
    assert torch.isnan(round_tf32(torch.tensor([math.nan]))).all()
    r = round_tf32(torch.randn(1000, generator=torch.Generator().manual_seed(0)))
    assert (r.view(torch.int32) & 0x1FFF == 0).all()
    with pytest.raises(ValueError, match="float32"):
        round_tf32(torch.ones(2, dtype=torch.float16))


def test_tf32_single_tile_and_rejected_below_fp32():
    kw = make_problem(B=1, Hq=2, Hkv=2, Nq=9, Nk=11, D=8, seed=7, dtype=torch.float32)
    q, k, v = kw["query"], kw["key"], kw["value"]
    got = reference.online_attention(q, k, v, scale=0.3, block_m=16, block_n=16, tf32=True)
    assert torch.equal(got, _single_tile_forward(q, k, v, 0.3, round_p=False,
                                                 op_round=round_tf32))
    plain = reference.online_attention(q, k, v, scale=0.3, block_m=16, block_n=16)
    err = (got.double() - plain.double()).abs().max().item()
    assert 0 < err <= 8 * 2.0**-11 * v.abs().max().item()
    for dt in (torch.float16, torch.bfloat16):
        with pytest.raises(ValueError, match="tf32"):
            reference.online_attention(q.to(dt), k.to(dt), v.to(dt), tf32=True)
    with pytest.raises(ValueError, match="tf32"):
        reference.online_attention(q, k, v, tf32=True, precision="exact")


def _subnormal(t):
    tiny = torch.finfo(t.dtype).tiny
    return (t != 0) & (t.abs() < tiny)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_flush_subnormals(dtype):
    dt = DTYPES[dtype]
    tiny = torch.finfo(dt).tiny
    kw = make_problem(B=1, Hq=2, Hkv=2, Nq=16, Nk=24, D=8, seed=5, dtype=torch.float64)
    # Half of V's columns subnormal; scores spread wide so that some P are subnormal too.
    v = kw["value"].clone()
    v[..., 4:] *= tiny / 8
    q = kw["query"] * 4
    q, k, v = (t.to(dt) for t in (q, kw["key"], v))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1),
                       dtype=torch.float64).to(dt)
    base = dict(query=q, key=k, value=v, attn_mask=None, is_causal=False, scale=None,
                enable_gqa=False, window=None, causal_alignment="top_left")
    out0, _, g0 = _run(base, dout, block_m=8, block_n=8)
    out1, _, g1 = _run(base, dout, block_m=8, block_n=8, flush_subnormals=True)
    assert _subnormal(out0).any()  # the case is meaningful
    assert (out1[_subnormal(out0)] == 0).all()
    assert (out1[..., 4:] == 0).all()  # V's flushed columns contribute nothing
    for t in (out1, *g1):
        assert not _subnormal(t).any()
    # Away from the flushed columns the output moves at most at rounding level (P < tiny
    # are dropped).
    assert ((out1[..., :4].double() - out0[..., :4].double()).abs() <= 4 * U[dt]).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_flush_reads_only_fp32_range_subnormal_inputs(dtype):
    """DAZ acts on fp32 operands: a bf16 subnormal input (below fp32's smallest normal) is
    read as 0, an fp16 one (6e-8..6.1e-5, a normal fp32 number once converted) as it is.
    V's subnormal columns reach dq through dP = dO·Vᵀ."""
    dt = DTYPES[dtype]
    tiny = torch.finfo(dt).tiny
    kw = make_problem(B=1, Hq=1, Hkv=1, Nq=8, Nk=8, D=8, seed=6, dtype=torch.float64)
    v = kw["value"].clone()
    v[..., 4:] *= tiny / 8
    q, k, v = (t.to(dt) for t in (kw["query"], kw["key"], v))
    v0 = v.clone()
    v0[..., 4:] = 0
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2),
                       dtype=torch.float64).to(dt)
    base = dict(query=q, key=k, attn_mask=None, is_causal=False, scale=None,
                enable_gqa=False, window=None, causal_alignment="top_left")
    _, _, (dq, _, _) = _run(dict(base, value=v), dout, block_m=8, block_n=8,
                            flush_subnormals=True)
    _, _, (dq0, _, _) = _run(dict(base, value=v0), dout, block_m=8, block_n=8,
                             flush_subnormals=True)
    assert _subnormal(v).any()
    assert torch.equal(dq, dq0) == (dt == torch.bfloat16)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_scale_placement_exact_for_power_of_two_scale(dtype):
    """Scaling by 2^k commutes with rounding: Q·scale or dS·scale rounded to the dtype, or
    Q·√scale and K·√scale rounded in fp32 (√0.25 = 0.5), equal the default bit for bit; with
    scale = 0.3 the choices differ."""
    dt = DTYPES[dtype]
    kw, dout = _gqa_case(dt)
    for scale, same in ((0.25, True), (0.3, False)):
        kw["scale"] = scale
        base = _run(kw, dout, block_m=8, block_n=4)
        for sw in (dict(scale_at="q"), dict(scale_at="qk_sqrt"), dict(ds_scale="before_round")):
            got = _run(kw, dout, block_m=8, block_n=4, **sw)
            eq = torch.equal(got[0], base[0]) and all(
                torch.equal(a, b) for a, b in zip(got[2], base[2], strict=True))
            assert eq == same, (scale, sw)
            if sw.get("ds_scale"):  # the forward does not see ds_scale
                assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1])


@pytest.mark.parametrize("order", ["fa2", "fa1"])
@pytest.mark.parametrize("scale_at", ["exp2", "q_exp2", "exp2_fma"])
@pytest.mark.parametrize("normalize", ["divide", "reciprocal"])
def test_exp2_is_exact_in_float64(scale_at, order, normalize):
    kw = make_problem(B=1, Hq=4, Hkv=2, Nq=13, Nk=17, D=8, seed=2, mask="additive",
                      is_causal=True)
    dout = torch.randn(kw["query"].shape, generator=torch.Generator().manual_seed(0),
                       dtype=torch.float64)
    want = _grads(lambda **a: reference.attention_fp64(**a, return_lse=True), kw, dout, "cpu")
    got = _run(kw, dout, block_m=4, block_n=8, precision="exact", scale_at=scale_at,
               order=order, normalize=normalize)
    for a, b in zip([got[0], *got[2]], [want[0], *want[2]], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12 * max(b.abs().max().item(), 1.0))
    live = want[1] > -torch.inf
    torch.testing.assert_close(got[1][live], want[1][live], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_exp2_differs_from_exp_at_rounding_level(dtype):
    dt = DTYPES[dtype]
    kw, dout = _gqa_case(dt)
    kw["attn_mask"] = make_problem(B=1, Hq=6, Hkv=2, Nq=21, Nk=19, D=8, seed=4,
                                   mask="additive", dtype=dt)["attn_mask"]
    base = _run(kw, dout, block_m=8, block_n=4)
    got = _run(kw, dout, block_m=8, block_n=4, scale_at="exp2")
    diff = False
    for a, b in zip([got[0], *got[2]], [base[0], *base[2]], strict=True):
        d = (a.double() - b.double()).abs().max().item()
        diff |= d > 0
        assert d <= 4 * U[dt] * max(b.abs().max().item(), 1.0)
    lse_d = (got[1] - base[1])[base[1] > -torch.inf].abs().max().item()
    assert lse_d <= 64 * 2.0**-24 * (base[1][base[1] > -torch.inf].abs().max().item() + 1)
    assert diff or lse_d > 0


@pytest.mark.parametrize("order", ["fa2", "fa1"])
def test_fused_exponent_and_reciprocal(order):
    """scale_at="exp2_fma": P = 2^fl(s·c − fl(m·c)) with s·c unrounded (an FFMA);
    normalize="reciprocal": O = acc·fl(1/ℓ). With one key (Nk = 1) the row max is that
    key's score, so exp2_folded gives P = 1 and out = v exactly, while the fused exponent is
    the rounding error of the scaled score: out = fl(fl(P·v)·fl(1/P)), computed here
    independently, differs from v."""
    g = torch.Generator().manual_seed(2)  # a seed where fl(fl(P·v)·fl(1/P)) != v
    q, k, v, do = (torch.randn(1, 1, 1, 8, generator=g) for _ in range(4))
    q = q * 16  # |s·c| ~ 50: the rounding error of s·c moves 2^x off 1
    kw = dict(query=q, key=k, value=v, attn_mask=None)
    folded = _run(kw, do, block_m=4, block_n=4, scale_at="exp2", order=order)
    assert torch.equal(folded[0], v)
    c = torch.tensor(8 ** -0.5 * 1.4426950408889634, dtype=torch.float32).item()
    raw = (q @ k.transpose(-2, -1)).double() * c
    pt = torch.exp2((raw - raw.float().double()).float())
    assert float(pt) != 1.0
    fused = _run(kw, do, block_m=4, block_n=4, scale_at="exp2_fma", normalize="reciprocal",
                 order=order)
    want = (pt * v) * (1 / pt)
    assert torch.equal(fused[0].detach(), want) and not torch.equal(want, v)
    assert all(torch.isfinite(g).all() for g in fused[2])
    recip = _run(kw, do, block_m=4, block_n=4, normalize="reciprocal", order=order)
    assert torch.equal(recip[0].detach(), v)  # P = 1: 1/ℓ = 1 exactly


def test_truncate_tf32():
    """The 13 low mantissa bits dropped: toward zero, within 2^-10 relative, never above
    |x|; inf and NaN kept; fp32 only."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    t = truncate_tf32(x)
    assert bool((t.view(torch.int32) & 0x1FFF == 0).all()) and bool((t.abs() <= x.abs()).all())
    assert ((t - x).abs() / x.abs()).max() < 2.0**-10
    assert not torch.equal(t, round_tf32(x))
    assert truncate_tf32(torch.tensor([-math.inf])).item() == -math.inf
    assert torch.isnan(truncate_tf32(torch.tensor([math.nan]))).all()
    with pytest.raises(ValueError, match="float32"):
        truncate_tf32(torch.ones(2, dtype=torch.bfloat16))


def test_round_exp_approx_keeps_22_bits():
    """Within 2^-22 relative of its input (the bound of ex2.approx.f32), on a grid of 22
    significant bits; inf, NaN and other dtypes unchanged."""
    x = torch.exp2(torch.linspace(-30, 30, 10001, dtype=torch.float32))
    r = round_exp_approx(x)
    rel = ((r.double() - x.double()) / x.double()).abs()
    assert rel.max() <= 2.0**-22 and rel.max() > 2.0**-24
    assert bool((r.view(torch.int32) & 3 == 0).all())
    assert round_exp_approx(torch.tensor([math.inf])).item() == math.inf
    assert torch.isnan(round_exp_approx(torch.tensor([math.nan]))).all()
    h = torch.ones(3, dtype=torch.float16)
    assert round_exp_approx(h) is h


def test_exp_accuracy_approx_rounds_every_exponential():
    """exp_accuracy="approx" moves fp32 results by the exponential's 2^-22 (not more), and
    is the identity's neighbour below fp32, where P is rounded to the input dtype anyway."""
    kw = make_problem(B=1, Hq=2, Hkv=2, Nq=40, Nk=40, D=8, seed=3, dtype=torch.float32)
    lib = reference.online_attention(**kw, scale_at="exp2", block_m=16, block_n=16)
    app = reference.online_attention(**kw, scale_at="exp2", block_m=16, block_n=16,
                                     exp_accuracy="approx")
    exact = reference.online_attention(**{k: v.double() if torch.is_tensor(v) else v
                                          for k, v in kw.items()}, precision="exact")
    assert not torch.equal(lib, app)
    err_lib = (lib.double() - exact).abs().max()
    err_app = (app.double() - exact).abs().max()
    assert err_app <= 8 * 2.0**-22 * exact.abs().max() and err_app > err_lib


def test_switches_rejected_with_names():
    kw = make_problem(B=1, Hq=1, Hkv=1, Nq=3, Nk=3, D=2, seed=0, dtype=torch.float16)
    for name, bad in (("gqa_reduce", "sum"), ("scale_at", "k"), ("p_precision", "fp16"),
                      ("ds_precision", None), ("ds_scale", "never"),
                      ("flush_subnormals", 1), ("tf32", "yes"), ("normalize", "mul"),
                      ("exp_accuracy", "fast"), ("tf32_rounding", "down"),
                      ("accumulate", "pairwise")):
        with pytest.raises(ValueError, match=name):
            reference.online_attention(**kw, **{name: bad})
    kw32 = make_problem(B=1, Hq=1, Hkv=1, Nq=3, Nk=3, D=2, seed=0, dtype=torch.float32)
    with pytest.raises(ValueError, match="fma_chain.*tf32"):
        reference.online_attention(**kw32, tf32=True, accumulate="fma_chain")


# ---------------------------------------------------------------- the family


def test_family_table_and_members():
    assert list(FAMILY)[0] == "fa2_128" and set(FAMILY) == set(FAMILY_NOTES)
    assert all(FAMILY_NOTES[n].strip() for n in FAMILY)
    fp16 = family_members(torch.float16, gqa=False, tf32=False)
    assert "p_ds_fp32" in fp16 and "tf32" not in fp16
    assert not any(n.startswith("gqa_") for n in fp16)
    assert "tf32" not in family_members("bfloat16", gqa=True, tf32=True)  # meaningless
    fp32 = family_members("float32", gqa=True, tf32=True)
    assert "tf32" in fp32 and "p_ds_fp32" not in fp32 and "gqa_group_fp32" in fp32
    assert "exp2_approx" in fp32 and "exp2_approx" not in fp16
    assert "fa2_128x16" in fp32 and "fa2_128x16" in fp16
    assert "tf32_truncated" in fp32
    assert "tf32_truncated" not in family_members("float32", gqa=False, tf32=False)
    assert not {"gqa_per_head_rounded", "gqa_expand_autograd"} & set(fp32)
    assert {"gqa_group_fp32", "gqa_per_head_rounded", "gqa_expand_autograd"} <= set(
        family_members("float16", gqa=True, tf32=False))
    assert list(fp32) == [n for n in FAMILY if n in fp32]  # table order kept
    fp32["fa2_128"]["block_m"] = 1  # copies: the table is not changed
    assert FAMILY["fa2_128"]["block_m"] == 128
    with pytest.raises(ValueError, match="dtype"):
        family_members(torch.int32, gqa=False, tf32=False)


def _small(members):
    """The members with smaller tiles (the sizes of a CPU test), fa2_64x32 kept distinct."""
    return {n: dict(kw, block_m=kw["block_m"] // 16, block_n=kw["block_n"] // 16)
            for n, kw in members.items()}


@pytest.mark.parametrize("tiles", ["one", "many"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_run_family_equals_one_call_per_member(dtype, tiles):
    """Bit for bit, whatever work the members share (with one tile per row, FA1 and FA2
    give the same out and lse and share the backward)."""
    dt = DTYPES[dtype]
    kw, dout = _gqa_case(dt, seed=9)
    kw["is_causal"] = True
    members = family_members(dt, gqa=True, tf32=dt == torch.float32)
    members = _small(members) if tiles == "many" else members
    got = run_family(kw["query"], kw["key"], kw["value"], dout, members=members,
                     is_causal=True, scale=0.3, enable_gqa=True)
    assert list(got) == list(members)
    for name, opts in members.items():
        out, _, (dq, dk, dv) = _run(kw, dout, **opts)
        for t, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), strict=True):
            assert torch.equal(got[name][t], want), (name, t)
    fwd_only = run_family(kw["query"], kw["key"], kw["value"], members=members,
                          is_causal=True, scale=0.3, enable_gqa=True)
    assert all(set(r) == {"out"} for r in fwd_only.values())
    with pytest.raises(ValueError, match="unknown"):
        run_family(kw["query"], kw["key"], kw["value"], members={"x": {"blockm": 2}},
                   enable_gqa=True)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("seed", [0, 1])
def test_every_member_near_fp64(dtype, seed):
    """Normwise max error <= C·u·max|exact| per tensor: C = 4 below fp32 (one or two
    roundings dominate), 32 for fp32 (accumulation dominates); u = 2^-11 for TF32, 2^-10 for
    truncated TF32 (the bound of truncation)."""
    dt = DTYPES[dtype]
    kw = make_problem(B=1, Hq=4, Hkv=2, Nq=37, Nk=45, D=16, seed=seed, dtype=dt,
                      mask=("additive", "bool")[seed], is_causal=seed == 0)
    kw["scale"] = 0.3
    dout = torch.randn(kw["query"].shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64).to(dt)
    exact = _grads(lambda **a: reference.attention_fp64(**a, return_lse=True),
                   _cast(kw, torch.float64), dout.double(), "cpu")
    want = dict(zip(("out", "dq", "dk", "dv"), [exact[0], *exact[2][:3]], strict=True))
    members = _small(family_members(dt, gqa=True, tf32=dt == torch.float32))
    got = run_family(kw["query"], kw["key"], kw["value"], dout, kw["attn_mask"],
                     members=members, is_causal=kw["is_causal"], scale=0.3, enable_gqa=True)
    for name, res in got.items():
        tf32 = name.startswith("tf32")
        u = {"tf32": 2.0**-11, "tf32_truncated": 2.0**-10}.get(name, U[dt])
        c = 32 if dt == torch.float32 and not tf32 else 4
        for t, x in res.items():
            err = (x.double() - want[t]).abs().max().item()
            assert err <= c * u * want[t].abs().max().item(), (name, t, err)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_each_member_differs_from_the_baseline(dtype):
    """On generic inputs (scale 0.3, several tiles, GQA) the members whose choice acts at
    the input dtype's rounding change some bit; below fp32 those acting at fp32 level
    (exp2, tiles, loop order, fp32 summation order) may be absorbed by the final rounding.
    For fp32 inputs every member but ftz (no subnormals here) and bwd_scores_k16 (D = 8 is one
    k-step: the same product; tests/test_reference_online.py shows it differ at D = 48)
    differs."""
    dt = DTYPES[dtype]
    kw, dout = _gqa_case(dt, seed=4)
    members = _small(family_members(dt, gqa=True, tf32=dt == torch.float32))
    got = run_family(kw["query"], kw["key"], kw["value"], dout, members=members, scale=0.3,
                     enable_gqa=True)
    base = got.pop("fa2_128")
    same = {n for n, r in got.items() if all(torch.equal(r[t], base[t]) for t in base)}
    if dt == torch.float32:
        assert same <= {"ftz", "bwd_scores_k16"}, same
    else:
        assert not same & {"q_prescaled", "q_exp2_prescaled", "p_ds_fp32", "ds_before_round",
                           "ds_p_rounded", "gqa_per_head_rounded", "gqa_expand_autograd"}, same
        a, b = got["gqa_expand_autograd"], got["gqa_per_head_rounded"]
        assert all(torch.equal(a[t], b[t]) for t in a)


# ---------------------------------------------------------------- split-KV


@given(
    kw=problems(max_n=24, max_d=8), dtype=st.sampled_from(list(DTYPES) + ["float64"]),
    block_m=blocks, block_n=blocks, order=st.sampled_from(["fa2", "fa1"]),
    precision=st.sampled_from(["emulate", "exact"]), seed=st.integers(0, 2**32 - 1),
)
def test_kv_splits_one_bit_identical_to_previous_code(kw, dtype, block_m, block_n, order,
                                                      precision, seed):
    """kv_splits=1 given explicitly is the forward before the switch existed (the frozen
    copy): output, lse and every gradient, bit for bit."""
    dt = getattr(torch, dtype)
    kw = _cast(kw, dt)
    dout = torch.randn(kw["query"].shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64).to(torch.float64 if precision == "exact" else dt)
    opts = dict(block_m=block_m, block_n=block_n, order=order, precision=precision)
    old = _grads(lambda **a: OLD.online_attention(**a, return_lse=True, **opts), kw, dout, "cpu")
    new = _run(kw, dout, kv_splits=1, **opts)
    assert _same(new[0], old[0]) and _same(new[1], old[1])
    for a, b in zip(new[2], old[2], strict=True):
        assert _same(a, b)


@pytest.mark.parametrize("member", ["split_kv", "bwd_scores_k16", "bwd_k_prescaled"])
def test_far_members_are_opt_in(member):
    """split_kv, bwd_scores_k16 and bwd_k_prescaled sit above the rest in one regime (fp32
    large logits; reference/family.py OPT_IN): judged against only when the kernel declares
    them, then for every dtype, GQA or not."""
    for dt in ("float16", "bfloat16", "float32", "float64"):
        for gqa in (False, True):
            for tf32 in (False, True):
                assert member not in family_members(dt, gqa=gqa, tf32=tf32)
                assert member in family_members(dt, gqa=gqa, tf32=tf32, declared=(member,))


def test_fast_exp_members_are_opt_in_below_fp32_and_shift_the_lse():
    """fwd_fast_exp (declared) brings its two members, below fp32 only; each scales every
    forward probability by 1 -/+ 2^-13 and leaves the rescale factors and the backward's P
    alone: its lse is the baseline's + log(1 -/+ 2^-13) in every row (to fp32 roundings)."""
    from flashcheck.reference.online import FAST_EXP_REL

    pair = {"fwd_fast_exp_low", "fwd_fast_exp_high"}
    for dt in ("float16", "bfloat16", "float32", "float64"):
        for gqa in (False, True):
            assert not pair & set(family_members(dt, gqa=gqa, tf32=False))
            got = set(family_members(dt, gqa=gqa, tf32=False, declared=("fwd_fast_exp",)))
            assert (pair <= got) if dt in ("float16", "bfloat16") else not (pair & got)
    kw, dout = _gqa_case(torch.float16, seed=9)
    base = _run(kw, dout)[1]
    for name, sign in (("fwd_fast_exp_low", -1), ("fwd_fast_exp_high", 1)):
        lse = _run(kw, dout, **FAMILY[name])[1]
        want = math.log1p(sign * FAST_EXP_REL)
        d = lse.double() - base.double()
        slack = 4 * torch.finfo(torch.float32).eps * (1 + base.double().abs())
        assert bool(((d - want).abs() <= slack).all()), (name, d.min(), d.max())


def test_backward_k_prescaled_changes_only_the_backward_scores():
    """bwd_k_prescaled: the forward is the baseline's bit for bit; the backward rebuilds P
    from S = Q·fl(K·scale) (K·scale rounded in fp32) and the forward's lse. With one tile
    (21 x 19) dV is Pᵀ dO of that P: the member's dV is that product to fp32 roundings,
    where the baseline's (P from fl(QKᵀ)·scale) is further off it. Any other scale_at, or a
    split bias FMA, is refused by name."""
    kw = make_problem(B=1, Hq=1, Hkv=1, Nq=21, Nk=19, D=10, seed=4, dtype=torch.float32)
    kw = {**kw, "query": kw["query"] * 4, "key": kw["key"] * 4}
    dout = torch.randn(kw["query"].shape, generator=torch.Generator().manual_seed(4))
    base = _run(kw, dout)
    got = _run(kw, dout, **FAMILY["bwd_k_prescaled"])
    assert _same(got[0], base[0]) and _same(got[1], base[1])
    scale = 1 / math.sqrt(10)
    s = kw["query"] @ (kw["key"] * scale).transpose(-1, -2)
    p = torch.exp(s.double() - got[1].double().unsqueeze(-1))
    want = p.transpose(-1, -2) @ dout.double()
    err = lambda dv: float((dv.double() - want).abs().max())  # noqa: E731
    # |dV| ~4: the member within one fp32 ulp (4.8e-7); the baseline 1.7e-5 off
    assert err(got[2][2]) < 4.8e-7 and err(base[2][2]) > 10 * err(got[2][2]), (
        err(got[2][2]), err(base[2][2]))
    for bad in (dict(scale_at="q"), dict(scale_at="exp2", bias_fma="split")):
        with pytest.raises(ValueError, match="k_prescaled"):
            _run(kw, dout, bwd_scores="k_prescaled", **bad)


def test_split_kv_member_splits_short_sequences():
    from flashcheck.reference.online import split_chunks

    kw = FAMILY["split_kv"]
    # The CPU suite's few dozen keys split: 2 non-empty runs from 17 keys, 4 from 49.
    runs = {nk: sum(len(r) > 0 for r in split_chunks(-(-nk // kw["block_n"]), kw["kv_splits"]))
            for nk in (16, 17, 48, 49, 128)}
    assert runs == {16: 1, 17: 2, 48: 3, 49: 4, 128: 4}


def test_run_family_keys_the_forward_by_kv_splits(monkeypatch):
    """Members differing only in kv_splits get their own forward (and differ); members
    differing only in a backward-only switch share one; every result is bit for bit that of
    one online_attention call."""
    import flashcheck.reference.family as fam

    calls = []
    real = fam._run_forward

    def counting(ar, *a, **k):
        calls.append(ar.kv_splits)
        return real(ar, *a, **k)

    monkeypatch.setattr(fam, "_run_forward", counting)
    kw, dout = _gqa_case(torch.float16, seed=6)
    kw["is_causal"] = True
    members = {
        "plain": dict(block_m=8, block_n=4),
        "s3": dict(block_m=8, block_n=4, kv_splits=3),
        "s3_ds": dict(block_m=8, block_n=4, kv_splits=3, ds_scale="before_round"),
        "s3_fa1": dict(block_m=8, block_n=4, kv_splits=3, order="fa1"),
        "s2_exp2": dict(block_m=8, block_n=4, kv_splits=2, scale_at="exp2"),
        "s5_gqa": dict(block_m=8, block_n=4, kv_splits=5, gqa_reduce="group_fp32"),
    }
    got = run_family(kw["query"], kw["key"], kw["value"], dout, members=members,
                     is_causal=True, scale=0.3, enable_gqa=True)
    assert sorted(calls) == [1, 2, 3, 3, 5]  # s3_ds shares s3's forward
    for name, opts in members.items():
        out, _, (dq, dk, dv) = _run(kw, dout, **opts)
        for t, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), strict=True):
            assert torch.equal(got[name][t], want), (name, t)
    assert not torch.equal(got["plain"]["out"], got["s3"]["out"])


def test_fma_chain_is_one_running_sum_per_gradient():
    """accumulate="fma_chain": with one query row each dK/dV element is one product, bit for
    bit the blocked value; over many rows of positive terms (P, dO = 1) the running sum loses
    what falls under half an ulp of it, a negative bias the blocked sums do not have; dQ with
    one key is one product too; float64 ("exact") is unchanged."""
    torch.manual_seed(3)

    def kw_of(q, k, v):
        return dict(query=q, key=k, value=v, attn_mask=None)

    q, k, v = (torch.rand(1, 1, n, 4) * 4 - 2 for n in (1, 9, 9))
    one = [_run(kw_of(q, k, v), torch.ones(1, 1, 1, 4), accumulate=a)
           for a in ("blocked", "fma_chain")]
    assert all(_same(a, b) for a, b in zip(one[0][2][1:], one[1][2][1:], strict=True))
    q = torch.rand(1, 1, 1500, 1) * 4 - 2
    single = [_run(kw_of(q, k[:, :, :1, :1], v[:, :, :1, :1]), torch.rand(1, 1, 1500, 1),
                   accumulate=a) for a in ("blocked", "fma_chain")]
    # dq over one key and dP over a head dim of 1: one product each
    assert _same(single[0][2][0], single[1][2][0])
    # the H200 case's shape: 81 keys, uniform(4), many P_ij below half an ulp of dv_j
    q, k, v = (torch.rand(1, 1, n, 8) * 8 - 4 for n in (1500, 81, 81))
    dout = torch.ones(1, 1, 1500, 8)
    vd = v.double().requires_grad_()
    torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), vd).backward(
        dout.double())
    bias = {a: float((_run(kw_of(q, k, v), dout, accumulate=a)[2][2].double() - vd.grad).mean())
            for a in ("blocked", "fma_chain")}
    assert bias["fma_chain"] < 0 and abs(bias["fma_chain"]) > 3 * abs(bias["blocked"]), bias
    exact = [_run(kw_of(q.double(), k.double(), v.double()), dout.double(), precision="exact",
                  accumulate=a)[2][2] for a in ("blocked", "fma_chain")]
    assert _same(*exact)


def test_fma_chain_forms_dp_as_one_running_sum_over_the_head_dim():
    """With one key (P = 1, O = V, exact dS = 0) dQ is all rounding of dP − D. Under
    accumulate="fma_chain", dP = dO·V is the running fp32 sum over the head dim in order, so
    dq = fl(fl(fl(Σ_seq − D)·K)·scale) bit for bit (H200, triton-fa1, fp32 D 38, constant V
    row, dO = 1: a tl.dot FMA loop; the blocked members' dP came from cuBLAS's tree)."""
    d = 38
    q = torch.full((1, 1, 1, d), 0.3)
    k = torch.full((1, 1, 1, d), 0.7)
    v = torch.full((1, 1, 1, d), 0.1)
    dout = torch.ones(1, 1, 1, d)
    kw = dict(query=q, key=k, value=v, attn_mask=None)
    out, _, (dq, _, _) = _run(kw, dout, accumulate="fma_chain")
    acc = torch.zeros((), dtype=torch.float32)
    for x in v[0, 0, 0]:
        acc = (acc.double() + x.double()).float()
    delta = (dout * out).sum(-1)
    scale = d ** -0.5
    want = ((acc - delta)[..., None] * k) * scale
    assert torch.equal(dq, want.float()), (dq[0, 0, 0, 0], want[0, 0, 0, 0])
    assert float(acc - delta) != 0.0  # the sequential sum is not the tree's

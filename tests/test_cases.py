"""Tests for verify.cases / verify.distributions: JSON round-trip, validation, determinism,
layouts, the defining property of each distribution and mask kind, case and tensor files."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from flashcheck.verify.cases import (
    DTYPES,
    Case,
    TensorCase,
    d_bucket,
    load_case_file,
    load_tensors,
    n_bucket,
    save_case_file,
    save_tensors,
    tensors_path_for,
)
from flashcheck.verify.strategies import ALL_FEATURES, OPT_IN_FEATURES, cases
from hypothesis import given

TENSORS = ("query", "key", "value", "grad_out")
BASE = dict(B=2, Hq=4, Hkv=2, Nq=17, Nk=33, D=40, seed=7)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern, so NaN payloads and -0.0 compare exactly."""
    if t.dtype == torch.bool:
        return t
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _same_inputs(a, b) -> bool:
    for name in (*TENSORS, "attn_mask"):
        x, y = getattr(a, name), getattr(b, name)
        if (x is None) != (y is None):
            return False
        if x is not None and not (x.dtype == y.dtype and x.shape == y.shape
                                  and x.stride() == y.stride()
                                  and torch.equal(_bits(x), _bits(y))):
            return False
    return True


# -- JSON round-trip and determinism --------------------------------------------------------

@given(cases(dtypes=tuple(DTYPES), features=ALL_FEATURES | OPT_IN_FEATURES))
def test_json_round_trip(case):
    text = case.to_json()
    back = Case.from_json(text)
    assert back == case
    assert hash(back) == hash(case)
    assert Case.from_dict(json.loads(text)) == case
    assert back.to_json() == text


@given(cases(dtypes=tuple(DTYPES), max_n=24, max_heads=3))
def test_materialize_is_deterministic_and_survives_json(case):
    first = case.materialize("cpu")
    assert _same_inputs(first, case.materialize("cpu"))
    assert _same_inputs(first, Case.from_json(case.to_json()).materialize("cpu"))
    for name in TENSORS:
        assert torch.isfinite(getattr(first, name)).all(), name


def test_layouts_hold_the_same_values():
    ref = Case(**BASE, layout="contiguous").materialize()
    for layout in ("bnhd", "strided"):
        other = Case(**BASE, layout=layout).materialize()
        for name in TENSORS:
            assert torch.equal(getattr(ref, name), getattr(other, name).contiguous()), name


def test_seed_and_mask_streams_are_independent():
    a = Case(**BASE).materialize()
    b = Case(**{**BASE, "mask": {"kind": "random", "density": 0.5}}).materialize()
    c = Case(**{**BASE, "seed": 8}).materialize()
    assert torch.equal(a.query, b.query) and torch.equal(a.grad_out, b.grad_out)
    assert not torch.equal(a.query, c.query)


# -- layouts --------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["contiguous", "bnhd", "strided"])
@pytest.mark.parametrize("name", TENSORS)
def test_layout_strides(layout, name):
    case = Case(**BASE, layout=layout)
    t = getattr(case.materialize(), name)
    B, H, N, D = t.shape
    if layout == "contiguous":
        assert t.is_contiguous()
    elif layout == "bnhd":
        assert not t.is_contiguous()
        assert t.stride() == (N * H * D, D, H * D, 1)
    else:
        assert t.stride()[-1] == 2 and t.stride()[-2] == 2 * D + 2
        assert t.stride()[1] == (N + 1) * (2 * D + 2)
        # The buffer around the view is NaN, so out-of-view reads cannot go unnoticed.
        flat = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0,
                                                  (t.untyped_storage().nbytes()
                                                   // t.element_size(),), (1,))
        assert int(torch.isnan(flat).sum()) == flat.numel() - t.numel()


@pytest.mark.parametrize("layout", ["contiguous", "bnhd", "strided"])
def test_clone_keeps_layout_and_is_independent(layout):
    inp = Case(**BASE, layout=layout, mask={"kind": "bias"}).materialize()
    cl = inp.clone()
    assert _same_inputs(inp, cl)
    cl.query.add_(1)
    assert not torch.equal(inp.query, cl.query)


# -- distributions --------------------------------------------------------------------------

def _scores(inp) -> torch.Tensor:
    q, k = inp.query.double(), inp.key.double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return (q @ k.transpose(-1, -2)) * inp.effective_scale


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("target", [1e3, 1e4])
def test_large_logits_reach_target(dtype, target):
    inp = Case(**BASE, dtype=dtype, dist={"kind": "large_logits", "target": target}).materialize()
    peak = _scores(inp).abs().max().item()
    # The common factor is rounded to 3 digits (c^2 off by <= 1%) and rounding q, k to bf16
    # moves each product by <= 2 * 2^-8 relative (0.8%): 1.1x leaves room for both.
    assert target / 1.1 <= peak <= target * 1.1
    # exp overflows fp32 past ln(2^128) = 88.7: without max-subtraction these rows are inf.
    assert torch.isinf(torch.exp(torch.tensor(peak, dtype=torch.float32)))


@pytest.mark.parametrize("groups", [1, 3])
def test_ties_really_tie(groups):
    inp = Case(**BASE, dist={"kind": "ties", "groups": groups}).materialize()
    k = inp.key
    for b in range(k.shape[0]):
        for h in range(k.shape[1]):
            assert torch.unique(k[b, h], dim=0).shape[0] <= groups
    if groups == 1:
        s = _scores(inp)
        assert (s == s[..., :1]).all()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_tiny_has_subnormals(dtype):
    inp = Case(**BASE, dtype=dtype, dist={"kind": "tiny"}).materialize()
    tiny = torch.finfo(inp.query.dtype).tiny
    for name in ("query", "key", "value"):
        x = getattr(inp, name).abs()
        sub = ((x > 0) & (x < tiny)).float().mean().item()
        # |N(0,1)| < 1 w.p. 0.683; a few hundred samples keep the fraction well above 0.5.
        assert sub > 0.5, (name, sub)


def test_outliers_heavy_tail():
    shape = dict(B=2, Hq=4, Hkv=4, Nq=256, Nk=256, D=64, dtype="float32", seed=3)
    heavy = Case(**shape, dist={"kind": "outliers"}).materialize()
    plain = Case(**shape, dist={"kind": "normal"}).materialize()
    n = heavy.query.numel()
    for name in ("query", "key", "value"):
        big = (getattr(heavy, name).abs() > 7).sum().item()
        # P(|N(0,1) + N(0,10^2)| > 7) ~ 0.49 per outlier, 1e-3 outliers: ~0.49e-3 n expected
        # (64 here); Poisson, so >= 1/3 of that fails with probability < 1e-6.
        assert big >= 0.49e-3 * n / 3, (name, big)
        # For N(0,1) alone P(|x| > 7) = 2.6e-12: none.
        assert (getattr(plain, name).abs() > 7).sum().item() == 0


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("margin", [10.0, 20.0])
def test_dominant_key_dominates(dtype, margin):
    case = Case(**BASE, dtype=dtype, dist={"kind": "dominant", "margin": margin})
    inp = case.materialize()
    p = torch.softmax(_scores(inp), dim=-1)
    # Margin m before rounding; rounding q, k to bf16 moves a score of size S by ~2^-7 S.
    # With S <= m + a few units, half the margin survives: weight >= 1 - Nk e^{-m/2}.
    assert p.amax(dim=-1).min().item() >= 1 - case.Nk * math.exp(-margin / 2)
    # Every query row of a (batch, kv head) group picks the same key.
    top = p.argmax(dim=-1).reshape(case.B, case.Hkv, -1)
    assert (top == top[..., :1]).all()


def test_constant_rows():
    inp = Case(**BASE, dist={"kind": "constant_rows"}).materialize()
    assert (inp.query == inp.query[:, :, :1, :]).all()
    assert (inp.value == inp.value[..., :1]).all()


@pytest.mark.parametrize("dist,check", [
    ({"kind": "normal", "sigma": 3.0}, lambda x: abs(x.std().item() / 3.0 - 1) < 0.05),
    ({"kind": "uniform", "a": 0.5}, lambda x: x.abs().max().item() <= 0.5
     and abs(x.std().item() / (0.5 / math.sqrt(3)) - 1) < 0.05),
])
def test_elementwise_dists(dist, check):
    inp = Case(**{**BASE, "dtype": "float32"}, dist=dist, grad_dist=dist).materialize()
    for name in TENSORS:  # ~2.7e4 samples per tensor: std's relative error ~0.4% (1 sigma)
        assert check(getattr(inp, name).double()), name


@pytest.mark.parametrize("grad_dist,check", [
    ({"kind": "constant", "value": -0.5}, lambda g: (g == -0.5).all()),
    ({"kind": "tiny"}, lambda g: ((g != 0) & (g.abs() < torch.finfo(g.dtype).tiny))
     .float().mean() > 0.5),
    # ~400 outliers in 40960 elements, each beyond 7 w.p. ~0.49; N(0,1) alone: P = 2.6e-12.
    ({"kind": "outliers", "p": 0.01}, lambda g: g.abs().max() > 7),
])
def test_grad_dists(grad_dist, check):
    inp = Case(**{**BASE, "Nq": 128}, grad_dist=grad_dist).materialize()
    assert check(inp.grad_out)


# -- masks ----------------------------------------------------------------------------------

def test_key_padding_zero_length():
    case = Case(**BASE, mask={"kind": "key_padding", "lengths": [0, 5]})
    m = case.materialize().attn_mask
    assert m.dtype == torch.bool and m.shape == (2, 4, 17, 33)
    assert not m[0].any()
    assert m[1, ..., :5].all() and not m[1, ..., 5:].any()


def test_dead_rows():
    case = Case(**BASE, mask={"kind": "dead_rows", "rows": 0.2})
    m = case.materialize().attn_mask
    dead = ~m.any(dim=-1)  # (B, H, Nq)
    assert (dead.sum(-1) == math.ceil(0.2 * 17)).all()
    assert m[~dead].all()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_bias_neginf_first_tile(dtype):
    case = Case(**BASE, dtype=dtype,
                mask={"kind": "bias", "neginf_first_tile": True, "tile": 16, "neginf_prob": 0.1})
    m = case.materialize().attn_mask
    assert m.dtype == DTYPES[dtype]
    assert torch.isneginf(m[..., :16]).all()
    rest = m[..., 16:]
    frac = torch.isneginf(rest).float().mean().item()
    assert 0.05 < frac < 0.15  # 2*4*17*17 = 2312 draws at p = 0.1: sd 0.006
    assert torch.isfinite(rest[~torch.isneginf(rest)]).all()


@pytest.mark.parametrize("shape,dims", [
    ("bhqk", (2, 4, 17, 33)), ("bqk", (2, 1, 17, 33)), ("hqk", (1, 4, 17, 33)),
    ("qk", (1, 1, 17, 33)), ("bhk", (2, 4, 1, 33)), ("bk", (2, 1, 1, 33)),
    ("hk", (1, 4, 1, 33)), ("k", (1, 1, 1, 33)),
])
def test_mask_broadcast_shapes(shape, dims):
    m = Case(**BASE, mask={"kind": "random", "shape": shape}).materialize().attn_mask
    assert tuple(m.shape) == dims
    torch.broadcast_shapes(m.shape, (2, 4, 17, 33))


@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
def test_random_density(density):
    m = Case(**{**BASE, "Nq": 64, "Nk": 64}, mask={"kind": "random", "density": density}) \
        .materialize().attn_mask
    # 32768 Bernoulli draws: sd <= 0.003, so 0.02 is > 6 sd.
    assert abs(m.float().mean().item() - density) < 0.02


def test_block_sparse_is_constant_on_tiles():
    case = Case(**{**BASE, "Nq": 40, "Nk": 50},
                mask={"kind": "block_sparse", "block": 16, "density": 0.5})
    m = case.materialize().attn_mask
    for qi in range(0, 40, 16):
        for kj in range(0, 50, 16):
            tile = m[..., qi:qi + 16, kj:kj + 16]
            assert (tile == tile[..., :1, :1]).all()
    assert m.any() and not m.all()


# -- validation -----------------------------------------------------------------------------

GOOD = Case(**BASE).to_dict()


@pytest.mark.parametrize("change,field", [
    ({"version": 2}, "version"),
    ({"B": 0}, "B"),
    ({"Nq": 1.5}, "Nq"),
    ({"Hkv": 3}, "Hkv"),
    ({"D": 0}, "D"),
    ({"D": 257}, "D"),
    ({"dtype": "float64"}, "dtype"),
    ({"layout": "bhnd"}, "layout"),
    ({"is_causal": 1}, "is_causal"),
    ({"causal_alignment": "center"}, "causal_alignment"),
    ({"window": [-2, 0]}, "window"),
    ({"window": [1]}, "window"),
    ({"scale": 0.0}, "scale"),
    ({"scale": float("inf")}, "scale"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**32}, "seed"),
    ({"seed": True}, "seed"),
    ({"mask": {"kind": "lower"}}, "mask.kind"),
    ({"mask": {"kind": "random", "density": 1.5}}, "mask.density"),
    ({"mask": {"kind": "random", "shape": "bq"}}, "mask.shape"),
    ({"mask": {"kind": "dead_rows", "shape": "bk"}}, "mask.shape"),
    ({"mask": {"kind": "key_padding", "lengths": [1]}}, "mask.lengths"),
    ({"mask": {"kind": "key_padding", "lengths": [1, 34]}}, "mask.lengths"),
    ({"mask": {"kind": "block_sparse", "block": 0}}, "mask.block"),
    ({"mask": {"kind": "bias", "neginf_first_tile": "yes"}}, "mask.neginf_first_tile"),
    ({"mask": {"kind": "none", "density": 0.5}}, "mask"),
    ({"dist": {"kind": "cauchy"}}, "dist.kind"),
    ({"dist": {"kind": "normal", "sigma": -1.0}}, "dist.sigma"),
    ({"dist": {"kind": "ties", "groups": 0}}, "dist.groups"),
    ({"dist": {"kind": "normal", "mu": 0.0}}, "dist"),
    ({"grad_dist": {"kind": "ties"}}, "grad_dist.kind"),
    ({"colour": "red"}, "unknown field"),
])
def test_malformed_case_names_the_field(change, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        Case.from_dict({**GOOD, **change})


@pytest.mark.parametrize("missing", ["version", "B", "D", "dtype", "seed"])
def test_missing_required_field(missing):
    d = dict(GOOD)
    del d[missing]
    with pytest.raises(ValueError, match=missing):
        Case.from_dict(d)


def test_from_json_rejects_non_json_and_non_object():
    with pytest.raises(ValueError, match="JSON"):
        Case.from_json("{not json")
    with pytest.raises(ValueError, match="JSON object"):
        Case.from_json("[1, 2]")


def test_replace_revalidates():
    with pytest.raises(ValueError, match="Hq % Hkv"):
        dataclasses.replace(Case(**BASE), Hq=3)


def test_overflowing_dist_raises():
    case = Case(**{**BASE, "D": 1}, scale=1e-6, dist={"kind": "large_logits", "target": 1e6})
    with pytest.raises(ValueError, match="overflows float16"):
        case.materialize()


# -- summaries ------------------------------------------------------------------------------

def test_config_key_and_short():
    case = Case(**BASE, layout="bnhd", is_causal=True, causal_alignment="bottom_right",
                window=(4, 0), mask={"kind": "bias", "neginf_prob": 0.1})
    assert case.config_key() == {"dtype": "float16", "D": "33-64", "N": "17-128",
                                 "causal": "bottom_right+window", "mask": "bias",
                                 "dist": "normal", "gqa": "gqa"}
    s = case.short()
    for part in ("fp16", "B2", "H4/2", "Nq17", "Nk33", "D40", "bnhd", "causal=br",
                 "mask=bias(neginf_prob=0.1", "dist=normal(1)", "seed=7"):
        assert part in s, (part, s)


@pytest.mark.parametrize("value,d,n", [(1, "1-32", "1-16"), (16, "1-32", "1-16"),
                                       (17, "1-32", "17-128"), (33, "33-64", "17-128"),
                                       (128, "65-128", "17-128"), (129, "129-256", "129-1024"),
                                       (8192, "129-256", "1025-8192"),
                                       (8193, "129-256", ">8192")])
def test_buckets(value, d, n):
    assert d_bucket(value) == d and n_bucket(value) == n


def test_kwargs_and_extensions():
    plain = Case(**BASE).materialize()
    assert plain.kwargs() == {"attn_mask": None, "dropout_p": 0.0, "is_causal": False,
                              "scale": None, "enable_gqa": True}
    assert plain.extensions() == ()
    ext = Case(**BASE, is_causal=True, causal_alignment="bottom_right", window=(3, -1),
               scale=0.5).materialize()
    kw = ext.kwargs()
    assert kw["window"] == (3, -1) and kw["causal_alignment"] == "bottom_right"
    assert kw["scale"] == 0.5 and ext.extensions() == ("window", "causal_alignment")


# -- files ----------------------------------------------------------------------------------

def test_case_file_round_trip(tmp_path):
    case = Case(**BASE, mask={"kind": "dead_rows"})
    path = tmp_path / "fail.json"
    meta = {"kernel": "kernels.fa2:attention", "versions": {"torch": torch.__version__},
            "device": "cpu", "verdict": {"status": "fail"}}
    save_case_file(path, case, **meta)
    back, got_meta = load_case_file(path)
    assert back == case and got_meta == meta
    assert tensors_path_for(path) is None


@pytest.mark.parametrize("doc,msg", [
    ({"format": "other", "version": 1, "case": GOOD}, "format"),
    ({"format": "flashcheck-case", "version": 9, "case": GOOD}, "version"),
    ({"format": "flashcheck-case", "version": 1}, "case"),
    ({"format": "flashcheck-case", "version": 1, "case": GOOD, "extra": 1}, "extra"),
    ({"format": "flashcheck-case", "version": 1, "case": {**GOOD, "D": -1}}, "D"),
])
def test_bad_case_file(tmp_path, doc, msg):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=msg):
        load_case_file(path)


def test_save_case_file_rejects_unknown_meta(tmp_path):
    with pytest.raises(ValueError, match="colour"):
        save_case_file(tmp_path / "x.json", Case(**BASE), colour="red")


@pytest.mark.parametrize("suffix", [".npz", ".pt"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_load_tensors_round_trip(tmp_path, suffix, dtype):
    case = Case(**BASE, dtype=dtype, layout="strided", is_causal=True,
                mask={"kind": "bias", "shape": "bqk", "neginf_prob": 0.2})
    inp = case.materialize()
    save_case_file(tmp_path / "cap.json", case)
    save_tensors(tmp_path / f"cap{suffix}", inp)
    found = tensors_path_for(tmp_path / "cap.json")
    assert found is not None and found.endswith(suffix)
    back = load_tensors(found, case=case)
    for name in (*TENSORS, "attn_mask"):
        assert torch.equal(_bits(getattr(back, name)), _bits(getattr(inp, name))), name
    assert back.is_causal and back.enable_gqa
    tc = TensorCase.from_file(found, case=case)
    assert tc.B == 2 and tc.config_key()["dist"] == "captured" and "cap" in tc.short()
    assert _same_inputs(tc.materialize(), load_tensors(found, case=case))
    described = TensorCase.from_file(found)  # no case: described from the tensors alone
    assert (described.Hq, described.Hkv, described.Nk, described.dtype) == (4, 2, 33, dtype)
    assert described.mask["kind"] == "bias" and described.mask["shape"] == "bqk"


@pytest.mark.parametrize("mutate,msg", [
    (lambda t: t.pop("value"), "missing"),
    (lambda t: t.update(extra=torch.zeros(1)), "unknown"),
    (lambda t: t.update(query=t["query"][0]), "query must be 4-D"),
    (lambda t: t.update(key=t["key"].double(), value=t["value"].double()), "dtypes"),
    (lambda t: t.update(key=t["key"][..., :3], value=t["value"][..., :3]), "key/value"),
    (lambda t: t.update(attn_mask=torch.ones(3, 33, dtype=torch.bool)), "attn_mask shape"),
    (lambda t: t.update(attn_mask=torch.ones(33, dtype=torch.int32)), "attn_mask dtype"),
    (lambda t: t.update(grad_out=t["grad_out"][:, :1]), "grad_out"),
])
def test_load_tensors_rejects_bad_files(tmp_path, mutate, msg):
    inp = Case(**BASE, dtype="float32").materialize()
    t = {n: getattr(inp, n).contiguous() for n in TENSORS}
    mutate(t)
    torch.save(t, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=msg):
        load_tensors(tmp_path / "bad.pt")


def test_load_tensors_checks_against_case(tmp_path):
    case = Case(**BASE)
    save_tensors(tmp_path / "t.pt", case.materialize())
    with pytest.raises(ValueError, match="does not match"):
        load_tensors(tmp_path / "t.pt", case=dataclasses.replace(case, Nk=32))
    with pytest.raises(ValueError, match="must end in"):
        load_tensors(tmp_path / "t.bin")

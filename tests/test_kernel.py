"""The Triton kernels (``kernels.attention``, ``kernels.attention_fa1``) against the float64
oracle ``reference.attention_fp64``, forward and backward, over every item of the domain.

Tolerance (first-order, element-wise; u = unit roundoff of the input dtype, u32 = 2^-24):

    err(T) <= u * |T_ref| + eps * M_T

- ``u * |T_ref|``: the final rounding of T to the input dtype.
- ``M_T``: the same attention computed in float64 on absolute values, i.e. the sum of the
  magnitudes of the terms that make up T: out: P|V|; dV: P^T|dO|; dQ: scale * (P o A)|K|;
  dK: scale * (P o A)^T|Q|, with A_ij = |dO_i|.(|V_j| + |O_i|) >= |dP_ij - delta_i|.
- ``eps`` = relative error of one term:
  * P rounded to the input dtype before the dot: u (0 for fp32; 2 u_tf32 for TF32, which
    also rounds the other operand);
  * scores: the fp32 dot of length D is off by <= D u32 S1 (S1 = max scale.|q_i|.|k_j|),
    and it enters P twice (score and row max / lse): 2 D u32 S1;
  * sums over N = max(Nq, Nk) terms in fp32 (l, P@V, P^T dO, dS K): 2 N u32; exp2 on the
    GPU (ex2.approx, relative error <= 2^-22 = 4 u32) and the per-tile rescale/division:
    6 u32;
  * dQ/dK only: dS rounded to the input dtype (u), delta from the rounded O (u), dP's fp32
    dot (D u32).
- Values that round into the subnormal range have an absolute error of half the subnormal
  spacing instead of a relative one: ``N * SUB * max|other operand|`` is added.
Rows that see no key have M = 0 and T_ref = 0: the kernel must return exact zeros there.
The bound is a rigorous first-order bound, so no fudge factor is applied.

Shapes are tiny because the CPU runs Triton's interpreter (16x16 tiles: N up to 80 spans
several tiles plus a tail). bfloat16 cases are collected everywhere but skipped on the CPU,
where the interpreter computes bf16 wrongly; they run on CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch
from flashcheck.kernels import _common, attention, attention_fa1
from flashcheck.kernels import flash_attention as fa
from flashcheck.kernels import flash_attention_fa1 as fa1

from flashcheck import reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
U = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}
U32 = 2.0**-24
U_TF32 = 2.0**-11
# Absolute rounding error of a value below the smallest normal (half the subnormal spacing):
# fp16 2^-24 / 2; bf16 and fp32 share fp32's exponent range, 2^-149 / 2, i.e. negligible.
SUB = {torch.float16: 2.0**-25, torch.bfloat16: 2.0**-150, torch.float32: 2.0**-150}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _skip_bf16(dtype):
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        pytest.skip("bfloat16 is not run under the CPU interpreter: "
                    "Triton's interpreter computes bf16 arithmetic and tl.dot wrongly")


# ----------------------------------------------------------------------------- inputs


def _tensor(gen, shape_bhnd, layout, dtype, sigma=1.0):
    """A (B, H, N, D) tensor of N(0, sigma^2) values in the given storage layout."""
    B, H, N, D = shape_bhnd
    if layout == "contiguous":
        t = torch.randn(B, H, N, D, generator=gen) * sigma
    elif layout == "bnhd":  # (B, N, H, D) storage viewed as (B, H, N, D)
        t = (torch.randn(B, N, H, D, generator=gen) * sigma).transpose(1, 2)
    elif layout == "strided":  # every other element on D, padded N stride
        t = (torch.randn(B, H, N + 3, 2 * D, generator=gen) * sigma)[:, :, :N, ::2]
    else:
        raise ValueError(layout)
    return t.to(dtype).to(DEVICE).detach().requires_grad_()


def _mask(gen, spec, B, Hq, Nq, Nk, qdtype):
    """``spec`` = (kind, shape letters) e.g. ("bool", "bhqk"), ("add", "k"), ("pad", "bk")."""
    if spec is None:
        return None
    kind, letters = spec
    full = {"b": B, "h": Hq, "q": Nq, "k": Nk}
    shape = [full[c] if c in letters else 1 for c in "bhqk"]
    if kind == "bool":
        m = torch.rand(*shape, generator=gen) < 0.7
    elif kind == "pad":  # key padding; batch 0 has length 0 (every row fully masked)
        lengths = torch.arange(B) * max(1, Nk // 2)
        m = (torch.arange(Nk)[None, :] < lengths[:, None]).view(B, 1, 1, Nk)
    elif kind == "add":  # additive bias with some -inf entries
        m = torch.randn(*shape, generator=gen)
        m = m.masked_fill(torch.rand(*shape, generator=gen) < 0.2, float("-inf"))
        m = m.to(qdtype)
    elif kind == "add32":
        m = torch.randn(*shape, generator=gen)
    else:
        raise ValueError(kind)
    if kind != "pad":  # drop the leading size-1 dims: broadcasting aligns from the right
        first = min("bhqk".index(c) for c in letters)
        m = m.reshape(shape[first:])
    return m.to(DEVICE)


def _build(case):
    gen = torch.Generator().manual_seed(case.get("seed", 1234))
    B, Hq, Hkv, Nq, Nk, D = case["shape"]
    dtype = DTYPES[case.get("dtype", "fp16")]
    layout = case.get("layout", "contiguous")
    q = _tensor(gen, (B, Hq, Nq, D), layout, dtype)
    k = _tensor(gen, (B, Hkv, Nk, D), layout, dtype)
    v = _tensor(gen, (B, Hkv, Nk, D), layout, dtype)
    mask = _mask(gen, case.get("mask"), B, Hq, Nq, Nk, dtype)
    do = torch.randn(B, Hq, Nq, D, generator=gen).to(dtype).to(DEVICE)
    kwargs = dict(attn_mask=mask, is_causal=case.get("causal", False), scale=case.get("scale"),
                  enable_gqa=Hq != Hkv, window=case.get("window"),
                  causal_alignment=case.get("align", "top_left"))
    return q, k, v, do, kwargs


# ----------------------------------------------------------------------------- bound


def _dense_p(q, k, kw):
    """P in float64 (B, Hq, Nq, Nk), 0 on masked entries; used only for the magnitudes."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    kk = k.double().repeat_interleave(Hq // Hkv, dim=1)
    scale = kw["scale"] if kw["scale"] is not None else 1.0 / math.sqrt(D)
    s = (q.double() @ kk.transpose(-1, -2)) * scale
    allowed = reference.structural_mask(
        Nq, Nk, is_causal=kw["is_causal"], causal_alignment=kw["causal_alignment"],
        window=kw["window"], device=q.device).expand(B, Hq, Nq, Nk)
    m = kw["attn_mask"]
    if m is not None:
        if m.dtype == torch.bool:
            allowed = allowed & m.expand(B, Hq, Nq, Nk)
        else:
            s = s + m.double()
    s = s.masked_fill(~allowed, float("-inf"))
    mx = s.amax(-1, keepdim=True)
    e = torch.exp(s - torch.where(mx == float("-inf"), 0.0, mx))
    l = e.sum(-1, keepdim=True)
    return e / torch.where(l == 0, 1.0, l), scale


def _bounds(q, k, v, do, out_ref, kw, dtype, tf32=False):
    """Element-wise tolerances for out, dq, dk, dv (see the module docstring)."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    P, scale = _dense_p(q, k, kw)
    qa, ka, va = q.double().abs(), k.double().abs(), v.double().abs()
    ka_g, va_g = ka.repeat_interleave(g, dim=1), va.repeat_interleave(g, dim=1)
    doa, oa = do.double().abs(), out_ref.abs()
    u = U[dtype]
    u_p = 0.0 if dtype == torch.float32 else u
    s1 = scale * (qa @ ka_g.transpose(-1, -2)).max().item()
    eps = u_p + U32 * (2 * D * s1 + 2 * max(Nq, Nk) + 6)
    if tf32:  # both dot operands rounded to TF32; scores off by 2 u_tf32 S1
        eps += 2 * U_TF32 + 2 * U_TF32 * s1
    eps_ds = eps + (u if dtype != torch.float32 else 0.0) + u + D * U32
    A = doa @ va_g.transpose(-1, -2) + (doa * oa).sum(-1, keepdim=True)
    PA = P * A

    sub = SUB[dtype] if dtype != torch.float32 else 0.0

    def per_kv(t):
        return t.view(B, Hkv, g, Nk, D).sum(2)

    return {
        "out": eps * (P @ va_g) + sub * Nk * va.max(),
        "dq": eps_ds * scale * (PA @ ka_g) + sub * Nk * scale * ka.max(),
        "dk": eps_ds * scale * per_kv(PA.transpose(-1, -2) @ qa) + sub * Nq * g * scale * qa.max(),
        "dv": eps * per_kv(P.transpose(-1, -2) @ doa) + sub * Nq * g * doa.max(),
    }, u


def _check(fn, case, tf32=False):
    q, k, v, do, kw = _build(case)
    dtype = q.dtype
    out = fn(q, k, v, **kw)
    assert out.dtype == dtype and out.shape == (q.shape[0], q.shape[1], q.shape[2], q.shape[3])
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)

    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    out_ref = reference.attention_fp64(qr, kr, vr, **kw)
    dq_r, dk_r, dv_r = torch.autograd.grad(out_ref, (qr, kr, vr), do.double())
    with torch.no_grad():
        bounds, u = _bounds(q.detach(), k.detach(), v.detach(), do, out_ref.detach(), kw, dtype,
                            tf32)
    got = {"out": out, "dq": dq, "dk": dk, "dv": dv}
    want = {"out": out_ref, "dq": dq_r, "dk": dk_r, "dv": dv_r}
    for name in ("out", "dq", "dk", "dv"):
        g_, w_ = got[name].detach().double(), want[name].detach()
        assert torch.isfinite(g_).all(), f"{name}: non-finite values for case {case}"
        tol = u * w_.abs() + bounds[name]
        err = (g_ - w_).abs()
        bad = err > tol
        if bad.any():
            idx = tuple(int(i) for i in torch.nonzero(bad)[(err - tol)[bad].argmax()])
            pytest.fail(f"{name}: {int(bad.sum())}/{bad.numel()} elements off; worst at {idx}: "
                        f"got {g_[idx].item()!r}, want {w_[idx].item()!r}, tol "
                        f"{tol[idx].item():.3g}; case {case}")
    return out


# ----------------------------------------------------------------------------- domain

S = (1, 2, 2, 40, 40, 16)  # default shape (B, Hq, Hkv, Nq, Nk, D): 3 tiles with a tail
DOMAIN = {
    "fp16": dict(shape=S),
    "fp32": dict(shape=S, dtype="fp32"),
    "bf16": dict(shape=S, dtype="bf16"),
    "bf16-causal-gqa": dict(shape=(1, 4, 2, 40, 33, 72), dtype="bf16", causal=True),
    **{f"D{d}": dict(shape=(1, 1, 1, 20, 19, d)) for d in (1, 40, 72, 80, 96, 111, 128, 256)},
    "D111-fp32": dict(shape=(1, 1, 1, 20, 19, 111), dtype="fp32"),
    "N1": dict(shape=(1, 2, 2, 1, 1, 16)),
    "Nq1": dict(shape=(1, 2, 2, 1, 37, 16)),
    "Nk1": dict(shape=(1, 2, 2, 37, 1, 16)),
    "Nq!=Nk": dict(shape=(2, 1, 1, 47, 20, 24)),
    "multiple-of-tile": dict(shape=(1, 1, 1, 32, 48, 32)),
    "causal": dict(shape=(1, 2, 2, 45, 45, 16), causal=True),
    "causal-Nq<Nk": dict(shape=(1, 1, 1, 20, 45, 16), causal=True),
    "causal-Nq>Nk": dict(shape=(1, 1, 1, 45, 20, 16), causal=True),
    "causal-br-Nq<Nk": dict(shape=(1, 1, 1, 20, 45, 16), causal=True, align="bottom_right"),
    "causal-br-Nq>Nk": dict(shape=(1, 1, 1, 45, 20, 16), causal=True, align="bottom_right"),
    "causal-fp32": dict(shape=(1, 1, 1, 45, 38, 16), dtype="fp32", causal=True),
    "window": dict(shape=(1, 1, 1, 48, 48, 16), window=(5, 3)),
    "window-00": dict(shape=(1, 1, 1, 33, 40, 16), window=(0, 0)),
    "window-left": dict(shape=(1, 1, 1, 48, 40, 16), window=(7, -1), align="bottom_right"),
    "window-right": dict(shape=(1, 1, 1, 40, 48, 16), window=(-1, 9)),
    "window-causal-br": dict(shape=(1, 1, 1, 33, 64, 16), window=(20, 4), causal=True,
                             align="bottom_right"),
    "window-empty-rows": dict(shape=(1, 1, 1, 50, 18, 16), window=(2, 1),
                              align="top_left"),
    "bool-full": dict(shape=(2, 2, 2, 33, 35, 16), mask=("bool", "bhqk")),
    "bool-qk": dict(shape=(2, 2, 2, 33, 35, 16), mask=("bool", "qk")),
    "bool-q1": dict(shape=(1, 2, 2, 33, 35, 16), mask=("bool", "bq")),
    "key-padding": dict(shape=(2, 2, 2, 33, 35, 16), mask=("pad", "bk")),
    "add-full": dict(shape=(2, 1, 1, 33, 35, 16), mask=("add", "bhqk")),
    "add-hk": dict(shape=(1, 2, 2, 33, 35, 16), mask=("add", "hk")),
    "add-k": dict(shape=(1, 2, 2, 33, 35, 16), mask=("add", "k")),
    "add-fp32-mask": dict(shape=(1, 2, 2, 33, 35, 16), mask=("add32", "qk")),
    "mask-causal-window": dict(shape=(1, 2, 2, 40, 40, 16), mask=("add", "qk"), causal=True,
                               window=(9, -1)),
    "gqa": dict(shape=(2, 4, 2, 33, 30, 16)),
    "mqa-causal": dict(shape=(1, 3, 1, 33, 40, 16), causal=True),
    "gqa-mask-fp32": dict(shape=(1, 4, 2, 20, 30, 16), dtype="fp32", mask=("bool", "hqk")),
    "scale-small": dict(shape=S, scale=0.05),
    "scale-large": dict(shape=S, scale=1.5),
    "bnhd": dict(shape=(2, 2, 2, 33, 35, 16), layout="bnhd"),
    "strided": dict(shape=(1, 2, 2, 33, 35, 24), layout="strided"),
    "strided-gqa-causal-fp32": dict(shape=(1, 4, 2, 33, 35, 16), layout="strided",
                                    dtype="fp32", causal=True),
}


@pytest.mark.parametrize("name", list(DOMAIN))
def test_fa2_matches_fp64(name):
    case = DOMAIN[name]
    _skip_bf16(DTYPES[case.get("dtype", "fp16")])
    _check(attention, case)


FA1_CASES = ["fp16", "fp32", "bf16", "D111-fp32", "Nk1", "causal-br-Nq>Nk", "window-left",
             "window-causal-br", "key-padding", "add-full", "mask-causal-window",
             "mqa-causal", "strided"]


@pytest.mark.parametrize("name", FA1_CASES)
def test_fa1_matches_fp64(name):
    case = DOMAIN[name]
    _skip_bf16(DTYPES[case.get("dtype", "fp16")])
    _check(attention_fa1, case)


@pytest.mark.parametrize("fn, tf32", [(fa.attention_tf32, True), (fa1.attention_fa1_tf32, True),
                                      (fa.attention_atomic, False)],
                         ids=["tf32", "fa1-tf32", "atomic-dq"])
@pytest.mark.parametrize("name", ["fp32", "gqa-mask-fp32", "strided-gqa-causal-fp32"])
def test_non_sdpa_entries(fn, tf32, name):
    _check(fn, DOMAIN[name], tf32=tf32)


@pytest.mark.parametrize("name", ["fp16", "bf16-causal-gqa", "D111", "Nq!=Nk", "key-padding",
                                  "window-causal-br", "bnhd"])
@pytest.mark.parametrize("tma", ["off", "auto"])
def test_atomic_dq_matches_fp64(name, tma):
    # dQ added inside the dK/dV kernel: per-element fp32 atomics with TMA "off", on sm_90+
    # GPUs otherwise one bulk tensor reduce-add per tile (rows past Nq, columns past D clipped
    # by the copy engine; the interpreter keeps the per-element atomics).
    case = DOMAIN[name]
    _skip_bf16(DTYPES[case.get("dtype", "fp16")])
    with _common.tma(tma):
        _check(fa.attention_atomic, case)


def test_fully_masked_rows_are_exact_zero():
    case = DOMAIN["causal-br-Nq>Nk"]  # rows i < Nq - Nk see no key
    q, k, v, do, kw = _build(case)
    out = attention(q, k, v, **kw)
    dq, = torch.autograd.grad(out, (q,), do)
    dead = q.shape[2] - k.shape[2]
    assert torch.equal(out[:, :, :dead].detach(), torch.zeros_like(out[:, :, :dead]))
    assert torch.equal(dq[:, :, :dead], torch.zeros_like(dq[:, :, :dead]))
    assert out[:, :, dead:].abs().sum() > 0


# ----------------------------------------------------------------------------- properties


@pytest.mark.parametrize("fn", [attention, attention_fa1], ids=["fa2", "fa1"])
def test_backward_is_bitwise_deterministic(fn):
    q, k, v, do, kw = _build(dict(shape=(1, 4, 2, 40, 35, 16), causal=True,
                                  mask=("add", "qk")))
    runs = []
    for _ in range(2):
        out = fn(q, k, v, **kw)
        runs.append((out.detach().clone(), *torch.autograd.grad(out, (q, k, v), do)))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fn", [attention, attention_fa1], ids=["fa2", "fa1"])
def test_no_alias_and_inputs_unchanged(fn):
    q, k, v, do, kw = _build(dict(shape=(1, 2, 2, 20, 20, 16), mask=("add", "hqk"),
                                  layout="bnhd"))
    before = [t.detach().clone() for t in (q, k, v, do, kw["attn_mask"])]
    out = fn(q, k, v, **kw)
    grads = torch.autograd.grad(out, (q, k, v), do)
    for t in (out, *grads):
        for inp in (q, k, v, do, kw["attn_mask"]):
            assert t.untyped_storage().data_ptr() != inp.untyped_storage().data_ptr()
    for b, a in zip(before, (q, k, v, do, kw["attn_mask"]), strict=True):
        assert torch.equal(b, a.detach())


# ----------------------------------------------------------------------------- skipping


def _visible_tiles(Nq, Nk, bm, bn, kw, transpose=False):
    """Brute force: for each program, the tiles with at least one visible entry and the
    tiles whose entries are all visible and in range (from reference.structural_mask)."""
    m = reference.structural_mask(Nq, Nk, is_causal=kw["is_causal"],
                                  causal_alignment=kw["causal_alignment"], window=kw["window"])
    if transpose:
        m, Nq, Nk, bm, bn = m.T, Nk, Nq, bn, bm
    rows = []
    for r0 in range(0, Nq, bm):
        any_, full = 0, 0
        for c0 in range(0, Nk, bn):
            t = m[r0:r0 + bm, c0:c0 + bn]
            if t.any():
                any_ += 1
                full += int(bool(t.all()) and c0 + bn <= Nk)
        rows.append((any_, full))
    return rows


BANDS = {
    "none": dict(shape=(1, 1, 1, 40, 50, 16)),
    "causal": dict(shape=(1, 1, 1, 64, 64, 16), causal=True),
    "causal-br": dict(shape=(1, 1, 1, 30, 70, 16), causal=True, align="bottom_right"),
    "window": dict(shape=(1, 1, 1, 80, 80, 16), window=(17, 5)),
    "window-br": dict(shape=(1, 1, 1, 70, 37, 16), window=(3, 20), align="bottom_right"),
}


@pytest.mark.parametrize("name", list(BANDS))
def test_masked_tiles_are_skipped(name):
    """Each program visits exactly the tiles that hold a visible entry, and only the edge
    tiles are masked (counted by the kernels' COUNT_TILES hook)."""
    if DEVICE != "cpu":
        pytest.skip("tile counts are checked for the interpreter's fixed 16x16 tiles")
    q, k, v, _, kw = _build(BANDS[name])
    counts = fa.debug_tile_counts(q.detach(), k.detach(), v.detach(), **kw)
    Nq, Nk = q.shape[2], k.shape[2]
    b = _common.INTERPRETER_BLOCK
    for kind, transpose in (("fwd", False), ("dq", False), ("dkdv", True)):
        want = _visible_tiles(Nq, Nk, b, b, kw, transpose)
        got = counts[kind][:len(want)].tolist()
        assert [g[0] + g[1] for g in got] == [w[0] for w in want], kind
        # Unmasked tiles are fully visible; only the last partial tile is masked extra.
        assert all(g[1] <= w[1] for g, w in zip(got, want, strict=True)), kind
        assert sum(g[1] for g in got) >= sum(w[1] for w in want) - len(want), kind
    total = (Nq // b + (Nq % b > 0)) * (Nk // b + (Nk % b > 0))
    if kw["is_causal"] or kw["window"]:
        assert sum(g[0] + g[1] for g in counts["fwd"].tolist()) < total


@pytest.mark.parametrize("name", ["window", "window-br", "causal-br"])
def test_band_equals_dense_mask(name):
    """The skipping band path gives the same bits as the same band given as a dense mask."""
    q, k, v, do, kw = _build(BANDS[name])
    Nq, Nk = q.shape[2], k.shape[2]
    dense = reference.structural_mask(Nq, Nk, is_causal=kw["is_causal"],
                                      causal_alignment=kw["causal_alignment"],
                                      window=kw["window"], device=q.device)
    for fn in (attention, attention_fa1):
        a = fn(q, k, v, **kw)
        b = fn(q, k, v, attn_mask=dense)
        ga = torch.autograd.grad(a, (q, k, v), do)
        gb = torch.autograd.grad(b, (q, k, v), do)
        for x, y in zip((a, *ga), (b, *gb), strict=True):
            if DEVICE == "cpu":
                assert torch.equal(x, y)
            else:  # the GPU may contract the unmasked path's scale and shift into one FMA
                torch.testing.assert_close(x, y, rtol=4 * U[x.dtype], atol=4 * U[x.dtype])


def test_fa1_skips_pairs():
    """FA1 computes exactly the (K tile, Q tile) pairs that hold a visible entry."""
    q, k, v, _, kw = _build(BANDS["causal-br"])
    bm, bn = fa1._fa1_blocks(q.shape[-1], q.dtype)
    n = int(fa1.fa1_tile_counts(q.detach(), k.detach(), v.detach(), **kw).sum())
    assert n == sum(w[0] for w in _visible_tiles(q.shape[2], k.shape[2], bm, bn, kw))


# ----------------------------------------------------------------------------- tuning


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("elem", [2, 4])
@pytest.mark.parametrize("bd", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("kind", _common.KINDS)
def test_both_tuning_modes_pick_configs_that_fit(kind, bd, elem, causal):
    """The heuristic table has an entry for every (kind, BLOCK_D, dtype size, causal), and
    both modes pick configs that keep() accepts for the H200's shared memory."""
    limit = _common.H200_SMEM
    point = _common.heuristic_point(kind, bd, elem, causal)
    assert _common.keep(kind, point, bd, elem, limit)
    assert _common.fixed_point(kind, bd, elem, causal, limit) == point
    tuned = _common.autotune_points(kind, bd, elem, causal, limit)
    assert 1 <= len(tuned) <= _common.MAX_AUTOTUNE <= 6
    assert tuned[0] == point and len(set(tuned)) == len(tuned)
    assert all(_common.keep(kind, p, bd, elem, limit) for p in tuned)
    assert set(tuned) <= set(_common.all_points(kind))


@pytest.mark.parametrize("kind", _common.KINDS)
def test_small_shared_memory_falls_back(kind):
    """On a device with less shared memory the fixed config still fits (grid, then
    fallback tiles), and the autotuner is never handed an empty list."""
    limit = 101376  # max_shared_mem of an sm_86 part (99 KiB)
    for bd in (64, 256):
        for elem in (2, 4):
            p = _common.fixed_point(kind, bd, elem, False, limit)
            assert _common.keep(kind, p, bd, elem, limit)
            assert _common.autotune_points(kind, bd, elem, False, limit)


def test_tuning_mode_switch():
    from flashcheck import kernels
    assert kernels.get_tuning() == "heuristic"
    with kernels.tuning("autotune"):
        assert kernels.get_tuning() == "autotune"
        with pytest.raises(ValueError, match="tuning mode"):
            kernels.set_tuning("fast")
        assert kernels.get_tuning() == "autotune"
    assert kernels.get_tuning() == "heuristic"
    with pytest.raises(ValueError, match="tuning mode"), kernels.tuning("exhaustive"):
        pass
    assert kernels.get_tuning() == "heuristic"


def test_autotune_mode_gives_the_same_bits_under_the_interpreter():
    """Under the interpreter both modes run the single interpreter config."""
    from flashcheck import kernels
    q, k, v, do, kw = _build(dict(shape=(1, 2, 2, 33, 35, 16), causal=True))
    runs = []
    for mode in ("heuristic", "autotune"):
        with kernels.tuning(mode):
            out = attention(q, k, v, **kw)
            runs.append((out.detach(), *torch.autograd.grad(out, (q, k, v), do)))
    if DEVICE == "cpu":
        for a, b in zip(*runs, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("n, want", [(1, 16), (16, 16), (17, 32), (4096, 4096), (5000, 8192),
                                     (10**6, 16384)])
def test_bucket(n, want):
    assert _common.bucket(n) == want


# ----------------------------------------------------------------------------- errors


def _t(shape=(1, 2, 8, 16), dtype=torch.float16, device=DEVICE):
    return torch.randn(shape).to(dtype).to(device)


def _err_cases():
    q = _t()
    yield "D>256", dict(query=_t((1, 2, 8, 272)), key=_t((1, 2, 8, 272)),
                        value=_t((1, 2, 8, 272))), NotImplementedError, "head dim"
    yield "float64", dict(query=_t(dtype=torch.float64), key=_t(dtype=torch.float64),
                          value=_t(dtype=torch.float64)), NotImplementedError, "dtype"
    yield "int", dict(query=_t(dtype=torch.int32), key=_t(dtype=torch.int32),
                      value=_t(dtype=torch.int32)), ValueError, "dtype"
    yield "dtype-mismatch", dict(query=q, key=_t(dtype=torch.float32), value=_t()), \
        ValueError, "key dtype"
    yield "mask-shape", dict(query=q, key=_t(), value=_t(),
                             attn_mask=torch.ones(3, 8, 8, dtype=torch.bool, device=DEVICE)), \
        ValueError, "attn_mask"
    yield "mask-int", dict(query=q, key=_t(), value=_t(),
                           attn_mask=torch.ones(8, 8, dtype=torch.int32, device=DEVICE)), \
        ValueError, "attn_mask"
    yield "dropout", dict(query=q, key=_t(), value=_t(), dropout_p=0.1), \
        NotImplementedError, "dropout_p"
    yield "gqa-divides", dict(query=_t((1, 3, 8, 16)), key=_t(), value=_t(), enable_gqa=True), \
        ValueError, "Hq % Hkv"
    yield "gqa-flag", dict(query=_t((1, 4, 8, 16)), key=_t(), value=_t()), \
        ValueError, "enable_gqa"
    yield "window-type", dict(query=q, key=_t(), value=_t(), window=(1.5, 2)), \
        ValueError, "window"
    yield "window-range", dict(query=q, key=_t(), value=_t(), window=(-2, 0)), \
        ValueError, "window"
    yield "alignment", dict(query=q, key=_t(), value=_t(), causal_alignment="center"), \
        ValueError, "causal_alignment"
    yield "scale-neg", dict(query=q, key=_t(), value=_t(), scale=-1.0), ValueError, "scale"
    yield "scale-nan", dict(query=q, key=_t(), value=_t(), scale=float("nan")), \
        ValueError, "scale"
    yield "scale-zero", dict(query=q, key=_t(), value=_t(), scale=0.0), ValueError, "scale"
    yield "rank", dict(query=_t((2, 8, 16)), key=_t(), value=_t()), ValueError, "query"
    yield "value-shape", dict(query=q, key=_t(), value=_t((1, 2, 9, 16))), ValueError, "value"
    yield "head-dim", dict(query=q, key=_t((1, 2, 8, 8)), value=_t((1, 2, 8, 8))), \
        ValueError, "head dim"
    yield "empty-N", dict(query=_t((1, 2, 0, 16)), key=_t(), value=_t()), ValueError, "Nq"
    yield "mask-grad", dict(query=q, key=_t(), value=_t(),
                            attn_mask=torch.zeros(8, 8, device=DEVICE, requires_grad=True)), \
        NotImplementedError, "attn_mask"
    yield "bf16-cpu" if DEVICE == "cpu" else "mixed-devices", (
        dict(query=_t(dtype=torch.bfloat16), key=_t(dtype=torch.bfloat16),
             value=_t(dtype=torch.bfloat16)) if DEVICE == "cpu" else
        dict(query=q, key=_t(device="cpu"), value=_t())), \
        (NotImplementedError if DEVICE == "cpu" else ValueError), \
        ("bfloat16" if DEVICE == "cpu" else "devices")


ERRORS = {name: (kw, exc, text) for name, kw, exc, text in _err_cases()}


@pytest.mark.parametrize("fn", [attention, attention_fa1], ids=["fa2", "fa1"])
@pytest.mark.parametrize("name", list(ERRORS))
def test_outside_domain_raises(fn, name):
    kw, exc, text = ERRORS[name]
    with pytest.raises(exc, match=text):
        fn(**kw)


def test_mixed_devices_raise_on_cpu_too():
    meta = torch.empty(1, 2, 8, 16, dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match="devices"):
        attention(_t(), meta, meta)


def test_capabilities():
    caps = attention.capabilities
    assert caps["dtypes"] == ("float16", "bfloat16", "float32")
    assert caps["head_dims"] == (1, 256)
    assert set(caps["extensions"]) == {"window", "causal_alignment"}
    assert caps["deterministic_backward"] and not caps["tf32"]
    assert fa.attention_atomic.capabilities["deterministic_backward"] is False
    assert fa.attention_tf32.capabilities["tf32"] is True
    assert attention_fa1.capabilities == caps
    if DEVICE == "cpu":
        assert "interpreter" in caps["not_run"]["cpu"]["bfloat16"]

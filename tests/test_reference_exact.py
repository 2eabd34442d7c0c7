"""Tests of the float64 oracle ``reference.attention_fp64``, of ``reference.masks`` and of
the textbook ``reference.naive_attention``.

- against mpmath at 50 digits on tiny problems (moderate and huge logits, masks, -inf
  biases, dead rows), to 1e-12 relative;
- gradients by ``torch.autograd.gradcheck`` (output and lse; full and broadcast additive
  masks); double backward raises NotImplementedError;
- agreement with PyTorch's SDPA in float64 where SDPA defines the same thing;
- chunking invariance of output, lse and every gradient, the no-grad path equal to the
  autograd path, and an autograd graph that keeps no per-chunk tensor;
- fully-masked rows: 0 output, -inf lse, zero gradients, no NaN;
- ``structural_mask`` against its definition, element by element;
- ``naive_attention`` (every upcast/reorder_ops variant) on float64 inputs equals the oracle,
  and its dead rows and gradients behave the same.
"""

from __future__ import annotations

import math

import flashcheck.reference.exact as exact_mod
import mpmath
import pytest
import torch
from flashcheck.reference._problems import make_problem
from hypothesis import given, note
from hypothesis import strategies as st

from flashcheck import reference

# The oracle's agreement target (issue: "≤ 1e-12 relative"). float64 has u = 2^-53 ≈ 1.1e-16;
# with exactly representable scores the remaining error is a few hundred u at these sizes.
ORACLE_RTOL = 1e-12


@st.composite
def tiny_problems(draw, *, max_n: int = 4, max_d: int = 3):
    """Knobs of a tiny problem (N <= max_n, D <= max_d), built from a drawn seed."""
    Hkv = draw(st.integers(1, 2))
    knobs = dict(
        B=draw(st.integers(1, 2)), Hkv=Hkv, Hq=Hkv * draw(st.integers(1, 2)),
        Nq=draw(st.integers(1, max_n)), Nk=draw(st.integers(1, max_n)),
        D=draw(st.integers(1, max_d)), seed=draw(st.integers(0, 2**32 - 1)),
        mask=draw(st.sampled_from(["none", "bool", "bool_bcast", "additive"])),
        values=draw(st.sampled_from(["normal", "large"])),
        is_causal=draw(st.booleans()),
        causal_alignment=draw(st.sampled_from(["top_left", "bottom_right"])),
        window=draw(st.none() | st.tuples(st.integers(-1, 3), st.integers(-1, 3))),
    )
    note(knobs)
    return make_problem(**knobs)


def _mp_attention(kw):
    """Output, lse and per-element error scale sum_j p_j |v_jd| at 50 digits."""
    mpmath.mp.dps = 50
    q, k, v, mask = kw["query"], kw["key"], kw["value"], kw["attn_mask"]
    B, Hq, Nq, D = q.shape
    Nk, G = k.shape[2], Hq // k.shape[1]
    scale = mpmath.mpf(kw["scale"]) if kw["scale"] is not None else 1 / mpmath.sqrt(D)
    allowed, bias = reference.masks.combined_mask(
        mask, (B, Hq, Nq, Nk), is_causal=kw["is_causal"],
        causal_alignment=kw["causal_alignment"], window=kw["window"],
    )
    out = torch.zeros(B, Hq, Nq, D, dtype=torch.float64)
    mag = torch.zeros_like(out)
    lse = torch.full((B, Hq, Nq), -torch.inf, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            for i in range(Nq):
                s = {}
                for j in range(Nk):
                    bij = float(bias[b, h, i, j]) if bias is not None else 0.0
                    if allowed[b, h, i, j] and bij != -float("inf"):
                        dot = mpmath.fsum(
                            mpmath.mpf(float(q[b, h, i, d])) * mpmath.mpf(float(k[b, h // G, j, d]))
                            for d in range(D)
                        )
                        s[j] = scale * dot + mpmath.mpf(bij)
                if not s:
                    continue
                m = max(s.values())
                e = {j: mpmath.exp(x - m) for j, x in s.items()}
                total = mpmath.fsum(e.values())
                lse[b, h, i] = float(m + mpmath.log(total))
                for d in range(D):
                    vals = {j: mpmath.mpf(float(v[b, h // G, j, d])) for j in e}
                    out[b, h, i, d] = float(mpmath.fsum(e[j] * vals[j] for j in e) / total)
                    mag[b, h, i, d] = float(mpmath.fsum(e[j] * abs(vals[j]) for j in e) / total)
    return out, lse, mag


@given(kw=tiny_problems())
def test_matches_mpmath(kw):
    out, lse = reference.attention_fp64(**kw, return_lse=True)
    want, want_lse, mag = _mp_attention(kw)
    assert out.dtype == torch.float64 and not out.isnan().any()
    # Output error relative to sum_j p_j |v_jd| (the condition of the weighted mean).
    err = (out - want).abs()
    assert (err <= ORACLE_RTOL * mag).all(), f"max err {err.max()} at {err.argmax()}"
    assert torch.equal(lse == -torch.inf, want_lse == -torch.inf)
    live = want_lse > -torch.inf
    # lse = m + log(l): relative to |m| + log(l) <= |m| + log 4, floored at 1.
    tol = ORACLE_RTOL * torch.clamp(want_lse[live].abs() + 2.0, min=1.0)
    assert ((lse[live] - want_lse[live]).abs() <= tol).all()


@given(kw=tiny_problems(max_n=3, max_d=2))
def test_gradcheck(kw):
    inputs = [kw.pop("query"), kw.pop("key"), kw.pop("value")]
    if kw["attn_mask"] is not None and kw["attn_mask"].dtype != torch.bool:
        inputs.append(kw.pop("attn_mask"))
    for t in inputs:
        t.requires_grad_(True)

    def f(q, k, v, *mask):
        out, lse = reference.attention_fp64(q, k, v, *mask, **kw, return_lse=True)
        # Finite differences of a constant -inf are NaN; dead rows are checked separately.
        return out, torch.where(lse == -torch.inf, torch.zeros_like(lse), lse)

    assert torch.autograd.gradcheck(f, tuple(inputs))


@pytest.mark.parametrize(
    "opts",
    [
        dict(mask="none"),
        dict(mask="none", is_causal=True),
        dict(mask="bool", dead=False),
        dict(mask="additive", dead=False),
        dict(mask="none", gqa=True),
    ],
    ids=["plain", "causal", "bool", "additive", "gqa"],
)
def test_matches_torch_sdpa_float64(opts):
    """SDPA's own semantics (top-left causal, masks, GQA head mapping) in float64."""
    gqa = opts.get("gqa", False)
    kw = make_problem(
        B=2, Hq=4, Hkv=2 if gqa else 4, Nq=7, Nk=9, D=5, seed=3, mask=opts["mask"],
        is_causal=opts.get("is_causal", False),
    )
    if opts.get("dead") is False:
        # SDPA before _safe_softmax returned NaN on dead rows; compare live rows only.
        m = kw["attn_mask"]
        m[:, :, 0] = True if m.dtype == torch.bool else 0.0
        m[:, :, -1] = True if m.dtype == torch.bool else 0.0
    sdpa_kw = {k: kw[k] for k in ("attn_mask", "scale", "is_causal", "enable_gqa")}
    want = torch.nn.functional.scaled_dot_product_attention(
        kw["query"], kw["key"], kw["value"], **sdpa_kw
    )
    got = reference.attention_fp64(**kw)
    # Two float64 implementations of the same sums: D=5 and Nk=9 term sums, |values| ~ 1.
    torch.testing.assert_close(got, want, rtol=0, atol=ORACLE_RTOL)


def _leaves(kw):
    """Pop query/key/value (and a floating attn_mask) from ``kw`` as fresh leaves with grad."""
    names = ["query", "key", "value"]
    if kw["attn_mask"] is not None and kw["attn_mask"].dtype != torch.bool:
        names.append("attn_mask")
    return [kw.pop(n).detach().clone().requires_grad_(True) for n in names]


def _forced_chunks(mp, rows: int, kw) -> None:
    """Make ``attention_fp64`` work ``rows`` query rows at a time on this problem."""
    B, Hq = kw["query"].shape[:2]
    mp.setattr(exact_mod, "_CHUNK_ELEMS", rows * B * Hq * kw["key"].shape[2])


@given(kw=tiny_problems(max_n=12, max_d=4), chunk=st.integers(1, 12), seed=st.integers(0, 99))
def test_chunking_and_nograd_path_agree(kw, chunk, seed):
    """Any chunk size gives the same output, lse and gradients (q, k, v, additive mask, via
    both out and lse); the no-grad path equals the autograd one."""
    whole_out, whole_lse = reference.attention_fp64(**kw, return_lse=True)
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(whole_out.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(whole_lse.shape, generator=g, dtype=torch.float64)
    live = whole_lse > -torch.inf
    grads = []
    for rows in (kw["query"].shape[2], chunk):
        leaves = _leaves(dict(kw))
        args = dict(kw, **dict(zip(["query", "key", "value", "attn_mask"], leaves, strict=False)))
        with pytest.MonkeyPatch.context() as mp:
            _forced_chunks(mp, rows, kw)
            out, lse = reference.attention_fp64(**args, return_lse=True)
            assert out.requires_grad and lse.requires_grad
            # Same float64 formulas; only BLAS blocking may differ between chunk shapes.
            torch.testing.assert_close(out.detach(), whole_out, rtol=0, atol=ORACLE_RTOL)
            torch.testing.assert_close(lse.detach(), whole_lse, rtol=0, atol=ORACLE_RTOL)
            loss = (out * dout).sum() + (lse[live] * dlse[live]).sum()
            grads.append(torch.autograd.grad(loss, leaves))
    for a, b in zip(*grads, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=ORACLE_RTOL * max(b.abs().max().item(), 1.0))


@pytest.mark.parametrize(
    "shape", [(5, 6), (1, 1, 1, 6), (2, 1, 5, 1), (1, 2, 5, 6), (2, 2, 1, 6)],
    ids=["qk", "k", "bq", "hqk", "bhk"],
)
def test_gradcheck_broadcast_additive_mask(shape):
    """The mask gradient is dS summed over the broadcast dims, accumulated over query
    chunks when the mask has no query dim (2-row chunks force several of them)."""
    kw = make_problem(B=2, Hq=2, Hkv=1, Nq=5, Nk=6, D=3, seed=11, is_causal=True)
    g = torch.Generator().manual_seed(12)
    kw["attn_mask"] = torch.randn(shape, generator=g, dtype=torch.float64)
    inputs = tuple(_leaves(kw))

    def f(q, k, v, mask):
        out, lse = reference.attention_fp64(q, k, v, mask, **kw, return_lse=True)
        return out, lse

    with pytest.MonkeyPatch.context() as mp:
        _forced_chunks(mp, 2, dict(kw, query=inputs[0], key=inputs[1]))
        assert torch.autograd.gradcheck(f, inputs)


def test_autograd_saves_no_per_chunk_tensors():
    """The graph keeps q, k, v, out, the mask and two row statistics: O(N·D), no scores."""
    B, Hq, Nq, Nk, D = 1, 2, 64, 48, 4
    kw = make_problem(B=B, Hq=Hq, Hkv=1, Nq=Nq, Nk=Nk, D=D, seed=5, mask="additive")
    leaves = _leaves(kw)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with pytest.MonkeyPatch.context() as mp, torch.autograd.graph.saved_tensors_hooks(
        pack, lambda t: t
    ):
        _forced_chunks(mp, 8, dict(kw, query=leaves[0], key=leaves[1]))
        out, lse = reference.attention_fp64(*leaves, **kw, return_lse=True)
    mask_numel = B * Hq * Nq * Nk
    # q, k, v, out, m, l and the mask, each at most once.
    budget = B * Hq * Nq * D * 2 + 2 * B * 1 * Nk * D + 2 * B * Hq * Nq + mask_numel
    assert sum(saved) <= budget, saved
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in leaves)


def test_double_backward_raises():
    kw = make_problem(B=1, Hq=1, Hkv=1, Nq=3, Nk=4, D=2, seed=1)
    q = kw.pop("query").requires_grad_(True)
    out = reference.attention_fp64(q, **kw)
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(out.sum(), q, create_graph=True)


DEAD_ROW_CASES = {
    "bool_mask": dict(mask="bool"),
    "neg_inf_bias": dict(mask="additive"),
    "window_outside": dict(window=(0, 0), causal_alignment="bottom_right", Nq=6, Nk=3),
    "bottom_right_causal": dict(is_causal=True, causal_alignment="bottom_right", Nq=6, Nk=3),
}


@pytest.mark.parametrize("oracle", ["fp64", "naive"])
@pytest.mark.parametrize("case", DEAD_ROW_CASES.values(), ids=DEAD_ROW_CASES.keys())
def test_fully_masked_rows(case, oracle):
    knobs = dict(B=1, Hq=2, Hkv=2, Nq=5, Nk=5, D=3, seed=7)
    knobs.update(case)
    kw = make_problem(**knobs)
    q, k, v = (kw.pop(n).requires_grad_(True) for n in ("query", "key", "value"))
    out, lse = reference.attention_fp64(q, k, v, **kw, return_lse=True)
    dead = lse == -torch.inf
    assert dead.any(), "the case must produce a fully-masked row"
    loss = out.sum() + lse[~dead].sum()
    if oracle == "naive":
        out = reference.naive_attention(q, k, v, **kw)
        loss = out.sum()
    assert (out[dead] == 0).all()
    loss.backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[dead] == 0).all()


@given(
    Nq=st.integers(1, 9), Nk=st.integers(1, 9), is_causal=st.booleans(),
    align=st.sampled_from(["top_left", "bottom_right"]),
    window=st.none() | st.tuples(st.integers(-1, 4), st.integers(-1, 4)),
)
def test_structural_mask_definition(Nq, Nk, is_causal, align, window):
    m = reference.structural_mask(
        Nq, Nk, is_causal=is_causal, causal_alignment=align, window=window
    )
    off = 0 if align == "top_left" else Nk - Nq
    for i in range(Nq):
        for j in range(Nk):
            want = not is_causal or j <= i + off
            if window is not None:
                left, right = window
                want = want and (left == -1 or j >= i + off - left)
                want = want and (right == -1 or j <= i + off + right)
            assert bool(m[i, j]) == want, (i, j)


@given(
    kw=tiny_problems(max_n=12, max_d=6), upcast=st.booleans(), reorder_ops=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_naive_float64_matches_oracle(kw, upcast, reorder_ops, seed):
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(kw["query"].shape, generator=g, dtype=torch.float64)
    leaves = [kw.pop(n).requires_grad_(True) for n in ("query", "key", "value")]
    want = reference.attention_fp64(*leaves, **kw)
    got = reference.naive_attention(*leaves, **kw, upcast=upcast, reorder_ops=reorder_ops)
    assert got.dtype == torch.float64
    # Same float64 sums in another order (<= 12 terms): far below the oracle target.
    atol = ORACLE_RTOL * leaves[2].abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
    for a, b in zip(torch.autograd.grad(got, leaves, dout), torch.autograd.grad(want, leaves, dout),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=ORACLE_RTOL * max(b.abs().max().item(), 1.0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_naive_same_dtype_computes_in_input_dtype(dtype):
    """upcast=False keeps every intermediate in the input dtype: q·scale then q·kᵀ rounded."""
    kw = make_problem(B=1, Hq=1, Hkv=1, Nq=6, Nk=8, D=5, seed=4, dtype=dtype)
    q, k, v = kw["query"], kw["key"], kw["value"]
    scores = torch.matmul(q * (1 / math.sqrt(5)), k.transpose(-2, -1))
    want = torch.matmul(torch.softmax(scores, dim=-1), v)
    got = reference.naive_attention(q, k, v, upcast=False)
    assert got.dtype == dtype
    assert torch.equal(got, want)

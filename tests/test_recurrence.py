"""The streaming (m, ℓ) recurrence of ``reference.online``.

- folding ``online_lse_step`` over any list of floats gives its log-sum-exp (mpmath at 50
  digits), including −inf entries, all −inf lists and ±1e4, without overflow or NaN;
- the tile updates (FA2: new-frame row sum; FA1: block max and block sum merged) equal
  folding the scalar step over the tile's columns, from any starting state.
"""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
from flashcheck.reference.online import online_lse_step, tile_step_fa1, tile_step_fa2
from hypothesis import given, note
from hypothesis import strategies as st

U64 = 2.0**-53  # float64 unit roundoff

scores = st.one_of(
    st.floats(-1e4, 1e4, allow_nan=False),
    st.sampled_from([-math.inf, 1e4, -1e4, 0.0]),
)


def _fold(xs, m=-math.inf, l=0.0):
    for x in xs:
        m, l = online_lse_step(m, l, x)
    return m, l


def _mp_lse(xs) -> float:
    mpmath.mp.dps = 50
    finite = [mpmath.mpf(x) for x in xs if x != -math.inf]
    if not finite:
        return -math.inf
    return float(mpmath.log(mpmath.fsum(mpmath.exp(x) for x in finite)))


@given(xs=st.lists(scores, max_size=40))
def test_fold_equals_logsumexp(xs):
    m, l = _fold(xs)
    want = _mp_lse(xs)
    assert not math.isnan(m) and not math.isnan(l)
    if want == -math.inf:
        assert (m, l) == (-math.inf, 0.0)
        return
    got = m + math.log(l)
    # Each step rounds two exps, a product and a sum (<= 4 u relative on ℓ, compounding
    # over n steps); then log ℓ (<= log n) and m + log ℓ add u each.
    n = len(xs)
    tol = 4 * (n + 1) * U64 + U64 * (abs(m) + math.log(n) + 2)
    assert abs(got - want) <= tol, (got, want)


@pytest.mark.parametrize(
    "xs",
    [[], [-math.inf] * 5, [1e4, 1e4], [-1e4, 1e4, -math.inf], [1e4 - 1.0, 1e4, -1e4]],
    ids=["empty", "all_neg_inf", "big_ties", "mixed_extremes", "near_big"],
)
def test_fold_edge_cases(xs):
    m, l = _fold(xs)
    want = _mp_lse(xs)
    got = m + math.log(l) if l > 0 else -math.inf
    # Same derivation as above with n = len(xs) <= 5.
    assert got == want or abs(got - want) <= 24 * U64 + U64 * (abs(m) + 4)


@given(
    rows=st.integers(1, 6), cols=st.integers(1, 12), seed=st.integers(0, 2**32 - 1),
    spread=st.sampled_from([1.0, 1e4]), neg_inf=st.sampled_from([0.0, 0.3, 1.0]),
    fresh_state=st.booleans(), step=st.sampled_from(["fa2", "fa1"]),
)
def test_tile_step_equals_scalar_fold(rows, cols, seed, spread, neg_inf, fresh_state, step):
    note(dict(rows=rows, cols=cols, seed=seed, spread=spread, neg_inf=neg_inf))
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(rows, cols, generator=g, dtype=torch.float64) * spread
    s[torch.rand(rows, cols, generator=g) < neg_inf] = -torch.inf
    if fresh_state:
        m0 = torch.full((rows,), -torch.inf, dtype=torch.float64)
        l0 = torch.zeros(rows, dtype=torch.float64)
    else:
        m0 = torch.randn(rows, generator=g, dtype=torch.float64) * spread
        l0 = torch.rand(rows, generator=g, dtype=torch.float64) + 1.0
    tile = tile_step_fa2 if step == "fa2" else tile_step_fa1
    m_t, l_t = tile(m0, l0, s)[:2]
    m_f, l_f = m0, l0
    for j in range(cols):
        m_f, l_f = online_lse_step(m_f, l_f, s[:, j])
    assert torch.equal(m_t, m_f)  # a max is exact whatever the order
    assert not torch.isnan(l_t).any()
    # Both are sums of cols + 1 positive terms, each with <= 4 roundings on the way.
    torch.testing.assert_close(l_t, l_f, rtol=8 * (cols + 2) * U64, atol=0)

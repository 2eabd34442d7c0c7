"""verify.metrics on hand-made tensors: known errors, guarded relative error, ulps, bias."""

from __future__ import annotations

import math

import pytest
import torch
from flashcheck.verify.metrics import REL_GUARD_FRACTION, tensor_metrics, ulp, unit_roundoff


@pytest.mark.parametrize(
    "dtype, x, expected",
    [
        ("float16", 1.0, 2.0**-10),
        ("float16", 1.5, 2.0**-10),
        ("float16", 2.0, 2.0**-9),
        ("float16", 0.0, 2.0**-24),  # zero: the subnormal spacing
        ("float16", 2.0**-20, 2.0**-24),  # a subnormal
        ("float16", 2.0**-14, 2.0**-24),  # smallest normal: same spacing as subnormals
        ("bfloat16", 1.0, 2.0**-7),
        ("bfloat16", -3.0, 2.0**-6),
        ("bfloat16", 0.0, 2.0**-133),
        ("float32", 1.0, 2.0**-23),
        ("float32", 0.0, 2.0**-149),
    ],
)
def test_ulp(dtype, x, expected):
    assert float(ulp(torch.tensor([x], dtype=torch.float64), dtype)[0]) == expected


def test_ulp_matches_nextafter_in_each_dtype():
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        x = torch.tensor([0.3, 7.0, -1e-3, 123.0], dtype=dt)
        step = (torch.nextafter(x.abs(), torch.tensor(math.inf, dtype=dt)) - x.abs()).double()
        assert torch.equal(ulp(x.double(), dt), step)


def test_unit_roundoffs():
    assert unit_roundoff("bfloat16") == 2.0**-8
    assert unit_roundoff(torch.float16) == 2.0**-11
    assert unit_roundoff("float32") == 2.0**-24
    assert unit_roundoff("float32", tf32=True) == 2.0**-11
    with pytest.raises(ValueError, match="dtype must be one of"):
        unit_roundoff("int8")


def test_known_errors_and_bias_sign():
    want = torch.tensor([[1.0, -2.0], [4.0, 0.0]], dtype=torch.float64)
    got = (want + torch.tensor([[0.5, 0.25], [-0.125, 0.0]])).to(torch.float32)
    m = tensor_metrics(got, want, dtype="float32")
    assert m.max_abs == 0.5 and m.worst_index == (0, 0) and (m.got, m.want) == (1.5, 1.0)
    assert m.bias == pytest.approx((0.5 + 0.25 - 0.125) / 4)
    assert m.rmse == pytest.approx(math.sqrt((0.25 + 0.0625 + 0.015625) / 4))
    assert m.max_ulps == 0.5 / 2.0**-23
    neg = tensor_metrics((want - (got.double() - want)).float(), want, dtype="float32")
    assert neg.bias == -m.bias


def test_relative_error_is_guarded_near_zero():
    want = torch.tensor([1.0, 1.0, 1.0, 1e-12], dtype=torch.float64)
    got = want + torch.tensor([0.0, 0.0, 0.0, 1e-4], dtype=torch.float64)
    m = tensor_metrics(got, want, dtype="float64")
    rms = math.sqrt(3 / 4)
    assert m.max_rel == pytest.approx(1e-4 / (REL_GUARD_FRACTION * rms))


def test_nonfinite_counted_and_matching_infinities_ignored():
    want = torch.tensor([1.0, -math.inf, 2.0], dtype=torch.float64)
    got = torch.tensor([1.0, -math.inf, math.nan])
    m = tensor_metrics(got, want, dtype="float32")
    assert m.n_nonfinite == 1 and m.worst_index == (2,) and m.max_abs == math.inf
    ok = tensor_metrics(torch.tensor([1.0, -math.inf, 2.0]), want, dtype="float32")
    assert ok.n_nonfinite == 0 and ok.max_abs == 0.0

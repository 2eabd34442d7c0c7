"""CPU tests of ``scripts/gpu/long_seq.py`` (the 65536-token kernel-vs-oracle check).

The script is run in-process at N = 256 under the Triton interpreter in fp16 (bf16 is
``not_run`` there), with the kernel made to raise on the causal configuration, so that
one run covers a measured configuration, an error that is recorded while the run goes
on, a skipped dtype and the JSON file. ``tensor_errors`` is checked on tensors whose
errors are known exactly.
"""

from __future__ import annotations

import json
import math
import pathlib

import pytest
import torch

from flashcheck import kernels, reference
from tests.script_modules import load

_PATH = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "long_seq.py"
long_seq = load(_PATH)


# See test_cpu_run_records_every_configuration: three roundings of size u (Minkowski).
RATIO_SCALE_MAX = 3.0


def _fp16_inputs(n: int, d: int):
    return [t.double() for t in long_seq._inputs(n, d, torch.float16, 0, "cpu")]


def _score_abs_max(n: int, d: int) -> float:
    """scale·max‖q‖·max‖k‖ (Cauchy-Schwarz), from the inputs the script draws (seed 0)."""
    q, k, _, _ = _fp16_inputs(n, d)
    return float(q.norm(dim=-1).max() * k.norm(dim=-1).max()) / math.sqrt(d)


def _v_abs_max(n: int, d: int) -> float:
    return float(_fp16_inputs(n, d)[2].abs().max())


def test_tensor_errors_on_known_errors():
    want = torch.tensor([1.0, -2.0, 0.0, 2.0], dtype=torch.float64)
    got = (want + torch.tensor([0.0, 0.5, -0.5, 0.0], dtype=torch.float64)).half()
    e = long_seq.tensor_errors(got, want, u=2.0**-11, length=4)
    assert e["finite"]
    assert e["max_abs"] == 0.5 and e["max_ref"] == 2.0 and e["rel_max"] == 0.25
    assert e["rmse"] == pytest.approx(math.sqrt(0.5 / 4), rel=1e-15)
    assert e["rms_ref"] == pytest.approx(math.sqrt(9 / 4), rel=1e-15)
    assert e["scale_rms"] == pytest.approx(1.5 * (2.0**-11 + 2.0**-24 * 2), rel=1e-15)
    assert e["ratio_scale"] == pytest.approx(e["rmse"] / e["scale_rms"], rel=1e-15)
    nan = long_seq.tensor_errors(torch.full((2,), math.nan), want[:2], u=2.0**-11, length=2)
    assert not nan["finite"]
    exact = long_seq.tensor_errors(torch.zeros(3), torch.zeros(3, dtype=torch.float64),
                                   u=2.0**-11, length=3)
    assert exact["rel_max"] == 0.0 and exact["ratio_scale"] == 0.0


def test_cpu_run_records_every_configuration(tmp_path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the CPU path of the script is exercised on CPU-only machines")
    real = kernels.attention

    def causal_breaks(q, k, v, *, is_causal):
        if is_causal:
            raise RuntimeError("injected failure")
        return real(q, k, v, is_causal=is_causal)

    causal_breaks.capabilities = real.capabilities
    monkeypatch.setattr(kernels, "attention", causal_breaks)
    out = tmp_path / "ls.json"
    n, d = 256, 16
    rc = long_seq.main(["--device", "cpu", "--n", str(n), "--d", str(d),
                        "--dtypes", "float16,bfloat16", "--kernel-repeats", "1",
                        "--out", str(out)])
    assert rc == 1  # the injected error counts as a failed configuration
    doc = json.loads(out.read_text())
    by_key = {(r["dtype"], r["causal"]): r for r in doc["results"]}
    assert set(by_key) == {(dt, c) for dt in ("float16", "bfloat16") for c in (False, True)}
    assert by_key["float16", True]["status"] == "error"
    assert "injected failure" in by_key["float16", True]["error"]
    assert all(by_key["bfloat16", c]["status"] == "not_run" for c in (False, True))

    rec = by_key["float16", False]
    assert rec["status"] == "ok"
    for part in ("kernel", "oracle"):
        assert rec[part]["fwd_s"] > 0 and rec[part]["bwd_s"] > 0
    assert rec["kernel"]["first_call_s"] == rec["kernel"]["fwd_s"] + rec["kernel"]["bwd_s"]
    assert rec["host_peak_rss_mib"] > 0
    assert rec["baseline_backend"] in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
    for name in long_seq.TENSORS:
        t = rec["tensors"][name]
        assert t["finite"] and t["max_ref"] > 0 and t["base_max_abs"] > 0
        # At most three roundings of relative size <= u on each element's path (the P or dS
        # operand, the P inside dS, the result) plus the accumulation: by Minkowski the
        # RMS error is <= 3·rms(ref)·(u + u_a·sqrt(L)) = 3·scale_rms. Measured: about 0.6.
        assert 0 < t["ratio_scale"] <= RATIO_SCALE_MAX, (name, t)
    out_t = rec["tensors"]["out"]
    assert out_t["bound"] == reference.emulate_error_bound(
        torch.float16, D=d, N=n, score_abs_max=_score_abs_max(n, d), v_abs_max=_v_abs_max(n, d)
    )
    assert 0 < out_t["ratio_bound"] <= 1

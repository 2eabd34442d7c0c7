"""CPU tests of the GPU diagnosis scripts ``scripts/gpu/subnormals.py`` and
``scripts/gpu/math_stages.py``: both compare a device against the CPU, so with
``--device cpu`` every difference must be zero, and the tables must be complete."""

from __future__ import annotations

import json
import pathlib

import pytest
from flashcheck.verify.cases import Case

from tests.script_modules import load

_GPU = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "gpu"


def _load(name: str):
    return load(_GPU / f"{name}.py")


def test_subnormal_probe_covers_every_dtype_and_op(tmp_path):
    out = tmp_path / "subnormals.json"
    assert _load("subnormals").main(["--device", "cpu", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    ops = {r["op"] for r in rows}
    assert {"mul (elementwise)", "fp32 -> dtype", "index_add_ (atomics)",
            "softmax backward"} <= ops
    assert {r["dtype"] for r in rows} == {"float32", "bfloat16", "float16"}
    # Every probe has subnormal exact results to lose, and the CPU keeps them where the
    # operation is elementwise (matmuls may legitimately differ: oneDNN's bf16 GEMM flushes).
    assert all(r["nonzero_exact"] > 0 for r in rows)
    for r in rows:
        if r["op"] in ("mul (elementwise)", "fp32 -> dtype"):
            assert r["flushed_to_zero"] == 0 and r["max_err_in_subnormal_spacings"] == 0, r


def test_math_stages_cpu_against_cpu_is_exact(tmp_path):
    case = Case(B=1, Hq=2, Hkv=2, Nq=9, Nk=13, D=8, dtype="float32", is_causal=True,
                grad_dist={"kind": "tiny", "factor": 1.0}, seed=3)
    path = tmp_path / "case.json"
    path.write_text(json.dumps({"format": "flashcheck-case", "version": 1,
                                "case": case.to_dict()}))
    out = tmp_path / "stages.json"
    assert _load("math_stages").main([str(path), "--device", "cpu", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    stages, backend = rows[:7], rows[7:]
    assert [r["stage"].split(" ")[0] for r in stages] == ["S", "P", "dP", "dS", "dQ", "dK", "dV"]
    assert all(r["max_diff"] == 0 and r["nonfinite_mismatch"] == 0 for r in stages), stages
    # The backend itself: device against CPU (here the same) is exact; against float64 each
    # gradient has its rounding error, small and finite.
    assert [r["stage"] for r in backend] == [f"backend {n}: {w}" for n in ("dq", "dk", "dv")
                                             for w in ("device", "cpu", "device vs cpu")]
    for r in backend:
        if r["stage"].endswith("device vs cpu"):
            assert r["max_diff"] == 0, r
        else:
            assert 0 <= r["max_diff"] < 1e-5, r


def test_math_stages_rejects_gqa(tmp_path):
    case = Case(B=1, Hq=4, Hkv=2, Nq=4, Nk=4, D=8, dtype="float32", seed=1)
    path = tmp_path / "case.json"
    path.write_text(json.dumps({"format": "flashcheck-case", "version": 1,
                                "case": case.to_dict()}))
    with pytest.raises(SystemExit, match="Hq = Hkv"):
        _load("math_stages").main([str(path), "--device", "cpu"])

"""Tests of verify.report on verdict dicts of the documented shape (``Verdict.to_dict()``).

The dicts are built by hand here so every aggregated number has a known answer; a test at the
end feeds real verdicts from ``check_case`` through the same path.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re

import pytest
from flashcheck.verify import report as R

HEADER = {"kernel": "triton", "device": "cpu", "gpu": None,
          "versions": {"flashcheck": "0.1.0", "torch": "2.x"}, "date": "2025-01-01T00:00:00",
          "command": "flashcheck run"}


def _tensor(max_abs: float, tol: float, *, apriori: float = 1e-2, baseline: float = 1e-3):
    ratio = max_abs / tol
    return {"max_abs": max_abs, "max_rel": max_abs, "rmse": max_abs / 3, "bias": 0.0,
            "max_ulps": 2.0, "worst_index": [0, 0, 0, 0], "got": 1.0, "want": 1.0,
            "n_bad": int(ratio > 1), "numel": 64, "tol": tol, "baseline_err": baseline,
            "apriori": apriori, "ratio": ratio, "ratio_apriori": max_abs / apriori,
            "passed": ratio <= 1, "note": ""}


def _verdict(dtype: str, n: int, status: str, errs: dict[str, float] | None = None, *,
             tol: float = 1e-3, reason: str = "", failure: str | None = None,
             case_file: str | None = None):
    key = {"dtype": dtype, "D": "D<=64", "N": f"N<={n}", "causal": False, "mask": "none",
           "dist": "normal", "gqa": False}
    tensors = {name: _tensor(e, tol) for name, e in (errs or {}).items()}
    if status == "fail" and failure is None:
        failure = "numerical"
    return {"case": {"dtype": dtype, "Nq": n, "Nk": n, "D": 32, "seed": 1},
            "kernel": "triton", "device": "cpu", "status": status, "failure": failure,
            "reason": reason, "tensors": tensors, "timings": {}, "config": key,
            "summary": f"{status} {dtype} N={n}", "case_file": case_file}


@pytest.fixture
def verdicts(tmp_path):
    failing = tmp_path / "failures" / "abc.json"
    return [
        _verdict("float16", 64, "pass", {"out": 4e-4, "dq": 2e-4}),
        _verdict("float16", 64, "pass", {"out": 9e-4, "dq": 1e-4}),
        _verdict("float16", 128, "pass", {"out": 1e-4}),
        _verdict("float16", 128, "fail", {"out": 3e-3}, case_file=str(failing)),
        _verdict("float16", 128, "not_run", reason="interpreter bf16 arithmetic is wrong"),
        _verdict("bfloat16", 64, "not_run", reason="interpreter bf16 arithmetic is wrong"),
        _verdict("bfloat16", 64, "not_run", reason="interpreter bf16 arithmetic is wrong"),
    ]


def _config(rep, dtype, n):
    (c,) = [c for c in rep["configs"] if c["key"]["dtype"] == dtype and c["key"]["N"] ==
            f"N<={n}"]
    return c


def test_aggregates_worst_case_per_tensor_and_status(verdicts):
    rep = R.build_report(verdicts, header=HEADER)
    assert rep["summary"] == {"cases": 7, "pass": 3, "fail": 1, "not_run": 3, "configs": 3,
                              "configs_failed": 1, "configs_not_run": 1}
    small = _config(rep, "float16", 64)
    assert small["status"] == "pass" and small["cases"] == 2
    assert small["tensors"]["out"]["max_abs"] == pytest.approx(9e-4)
    assert small["tensors"]["out"]["ratio"] == pytest.approx(0.9)
    assert small["tensors"]["dq"]["max_abs"] == pytest.approx(2e-4)
    assert small["worst_ratio"] == pytest.approx(0.9)
    assert list(small["tensors"]) == ["out", "dq"]
    big = _config(rep, "float16", 128)
    assert big["status"] == "fail"
    assert big["counts"] == {"pass": 1, "fail": 1, "not_run": 1}
    assert big["tensors"]["out"]["failed"] == 1 and not big["tensors"]["out"]["passed"]
    assert big["worst_ratio"] == pytest.approx(3.0)
    assert big["not_run"] == [{"reason": "interpreter bf16 arithmetic is wrong", "count": 1}]
    skipped = _config(rep, "bfloat16", 64)
    assert skipped["status"] == "not_run" and skipped["tensors"] == {}
    assert skipped["worst_ratio"] is None
    assert {"config": skipped["label"], "reason": "interpreter bf16 arithmetic is wrong",
            "count": 2} in rep["not_run"]


def test_failure_without_numbers_counts_as_unbounded():
    v = _verdict("float32", 64, "fail", failure="input_mutated")
    rep = R.build_report([v], header=HEADER)
    assert rep["configs"][0]["worst_ratio"] == math.inf
    assert rep["failures"][0]["failure"] == "input_mutated"


def test_nan_ratio_ranks_worst():
    v = _verdict("float32", 64, "fail", {"out": 1e-5, "dq": 1e-5})
    v["tensors"]["dq"].update(max_abs=math.nan, ratio=math.nan, passed=False)
    rep = R.build_report([v], header=HEADER)
    assert math.isnan(rep["configs"][0]["tensors"]["dq"]["ratio"])
    assert math.isinf(rep["configs"][0]["worst_ratio"]) or math.isnan(
        rep["configs"][0]["worst_ratio"])
    assert R.render_terminal_table(rep).splitlines()[1].split()[-2] == "dq"


def test_writes_three_files_self_contained(verdicts, tmp_path):
    rep = R.build_report(verdicts, header=HEADER)
    out = tmp_path / "rep"
    paths = R.write_report(rep, out)
    assert sorted(p.name for p in paths.values()) == ["report.html", "report.json",
                                                      "report.md"]
    back = R.load_report(paths["json"])
    assert back["summary"] == rep["summary"]
    page = paths["html"].read_text()
    # Self-contained: no external scripts, stylesheets or images.
    assert not re.search(r'<(script|link)\b', page)
    srcs = re.findall(r'src="([^"]+)"', page)
    assert len(srcs) == 3 and all(s.startswith("data:image/png;base64,") for s in srcs)
    for s in srcs:
        assert base64.b64decode(s.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    assert 'class="fail"' in page and 'class="not_run"' in page and 'class="pass"' in page
    for text in ("interpreter bf16 arithmetic is wrong", "flashcheck repro", "flashcheck run"):
        assert text in page
    # A case file outside the report directory keeps its absolute path.
    assert f'href="{tmp_path / "failures" / "abc.json"}"' in page
    md = paths["md"].read_text()
    row = "| float16 | D<=64 | N<=128 | False | none | normal | False | 3 | fail: 1/3 cases, "
    assert row + "1 not run |" in md
    assert "flashcheck repro" in md and "interpreter bf16 arithmetic is wrong" in md


def test_failure_link_is_relative_when_inside_out_dir(tmp_path):
    case_file = tmp_path / "failures" / "abc.json"
    rep = R.build_report([_verdict("float16", 64, "fail", {"out": 1.0},
                                   case_file=str(case_file))], header=HEADER)
    paths = R.write_report(rep, tmp_path)
    assert 'href="failures/abc.json"' in paths["html"].read_text()
    assert "[failures/abc.json](failures/abc.json)" in paths["md"].read_text()


def test_non_finite_numbers_round_trip_through_json(tmp_path):
    v = _verdict("float32", 64, "fail", {"out": 1e-5})
    v["tensors"]["out"].update(max_abs=math.inf, ratio=math.inf, passed=False)
    paths = R.write_report(R.build_report([v], header=HEADER), tmp_path)
    json.loads(paths["json"].read_text(), parse_constant=pytest.fail)  # strict JSON
    back = R.load_report(paths["json"])
    assert R._f(back["configs"][0]["tensors"]["out"]["max_abs"]) == math.inf


def test_compare_table(verdicts, tmp_path):
    a = R.write_report(R.build_report(verdicts, header=HEADER), tmp_path / "a")["json"]
    other = [_verdict("float16", 64, "pass", {"out": 5e-4}),
             _verdict("float32", 64, "pass", {"out": 1e-7}, tol=1e-6)]
    b = R.write_report(R.build_report(other, header={**HEADER, "kernel": "online"}),
                       tmp_path / "b")["json"]
    table = R.compare_reports([a, b])
    lines = table.splitlines()
    assert "| configuration | triton (cpu) | online (cpu) |" in lines
    row = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]]
           for ln in lines if ln.startswith("| `")}
    f16_small = row["`dtype=float16 D=D<=64 N=N<=64 causal=False mask=none dist=normal "
                    "gqa=False`"]
    assert f16_small == ["0.9 pass", "0.5 pass"]
    assert row["`dtype=float16 D=D<=64 N=N<=128 causal=False mask=none dist=normal "
               "gqa=False`"] == ["3 **FAIL**", "-"]
    assert row["`dtype=float32 D=D<=64 N=N<=64 causal=False mask=none dist=normal "
               "gqa=False`"][0] == "-"
    assert row["`dtype=bfloat16 D=D<=64 N=N<=64 causal=False mask=none dist=normal "
               "gqa=False`"][0].startswith("not run (")


@pytest.mark.parametrize("content", ["{not json", '{"format": "other"}'])
def test_load_report_rejects_non_reports(tmp_path, content):
    p = tmp_path / "r.json"
    p.write_text(content)
    with pytest.raises(ValueError, match="report file"):
        R.load_report(p)


@pytest.mark.parametrize(("x", "text"), [(0.0, "0"), (0.25, "0.25"), (1.5e-5, "1.5e-05"),
                                         (math.inf, "inf"), ("nan", "nan"), (None, "-")])
def test_fmt(x, text):
    assert R.fmt(x) == text


def test_header_records_the_settings_the_run_took(monkeypatch, tmp_path):
    """The ``FLASHCHECK_*`` variables of the run (the Gluon path and schedule among them) go
    into the header and every rendering of it: a report on a candidate schedule says so."""
    for k in [k for k in os.environ if k.startswith("FLASHCHECK_")]:
        monkeypatch.delenv(k)
    plain = R.make_header(kernel="triton", device="cpu", command="flashcheck gate")
    assert plain["settings"] == {}
    assert "- settings: none" in R.render_markdown(R.build_report([], header=plain))
    monkeypatch.setenv("FLASHCHECK_GLUON_SCHEDULE", "64=early")
    monkeypatch.setenv("FLASHCHECK_GLUON", "tile")
    h = R.make_header(kernel="triton", device="cpu", command="flashcheck gate")
    assert h["settings"] == {"FLASHCHECK_GLUON": "tile", "FLASHCHECK_GLUON_SCHEDULE": "64=early"}
    paths = R.write_report(R.build_report([], header=h), tmp_path)
    md = open(paths["md"]).read()
    assert "- settings: `FLASHCHECK_GLUON=tile` `FLASHCHECK_GLUON_SCHEDULE=64=early`" in md
    assert "FLASHCHECK_GLUON=tile FLASHCHECK_GLUON_SCHEDULE=64=early" in open(paths["html"]).read()
    assert json.load(open(paths["json"]))["header"]["settings"] == h["settings"]

"""``scripts/classify_failures.py``: a sweep's failures sorted into the divergence classes of
docs/reports/README.md from their case files."""

from __future__ import annotations

import json
import pathlib

from flashcheck.verify.cases import Case

from tests.script_modules import load

_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "classify_failures.py"


def _load():
    return load(_SCRIPT)


# Batch 0 has no allowed key at all (every one of its query rows is dead); batch 1 has 3.
PADDED = Case(B=2, Hq=1, Hkv=1, Nq=4, Nk=5, D=2, dtype="float16",
              mask={"kind": "key_padding", "lengths": [0, 3]})


def _summary(name: str, idx: tuple[int, ...]) -> str:
    return (f"{name}: 1/40 elements off (worst at [{', '.join(map(str, idx))}]: got 1, want 0,"
            " |err| 1 > tol 0.1 = 3 × baseline 0.03); replay: flashcheck repro x.json")


def test_a_failure_counts_as_a_masked_row_only_where_its_worst_element_is_in_one():
    cf = _load()
    assert cf.worst_in_dead_row(PADDED, _summary("out", (0, 0, 2, 1)))
    assert cf.worst_in_dead_row(PADDED, _summary("dq", (0, 0, 3, 0)))
    assert not cf.worst_in_dead_row(PADDED, _summary("out", (1, 0, 2, 1)))  # batch 1: 3 keys
    assert not cf.worst_in_dead_row(PADDED, _summary("dk", (0, 0, 2, 1)))  # a key index
    assert not cf.worst_in_dead_row(PADDED, "out: rmse 1e-3 > tol 5e-4")  # no element off


def test_classify_reads_a_sweeps_report_and_case_files(tmp_path, capsys):
    cf = _load()
    tiny = Case(B=1, Hq=1, Hkv=1, Nq=3, Nk=3, D=2, dtype="bfloat16",
                grad_dist={"kind": "tiny", "factor": 1.0})
    plain = Case(B=1, Hq=1, Hkv=1, Nq=3, Nk=3, D=2, dtype="float16")
    run = tmp_path / "sdpa-x"
    (run / "failures").mkdir(parents=True)
    failures, configs = [], []
    for i, (case, summary) in enumerate([(PADDED, _summary("out", (0, 0, 1, 0))),
                                         (tiny, _summary("dq", (0, 0, 1, 0))),
                                         (plain, _summary("dk", (0, 0, 2, 1)))]):
        path = run / "failures" / f"numerical-{i}.json"
        path.write_text(json.dumps({"format": "flashcheck-case", "version": 1,
                                    "case": case.to_dict()}))
        failures.append({"config": f"c{i}", "failure": "numerical", "summary": summary,
                         "case_file": f"/elsewhere/failures/numerical-{i}.json"})
        configs.append({"label": f"c{i}", "worst_ratio": 2.0 + i,
                        "tensors": {"out": {"passed": i != 0}, "dk": {"passed": i != 2}}})
    (run / "report.json").write_text(json.dumps({"summary": {}, "configs": configs,
                                                 "failures": failures}))
    out = tmp_path / "classes.json"
    assert cf.main([str(run), "--out", str(out)]) == 0
    (result,) = json.loads(out.read_text())
    assert result["kernel"] == "sdpa-x"
    assert result["classes"] == {"1. fully-masked rows": 1, "2. subnormals": 1, "5. other": 1}
    (other,) = result["other"]
    assert other["worst_ratio"] == 4.0 and other["tensors"] == ["dk"]
    assert "| sdpa-x | 1 | 1 | 1 |" in capsys.readouterr().out

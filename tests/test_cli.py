"""Tests of the ``flashcheck`` command line.

Usage errors are checked in-process through ``main(argv)`` (exit 2, one line on stderr, no
traceback) and once through a real subprocess. The working commands run against small
pure-PyTorch kernels written into the test's temporary directory (fast, and no Triton), with
``fixed_sweep`` replaced by a three-case sweep where a whole sweep would be too slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from flashcheck.verify import cli
from flashcheck.verify.cases import Case, load_case_file, save_case_file, save_tensors
from flashcheck.verify.fuzz import signature

KERNELS = textwrap.dedent("""
    import torch
    import torch.nn.functional as F


    def good(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                              is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)


    def long_rows_off(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                      scale=None, enable_gqa=False):
        # Wrong by 1% once there are more than 8 query rows: a bug the shrinker should
        # pin to Nq = 9.
        out = good(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        return out * 1.01 if query.shape[-2] > 8 else out

    not_callable = 3
""")


@pytest.fixture
def kfile(tmp_path) -> Path:
    p = tmp_path / "kern.py"
    p.write_text(KERNELS)
    return p


@pytest.fixture(autouse=True)
def _keep_env(monkeypatch):
    """``main`` sets TRITON_INTERPRET for --device cpu; restore it after each test."""
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))


SMALL = Case(B=1, Hq=2, Hkv=2, Nq=12, Nk=12, D=16, dtype="float32", seed=3)
TINY = Case(B=1, Hq=2, Hkv=2, Nq=5, Nk=7, D=8, dtype="float32", is_causal=True, seed=4)


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# --------------------------------------------------------------------------- usage errors


def _bad_json(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('{"format": "flashcheck-case", "version": 1, "case": {"B": 1')
    return [str(p)]


def _bad_case_field(tmp_path):
    p = tmp_path / "bad_field.json"
    doc = {"format": "flashcheck-case", "version": 1, "case": {**SMALL.to_dict(), "D": 0}}
    p.write_text(json.dumps(doc))
    return [str(p)]


@pytest.mark.parametrize(("argv", "needle"), [
    (["run", "--kernel", "no_such_kernel", "--device", "cpu"], "no_such_kernel"),
    (["run", "--kernel", "{kfile}:missing", "--device", "cpu"], "missing"),
    (["run", "--kernel", "{tmp}/nofile.py:attention", "--device", "cpu"], "nofile.py"),
    (["repro", "{bad_json}", "--kernel", "{kfile}:good", "--device", "cpu"], "JSON"),
    (["repro", "{bad_field}", "--kernel", "{kfile}:good", "--device", "cpu"], "D must be"),
    (["repro", "{tmp}/absent.json", "--device", "cpu"], "absent.json"),
    (["repro", "--device", "cpu"], "exactly one"),
    (["fuzz", "--kernel", "online", "--examples", "0"], "--examples"),
    (["fuzz", "--kernel", "online", "--minutes", "-1"], "--minutes"),
    (["fuzz", "--kernel", "online", "--minutes", "nan"], "--minutes"),
    (["fuzz", "--kernel", "online", "--examples", "5", "--minutes", "1"], "not allowed"),
    (["fuzz", "--kernel", "online", "--seed", "-3"], "--seed"),
    (["fuzz", "--device", "cpu"], "--kernel"),
    (["run", "--device", "tpu"], "--device"),
    (["gate", "--kernel", "online", "--device", "cpu", "--budgets", "{tmp}/none.json"],
     "none.json"),
    (["compare", "{bad_json}"], "report file"),
    (["nonsense"], "invalid choice"),
])
def test_usage_errors_exit_2_with_one_line(argv, needle, tmp_path, kfile, capsys):
    subst = {"kfile": kfile, "tmp": tmp_path, "bad_json": _bad_json(tmp_path)[0],
             "bad_field": _bad_case_field(tmp_path)[0]}
    argv = [a.format(**subst) for a in argv]
    assert cli.main(argv) == 2
    assert needle in _one_line_error(capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_asked_where_there_is_none(capsys):
    assert cli.main(["run", "--device", "cuda"]) == 2
    assert "no CUDA device" in _one_line_error(capsys)


def test_subprocess_usage_error_has_no_traceback():
    r = subprocess.run([sys.executable, "-m", "flashcheck", "fuzz", "--kernel", "nope:x",
                        "--examples", "3", "--device", "cpu"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


# --------------------------------------------------------------------------- repro


@pytest.mark.parametrize(("attr", "case", "rc"), [
    ("good", SMALL, 0), ("long_rows_off", SMALL, 1), ("long_rows_off", TINY, 0)])
def test_repro_exit_status(attr, case, rc, tmp_path, kfile, capsys):
    path = tmp_path / "case.json"
    save_case_file(path, case, kernel=f"{kfile}:{attr}", device="cpu")
    assert cli.main(["repro", str(path), "--device", "cpu"]) == rc
    out = capsys.readouterr().out
    assert "| tensor" in out and "| dq" in out  # the per-tensor table
    assert ("NO" in out) == (rc == 1)


def test_repro_family_full_names_the_member_behind_each_tolerance(tmp_path, kfile, capsys):
    """`repro --family full` judges a passing case against every member: the table's
    member column then names which implementation choice sets each tensor's tolerance,
    where the default (lazy) judges a pass against the baseline member alone."""
    import re

    path = tmp_path / "case.json"
    save_case_file(path, Case(B=1, Hq=4, Hkv=2, Nq=40, Nk=40, D=16, dtype="float16",
                              seed=5), kernel=f"{kfile}:good", device="cpu")

    def members(argv) -> set[str]:
        assert cli.main(["repro", str(path), "--device", "cpu", *argv]) == 0
        rows = [ln for ln in capsys.readouterr().out.splitlines()
                if re.match(r"\| (out|dq|dk|dv) ", ln)]
        assert len(rows) == 4
        return {m for ln in rows for m in re.findall(r"\((\w+)\) +\|", ln)}

    assert members([]) == {"fa2_128"}
    full = members(["--family", "full"])
    assert full and full != {"fa2_128"}
    assert cli.main(["repro", str(path), "--device", "cpu", "--family", "all"]) == 2
    assert "--family: invalid choice: 'all'" in capsys.readouterr().err


def test_repro_not_run_is_bisect_skip(tmp_path, capsys):
    # A kernel that rejects fp16 with a clear exception: the case is outside its domain.
    src = tmp_path / "f32only.py"
    src.write_text(KERNELS + textwrap.dedent("""
        def f32_only(query, key, value, **kw):
            if query.dtype != torch.float32:
                raise NotImplementedError("dtype: only float32 is supported")
            return good(query, key, value, **kw)
    """))
    path = tmp_path / "case.json"
    save_case_file(path, Case(B=1, Hq=1, Hkv=1, Nq=4, Nk=4, D=8, dtype="float16"))
    assert cli.main(["repro", str(path), "--kernel", f"{src}:f32_only", "--device", "cpu"]) \
        == 125
    assert "not run" in capsys.readouterr().out


@pytest.mark.parametrize("suffix", [".npz", ".pt"])
def test_repro_captured_tensors(suffix, tmp_path, kfile, capsys):
    tensors = tmp_path / f"captured{suffix}"
    save_tensors(tensors, TINY.materialize("cpu"))
    base = ["repro", "--tensors", str(tensors), "--device", "cpu", "--is-causal"]
    assert cli.main([*base, "--kernel", f"{kfile}:good"]) == 0
    # The same tensors without --is-causal: the kernel is asked a non-causal question and
    # answers it correctly, so it still passes; the wrong kernel fails on 9+ rows only.
    assert cli.main(["repro", "--tensors", str(tensors), "--device", "cpu",
                     "--kernel", f"{kfile}:good"]) == 0
    assert "tensors=captured" in capsys.readouterr().out
    big = tmp_path / f"big{suffix}"
    save_tensors(big, SMALL.materialize("cpu"))
    assert cli.main(["repro", "--tensors", str(big), "--device", "cpu",
                     "--kernel", f"{kfile}:long_rows_off"]) == 1


def test_repro_case_file_with_tensors_beside_it(tmp_path, kfile):
    path = tmp_path / "reg.json"
    save_case_file(path, SMALL, kernel=f"{kfile}:long_rows_off", device="cpu")
    # The tensor file beside the case file supplies the inputs (same shapes as the case).
    save_tensors(tmp_path / "reg.npz", SMALL.materialize("cpu"))
    assert cli.main(["repro", str(path)]) == 1
    assert cli.main(["repro", str(path), "--kernel", f"{kfile}:good"]) == 0


SETTING_KERNEL = textwrap.dedent("""
    import os

    # read once at import, as the Gluon kernels read FLASHCHECK_GLUON_SCHEDULE
    OFF = os.environ.get("FLASHCHECK_TEST_PATH") == "one_percent_off"


    def by_setting(query, key, value, **kw):
        out = good(query, key, value, **kw)
        return out * 1.01 if OFF else out
""")


def test_a_failure_under_a_setting_records_it_and_replays_under_it(tmp_path, kfile, capsys,
                                                                    monkeypatch):
    """The kernels' FLASHCHECK_* settings of the run go into its case files (the written
    one and the log's JSON line); `repro` sets them for its worker where its own
    environment has no such variable, and one set there, even empty, wins."""
    import re

    src = tmp_path / "setting.py"
    src.write_text(KERNELS + SETTING_KERNEL)
    monkeypatch.setenv("FLASHCHECK_TEST_PATH", "one_percent_off")
    out = tmp_path / "fz"
    assert cli.main(["fuzz", "--kernel", f"{src}:by_setting", "--device", "cpu",
                     "--examples", "30", "--seed", "7", "--max-n", "16", "--dtypes", "float32",
                     "--out", str(out), "--quiet"]) == 1
    [path] = sorted((out / "failures").glob("*.json"))
    assert load_case_file(path)[1]["settings"] == {"FLASHCHECK_TEST_PATH": "one_percent_off"}
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if x.startswith("  json:   "))
    assert json.loads(line.split("json:   ", 1)[1])["settings"] == {
        "FLASHCHECK_TEST_PATH": "one_percent_off"}
    assert re.search(r"env .*FLASHCHECK_TEST_PATH=one_percent_off flashcheck repro", printed)

    monkeypatch.delenv("FLASHCHECK_TEST_PATH")
    assert cli.main(["repro", str(path)]) == 1  # the case file's setting, set for the worker
    printed = capsys.readouterr().out
    assert "set:    FLASHCHECK_TEST_PATH=one_percent_off (from the case file)" in printed
    assert "FLASHCHECK_TEST_PATH" not in os.environ  # this process's environment untouched
    monkeypatch.setenv("FLASHCHECK_TEST_PATH", "")
    assert cli.main(["repro", str(path)]) == 0  # the environment's (empty) wins
    assert ("set:    FLASHCHECK_TEST_PATH= (from the environment; the case file's: "
            "one_percent_off)") in capsys.readouterr().out

    doc = json.loads(path.read_text())
    for bad in ({"PATH": "/tmp"}, {"FLASHCHECK_CONTROL_SEED": "1"}, ["FLASHCHECK_GLUON"],
                {"FLASHCHECK_GLUON": 1}):
        path.write_text(json.dumps({**doc, "settings": bad}))
        assert cli.main(["repro", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"{path}: settings must map FLASHCHECK_* variable names" in err, err


# --------------------------------------------------------------------------- fuzz


def test_fuzz_finds_shrinks_and_writes_the_failure(tmp_path, kfile, capsys):
    out = tmp_path / "fz"
    rc = cli.main(["fuzz", "--kernel", f"{kfile}:long_rows_off", "--device", "cpu",
                   "--examples", "60", "--seed", "7", "--max-n", "32", "--dtypes", "float32",
                   "--out", str(out), "--quiet"])
    assert rc == 1
    files = sorted((out / "failures").glob("*.json"))
    assert len(files) == 1
    case, meta = load_case_file(files[0])
    assert case.Nq == 9  # shrunk to the smallest failing shape
    assert meta["kernel"] == f"{kfile}:long_rows_off" and meta["device"] == "cpu"
    assert meta["verdict"]["status"] == "fail" and meta["versions"]["torch"]
    assert files[0].with_suffix(".md").exists()
    printed = capsys.readouterr().out
    assert "flashcheck repro" in printed and "FAIL" in printed
    # The written case replays as a failure.
    assert cli.main(["repro", str(files[0])]) == 1
    # ... and so does its one-line JSON in the log, saved as a file (a CI run's files go)
    line = next(x for x in printed.splitlines() if x.startswith("  json:   "))
    (tmp_path / "from_log.json").write_text(line.split("json:   ", 1)[1])
    assert load_case_file(tmp_path / "from_log.json")[0] == case
    assert cli.main(["repro", str(tmp_path / "from_log.json")]) == 1


def test_fuzz_reuse_compiled_finds_and_shrinks_the_failure(tmp_path, kfile):
    """--reuse-compiled runs in rounds whose draws mostly repeat compile keys already run;
    the free draws still reach the failing shapes, which shrink as without it."""
    out = tmp_path / "fz"
    rc = cli.main(["fuzz", "--kernel", f"{kfile}:long_rows_off", "--device", "cpu",
                   "--examples", "120", "--seed", "7", "--max-n", "32", "--dtypes", "float32",
                   "--reuse-compiled", "--out", str(out), "--quiet"])
    assert rc == 1
    files = sorted((out / "failures").glob("*.json"))
    assert len(files) == 1 and load_case_file(files[0])[0].Nq == 9
    from flashcheck.verify.fuzz import reuse_round

    assert [reuse_round(i) for i in range(6)] == [2, 4, 8, 16, 20, 20]


def test_fuzz_unseeded_saves_to_the_example_database(tmp_path, kfile):
    out = tmp_path / "fz"
    argv = ["fuzz", "--kernel", f"{kfile}:long_rows_off", "--device", "cpu", "--examples",
            "40", "--max-n", "16", "--dtypes", "float32", "--out", str(out), "--quiet"]
    assert cli.main(argv) == 1
    saved = [p for p in (out / "hypothesis-db").rglob("*") if p.is_file()]
    assert saved  # the shrunk failure is kept, and a rerun replays it first


def test_fuzz_keep_going_collects_distinct_failures(tmp_path, kfile, capsys):
    out = tmp_path / "fz"
    rc = cli.main(["fuzz", "--kernel", f"{kfile}:long_rows_off", "--device", "cpu",
                   "--examples", "40", "--seed", "2", "--max-n", "16", "--keep-going",
                   "--dtypes", "float32", "float16", "--out", str(out), "--quiet"])
    assert rc == 1
    files = sorted((out / "failures").glob("*.json"))
    assert len(files) >= 2
    sigs = {signature(*_case_and_verdict(f)) for f in files}
    assert len(sigs) == len(files)


def _case_and_verdict(path):
    case, meta = load_case_file(path)
    return case, meta["verdict"]


def test_fuzz_correct_kernel_finds_nothing(tmp_path, kfile, capsys):
    rc = cli.main(["fuzz", "--kernel", f"{kfile}:good", "--device", "cpu", "--examples", "10",
                   "--seed", "1", "--max-n", "16", "--out", str(tmp_path / "fz"), "--quiet"])
    assert rc == 0
    assert "0 distinct failure(s)" in capsys.readouterr().out
    assert not (tmp_path / "fz" / "failures").exists()


# --------------------------------------------------------------------------- run, gate, compare


@pytest.fixture
def small_sweep(monkeypatch):
    from flashcheck.verify import strategies

    sweep = [SMALL, TINY, Case(B=1, Hq=2, Hkv=1, Nq=4, Nk=4, D=8, dtype="float16",
                               mask={"kind": "random", "density": 0.5}, seed=9)]
    monkeypatch.setattr(strategies, "fixed_sweep",
                        lambda profile, api="dense": list(sweep))
    return sweep


@pytest.mark.parametrize(("attr", "rc"), [("good", 0), ("long_rows_off", 1)])
def test_run_writes_report_and_failures(attr, rc, small_sweep, tmp_path, kfile, capsys):
    out = tmp_path / "rep"
    assert cli.main(["run", "--kernel", f"{kfile}:{attr}", "--device", "cpu", "--out",
                     str(out), "--quiet"]) == rc
    for name in ("report.json", "report.md", "report.html"):
        assert (out / name).stat().st_size > 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["summary"]["cases"] == 3 and rep["summary"]["fail"] == rc
    assert len(list((out / "failures").glob("*.json"))) == rc
    printed = capsys.readouterr().out
    assert "cases" in printed and "status" in printed  # the per-configuration table


def test_gate_update_then_pass_then_over_budget(small_sweep, tmp_path, kfile, capsys):
    budgets = tmp_path / "b.json"
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    save_case_file(corpus / "reg1.json", TINY)
    base = ["gate", "--kernel", f"{kfile}:good", "--device", "cpu", "--budgets", str(budgets),
            "--corpus", str(corpus), "--out", str(tmp_path / "g"), "--quiet"]
    assert cli.main([*base, "--update"]) == 0
    assert "+++ b.json (new)" in capsys.readouterr().out
    data = json.loads(budgets.read_text())
    # The three sweep configurations, and the corpus file under its own name.
    assert data["format"] == "flashcheck-budgets" and len(data["configs"]) == 4
    assert "regression=reg1 dtype=float32" in data["configs"]
    assert data["device_model"] == "cpu"
    assert cli.main(base) == 0
    assert "within budget" in capsys.readouterr().out
    # Shrink every budget below the observed ratio: the same run now fails the gate.
    for entry in data["configs"].values():
        entry["budget"] = entry["worst_ratio"] / 2 if entry["worst_ratio"] > 0 else 1e-30
    budgets.write_text(json.dumps(data))
    assert cli.main(base) == 1
    out = capsys.readouterr().out
    assert "> budget" in out and "recorded under" not in out
    # Over budget on budgets recorded under another numpy: the gate says which versions moved.
    budgets.write_text(json.dumps({**data, "versions": {**data["versions"], "numpy": "0.0.1"}}))
    assert cli.main(base) == 1
    out = capsys.readouterr().out
    assert "recorded under numpy 0.0.1, this run has numpy " in out
    # A configuration without a budget fails too.
    budgets.write_text(json.dumps({**data, "configs": {"x": {"budget": 1.0}}}))
    assert cli.main(base) == 1
    assert "no committed budget" in capsys.readouterr().out


def test_an_interrupted_gate_or_run_fails_and_writes_no_budgets(small_sweep, tmp_path, kfile,
                                                                capsys, monkeypatch):
    """An interrupt (Ctrl-C, SIGTERM, a CI time limit) leaves cases unchecked: the gate (and
    `run`) exits 1 and says how many, whatever the cases that ran gave, and --update writes
    nothing."""
    from flashcheck.verify import sweep as sw

    budgets = tmp_path / "b.json"
    base = ["gate", "--kernel", f"{kfile}:good", "--device", "cpu", "--budgets", str(budgets),
            "--corpus", str(tmp_path / "empty"), "--out", str(tmp_path / "g"), "--quiet"]
    (tmp_path / "empty").mkdir()
    assert cli.main([*base, "--update"]) == 0
    written = budgets.read_text()
    real = sw.run_cases

    def cut_short(kernel, cases, device, *, kernel_spec, **kw):  # the first case, then SIGTERM
        done = real(kernel, cases[:1], device, kernel_spec=kernel_spec, **kw)
        return done + [sw._not_run(c, kernel_spec, device, sw.INTERRUPTED) for c in cases[1:]]

    monkeypatch.setattr(sw, "run_cases", cut_short)
    capsys.readouterr()
    assert cli.main(base) == 1
    out = capsys.readouterr().out
    assert "gate: interrupted: 2 of 3 cases not run" in out and "within budget" not in out
    budgets.unlink()
    assert cli.main([*base, "--update"]) == 1
    assert "budgets not written" in capsys.readouterr().out and not budgets.exists()
    budgets.write_text(written)
    # `run` too: an interrupt is not a pass.
    assert cli.main(["run", "--kernel", f"{kfile}:good", "--device", "cpu", "--out",
                     str(tmp_path / "r"), "--quiet"]) == 1
    assert "run: interrupted: 2 of 3 cases not run" in capsys.readouterr().out


def test_gate_names_a_corpus_case_added_without_its_budget(small_sweep, tmp_path, kfile, capsys):
    """The committed-budgets workflow: a case copied into the corpus without re-running
    ``--update`` fails the gate, and the gate names the file."""
    budgets, corpus = tmp_path / "b.json", tmp_path / "corpus"
    corpus.mkdir()
    base = ["gate", "--kernel", f"{kfile}:good", "--device", "cpu", "--budgets", str(budgets),
            "--corpus", str(corpus), "--out", str(tmp_path / "g"), "--quiet"]
    assert cli.main([*base, "--update"]) == 0
    assert cli.main(base) == 0
    capsys.readouterr()
    save_case_file(corpus / "new-hazard.json", TINY)
    assert cli.main(base) == 1
    out = capsys.readouterr().out
    assert "unbudgeted: regression case new-hazard.json has no committed budget" in out
    assert "gate: 1 of 4 configurations over budget or failing" in out
    assert cli.main([*base, "--update"]) == 0 and cli.main(base) == 0
    # Removing a budgeted case (or pointing the gate at the wrong corpus) fails too.
    (corpus / "new-hazard.json").unlink()
    capsys.readouterr()
    assert cli.main(base) == 1
    assert "budgeted regression case not found in the corpus" in capsys.readouterr().out


def test_gate_refuses_budgets_of_another_device_model(small_sweep, tmp_path, kfile, capsys):
    budgets = tmp_path / "b.json"
    base = ["gate", "--kernel", f"{kfile}:good", "--device", "cpu", "--budgets", str(budgets),
            "--corpus", str(tmp_path), "--out", str(tmp_path / "g"), "--quiet"]
    assert cli.main([*base, "--update"]) == 0
    budgets.write_text(json.dumps({**json.loads(budgets.read_text()),
                                   "device_model": "NVIDIA H200"}))
    capsys.readouterr()
    assert cli.main(base) == 2
    err = _one_line_error(capsys)
    assert "no budgets for this device (cpu)" in err and "NVIDIA H200" in err


def test_default_budgets_path_by_kernel_and_device(tmp_path, monkeypatch):
    from flashcheck.verify import gate

    monkeypatch.chdir(tmp_path)
    assert gate.default_budgets_path("triton", "cpu").name == "triton-cpu.json"
    assert gate.default_budgets_path("triton", "gpu", "NVIDIA H200").name == \
        "triton-gpu-NVIDIA_H200.json"
    user = gate.default_budgets_path("mykern.py:attention", "cpu")
    assert user == tmp_path / "flashcheck-budgets" / "mykern.py_attention-cpu.json"


def test_the_cpu_device_model_names_an_architecture_whose_blas_is_not_pinned(monkeypatch):
    """x86-64 hosts share the "cpu" budgets (one BLAS core type in the workers); another
    architecture sums in other orders, so its budgets are its own file, and a gate there on
    the x86-64 budgets is refused ("no budgets for this device") rather than judged."""
    import platform

    from flashcheck.verify import gate

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert gate.device_model("cpu") == "cpu"
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert gate.device_model("cpu") == "cpu-aarch64"
    assert gate.default_budgets_path("triton", "cpu", "cpu-aarch64").name == \
        "triton-cpu-aarch64.json"
    with pytest.raises(ValueError, match=r"no budgets for this device \(cpu-aarch64\)"):
        gate.check_device_model({"device_model": "cpu"}, Path("b.json"), "cpu-aarch64")


def test_gate_update_does_not_budget_a_failing_configuration(small_sweep, tmp_path, kfile,
                                                             capsys):
    budgets = tmp_path / "b.json"
    rc = cli.main(["gate", "--kernel", f"{kfile}:long_rows_off", "--device", "cpu",
                   "--budgets", str(budgets), "--corpus", str(tmp_path), "--update",
                   "--out", str(tmp_path / "g"), "--quiet"])
    assert rc == 1
    labels = json.loads(budgets.read_text())["configs"]
    assert len(labels) == 2  # SMALL (12 query rows) fails and is left out
    assert not any("N=1-16 causal=none mask=none" in lab and "float32" in lab for lab in labels)
    assert "not budgeted" in capsys.readouterr().out


def test_compare_command(small_sweep, tmp_path, kfile, capsys):
    for attr in ("good", "long_rows_off"):
        cli.main(["run", "--kernel", f"{kfile}:{attr}", "--device", "cpu", "--out",
                  str(tmp_path / attr), "--quiet"])
    out = tmp_path / "cmp.md"
    assert cli.main(["compare", str(tmp_path / "good" / "report.json"),
                     str(tmp_path / "long_rows_off" / "report.json"), "--out", str(out)]) == 0
    table = out.read_text()
    assert f"{kfile}:good (cpu)" in table and "**FAIL**" in table


def test_run_budget_reports_unchecked_cases_as_not_run(small_sweep, tmp_path, kfile,
                                                        monkeypatch):
    """Past --budget-s no case is started, and none is lost: the rest show as not run."""
    import itertools

    clock = itertools.count(0.0, 10.0)  # every reading is 10 s after the previous one
    monkeypatch.setattr("time.monotonic", lambda: next(clock))
    out = tmp_path / "rep"
    assert cli.main(["run", "--kernel", f"{kfile}:good", "--device", "cpu", "--out", str(out),
                     "--budget-s", "15", "--quiet"]) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["summary"]["cases"] == 3
    assert rep["summary"]["not_run"] >= 1
    assert "time budget of 15 s exhausted" in (out / "report.md").read_text()


FLUSHING_KERNEL = textwrap.dedent('''
    import torch
    from flashcheck.reference import attention_fp64

    def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
        o = attention_fp64(q.double(), k.double(), v.double(), is_causal=is_causal,
                           scale=scale).to(q.dtype)
        return torch.where(o.abs() < 2.0**-14, torch.zeros_like(o), o)  # fp16 FTZ store
''')


def test_strict_subnormals_turns_a_flushed_result_into_a_failure(tmp_path, capsys):
    """Flushing is accepted by default (an observation); --strict-subnormals fails it, in
    the worker that judges the case."""
    kern = tmp_path / "flushk.py"
    kern.write_text(FLUSHING_KERNEL)
    case = tmp_path / "tiny.json"
    save_case_file(case, Case(B=1, Hq=1, Hkv=1, Nq=8, Nk=8, D=8, dtype="float16",
                              dist={"kind": "normal", "sigma": 2e-6}, backward=False, seed=4))
    base = ["repro", str(case), "--kernel", f"{kern}:attention", "--device", "cpu"]
    assert cli.main(base) == 0
    capsys.readouterr()
    assert cli.main([*base, "--strict-subnormals"]) == 1
    assert "subnormals_flushed" in capsys.readouterr().out


def test_oracle_device_reaches_workers_and_replay_commands(monkeypatch, tmp_path):
    """--oracle-device goes to every worker through the environment (read by check_case),
    to each fuzz worker's command line, and into the replay command of a failure."""
    from flashcheck.verify.check import ORACLE_ENV
    from flashcheck.verify.report import REPLAY_ENV, replay_command
    from flashcheck.verify.scale import worker_argv

    assert cli.ORACLE_ENV == ORACLE_ENV
    monkeypatch.delenv(ORACLE_ENV, raising=False)
    args = cli.build_parser().parse_args(["fuzz", "--kernel", "sdpa-math", "--workers", "2",
                                          "--oracle-device", "device"])
    assert args.oracle_device == "device"
    argv = worker_argv(args, 1, tmp_path, "db", 10)
    assert argv[argv.index("--oracle-device") + 1] == "device"
    for k in (*REPLAY_ENV, *(k for k in os.environ if k.startswith("FLASHCHECK_"))):
        monkeypatch.delenv(k, raising=False)
    assert replay_command("c.json", "triton", "cuda") == (
        "flashcheck repro c.json --kernel triton --device cuda")
    # the kernels' settings go in front (the code that failed is launched again); the
    # harness's own do not
    monkeypatch.setenv("FLASHCHECK_GLUON_SCHEDULE", "64=early")
    monkeypatch.setenv("FLASHCHECK_CONTROL_SEED", "7")
    monkeypatch.setenv("FLASHCHECK_GLUON", "tile")
    assert replay_command("c.json", "triton", "cuda") == (
        "env FLASHCHECK_GLUON=tile FLASHCHECK_GLUON_SCHEDULE=64=early "
        "flashcheck repro c.json --kernel triton --device cuda")
    for k in ("FLASHCHECK_GLUON_SCHEDULE", "FLASHCHECK_CONTROL_SEED", "FLASHCHECK_GLUON"):
        monkeypatch.delenv(k)
    monkeypatch.setenv(ORACLE_ENV, "device")
    assert replay_command("c.json", "triton", "cuda").endswith("--oracle-device device")
    # the CPU arithmetic's pins go in front: without them the case rounds otherwise
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert replay_command("c.json", "triton", "cpu").startswith(
        "env ATEN_CPU_CAPABILITY=avx2 OMP_NUM_THREADS=1 flashcheck repro c.json ")
    # main() puts the choice into the environment before any worker starts
    monkeypatch.delenv(ORACLE_ENV)
    assert cli.main(["repro", str(tmp_path / "missing.json"), "--oracle-device", "device"]) == 2
    assert os.environ[ORACLE_ENV] == "device"

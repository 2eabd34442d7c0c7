"""Acceptance: flashcheck run from a kernel project of its own (tests/data/userproj).

The sample project has top-level packages named ``verify``, ``reference`` and ``kernels``
(the names of flashcheck's subpackages in this checkout), a pure-PyTorch kernel ``mod.py``
with a narrow declared domain (Nq, Nk multiples of 16; D in {16, 32, 64}) that raises
outside it, a wrong kernel ``bad.py`` (output x 1.01), and tests of its own. Every run
happens in a copy of the project under the test's temporary directory, with the project as
the working directory, as a user runs it:

- ``flashcheck fuzz`` draws only inside the declared domain and every example runs;
- ``pytest --flashcheck-kernel`` (the plugin, under pytest-xdist) gives one JUnit testcase per
  gate configuration, ids equal to the labels, skipped exactly where no case is in the
  domain, beside the project's own tests;
- a wrong kernel makes that run exit 1 with the verdict (tensor, tolerance, family member,
  case file, replay command), in the configuration items and the fuzz item;
- the plugin is inert without ``--flashcheck-kernel`` and rejects bad option values;
- the built-in kernels resolve to flashcheck's own packages, never the project's.

The mod kernel runs in float64 (SDPA math), so the whole CPU gate sweep takes seconds: most
of its 77 configurations are outside the kernel's domain and are skipped without a call.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from flashcheck.verify import gate, strategies
from flashcheck.verify import report as R

REPO = Path(__file__).resolve().parents[1]
USERPROJ = REPO / "tests" / "data" / "userproj"
CORPUS = REPO / "tests" / "regressions"
SEQ_MULTIPLE, HEAD_DIMS = 16, {16, 32, 64}  # mod.py's declared domain
OWN_TESTS = {"test_own_packages_are_the_projects", "test_flashcheck_is_not_from_this_project"}
# A subprocess is killed after this long: the slowest run here takes ~30 s on 2 busy cores.
TIMEOUT_S = 300


@pytest.fixture
def project(tmp_path) -> Path:
    dst = tmp_path / "userproj"
    shutil.copytree(USERPROJ, dst, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def _run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
            "PYTHONDONTWRITEBYTECODE": "1", **env}
    full.pop("PYTEST_ADDOPTS", None)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=full, capture_output=True,
                          text=True, timeout=TIMEOUT_S)


def _pytest(project: Path, *args: str) -> subprocess.CompletedProcess:
    return _run(["-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(project),
                 "-c", str(project / "pytest.ini"), *args], project)


def _in_domain(case) -> bool:
    return (case.Nq % SEQ_MULTIPLE == 0 and case.Nk % SEQ_MULTIPLE == 0
            and case.D in HEAD_DIMS)


def gate_configs() -> dict[str, list]:
    """The CPU gate's configurations (label -> cases), as ``flashcheck gate`` groups them."""
    out: dict[str, list] = {}
    for case in strategies.fixed_sweep("cpu"):
        out.setdefault(R.config_label(case.config_key()), []).append(case)
    for path, case in zip(gate.corpus_files(CORPUS), gate.load_corpus(CORPUS), strict=True):
        out.setdefault(R.config_label(gate.regression_key(path, case.dtype)), []).append(case)
    return out


def _testcases(xml: Path) -> dict[tuple[str, str], str]:
    """(classname, name) -> "pass" / "skipped: MESSAGE" / "failure: MESSAGE"."""
    out = {}
    for tc in ET.parse(xml).getroot().iter("testcase"):
        key = (tc.get("classname"), tc.get("name"))
        assert key not in out, f"duplicate testcase {key}"
        state = "pass"
        for tag in ("skipped", "failure", "error"):
            el = tc.find(tag)
            if el is not None:
                state = f"{tag}: {el.get('message')}"
        out[key] = state
    return out


def test_fuzz_draws_inside_the_declared_domain(project, tmp_path):
    log = tmp_path / "shapes.log"
    r = _run(["-m", "flashcheck", "fuzz", "--kernel", "mod:attention", "--device", "cpu",
              "--examples", "60", "--seed", "0", "--out", str(tmp_path / "fuzz"), "--quiet"],
             project, USERPROJ_SHAPES_LOG=str(log))
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"fuzz: (\d+) examples in .*; 0 distinct failure", r.stdout)
    assert m and int(m.group(1)) >= 60, r.stdout
    assert "not run" not in r.stdout, r.stdout  # every drawn example ran
    calls = [tuple(map(int, line.split())) for line in log.read_text().splitlines()]
    assert len(calls) >= 60
    outside = [c for c in calls if c[0] % SEQ_MULTIPLE or c[1] % SEQ_MULTIPLE
               or c[2] not in HEAD_DIMS]
    assert not outside, f"the kernel was called outside its declared domain: {outside[:5]}"


def test_plugin_one_testcase_per_configuration_under_xdist(project, tmp_path):
    xml = tmp_path / "j.xml"
    r = _pytest(project, "-n", "2", "--flashcheck-kernel", "mod:attention",
                "--flashcheck-device", "cpu", "--flashcheck-minutes", "0",
                "--flashcheck-corpus", str(CORPUS), "--flashcheck-out", str(tmp_path / "out"),
                f"--junitxml={xml}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "configurations are judged by their own verdicts only" in r.stdout
    configs = gate_configs()
    assert len(configs) > 10
    cases = _testcases(xml)
    ours = {name: state for (cls, name), state in cases.items() if cls == "flashcheck"}
    assert set(ours) == set(configs)  # one testcase per configuration, id = its label
    assert {name for (cls, name) in cases if cls != "flashcheck"} == OWN_TESTS
    assert all(state == "pass" for (cls, _), state in cases.items() if cls != "flashcheck")
    for label, state in ours.items():
        if any(_in_domain(c) for c in configs[label]):
            assert state == "pass", (label, state)
        else:  # nothing to run: skipped with the harness's reason
            assert state.startswith("skipped: not run: "), (label, state)
    assert any(state == "pass" for state in ours.values())


def test_plugin_reports_a_wrong_kernel(project, tmp_path):
    xml = tmp_path / "j.xml"
    out = tmp_path / "out"
    r = _pytest(project, "--flashcheck-kernel", "bad.py:attention", "--flashcheck-device", "cpu",
                "--flashcheck-minutes", "1", "--flashcheck-examples", "5",
                "--flashcheck-configs", "mask=key_padding", "--flashcheck-corpus", str(CORPUS),
                "--flashcheck-out", str(out), f"--junitxml={xml}", "tests/check_own.py")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    picked = {lab for lab in gate_configs() if "mask=key_padding" in lab}
    cases = _testcases(xml)
    ours = {name: state for (cls, name), state in cases.items() if cls == "flashcheck"}
    assert set(ours) == picked | {"flashcheck-fuzz"}
    failed = [name for name, state in ours.items() if state.startswith("failure")]
    assert "flashcheck-fuzz" in failed and len(failed) >= 2, ours
    # The message names the tensor, the worst element, the tolerance and the family member
    # it comes from, the case file and the replay command.
    for word in ("elements off (worst at [", "> tol", "family member", "case file: ",
                 "replay: flashcheck repro ", "--kernel bad.py:attention --device cpu"):
        assert word in r.stdout, word
    files = sorted((out / "failures").glob("numerical-*.json"))
    assert files and all(str(p) in r.stdout for p in files)
    assert list((out / "fuzz" / "failures").glob("*.json"))


def test_plugin_judges_configurations_against_budgets(project, tmp_path):
    # The three dead_rows configurations (N = 64, D = 64: inside the domain) of a correct
    # kernel: one within its budget, one over it, one without a budget.
    labels = sorted(lab for lab in gate_configs() if "mask=dead_rows" in lab)
    by_dtype = {re.search(r"dtype=(\w+)", lab).group(1): lab for lab in labels}
    assert set(by_dtype) == {"float16", "bfloat16", "float32"}
    budgets = tmp_path / "budgets.json"
    budgets.write_text(json.dumps({
        "format": gate.BUDGETS_FORMAT, "version": gate.BUDGETS_VERSION, "device_model": "cpu",
        "configs": {by_dtype["bfloat16"]: {"budget": 1.0}, by_dtype["float16"]: {"budget": 1e-6}},
    }))
    xml = tmp_path / "j.xml"
    r = _pytest(project, "--flashcheck-kernel", "mod:attention", "--flashcheck-device", "cpu",
                "--flashcheck-minutes", "0", "--flashcheck-configs", "mask=dead_rows",
                "--flashcheck-budgets", str(budgets), "--flashcheck-corpus", str(CORPUS),
                "--flashcheck-out", str(tmp_path / "out"), f"--junitxml={xml}",
                "tests/check_own.py")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"flashcheck: budgets {budgets}" in r.stdout
    ours = {name: state for (cls, name), state in _testcases(xml).items()
            if cls == "flashcheck"}
    assert set(ours) == set(labels)
    assert ours[by_dtype["bfloat16"]] == "pass"
    assert re.match(r"failure: .*: ratio \S+ > budget 1e-06", ours[by_dtype["float16"]])
    assert "no committed budget" in ours[by_dtype["float32"]]


def test_plugin_is_inert_without_a_kernel_and_checks_its_options(project):
    r = _run(["-c", "import sys, flashcheck.verify.pytest_plugin; "
                    "assert 'torch' not in sys.modules, 'the plugin imported torch'"], project)
    assert r.returncode == 0, r.stderr
    r = _pytest(project, "--collect-only", "-q")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 tests collected" in r.stdout and "flashcheck::" not in r.stdout, r.stdout
    for args, message in [
        (["--flashcheck-device", "cpu"], "--flashcheck-device: needs --flashcheck-kernel"),
        (["--flashcheck-kernel", "mod:attention", "--flashcheck-minutes", "-1"],
         "--flashcheck-minutes must be a finite number >= 0"),
        (["--flashcheck-kernel", "mod:attention", "--flashcheck-seed", "2**32"],
         "--flashcheck-seed must be an integer in [0, 2**32)"),
        (["--flashcheck-kernel", "mod:attention", "--flashcheck-profile", "tpu"],
         "--flashcheck-profile must be cpu or gpu"),
        (["--flashcheck-kernel", "mod:attention", "--flashcheck-case-timeout", "0"],
         "--flashcheck-case-timeout must be a number > 0"),
        (["--flashcheck-strict-subnormals"],
         "--flashcheck-strict-subnormals: needs --flashcheck-kernel"),
        (["--flashcheck-kernel", "mod:attention", "--flashcheck-oracle-device", "gpu"],
         "--flashcheck-oracle-device must be auto or device, got 'gpu'"),
    ]:
        r = _pytest(project, "--collect-only", "-q", *args)
        assert r.returncode == pytest.ExitCode.USAGE_ERROR, (args, r.stdout, r.stderr)
        assert message in r.stderr, (args, r.stderr)


def test_builtin_kernels_do_not_import_the_projects_packages(project):
    code = ("import sys\n"
            "from flashcheck.verify.adapters import resolve_kernel\n"
            "for spec in ('reference', 'online', 'triton', 'triton-fa1'):\n"
            "    resolve_kernel(spec, 'cpu')\n"
            "taken = [n for n in ('verify', 'reference', 'kernels') if n in sys.modules]\n"
            "assert not taken, f'generic top-level names imported: {taken}'\n")
    r = _run(["-c", code], project)
    assert r.returncode == 0, r.stdout + r.stderr

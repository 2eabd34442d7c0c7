"""The public API (flashcheck.cases, flashcheck.check), the namespaced install and
MODULE:ATTR resolution from the working directory (issue: plug in real kernels as they are)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import domain_kernels
import pytest
from flashcheck.verify.adapters import SpecError, resolve_kernel
from flashcheck.verify.cases import save_case_file
from hypothesis import given, settings

import flashcheck

ROOT = Path(__file__).resolve().parent.parent
MUTANT = str(ROOT / "verify" / "mutants" / "scale_ignored.py") + ":attention"
SMALL = dict(B=1, Hq=1, Hkv=1, Nq=16, Nk=16, D=16, scale=0.5, seed=3)


def test_check_returns_the_verdict_of_a_correct_kernel():
    v = flashcheck.check("reference", flashcheck.Case(**SMALL), device="cpu")
    assert v.status == "pass" and set(v.tensors) == {"out", "dq", "dk", "dv"}


def test_check_raises_with_the_mismatch_table_for_a_wrong_kernel():
    with pytest.raises(AssertionError) as e:
        flashcheck.check(MUTANT, flashcheck.Case(**SMALL), device="cpu")
    text = str(e.value)
    # tensor, worst index, both values, tolerance, the member that set it, the table
    assert "elements off (worst at [" in text and "got " in text and "want " in text
    assert "tol " in text and "family member" in text
    assert "| tensor" in text and "case json: {" in text


def test_check_names_a_bad_argument():
    case = flashcheck.Case(**SMALL)
    with pytest.raises(ValueError, match="policy: unknown option"):
        flashcheck.check("reference", case, device="cpu", tolerance=1e-2)
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        flashcheck.check("reference", case, device="tpu")
    with pytest.raises(ValueError, match="case must be a flashcheck Case"):
        flashcheck.check("reference", {"B": 1}, device="cpu")


@settings(max_examples=25, deadline=None, database=None)
@given(flashcheck.cases(kernel=domain_kernels.attention, max_n=64))
def test_cases_stay_inside_the_kernels_declared_domain(case):
    assert case.Nq % 16 == 0 and case.Nk % 16 == 0 and case.D in (16, 32, 64)


def test_installs_one_name_only(tmp_path):
    """The wheel holds flashcheck/ (with verify, kernels, reference under it) and its
    dist-info: no top-level verify/, kernels/ or reference/ to shadow a kernel repo's own."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                    "-q", "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("flashcheck-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"flashcheck", next(t for t in top if t.endswith(".dist-info"))}, top
    for sub in ("verify/cli.py", "verify/budgets/triton-cpu.json", "kernels/__init__.py",
                "reference/__init__.py", "verify/pytest_plugin.py", "verify/mutants/_blocked.py"):
        assert f"flashcheck/{sub}" in names, sub


def _kernel_module(d: Path, name: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.py").write_text(
        "from flashcheck.reference import attention_fp64\n"
        "def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,\n"
        "              enable_gqa=False):\n"
        "    return attention_fp64(q.double(), k.double(), v.double(), attn_mask=attn_mask,\n"
        "                          is_causal=is_causal, scale=scale).to(q.dtype)\n")
    # A kernel repo's own package named like one of ours must not be what we import.
    (d / "verify").mkdir(exist_ok=True)
    (d / "verify" / "__init__.py").write_text("raise ImportError('the user repo verify/')\n")


def test_module_spec_resolves_from_the_working_directory(tmp_path, monkeypatch):
    _kernel_module(tmp_path, "cwd_kernel_mod")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    k = resolve_kernel("cwd_kernel_mod:attention", "cpu")
    assert k.name == "attention"
    with pytest.raises(SpecError, match="module 'no_such_mod_here' not found"):
        resolve_kernel("no_such_mod_here:attention", "cpu")


def test_cli_path_option_and_a_users_own_verify_package(tmp_path):
    """`flashcheck repro --kernel mod:attention --path DIR` from a directory that holds a
    package named verify/ (which raises on import): the kernel is found in DIR, ours is
    flashcheck.verify, the case passes (exit 0)."""
    _kernel_module(tmp_path / "kernels_dir", "path_kernel_mod")
    (tmp_path / "verify").mkdir()
    (tmp_path / "verify" / "__init__.py").write_text("raise ImportError('user verify/')\n")
    case = tmp_path / "case.json"
    save_case_file(case, flashcheck.Case(**SMALL))
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    r = subprocess.run([sys.executable, "-m", "flashcheck", "repro", str(case), "--kernel",
                        "path_kernel_mod:attention", "--path", str(tmp_path / "kernels_dir"),
                        "--device", "cpu"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "flashcheck", "repro", str(case), "--kernel",
                        "path_kernel_mod:attention", "--path", str(tmp_path / "nope"),
                        "--device", "cpu"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and "--path" in r.stderr and "not a directory" in r.stderr

"""scripts/ptxas_report.py: our kernels compiled for sm_90a on a machine without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.script_modules import load

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "ptxas_report.py"


def _module():
    return load(SCRIPT)


def _run(*args: str) -> subprocess.CompletedProcess:
    # the Triton kernels of the table: at D = 64 and 4096 keys the default forward is the
    # Gluon persistent grid, whose compile tests/test_flash_gluon.py checks
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["FLASHCHECK_GLUON"] = "off"
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=600)


def test_code_hash_ignores_source_positions_only():
    code_of = _module().code_of
    ptx = ("\t.loc\t1 700 0 // flash_attention.py:700:0\n$L__tmp3:\n\tadd.s32 \t%r1, %r2, 1;"
           " // note\n\t.file\t1 \"x.py\"\n\t.section\t.debug_info\n\t{ }\n")
    moved = ptx.replace("700", "712").replace("tmp3", "tmp9")
    assert code_of(ptx) == code_of(moved) == "\tadd.s32 \t%r1, %r2, 1;"
    assert code_of(ptx) != code_of(ptx.replace("%r2, 1", "%r2, 2"))


def test_table_launches_compile_for_sm90_with_registers_and_spills(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    out = tmp_path / "r.json"
    res = _run("--out", str(out), "--d", "64")
    assert res.returncode == 0, res.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["target"] == "sm_90a" and rep["shape"]["D"] == 64 and rep["triton"]
    kinds = {(r["launch"], r["kernel"]) for r in rep["kernels"]}
    for causal in (False, True):
        for k in ("_fwd_kernel_impl", "_bwd_dkdv_kernel_impl", "_bwd_dq_kernel_impl"):
            assert (f"table causal={causal}", k) in kinds
    for r in rep["kernels"]:
        assert 1 <= r["registers"] <= 255 and r["spill_store_bytes"] >= 0, r
        assert r["shared_bytes"] >= 0 and len(r["ptx_sha256"]) == 16
        assert r["constexprs"]["BLOCK_D"] == 64
    # The same source compiles to the same code: the refactor check passes.
    again = _run("--out", str(tmp_path / "r2.json"), "--d", "64", "--against", str(out))
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert f"{len(rep['kernels'])} kernels, 0 with other code" in again.stdout


def test_differences_names_each_launch_whose_code_changed():
    differences = _module().differences
    rec = dict(launch="table causal=False", kernel="_fwd_kernel_impl", ptx_sha256="a" * 16)
    head = dict(triton="3.6.0", target="sm_90a", shape={"D": 64}, dtype="bfloat16")
    before = dict(head, kernels=[rec, dict(rec, kernel="_bwd_dq_kernel_impl")])
    assert differences(before, before) == []
    after = dict(head, kernels=[dict(rec, ptx_sha256="b" * 16)])
    assert differences(before, after) == ["table causal=False _bwd_dq_kernel_impl",
                                          "table causal=False _fwd_kernel_impl"]
    assert "triton" in differences(before, dict(before, triton="3.9.0"))[0]


def test_bad_head_dim_is_a_usage_error(tmp_path):
    res = _run("--out", str(tmp_path / "r.json"), "--d", "512")
    assert res.returncode == 2 and "--d must be in 1..256" in res.stderr


def test_unreadable_against_report_is_a_usage_error(tmp_path):
    res = _run("--out", str(tmp_path / "r.json"), "--against", str(tmp_path / "missing.json"))
    assert res.returncode == 2 and "--against: cannot read a report" in res.stderr


def test_bad_schedule_is_a_usage_error(tmp_path):
    res = _run("--out", str(tmp_path / "r.json"), "--schedule", "c3+faster")
    assert res.returncode == 2 and "--schedule" in res.stderr and "'faster'" in res.stderr
    differences = _module().differences
    head = dict(triton="3.9.0", target="sm_90a", shape={"D": 64}, dtype="bfloat16", kernels=[])
    assert "schedule" in differences(head, dict(head, schedule="c3"))[0]

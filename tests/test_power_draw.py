"""scripts/gpu/power_draw.py's CPU side: nvidia-smi's log parsed, joined to the phases,
summarised per implementation, and its options' ranges refused with their names."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.script_modules import load

pd = load("scripts/gpu/power_draw.py", "power_draw_test")
ROOT = Path(__file__).resolve().parent.parent

SMI = """timestamp, clocks.current.sm [MHz], power.draw [W], clocks_event_reasons.active
2026/12/06 14:00:00.000, 1980 MHz, 120.00 W, 0x0000000000000000
2026/12/06 14:00:00.500, 1500 MHz, 700.00 W, 0x0000000000000004
2026/12/06 14:00:00.900, 1700 MHz, 690.00 W, 0x0000000000000000
2026/12/06 14:00:01.500, 1400 MHz, 699.50 W, 0x0000000000000004
2026/12/06 14:00:0"""


def _t(s: str) -> float:
    return datetime.datetime.strptime(s, "%Y/%m/%d %H:%M:%S.%f").timestamp()


def test_the_log_parses_and_a_cut_last_line_is_skipped():
    got = pd.parse_smi(SMI)
    assert [g[1:] for g in got] == [(1980, 120.0, 0), (1500, 700.0, 4), (1700, 690.0, 0),
                                    (1400, 699.5, 4)]


def test_the_columns_are_found_by_the_header_names():
    """session.sh's spread log has the temperature between power and reasons, and asks
    for clocks_throttle_reasons (printed under its newer name)."""
    text = ("timestamp, clocks.current.sm [MHz], power.draw [W], temperature.gpu, "
            "clocks_event_reasons.active\n"
            "2026/12/06 14:18:53.856, 345 MHz, 72.14 W, 37, 0x0000000000000001\n")
    assert [g[1:] for g in pd.parse_smi(text)] == [(345, 72.14, 1)]
    # no header: QUERY's order
    assert [g[1:] for g in pd.parse_smi(SMI.split("\n", 1)[1])][:1] == [(1980, 120.0, 0)]


def test_a_phase_takes_its_samples_after_settling_and_derives_cycles_and_energy():
    samples = pd.parse_smi(SMI)
    t0 = _t("2026/12/06 14:00:00.000")
    phases = [dict(phase=0, impl="auto", start=t0, end=t0 + 1.0, launches=100),
              dict(phase=0, impl="cudnn", start=t0 + 1.0, end=t0 + 1.2, launches=10)]
    a, b = pd.join(phases, samples)
    assert a["ms"] == pytest.approx(10.0)
    assert a["samples"] == 2  # 0.000 is inside the settling time, 1.500 after the end
    assert a["mhz"] == pytest.approx(1600) and a["watts"] == pytest.approx(695)
    assert a["capped"] == pytest.approx(0.5)
    assert a["mcycles"] == pytest.approx(16.0) and a["mj"] == pytest.approx(6950)
    assert b["samples"] == 0 and b["mhz"] is None and b["mj"] is None
    s = pd.summary([a, b, dict(a, ms=12.0, mhz=1400.0, mcycles=16.8)])
    assert list(s) == ["auto", "cudnn"]
    assert s["auto"]["ms"] == pytest.approx(11.0) and s["auto"]["mhz"] == pytest.approx(1500)
    assert s["cudnn"]["ms"] == pytest.approx(20.0) and s["cudnn"]["watts"] is None


@pytest.mark.parametrize("argv, words", [
    (["--impls", "auto,fast"], "--impls takes a comma list of auto, tile"),
    (["--seconds", "0.5"], "--seconds must be in 1..30"),
    (["--phases", "0"], "--phases must be in 1..20"),
    (["--n", "2048"], "--n: invalid choice"),
    (["--base", "/nonexistent/tree"], "--base must be a checkout's tree holding flashcheck"),
    (["--impls", "auto,base"], "--impls names base, which needs --base TREE"),
])
def test_options_out_of_range_are_refused_by_name(argv, words, capsys):
    with pytest.raises(SystemExit) as exc:
        pd.main(["--out", "x.json", *argv])
    assert exc.value.code == 2
    assert words in capsys.readouterr().err


def test_without_nvidia_smi_it_says_what_it_needs(monkeypatch, capsys):
    monkeypatch.setattr(pd.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit) as exc:
        pd.main(["--out", "x.json"])
    assert exc.value.code == 2
    assert "nvidia-smi is not on PATH" in capsys.readouterr().err


def test_the_worker_answers_each_request_with_one_phase_and_stops_on_an_empty_line():
    import io
    calls = []
    out = io.StringIO()
    pd._serve(lambda: calls.append(1), lambda: None, ["0.01\n", "0.01\n", "\n", "5\n"], out)
    replies = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(replies) == 2  # the empty line stopped it before the 5-second request
    assert sum(r["launches"] for r in replies) == len(calls)
    assert all(r["launches"] % 8 == 0 and r["end"] - r["start"] >= 0.01 for r in replies)


def _fake_tree(root, init: str):
    (root / "flashcheck" / "kernels").mkdir(parents=True)
    (root / "flashcheck" / "__init__.py").write_text("")
    (root / "flashcheck" / "kernels" / "__init__.py").write_text(init)
    return root


def test_the_base_tree_is_imported_ahead_of_this_checkout(tmp_path):
    """``_load_tree`` puts the tree first, so the worker runs that tree's kernels even with
    this checkout on PYTHONPATH (as session.sh sets it)."""
    tree = _fake_tree(tmp_path / "base", "TREE = 'base'\n")
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('pd', {str(pd.__file__)!r})\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            f"print(m._load_tree({str(tree)!r}).TREE)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "base"


def test_a_base_worker_that_dies_before_its_forward_is_an_error_naming_the_tree(tmp_path):
    tree = _fake_tree(tmp_path / "broken", "raise ImportError('no kernels here')\n")
    args = argparse.Namespace(base=str(tree), dtype="float16", d=64, n=1024, causal=False)
    with pytest.raises(RuntimeError, match=r"--base worker \(.*broken\) stopped before its "
                                           r"forward ran \(exit 1\)"):
        pd._Base(args)

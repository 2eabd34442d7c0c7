"""scripts/gpu/power_draw.py's CPU side: nvidia-smi's log parsed, joined to the phases,
summarised per implementation, and its options' ranges refused with their names."""

from __future__ import annotations

import datetime

import pytest

from tests.script_modules import load

pd = load("scripts/gpu/power_draw.py", "power_draw_test")

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

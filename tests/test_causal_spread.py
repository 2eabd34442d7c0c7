"""scripts/gpu/causal_spread.py and gluon_fwd_ab.py's timed set: their CPU-side parts."""

from __future__ import annotations

import pytest

from tests.script_modules import load


def _row(proc, rnd, impl, ms, addr):
    return dict(proc=proc, round=rnd, impl=impl, ms=ms, addr=[addr, addr, addr])


def test_spread_separates_rounds_addresses_and_processes():
    cs = load("scripts/gpu/causal_spread.py", "causal_spread_test")
    rows = [
        # process 0: 1.9 and 2.3 at one address, 2.0 at another
        _row(0, 0, "ours", 1.9, "0x10"), _row(0, 1, "ours", 2.3, "0x10"),
        _row(0, 2, "ours", 2.0, "0x20"),
        # process 1: steady
        _row(1, 0, "ours", 2.1, "0x10"), _row(1, 1, "ours", 2.1, "0x10"),
        _row(1, 2, "ours", 2.1, "0x30"),
        _row(0, 0, "peer", 2.0, "0x10"), _row(1, 0, "peer", 2.05, "0x10"),
    ]
    s = cs.spread(rows)
    assert s["ours"]["process_medians"] == [2.0, 2.1]
    assert s["ours"]["between_processes"] == pytest.approx(0.1)
    assert s["ours"]["within_process_same_addresses"] == pytest.approx(0.4)
    assert s["ours"]["within_process"] == pytest.approx(0.4)
    assert s["peer"]["between_processes"] == pytest.approx(0.05)
    assert s["peer"]["within_process"] == 0


@pytest.mark.parametrize("argv, name", [(["--procs", "0"], "--procs"),
                                        (["--rounds", "1"], "--rounds")])
def test_spread_refuses_counts_out_of_range(argv, name, capsys, tmp_path):
    cs = load("scripts/gpu/causal_spread.py", "causal_spread_test")
    with pytest.raises(SystemExit):
        cs.main(["--out", str(tmp_path / "x.json"), *argv])
    assert name in capsys.readouterr().err


def test_fwd_ab_times_each_head_dim_and_length_asked_for():
    ab = load("scripts/gpu/gluon_fwd_ab.py", "gluon_fwd_ab_timed")
    got = ab.timed([64], [4096, 16384])
    assert len(got) == 8 and {(c["D"], c["N"]) for c in got} == {(64, 4096), (64, 16384)}
    assert {(c["dtype"], c["causal"]) for c in got} == {
        (dt, c) for dt in ("bfloat16", "float16") for c in (False, True)}
    assert all(c["B"] * c["H"] * c["N"] == 2 ** 20 for c in got)  # the benchmark's rows


@pytest.mark.parametrize("argv, name", [(["--d", "96"], "--d"), (["--n", "4000"], "--n"),
                                        (["--n", "x"], "--n")])
def test_fwd_ab_refuses_a_head_dim_or_length_it_does_not_time(argv, name, capsys):
    ab = load("scripts/gpu/gluon_fwd_ab.py", "gluon_fwd_ab_timed")
    with pytest.raises(SystemExit):
        ab.main(["--old", ".", "--out", "x.json", *argv])
    err = capsys.readouterr().err
    assert name in err and "must be" in err

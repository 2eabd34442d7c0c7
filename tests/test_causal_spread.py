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


def test_clocks_joins_each_timing_with_its_samples():
    cs = load("scripts/gpu/causal_spread.py", "causal_spread_test")
    # samples every 100 ms: (epoch s, SM MHz, W, reasons); 0x4 the software power cap
    samples = [(10.0, 1980, 100, 0), (10.1, 1980, 110, 0), (10.2, 1500, 700, 4),
               (10.3, 1400, 700, 4), (10.4, 1700, 690, 4), (12.0, 1300, 700, 4)]
    rows = [dict(impl="ours", ms=1.75, start=10.0, end=10.1),     # 1980, free
            dict(impl="ours", ms=2.10, start=10.25, end=10.3),    # 1500..1400, capped
            dict(impl="ours", ms=1.95, start=10.4, end=10.42),    # 1700, capped
            dict(impl="peer", ms=2.0, start=11.5, end=11.55)]     # nearest sample: 12.0
    got = cs.clocks(rows, samples, cap_bit=0x4)
    assert got["ours"]["timings"] == 3 and got["ours"]["under_cap"] == 2
    assert got["ours"]["mhz_under_cap"] == [1400, 1700]
    assert got["ours"]["ms_under_cap"] == [1.95, 2.10] and got["ours"]["ms_free"] == [1.75, 1.75]
    assert got["ours"]["corr_ms_mhz"] < -0.9  # slower at a lower clock
    assert got["peer"] == dict(timings=1, under_cap=1, mhz_under_cap=[1300, 1300],
                               ms_under_cap=[2.0, 2.0], ms_free=None, corr_ms_mhz=None)


def test_clocks_reads_the_committed_h100_run(capsys):
    """The numbers sweep.md round 28 quotes, from the files committed beside it."""
    cs = load("scripts/gpu/causal_spread.py", "causal_spread_test")
    sweep = "docs/benchmarks/sweep/round28_"
    assert cs.main(["--clocks", f"{sweep}causal_spread_h100.json",
                    "--smi", f"{sweep}spread_smi_h100.csv"]) == 0
    out = capsys.readouterr().out
    assert "sdpa-cudnn   45 of 45 timings under the power cap at 1260-1965 MHz" in out
    assert "triton-fa2   40 of 45 timings under the power cap" in out
    assert "without 1.749-1.807; corr(ms, clock) -0.74" in out


@pytest.mark.parametrize("argv, words", [
    (["--clocks", "a.json"], "--clocks and --smi go together"),
    (["--procs", "2"], "--out is required"),
])
def test_clocks_and_out_are_asked_for_by_name(argv, words, capsys):
    cs = load("scripts/gpu/causal_spread.py", "causal_spread_test")
    with pytest.raises(SystemExit) as exc:
        cs.main(argv)
    assert exc.value.code == 2
    assert words in capsys.readouterr().err


def test_fwd_ab_times_each_head_dim_and_length_asked_for():
    ab = load("scripts/gpu/gluon_fwd_ab.py", "gluon_fwd_ab_timed")
    got = ab.timed([64], [4096, 16384])
    assert len(got) == 8 and {(c["D"], c["N"]) for c in got} == {(64, 4096), (64, 16384)}
    assert {(c["dtype"], c["causal"]) for c in got} == {
        (dt, c) for dt in ("bfloat16", "float16") for c in (False, True)}
    assert all(c["B"] * c["H"] * c["N"] == 2 ** 20 for c in got)  # the benchmark's rows
    matrix = [c for c in ab.bench.configurations(False) if c["N"] in (1024, 4096, 16384)]
    assert ab.timed([128, 64], [4096, 16384, 1024]) == matrix  # the matrix's rows and order


def test_fwd_ab_times_lengths_off_the_matrix_by_its_rule():
    ab = load("scripts/gpu/gluon_fwd_ab.py", "gluon_fwd_ab_timed")
    assert ab.LENGTHS == (1024, 2048, 4096, 8192, 16384, 32768, 65536)
    got = ab.timed([64], ab._lengths("8192,32768,65536"))
    assert [(c["N"], c["B"]) for c in got[::4]] == [(8192, 8), (32768, 2), (65536, 1)]
    with pytest.raises(Exception, match="1024, 2048, .*65536"):
        ab._lengths("131072")  # B would be 0


@pytest.mark.parametrize("argv, name", [(["--d", "96"], "--d"), (["--n", "4000"], "--n"),
                                        (["--n", "x"], "--n"), (["--variants", "c3+fast"],
                                                                "--variants"),
                                        (["--prewarm", "33"], "--prewarm"),
                                        (["--warm", "2/2"], "--warm"), (["--warm", "x"], "--warm")])
def test_fwd_ab_refuses_a_head_dim_or_length_it_does_not_time(argv, name, capsys):
    ab = load("scripts/gpu/gluon_fwd_ab.py", "gluon_fwd_ab_timed")
    with pytest.raises(SystemExit):
        ab.main(["--old", ".", "--out", "x.json", *argv])
    err = capsys.readouterr().err
    assert name in err and "must be" in err


def test_fwd_ab_runs_each_variant_under_its_schedule_and_restores_the_default():
    ab = load("scripts/gpu/gluon_fwd_ab.py", "gluon_fwd_ab_timed")
    assert ab.variant("c3+early+split") == dict(consumers64=3, c3_from64=None, early_p=True,
                                                split=True)
    assert ab.variant("split") == dict(split=True)
    assert ab.variant("") == {}  # the default schedule
    seen = []
    default = {d: dict(f) for d, f in ab.new.SCHEDULE.items()}
    run = ab.scheduled("c3+late+split", lambda: seen.append(
        (ab.new.consumers(64), dict(ab.new.flags(64)), dict(ab.new.flags(128)))) or "out")
    assert run() == "out"
    assert seen == [(3, {"consumers": 3, "c3_from": None, "early_p": False, "split": True},
                     {"consumers": 2, "c3_from": None, "early_p": False, "split": True})]
    assert ab.new.consumers(64) == 2 and ab.new.SCHEDULE == default
    with pytest.raises(ZeroDivisionError):
        ab.scheduled("early", lambda: 1 / 0)()
    assert ab.new.SCHEDULE == default

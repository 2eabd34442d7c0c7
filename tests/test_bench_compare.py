"""scripts/bench_compare.py: every configuration of ours against an earlier benchmark run."""

from __future__ import annotations

import json
from pathlib import Path

from tests.script_modules import load

MOD = load(Path(__file__).resolve().parent.parent / "scripts" / "bench_compare.py")


def _run_file(tmp_path, name, times):
    rows = [dict(dtype="bfloat16", D=128, causal=c, N=4096, B=16, H=16, impl=impl,
                 **{"pass": "fwd"}, ms=ms, note="")
            for (impl, c), ms in times.items()]
    rows.append(dict(dtype="bfloat16", D=64, causal=False, N=1024, B=64, H=16,
                     impl="triton-fa2", **{"pass": "fwd"}, ms="n/a: skipped", note=""))
    p = tmp_path / name
    p.write_text(json.dumps({"meta": {"gpu": "G", "triton": "3.9.0"}, "rows": rows}))
    return p


def test_faster_slower_within_and_beyond_the_reference_drift(tmp_path, capsys):
    old = _run_file(tmp_path, "old.json", {("triton-fa2", False): 4.0, ("triton-fa2", True): 2.0,
                                           ("sdpa-cudnn", False): 3.0, ("sdpa-cudnn", True): 2.0})
    # non-causal: ours 1.0 % slower while cuDNN is 2.0 % slower (the machine) -> within drift;
    # causal: ours 15 % slower, cuDNN unchanged -> beyond
    new = _run_file(tmp_path, "new.json", {("triton-fa2", False): 4.04, ("triton-fa2", True): 2.3,
                                           ("sdpa-cudnn", False): 3.06, ("sdpa-cudnn", True): 2.0})
    md = tmp_path / "cmp.md"
    assert MOD.main([str(old), str(new), "--md", str(md)]) == 1
    out = capsys.readouterr().out
    assert "| bfloat16 | 128 | no | 4096 | triton-fa2 | fwd | 4.000 | 4.040 | 0.990 | 0.980 | " \
           "slower, within drift |" in out
    assert "| yes | 4096 | triton-fa2 | fwd | 2.000 | 2.300 | 0.870 | 1.000 | slower beyond " \
           "drift |" in out
    assert "2 rows in both runs; 0 at least as fast; 1 slower within drift; 1 slower beyond " \
           "drift" in out
    assert md.read_text() == out
    # ours 7.4 % slower with cuDNN unchanged: inside the default noise (10 %), beyond 5 %
    near = _run_file(tmp_path, "near.json", {("triton-fa2", False): 4.32,
                                             ("triton-fa2", True): 2.16,
                                             ("sdpa-cudnn", False): 3.0, ("sdpa-cudnn", True): 2.0})
    assert MOD.main([str(old), str(near)]) == 0
    assert "0 slower beyond drift" in capsys.readouterr().out
    assert MOD.main([str(old), str(near), "--noise", "0.05"]) == 1
    assert "2 slower beyond drift" in capsys.readouterr().out
    # the same run against itself: every row at least as fast, exit 0
    assert MOD.main([str(old), str(old)]) == 0
    assert "2 at least as fast" in capsys.readouterr().out


def test_bad_input_names_the_argument(tmp_path, capsys):
    old = _run_file(tmp_path, "old.json", {("triton-fa2", False): 4.0})
    assert MOD.main([str(old), str(old), "--noise", "1.5"]) == 2
    assert "--noise must be in [0, 1), got 1.5" in capsys.readouterr().err
    assert MOD.main([str(old), str(tmp_path / "missing.json")]) == 2
    assert "cannot read the runs" in capsys.readouterr().err
    assert MOD.main([str(old), str(old), "--impl", "flex"]) == 2
    assert "no row of ['flex'] is timed in both runs" in capsys.readouterr().err

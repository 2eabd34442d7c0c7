"""scripts/gpu/ab_time.py: two source trees timed in alternation (its CPU-side parts)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu" / "ab_time.py"


def _module():
    spec = importlib.util.spec_from_file_location("ab_time", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(ms, pass_="bwd", causal=True):
    return dict(dtype="bfloat16", D=64, causal=causal, N=4096, B=16, H=16, impl="triton-fa2",
                **{"pass": pass_}, ms=ms)


def test_summary_takes_each_trees_median_over_rounds_and_their_ratio():
    ab = _module()
    times = {"a": [[_row(5.0), _row(1.0, "fwd")], [_row(5.4), _row(1.2, "fwd")],
                   [_row(5.2), _row(None, "fwd")]],
             "b": [[_row(4.8), _row(1.1, "fwd")], [_row(4.9), _row(1.1, "fwd")],
                   [_row(5.5), _row(1.1, "fwd")]]}
    by_pass = {s["pass"]: s for s in ab.summarize(times)}
    assert by_pass["bwd"]["a_ms"] == 5.2 and by_pass["bwd"]["b_ms"] == 4.9
    assert by_pass["bwd"]["b_over_a"] == pytest.approx(4.9 / 5.2)
    assert by_pass["fwd"]["a_all"] == [1.0, 1.2]          # a missing time is left out
    assert by_pass["fwd"]["b_over_a"] == pytest.approx(1.1 / 1.1)


def test_a_configuration_timed_by_one_tree_only_has_no_ratio():
    ab = _module()
    (s,) = ab.summarize({"a": [[_row(2.0)]], "b": [[]]})
    assert s["a_ms"] == 2.0 and s["b_ms"] is None and s["b_over_a"] is None


@pytest.mark.parametrize("args, message", [
    (["--d", "96"], "--d must be 64 or 128"),
    (["--n", "2048"], "--n must be among"),
    (["--n", "4k"], "--n must be comma-separated integers"),
    (["--rounds", "0"], "--rounds must be in 1..20"),
    (["--b", "/nonexistent"], "--b: /nonexistent is not a checkout"),
])
def test_bad_arguments_are_refused_naming_the_argument(args, message, tmp_path, capsys):
    ab = _module()
    base = ["--a", str(ROOT), "--b", str(ROOT), "--out", str(tmp_path / "ab.json")]
    with pytest.raises(SystemExit) as e:
        ab.main(base + args)
    assert e.value.code == 2
    assert message in capsys.readouterr().err

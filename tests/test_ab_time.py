"""scripts/gpu/ab_time.py: two source trees timed in alternation (its CPU-side parts)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.script_modules import load

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu" / "ab_time.py"


def _module():
    return load(SCRIPT)


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


def test_autotune_picks_name_each_kernels_point_per_tuning_key():
    import triton
    ab = _module()
    cfg = triton.Config({"BLOCK_N": 64, "BLOCK_M": 64}, num_warps=4, num_stages=3)
    fa = SimpleNamespace(_dkdv_tuned=SimpleNamespace(cache={(4096, 64, "bf16"): cfg}),
                         _fwd_tuned=SimpleNamespace(cache={}))   # no _dq_tuned at all
    picks = ab.autotune_picks(fa)
    assert picks == {"fwd": {}, "dq": {},
                     "dkdv": {"(4096, 64, 'bf16')": "[('BLOCK_M', 64), ('BLOCK_N', 64)] w4 s3"}}


def test_pick_differences_name_changed_and_one_sided_keys_only():
    ab = _module()
    a = {"dkdv": {"k1": "p w4 s3", "k2": "q w8 s3"}, "fwd": {"k1": "r w4 s3"}}
    b = {"dkdv": {"k1": "p w4 s3", "k2": "q w8 s2", "k3": "s w4 s2"}}
    assert ab.pick_differences(a, b) == [
        "dkdv k2: A q w8 s3 | B q w8 s2", "dkdv k3: A not tuned | B s w4 s2",
        "fwd k1: A r w4 s3 | B not tuned"]
    assert ab.pick_differences(a, a) == []


def test_a_tree_is_timed_from_its_workers_rows_and_picks(monkeypatch, tmp_path):
    ab = _module()
    seen = {}

    def run(cmd, env, cwd, **kw):
        seen.update(env=env, cwd=cwd, code=cmd[-1])
        return SimpleNamespace(returncode=0, stderr="", stdout="noise\nAB_ROWS [1, 2]\n"
                               'AB_PICKS {"fwd": {"k": "p"}}\n')

    monkeypatch.setattr(ab.subprocess, "run", run)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    rows, picks = ab._time_tree(tmp_path, 64, [1024], 10.0)
    assert rows == [1, 2] and picks == {"fwd": {"k": "p"}}
    assert seen["cwd"] == tmp_path and seen["env"]["PYTHONPATH"] == str(tmp_path.resolve())
    # a carried Triton on the caller's path stays on the worker's, after the tree
    monkeypatch.setenv("PYTHONPATH", "/tmp/triton-slim")
    ab._time_tree(tmp_path, 64, [1024], 10.0)
    assert seen["env"]["PYTHONPATH"] == f"{tmp_path.resolve()}{os.pathsep}/tmp/triton-slim"
    assert seen["env"]["FLASHCHECK_AUTOTUNE_CACHE"] == "0"
    compile(seen["code"], "worker", "exec")  # the formatted worker is Python


def test_a_tree_without_timings_is_an_error_with_its_stderr(monkeypatch, tmp_path):
    ab = _module()
    monkeypatch.setattr(ab.subprocess, "run", lambda *a, **k: SimpleNamespace(
        returncode=1, stdout="", stderr="ImportError: no flashcheck"))
    with pytest.raises(RuntimeError, match="no timings .exit 1.: ImportError"):
        ab._time_tree(tmp_path, 64, [1024], 10.0)


def test_rounds_alternate_which_tree_is_timed_first(monkeypatch, tmp_path):
    """A then B, B then A, A then B: an effect of the order shows in both trees' medians."""
    ab = _module()
    (tmp_path / "flashcheck").mkdir()
    (tmp_path / "flashcheck" / "__init__.py").write_text("")
    calls = []

    def fake(tree, d, ns, timeout_s):
        calls.append(tree)
        return [_row(1.0)], {}

    monkeypatch.setattr(ab, "_time_tree", fake)
    other = tmp_path / "other"
    (other / "flashcheck").mkdir(parents=True)
    (other / "flashcheck" / "__init__.py").write_text("")
    out = tmp_path / "ab.json"
    assert ab.main(["--a", str(tmp_path), "--b", str(other), "--rounds", "3",
                    "--out", str(out)]) == 0
    assert calls == [tmp_path, other, other, tmp_path, tmp_path, other]
    data = json.loads(out.read_text())
    assert len(data["times"]["a"]) == len(data["times"]["b"]) == 3

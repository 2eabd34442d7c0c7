"""The launch-point sweep's variant sets (scripts/gpu/sweep_hopper.py) and the device
properties the launchers read.

A sweep runs on a GPU call that cannot be repeated cheaply, so its variant lists are checked
here: every variant names a kernel and a point that fits an H200's shared memory at the head
dim it is run with, the sets that time the table's point first and last do, and no set
holds the same variant twice except those two.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from flashcheck.kernels import _common

from tests.script_modules import load

SWEEP = load("scripts/gpu/sweep_hopper.py")


@pytest.mark.parametrize("which", SWEEP.SETS)
def test_every_variant_is_a_launch_point_that_fits(which):
    bd = SWEEP.SET_D.get(which, 128)
    out = SWEEP.variants(which)
    assert out
    for var in out:
        assert var["kind"] in _common.KINDS
        assert len(var["point"]) == 4 and all(isinstance(x, int) for x in var["point"])
        assert _common.keep(var["kind"], tuple(var["point"]), bd, 2, _common.H200_SMEM), var
        assert isinstance(var["causal"], bool)


@pytest.mark.parametrize("which", ["dkdv4", "dq4", "dkdv64", "ws"])
def test_drift_sets_time_the_table_point_first_and_last(which):
    out = SWEEP.variants(which)
    for causal in (False, True):
        mine = [v for v in out if v["causal"] == causal]
        assert mine[0] == mine[-1]
        inner = [repr(sorted(v.items())) for v in mine[1:-1]]
        assert len(set(inner)) == len(inner), "a variant is timed twice"
        assert mine[0] not in mine[1:-1]


def test_dkdv64_times_the_current_and_the_earlier_d64_points():
    pts = {(tuple(v["point"]), v["causal"]) for v in SWEEP.variants("dkdv64")}
    for causal in (False, True):
        assert (_common.heuristic_point("dkdv", 64, 2, causal), causal) in pts
        for p in _common.autotune_points("dkdv", 64, 2, causal, _common.H200_SMEM):
            assert (p, causal) in pts


def test_head_dim_defaults_to_the_sets(monkeypatch, tmp_path):
    """`--set d64` without `--d` times head dim 64, not the D 128 default of the other sets."""
    seen = []
    monkeypatch.setattr(SWEEP, "compile_shard", lambda i, n, dtype, d, out, which: seen.append(d))
    for which, d in (("d64", 64), ("dkdv64", 64), ("ws", 128), ("tables", 128)):
        assert SWEEP.main(["--out", str(tmp_path), "--set", which, "--shard", "0/1"]) == 0
        assert seen[-1] == d
    SWEEP.main(["--out", str(tmp_path), "--set", "d64", "--d", "128", "--shard", "0/1"])
    assert seen[-1] == 128


def test_unknown_set_is_refused_with_the_allowed_ones():
    with pytest.raises(ValueError, match="--set must be one of"):
        SWEEP.variants("nope")


def test_device_properties_are_read_once_and_shared(monkeypatch):
    calls = []

    class Utils:
        @staticmethod
        def get_device_properties(index):
            calls.append(index)
            return {"max_shared_mem": 1234, "multiprocessor_count": 7}

    class Active:
        utils = Utils

    monkeypatch.setattr(_common, "_props_cache", {})
    monkeypatch.setattr(_common.triton.runtime, "driver", SimpleNamespace(active=Active))
    assert _common.smem_limit(5) == 1234
    assert _common.sm_count(torch.device("cuda", 5)) == 7
    assert calls == [5]
    # Off CUDA there is one program at a time (the interpreter): no device is read.
    assert _common.sm_count(torch.device("cpu")) == 1
    assert calls == [5]


def test_compile_records_carry_the_sets_order_and_are_timed_in_it(monkeypatch, tmp_path):
    """Shards write as they finish; the timing phase reads the records back in the set's
    order, so a table point timed first and last really brackets the candidates."""
    monkeypatch.setattr(SWEEP, "_problem", lambda *a, **k: ())
    monkeypatch.setattr(SWEEP, "_fwd_bwd", lambda *a, **k: (torch.zeros(1),) * 4)
    monkeypatch.setattr(SWEEP.torch.cuda, "synchronize", lambda: None)
    comp = tmp_path / "compile.jsonl"
    for shard in (2, 0, 1):  # finishing out of order
        SWEEP.compile_shard(shard, 3, torch.bfloat16, 128, comp, "dkdv4")
    recs = SWEEP.load_compiled(comp)
    want = SWEEP.variants("dkdv4")
    assert [r["index"] for r in recs] == list(range(len(want)))
    for rec, var in zip(recs, want, strict=True):
        assert {k: rec[k] for k in var} == var and rec["ok"]


@pytest.mark.parametrize("which", ["confirm128", "confirm64"])
def test_confirm_sets_put_a_table_time_on_either_side_of_every_candidate(which):
    out = SWEEP.variants(which)
    for causal, table, cands in SWEEP.CONFIRM[which]:
        kind = table[0]
        mine = [v for v in out if v["causal"] == causal and v["kind"] == kind]
        is_table = [tuple(v["point"]) == table[1] and v["tma"] == table[2] for v in mine]
        assert is_table[0] and is_table[-1]
        assert is_table.count(True) == SWEEP.CONFIRM_REPEATS + 1
        assert len(mine) == 1 + (len(cands) + 1) * SWEEP.CONFIRM_REPEATS
        # the table's variant is the pointer path the default launch took when rounds 11 and
        # 12 ran (commit 7a2d11f); the candidates differ from it
        assert not table[2] and all(c != table for c in cands)

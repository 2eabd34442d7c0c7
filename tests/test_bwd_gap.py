"""scripts/gpu/bwd_gap.py and bwd_alloc.py: their arguments, checked without a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.script_modules import load

gap = load("scripts/gpu/bwd_gap.py")
alloc = load("scripts/gpu/bwd_alloc.py")


@pytest.mark.parametrize("args, message", [
    (["--causal", "maybe"], "--causal: must be no and/or yes separated by commas, got 'maybe'"),
    (["--reps", "0"], "--reps: must be an integer from 1 to 1000, got '0'"),
    (["--reps", "x"], "--reps: must be an integer from 1 to 1000, got 'x'"),
    (["--d", "96"], "--d: must be 64 or 128 (the bench's head dims), got '96'"),
])
def test_bad_arguments_name_themselves_and_their_range(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        gap.main(["--out", str(tmp_path / "g.json"), *args])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without one")
def test_without_a_gpu_it_says_so_and_writes_nothing(tmp_path, capsys):
    assert gap.main(["--out", str(tmp_path / "g.json"), "--causal", "yes", "--reps", "3"]) == 2
    assert "bwd_gap: needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "g.json").exists()


@pytest.mark.parametrize("args, message", [
    (["--allocs", "0"], "--allocs: must be an integer from 1 to 200, got '0'"),
    (["--allocs", "many"], "--allocs: must be an integer from 1 to 200, got 'many'"),
    (["--turn-stride", "8"], "--turn-stride: must be 1 or 32, got '8'"),
])
def test_bwd_alloc_bad_arguments_name_themselves_and_their_range(tmp_path, capsys, args,
                                                                 message):
    with pytest.raises(SystemExit) as exc:
        alloc.main(["--out", str(tmp_path / "a.json"), *args])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without one")
def test_bwd_alloc_without_a_gpu_says_so_and_writes_nothing(tmp_path, capsys):
    assert alloc.main(["--out", str(tmp_path / "a.json"), "--empty-cache", "--small-pad"]) == 2
    assert "bwd_alloc: needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "a.json").exists()

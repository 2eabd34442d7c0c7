"""scripts/gpu/bwd_gap.py: its arguments, checked without a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.script_modules import load

gap = load("scripts/gpu/bwd_gap.py")


@pytest.mark.parametrize("args, message", [
    (["--causal", "maybe"], "--causal: must be no and/or yes separated by commas, got 'maybe'"),
    (["--reps", "0"], "--reps: must be an integer from 1 to 1000, got '0'"),
    (["--reps", "x"], "--reps: must be an integer from 1 to 1000, got 'x'"),
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

"""Inputs rebuilt from a case are bit-identical to the committed digests (made with torch 2.13
on x86-64). Run on another torch version or machine (the GPU suite), this is the check that a
case file replays the same bits there."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
from input_hashes import compute  # noqa: E402

GOLDEN = pathlib.Path(__file__).parent / "data" / "input_hashes.json"


def test_materialized_inputs_match_committed_digests():
    golden = json.loads(GOLDEN.read_text())["digests"]
    got = compute()
    assert set(got) == set(golden), "the first cases of fixed_sweep('cpu') changed; regenerate"
    diff = [k for k in golden if golden[k] != got[k]]
    if diff:
        pytest.fail(f"{len(diff)}/{len(golden)} cases rebuild different input bits; first: "
                    f"{diff[0]}")

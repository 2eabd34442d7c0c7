"""Acceptance of issue #4, on the CPU: a correct fixture passes, a wrong one is caught fast.

- A correct blocked PyTorch kernel (tests/fixtures_kernels.py: fp32 accumulation, P rounded
  to the input dtype) passes a 500-example `flashcheck fuzz` campaign (slow: minutes).
- The seed post's rescale bug (verify/mutants/rescale_div_l.py) is caught within
  KILL_LIMIT_S by the same campaign, and `flashcheck repro` replays the shrunk case file
  with exit 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from flashcheck.verify import cli
from flashcheck.verify.selftest import run_campaign

ROOT = Path(__file__).resolve().parent.parent
KILL_LIMIT_S = 60.0  # issue #4: "caught in <= 60 s on the CPU"
SEED = 0


@pytest.mark.long
@pytest.mark.slow
def test_correct_blocked_fixture_passes_500_examples(tmp_path, device):
    spec = f"{ROOT / 'tests' / 'fixtures_kernels.py'}:blocked_attention"
    rc = cli.main(["fuzz", "--kernel", spec, "--device", device, "--examples", "500",
                   "--seed", str(SEED), "--out", str(tmp_path)])
    reports = sorted((tmp_path / "failures").glob("*.md"))
    assert rc == 0, "failures:\n" + "\n".join(p.read_text() for p in reports)


def test_rescale_bug_caught_fast_and_replayed(tmp_path, device):
    spec = f"{ROOT / 'verify' / 'mutants' / 'rescale_div_l.py'}:attention"
    res = run_campaign(spec, device, seconds=KILL_LIMIT_S, seed=SEED, out=tmp_path)
    assert res.case_file is not None, f"not caught in {res.examples} examples ({res.error})"
    assert res.first_fail_s <= KILL_LIMIT_S
    assert cli.main(["repro", res.case_file, "--device", device]) == 1

"""The regression corpus, replayed: one test per case file in ``tests/regressions/``.

Each file is a case that once exposed a bug (in our kernel, or in a catalogued mutant whose
bug class our kernel must never acquire), shrunk by ``flashcheck fuzz``. Every one must pass
on our Triton kernel through the same path as ``flashcheck repro`` and ``flashcheck gate``
(case file -> optional captured tensors beside it -> ``check_case``). Test ids are the file
stems. A case outside the kernel's domain on this device (bfloat16 under the CPU
interpreter) is skipped with the kernel's reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from flashcheck.verify.adapters import resolve_kernel
from flashcheck.verify.check import check_case
from flashcheck.verify.repro import load_target

CORPUS = Path(__file__).parent / "regressions"
FILES = sorted(CORPUS.glob("*.json"))


@pytest.fixture(scope="module")
def kernel(device):
    return resolve_kernel("triton", device)


def test_corpus_is_not_empty():
    assert FILES, f"no case files in {CORPUS}"


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_regression_case_passes(path, kernel, device):
    target = load_target(case_path=str(path), tensors_path=None)
    verdict = check_case(kernel, target.case, device)
    if verdict.status == "not_run":
        pytest.skip(f"outside {kernel.spec}'s domain on {device}: {verdict.reason}")
    assert verdict.status == "pass", (
        f"{verdict.summary()}; replay: flashcheck repro {path} --kernel triton "
        f"--device {device}")

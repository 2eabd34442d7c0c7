"""The public Python API (``flashcheck.cases``, ``flashcheck.check``; docs/contracts.md §8).

For property tests in a kernel repository::

    from hypothesis import given, settings
    import flashcheck
    from mykernels import attention          # an SDPA-compatible callable

    @settings(max_examples=200, deadline=None)
    @given(flashcheck.cases(kernel=attention, max_n=256))
    def test_attention_matches_the_family(case):
        flashcheck.check(attention, case)     # AssertionError with the mismatch table

- :func:`cases` is :func:`flashcheck.verify.strategies.cases` (the same bounds) with the
  kernel's declared ``capabilities`` applied: draws stay inside its dtypes, head dims,
  sequence rules, masks, layouts and backward domain, by construction.
- :func:`check` judges one case exactly as ``flashcheck repro`` does (in this process, not in
  a supervised worker: a crash takes the test process with it, as any crashing test does).
  A failing verdict raises ``AssertionError`` whose text names the tensor, the worst index,
  both values, the tolerance and the family member that set it, followed by the per-tensor
  table; a passing or not-run verdict is returned (``verdict.status`` is ``"pass"`` or
  ``"not_run"``, with ``verdict.reason``), so a test may ``assume``/skip on the latter.
"""

from __future__ import annotations

from typing import Any

from flashcheck.verify.adapters import as_kernel
from flashcheck.verify.cases import Case
from flashcheck.verify.check import Verdict, check_case
from flashcheck.verify.report import render_verdict_table
from flashcheck.verify.strategies import cases as _cases

__all__ = ["Case", "Verdict", "cases", "check", "default_device"]

_POLICY = ("strict_subnormals", "family")


def default_device() -> str:
    """``"cuda"`` when a CUDA device is available, else ``"cpu"``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def cases(kernel: Any = None, **bounds):
    """A Hypothesis strategy of :class:`Case` within ``bounds`` (the keyword arguments of
    :func:`flashcheck.verify.strategies.cases`: ``dtypes``, ``max_n``, ``head_dims``,
    ``max_batch``, ``max_heads``, ``features``, ``backward``, ``layouts``,
    ``distributions``, ``grad_distributions``, ``capabilities``). ``kernel`` (a callable or a
    spec string) supplies ``capabilities`` from its declared ``capabilities`` dict unless
    ``capabilities`` is given. Raises ValueError naming the argument on bad bounds."""
    if kernel is not None and "capabilities" not in bounds:
        bounds["capabilities"] = as_kernel(kernel, "cpu").declared or None
    return _cases(**bounds)


def check(kernel: Any, case: Case, device: str | None = None, **policy) -> Verdict:
    """Run ``kernel`` (a callable or a spec string) on ``case`` and judge it.

    ``device``: ``"cpu"`` or ``"cuda"`` (default: :func:`default_device`). ``policy``:
    ``strict_subnormals`` (bool: a subnormal result flushed to 0 fails) and ``family``
    (``"lazy"``, the default, or ``"full"``: every member runs, so a pass names the member
    each tensor is measured against). Returns the verdict when it passes or is not run;
    raises ``AssertionError`` with the mismatch message and table when it fails."""
    bad = sorted(set(policy) - set(_POLICY))
    if bad:
        raise ValueError(f"policy: unknown option(s) {bad}; allowed: {list(_POLICY)}")
    if not isinstance(case, Case):
        raise ValueError(f"case must be a flashcheck Case, got {type(case).__name__}")
    device = default_device() if device is None else device
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    verdict = check_case(as_kernel(kernel, device), case, device, **policy)
    if verdict.status == "fail":
        raise AssertionError(f"{verdict.summary()}\ncase: {case.short()}\n"
                             f"{render_verdict_table(verdict.to_dict())}\n"
                             f"case json: {case.to_json()}")
    return verdict

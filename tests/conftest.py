"""Shared pytest configuration: Hypothesis profiles and the device fixture.

Example budgets live in named profiles, selected with ``--hypothesis-profile=NAME``
(tox sets ``ci`` for the CPU suite and ``gpu`` for the CUDA suite):

- ``dev``: quick local iteration.
- ``ci``: the CPU suite under the Triton interpreter; derandomized so CI is repeatable.
- ``gpu``: the CUDA suite; more and larger examples.
- ``fuzz``: long campaigns.

On a machine without CUDA, ``TRITON_INTERPRET=1`` is put into the environment here (unless
already set), before any test module imports a kernel: Triton reads it when ``@triton.jit``
decorates a function, so it must be set before ``kernels`` is first imported. tox sets it
too; this makes a bare ``pytest`` on a CPU-only machine behave the same.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]

settings.register_profile("dev", max_examples=10, deadline=None, suppress_health_check=_SLOW_OK)
settings.register_profile(
    "ci", max_examples=25, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=_SLOW_OK,
)
settings.register_profile(
    "gpu", max_examples=200, deadline=None, print_blob=True, suppress_health_check=_SLOW_OK
)
settings.register_profile(
    "fuzz", max_examples=5000, deadline=None, print_blob=True, suppress_health_check=_SLOW_OK
)
settings.load_profile("dev")


def pytest_collection_modifyitems(config, items):
    """``long`` tests first (stable order otherwise): pytest-xdist hands out the first items
    one per worker, so the minutes-long campaigns run side by side from the start instead of
    one of them starting last and setting the suite's wall time."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.fixture(scope="session")
def device() -> str:
    """The device the suite targets: CUDA when present, else the CPU (Triton interpreter)."""
    return "cuda" if torch.cuda.is_available() else "cpu"

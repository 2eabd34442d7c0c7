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
    """Spread the ``long`` tests over pytest-xdist's first chunks, one per worker.

    xdist's load scheduler first hands worker k the k-th run of ``chunk`` consecutive items
    (chunk = max(2, items per worker // 4)); minutes-long campaigns next to each other in the
    collection would all land on one worker and run one after the other (on the H200 that
    set the suite's wall time). Each long test is therefore put at the start of its own
    chunk. Without xdist they simply come first. Every worker computes the same order.
    """
    long = [it for it in items if it.get_closest_marker("long")]
    if not long:
        return
    rest = [it for it in items if not it.get_closest_marker("long")]
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    chunk = max(2, len(items) // workers // 4) if workers > 1 else 1
    ordered = []
    for it in long:
        ordered.append(it)
        ordered.extend(rest[:chunk - 1])
        rest = rest[chunk - 1:]
    items[:] = ordered + rest


@pytest.fixture(scope="session")
def device() -> str:
    """The device the suite targets: CUDA when present, else the CPU (Triton interpreter)."""
    return "cuda" if torch.cuda.is_available() else "cpu"

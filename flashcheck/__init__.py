"""flashcheck: correctness and numerical verification of flash-attention kernels.

One installed name, ``flashcheck``, with three subpackages: ``flashcheck.verify`` (the
harness), ``flashcheck.reference`` (the oracles) and ``flashcheck.kernels`` (our Triton
kernels). No generic top-level names are installed, so a kernel repository with its own
``verify/``, ``reference/`` or ``kernels/`` packages can run flashcheck from its directory.

In a source checkout the subpackages are the repository's top-level folders
(``verify/``, ``reference/``, ``kernels/``): this package's search path is extended with the
repository root, so ``PYTHONPATH=<checkout>`` works without installing. An installed copy
(wheel or editable) maps the same folders under ``flashcheck/``.

The public API, for property tests in a kernel repository (docs/contracts.md §8):

- :func:`cases` — a Hypothesis strategy of :class:`Case` inside a kernel's domain;
- :func:`check` — run and judge one case; raises ``AssertionError`` with the mismatch table
  on a failure, returns the :class:`Verdict` otherwise.
"""

from __future__ import annotations

import os as _os

_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if (_os.path.isfile(_os.path.join(_ROOT, "verify", "__init__.py"))
        and _os.path.isfile(_os.path.join(_ROOT, "pyproject.toml"))
        and not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "verify"))):
    __path__.append(_ROOT)  # source checkout: flashcheck.verify is <root>/verify

__version__ = "0.1.0"

__all__ = ["Case", "Verdict", "cases", "check", "__version__"]


def __getattr__(name):  # the API imports torch and Hypothesis: only when used
    if name in ("cases", "check", "Case", "Verdict"):
        from flashcheck.verify import api
        return getattr(api, name)
    raise AttributeError(f"module 'flashcheck' has no attribute {name!r}")

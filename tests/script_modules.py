"""A repository file that is not part of the package (a script, a frozen copy of earlier
code) loaded as a module for its tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load(path: str | Path, name: str | None = None):
    """The module of ``path`` (relative to the repository root, or absolute), executed
    afresh on each call, named ``name`` (default: the file's stem)."""
    path = Path(path)
    path = path if path.is_absolute() else ROOT / path
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

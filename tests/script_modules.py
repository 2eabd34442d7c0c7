"""A repository file that is not part of the package (a script, a frozen copy of earlier
code) loaded as a module for its tests."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load(path: str | Path, name: str | None = None):
    """The module of ``path`` (relative to the repository root, or absolute), executed
    afresh on each call, named ``name`` (default: the file's stem)."""
    path = Path(path)
    path = path if path.is_absolute() else ROOT / path
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    # registered before it runs, as an import does: a dataclass of the module looks its
    # module up by name
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


_SM90_PRELUDE = r"""
import json, sys, importlib.util, torch
from pathlib import Path
spec = importlib.util.spec_from_file_location("ptxas_report", "scripts/ptxas_report.py")
rep = importlib.util.module_from_spec(spec); spec.loader.exec_module(rep)
comp = rep._Compiler(Path(sys.argv[1])); comp.install()
"""


def compile_for_sm90(body: str, ptx_dir: Path, timeout: int = 900):
    """Run ``body`` in a subprocess without the interpreter, after scripts/ptxas_report.py's
    stand-in sm_90 driver is installed as ``comp`` (each launch compiled, its PTX kept under
    ``ptx_dir``, nothing run); ``json``, ``sys`` and ``torch`` are imported. Returns the
    completed process."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return subprocess.run([sys.executable, "-c", _SM90_PRELUDE + body, str(ptx_dir)], env=env,
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout)

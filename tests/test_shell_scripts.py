"""The repository's shell scripts (device sessions, CI): they parse, and their CPU-side parts.

The GPU phases run only on a CUDA machine, where a broken script costs a device call; what can
be checked here is that every script parses, that a usage error is refused with the usage,
and how a device session names its files.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for p in (ROOT / "scripts").rglob("*.sh")) + [ROOT / ".ci" / "run"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("args", [[], ["unpack"]])
def test_triton_slim_refuses_an_unknown_mode_with_its_usage(args):
    proc = subprocess.run(["bash", str(ROOT / "scripts/gpu/triton_slim.sh"), *args],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "usage: triton_slim.sh pack VERSION" in proc.stderr


def test_session_names_a_multi_phase_calls_env_file_without_a_space(tmp_path):
    """Files whose names hold a space do not come back from the device."""
    out = tmp_path / "r"
    proc = subprocess.run(["bash", str(ROOT / "scripts/gpu/session.sh"), "nosuch", "other"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "GPU_R": str(out), "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in out.iterdir()] == ["env-nosuch+other.txt"]

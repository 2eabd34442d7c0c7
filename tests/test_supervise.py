"""Campaigns that never lose a failure (verify/supervise.py, verify/fuzz.py).

Each misbehaving kernel of tests/misbehaving_kernels.py is fuzzed through the CLI: the campaign
must end inside its budget with exit 1 and a case file whose replay in a fresh process
(``python -m flashcheck repro CASE.json``) fails the same way. The kernels are pure PyTorch, so a
case takes milliseconds and the time goes into process starts and the shrinks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from flashcheck.verify import cli
from flashcheck.verify.cases import Case, load_case_file, save_case_file
from flashcheck.verify.fuzz import CONFIRM_RUNS
from flashcheck.verify.repro import (
    FLAKY_MAX_REPLAYS,
    FLAKY_MISS,
    FLAKY_REPEATS,
    flaky_replays,
    rate_lower_bound,
)
from flashcheck.verify.supervise import (
    BASE_TIMEOUT_S,
    CPU_ARITHMETIC_ENV,
    TIMEOUT_MEDIAN_FACTOR,
    Supervisor,
    normalise_message,
    pins_cpu_arithmetic,
    root_cause,
)
from flashcheck.verify.sweep import run_cases

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "tests" / "misbehaving_kernels.py"
ENV = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
       "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.fixture(autouse=True)
def _keep_env(monkeypatch):
    """``main`` sets TRITON_INTERPRET for --device cpu; restore it after each test."""
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))


def _spec(name: str) -> str:
    return f"{KERNELS}:{name}"


def _fuzz(name: str, out: Path, *extra: str) -> tuple[int, float]:
    t0 = time.monotonic()
    rc = cli.main(["fuzz", "--kernel", _spec(name), "--device", "cpu", "--seed", "7",
                   "--max-n", "16", "--dtypes", "float32", "--out", str(out), "--quiet",
                   *extra])
    return rc, time.monotonic() - t0


def _repro(case_file: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashcheck", "repro", str(case_file), "--kernel",
                           _spec(name), "--device", "cpu", *extra],
                          capture_output=True, text=True, timeout=120, env=ENV, cwd=ROOT)


# One row per behaviour that can happen on a CPU: kernel, expected failure class, extra flags
# (with the budget the campaign must end inside), and the repro status line's class.
CAMPAIGNS = [
    ("segv_large", "crashed", ["--minutes", "0.5"], "crashed"),
    ("abort_large", "crashed", ["--minutes", "0.5"], "crashed"),
    # 2 s: far above a healthy case here (~0.03 s, ~0.4 s as a fresh worker's first), so a
    # loaded CI machine does not turn a passing shrink candidate into a false timeout
    ("hang_large", "timeout", ["--minutes", "0.2", "--case-timeout", "2"], "timeout"),
    ("cuda_error_large", "cuda_error", ["--minutes", "0.5"], "cuda_error"),
    ("hostile_output_large", "harness_error", ["--minutes", "0.5"], "harness_error"),
    ("first_use_wrong", "flaky", ["--minutes", "0.5"], None),
    # Wrong at random: its eight re-checks all repeat the first class ("nondeterministic")
    # with probability 0.42^8 ~ 0.1% (verify/fuzz.py, CONFIRM_RUNS), and then that class is
    # the record; either way the replay repeats until it fails (verify/repro.py).
    ("random_wrong", "flaky|nondeterministic", ["--minutes", "0.5"], None),
]


@pytest.mark.parametrize(("name", "cls", "extra", "repro_cls"), CAMPAIGNS,
                         ids=[c[0] for c in CAMPAIGNS])
def test_campaign_keeps_the_failure_and_its_replay_fails_the_same_way(name, cls, extra,
                                                                      repro_cls, tmp_path):
    out = tmp_path / "fz"
    rc, wall = _fuzz(name, out, *extra)
    assert rc == 1
    minutes = float(extra[extra.index("--minutes") + 1])
    timeout = float(extra[extra.index("--case-timeout") + 1]) if "--case-timeout" in extra \
        else 0.0
    # inside the budget, to within one case timeout (+ start-up and writing what was found)
    assert wall < 60 * minutes + timeout + 10, wall
    files = sorted(p for c in cls.split("|") for p in (out / "failures").glob(f"{c}-*.json"))
    # One file per root cause; the kernel wrong at random can also fail a case tried while
    # its first failure is shrunk, which is kept as a file of its own.
    assert len(files) == 1 or (name == "random_wrong" and files), \
        sorted(p.name for p in (out / "failures").iterdir())
    assert not list((out / "inflight").glob("*.json"))  # nothing left in flight
    case, meta = load_case_file(files[0])
    assert meta["verdict"]["failure"] in cls.split("|")
    if cls in ("crashed", "timeout", "cuda_error", "harness_error"):
        # shrunk, every candidate in a fresh worker (a hang's shrink may be cut by the budget)
        assert case.Nq == 9 if cls != "timeout" else 8 < case.Nq <= 16
        assert meta["verdict"]["observations"]["exception"]["frame"].startswith(
            "misbehaving_kernels.py:")
    r = _repro(files[0], name, *(["--case-timeout", "1"] if cls == "timeout" else []))
    assert r.returncode == 1, r.stdout + r.stderr
    status = next(ln for ln in r.stdout.splitlines() if ln.startswith("status:"))
    if repro_cls is not None:
        assert f"({repro_cls})" in status
    else:
        assert "fail" in status


def test_a_kernel_that_crashes_on_the_probes_is_a_failure_not_a_usage_error(tmp_path):
    rc, _ = _fuzz("segv_always", tmp_path / "fz", "--examples", "5")
    assert rc == 1
    (f,) = (tmp_path / "fz" / "failures").glob("*.json")
    _, meta = load_case_file(f)
    assert meta["verdict"]["failure"] == "crashed"
    assert "SIGSEGV" in meta["verdict"]["reason"]


def test_flaky_failures_say_first_use_or_random(tmp_path):
    kinds = {}
    for name in ("first_use_wrong", "random_wrong"):
        rc, _ = _fuzz(name, tmp_path / name, "--examples", "40")
        assert rc == 1
        verdicts = [json.loads(p.read_text())["verdict"]
                    for p in sorted((tmp_path / name / "failures").glob("*.json"))]
        # The kernel wrong at random also fails, now and then, the cases tried while its
        # first failure is shrunk: each is kept (unshrunk, a file of its own), never dropped.
        # The record under test is the flaky (or nondeterministic) one.
        main = [v for v in verdicts if v["failure"] in ("flaky", "nondeterministic")]
        assert main and (name == "random_wrong" or len(verdicts) == 1), \
            [v["failure"] for v in verdicts]
        verdict = main[0]
        if name == "random_wrong" and verdict["failure"] == "nondeterministic":
            # every re-check repeated the first class (0.1%, CAMPAIGNS above): recorded as such
            assert verdict["observations"]["rechecks_agreed"] == CONFIRM_RUNS + 1
            kinds[name] = "random"
            continue
        flaky = verdict["observations"]["flaky"]
        assert flaky["first"]["status"] == "fail"
        assert flaky["replay"]["status"] in ("pass", "fail")
        kinds[name] = flaky["kind"]
    assert kinds["first_use_wrong"] == "first_use"
    assert kinds["random_wrong"] in ("random", "fresh_fails", "history")


def test_a_replay_of_a_failure_that_comes_and_goes_repeats_until_it_fails(tmp_path):
    """`repro` of a flaky (or nondeterministic) case file checks at least FLAKY_REPEATS times
    and, while none has failed, on up to the count at which a kernel still failing at the
    recorded rate (its 99% lower bound) passes them all with probability FLAKY_MISS."""
    assert [flaky_replays(r) for r in [None, (0, 10), (7, 10), (4, 10), (1, 10), (1, 1)]] == \
        [FLAKY_REPEATS, FLAKY_REPEATS, 33, 90, FLAKY_MAX_REPLAYS, 82]
    for failed, runs in [(7, 10), (4, 10), (10, 10), (9, 9)]:
        q, n = rate_lower_bound(failed, runs), flaky_replays((failed, runs))
        assert 0 < q < failed / runs + 1e-12
        assert (1 - q) ** n <= FLAKY_MISS < (1 - q) ** (n - 1) or n == FLAKY_REPEATS
    # a correct kernel on random_wrong's flaky record: every replay passes, all 90 of them
    case = Case(B=1, Hq=2, Hkv=1, Nq=5, Nk=3, D=8, dtype="float32", seed=2)
    verdict = {"status": "fail", "failure": "flaky", "observations": {"flaky": {
        "reruns_fresh_worker": [["pass", "fail (numerical)"]] * 4 + [["pass", "pass"]]}}}
    path = tmp_path / "flaky-0.json"
    save_case_file(path, case, verdict=verdict)
    good = subprocess.run([sys.executable, "-m", "flashcheck", "repro", str(path), "--kernel",
                           "torch.nn.functional:scaled_dot_product_attention", "--device",
                           "cpu"], capture_output=True, text=True, timeout=300, env=ENV,
                          cwd=ROOT)
    assert good.returncode == 0, good.stdout + good.stderr
    assert "runs:   0 of 90 failed: pass x90" in good.stdout, good.stdout
    assert "passes 90 runs with probability 1e-06" in good.stdout
    # the kernel that fails half its checks: stops once it has failed, after at least 8
    bad = _repro(path, "random_wrong")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    line = next(ln for ln in bad.stdout.splitlines() if ln.startswith("runs:"))
    n = int(line.split(" of ")[1].split()[0])
    assert FLAKY_REPEATS <= n < 90, line


def test_failure_that_passes_in_a_fresh_process_is_flaky_history(tmp_path):
    """Wrong only after many calls in the campaign's worker: its confirmation in a fresh
    worker (what `flashcheck repro` does) passes, so the failure is recorded as flaky with
    kind "history", not as a case file that would not replay."""
    rc, _ = _fuzz("history_wrong", tmp_path / "fz", "--examples", "120")
    assert rc == 1
    (f,) = (tmp_path / "fz" / "failures").glob("flaky-*.json")
    flaky = json.loads(f.read_text())["verdict"]["observations"]["flaky"]
    assert flaky["kind"] == "history", flaky


def test_failure_refused_in_a_fresh_process_is_flaky_fresh_not_run(tmp_path):
    """Run (wrongly) in the campaign's worker after many calls, refused in a fresh one: kept
    as flaky of kind "fresh_not_run", not as a failure "every time in a fresh worker"; its
    replay says not run (exit 125)."""
    rc, _ = _fuzz("compiled_until_history", tmp_path / "fz", "--examples", "120")
    assert rc == 1
    files = sorted((tmp_path / "fz" / "failures").glob("flaky-*.json"))
    assert files
    verdict = json.loads(files[0].read_text())["verdict"]
    flaky = verdict["observations"]["flaky"]
    assert flaky["kind"] == "fresh_not_run", flaky
    assert flaky["fail_rate_fresh_worker"] == 0.0
    assert "not run in a fresh worker (refused in 10 of 10 runs" in verdict["reason"]
    assert verdict["case"]["D"] < 16
    replay = _repro(files[0], "compiled_until_history")
    assert replay.returncode == 125, replay.stdout + replay.stderr
    assert "head dim must be at least 16" in replay.stdout


@pytest.mark.parametrize("script, kind", [
    (["not_run", "pass"] * 5, "history"),              # refused in some, passed in the rest
    (["not_run"] * 10, "fresh_not_run"),               # refused in every fresh worker
    (["not_run", "fail (numerical)", "pass", "pass"] * 2 + ["pass", "pass"], "random"),
    (["pass"] * 10, "history"),
])
def test_flaky_kind_from_fresh_worker_runs(script, kind):
    """The fresh-worker runs name the kind: a refusal is no failure, so runs that pass where
    the kernel runs them and are refused elsewhere are "history", not "at random"."""
    from types import SimpleNamespace

    from flashcheck.verify.fuzz import Campaign

    def verdict(word):
        status, _, failure = word.partition(" (")
        return SimpleNamespace(status=status, failure=failure.rstrip(")") or None)

    answers = iter(script)
    campaign = object.__new__(Campaign)
    campaign.deadline = None
    campaign.sup = SimpleNamespace(check=lambda case, **kw: verdict(next(answers)))
    got, text, runs = campaign._classify_flaky(None)
    assert (got, len(runs)) == (kind, 5), text
    if script.count("not_run") and kind == "history":
        assert "5 not run" in text


def test_random_order_is_a_failure(tmp_path):
    """A kernel whose bits change from call to call: nondeterministic, or flaky when a replay
    happened to repeat the bits; either way exit 1 and a file."""
    rc, _ = _fuzz("random_order", tmp_path / "fz", "--examples", "60")
    assert rc == 1
    classes = {json.loads(p.read_text())["verdict"]["failure"]
               for p in (tmp_path / "fz" / "failures").glob("*.json")}
    assert classes and classes <= {"nondeterministic", "flaky"}


def test_one_root_cause_is_one_failure_file(tmp_path):
    """Every head dim below 16 raises the same compiler error: --keep-going records it once,
    with the configurations it hit, instead of once per configuration."""
    out = tmp_path / "fz"
    rc = cli.main(["fuzz", "--kernel", _spec("compile_error_small_d"), "--device", "cpu",
                   "--seed", "3", "--max-n", "16", "--examples", "60", "--keep-going",
                   "--dtypes", "float32", "float16", "--out", str(out), "--quiet"])
    assert rc == 1
    files = sorted((out / "failures").glob("*.json"))
    assert [p.name.split("-")[0] for p in files] == ["raised"]
    info = json.loads(files[0].read_text())["verdict"]["observations"]["root_cause"]
    assert info["hits"] >= 2 and len(info["configurations"]) >= 2
    assert info["key"][3].startswith("misbehaving_kernels.py:")  # the innermost kernel frame


def test_sweep_dedups_by_root_cause_and_keeps_the_smallest_case(tmp_path):
    cases = [Case(B=1, Hq=2, Hkv=2, Nq=n, Nk=n, D=d, dtype=dt, seed=1)
             for n, d, dt in [(12, 8, "float32"), (5, 4, "float16"), (7, 32, "float32"),
                              (9, 2, "float32")]]
    recs = run_cases(None, cases, "cpu", kernel_spec=_spec("compile_error_small_d"),
                     failures_dir=tmp_path / "f", quiet=True)
    assert [r["status"] for r in recs] == ["fail", "fail", "pass", "fail"]
    files = list((tmp_path / "f").glob("*.json"))
    assert len(files) == 1
    case, meta = load_case_file(files[0])
    assert (case.Nq, case.D) == (5, 4)  # the smallest of the three
    info = meta["verdict"]["observations"]["root_cause"]
    assert info["hits"] == 3 and len(info["configurations"]) == 2
    assert {r["case_file"] for r in recs if r["status"] == "fail"} == {str(files[0])}


@pytest.mark.skipif(not pins_cpu_arithmetic(), reason="the BLAS core type is pinned on x86-64")
def test_workers_run_one_blas_core_type_whatever_the_host_picks(tmp_path, monkeypatch):
    """The interpreter's tl.dot is numpy's OpenBLAS sgemm, whose summation order follows the
    core type OpenBLAS picks per CPU (the CPU gate failed 5 of 77 configurations on budgets
    recorded on another x86-64 host). Workers start under one pinned core type, whatever the
    environment (here: another core type set by the user) says."""
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    kfile = tmp_path / "blas_env.py"
    kfile.write_text(
        "import os\nimport torch\n\n"
        "def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,\n"
        "              scale=None, enable_gqa=False):\n"
        f"    want = {CPU_ARITHMETIC_ENV['OPENBLAS_CORETYPE']!r}\n"
        "    assert os.environ.get('OPENBLAS_CORETYPE') == want\n"
        "    return torch.nn.functional.scaled_dot_product_attention(\n"
        "        query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale)\n")
    case = Case(B=1, Hq=2, Hkv=2, Nq=5, Nk=5, D=8, dtype="float32", seed=1)
    recs = run_cases(None, [case], "cpu", kernel_spec=f"{kfile}:attention",
                     failures_dir=tmp_path / "f", quiet=True)
    assert [r["status"] for r in recs] == ["pass"], recs


def test_cuda_error_replaces_the_worker_and_is_confirmed(tmp_path):
    """After a CUDA error every later call in that process fails; the worker is replaced, so
    the next cases pass, and the error is re-run in a fresh worker to confirm it."""
    cases = [Case(B=1, Hq=1, Hkv=1, Nq=n, Nk=4, D=8, dtype="float32", seed=2)
             for n in (4, 12, 4, 5)]
    recs = run_cases(None, cases, "cpu", kernel_spec=_spec("cuda_error_large"),
                     failures_dir=tmp_path / "f", quiet=True)
    assert [r["failure"] for r in recs] == [None, "cuda_error", None, None]
    assert recs[1]["observations"]["confirmed"]["reproduced"] is True
    assert "reproduced in a fresh worker" in recs[1]["reason"]


def test_confirmation_is_one_fresh_rerun_per_root_cause(tmp_path, monkeypatch):
    """Five CUDA errors of one root cause (each case after a warm-up pass in its worker):
    one fresh-worker re-run confirms all five; with the stop condition set (a spent time
    budget), nothing is re-run and every failure is still kept and says so."""
    from flashcheck.verify.supervise import Supervisor

    cases = [Case(B=1, Hq=1, Hkv=1, Nq=n, Nk=4, D=8, dtype="float32", seed=2)
             for n in (4, 12, 4, 13, 4, 14, 4, 15, 4, 16)]
    reruns = []
    real = Supervisor.run

    def counting(self, cs, **kw):
        if kw.get("fresh"):
            reruns.append(len(cs))
        return real(self, cs, **kw)

    monkeypatch.setattr(Supervisor, "run", counting)
    with Supervisor(_spec("cuda_error_large"), "cpu", failures_dir=tmp_path / "f") as sup:
        res = sup.run(cases)
    bad = [v for v in res.values() if v.failure == "cuda_error"]
    assert len(bad) == 5 and reruns == [1]
    assert all(v.observations["confirmed"]["reproduced"] is True for v in bad)
    assert sum("same root cause" in v.reason for v in bad) == 4
    reruns.clear()
    with Supervisor(_spec("cuda_error_large"), "cpu", failures_dir=tmp_path / "g") as sup:
        done: list = []  # the budget runs out as the last case finishes
        res = sup.run(cases, on_result=lambda i, v: done.append(i),
                      stop=lambda: "time budget of 1 s spent" if len(done) == len(cases)
                      else None)
    bad = [v for v in res.values() if v.failure == "cuda_error"]
    assert reruns == [] and len(bad) == 5
    assert all("not re-run in a fresh worker (time budget" in v.reason for v in bad)
    assert list((tmp_path / "g").glob("cuda_error-*.json"))


def test_sweep_hang_times_out_alone_in_parallel(tmp_path):
    """--jobs 2: the hanging case becomes a timeout within its limit, the others pass."""
    cases = [Case(B=1, Hq=1, Hkv=1, Nq=n, Nk=6, D=8, dtype="float32", seed=5)
             for n in (4, 12, 5, 6)]
    t0 = time.monotonic()
    recs = run_cases(None, cases, "cpu", kernel_spec=_spec("hang_large"),
                     failures_dir=tmp_path / "f", quiet=True, jobs=2, case_timeout=2.0)
    assert time.monotonic() - t0 < 15
    assert [r["failure"] for r in recs] == [None, "timeout", None, None]
    assert "case timeout of 2 s" in recs[1]["reason"]
    assert "hang_large" in recs[1]["observations"]["exception"]["frame"]
    (f,) = (tmp_path / "f").glob("timeout-*.json")
    assert recs[1]["case_file"] == str(f)


def test_gate_and_run_record_a_crash_and_exit_1(tmp_path, monkeypatch, capsys):
    from flashcheck import verify

    sweep = [Case(B=1, Hq=1, Hkv=1, Nq=n, Nk=6, D=8, dtype="float32", seed=5) for n in (4, 12)]
    monkeypatch.setattr(verify.strategies, "fixed_sweep",
                        lambda profile, api="dense": list(sweep))
    spec = _spec("segv_large")
    assert cli.main(["run", "--kernel", spec, "--device", "cpu", "--out", str(tmp_path / "r"),
                     "--quiet"]) == 1
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert rep["summary"]["cases"] == 2 and rep["summary"]["fail"] == 1
    assert "crashed" in (tmp_path / "r" / "report.md").read_text()
    assert cli.main(["gate", "--kernel", spec, "--device", "cpu", "--budgets",
                     str(tmp_path / "b.json"), "--corpus", str(tmp_path), "--update",
                     "--out", str(tmp_path / "g"), "--quiet"]) == 1
    assert list((tmp_path / "g" / "failures").glob("crashed-*.json"))


def test_root_cause_ignores_numbers_and_addresses():
    a = normalise_message("at 41:12: operands of shape (9, 8) and (8, 9): K = 8 at 0x7f3a1c")
    b = normalise_message("at 41:12: operands of shape (5, 4) and (4, 5): K = 4 at 0x55aa00")
    assert a == b
    v = {"failure": "raised", "reason": "x", "observations": {"exception": {
        "type": "CompilationError", "message": "K = 8", "frame": "k.py:3 in f",
        "where": "forward"}}}
    assert root_cause(v) == ("raised", "forward:CompilationError", "K = #", "k.py:3 in f")
    assert root_cause({"failure": "numerical"}) is None


def test_default_timeout_follows_the_median_and_leaves_first_cases_out():
    sup = Supervisor("sdpa-math", "cpu")
    try:
        assert sup.timeout() == BASE_TIMEOUT_S
        sup._times.extend([0.1, 0.2, 5.0])
        assert sup.timeout() == pytest.approx(BASE_TIMEOUT_S + TIMEOUT_MEDIAN_FACTOR * 0.2)
    finally:
        sup.close()
    assert Supervisor("sdpa-math", "cpu", case_timeout=3).timeout() == 3


def _hanging_in_flight(out: Path) -> bool:
    """An in-flight case that hang_large hangs on (more than 8 query rows)."""
    for p in (out / "inflight").glob("inflight-*.json"):
        try:
            case, _ = load_case_file(p)
        except (OSError, ValueError):  # being written or removed right now
            continue
        if case.Nq > 8:
            return True
    return False


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_killed_parent_leaves_an_in_flight_case_that_the_next_campaign_records(tmp_path):
    """Write-ahead: SIGKILL the campaign while a case hangs; its in-flight case file is on
    disk, with the kernels' settings the campaign ran under, and a campaign started in the
    same directory re-checks it first."""
    out = tmp_path / "fz"
    env = {**ENV, "FLASHCHECK_TEST_PATH": "in-flight", "FLASHCHECK_CONTROL_SEED": "5"}
    proc = subprocess.Popen([sys.executable, "-m", "flashcheck", "fuzz", "--kernel",
                             _spec("hang_large"), "--device", "cpu", "--seed", "7",
                             "--max-n", "16", "--dtypes", "float32", "--case-timeout", "600",
                             "--out", str(out), "--quiet"], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 60
        while time.monotonic() < end and not _hanging_in_flight(out):
            time.sleep(0.2)
        time.sleep(0.5)  # stuck in the hanging case (its timeout is 600 s)
        family = _descendants(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # the hung worker (and the fork server it keeps alive) go with the campaign
    end = time.monotonic() + 10
    while time.monotonic() < end and any(_alive(p) for p in family):
        time.sleep(0.2)
    assert not [p for p in family if _alive(p)]
    left = list((out / "inflight").glob("inflight-*.json"))
    assert len(left) == 1
    case, meta = load_case_file(left[0])
    assert meta["verdict"]["status"] == "in_flight" and case.Nq > 8
    # the kernels' settings (a harness-only one, the controls' seed, left out)
    assert meta["settings"]["FLASHCHECK_TEST_PATH"] == "in-flight"
    assert "FLASHCHECK_CONTROL_SEED" not in meta["settings"]
    rc, _ = _fuzz("hang_large", out, "--examples", "1", "--case-timeout", "1")
    assert rc == 1
    assert not list((out / "inflight").glob("*.json"))
    assert list((out / "failures").glob("timeout-*.json"))


def test_sigterm_keeps_what_was_found(tmp_path):
    out = tmp_path / "fz"
    proc = subprocess.Popen([sys.executable, "-m", "flashcheck", "fuzz", "--kernel",
                             _spec("hang_large"), "--device", "cpu", "--seed", "7",
                             "--max-n", "16", "--dtypes", "float32", "--case-timeout", "2",
                             "--examples", "100000", "--keep-going", "--out", str(out),
                             "--quiet"], env=ENV, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 60
        while time.monotonic() < end and not list((out / "failures").glob("*.json")):
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert "interrupted" in stdout
    assert list((out / "failures").glob("timeout-*.json"))


def test_an_interrupted_campaign_that_found_nothing_is_not_a_pass(tmp_path):
    """SIGTERM (a CI time limit) before the budget ends: nothing found yet, and still exit 1,
    as for `run` and `gate`: the campaign did not run what it was asked to."""
    out = tmp_path / "fz"
    proc = subprocess.Popen([sys.executable, "-m", "flashcheck", "fuzz", "--kernel",
                             "sdpa-math", "--device",
                             "cpu", "--seed", "7", "--max-n", "16", "--dtypes", "float32",
                             "--examples", "100000", "--out", str(out)], env=ENV,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end and not out.is_dir():
            time.sleep(0.1)
        time.sleep(4.0)  # the campaign is checking cases
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, stdout
    assert "not a pass (exit 1)" in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["exit"] == 1
    assert summary["failures"] == []


def test_the_campaign_process_never_imports_the_kernel(tmp_path):
    """Our Triton kernel runs in the workers only: the parent of `fuzz` never imports
    ``kernels``, nor Triton's JIT of it, and still gets verdicts from it."""
    code = ("import sys; from flashcheck.verify import cli; "
            f"rc = cli.main(['fuzz', '--kernel', 'triton', '--device', 'cpu', '--examples', "
            f"'2', '--seed', '1', '--max-n', '8', '--dtypes', 'float32', '--out', "
            f"{str(tmp_path / 'fz')!r}, '--quiet']); "
            "print('rc', rc, 'kernels' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env=ENV, cwd=ROOT)
    assert r.stdout.strip().splitlines()[-1] == "rc 0 False", r.stdout + r.stderr


@pytest.mark.parametrize(("argv", "needle"), [
    (["fuzz", "--kernel", "online", "--case-timeout", "0"], "--case-timeout"),
    (["run", "--device", "cpu", "--case-timeout", "inf"], "--case-timeout"),
    (["repro", "x.json", "--repeat", "0"], "--repeat"),
])
def test_bad_new_flags_exit_2_naming_the_argument(argv, needle, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


def test_a_failure_that_is_a_harness_error_each_time_is_kept_as_one_not_as_a_wrong_kernel():
    """fuzz's fresh-worker classification of a flaky failure: when every failing re-run
    was a harness_error (e.g. the bounds stage out of GPU memory beside other campaigns),
    the kind is ``harness``, not ``random``; one real wrong answer among them keeps it
    ``random``."""
    from types import SimpleNamespace

    from flashcheck.verify import fuzz

    def campaign(outcomes):
        it = iter(outcomes)

        def check(case, fresh=False, confirm=False):
            o = next(it)
            return SimpleNamespace(status="pass" if o == "pass" else "fail", failure=o)
        return SimpleNamespace(sup=SimpleNamespace(check=check), _past_deadline=lambda: False)

    runs = ["harness_error", "pass"] * fuzz.FLAKY_RERUNS
    kind, text, _ = fuzz.Campaign._classify_flaky(campaign(runs), case=None)
    assert kind == "harness" and "not a judgement of the kernel" in text
    assert f"{fuzz.FLAKY_RERUNS} of {2 * fuzz.FLAKY_RERUNS} runs" in text
    runs[1] = "numerical"
    kind, text, _ = fuzz.Campaign._classify_flaky(campaign(runs), case=None)
    assert kind == "random" and text.startswith("wrong at random")

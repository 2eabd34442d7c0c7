"""``flashcheck fuzz --workers N``: one campaign as N fuzz processes sharing one example database.

Each worker is a whole ``flashcheck fuzz`` process (its own Hypothesis engine, its own
supervised kernel worker: docs/contracts.md §6) writing to ``OUT/workers/w<i>/``. They share
Hypothesis's example database, Hypothesis's own protocol for that: a directory
(``DirectoryBasedExampleDatabase``, default ``OUT/hypothesis-db``, safe for concurrent
writers on one host or a shared file system) or a Redis server (``--db
redis://HOST:PORT/N``, ``RedisExampleDatabase``) for workers on several hosts. What one
worker saves (failing and covering examples, shrunk) the others replay and build on. There
is no coordinator: the same command on several hosts with the same ``--db`` scales out the
same way (README, "Scale a campaign out").

- Seeds: unseeded workers draw from their own random seeds (distinct) and use the database;
  with ``--seed S`` worker i runs seed S + i (reproducible; Hypothesis uses no database
  for a seeded run).
- Budget: ``--minutes M`` applies to each worker; ``--examples N`` is split between them, so
  the campaign runs N examples in all.
- Placement: with several CUDA GPUs, worker i sees GPU i mod count (``CUDA_VISIBLE_DEVICES``,
  the ids from ``verify.supervise.visible_gpus``, as the supervised workers are placed);
  on the CPU each gets cores / N OpenMP threads (unless ``OMP_NUM_THREADS`` is set).
- When every worker has ended, their failures are merged into ``OUT/failures/``: one file per
  signature (the one ``--keep-going`` uses: class, worst tensor, configuration, or the root
  cause), the smallest case of the workers that found it, with
  ``observations["workers"]`` (which workers found it, how often). The workers' own
  directories are kept as they are: nothing is lost if the merge is interrupted.
  ``OUT/summary.json`` counts every worker's examples.
- Exit status: 1 if any failure was found (or a worker died without a summary), 2 if a worker
  stopped on a usage error, else 0. Ctrl-C / SIGTERM are passed to the workers, which keep
  what they found; the merge still runs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

SUMMARY = "summary.json"


def example_shares(examples: int, workers: int) -> list[int]:
    """``examples`` split between ``workers`` as evenly as possible (every share >= 1)."""
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if examples < workers:
        raise ValueError(f"--examples ({examples}) must be at least --workers ({workers}): "
                         f"each worker runs one example or more")
    return [examples // workers + (i < examples % workers) for i in range(workers)]


def worker_argv(args: Any, index: int, out: Path, db: str, examples: int | None) -> list[str]:
    """The ``flashcheck fuzz`` command line of worker ``index``."""
    argv = [sys.executable, "-m", "flashcheck", "fuzz", "--kernel", args.kernel,
            "--out", str(out / "workers" / f"w{index}"), "--db", db, "--quiet"]
    if args.device:
        argv += ["--device", args.device]
    if examples is not None:
        argv += ["--examples", str(examples)]
    if args.minutes is not None:
        argv += ["--minutes", repr(args.minutes)]
    if args.seed is not None:
        argv += ["--seed", str(args.seed + index)]
    if args.keep_going:
        argv.append("--keep-going")
    if args.dtypes:
        argv += ["--dtypes", *args.dtypes]
    if args.max_n is not None:
        argv += ["--max-n", str(args.max_n)]
    if args.case_timeout is not None:
        argv += ["--case-timeout", repr(args.case_timeout)]
    if args.strict_subnormals:
        argv.append("--strict-subnormals")
    if getattr(args, "oracle_device", None):
        argv += ["--oracle-device", args.oracle_device]
    if getattr(args, "reuse_compiled", False):
        argv.append("--reuse-compiled")
    if getattr(args, "api", None):
        argv += ["--api", args.api]
    return argv


def worker_env(index: int, workers: int, device: str) -> dict[str, str]:
    from flashcheck.verify.supervise import visible_gpus

    env = dict(os.environ)
    gpus = visible_gpus(device)  # the supervised workers' rule: GPU index mod count
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus[index % len(gpus)]
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
    return env


def _pump(stream, prefix: str, lock: threading.Lock) -> None:
    for line in stream:
        with lock:
            sys.stdout.write(f"{prefix} {line}")
            sys.stdout.flush()


def run_workers(args: Any, device: str) -> int:
    """Run the campaign of ``args`` (parsed ``flashcheck fuzz`` options) as ``args.workers``
    processes; merge and summarise. Returns the exit status."""
    n = args.workers
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    db = args.db or str(out / "hypothesis-db")
    shares = example_shares(args.examples, n) if args.examples is not None else [None] * n
    print(f"fuzz: {n} workers, example database {db}"
          + ("" if args.seed is None else f" (seeded workers: {args.seed}..{args.seed + n - 1}, "
             "no database)"), flush=True)
    lock = threading.Lock()
    procs, pumps = [], []
    for i in range(n):
        p = subprocess.Popen(worker_argv(args, i, out, db, shares[i]),
                             env=worker_env(i, n, device), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, bufsize=1)
        t = threading.Thread(target=_pump, args=(p.stdout, f"[w{i}]", lock), daemon=True)
        t.start()
        procs.append(p)
        pumps.append(t)

    def _forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, _forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        codes = [p.wait() for p in procs]
        for t in pumps:
            t.join(5.0)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return merge(out, n, codes)


def _load(path: Path) -> tuple[Any, dict] | None:
    from flashcheck.verify.cases import Case

    try:
        d = json.loads(path.read_text())
        return Case.from_dict(d["case"]), d
    except (OSError, ValueError, KeyError, TypeError):
        return None


def merge(out: Path, n: int, codes: list[int]) -> int:
    """Merge the workers' failures into ``out/failures`` (one per signature, the smallest
    case) and write ``out/summary.json``; print the summary; return the exit status."""
    from flashcheck.verify.fuzz import signature
    from flashcheck.verify.sweep import case_size

    best: dict[tuple, dict] = {}
    per_worker = []
    for i in range(n):
        wdir = out / "workers" / f"w{i}"
        try:
            s = json.loads((wdir / SUMMARY).read_text())
        except (OSError, ValueError):
            s = None
        per_worker.append({"worker": i, "exit": codes[i], "summary": s})
        for path in sorted((wdir / "failures").glob("*.json")):
            loaded = _load(path)
            if loaded is None:
                continue
            case, d = loaded
            sig = signature(case, d.get("verdict") or {})
            entry = best.setdefault(sig, {"found_by": {}, "case": None, "path": None})
            entry["found_by"][f"w{i}"] = entry["found_by"].get(f"w{i}", 0) + 1
            if entry["case"] is None or case_size(case) < case_size(entry["case"]):
                entry.update(case=case, path=path, data=d)
    fdir = out / "failures"
    fdir.mkdir(parents=True, exist_ok=True)
    kept = []
    for entry in best.values():
        src: Path = entry["path"]
        d = entry["data"]
        d.setdefault("verdict", {}).setdefault("observations", {})["workers"] = {
            "found_by": sorted(entry["found_by"]),
            "files": sum(entry["found_by"].values()),
            "kept_from": src.parent.parent.name,
        }
        dst = fdir / src.name
        dst.write_text(json.dumps(d, indent=1) + "\n")
        md = src.with_suffix(".md")
        if md.exists():
            shutil.copyfile(md, dst.with_suffix(".md"))
        kept.append(str(dst))
    examples = sum((w["summary"] or {}).get("examples", 0) for w in per_worker)
    not_run = sum((w["summary"] or {}).get("not_run", 0) for w in per_worker)
    lost = [w["worker"] for w in per_worker if w["summary"] is None]
    usage = [w["worker"] for w in per_worker if w["exit"] == 2]
    status = 1 if (kept or lost or any(c == 1 for c in codes)) else (2 if usage else 0)
    summary = {"workers": n, "examples": examples, "not_run": not_run,
               "failures": sorted(kept), "per_worker": per_worker, "exit": status}
    (out / SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"fuzz: {n} workers, {examples} examples in all "
          f"({', '.join(str((w['summary'] or {}).get('examples', '?')) for w in per_worker)})"
          f"; {len(kept)} distinct failure(s)" + (f" in {fdir}" if kept else ""))
    for path in sorted(kept):
        print(f"  {path}")
    if lost:
        print(f"fuzz: worker(s) {', '.join(f'w{i}' for i in lost)} ended without a summary "
              f"(exit {', '.join(str(codes[i]) for i in lost)}); their directories under "
              f"{out / 'workers'} hold what they wrote")
    return status

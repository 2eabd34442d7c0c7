"""Running a list of cases against one kernel, and recording failures as case files.

Shared by ``flashcheck run``, ``gate``, ``fuzz`` and ``repro``: :func:`run_cases` checks each
case, turns each verdict into the dict the report consumes (``Verdict.to_dict()`` plus the
configuration key, the summary line and, for a failure, the case file it was written to), and
:func:`write_failure` writes ``DIR/<id>.json`` (the case file: case, kernel spec, versions,
device, verdict) and ``DIR/<id>.md`` (a human summary with the replay command).

Caveat: a failure id is the failure class plus a hash of the case JSON, so the same failing
case found twice overwrites its own file instead of piling up copies.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from verify import report as R
from verify.progress import Progress


def failure_id(case: Any, verdict: Any) -> str:
    """``<failure class>-<10 hex of sha1(case JSON)>``: stable for the same failing case."""
    payload = case.to_json(sort_keys=True) if hasattr(case, "to_json") else repr(case.to_dict())
    digest = hashlib.sha1(payload.encode()).hexdigest()[:10]
    return f"{verdict.failure or verdict.status}-{digest}"


def verdict_record(case: Any, verdict: Any, case_file: Path | None = None) -> dict[str, Any]:
    """``verdict.to_dict()`` plus ``config``, ``summary`` and ``case_file`` for the report."""
    d = verdict.to_dict()
    d["config"] = case.config_key()
    d["summary"] = verdict.summary()
    d["case_file"] = str(case_file) if case_file is not None else None
    return d


def failure_markdown(case: Any, record: dict[str, Any], *, kernel_spec: str, device: str,
                     case_file: Path) -> str:
    return "\n".join([
        f"# {record.get('failure') or record['status']}: `{kernel_spec}` on {device}",
        "",
        f"- case: `{case.short()}`",
        f"- configuration: `{R.config_label(record['config'])}`",
        f"- summary: {record['summary']}",
        f"- case file: [{case_file.name}]({case_file.name})",
        f"- replay: `{R.replay_command(str(case_file), kernel_spec, device)}`",
        "",
        R.render_verdict_table(record),
        "",
    ])


def write_failure(out_dir: str | Path, case: Any, verdict: Any, *, kernel_spec: str,
                  device: str) -> Path:
    """Write the case file and its Markdown summary into ``out_dir``; returns the case file.

    A case built on captured tensors gets its tensor file copied beside the case file, where
    ``load_case_file``'s caller (``repro``) looks for it.
    """
    from verify.cases import TensorCase, save_case_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fid = failure_id(case, verdict)
    path = out_dir / f"{fid}.json"
    verdict.case_file = str(path)  # so verdict.summary() carries the replay command
    save_case_file(path, case, kernel=kernel_spec, versions=R.versions(), device=device,
                   verdict=verdict)
    if isinstance(case, TensorCase):
        src = Path(case.path)
        shutil.copyfile(src, out_dir / f"{fid}{src.suffix}")
    record = verdict_record(case, verdict, path)
    (out_dir / f"{fid}.md").write_text(
        failure_markdown(case, record, kernel_spec=kernel_spec, device=device, case_file=path))
    return path


def run_cases(kernel: Any, cases: Iterable[Any], device: str, *, kernel_spec: str,
              failures_dir: str | Path | None, what: str = "cases",
              quiet: bool = False, budget_s: float | None = None,
              jobs: int = 1) -> list[dict[str, Any]]:
    """Check every case; returns the report records, in the order of ``cases``. Failures are
    written when a dir is given.

    No result is lost to a time limit or an interrupt: once ``budget_s`` seconds have passed,
    or on Ctrl-C / SIGTERM, the cases not yet checked are recorded as "not run" with that
    reason, and the caller still writes its report.

    ``jobs > 1`` checks the cases in that many worker processes (:func:`_run_parallel`); each
    resolves ``kernel_spec`` itself, so the spec must name the kernel (``kernel`` is then not
    used). Records and case files are the same as with one process.
    """
    import signal

    if not (isinstance(jobs, int) and jobs >= 1):
        raise ValueError(f"jobs must be an integer >= 1, got {jobs!r}")
    cases = list(cases)

    def _on_term(signum, frame):  # SIGTERM (e.g. `timeout`) becomes the same as Ctrl-C
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _on_term)
    try:
        with Progress(what, len(cases), quiet=quiet) as bar:
            if jobs > 1 and len(cases) > 1:
                return _run_parallel(cases, device, kernel_spec=kernel_spec,
                                     failures_dir=failures_dir, budget_s=budget_s,
                                     jobs=min(jobs, len(cases)), bar=bar)
            return _run_serial(kernel, cases, device, kernel_spec=kernel_spec,
                               failures_dir=failures_dir, budget_s=budget_s, bar=bar)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _budget_reason(budget_s: float) -> str:
    return f"time budget of {budget_s:g} s exhausted (--budget-s)"


def _not_run(case: Any, kernel_spec: str, device: str, reason: str) -> dict[str, Any]:
    from verify.check import Verdict

    verdict = Verdict(case=case, kernel=kernel_spec, device=device, status="not_run",
                      reason=reason)
    return verdict_record(case, verdict)


def _check_one(kernel: Any, case: Any, device: str, *, kernel_spec: str,
               failures_dir: str | Path | None, drawn: Any = None) -> dict[str, Any]:
    from verify.check import check_case

    verdict = check_case(kernel, case, device, drawn=drawn)
    case_file = None
    if verdict.status == "fail" and failures_dir is not None:
        case_file = write_failure(failures_dir, case, verdict, kernel_spec=kernel_spec,
                                  device=device)
    return verdict_record(case, verdict, case_file)


def _run_serial(kernel: Any, cases: list[Any], device: str, *, kernel_spec: str,
                failures_dir: str | Path | None, budget_s: float | None,
                bar: Progress) -> list[dict[str, Any]]:
    import time

    records: list[dict[str, Any]] = []
    t0 = time.monotonic()
    stop_reason: str | None = None
    drawing = Prefetch(cases)
    try:
        for i, case in enumerate(cases):
            if stop_reason is None and budget_s is not None and time.monotonic() - t0 > budget_s:
                stop_reason = _budget_reason(budget_s)
            if stop_reason is None:
                try:
                    drawn = drawing.take(i)
                    records.append(_check_one(kernel, case, device, kernel_spec=kernel_spec,
                                              failures_dir=failures_dir, drawn=drawn))
                    bar.advance(case.short()[:60])
                    continue
                except KeyboardInterrupt:
                    stop_reason = "interrupted before this case ran"
            records.append(_not_run(case, kernel_spec, device, stop_reason))
    finally:
        drawing.close()
    return records


class Prefetch:
    """Draws case i+1's inputs (``Case.draw``, CPU work that releases the GIL) in a thread
    while case i runs. ``take(i)`` returns case i's draw, or None, and the caller then
    materializes the case itself: for anything but a :class:`~verify.cases.Case` (a
    ``TensorCase`` loads captured tensors, which must not be replaced by a draw), and for a
    draw that raised, whose error then comes from the caller's own draw, as it always did."""

    def __init__(self, cases: list[Any]):
        import concurrent.futures as cf

        from verify.cases import Case

        self._cases = cases
        self._is_case = Case
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="draw")
        self._pending: dict[int, Any] = {}
        self._submit(0)

    def _submit(self, i: int) -> None:
        # type(), not isinstance: a TensorCase passes attribute reads through to its Case
        if i < len(self._cases) and type(self._cases[i]) is self._is_case:
            self._pending[i] = self._pool.submit(self._cases[i].draw)

    def take(self, i: int) -> Any:
        fut = self._pending.pop(i, None)
        self._submit(i + 1)  # queued behind case i's draw (one drawing thread)
        if fut is None:
            return None
        try:
            return fut.result()
        except Exception:
            return None

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


# Worker-process state for jobs > 1: the kernel is resolved once per worker.
_WORKER: dict[str, Any] = {}


def _worker_init(kernel_spec: str, device: str, threads: int) -> None:
    import signal

    import torch

    from verify.adapters import resolve_kernel

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what an interrupt does
    # The cores are shared out: J workers with a full-width OpenMP pool each would
    # oversubscribe the machine, and spinning OpenMP threads then slow every CPU-side step
    # (drawing inputs, metrics) by orders of magnitude.
    torch.set_num_threads(threads)
    _WORKER["kernel"] = resolve_kernel(kernel_spec, device)


def _worker_check(case: Any, device: str, kernel_spec: str, failures_dir: str | None,
                  deadline: float | None, budget_s: float | None) -> dict[str, Any]:
    import time

    if deadline is not None and time.time() > deadline:
        return _not_run(case, kernel_spec, device, _budget_reason(budget_s))
    return _check_one(_WORKER["kernel"], case, device, kernel_spec=kernel_spec,
                      failures_dir=failures_dir)


def _run_parallel(cases: list[Any], device: str, *, kernel_spec: str,
                  failures_dir: str | Path | None, budget_s: float | None, jobs: int,
                  bar: Progress) -> list[dict[str, Any]]:
    """``jobs`` spawned worker processes, one case per task. The budget is a wall-clock
    deadline that workers check before each case. On an interrupt the workers are stopped
    and every case without a result is recorded "not run"; a worker that dies (a crash in a
    kernel) fails only the cases that had no result, as ``worker_died`` failures naming the
    cause.

    Caveat: the cases that were running when an interrupt arrived are lost and recorded "not
    run"; a case is never reported twice.
    """
    import concurrent.futures as cf
    import multiprocessing
    import os
    import time
    from concurrent.futures.process import BrokenProcessPool

    import torch

    from verify.check import Verdict

    deadline = None if budget_s is None else time.time() + budget_s
    threads = max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // jobs))
    fdir = None if failures_dir is None else str(failures_dir)
    results: dict[int, dict[str, Any]] = {}
    pool = cf.ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context(
        "spawn"), initializer=_worker_init, initargs=(kernel_spec, device, threads))
    futures = {pool.submit(_worker_check, case, device, kernel_spec, fdir, deadline,
                           budget_s): i for i, case in enumerate(cases)}
    stop_reason = "interrupted before this case ran"
    try:
        for fut in cf.as_completed(futures):
            i = futures[fut]
            try:
                results[i] = fut.result()
            except BrokenProcessPool as e:
                # Conservative: a crash is a failure, and the crashing case is one of those
                # that had no result; ``--jobs 1`` (or ``repro``) tells which.
                verdict = Verdict(case=cases[i], kernel=kernel_spec, device=device,
                                  status="fail", failure="worker_died",
                                  reason=f"a worker process died while this case was pending "
                                         f"({e}); rerun with --jobs 1 to find the crashing case")
                results[i] = verdict_record(cases[i], verdict)
            bar.advance(cases[i].short()[:60])
    except KeyboardInterrupt:
        for fut in futures:
            fut.cancel()
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.terminate()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return [results[i] if i in results else _not_run(c, kernel_spec, device, stop_reason)
            for i, c in enumerate(cases)]

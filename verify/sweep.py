"""Running a list of cases against one kernel, and recording failures as case files.

Shared by ``flashcheck run``, ``gate``, ``fuzz`` and ``repro``: :func:`run_cases` checks each
case in supervised worker processes (verify/supervise.py), turns each verdict into the dict
the report consumes (``Verdict.to_dict()`` plus the configuration key, the summary line and,
for a failure, the case file it was written to), and :func:`write_failure` writes
``DIR/<id>.json`` (the case file: case, kernel spec, versions, device, verdict) and
``DIR/<id>.md`` (a human summary with the replay command).

Caveat: a failure id is the failure class plus a hash of the case JSON, so the same failing
case found twice overwrites its own file instead of piling up copies.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from flashcheck.verify import report as R
from flashcheck.verify.progress import Progress

# The "not run" reason of the cases an interrupt (Ctrl-C, SIGTERM) left unchecked; callers
# that go on after run_cases (the pytest plugin) read it to stop too.
INTERRUPTED = "interrupted before this case ran"


def interrupted(records: list[dict[str, Any]]) -> int:
    """How many of :func:`run_cases`' records an interrupt left unchecked."""
    return sum(r.get("reason") == INTERRUPTED for r in records)


def case_digest(case: Any) -> str:
    """10 hex of sha1(case JSON): names a case's failure and write-ahead files."""
    payload = case.to_json(sort_keys=True) if hasattr(case, "to_json") else repr(case.to_dict())
    return hashlib.sha1(payload.encode()).hexdigest()[:10]


def failure_id(case: Any, verdict: Any) -> str:
    """``<failure class>-<10 hex of sha1(case JSON)>``: stable for the same failing case."""
    return f"{verdict.failure or verdict.status}-{case_digest(case)}"


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
    from flashcheck.verify.cases import TensorCase, save_case_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fid = failure_id(case, verdict)
    path = out_dir / f"{fid}.json"
    verdict.case_file = str(path)  # so verdict.summary() carries the replay command
    save_case_file(path, case, kernel=kernel_spec, versions=R.versions(), device=device,
                   verdict=verdict, settings=R.kernel_settings())
    if isinstance(case, TensorCase):
        src = Path(case.path)
        shutil.copyfile(src, out_dir / f"{fid}{src.suffix}")
    record = verdict_record(case, verdict, path)
    (out_dir / f"{fid}.md").write_text(
        failure_markdown(case, record, kernel_spec=kernel_spec, device=device, case_file=path))
    return path


def supervisor_for(kernel_spec: str, device: str, *, jobs: int = 1,
                   case_timeout: float | None = None, failures_dir: str | Path | None = None,
                   strict_subnormals: bool = False) -> Any:
    """The :class:`~verify.supervise.Supervisor` that :func:`run_cases` starts for ``jobs``
    workers (not started yet): with several, the cores are shared out between them (see
    verify/supervise.py). A caller that needs the kernel's worker before the cases (its
    declared API) makes it here and passes it to ``run_cases``."""
    from flashcheck.verify.supervise import Supervisor

    threads = None
    if jobs > 1:
        import os

        import torch

        threads = max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // jobs))
    return Supervisor(kernel_spec, device, case_timeout=case_timeout,
                      failures_dir=failures_dir, threads=threads,
                      strict_subnormals=strict_subnormals)


def run_cases(kernel: Any, cases: Iterable[Any], device: str, *, kernel_spec: str,
              failures_dir: str | Path | None, what: str = "cases",
              quiet: bool = False, budget_s: float | None = None,
              jobs: int = 1, case_timeout: float | None = None,
              strict_subnormals: bool = False,
              supervisor: Any | None = None) -> list[dict[str, Any]]:
    """Check every case; returns the report records, in the order of ``cases``. Failures are
    written when a dir is given.

    The cases run in supervised worker processes (verify/supervise.py) that resolve
    ``kernel_spec`` themselves; ``kernel`` is not used (kept for callers) and this process
    never calls the kernel. ``jobs`` workers share the cases; a crash, a timeout
    (``case_timeout``, default derived from observed case times) or a CUDA error fails that
    case alone (``crashed`` / ``timeout`` / ``cuda_error``) and its worker is replaced.

    ``supervisor``: a :class:`~verify.supervise.Supervisor` to run the cases in, left open,
    so its workers (kernel imported, Triton kernels compiled) serve the next call too: the
    pytest plugin runs one configuration per call. Its own ``failures_dir``, case timeout,
    threads and ``strict_subnormals`` apply; pass the same ``failures_dir`` here. None: a
    supervisor is started for this call and closed at its end.

    No result is lost to a time limit or an interrupt: once ``budget_s`` seconds have passed,
    or on Ctrl-C / SIGTERM, the cases not yet checked are recorded as "not run" with that
    reason, and the caller still writes its report. Raised, crashed and timeout failures with
    one root cause (:func:`verify.supervise.root_cause`) share one failure file: the smallest
    case, with the number of cases and configurations it hit.
    """
    import contextlib
    import time

    from flashcheck.verify import interrupts

    if not (isinstance(jobs, int) and jobs >= 1):
        raise ValueError(f"jobs must be an integer >= 1, got {jobs!r}")
    cases = list(cases)

    t0 = time.monotonic()

    def stop() -> str | None:
        interrupts.check()  # a SIGTERM whose own raise was dropped (verify/interrupts.py)
        if budget_s is not None and time.monotonic() - t0 > budget_s:
            return _budget_reason(budget_s)
        return None

    results: dict[int, Any] = {}
    stop_reason = None
    # SIGTERM (e.g. `timeout`) becomes the same as Ctrl-C, and neither is lost
    with interrupts.interruptible():
        own = supervisor is None
        with Progress(what, len(cases), quiet=quiet) as bar, \
                (supervisor_for(kernel_spec, device, jobs=jobs, case_timeout=case_timeout,
                                failures_dir=failures_dir,
                                strict_subnormals=strict_subnormals) if own
                 else contextlib.nullcontext(supervisor)) as sup:
            if cases:
                sup.start()
            try:
                sup.run(cases, jobs=min(jobs, max(1, len(cases))), results=results, stop=stop,
                        on_result=lambda i, v: bar.advance(cases[i].short()[:60]))
            except KeyboardInterrupt:
                interrupts.clear()
                stop_reason = INTERRUPTED
    if stop_reason is None and budget_s is not None:
        stop_reason = _budget_reason(budget_s)
    done = sorted(results)
    consolidate([cases[i] for i in done], [results[i] for i in done], failures_dir,
                kernel_spec=kernel_spec, device=device)
    records = []
    for i, case in enumerate(cases):
        if i not in results:
            records.append(_not_run(case, kernel_spec, device, stop_reason or "not run"))
            continue
        verdict = results[i]
        if verdict.status == "fail" and failures_dir is not None and not verdict.case_file:
            write_failure(failures_dir, case, verdict, kernel_spec=kernel_spec, device=device)
        records.append(verdict_record(case, verdict, verdict.case_file))
    return records


def case_size(case: Any) -> tuple:
    """Orders cases from small to large (elements of the score matrix first)."""
    return (case.B * case.Hq * case.Nq * case.Nk * case.D, case.B, case.Hq, case.Nq, case.Nk,
            case.D, case_digest(case))


def _remove_failure_files(path: str | Path) -> None:
    path = Path(path)
    for p in path.parent.glob(path.stem + ".*"):
        try:
            p.unlink()
        except OSError:
            pass


def consolidate(cases: list[Any], verdicts: list[Any], failures_dir: str | Path | None, *,
                kernel_spec: str, device: str) -> None:
    """Root-cause deduplication of raised / crashed / timeout / cuda_error verdicts (in place).

    Per root cause, the smallest case keeps the failure file; the verdict records
    ``observations["root_cause"] = {"key", "hits", "configurations"}``; every other verdict of
    that cause points to the kept file (``case_file``) and its own file, if one was written,
    is removed."""
    from flashcheck.verify.supervise import root_cause

    groups: dict[tuple, list[int]] = {}
    for i, v in enumerate(verdicts):
        key = root_cause(v) if v.status == "fail" else None
        if key is not None:
            groups.setdefault(key, []).append(i)
    for key, idx in groups.items():
        keep = min(idx, key=lambda i: case_size(cases[i]))
        configs = sorted({R.config_label(cases[i].config_key()) for i in idx}, key=R._natural)
        info = {"key": list(key), "hits": len(idx), "configurations": configs}
        for i in idx:
            verdicts[i].observations["root_cause"] = info
        if failures_dir is None:
            continue
        for i in idx:
            if i != keep and verdicts[i].case_file:
                _remove_failure_files(verdicts[i].case_file)
        path = write_failure(failures_dir, cases[keep], verdicts[keep], kernel_spec=kernel_spec,
                             device=device)
        for i in idx:
            verdicts[i].case_file = str(path)


def _budget_reason(budget_s: float) -> str:
    return f"time budget of {budget_s:g} s exhausted (--budget-s)"


def _not_run(case: Any, kernel_spec: str, device: str, reason: str) -> dict[str, Any]:
    from flashcheck.verify.check import Verdict

    verdict = Verdict(case=case, kernel=kernel_spec, device=device, status="not_run",
                      reason=reason)
    return verdict_record(case, verdict)


class Prefetch:
    """(For in-process callers; a supervised worker draws the next case itself, from the
    ``next_case`` the parent sends with each case.) Draws case i+1's inputs (``Case.draw``,
    CPU work that releases the GIL) in a thread while case i runs. ``take(i)`` returns case
    i's draw, or None, and the caller then materializes the case itself: for anything but a
    :class:`~verify.cases.Case` (a ``TensorCase`` loads captured tensors, which must not be
    replaced by a draw), and for a draw that raised, whose error then comes from the
    caller's own draw, as it always did."""

    def __init__(self, cases: list[Any]):
        import concurrent.futures as cf

        from flashcheck.verify.cases import Case

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

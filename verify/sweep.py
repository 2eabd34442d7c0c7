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
              quiet: bool = False, budget_s: float | None = None) -> list[dict[str, Any]]:
    """Check every case; returns the report records. Failures are written when a dir is given.

    No result is lost to a time limit or an interrupt: once ``budget_s`` seconds have passed,
    or on Ctrl-C / SIGTERM, the cases not yet checked are recorded as "not run" with that
    reason, and the caller still writes its report.
    """
    import signal
    import time

    from verify.check import Verdict, check_case

    cases = list(cases)
    records: list[dict[str, Any]] = []
    t0 = time.monotonic()
    stop_reason: str | None = None

    def _on_term(signum, frame):  # SIGTERM (e.g. `timeout`) becomes the same as Ctrl-C
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _on_term)
    try:
        with Progress(what, len(cases), quiet=quiet) as bar:
            for case in cases:
                if budget_s is not None and time.monotonic() - t0 > budget_s:
                    stop_reason = f"time budget of {budget_s:g} s exhausted (--budget-s)"
                if stop_reason is None:
                    try:
                        verdict = check_case(kernel, case, device)
                    except KeyboardInterrupt:
                        stop_reason = "interrupted before this case ran"
                if stop_reason is not None:
                    verdict = Verdict(case=case, kernel=kernel_spec, device=device,
                                      status="not_run", reason=stop_reason)
                    records.append(verdict_record(case, verdict))
                    continue
                case_file = None
                if verdict.status == "fail" and failures_dir is not None:
                    case_file = write_failure(failures_dir, case, verdict,
                                              kernel_spec=kernel_spec, device=device)
                records.append(verdict_record(case, verdict, case_file))
                bar.advance(case.short()[:60])
    finally:
        signal.signal(signal.SIGTERM, previous)
    return records

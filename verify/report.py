"""Per-configuration reports: ``report.json``, ``report.md`` and a self-contained ``report.html``.

Input is a list of verdict dicts (``Verdict.to_dict()``). The CLI adds three optional keys to
each before handing them over: ``config`` (``Case.config_key()``), ``summary``
(``Verdict.summary()``) and, for failures, ``case_file`` (where the case file was written).
Without ``config`` the key is rebuilt from the case through ``verify.cases.Case``.

A configuration is the report's unit: dtype x D bucket x N bucket x causal x mask x
distribution x GQA. Per configuration the report gives the number of cases, and per tensor the
worst case (the one with the largest observed / tolerance ratio): its max abs error, the
tolerance applied, the a-priori bound, observed / tolerance, observed / a-priori, the
baseline's error, and whether every case passed. Cases that did not run are counted with their
reasons.

The HTML embeds its plots as base64 PNGs (matplotlib, Agg backend), so the file can be mailed
or attached to a CI run on its own. ``compare_reports`` builds the cross-kernel Markdown table
from several ``report.json`` files.

Caveats:
- JSON has no NaN or infinity; non-finite numbers are written as the strings ``"nan"``,
  ``"inf"``, ``"-inf"`` and read back by ``load_report``.
- Plots need matplotlib (the ``report`` extra). Without it the HTML says so instead of
  showing them; the tables are unaffected.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import importlib.metadata
import io
import json
import math
import os
import platform
import re
import shlex
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flashcheck.verify import ORACLE_ENV, __version__

REPORT_FORMAT = "flashcheck-report"
REPORT_VERSION = 1
TENSOR_ORDER = ("out", "lse", "dq", "dk", "dv")
STATUS_COLOURS = {"pass": "#d9f2d9", "fail": "#f8d0d0", "not_run": "#e6e6e6"}


# ----------------------------------------------------------------------------- numbers / json


def _num(x: Any) -> Any:
    """A float for JSON: finite floats as-is, non-finite ones as strings."""
    if isinstance(x, bool) or x is None:
        return x
    if isinstance(x, (int, float)):
        xf = float(x)
        if math.isnan(xf):
            return "nan"
        if math.isinf(xf):
            return "inf" if xf > 0 else "-inf"
        return x
    return x


def _sanitize(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_sanitize(v) for v in obj]
    return _num(obj)


def _f(x: Any) -> float:
    """A float back from JSON (the strings "nan"/"inf"/"-inf" included); None -> nan."""
    if x is None:
        return math.nan
    if isinstance(x, str):
        return float(x)
    return float(x)


def _ratio_key(x: Any) -> float:
    """Sort key for ratios: NaN (an error that could not be measured) ranks as the worst."""
    v = _f(x)
    return math.inf if math.isnan(v) else v


def fmt(x: Any, digits: int = 3) -> str:
    """Short numeric text for tables."""
    if x is None:
        return "-"
    v = _f(x)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:.{digits}g}"


def _natural(s: str) -> list:
    """Natural sort key: "N<=128" before "N<=1024"."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


# ----------------------------------------------------------------------------- header


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Versions of what the numbers depend on. Reads package metadata; imports nothing."""
    return {
        "flashcheck": __version__,
        "torch": _version("torch"),
        "triton": _version("triton"),
        "numpy": _version("numpy"),
        "hypothesis": _version("hypothesis"),
        "python": platform.python_version(),
    }


def settings() -> dict[str, str]:
    """The ``FLASHCHECK_*`` environment variables set for this run, sorted: the kernels' path
    and schedule (``FLASHCHECK_GLUON``, ``FLASHCHECK_GLUON_SCHEDULE``, ...) and the harness's
    own, which a replay elsewhere needs beside the command line."""
    return {k: os.environ[k] for k in sorted(os.environ) if k.startswith("FLASHCHECK_")}


def make_header(
    *, kernel: str, device: str, command: Sequence[str] | str | None = None, **extra: Any
) -> dict[str, Any]:
    """The report header: kernel, device, GPU name, versions, date, command line and the
    ``FLASHCHECK_*`` settings it ran under."""
    gpu = None
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(torch.device(device))
    if command is None:
        command = ["flashcheck", *sys.argv[1:]]
    if not isinstance(command, str):
        command = shlex.join(command)
    header = {
        "kernel": kernel,
        "device": device,
        "gpu": gpu,
        "versions": versions(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "settings": settings(),
        "platform": platform.platform(),
    }
    header.update(extra)
    return header


# ----------------------------------------------------------------------------- aggregation


def config_of(verdict: Mapping[str, Any]) -> dict[str, Any]:
    """The configuration key of one verdict dict."""
    if verdict.get("config") is not None:
        return dict(verdict["config"])
    from flashcheck.verify.cases import Case

    return dict(Case.from_dict(verdict["case"]).config_key())


def config_label(key: Mapping[str, Any]) -> str:
    """A one-line, stable name for a configuration (the budgets file is keyed by it)."""
    return " ".join(f"{k}={v}" for k, v in key.items())


# What pins the CPU's arithmetic (the ISA ATen's and oneDNN's kernels take, MKL's code path,
# the threads a reduction is split over): the oracles, the family and CPU kernels round
# differently without them, so a case judged under pins replays bit for bit only under the
# same ones (a controls campaign's case under `tox -e controls`' AVX2 pins failed at 1.002x
# its rule with them and passed without: the effective sample count moved across 128).
# OpenBLAS's core type is pinned by the harness itself (supervise.CPU_ARITHMETIC_ENV).
REPLAY_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS")


# FLASHCHECK_* settings that do not choose what a kernel computes: the oracle's device (a
# flag of the replay), a worker's profile output and the controls campaign's seed
HARNESS_ONLY_SETTINGS = (ORACLE_ENV, "FLASHCHECK_WORKER_CPROFILE", "FLASHCHECK_CONTROL_SEED")


def kernel_settings() -> dict[str, str]:
    """:func:`settings` less :data:`HARNESS_ONLY_SETTINGS`: the ``FLASHCHECK_*`` variables
    that choose the code a kernel runs (the Gluon path, its schedule, ...), which a case file
    records and a replay sets again."""
    return {k: v for k, v in settings().items() if k not in HARNESS_ONLY_SETTINGS}


def replay_command(case_file: str, kernel: str, device: str) -> str:
    """The command that replays ``case_file``: ``flashcheck repro`` with the kernel, the
    device, the oracle's device where it was moved, and, in front, the CPU arithmetic pins
    (:data:`REPLAY_ENV`) and the kernels' ``FLASHCHECK_*`` settings
    (:func:`kernel_settings`) this process runs under, so that the replay launches the code
    that failed (a case file records them too, and ``repro`` sets them where the
    environment does not)."""
    extra = (["--oracle-device", "device"]  # judged where the kernel ran (--oracle-device)
             if os.environ.get(ORACLE_ENV) == "device" else [])
    pins = [f"{k}={os.environ[k]}" for k in REPLAY_ENV if os.environ.get(k)]
    pins += [f"{k}={v}" for k, v in kernel_settings().items()]
    return shlex.join([*(["env", *pins] if pins else []), "flashcheck", "repro",
                       str(case_file), "--kernel", kernel, "--device", device, *extra])


def _case_n(case: Mapping[str, Any]) -> int | None:
    n = case.get("Nk", case.get("Nq"))
    return int(n) if n is not None else None


def _worst_tensor(entries: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The entry with the largest observed / tolerance ratio, plus pass counts."""
    worst = max(entries, key=lambda t: _ratio_key(t.get("ratio")))
    return {
        "max_abs": _f(worst.get("max_abs")),
        "tol": _f(worst.get("tol")),
        "apriori": _f(worst.get("apriori")),
        "ratio": _f(worst.get("ratio")),
        "ratio_apriori": _f(worst.get("ratio_apriori")),
        "baseline_err": _f(worst.get("baseline_err")),
        "member": worst.get("member", ""),
        "max_ulps": _f(worst.get("max_ulps")),
        "bias": _f(worst.get("bias")),
        "worst_of_all_max_abs": max((_f(t.get("max_abs")) for t in entries),
                                    key=lambda v: math.inf if math.isnan(v) else v),
        "cases": len(entries),
        "failed": sum(1 for t in entries if not t.get("passed", False)),
        "passed": all(t.get("passed", False) for t in entries),
        "note": worst.get("note", ""),
    }


def build_report(
    verdicts: Iterable[Mapping[str, Any]], *, header: Mapping[str, Any]
) -> dict[str, Any]:
    """Aggregate verdict dicts into the report structure written as ``report.json``."""
    verdicts = list(verdicts)
    groups: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    keys: dict[str, dict[str, Any]] = {}
    for v in verdicts:
        key = config_of(v)
        label = config_label(key)
        keys.setdefault(label, key)
        groups[label].append(v)

    configs = []
    failures = []
    not_run = []
    points = []
    for label in sorted(groups, key=_natural):
        vs = groups[label]
        statuses = Counter(v["status"] for v in vs)
        ran = [v for v in vs if v["status"] != "not_run"]
        per_tensor: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
        for v in ran:
            for name, t in (v.get("tensors") or {}).items():
                per_tensor[name].append(t)
        names = sorted(per_tensor, key=lambda n: (TENSOR_ORDER + (n,)).index(n))
        tensors = {name: _worst_tensor(per_tensor[name]) for name in names}
        reasons = Counter(v.get("reason", "") for v in vs if v["status"] == "not_run")
        failure_classes = Counter(v.get("failure") for v in vs if v["status"] == "fail")
        if statuses.get("fail"):
            status = "fail"
        elif ran:
            status = "pass"
        else:
            status = "not_run"
        ratios = [t["ratio"] for t in tensors.values()]
        worst_ratio = max(ratios, key=lambda r: math.inf if math.isnan(r) else r) if ratios \
            else None
        # A failure that produced no tensor numbers (it raised, mutated its input, ...)
        # has no ratio; it still fails, and the gate treats it as unbounded.
        if status == "fail" and (worst_ratio is None or worst_ratio <= 1.0):
            worst_ratio = math.inf
        configs.append({
            "label": label,
            "key": keys[label],
            "cases": len(vs),
            "counts": {s: statuses.get(s, 0) for s in ("pass", "fail", "not_run")},
            "status": status,
            "worst_ratio": worst_ratio,
            "tensors": tensors,
            "failure_classes": dict(failure_classes),
            "not_run": [{"reason": r, "count": c} for r, c in reasons.most_common()],
        })
        for r, c in reasons.most_common():
            not_run.append({"config": label, "reason": r, "count": c})
        for v in vs:
            case = v.get("case") or {}
            if v["status"] == "fail":
                case_file = v.get("case_file")
                failures.append({
                    "config": label,
                    "failure": v.get("failure"),
                    "summary": v.get("summary") or v.get("reason", ""),
                    "case_file": case_file,
                    "replay": replay_command(case_file, v.get("kernel", header.get("kernel")),
                                             v.get("device", header.get("device")))
                    if case_file else None,
                })
            if v["status"] == "not_run":
                continue
            for name, t in (v.get("tensors") or {}).items():
                points.append({
                    "config": label, "dtype": case.get("dtype"), "N": _case_n(case),
                    "D": case.get("D"), "tensor": name, "status": v["status"],
                    "max_abs": _f(t.get("max_abs")), "tol": _f(t.get("tol")),
                    "apriori": _f(t.get("apriori")), "baseline_err": _f(t.get("baseline_err")),
                })

    # Failures first, then passes, then what did not run; by configuration name within each.
    rank = {"fail": 0, "pass": 1, "not_run": 2}
    configs.sort(key=lambda c: (rank[c["status"]], _natural(c["label"])))
    counts = Counter(v["status"] for v in verdicts)
    summary = {
        "cases": len(verdicts),
        "pass": counts.get("pass", 0),
        "fail": counts.get("fail", 0),
        "not_run": counts.get("not_run", 0),
        "configs": len(configs),
        "configs_failed": sum(1 for c in configs if c["status"] == "fail"),
        "configs_not_run": sum(1 for c in configs if c["status"] == "not_run"),
    }
    return {
        "format": REPORT_FORMAT,
        "version": REPORT_VERSION,
        "header": dict(header),
        "summary": summary,
        "configs": configs,
        "failures": failures,
        "not_run": not_run,
        "points": points,
    }


def load_report(path: str | Path) -> dict[str, Any]:
    """Read a ``report.json``; raises ValueError naming the file if it is not one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"report file {path}: cannot read it as JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != REPORT_FORMAT:
        raise ValueError(f"report file {path}: not a flashcheck report "
                         f"(expected format {REPORT_FORMAT!r})")
    return data


# ----------------------------------------------------------------------------- text renderings


def key_fields(configs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The configuration key's field names, in first-seen order, over all configurations."""
    names: list[str] = []
    for c in configs:
        for k in c["key"]:
            if k not in names:
                names.append(k)
    return names


def _key_cells(c: Mapping[str, Any], fields: Sequence[str]) -> list[str]:
    return [str(c["key"].get(f, "-")) for f in fields]


def status_text(c: Mapping[str, Any]) -> str:
    """E.g. "pass", "fail: 1/3 cases", "pass, 1 not run", "not run"."""
    counts = c["counts"]
    text = c["status"].replace("_", " ")
    if counts["fail"]:
        text += f": {counts['fail']}/{c['cases']} cases"
    if c["status"] != "not_run" and counts["not_run"]:
        text += f", {counts['not_run']} not run"
    return text


def _family_cell(t: Mapping[str, Any]) -> str:
    """The worst family member's error, and which member it is (reference/family.py)."""
    member = t.get("member") or ""
    return fmt(t.get("baseline_err")) + (f" ({member})" if member else "")


def _tensor_cell(t: Mapping[str, Any]) -> tuple[str, ...]:
    return (fmt(t["max_abs"]), fmt(t["tol"]), fmt(t["apriori"]), fmt(t["ratio"]),
            fmt(t["ratio_apriori"]), _family_cell(t))


def _md_escape(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def render_markdown(report: Mapping[str, Any]) -> str:
    h = report["header"]
    s = report["summary"]
    vers = ", ".join(f"{k} {v}" for k, v in h.get("versions", {}).items() if v)
    lines = [
        f"# flashcheck report: `{h.get('kernel')}` on {h.get('device')}",
        "",
        f"- GPU: {h.get('gpu') or 'none'}",
        f"- versions: {vers}",
        f"- date: {h.get('date')}",
        f"- command: `{h.get('command')}`",
        f"- settings: {' '.join(f'`{k}={v}`' for k, v in h.get('settings', {}).items()) or 'none'}",
        "",
        f"**{s['cases']} cases in {s['configs']} configurations: {s['pass']} pass, "
        f"{s['fail']} fail, {s['not_run']} not run.**",
        "",
        "## Per configuration",
        "",
        "ratio = observed max abs error / tolerance (> 1 fails); vs a-priori = observed / "
        "a-priori bound. Per tensor, the worst case of the configuration.",
        "",
    ]
    fields = key_fields(report["configs"])
    lines += [
        "| " + " | ".join(fields) + " | cases | status | tensor | max abs | tolerance "
        "| a-priori | ratio | vs a-priori | family worst (member) | not run |",
        "|" + "---|" * len(fields) + "---:|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in report["configs"]:
        status = status_text(c)
        nr = "; ".join(f"{_md_escape(r['reason'])} (x{r['count']})" for r in c["not_run"])
        tensors = list(c["tensors"].items()) or [(None, None)]
        for i, (name, t) in enumerate(tensors):
            first = i == 0
            cells = [
                *(_key_cells(c, fields) if first else [""] * len(fields)),
                str(c["cases"]) if first else "",
                status if first else "",
                name or "-",
                *(_tensor_cell(t) if t else ("-",) * 6),
                nr if first else "",
            ]
            if t and not t["passed"]:
                cells[len(fields) + 2] = f"**{name}** ✗"
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Failures", ""]
    if not report["failures"]:
        lines.append("None.")
    for f in report["failures"]:
        lines.append(f"- `{f['config']}` [{f['failure']}]: {_md_escape(f['summary'])}")
        if f.get("case_file"):
            lines.append(f"  - case file: [{f['case_file']}]({f['case_file']})")
            lines.append(f"  - replay: `{f['replay']}`")
    lines += ["", "## Not run", ""]
    if not report["not_run"]:
        lines.append("Nothing was skipped.")
    for n in report["not_run"]:
        lines.append(f"- `{n['config']}` (x{n['count']}): {_md_escape(n['reason'])}")
    return "\n".join(lines) + "\n"


def print_failures(report: Mapping[str, Any], more_in: Path | None = None,
                   limit: int = 10) -> None:
    """The first ``limit`` failures of ``report``, each with its replay command; with
    ``more_in``, a line saying how many more are in that directory."""
    for f in report["failures"][:limit]:
        print(f"FAIL {f['summary']}\n  replay: {f['replay']}")
    if more_in is not None and len(report["failures"]) > limit:
        print(f"... and {len(report['failures']) - limit} more failures in {more_in}")


def render_terminal_table(report: Mapping[str, Any]) -> str:
    """The short per-configuration table printed at the end of ``flashcheck run``."""
    fields = key_fields(report["configs"])
    rows = [(*fields, "cases", "status", "worst", "ratio")]
    for c in report["configs"]:
        worst = "-"
        if c["tensors"]:
            worst = max(c["tensors"], key=lambda n: _ratio_key(c["tensors"][n]["ratio"]))
        status = c["status"].replace("_", " ")
        if c["status"] != "not_run" and c["counts"]["not_run"]:
            status += "*"
        rows.append((*_key_cells(c, fields), str(c["cases"]), status, worst,
                     fmt(c["worst_ratio"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
           for r in rows]
    s = report["summary"]
    out.append(f"{s['cases']} cases, {s['configs']} configurations: {s['pass']} pass, "
               f"{s['fail']} fail, {s['not_run']} not run"
               + ("  (* = some cases not run)" if any(
                   c["counts"]["not_run"] and c["status"] != "not_run"
                   for c in report["configs"]) else ""))
    return "\n".join(out)


def render_verdict_table(verdict: Mapping[str, Any]) -> str:
    """The per-tensor table of one verdict dict (``repro`` prints it; failure summaries embed
    it). Markdown, readable as plain text."""
    head = ("tensor", "max abs", "max rel", "rmse", "bias", "ulps", "bad", "tolerance",
            "a-priori", "ratio", "vs a-priori", "family worst (member)", "ok",
            "worst index: got / want",
            "note")
    rows = [head]
    tensors = verdict.get("tensors") or {}
    for name in sorted(tensors, key=lambda n: (TENSOR_ORDER + (n,)).index(n)):
        t = tensors[name]
        idx = t.get("worst_index")
        where = (f"{tuple(idx) if isinstance(idx, list) else idx}: {fmt(t.get('got'), 6)} / "
                 f"{fmt(t.get('want'), 6)}")
        rows.append((name, fmt(t.get("max_abs")), fmt(t.get("max_rel")), fmt(t.get("rmse")),
                     fmt(t.get("bias")), fmt(t.get("max_ulps")),
                     f"{t.get('n_bad', '-')}/{t.get('numel', '-')}", fmt(t.get("tol")),
                     fmt(t.get("apriori")), fmt(t.get("ratio")), fmt(t.get("ratio_apriori")),
                     _family_cell(t), "yes" if t.get("passed") else "NO", where,
                     str(t.get("note") or "")))
    if len(rows) == 1:
        return f"(no tensors compared: {verdict.get('status')}: {verdict.get('reason', '')})"
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) + " |"
             for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- plots


def _finite_pos(*xs: Any) -> bool:
    return all(math.isfinite(_f(x)) and _f(x) > 0 for x in xs)


def _fig_png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def render_plots(report: Mapping[str, Any]) -> dict[str, str]:
    """The three plots as base64 PNGs: error vs N per dtype, observed vs bound, vs baseline.

    Returns {} when matplotlib is not installed, or when there is nothing to plot.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    pts = [{**p, **{k: _f(p[k]) for k in ("max_abs", "tol", "apriori", "baseline_err")}}
           for p in report["points"] if _finite_pos(p["max_abs"])]
    if not pts:
        return {}
    dtypes = sorted({p["dtype"] for p in pts if p["dtype"]})
    tensors = [t for t in TENSOR_ORDER if any(p["tensor"] == t for p in pts)]
    colours = dict(zip(dtypes, plt.rcParams["axes.prop_cycle"].by_key()["color"],
                       strict=False))
    plots: dict[str, str] = {}

    fig, axes = plt.subplots(1, len(tensors), figsize=(3.4 * len(tensors), 3.2),
                             squeeze=False)
    # Fixed margins: constrained/tight layout costs extra draws, and the panels are uniform.
    fig.subplots_adjust(left=0.06, right=0.99, bottom=0.17, top=0.9, wspace=0.3)
    for ax, name in zip(axes[0], tensors, strict=True):
        for dt in dtypes:
            sel = [p for p in pts if p["tensor"] == name and p["dtype"] == dt
                   and p["N"] is not None]
            if sel:
                ax.scatter([p["N"] for p in sel], [p["max_abs"] for p in sel], s=12,
                           alpha=0.7, color=colours[dt], label=dt)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("N (keys)")
        ax.grid(True, which="major", alpha=0.3)
    axes[0][0].set_ylabel("max abs error")
    axes[0][0].legend(fontsize=7)
    plots["error_vs_n"] = _fig_png(fig)

    for key, xfield, title, xlabel in (
        ("observed_vs_bound", "apriori", "observed against a-priori bound", "a-priori bound"),
        ("observed_vs_baseline", "baseline_err", "observed against the baseline's error",
         "baseline (emulated flash, same dtype) max abs error"),
    ):
        sel = [p for p in pts if _finite_pos(p[xfield])]
        if not sel:
            continue
        fig, ax = plt.subplots(figsize=(5.2, 4.2))
        fig.subplots_adjust(left=0.16, right=0.97, bottom=0.13, top=0.92)
        for name in tensors:
            s = [p for p in sel if p["tensor"] == name]
            if s:
                ax.scatter([p[xfield] for p in s], [p["max_abs"] for p in s], s=12,
                           alpha=0.7, label=name)
        lo = min(min(p[xfield] for p in sel), min(p["max_abs"] for p in sel))
        hi = max(max(p[xfield] for p in sel), max(p["max_abs"] for p in sel))
        ax.plot([lo, hi], [lo, hi], "k--", linewidth=0.8, label="y = x")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("observed max abs error")
        ax.set_title(title)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7)
        plots[key] = _fig_png(fig)
    return plots


# ----------------------------------------------------------------------------- html

_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 1.5em;
       color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 12px; }
th, td { border: 1px solid #bbb; padding: 2px 6px; }
th { background: #f0f0f0; } td.num { text-align: right; font-family: monospace; }
tr.pass td.st { background: #d9f2d9; } tr.fail td.st { background: #f8d0d0; }
tr.not_run td.st { background: #e6e6e6; } td.bad { background: #f8d0d0; font-weight: bold; }
.counts span { display: inline-block; padding: 3px 10px; margin-right: 6px; border-radius: 3px; }
code { font-size: 11px; } .hdr td { border: none; padding: 1px 8px 1px 0; }
img { max-width: 100%; border: 1px solid #ddd; margin: 4px 0; }
"""


def render_html(report: Mapping[str, Any], plots: Mapping[str, str] | None = None) -> str:
    """A self-contained HTML page (inline CSS, plots as data: URIs)."""
    e = html.escape
    h = report["header"]
    s = report["summary"]
    if plots is None:
        plots = render_plots(report)
    vers = ", ".join(f"{k} {v}" for k, v in h.get("versions", {}).items() if v)
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>flashcheck report: {e(str(h.get('kernel')))}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>flashcheck report: <code>{e(str(h.get('kernel')))}</code> on "
        f"{e(str(h.get('device')))}</h1>",
        '<table class="hdr">',
    ]
    for k, v in (("kernel", h.get("kernel")), ("device", h.get("device")),
                 ("GPU", h.get("gpu") or "none"), ("versions", vers), ("date", h.get("date")),
                 ("command", h.get("command")),
                 ("settings", " ".join(f"{k}={v}" for k, v in h.get("settings", {}).items())
                  or "none")):
        out.append(f"<tr><td><b>{e(k)}</b></td><td><code>{e(str(v))}</code></td></tr>")
    out.append("</table>")
    out.append('<h2>Summary</h2><p class="counts">')
    out.append(f'<span style="background:#eee">{s["cases"]} cases, {s["configs"]} '
               "configurations</span>")
    for st in ("pass", "fail", "not_run"):
        out.append(f'<span style="background:{STATUS_COLOURS[st]}">{s[st]} '
                   f"{st.replace('_', ' ')}</span>")
    out.append("</p>")

    out.append("<h2>Per configuration</h2>")
    out.append("<p>ratio = observed max abs error / tolerance (&gt; 1 fails); vs a-priori = "
               "observed / a-priori bound. Per tensor, the worst case of the configuration."
               "</p>")
    fields = key_fields(report["configs"])
    out.append("<table><tr>" + "".join(f"<th>{e(f)}</th>" for f in fields)
               + "<th>cases</th><th>status</th><th>tensor</th><th>max abs</th>"
               "<th>tolerance</th><th>a-priori</th><th>ratio</th>"
               "<th>vs a-priori</th><th>family worst (member)</th><th>not run</th></tr>")
    for c in report["configs"]:
        tensors = list(c["tensors"].items()) or [(None, None)]
        span = len(tensors)
        status = status_text(c)
        nr = "<br>".join(f"{e(r['reason'])} (&times;{r['count']})" for r in c["not_run"])
        for i, (name, t) in enumerate(tensors):
            row = [f'<tr class="{c["status"]}">']
            if i == 0:
                row.extend(f'<td rowspan="{span}">{e(x)}</td>' for x in _key_cells(c, fields))
                row.append(f'<td rowspan="{span}" class="num">{c["cases"]}</td>'
                           f'<td rowspan="{span}" class="st">{e(status)}</td>')
            if t is None:
                row.append("<td>-</td>" + '<td class="num">-</td>' * 6)
            else:
                bad = "" if t["passed"] else ' class="bad"'
                row.append(f"<td{bad}>{e(name)}</td>")
                row.extend(f'<td class="num">{e(x)}</td>' for x in _tensor_cell(t))
            if i == 0:
                row.append(f'<td rowspan="{span}">{nr}</td>')
            row.append("</tr>")
            out.append("".join(row))
    out.append("</table>")

    out.append("<h2>Plots</h2>")
    if not plots:
        out.append("<p>No plots: matplotlib is not installed (<code>pip install "
                   "'flashcheck[report]'</code>) or no case produced a finite error.</p>")
    if "error_vs_n" in plots:
        out.append("<h3>Error against N, per dtype and tensor</h3>"
                   f'<img alt="error against N" src="data:image/png;base64,'
                   f'{plots["error_vs_n"]}">')
    pair = [k for k in ("observed_vs_bound", "observed_vs_baseline") if k in plots]
    if pair:
        out.append("<h3>Observed against the a-priori bound, and against the baseline</h3>"
                   '<div style="display:flex;gap:12px;flex-wrap:wrap">')
        out.extend(f'<img alt="{e(k)}" src="data:image/png;base64,{plots[k]}">' for k in pair)
        out.append("</div>")

    out.append("<h2>Failures</h2>")
    if not report["failures"]:
        out.append("<p>None.</p>")
    else:
        out.append("<ul>")
        for f in report["failures"]:
            item = (f"<li><code>{e(f['config'])}</code> [{e(str(f['failure']))}]: "
                    f"{e(f['summary'])}")
            if f.get("case_file"):
                item += (f'<br>case file: <a href="{e(f["case_file"])}">{e(f["case_file"])}</a>'
                         f"<br>replay: <code>{e(f['replay'])}</code>")
            out.append(item + "</li>")
        out.append("</ul>")
    out.append("<h2>Not run</h2>")
    if not report["not_run"]:
        out.append("<p>Nothing was skipped.</p>")
    else:
        out.append("<ul>")
        for n in report["not_run"]:
            out.append(f"<li><code>{e(n['config'])}</code> (&times;{n['count']}): "
                       f"{e(n['reason'])}</li>")
        out.append("</ul>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def write_report(report: Mapping[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write report.json, report.md and report.html into ``out_dir``; returns their paths.

    Failure case-file paths are made relative to ``out_dir`` in the Markdown and HTML so the
    links work when the directory is moved or attached as a whole.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    linked = json.loads(json.dumps(_sanitize(report)))
    for f in linked["failures"]:
        if f.get("case_file"):
            p = Path(f["case_file"])
            try:
                f["case_file"] = str(p.resolve().relative_to(out_dir.resolve()))
            except ValueError:
                pass
    paths = {"json": out_dir / "report.json", "md": out_dir / "report.md",
             "html": out_dir / "report.html"}
    paths["json"].write_text(json.dumps(_sanitize(report), indent=1) + "\n")
    paths["md"].write_text(render_markdown(linked))
    paths["html"].write_text(render_html(linked))
    return paths


# ----------------------------------------------------------------------------- compare


def compare_reports(paths: Sequence[str | Path]) -> str:
    """A Markdown table: one row per configuration, one column per report (kernel).

    Each cell is the configuration's worst observed / tolerance ratio and its status; a
    configuration a report does not have shows "-". Column titles are the reports' kernel
    specs (with the device, and the file name when two reports share a kernel and device).
    """
    if len(paths) < 1:
        raise ValueError("compare needs at least one report.json path")
    reports = [load_report(p) for p in paths]
    titles = [f"{r['header'].get('kernel')} ({r['header'].get('device')})" for r in reports]
    dup = Counter(titles)
    titles = [t if dup[t] == 1 else f"{t} [{p}]" for t, p in zip(titles, paths, strict=True)]
    by_label: list[dict[str, Mapping[str, Any]]] = [
        {c["label"]: c for c in r["configs"]} for r in reports
    ]
    labels = sorted({lab for m in by_label for lab in m}, key=_natural)
    lines = [
        "| configuration | " + " | ".join(_md_escape(t) for t in titles) + " |",
        "|---|" + "---:|" * len(titles),
    ]
    for lab in labels:
        cells = []
        for m in by_label:
            c = m.get(lab)
            if c is None:
                cells.append("-")
            elif c["status"] == "not_run":
                reason = c["not_run"][0]["reason"] if c["not_run"] else ""
                cells.append(f"not run ({_md_escape(reason)})" if reason else "not run")
            else:
                mark = "pass" if c["status"] == "pass" else "**FAIL**"
                cells.append(f"{fmt(c['worst_ratio'])} {mark}")
        lines.append(f"| `{lab}` | " + " | ".join(cells) + " |")
    totals = [f"{r['summary']['pass']}/{r['summary']['cases']} pass, "
              f"{r['summary']['fail']} fail" for r in reports]
    lines.append("| **cases** | " + " | ".join(totals) + " |")
    return ("Worst observed / tolerance ratio per configuration (> 1 fails).\n\n"
            + "\n".join(lines) + "\n")

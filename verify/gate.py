"""``flashcheck gate``: the CI gate against committed per-configuration error budgets.

The gate runs the derandomized fixed sweep of the device's profile plus every case file of the
regression corpus (``tests/regressions/``), aggregates by configuration (verify.report), and
fails (exit 1) when

- any case fails its own verdict (a numerical failure, NaN, a raise inside the domain, ...), or
- a configuration's worst error ratio (observed / tolerance, over its cases and tensors)
  exceeds the budget committed for it, or
- a configuration that ran has no committed budget (a new configuration must be budgeted on
  purpose, with ``--update``).

Every regression-corpus file is its own budget entry, keyed ``regression=<file stem>`` (with
its dtype, for the headroom): a corpus case exercises one specific hazard, so its worst ratio
is tracked on its own instead of being folded into (and hidden by) a sweep configuration. A
corpus file added without ``--update`` is named as unbudgeted and fails the gate.

Budgets are keyed by device model: the file records ``device_model`` ("cpu" for any x86-64
host, whose workers run one pinned BLAS core type, "cpu-<machine>" on another architecture,
or the CUDA device name such as "NVIDIA H200") and the default path carries it where it is
not "cpu" (``<kernel>-gpu-NVIDIA_H200.json``, ``<kernel>-cpu-aarch64.json``). A run on another
model is refused with "no budgets for this device" (exit 2) instead of being compared with
another machine's numbers. A gate that fails on budgets recorded under other library
versions says which (numpy's BLAS, torch and Triton move the ratios too).

A budget is the committed worst ratio times :data:`HEADROOM` of the configuration's dtype.
``--update`` rewrites the file from the current run and prints the diff against the committed
one; a configuration that fails gets no budget (so a budget never enshrines a failure) and
``--update`` then exits 1.

Caveat: budgets are per kernel and per profile (``verify/budgets/<kernel>-<profile>.json``);
CPU numbers (Triton interpreter) and GPU numbers differ and are never compared with each
other.
"""

from __future__ import annotations

import difflib
import json
import math
import platform
import re
from pathlib import Path
from typing import Any

from flashcheck.verify import report as R

BUDGETS_FORMAT = "flashcheck-budgets"
BUDGETS_VERSION = 1

# Budget = committed worst ratio x HEADROOM[dtype]. Inputs are bit-identical from their seeds
# and the sweep is fixed, so on one machine and one set of versions the ratios repeat exactly;
# the headroom absorbs what legitimately moves them: an upgrade (torch, numpy, Triton) or a
# retuning that reorders the same accumulations, which draws a new realisation of the same
# rounding errors. Measured with
# ``python -m flashcheck.verify.gate A/report.json B/report.json`` on the CPU sweep, our FA2
# kernel against verify/controls/triton_tile32 (another correct tiling),
# worst ``out`` ratio per configuration, 41 configurations: float16 moved by at most x1.051,
# float32 by up to x2.943 (median x1.002, 90th percentile x1.279). fp16/bf16 output errors are
# dominated by the final rounding to the output dtype, which no reordering changes; fp32 errors
# are sums of many comparable rounding terms, so the order shows. Hence x1.25 for the 16-bit
# dtypes (the measured 5% plus margin; bfloat16 cannot run on the CPU and is given fp16's value
# for the same reason) and x3.0 for float32 (the measured 2.94 rounded up). Caveat: the control
# is forward-only, so the gradients' spread is not measured; a change that costs a 16-bit
# kernel one bit (x2) still trips the gate, an fp32 one only from x3 up.
HEADROOM = {"float16": 1.25, "bfloat16": 1.25, "float32": 3.0}

# A configuration whose kernel is exact on every case (observed error 0: fully masked rows,
# identical keys) would get a budget of 0 and trip on the first changed rounding. Its budget
# is floored at 1/16 of the tolerance: 2^-4 is the smallest ratio the report's 3 significant
# digits round-trip meaningfully in practice and far below the x2 a lost bit causes.
RATIO_FLOOR = 2.0**-4


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")


def device_model(device: str) -> str:
    """What budgets are keyed by: "cpu" on x86-64 (the Triton interpreter, its workers' BLAS
    pinned to one core type: the same arithmetic on any x86-64 host), "cpu-<machine>" on
    another architecture (e.g. "cpu-aarch64", whose BLAS kernels sum in other orders), or
    the CUDA device's name (``torch.cuda.get_device_name``)."""
    if device == "cpu":
        from flashcheck.verify.supervise import pins_cpu_arithmetic

        return "cpu" if pins_cpu_arithmetic() else f"cpu-{_safe(platform.machine().lower())}"
    import torch

    return torch.cuda.get_device_name(torch.device(device))


def default_budgets_path(kernel_spec: str, profile: str, model: str = "cpu") -> Path:
    """Where the budgets of ``kernel_spec`` live when ``--budgets`` is not given.

    Built-in kernels: ``verify/budgets/<kernel>-<profile>[-<model>].json`` inside this package
    (the model is added for GPUs). Any other spec (``mykern.py:attention``, ``pkg.mod:fn``):
    ``flashcheck-budgets/<spec>-<profile>[-<model>].json`` under the working directory, i.e.
    beside the user's kernel repo, never inside the installed package.
    """
    from flashcheck.verify.adapters import BUILTINS

    name = _safe(kernel_spec) or "kernel"
    suffix = "" if model == "cpu" else "-" + _safe(model.removeprefix("cpu-"))
    stem = f"{name}-{profile}{suffix}"
    root = (Path(__file__).resolve().parent / "budgets" if kernel_spec in BUILTINS
            else Path.cwd() / "flashcheck-budgets")
    return root / f"{stem}.json"


def default_corpus() -> Path:
    """``tests/regressions`` of the source checkout this package was imported from, else of
    the working directory (an installed package, run from the checkout, as tox does)."""
    beside = Path(__file__).resolve().parents[1] / "tests" / "regressions"
    return beside if beside.is_dir() else Path.cwd() / "tests" / "regressions"


def corpus_files(corpus: Path) -> list[Path]:
    return sorted(corpus.glob("*.json")) if corpus.is_dir() else []


def load_corpus(corpus: Path) -> list[Any]:
    """The regression cases (with captured tensors where a tensor file sits beside one)."""
    from flashcheck.verify.repro import load_target

    return [load_target(case_path=str(p), tensors_path=None).case for p in corpus_files(corpus)]


def gate_cases(profile: str, corpus: Path, api: str = "dense") -> tuple[list[Any], list[Any],
                                                                        int]:
    """The gate's cases: the fixed sweep of ``profile`` for the kernel's ``api``, then the
    corpus files of that API in name order; per case its report key (None: the case's own
    ``config_key``; a corpus file: :func:`regression_key`); and how many are sweep cases."""
    from flashcheck.verify import strategies

    sweep = list(strategies.fixed_sweep(profile, api))
    pairs = [(p, c) for p, c in zip(corpus_files(corpus), load_corpus(corpus), strict=True)
             if c.api == api]
    files, regressions = [p for p, _ in pairs], [c for _, c in pairs]
    keys = [None] * len(sweep) + [regression_key(path, case.dtype)
                                  for path, case in zip(files, regressions, strict=True)]
    return sweep + regressions, keys, len(sweep)


def budget_for(ratio: float, dtype: str) -> float:
    """The budget of a configuration of ``dtype`` whose committed worst ratio is ``ratio``."""
    if dtype not in HEADROOM:
        raise ValueError(f"dtype must be one of {list(HEADROOM)}, got {dtype!r}")
    return max(ratio, RATIO_FLOOR) * HEADROOM[dtype]


def make_budgets(report: dict[str, Any], *, kernel_spec: str, profile: str,
                 device: str, model: str = "cpu") -> dict[str, Any]:
    """Budgets from a report: every configuration that passed gets its worst ratio x headroom.

    A failing configuration gets none, so a budget never enshrines a failure: the gate keeps
    failing on it ("no committed budget") until it passes and the budgets are updated.
    """
    configs = {}
    for c in report["configs"]:
        if c["status"] != "pass" or c["worst_ratio"] is None:
            continue
        r = R._f(c["worst_ratio"])
        configs[c["label"]] = {"worst_ratio": float(f"{r:.4g}"),
                               "budget": float(f"{budget_for(r, c['key']['dtype']):.4g}"),
                               "cases": c["cases"] - c["counts"]["not_run"]}
    return {"format": BUDGETS_FORMAT, "version": BUDGETS_VERSION, "kernel": kernel_spec,
            "profile": profile, "device": device, "device_model": model, "headroom": HEADROOM,
            "ratio_floor": RATIO_FLOOR, "versions": R.versions(),
            "configs": dict(sorted(configs.items(), key=lambda kv: R._natural(kv[0])))}


def budgets_text(budgets: dict[str, Any]) -> str:
    return json.dumps(budgets, indent=1) + "\n"


def load_budgets(path: Path) -> dict[str, Any]:
    """Read a budgets file; ValueError naming the file and the field when malformed."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--budgets {path}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != BUDGETS_FORMAT:
        raise ValueError(f"--budgets {path}: format must be {BUDGETS_FORMAT!r}")
    configs = data.get("configs")
    if not isinstance(configs, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("budget"), (int, float))
        and v["budget"] > 0 for v in configs.values()
    ):
        raise ValueError(f"--budgets {path}: 'configs' must map labels to "
                         "{'budget': number > 0, ...}")
    return data


def check_device_model(budgets: dict[str, Any], path: Path, model: str) -> None:
    """ValueError unless ``budgets`` were made on the device model this run uses. A file
    without the field predates it and was made on the CPU."""
    made_on = budgets.get("device_model", "cpu")
    if made_on != model:
        raise ValueError(f"--budgets {path}: no budgets for this device ({model}); these were "
                         f"made on {made_on}. Make them here with 'flashcheck gate --update' "
                         "and commit the file")


def version_changes(recorded: dict[str, str], now: dict[str, str]) -> tuple[str, str] | None:
    """("numpy 2.4.6", "numpy 2.5.0")-style texts of the versions that differ between a
    budgets file and this run (flashcheck's own excluded: the code under test is the
    point), or None when none does."""
    keys = [k for k in recorded if k != "flashcheck" and k in now and recorded[k] != now[k]]
    if not keys:
        return None
    return (", ".join(f"{k} {recorded[k]}" for k in keys),
            ", ".join(f"{k} {now[k]}" for k in keys))


def regression_key(case_file: Path, dtype: str) -> dict[str, str]:
    """The configuration key of one corpus file: its own budget entry."""
    return {"regression": case_file.stem, "dtype": dtype}


def compare_to_budgets(report: dict[str, Any], budgets: dict[str, Any]) -> tuple[
        list[dict[str, Any]], list[str]]:
    """Rows (label, ratio, budget, status, why) and the budgeted labels this run never ran."""
    rows = []
    seen = set()
    for c in report["configs"]:
        label = c["label"]
        seen.add(label)
        entry = budgets["configs"].get(label)
        budget = entry["budget"] if entry else None
        ratio = None if c["worst_ratio"] is None else R._f(c["worst_ratio"])
        if c["status"] == "fail":
            status, why = "fail", "a case fails its verdict: " + ", ".join(
                f"{k} x{n}" for k, n in c["failure_classes"].items())
        elif c["status"] == "not_run":
            status, why = "not_run", "; ".join(r["reason"] for r in c["not_run"])
        elif entry is None and "regression" in c["key"]:
            status, why = "fail", (f"regression case {c['key']['regression']}.json has no "
                                   "committed budget (run 'flashcheck gate --update' and "
                                   "commit the budgets file with the case)")
        elif entry is None:
            status, why = "fail", "no committed budget (run 'flashcheck gate --update')"
        elif math.isnan(ratio) or ratio > budget:
            status, why = "fail", f"ratio {R.fmt(ratio)} > budget {R.fmt(budget)}"
        else:
            status, why = "pass", ""
        rows.append({"label": label, "ratio": ratio, "budget": budget, "status": status,
                     "why": why})
    missing = [lab for lab in budgets["configs"] if lab not in seen]
    # A budgeted regression case that did not run is a lost check (a deleted file, or the
    # gate pointed at the wrong corpus), never a silent pass.
    for lab in missing:
        if lab.startswith("regression="):
            rows.append({"label": lab, "ratio": None, "budget": budgets["configs"][lab]["budget"],
                         "status": "fail",
                         "why": "budgeted regression case not found in the corpus (pass "
                                "--corpus DIR, or --update if it was removed on purpose)"})
    return rows, [lab for lab in missing if not lab.startswith("regression=")]


def render_gate_table(rows: list[dict[str, Any]]) -> str:
    table = [("configuration", "ratio", "budget", "gate", "why")]
    table += [(r["label"], R.fmt(r["ratio"]), R.fmt(r["budget"]), r["status"].replace("_", " "),
               r["why"]) for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(t[:4], widths, strict=True))
                     + ("  " + t[4] if t[4] else "") for t in table)


def diff_text(old: str, new: str, name: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(keepends=True),
                                        new.splitlines(keepends=True),
                                        fromfile=f"{name} (committed)", tofile=f"{name} (new)"))


def run_gate(kernel: Any, *, kernel_spec: str, device: str, profile: str, budgets_path: Path,
             corpus: Path, update: bool, out: Path, quiet: bool = False,
             command: list[str] | None = None, jobs: int = 1, model: str = "cpu",
             case_timeout: float | None = None, strict_subnormals: bool = False,
             api: str = "dense", supervisor: Any | None = None) -> int:
    """The gate (module docstring); ``supervisor``: run the cases in it (``run_cases``)."""
    from flashcheck.verify.sweep import interrupted, run_cases

    budgets = None if update and not budgets_path.exists() else load_budgets(budgets_path)
    if budgets is not None and not update:
        check_device_model(budgets, budgets_path, model)
    cases, keys, n_sweep = gate_cases(profile, corpus, api)
    records = run_cases(kernel, cases, device, kernel_spec=kernel_spec,
                        failures_dir=out / "failures", what=f"gate[{profile}]", quiet=quiet,
                        jobs=jobs, case_timeout=case_timeout,
                        strict_subnormals=strict_subnormals, supervisor=supervisor)
    for rec, key in zip(records, keys, strict=True):
        if key is not None:
            rec["config"] = key
    header = R.make_header(kernel=kernel_spec, device=device, command=command, profile=profile,
                           regressions=len(cases) - n_sweep)
    rep = R.build_report(records, header=header)
    R.write_report(rep, out)
    print(f"gate: {n_sweep} sweep cases + {len(cases) - n_sweep} regression "
          f"cases from {corpus}; report in {out}")
    # An interrupt (Ctrl-C, SIGTERM, a CI time limit) leaves cases unchecked: the gate then
    # neither passes nor writes budgets from the part that ran.
    unchecked = interrupted(records)
    if unchecked:
        R.print_failures(rep)
        print(f"gate: interrupted: {unchecked} of {len(records)} cases not run; "
              f"{len(rep['failures'])} failure(s) among those that ran"
              + ("; budgets not written" if update else ""))
        return 1
    if update:
        failing = [c["label"] for c in rep["configs"] if c["status"] == "fail"]
        new = budgets_text(make_budgets(rep, kernel_spec=kernel_spec, profile=profile,
                                        device=device, model=model))
        old = budgets_path.read_text() if budgets_path.exists() else ""
        budgets_path.parent.mkdir(parents=True, exist_ok=True)
        budgets_path.write_text(new)
        diff = diff_text(old, new, budgets_path.name)
        print(diff if diff else f"{budgets_path}: unchanged")
        print(f"wrote {budgets_path}")
        for label in failing:
            print(f"not budgeted (a case fails; the gate keeps failing until it passes): {label}")
        R.print_failures(rep)
        return 1 if failing else 0
    rows, missing = compare_to_budgets(rep, budgets)
    print(render_gate_table(rows))
    for lab in missing:
        print(f"note: budgeted configuration not exercised by this run: {lab}")
    for r in rows:
        if r["status"] == "fail" and r["why"].startswith("regression case"):
            print(f"unbudgeted: {r['why']}")
    bad = [r for r in rows if r["status"] == "fail"]
    print(f"gate: {len(bad)} of {len(rows)} configurations over budget or failing"
          if bad else f"gate: all {len(rows)} configurations within budget")
    moved = version_changes(budgets.get("versions") or {}, R.versions())
    if bad and moved:
        print(f"note: the budgets were recorded under {moved[0]}, this run has {moved[1]}: a "
              "library's arithmetic moves the ratios too; if the kernel did not change, "
              "re-record the budgets under these versions ('flashcheck gate --update')")
    R.print_failures(rep)
    return 1 if bad else 0



def order_spread(report_a: dict[str, Any], report_b: dict[str, Any],
                 tensor: str = "out") -> dict[str, float]:
    """Per configuration that passed in both reports: max(ra/rb, rb/ra) of ``tensor``'s worst
    ratio, ratios floored at :data:`RATIO_FLOOR`. Two correct kernels that differ only in
    accumulation order (tile sizes, loop order) on the same fixed sweep show how far a
    legitimate reordering moves the ratios; this is the measurement behind :data:`HEADROOM`.
    """
    def ratios(rep):
        return {c["label"]: max(R._f(c["tensors"][tensor]["ratio"]), RATIO_FLOOR)
                for c in rep["configs"] if c["status"] == "pass" and tensor in c["tensors"]}

    a, b = ratios(report_a), ratios(report_b)
    return {lab: max(a[lab] / b[lab], b[lab] / a[lab]) for lab in a.keys() & b.keys()}


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3:
        sys.exit("usage: python -m flashcheck.verify.gate A/report.json B/report.json")
    spread = order_spread(R.load_report(sys.argv[1]), R.load_report(sys.argv[2]))
    for lab, x in sorted(spread.items(), key=lambda kv: -kv[1]):
        print(f"{x:6.3f}  {lab}")
    print(f"max spread over {len(spread)} configurations: {max(spread.values()):.3f}")

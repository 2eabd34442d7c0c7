"""What `session.sh bwd39` found, form by form, and which Gluon backward mode to take next.

    python3 scripts/gpu/bwd39_verdict.py DIR [--json FILE] [--race-sass SASS_DIR]

DIR: the phase's collected output (gpu_out, or where `collect` unpacked it). Per form
("split", "writer" as their adds come; "split_ordered", "writer_ordered" deterministic):

- timing (bwd39.json, bwd39_ordered.json; scripts/gpu/gluon_bwd.py): every row (of either
  call) ran, both calls took the Gluon kernel, the largest difference from our Triton
  backward within 4 units in the last place, the ordered forms the same bits twice; its
  speed against cuDNN;
- the GPU tests (bwd39-pytest.log): a failed test whose id names the form fails it, one
  that names none fails every form;
- compute-sanitizer on every form (bwd39-{racecheck,memcheck,synccheck}.log): a "BAD" line
  fails its form; reported errors (racecheck's summary too; less Triton 3.9's loader probe,
  a refused cuFuncSetAttribute it falls back from), no error summary (the run did not
  finish) or a nonzero exit without BAD lines fail every form (the tool does not say which
  kernel), with the source lines the reports name; with --race-sass (scripts/gpu/
  race_trace.py compile's folder), racecheck's reports fail nothing when every one is
  displayed and traced to Triton's warp-specialize hand-off;
- the campaigns (bwd39-fuzz-ENTRY-MODE/summary.json): examples run and no failure (each
  named with its class and reason).

A mode passes when both its forms do (a mode serves both determinisms); of those that pass,
the one whose ordered form is fastest (the default backward is deterministic) is the one
to take, and the command of the issue's acceptance run with it is printed. The rows where a
form is slower than our Triton backward are listed: where the default must not take it
(the issue wants no configuration slower than today's). Exit 0 when a
mode passes, 1 when none does, 2 on a folder that is not the phase's output.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import sys
from pathlib import Path


def _script(name: str):
    """A script beside this one, as a module."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(
            f"{name}.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


# The timing script's forms, (name, mode, deterministic), and its 4-ulp ratio
_timing_script = _script("gluon_bwd")
FORMS = _timing_script.NAMES
_FORM = {name: (mode, det) for name, mode, det in _timing_script.FORMS}  # -> (mode, det)
_NAME = {form: name for name, form in _FORM.items()}  # (mode, deterministic) -> name
MODES = tuple(dict.fromkeys(mode for mode, _ in _NAME))
SANITIZERS = ("racecheck", "memcheck", "synccheck")
TARGET = 0.9  # the backward target: at least 0.9x cuDNN at D = 128, causal and not


def _timing(rows: list[dict], form: str, problems: list[str]) -> list[float]:
    """The form's speeds against cuDNN (one per row), its problems appended."""
    speeds = []
    shapes = {(row["D"], row["causal"]) for row in rows}  # the rows either call started
    for d, causal in sorted(shapes - {(r["D"], r["causal"]) for r in rows if form in r}):
        problems.append(f"timing D={d} causal={causal}: not reached (the call ended first)")
    for row in rows:
        f = row.get(form)
        if f is None:
            continue
        where = f"D={row['D']} causal={row['causal']}"
        if "error" in f:
            problems.append(f"timing {where}: {f['error']}")
            continue
        if f.get("gluon_launches") != 2:
            problems.append(f"timing {where}: {f.get('gluon_launches')} Gluon launches of 2 "
                            "calls (left the Gluon path)")
        worst = _timing_script.worst_ulps(f)
        if not worst <= 1:
            problems.append(f"timing {where}: largest difference {worst:.3g} x 4 ulps")
        if _FORM[form][1] and not f.get("repeats_equal"):
            problems.append(f"timing {where}: two calls gave different bits")
        speeds.append(row["cudnn_ms"] / f["ms"])
    if not speeds and not any(p.startswith("timing") for p in problems):
        problems.append("timing: no row ran this form")
    return speeds


def _exit_code(text: str) -> int | None:
    m = re.findall(r"^exit=(\d+)$", text, re.M)
    return int(m[-1]) if m else None


def _names_form(test_id: str, form: str) -> bool:
    """Whether a failed test's parameters name this form: its mode ("split" or "writer")
    and, where the id carries the call's determinism (True / False), that too; a mode
    without it names both of the mode's forms."""
    params = re.findall(r"[\[-]([A-Za-z_]+)(?=[-\]])", test_id)
    mode, deterministic = _FORM[form]
    if mode not in params:
        return False
    if "True" in params or "False" in params:
        return ("True" in params) == deterministic
    return True


def _pytest(text: str | None, problems: dict[str, list[str]], other: list[str]) -> None:
    """The backward's GPU tests: a failure whose id names forms fails them, one that names
    none fails every form; the forward's failures (the same log) go to ``other``."""
    if text is None:
        for form in FORMS:
            problems[form].append("GPU tests: no log")
        return
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)
    for test_id in failed:
        if "test_flash_gluon_bwd.py" not in test_id:
            other.append(f"GPU tests: {test_id}")
            continue
        named = [form for form in FORMS if _names_form(test_id, form)]
        for form in named or FORMS:
            problems[form].append(f"GPU tests: {test_id}")
    if _exit_code(text) not in (0, None) and not failed:
        for form in FORMS:
            problems[form].append(f"GPU tests: exit {_exit_code(text)}")
    if not re.search(r"\d+ passed", text):
        for form in FORMS:
            problems[form].append("GPU tests: none passed")


# Triton 3.9's loader asks for oversized shared memory first and falls back to the
# Hopper call when the driver refuses (driver.c, loadBinary): one refused API call per
# kernel loaded, under memcheck's API-error reporting; not an error of any kernel.
_LOADER_PROBE = re.compile(r"Program hit CUDA_ERROR_INVALID_VALUE \(error 1\) due to "
                           r"\"invalid argument\" on CUDA API call to cuFuncSetAttribute\."
                           r"(?:\n=+ +[^\n]*){1,3}Host Frame: loadBinary ")


def _traced(text: str, errors: int, race_sass: Path) -> tuple[str | None, str]:
    """racecheck's reports read by scripts/gpu/race_trace.py in the machine code of
    ``race_sass`` (its compile): (problem, note). No problem when every error is a
    displayed report whose bytes are all Triton's warp-specialize hand-off."""
    rt = _script("race_trace")
    reports = rt.parse_log(text)
    _, bad = rt.trace(reports, race_sass)
    if reports and not bad and len(reports) == errors:
        return None, (f"racecheck: all {errors} reports traced to Triton's warp-specialize "
                      f"hand-off (race_trace.py, machine code of {race_sass})")
    untraced = errors - len(reports)
    return (f"racecheck: {errors} error(s); race_trace.py: {bad} of {len(reports)} displayed "
            f"touch the kernels' own buffers or could not be placed"
            + (f", {untraced} not displayed" if untraced > 0 else "")), ""


def _sanitizer(tool: str, text: str | None, problems: dict[str, list[str]],
               race_sass: Path | None = None, notes: list[str] | None = None) -> None:
    """compute-sanitizer's log: BAD lines (the script's own comparison) fail their form;
    the tool's reported errors, less Triton's loader probe (counted only where printed:
    errors past --print-limit cannot be told apart), fail every form, with the source
    lines the hazards name. racecheck's, with ``race_sass`` (race_trace.py compile's
    folder), fail nothing where every one is traced to Triton's warp-specialize hand-off
    (the tracing goes to ``notes``)."""
    if text is None:
        for form in FORMS:
            problems[form].append(f"{tool}: no log")
        return
    bad = re.findall(r"^BAD (\S+) (.*)$", text, re.M)
    for name, where in bad:
        if name in problems:
            problems[name].append(f"{tool}: disagrees with ours at {where}")
    totals = [int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) errors?\s*$", text, re.M)]
    totals += [int(n) for n in re.findall(r"RACECHECK SUMMARY: .*?\((\d+) errors?", text)]
    code = _exit_code(text)
    probes = len(_LOADER_PROBE.findall(text))
    errors = sum(totals) - probes
    if not totals:
        msg = f"{tool}: no error summary (the run did not finish), exit {code}"
    elif errors > 0 and tool == "racecheck" and race_sass is not None:
        msg, note = _traced(text, errors, race_sass)
        if note and notes is not None:
            notes.append(note)
    elif errors > 0:
        where = sorted(set(re.findall(r"(?:Race reported|Invalid|Misaligned|Out-of-range)"
                                      r"[^\n]* in (\S+:\d+)", text)))
        msg = (f"{tool}: {errors} reported error(s)"
               + (f" at {', '.join(where)}" if where else "")
               + (f" (besides {probes} of Triton's loader probe)" if probes else "")
               + f", exit {code}")
    elif code not in (0, None) and not bad:  # exit 1 with BAD lines: already attributed
        msg = f"{tool}: exit {code}"
    else:
        msg = None
    if msg:
        for form in FORMS:
            problems[form].append(msg)


def _campaign(path: Path, problems: list[str]) -> int:
    try:
        s = json.loads((path / "summary.json").read_text())
    except (OSError, ValueError):
        problems.append(f"campaign {path.name}: no summary (did not finish)")
        return 0
    if s.get("failures"):
        problems.append(f"campaign {path.name}: {len(s['failures'])} failure(s): "
                        + ", ".join(_failure(path, p) for p in s["failures"][:3]))
    elif s.get("exit") not in (0, None) or not s.get("examples"):
        problems.append(f"campaign {path.name}: exit {s.get('exit')}, "
                        f"{s.get('examples')} examples")
    return int(s.get("examples") or 0)


def _failure(campaign: Path, recorded: str) -> str:
    """A campaign's failure file by name, with its class and reason where the file is
    there (a harness_error is the harness's, e.g. out of GPU memory beside other jobs)."""
    name = Path(recorded).name
    try:
        v = json.loads((campaign / "failures" / name).read_text())["verdict"]
    except (OSError, ValueError, KeyError):
        return name
    return f"{name} ({v.get('failure')}: {str(v.get('reason', ''))[:160]})"


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def verdict(out: Path, race_sass: Path | None = None) -> dict:
    """Each form's problems, speeds and campaign examples, each mode's standing, and the
    mode to take (None when none passes). ``race_sass``: racecheck's reports traced
    (:func:`_sanitizer`)."""
    rows = []
    for name in ("bwd39.json", "bwd39_ordered.json"):
        text = _read(out / name)
        if text is not None:
            rows += json.loads(text)["rows"]
    problems: dict[str, list[str]] = {form: [] for form in FORMS}
    forms = {}
    for form in FORMS:
        speeds = _timing(rows, form, problems[form])
        d128 = {row["causal"]: row["cudnn_ms"] / row[form]["ms"] for row in rows
                if row["D"] == 128 and "ms" in row.get(form, {})}
        slower = [f"D={row['D']} causal={row['causal']}" for row in rows
                  if "ms" in row.get(form, {}) and row[form]["ms"] > row["ours_ms"]]
        forms[form] = dict(speeds=speeds, d128_x_cudnn=d128,
                           geomean_x_cudnn=math.prod(speeds) ** (1 / len(speeds))
                           if speeds else None, slower_than_ours=slower)
    other: list[str] = []
    notes: list[str] = []
    _pytest(_read(out / "bwd39-pytest.log"), problems, other)
    for tool in SANITIZERS:
        _sanitizer(tool, _read(out / f"bwd39-{tool}.log"), problems, race_sass, notes)
    for form in FORMS:
        mode, deterministic = _FORM[form]
        entry = "attention_ordered" if deterministic else "attention"
        forms[form]["campaign_examples"] = _campaign(out / f"bwd39-fuzz-{entry}-{mode}",
                                                     problems[form])
        forms[form]["problems"] = problems[form]
        d128 = forms[form]["d128_x_cudnn"]
        forms[form]["meets_target"] = (len(d128) == 2
                                       and all(x >= TARGET for x in d128.values()))
    passing = [m for m in MODES if not any(problems[_NAME[m, d]] for d in (False, True))]
    take = max(passing, key=lambda m: forms[_NAME[m, True]]["geomean_x_cudnn"] or 0.0,
               default=None)
    return dict(forms=forms, passing_modes=passing, take=take, other=other, notes=notes)


def report(v: dict) -> str:
    lines = ["| form | × cuDNN D=128 | × cuDNN D=128 causal | geomean × cuDNN | slower than "
             "ours at | campaign examples | problems |", "|---|---:|---:|---:|---|---:|---|"]
    for form, f in v["forms"].items():
        d = f["d128_x_cudnn"]
        cell = [f"{d[c]:.3f}" if c in d else "–" for c in (False, True)]
        g = f"{f['geomean_x_cudnn']:.3f}" if f["geomean_x_cudnn"] else "–"
        probs = "; ".join(f["problems"]) or "none"
        slower = ", ".join(f["slower_than_ours"]) or "–"
        lines.append(f"| {form} | {cell[0]} | {cell[1]} | {g} | {slower} "
                     f"| {f['campaign_examples']} | {probs} |")
    if v["other"]:
        lines.append("\nBeside the backward: " + "; ".join(v["other"]))
    lines += [f"\n{note}." for note in v.get("notes", ())]
    take = v["take"]
    if take is None:
        lines.append("\nNo mode passes: run with FLASHCHECK_GLUON_BWD=off (the Triton kernels; "
                     "the default, auto, takes writer); the problems above say where to look.")
    else:
        det = v["forms"][_NAME[take, True]]
        lines.append(f"\nTake {take!r} (its ordered form at "
                     f"{det['geomean_x_cudnn']:.3f}x cuDNN over the rows; the issue's "
                     f"{TARGET}x at D=128 {'met' if det['meets_target'] else 'NOT met'}). "
                     "The acceptance run with it:\n\n"
                     f"    KERNEL_TRITON39=1 FLASHCHECK_GLUON_BWD={take} KERNEL_MIN=10 "
                     "bash scripts/gpu/session.sh detach kernel")
        slower = sorted({r for d in (False, True)
                         for r in v["forms"][_NAME[take, d]]["slower_than_ours"]})
        if slower:
            lines.append(f"\nSlower than our Triton backward at {', '.join(slower)}: a default "
                         "must route those to the Triton kernels.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, metavar="DIR", help="the bwd39 phase's output folder")
    ap.add_argument("--json", type=Path, help="also write the verdict as JSON here")
    ap.add_argument("--race-sass", type=Path, default=None, metavar="DIR",
                    help="scripts/gpu/race_trace.py compile's folder: racecheck's reports "
                         "traced there, those all in Triton's warp-specialize hand-off fail "
                         "nothing")
    args = ap.parse_args(argv)
    if args.race_sass is not None and not any(args.race_sass.glob("*.alloc.mlir")):
        ap.error(f"--race-sass must be race_trace.py compile's folder, got {str(args.race_sass)!r}")
    if not (args.out / "bwd39.json").is_file() and not (args.out / "bwd39_ordered.json").is_file():
        ap.error(f"DIR must hold the bwd39 phase's output (bwd39.json), got {str(args.out)!r}")
    try:
        v = verdict(args.out, args.race_sass)
    except (ValueError, KeyError, TypeError) as e:
        ap.error(f"DIR: not the bwd39 phase's output ({type(e).__name__}: {e})")
    print(report(v), end="")
    if args.json is not None:
        args.json.write_text(json.dumps(v, indent=1) + "\n")
    return 0 if v["take"] is not None else 1


if __name__ == "__main__":
    sys.exit(main())

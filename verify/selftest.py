"""``flashcheck mutants``: the harness's self-test — a kill table and a false-alarm table.

The harness is tested the way it tests kernels. Every wrong kernel of the catalogue in
`verify/mutants/` is fuzzed through exactly the path users take for their own kernels,
`flashcheck fuzz --kernel verify/mutants/NAME.py:attention` (the spec is resolved by
`verify.adapters.resolve_kernel`, the campaign is `verify.fuzz.Campaign`: the same Hypothesis
`cases` strategy, `check_case`, shrinking and case files). A mutant is *killed* when the
campaign records a failure; the kill table gives the time and the number of examples to the
first failing example, the shrunk case (`Case.short()`), and what caught it (failure class
and tensor). Then every correct-but-different kernel of `verify/controls/` is fuzzed the same
way for the rest of the budget; any failure there is a *false alarm*. The false-alarm table
gives the examples run and the worst error ratio (observed / tolerance; a pass is < 1).

Budget. Mutant campaigns are boxed by examples (``--examples``, per campaign), not by
time, so whether a mutant is killed depends on the seed only, never on the machine's load.
Every mutant gets one campaign (seed ``--seed``); a survivor gets a fresh campaign with the
next seed, round after round, while the run is within MUTANT_SHARE of ``--budget-s``.
Restarts matter: one campaign climbs toward the largest error ratio (``target()``) and keeps
drawing near its best case, while a new seed starts a new search. Times and examples to the
first failure add up over a mutant's rounds. The controls then share the rest of
``--budget-s``, one time-boxed campaign each (at least MIN_BOX_S), with time that earlier
controls leave going to later ones. So the run takes the mutants' first round (however
long the seed needs) plus the rest of the budget; a time box is checked between examples
and a shrink is never cut short, so it can end later by about one shrink.

Repeatability: every campaign starts from an empty example database
(``DIR/<kernel>/hypothesis-db`` is removed first) and a seed derived from ``--seed``, and
the score the search climbs is the ratio on a 3-digit grid (``verify.fuzz.target_score``),
so the kill table's examples, and with ``--control-examples`` the controls', are the same on
every machine; time-boxed controls' example counts depend on speed.

Output: the two tables on stdout, ``DIR/mutants.json`` and ``DIR/mutants.md``, each kernel's
campaign log and case files under ``DIR/<kernel>/`` (emptied at the start of a run); with
``--write-docs`` also ``docs/mutants.md``. Exit 1 when a mutant survives or a control
fails, 2 on a usage error, 0 otherwise.

Caveat: the per-example verdicts (for "examples needed" and the worst error ratio) are
observed through ``Campaign._observe``, which the campaign's property calls with each
verdict from its supervised worker; if that wiring changes the self-test stops with an error
instead of reporting nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_OUT = "flashcheck-out/mutants"
DEFAULT_BUDGET_S = 900.0
DEFAULT_SEED = 0
# Examples per mutant campaign (shrinking included). With seed 0 the slowest kill,
# gqa_head_mapping, came at example 96 of a 100-example campaign and 146 of a 200-example
# one (Hypothesis's draws depend on the budget): the only GQA shape with Hkv > 1 and
# Hq/Hkv > 1 that the strategy draws at max_heads = 4 is Hq=4/Hkv=2, in ~4% of cases. A
# survivor costs ~200 examples (about a minute on the CPU) per round.
DEFAULT_EXAMPLES = 200
# Restarts of survivors may use this share of the budget; the controls get the rest.
MUTANT_SHARE = 0.6
# A control campaign shorter than this is hardly more than its set-up (kernel resolution,
# the first example's Hypothesis overhead); no box is made shorter.
MIN_BOX_S = 5.0
DOCS_PATH = Path(__file__).resolve().parent.parent / "docs" / "mutants.md"
# A passing control's cases judged again against the whole family (run_campaign's
# ``rejudge``): its margin. The ratios against the baseline member that near 1 come from a
# handful of cases (the family member the control implements sets their tolerance), so the
# highest few carry the margin; each costs one full-family check (every member).
REJUDGE = 8


@dataclass
class CampaignResult:
    """What one fuzz campaign against one kernel saw."""

    examples: int  # check_case calls (shrinking included)
    wall_s: float
    first_fail_s: float | None = None  # from the campaign's start to the first failing verdict
    first_fail_examples: int | None = None  # 1-based index of that example
    worst_ratio: float = 0.0  # over the examples that ran (not_run excluded)
    worst: str = ""  # where it was: "tensor (elementwise|rmse, member) case"
    case_file: str | None = None  # the shrunk failure's case file
    shrunk: str = ""  # Case.short() of the shrunk failure
    caught_by: str = ""  # failure class: tensor (or reason)
    error: str = ""  # the campaign itself raised (usage/environment problem)
    rounds: int = 1  # campaigns run (a survivor gets another, with the next seed)
    # A control's margin: its REJUDGE cases of highest ratio judged again against the whole
    # family (family="full"). worst_ratio is measured against the baseline member where that
    # passes, an upper bound of the family's ratio; the largest of these re-judged ratios is
    # a lower bound of it (the family's worst case may lie outside the ones re-judged).
    family_ratio: float | None = None
    family_where: str = ""
    family_cases: int = 0


@dataclass
class KillRow:
    name: str
    kind: str
    impl: str
    bug: str
    killed: bool
    result: CampaignResult


@dataclass
class ControlRow:
    name: str
    what: str
    passed: bool
    result: CampaignResult


@dataclass
class SelfTest:
    device: str
    seed: int
    budget_s: float
    command: str
    versions: dict
    examples: int = DEFAULT_EXAMPLES
    control_examples: int | None = None  # None: controls boxed by time
    kills: list[KillRow] = field(default_factory=list)
    controls: list[ControlRow] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def n_killed(self) -> int:
        return sum(r.killed for r in self.kills)

    @property
    def n_false_alarms(self) -> int:
        return sum(not r.passed for r in self.controls)

    @property
    def median_kill_s(self) -> float | None:
        times = [r.result.first_fail_s for r in self.kills if r.killed]
        return statistics.median(times) if times else None

    @property
    def ok(self) -> bool:
        return self.n_killed == len(self.kills) and self.n_false_alarms == 0

    def to_dict(self) -> dict:
        return {
            "command": self.command, "device": self.device, "seed": self.seed,
            "budget_s": self.budget_s, "examples": self.examples,
            "control_examples": self.control_examples, "wall_s": self.wall_s,
            "versions": self.versions,
            "summary": {"mutants": len(self.kills), "killed": self.n_killed,
                        "median_time_to_kill_s": self.median_kill_s,
                        "controls": len(self.controls), "false_alarms": self.n_false_alarms},
            "mutants": [asdict(r) for r in self.kills],
            "controls": [asdict(r) for r in self.controls],
        }


def _caught_by(verdict: dict) -> str:
    """``failure class: tensor`` of a verdict dict (the reason when no tensor failed)."""
    failing = {n: t for n, t in (verdict.get("tensors") or {}).items() if not t.get("passed")}
    if failing:
        def ratio(t):
            r = t.get("ratio")
            return math.inf if isinstance(r, str) else float(r)

        return f"{verdict.get('failure')}: {max(failing, key=lambda n: ratio(failing[n]))}"
    return f"{verdict.get('failure')}: {verdict.get('reason', '')}".strip()


def _ratio(verdict) -> float:
    from flashcheck.verify.check import error_ratio

    r = error_ratio(verdict)
    return r if math.isfinite(r) else math.inf


def _where(verdict) -> str:
    """The tensor and rule behind a verdict's error ratio, and its case: a control whose
    worst ratio nears 1 says where to look."""
    if not verdict.tensors:
        return verdict.case.short()
    t = max(verdict.tensors.values(), key=lambda t: t.ratio)
    rule = (f"rmse, {t.rmse_member or 'baseline'}" if t.ratio_rmse >= t.ratio
            else f"elementwise, {t.member or 'baseline'}")
    return f"{t.name} ({rule}) {verdict.case.short()}"


def run_campaign(spec: str, device: str, *, seed: int, out: Path, seconds: float | None = None,
                 examples: int | None = None, quiet: bool = True,
                 rejudge: int = 0) -> CampaignResult:
    """Fuzz ``spec`` on ``device`` with ``verify.fuzz.Campaign``, boxed by ``seconds`` or by
    ``examples`` (exactly one). ``rejudge``: a campaign without failure judges its
    ``rejudge`` cases of highest ratio again against the whole family
    (``CampaignResult.family_ratio``).

    Stops at the first (shrunk) failure. The campaign's printout is appended to
    ``out/fuzz.log``; its example database ``out/hypothesis-db`` is removed first.
    """
    from flashcheck.verify.cases import load_case_file
    from flashcheck.verify.fuzz import Campaign

    seen: list[tuple[float, object]] = []
    t0 = time.monotonic()

    class _Observed(Campaign):
        def _observe(self, case, verdict):
            seen.append((time.monotonic() - t0, verdict))

    shutil.rmtree(out / "hypothesis-db", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "fuzz.log", "a", encoding="utf-8") as log, contextlib.redirect_stdout(log):
        try:
            campaign = _Observed(None, kernel_spec=spec, device=device, out=out,
                                 minutes=None if seconds is None else seconds / 60.0,
                                 examples=examples, seed=seed, quiet=quiet)
            t0 = time.monotonic()
            campaign.run()
        except (ValueError, NotImplementedError, RuntimeError) as e:
            print(f"error: {type(e).__name__}: {e}")
            return CampaignResult(examples=len(seen), wall_s=time.monotonic() - t0,
                                  error=f"{type(e).__name__}: {e}")
    wall = time.monotonic() - t0
    if campaign.calls and not seen:
        raise RuntimeError("verify.fuzz.Campaign no longer reports its verdicts through "
                           "_observe; the self-test cannot observe them")
    res = CampaignResult(examples=len(seen), wall_s=wall)
    ran = [v for _, v in seen if v.status != "not_run"]
    if ran:
        worst = max(ran, key=_ratio)
        res.worst_ratio, res.worst = _ratio(worst), _where(worst)
    for i, (t, v) in enumerate(seen):
        if v.status == "fail":
            res.first_fail_s, res.first_fail_examples = t, i + 1
            break
    if rejudge and ran and not campaign.found and res.first_fail_s is None:
        _rejudge(spec, device, ran, rejudge, res)
    if campaign.found:
        case, meta = load_case_file(campaign.found[0])
        res.case_file = str(campaign.found[0])
        res.shrunk = case.short()
        res.caught_by = _caught_by(meta.get("verdict") or {})
    return res


def _rejudge(spec: str, device: str, verdicts: list, most: int, res: CampaignResult) -> None:
    """Judge the ``most`` distinct cases of highest ratio among ``verdicts`` against the
    whole family, in supervised workers as the campaign's were; the largest ratio and where
    it was go into ``res``."""
    from flashcheck.verify.supervise import Supervisor

    top, keys = [], set()
    for v in sorted(verdicts, key=_ratio, reverse=True):
        key = v.case.short()
        if key not in keys:
            keys.add(key)
            top.append(v.case)
        if len(top) == most:
            break
    with Supervisor(spec, device, family="full") as sup:
        judged = [v for v in sup.run(top).values() if v.status != "not_run"]
    if judged:
        worst = max(judged, key=_ratio)
        res.family_ratio, res.family_where = _ratio(worst), _where(worst)
        res.family_cases = len(judged)


def _merge(before: CampaignResult | None, res: CampaignResult) -> CampaignResult:
    """One mutant's rounds as one result: times and example counts add up."""
    if before is None:
        return res
    res.rounds = before.rounds + 1
    if res.first_fail_s is not None:
        res.first_fail_s += before.wall_s
        res.first_fail_examples += before.examples
    res.examples += before.examples
    res.wall_s += before.wall_s
    if before.worst_ratio > res.worst_ratio:
        res.worst_ratio, res.worst = before.worst_ratio, before.worst
    return res


def _pool_init(parent_pid: int) -> None:
    """A pool process ends with ``flashcheck mutants``: it is forked by the forkserver, so
    nothing else tells it that a killed parent (a CI timeout, SIGTERM) is gone, and it would
    idle on, keeping the forkserver alive too (the supervised workers' own watch)."""
    from flashcheck.verify.supervise import watch_parent

    watch_parent(parent_pid)


def _control_campaign(args: tuple) -> CampaignResult:
    """One control's campaign in a pool process (``run_selftest(jobs=...)``)."""
    spec, device, kw = args
    return run_campaign(spec, device, **kw)


def launch_order(ctrls) -> list[int]:
    """The order in which side-by-side control campaigns start (indices into ``ctrls``): the
    interpreted ones first, the rest as listed. A pool of two started in the table's order
    left a Triton control, last in the table and longest, running alone for 40 minutes
    after every other had finished; results still come back in the table's order."""
    return sorted(range(len(ctrls)), key=lambda i: not ctrls[i].interpreted)


def run_selftest(*, device: str, budget_s: float, seed: int, out: Path,
                 examples: int = DEFAULT_EXAMPLES, only: list[str] | None = None,
                 controls: bool = True, command: str = "flashcheck mutants",
                 mutants: bool = True, control_examples: int | None = None, jobs: int = 1,
                 echo=print) -> SelfTest:
    """Run the kill table, then the false-alarm table (see the module docstring).

    ``mutants=False``: the false-alarm table only. ``control_examples``: box each control's
    campaign by this many examples instead of a share of ``budget_s`` (then ``budget_s``
    does not bound the controls). ``jobs``: control campaigns run this many at a time, each
    in its own process (the mutants always run one at a time)."""
    from flashcheck.verify import report as R
    from flashcheck.verify.controls import CONTROLS
    from flashcheck.verify.mutants import CATALOGUE, by_name

    if not mutants:
        mutants = []
    else:
        mutants = [by_name(n) for n in only] if only else list(CATALOGUE)
    ctrls = list(CONTROLS) if controls else []
    st = SelfTest(device=device, seed=seed, budget_s=budget_s, command=command,
                  versions=R.versions(), examples=examples, control_examples=control_examples)
    for name in [m.name for m in mutants] + [c.name for c in ctrls]:
        shutil.rmtree(out / name, ignore_errors=True)  # this run's logs and case files only
    started = time.monotonic()
    restarts_end = started + budget_s * (MUTANT_SHARE if ctrls else 1.0)
    results: dict[str, CampaignResult] = {}
    pending, rnd = list(mutants), 0
    while pending and (rnd == 0 or time.monotonic() < restarts_end):
        survivors = []
        for m in pending:
            if rnd and time.monotonic() >= restarts_end:
                survivors.append(m)
                continue
            res = run_campaign(m.spec, device, examples=examples, seed=seed + rnd,
                               out=out / m.name)
            results[m.name] = _merge(results.get(m.name), res)
            if res.case_file is None and not res.error:
                survivors.append(m)
        pending, rnd = survivors, rnd + 1
    for m in mutants:
        res = results[m.name]
        row = KillRow(m.name, m.kind, m.impl, m.bug, killed=res.case_file is not None,
                      result=res)
        st.kills.append(row)
        echo(_kill_line(row))
    if control_examples is not None or jobs > 1:
        # Boxed by examples, or time boxes of equal share: independent campaigns, run side
        # by side in fresh processes (forkserver: no CUDA state or threads inherited).
        import concurrent.futures as cf
        import multiprocessing as mp

        left = started + budget_s - time.monotonic()
        box = max(left * min(jobs, len(ctrls) or 1) / (len(ctrls) or 1), MIN_BOX_S)
        kw = (dict(examples=control_examples) if control_examples is not None
              else dict(seconds=box))
        tasks = [(c.spec, device, dict(kw, seed=seed, out=out / c.name, rejudge=REJUDGE))
                 for c in ctrls]
        with cf.ProcessPoolExecutor(max_workers=max(1, jobs),
                                    mp_context=mp.get_context("forkserver"),
                                    initializer=_pool_init, initargs=(os.getpid(),)) as pool:
            futures = {i: pool.submit(_control_campaign, tasks[i]) for i in launch_order(ctrls)}
            for i, c in enumerate(ctrls):
                res = futures[i].result()
                row = ControlRow(c.name, c.what,
                                 passed=res.first_fail_s is None and not res.error, result=res)
                st.controls.append(row)
                echo(_control_line(row))
    else:
        for i, c in enumerate(ctrls):
            box = (started + budget_s - time.monotonic()) / (len(ctrls) - i)
            res = run_campaign(c.spec, device, seconds=max(box, MIN_BOX_S), seed=seed,
                               out=out / c.name, rejudge=REJUDGE)
            row = ControlRow(c.name, c.what, passed=res.first_fail_s is None and not res.error,
                             result=res)
            st.controls.append(row)
            echo(_control_line(row))
    st.wall_s = time.monotonic() - started
    return st


# ------------------------------------------------------------------------------ tables


def _fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _fmt_ratio(x: float) -> str:
    return "inf" if not math.isfinite(x) else f"{x:.3g}"


def _kill_line(r: KillRow) -> str:
    res = r.result
    if r.killed:
        return (f"KILLED   {r.name:<26} {_fmt_s(res.first_fail_s):>6} s "
                f"{res.first_fail_examples:>4} ex  {res.caught_by:<28} {res.shrunk}")
    why = res.error or f"no failure in {res.examples} examples, {res.wall_s:.1f} s"
    return f"SURVIVED {r.name:<26} {why}"


def _control_line(r: ControlRow) -> str:
    res = r.result
    status = "pass" if r.passed else "FALSE ALARM"
    extra = (f"  at {res.worst}" if r.passed and res.worst else
             "" if r.passed else f"  {res.error or res.caught_by}  {res.shrunk}")
    if r.passed and res.family_ratio is not None:
        extra += (f"\n{'':<11} {'':<18} family: {_fmt_ratio(res.family_ratio)} over its "
                  f"{res.family_cases} highest  at {res.family_where}")
    return (f"{status:<11} {r.name:<18} {res.examples:>4} ex  worst ratio "
            f"{_fmt_ratio(res.worst_ratio)}{extra}")


def false_alarm_report(r: ControlRow, device: str) -> str:
    """What a false alarm leaves in the log, for a CI run whose output directory is gone:
    the verdict's reason (tensor, worst index, both values, the bound and the member that
    set it), the replay command, and the case file's case as one line of JSON, which saved
    as a ``.json`` file replays the same case (seed included) with ``flashcheck repro``."""
    from flashcheck.verify import report as R
    from flashcheck.verify.cases import case_file_line, load_case_file
    from flashcheck.verify.controls import CONTROLS

    res = r.result
    if not res.case_file:
        return f"false alarm {r.name}: no case file ({res.error or res.caught_by})"
    case, meta = load_case_file(res.case_file)
    control = next((c for c in CONTROLS if c.name == r.name), None)
    spec = control.module_spec if control else meta.get("kernel") or r.name
    reason = (meta.get("verdict") or {}).get("reason") or res.caught_by
    return "\n".join([
        f"false alarm {r.name}: {reason}",
        f"  case file: {res.case_file}",
        f"  replay:    {R.replay_command(res.case_file, spec, device)}",
        f"  case JSON: {case_file_line(case, kernel=spec)}",
    ])


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(st: SelfTest) -> str:
    med = st.median_kill_s
    lines = [
        "# Mutation self-test",
        "",
        "The harness must kill every wrong kernel in `verify/mutants/` and pass every correct",
        "kernel in `verify/controls/`. Each kernel is fuzzed exactly as",
        "`flashcheck fuzz --kernel verify/mutants/NAME.py:attention` would (same strategy,",
        "checks, shrinking and case files); see `verify/selftest.py` for the budget rules.",
        "",
        "Made with:",
        "",
        "```",
        st.command,
        "```",
        "",
        f"Device `{st.device}`, seed {st.seed}, {st.examples} examples per mutant campaign, "
        + (f"{st.control_examples} examples per control campaign, "
           if st.control_examples else "") +
        f"budget {st.budget_s:g} s, wall "
        f"{st.wall_s:.0f} s; " + ", ".join(f"{k} {v}" for k, v in st.versions.items()) + ".",
        "",
        f"**{st.n_killed}/{len(st.kills)} mutants killed**"
        + (f", median time to kill {med:.1f} s" if med is not None else "")
        + f"; **{st.n_false_alarms} false alarm{'' if st.n_false_alarms == 1 else 's'}** in "
        f"{len(st.controls)} controls.",
        "",
        "## Kill table",
        "",
        "Time and examples are to the first failing example (before shrinking); the case is",
        "the shrunk one; \"caught by\" is the failure class and the tensor (or the reason).",
        "",
        "| mutant | kind | bug | killed | time to first failure (s) | examples | caught by "
        "| shrunk case |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in st.kills:
        res = r.result
        lines.append(
            f"| `{r.name}` | {r.kind} ({r.impl}) | {_md_cell(r.bug)} | "
            f"{'yes' if r.killed else '**NO**'} | {_fmt_s(res.first_fail_s)} | "
            f"{res.first_fail_examples or '-'} | {_md_cell(res.caught_by or res.error or '-')} "
            f"| `{_md_cell(res.shrunk or '-')}` |")
    lines += [
        "",
        "## False-alarm table",
        "",
        "Worst error ratio = the largest observed error / tolerance over all examples and",
        "tensors (a pass is <= 1), the tolerance set by the baseline member where that",
        "passes: an upper bound of the ratio against the whole family. Family = the largest",
        "ratio of the highest cases judged again against every member: a lower bound of it.",
        "",
        "| kernel | what | examples run | passed | worst error ratio | family (cases) |",
        "|---|---|---|---|---|---|",
    ]
    for r in st.controls:
        res = r.result
        passed = "yes" if r.passed else f"**NO** ({_md_cell(res.error or res.caught_by)})"
        fam = ("-" if res.family_ratio is None
               else f"{_fmt_ratio(res.family_ratio)} ({res.family_cases})")
        lines.append(f"| `{r.name}` | {_md_cell(r.what)} | {res.examples} | {passed} | "
                     f"{_fmt_ratio(res.worst_ratio)} | {fam} |")
    return "\n".join(lines) + "\n"


def write_outputs(st: SelfTest, out: Path, *, write_docs: bool) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "mutants.json", out / "mutants.md"]
    paths[0].write_text(json.dumps(st.to_dict(), indent=2, default=str) + "\n")
    text = render_markdown(st)
    paths[1].write_text(text)
    if write_docs:
        DOCS_PATH.write_text(text)
        paths.append(DOCS_PATH)
    return paths


# ------------------------------------------------------------------------------ command


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flashcheck mutants",
        description="Mutation self-test: fuzz every mutant (must fail) and control (must pass).")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda when available, else cpu")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, metavar="S",
                   help=f"wall-clock budget of the whole self-test (default {DEFAULT_BUDGET_S:g})")
    p.add_argument("--examples", type=int, default=DEFAULT_EXAMPLES, metavar="N",
                   help=f"examples per mutant campaign (default {DEFAULT_EXAMPLES})")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED,
                   help=f"Hypothesis seed of every campaign (default {DEFAULT_SEED})")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"tables, logs and case files (default {DEFAULT_OUT})")
    p.add_argument("--write-docs", action="store_true", help=f"also write {DOCS_PATH.name} "
                   "under docs/")
    p.add_argument("--only", action="append", metavar="MUTANT",
                   help="run only this mutant (repeatable); skips the controls")
    p.add_argument("--controls-only", action="store_true",
                   help="run only the controls (the false-alarm table)")
    p.add_argument("--control-examples", type=int, default=None, metavar="N",
                   help="box each control's campaign by N examples instead of time "
                        "(--budget-s then bounds the mutants only)")
    p.add_argument("--jobs", type=int, default=1, metavar="J",
                   help="control campaigns run J at a time, one process each (default 1)")
    return p


def main(argv: list[str] | None = None) -> int:
    import os

    argv = list(sys.argv[1:] if argv is None else argv)
    p = _parser()
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return 0 if e.code == 0 else 2
    if not (math.isfinite(args.budget_s) and args.budget_s > 0):
        print(f"flashcheck mutants: --budget-s must be a finite number > 0, got {args.budget_s}",
              file=sys.stderr)
        return 2
    if args.examples < 1:
        print(f"flashcheck mutants: --examples must be >= 1, got {args.examples}",
              file=sys.stderr)
        return 2
    if args.control_examples is not None and args.control_examples < 1:
        print(f"flashcheck mutants: --control-examples must be >= 1, got "
              f"{args.control_examples}", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print(f"flashcheck mutants: --jobs must be >= 1, got {args.jobs}", file=sys.stderr)
        return 2
    if args.controls_only and args.only:
        print("flashcheck mutants: --only and --controls-only exclude each other",
              file=sys.stderr)
        return 2
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("flashcheck mutants: --device cuda: no CUDA device is available", file=sys.stderr)
        return 2
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("flashcheck mutants: --device cpu runs the Triton mutants in the interpreter; "
              "set TRITON_INTERPRET=1 before starting (the flashcheck command does)",
              file=sys.stderr)
        return 2
    from flashcheck.verify.mutants import by_name

    try:
        for name in args.only or ():
            by_name(name)
    except ValueError as e:
        print(f"flashcheck mutants: --only: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    command = "flashcheck mutants " + " ".join(argv) if argv else "flashcheck mutants"
    print(f"mutants: {device}, budget {args.budget_s:g} s, seed {args.seed}, out {out}")
    st = run_selftest(device=device, budget_s=args.budget_s, seed=args.seed, out=out,
                      examples=args.examples, only=args.only, controls=not args.only,
                      command=command, mutants=not args.controls_only,
                      control_examples=args.control_examples, jobs=args.jobs)
    paths = write_outputs(st, out, write_docs=args.write_docs)
    med = st.median_kill_s
    print(f"mutants: {st.n_killed}/{len(st.kills)} killed"
          + (f" (median {med:.1f} s to first failure)" if med is not None else "")
          + f"; controls: {st.n_false_alarms} false alarm(s) in {len(st.controls)}; "
          f"{st.wall_s:.0f} s")
    print("tables: " + ", ".join(str(x) for x in paths))
    # Last in the log, where a CI tail keeps them: each false alarm's case, replayable.
    for r in st.controls:
        if not r.passed:
            print(false_alarm_report(r, device))
    return 0 if st.ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""``flashcheck fuzz``: a time- or example-boxed Hypothesis campaign against one kernel.

The campaign runs a ``@given(cases(...))`` property programmatically. This process draws and
shrinks (Hypothesis) and writes case files; it never imports or calls the kernel. Each example
is checked in a supervised worker process (verify/supervise.py: reused while healthy, replaced
after a crash, a timeout or a CUDA error). The error ratio (observed / tolerance) is passed to
``target()`` so the search climbs toward the worst cases, and the case is ``note()``-d. A
failing verdict raises, Hypothesis shrinks it, and the final (shrunk) example is written as
``DIR/failures/<id>.json`` (case file: case, kernel spec, versions, device, verdict) plus
``DIR/failures/<id>.md``.

- Nothing found is lost. Each case is written ahead as ``DIR/inflight/`` before it runs; a
  worker that dies or hangs turns it into a ``crashed`` / ``timeout`` failure file at once.
  A campaign started in a DIR with in-flight files left by a killed one re-checks them first.
  Ctrl-C and SIGTERM keep what was found, including a failure being shrunk (the smallest
  case so far).
- Shrinking a ``crashed`` / ``timeout`` / ``cuda_error`` / ``harness_error`` failure runs
  every candidate in a fresh worker (a crash may depend on what ran before in the process),
  at most
  :data:`MAX_FRESH_SHRINK` (:data:`MAX_TIMEOUT_SHRINK` for a hang) candidates.
- Flaky is a failure. When the replay of a failing case disagrees with its first run (Hypothesis's
  final replay, or :data:`CONFIRM_RUNS` re-checks of the shrunk case), one ``flaky`` failure
  records both verdicts, and :data:`FLAKY_RERUNS` fresh workers, each running the case twice,
  tell "wrong on first use" from "wrong at random" (``observations["flaky"]["kind"]``).
- Draws stay inside the kernel's capabilities on this device (probed inside a worker): its
  dtypes minus those it declares ``not_run`` here, its mask kinds, extensions, GQA,
  backward, head dims (range or set), layouts and sequence rules (``seq_multiple``,
  ``same_seqlen``, ``max_seqlen``), drawn by construction (docs/contracts.md §2). The
  default N cap is raised to the largest declared ``seq_multiple``. Cases the kernel's
  ``supports`` refuses, or that it rejects clearly without declaring it, are "not run";
  their reasons are printed after the campaign, what the probes took out before it.
- The example database is ``DIR/hypothesis-db`` (``DirectoryBasedExampleDatabase``): a rerun
  with the same DIR first replays what failed before.
- ``seed`` fixes Hypothesis's random choices (``hypothesis.seed``), so the same seed, kernel
  and device give the same campaign. A seeded run does not use the database (Hypothesis's
  own rule for ``@seed``: replaying saved examples first would change the sequence).
- ``keep_going``: after a failure, the campaign restarts and treats failures of an already
  recorded kind as uninteresting, so every recorded failure is distinct and shrunk, until the
  budget ends. The kind is (failure class, worst tensor, configuration), or for raised,
  crashed, timeout and CUDA-error failures the root cause (class, exception type, message
  without numbers, innermost kernel frame): one file, the smallest case, with the count of
  hits and the configurations it hit (``observations["root_cause"]``).
- ``minutes`` is checked before every example, shrink candidates included, so a campaign
  ends within one case timeout of its budget (plus the writing of what it found).

Caveat: a failure found while another is being shrunk (a different class) is recorded
unshrunk.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashcheck.verify import interrupts
from flashcheck.verify import report as R
from flashcheck.verify.progress import Progress

DEFAULT_EXAMPLES = 200
# Largest sequence length drawn by default. The CPU runs the Triton interpreter (seconds per
# case at N = 64) and the fp64 reference is O(N^2) per head; on a GPU, 2048 is where the
# references still fit comfortably alongside the kernel.
DEFAULT_MAX_N = {"cpu": 64, "cuda": 2048}
# target() needs a finite score; an unbounded ratio (NaN output) is a failure anyway and
# stops the search, so any value far above 1 serves.
TARGET_CAP = 1e6


def target_score(ratio: float) -> float:
    """The error ratio as the score ``target()`` climbs: capped (above), and rounded to 3
    significant digits. Hypothesis steers its search by the scores it has seen, so a score
    that differs in its last bits (another machine's BLAS sums the references' products in
    another order) would make the campaign draw other examples from then on: a seed would
    name one campaign here and another in CI (ties broken, near-ties reordered). On a
    3-digit grid a last-bit difference moves a score only where the ratio sits that close to
    a step of the grid; 0.1 % is finer than any ratio the search needs to tell apart."""
    if not math.isfinite(ratio) or ratio >= TARGET_CAP:
        return TARGET_CAP
    return float(f"{ratio:.3g}") if ratio > 0 else 0.0
# --reuse-compiled: the campaign runs in rounds of 2, 4, 8, 16, then REUSE_ROUND examples;
# each round's strategy draws 3 in 4 cases with the compile key of one of the last REUSE_POOL
# distinct keys run so far (verify/strategies.py, ``cases(reuse=)``). A cold Triton campaign
# on the H200 compiles for ~8 s per new configuration (7-8 examples in its first minute), so
# the pool must start after the first examples, not after 20 (measured: with one round of 20
# first, a 1-minute cold campaign never left it); 20 later is ~30 s at the warm rate of 0.66
# examples/s, against Hypothesis's per-run start-up of a few ms. 32 keys: each compiled
# variant is revisited ~every 40 examples, while the free draws keep adding new ones.
REUSE_ROUND = 20
REUSE_POOL = 32


def reuse_round(round_no: int) -> int:
    """Examples in round ``round_no`` (0-based) of a --reuse-compiled campaign."""
    return min(REUSE_ROUND, 2 ** (round_no + 1))


# Shrinking a crash-class failure runs each candidate in a fresh worker: a fork plus the
# kernel's import (~0.4 s measured on the CPU; on a GPU add a CUDA context and the Triton
# compile). Measured: tests/misbehaving_kernels.py's segv_large goes from its first failure
# (N <= 32) to Nq = 9 in 24 fresh-worker candidates, so 64 lets such shrinks finish; the
# smallest case so far is recorded when the cap is hit.
MAX_FRESH_SHRINK = 64
# A candidate that hangs costs a whole case timeout (60 s and up by default); those that
# pass cost a normal case. Measured: hang_large shrinks to Nq = 9 in 25 candidates taking
# 19 s at a 1 s timeout, so ~12 of them hung; 24 hanging candidates (~25 min at the default
# timeout) leave room for larger cases, and --minutes cuts it shorter, keeping the smallest
# case so far.
MAX_TIMEOUT_SHRINK = 24
# Re-checks of a shrunk (non-crash) failure before it is written: CONFIRM_RUNS + 1 of them (the
# last in a fresh worker), after Hypothesis's final replay, must all give the same class.
# A kernel wrong at random, whose case gives that class with probability q per check, passes
# for deterministic with q^(CONFIRM_RUNS + 1): 0.1% at q = 0.42 (tests/misbehaving_kernels.py's
# random_wrong: one of the check's two forward calls wrong, 2 * 0.3 * 0.7) and 0.4% at the
# worst, q = 1/2. Each costs one case, paid once per recorded failure.
CONFIRM_RUNS = 7
# Fresh workers used to classify a flaky failure, each running the case twice: a first-use
# bug gives "first run fails, second passes" in every one, while a bug that fails a check at
# random with probability p fakes that pattern with (p(1-p))^5 <= (1/4)^5 < 0.1%. A fresh
# worker costs a fork and the kernel's import (plus a CUDA context on a GPU), once per
# recorded flaky failure.
FLAKY_RERUNS = 5


class _StopCampaign(BaseException):
    """The time budget is spent. A BaseException, so Hypothesis does not take it for a failure
    of the property and shrink it; it propagates out of the run."""


class _StopShrink(BaseException):
    """A crash-class shrink hit its cap (MAX_FRESH_SHRINK / MAX_TIMEOUT_SHRINK): the smallest
    case so far is recorded and, with keep_going, the campaign goes on."""


class _Found(AssertionError):
    """A failing verdict inside the property (Hypothesis shrinks on it)."""

    def __init__(self, case: Any, verdict: Any) -> None:
        super().__init__(verdict.summary())
        self.case = case
        self.verdict = verdict


def shrink_key(verdict: Any) -> tuple:
    """What must stay the same while a failure is shrunk: its root cause for raised and
    crash-class failures, else its failure class (the configuration may change: shrinking
    crosses N buckets, dtypes and mask kinds)."""
    from flashcheck.verify.supervise import root_cause

    return root_cause(verdict) or (verdict.failure,)


def signature(case: Any, verdict: Any) -> tuple[str, ...]:
    """What makes two failures the same: failure class, worst tensor, configuration; for a
    raised / crashed / timeout / cuda_error failure, its root cause instead
    (``("root-cause", *verify.supervise.root_cause(verdict))``).

    ``verdict`` is a Verdict or its ``to_dict()`` (as stored in a case file).
    """
    from flashcheck.verify.supervise import root_cause

    cause = root_cause(verdict)
    if cause is not None:
        return ("root-cause", *cause)
    if isinstance(verdict, dict):
        failure = verdict.get("failure")
        ratios = {n: t.get("ratio") for n, t in (verdict.get("tensors") or {}).items()}
    else:
        failure = verdict.failure
        ratios = {n: t.ratio for n, t in verdict.tensors.items()}
    worst = max(ratios, key=lambda n: R._ratio_key(ratios[n])) if ratios else "-"
    return (str(failure), worst, R.config_label(case.config_key()))


def draw_dtypes(capabilities: dict, device: str, requested: list[str] | None) -> tuple[str, ...]:
    """The dtypes to draw: requested (or all) minus what the kernel cannot run on ``device``."""
    import torch

    dev = torch.device(device).type
    allowed = tuple(capabilities.get("dtypes") or ("float16", "bfloat16", "float32"))
    skipped = dict((capabilities.get("not_run") or {}).get(dev, {}))
    for key, why in (capabilities.get("probed_not_run") or {}).items():
        if key.startswith("dtype="):
            skipped[key.split("=", 1)[1]] = why
    want = tuple(requested) if requested else ("float16", "bfloat16", "float32")
    out = tuple(d for d in want if d in allowed and d not in skipped)
    if not out:
        reasons = "; ".join(f"{d}: {skipped.get(d, 'not in the kernel dtypes')}" for d in want)
        raise ValueError(f"--dtypes: the kernel runs none of {list(want)} on {dev} ({reasons})")
    return out


def default_max_n(capabilities: dict, max_n: int) -> int:
    """The default N cap, raised to the largest declared ``seq_multiple`` so that a kernel
    taking only multiples of 128 still gets a campaign, and lowered to ``max_seqlen``."""
    m = capabilities.get("seq_multiple", 1)
    biggest = max(m.values()) if isinstance(m, dict) else int(m)
    out = max(max_n, biggest)
    top = capabilities.get("max_seqlen")
    return min(out, top) if top is not None else out


def domain_notes(capabilities: dict) -> list[str]:
    """Lines for the campaign's header: what the probes took out of the domain, and the
    probe shapes a kernel rejected while another shape ran (declare both, to skip them)."""
    out = []
    for key, why in (capabilities.get("probed_not_run") or {}).items():
        out.append(f"probed, not run: {key}: {why} (undeclared; declare it in capabilities)")
    for key, why in (capabilities.get("probe_rejected_cases") or {}).items():
        out.append(f"probe shape rejected, {key} kept in the domain: {why}")
    return out


@dataclass
class Campaign:
    """One campaign. ``kernel`` is not used (kept for callers): the workers resolve
    ``kernel_spec``, and this process never imports the kernel. ``case_timeout``: seconds per
    case (None: derived from observed case times, verify/supervise.py)."""

    kernel: Any
    kernel_spec: str
    device: str
    out: Path
    examples: int | None = None
    minutes: float | None = None
    seed: int | None = None
    keep_going: bool = False
    dtypes: list[str] | None = None
    max_n: int | None = None
    quiet: bool = False
    case_timeout: float | None = None
    strict_subnormals: bool = False
    # The example database: None = DIR/hypothesis-db; a directory; or redis://HOST:PORT/N.
    db: str | None = None
    # The plug-in API asked for (--api); None: the kernel's own. A contradiction is an error.
    api: str | None = None
    # Prefer configurations this campaign has compiled (--reuse-compiled; REUSE_ROUND).
    reuse_compiled: bool = False
    found: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.examples is not None and self.examples < 1:
            raise ValueError(f"--examples must be >= 1, got {self.examples}")
        if self.minutes is not None and not (math.isfinite(self.minutes) and self.minutes > 0):
            raise ValueError(f"--minutes must be a finite number > 0, got {self.minutes}")
        if self.examples is not None and self.minutes is not None:
            raise ValueError("give --examples or --minutes, not both")
        if self.case_timeout is not None and not (math.isfinite(self.case_timeout)
                                                  and self.case_timeout > 0):
            raise ValueError(f"--case-timeout must be a finite number > 0, got "
                             f"{self.case_timeout}")
        if self.examples is None and self.minutes is None:
            self.examples = DEFAULT_EXAMPLES
        import torch
        from flashcheck.verify.supervise import ProbeCrashed, Supervisor

        dev = torch.device(self.device).type
        default_n = self.max_n is None
        if default_n:
            self.max_n = DEFAULT_MAX_N[dev]
        self.out = Path(self.out)
        self.sup = Supervisor(self.kernel_spec, self.device, case_timeout=self.case_timeout,
                              failures_dir=self.out / "failures",
                              strict_subnormals=self.strict_subnormals)
        self.probe_crash: str | None = None
        try:
            try:
                caps = self.sup.capabilities()
            except ProbeCrashed as e:
                # Recorded as a failure by run(); draw from the declared capabilities alone.
                self.probe_crash = str(e)
                caps = {}
            self.capabilities = caps
            declared = caps.get("api", "dense")
            if self.api is not None and self.api != declared and not self.probe_crash:
                raise ValueError(f"--api {self.api}: the kernel {self.kernel_spec!r} declares "
                                 f"the {declared} API (capabilities['api'])")
            self.draw_dtypes = draw_dtypes(caps, self.device, self.dtypes)
            if default_n:
                self.max_n = default_max_n(caps, self.max_n)
            # Built once here so bad bounds surface as a usage error before anything runs.
            self.strategy = self._cases()
        except BaseException:
            self.sup.close()
            raise
        self.calls = 0
        # normalised reason -> [drawn cases the kernel did not run, first reason, distinct]
        self.not_run: dict[str, list] = {}
        self.known: set[tuple] = set()
        self.causes: dict[tuple, dict] = {}  # root-cause signature -> its file and hits
        self.strays: list[tuple[Any, Any]] = []
        self.recorded_cases: list[Any] = []
        self.deadline: float | None = None
        self.compiled: dict[tuple, Any] = {}  # compile key -> the last case run with it

    # -- one Hypothesis run ---------------------------------------------------------------

    def _past_deadline(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def _observe(self, case: Any, verdict: Any) -> None:
        """Called with every verdict of the property (an extension point: the mutation
        self-test records them; verify/selftest.py)."""

    def _n_not_run(self) -> int:
        """Drawn cases the kernel did not run (domain), over the campaign so far."""
        return sum(e[0] for e in self.not_run.values())

    def _count_not_run(self, reason: str) -> None:
        """Group "not run" reasons that differ only in numbers (``Nq=37`` and ``Nq=9``)."""
        from flashcheck.verify.supervise import normalise_message

        entry = self.not_run.setdefault(normalise_message(reason), [0, reason, set()])
        entry[0] += 1
        entry[2].add(reason)

    def _property(self, bar: Progress, state: dict):
        from flashcheck.verify.check import error_ratio
        from flashcheck.verify.supervise import CRASH_CLASSES
        from hypothesis import note, reject, target

        def prop(case) -> None:
            interrupts.check()  # a SIGTERM whose own raise was dropped (verify/interrupts.py)
            failing = state["key"] is not None
            if self._past_deadline():
                raise _StopCampaign
            fresh = failing and state["fresh"]
            if fresh:
                if (state["fresh_runs"] >= MAX_FRESH_SHRINK
                        or state["timeouts"] >= MAX_TIMEOUT_SHRINK):
                    raise _StopShrink
                state["fresh_runs"] += 1
            self.calls += 1
            note(case.short())
            verdict = self.sup.check(case, fresh=fresh)
            self._observe(case, verdict)
            state["last"] = (case, verdict)
            if self.reuse_compiled and verdict.status != "not_run":
                from flashcheck.verify.strategies import compile_key

                key = compile_key(case)
                self.compiled.pop(key, None)  # re-inserted: the most recent key last
                self.compiled[key] = case
            if failing or verdict.status == "fail":  # (passes before a failure: not kept)
                state["outcomes"].setdefault(case, []).append(_brief(verdict))
            if failing and verdict.failure == "timeout":
                state["timeouts"] += 1
            if verdict.status == "not_run":
                # Not an example: --examples N counts judged cases (Hypothesis does not
                # count a rejected draw towards max_examples either); the bar says how many
                # were drawn and not run.
                self._count_not_run(verdict.reason)
                bar.advance(f"(+{self._n_not_run()} not run) {case.short()[:44]}", n=0)
                reject()
            bar.advance(case.short()[:60])
            ratio = error_ratio(verdict)
            target(target_score(ratio), label="error ratio")
            if verdict.status != "fail":
                return
            sig = signature(case, verdict)
            if sig in self.known:
                self._hit(sig, case, verdict)
                return
            key = shrink_key(verdict)
            if failing and key != state["key"]:
                self.strays.append((case, verdict))  # another failure: recorded after
                return
            if not failing:
                state.update(key=key, cls=verdict.failure,
                             fresh=verdict.failure in CRASH_CLASSES, first=(case, verdict))
            state["best"] = (case, verdict)
            raise _Found(case, verdict)

        return prop

    def _cases(self, reuse=()):
        """The campaign's case strategy (its dtypes, max N and the kernel's capabilities);
        ``reuse``: cases already run, whose compile keys 3 draws in 4 take
        (``--reuse-compiled``)."""
        from flashcheck.verify.strategies import cases

        return cases(dtypes=self.draw_dtypes, max_n=self.max_n,
                     capabilities=self.capabilities, reuse=reuse)

    def _run_once(self, bar: Progress, max_examples: int, state: dict, round_no: int) -> None:
        from hypothesis import HealthCheck, Phase, Verbosity, given, settings
        from hypothesis import seed as hyp_seed
        db = example_database(self.db, self.out)
        strategy = self.strategy
        if self.reuse_compiled and self.compiled:
            strategy = self._cases(reuse=list(self.compiled.values())[-REUSE_POOL:])
        test = given(strategy)(self._property(bar, state))
        test = settings(database=db, max_examples=max_examples, deadline=None,
                        phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target,
                                Phase.shrink),
                        suppress_health_check=list(HealthCheck),
                        report_multiple_bugs=False, verbosity=Verbosity.quiet,
                        print_blob=False)(test)
        if self.seed is not None:
            test = hyp_seed(self.seed + round_no)(test)
        test()

    # -- recording ------------------------------------------------------------------------

    def _write(self, case: Any, verdict: Any, *, note: str = "") -> Path:
        """Write the failure (and, for a root cause, remember its file); print it."""
        from flashcheck.verify.cases import case_file_line
        from flashcheck.verify.supervise import root_cause
        from flashcheck.verify.sweep import write_failure

        sig = signature(case, verdict)
        self.recorded_cases.append(case)
        if root_cause(verdict) is not None:
            info = {"key": list(root_cause(verdict)), "hits": 1,
                    "configurations": [R.config_label(case.config_key())]}
            verdict.observations["root_cause"] = info
        path = write_failure(self.out / "failures", case, verdict,
                             kernel_spec=self.kernel_spec, device=self.device)
        if root_cause(verdict) is not None:
            self.causes[sig] = {"case": case, "verdict": verdict, "path": path}
        self.known.add(sig)
        if path not in self.found:
            self.found.append(path)
        if note:
            print(f"note: {note}")
        print(f"FAIL {verdict.summary()}")
        print(f"  case:   {case.short()}")
        print(f"  file:   {path} (+ {path.with_suffix('.md').name})")
        print(f"  replay: {R.replay_command(str(path), self.kernel_spec, self.device)}")
        # the case file's case in the log too, for a run whose files are gone (CI)
        line = case_file_line(case, kernel=self.kernel_spec, settings=R.kernel_settings())
        print(f"  json:   {line}")
        return path

    def _hit(self, sig: tuple, case: Any, verdict: Any) -> None:
        """An already recorded root cause hit again: count it; a new configuration rewrites
        its file, and a smaller case takes its place."""
        from flashcheck.verify.sweep import _remove_failure_files, case_size, write_failure

        entry = self.causes.get(sig)
        if verdict.case_file and (entry is None or Path(verdict.case_file) != entry["path"]):
            _remove_failure_files(verdict.case_file)  # written at once (a crash); one per cause
            verdict.case_file = None
        if entry is None:
            return
        info = entry["verdict"].observations["root_cause"]
        info["hits"] += 1
        label = R.config_label(case.config_key())
        smaller = case_size(case) < case_size(entry["case"])
        if label in info["configurations"] and not smaller:
            return
        if label not in info["configurations"]:
            info["configurations"] = sorted({*info["configurations"], label}, key=R._natural)
        if smaller:
            _remove_failure_files(entry["path"])
            verdict.observations["root_cause"] = info
            entry.update(case=case, verdict=verdict)
        path = write_failure(self.out / "failures", entry["case"], entry["verdict"],
                             kernel_spec=self.kernel_spec, device=self.device)
        if path != entry["path"]:
            self.found[self.found.index(entry["path"])] = path
            entry["path"] = path

    def _confirm(self, case: Any, verdict: Any) -> tuple[Any | None, int]:
        """Re-check a shrunk failure CONFIRM_RUNS times in the campaign's worker, then once
        in a fresh worker (what `flashcheck repro` does: a kernel whose result depends on
        what ran before it in the process, e.g. a recompiled variant, fails only in the
        campaign): (the first disagreeing verdict or None when every run agreed, the number
        of re-checks that agreed)."""
        key = shrink_key(verdict)
        agreed = 0
        for fresh in [False] * CONFIRM_RUNS + [True]:
            if self._past_deadline():
                break
            again = self.sup.check(case, fresh=fresh, confirm=False)
            if again.status != "fail" or shrink_key(again) != key:
                return again, agreed
            agreed += 1
        return None, agreed

    def _classify_flaky(self, case: Any) -> tuple[str, str, list]:
        """Run the case twice in each of FLAKY_RERUNS fresh workers: (kind, text, runs)."""
        runs = []
        for _ in range(FLAKY_RERUNS):
            if self._past_deadline():
                break
            a = self.sup.check(case, fresh=True, confirm=False)
            b = self.sup.check(case, confirm=False)
            runs.append([_brief(a), _brief(b)])
        if not runs:
            return "unclassified", "not re-run: the time budget is spent", runs
        firsts = [r[0] != "pass" for r in runs]
        seconds = [r[1] != "pass" for r in runs]
        failed = [b for r in runs for b in r if b.startswith("fail")]
        n_fail, n = len(failed), 2 * len(runs)
        refused = sum(b == "not_run" for r in runs for b in r)
        if refused == n:
            # e.g. a compiled kernel whose compiler refuses the shape in a fresh process,
            # while the campaign's worker had run it on another code path
            return ("fresh_not_run", f"not run in a fresh worker (refused in {n} of {n} "
                    "runs; the campaign's worker, after earlier cases, ran it): what runs "
                    "depends on the worker's history", runs)
        if refused and n_fail == 0:
            # refused in some fresh workers, passed in the others: never wrong there
            return ("history", f"passes in fresh workers where it runs ({n - refused} of {n} "
                    f"runs; {refused} not run, refused by the kernel): wrong only after what "
                    "earlier cases did in the campaign's worker", runs)
        if refused:
            return ("random", f"differs at random: in fresh workers {n_fail} of {n} runs "
                    f"failed, {refused} not run", runs)
        if failed and all(b == "fail (harness_error)" for b in failed):
            # e.g. the harness's own GPU work out of memory beside other processes: kept
            # (never lost), but named for what it is, not as a kernel wrong at random
            return ("harness", f"the harness could not judge it in {n_fail} of {n} runs in "
                    "fresh workers (harness_error each time; the first run's reason says "
                    "why): not a judgement of the kernel", runs)
        if all(firsts) and not any(seconds):
            return ("first_use", "wrong on first use: fails on its first run in a fresh worker "
                    "and passes when repeated there", runs)
        if n_fail == 0:
            return ("history", "passes in fresh workers: wrong only after what earlier cases "
                    "did in the campaign's worker", runs)
        if n_fail == n:
            return ("fresh_fails", "fails every time in a fresh worker (in the campaign's "
                    "worker, after earlier cases, a run disagreed)", runs)
        return "random", f"wrong at random: {n_fail} of {n} runs in fresh workers failed", runs

    def _record_flaky(self, case: Any, first: Any, replay: Any,
                      unshrunk: tuple[Any, Any] | None = None,
                      changed: dict | None = None) -> None:
        """One ``flaky`` failure with both verdicts and the fresh-worker classification.

        Shrinking a failure that comes and goes drifts toward cases where it barely shows, so
        when the shrunk case failed in fewer than half of its fresh-worker runs, the first
        failing case of the campaign (``unshrunk``) is classified too, and the one that
        failed more often is kept: the file's replay should reproduce it."""
        from flashcheck.verify.check import Verdict

        kind, text, runs = self._classify_flaky(case)
        note = ""
        if unshrunk is not None and unshrunk[0] != case and _fail_rate(runs) < 0.5:
            kind2, text2, runs2 = self._classify_flaky(unshrunk[0])
            if _fail_rate(runs2) > _fail_rate(runs):
                note = (f"kept the campaign's first failing case: it failed "
                        f"{_fail_rate(runs2):.0%} of its fresh-worker runs, the shrunk case "
                        f"{case.short()} {_fail_rate(runs):.0%}")
                case, first = unshrunk
                kind, text, runs = kind2, text2, runs2
        reason = f"first run: {_brief(first)}; replay: {_brief(replay)}; {text}"
        if _brief(first) == _brief(replay) and changed:
            other, outcomes = next(iter(changed.items()))
            where = "this case" if other == case else f"the shrink candidate {other.short()}"
            reason += f"; in the campaign, {where} gave {', '.join(outcomes)}"
        if note:
            reason = (f"first run: {_brief(first)}; the shrunk case gave {_brief(replay)} on "
                      f"replay; {text}; {note}")
        verdict = Verdict(case=case, kernel=self.kernel_spec, device=self.device,
                          status="fail", failure="flaky", reason=reason,
                          tensors=dict(first.tensors), timings=dict(first.timings))
        verdict.observations["flaky"] = {
            "kind": kind, "classification": text, "reruns_fresh_worker": runs,
            "fail_rate_fresh_worker": _fail_rate(runs),
            "first": _plain_verdict(first), "replay": _plain_verdict(replay)}
        if note:
            verdict.observations["flaky"]["kept"] = note
        if changed:
            verdict.observations["flaky"]["changed_in_campaign"] = [
                {"case": c.to_dict(), "outcomes": o} for c, o in changed.items()]
        self.known.add(signature(case, first))
        self._write(case, verdict)

    def _record(self, state: dict, *, flaky: bool = False, stopped: bool = False) -> None:
        """Write the failure being shrunk (``state["best"]``): confirmed, or as flaky."""
        from flashcheck.verify.supervise import CRASH_CLASSES
        from flashcheck.verify.sweep import _remove_failure_files, write_failure

        case, verdict = state["best"]
        first_case, first = state["first"]
        provisional = None
        if flaky or (verdict.failure not in CRASH_CLASSES and not stopped):
            # On disk before the re-runs below (a kill or a harness error during them must
            # not lose it); replaced by the final record.
            provisional = write_failure(self.out / "failures", case, verdict,
                                        kernel_spec=self.kernel_spec, device=self.device)
        n_found = len(self.found)
        if flaky:
            replay = state["last"][1] if state["last"] and state["last"][0] == case \
                else self.sup.check(case)
            # Hypothesis may have seen another case (a shrink candidate) change its outcome
            changed = {c: o for c, o in state["outcomes"].items() if len(set(o)) > 1}
            self._record_flaky(case, verdict, replay, unshrunk=state["first"],
                               changed=changed)
        elif verdict.failure in CRASH_CLASSES or stopped:
            note = "" if not stopped else "shrinking stopped (time budget, shrink cap or " \
                                          "interrupt); recording the smallest failing case " \
                                          "so far"
            self._write(case, verdict, note=note)
        else:
            other, agreed = self._confirm(case, verdict)
            if other is not None:
                self._record_flaky(case, verdict, other, unshrunk=state["first"])
            else:
                # `repro` sizes its replay of a nondeterministic failure from these
                verdict.observations["rechecks_agreed"] = agreed
                self._write(case, verdict)
        if provisional is not None and provisional not in self.found[n_found:]:
            _remove_failure_files(provisional)
        self.known.add(signature(first_case, first))
        self._drop_superseded(case, verdict)

    def _drop_superseded(self, case: Any, verdict: Any) -> None:
        """Crash-class candidates written at once during the shrink (write-ahead) are
        superseded by the shrunk case's file: one file per failure."""
        from flashcheck.verify.supervise import CRASH_CLASSES
        from flashcheck.verify.sweep import _remove_failure_files, failure_id

        if verdict.failure not in CRASH_CLASSES:
            return
        keep = {p.name for p in self.found}
        key = shrink_key(verdict)
        for p in (self.out / "failures").glob(f"{verdict.failure}-*.json"):
            if p.name in keep or p.name == f"{failure_id(case, verdict)}.json":
                continue
            try:
                from flashcheck.verify.cases import load_case_file

                _, meta = load_case_file(p)
            except (OSError, ValueError):
                continue
            mine = p.stat().st_mtime >= self.t_wall0
            if mine and shrink_key_of(meta.get("verdict") or {}) == key:
                _remove_failure_files(p)

    def _record_strays(self) -> None:
        """Failures of another kind met while one was being shrunk: per failure class (or root
        cause) the smallest of them, unshrunk, unless that kind is recorded already."""
        from flashcheck.verify.sweep import _remove_failure_files, case_size

        smallest: dict[tuple, tuple[Any, Any, int]] = {}
        for case, verdict in self.strays:
            if signature(case, verdict) in self.known or case in self.recorded_cases:
                continue  # the same case recorded already (e.g. as flaky) says it all
            key = shrink_key(verdict)
            if any(shrink_key_of_sig(sig) == key for sig in self.known):
                continue
            n = smallest[key][2] + 1 if key in smallest else 1
            if key not in smallest or case_size(case) < case_size(smallest[key][0]):
                smallest[key] = (case, verdict, n)
            else:
                smallest[key] = (*smallest[key][:2], n)
        for case, verdict, n in smallest.values():
            self._write(case, verdict, note=f"found while another failure was being shrunk "
                                            f"({n} such case(s)); recorded unshrunk, the "
                                            f"smallest of them")
        # Crash-class strays were written at once; every kind is recorded now, so the files
        # of the others are duplicates.
        for _, verdict in self.strays:
            if verdict.case_file and Path(verdict.case_file) not in self.found:
                _remove_failure_files(verdict.case_file)
        self.strays.clear()

    def _recheck_leftovers(self) -> None:
        """In-flight files left by a campaign that was killed: re-check each in a fresh worker."""
        from flashcheck.verify.cases import load_case_file

        left = sorted((self.out / "inflight").glob("inflight-*.json"))
        for p in left:
            if self._past_deadline():
                print(f"note: {p.name} not re-checked: the time budget is spent")
                continue
            try:
                case, _ = load_case_file(p)
            except (OSError, ValueError):
                continue
            print(f"note: re-checking {p.name}, left in flight by an earlier campaign")
            verdict = self.sup.check(case, fresh=True)
            p.unlink(missing_ok=True)
            if verdict.status == "fail":
                self._write(case, verdict, note="an in-flight case of an earlier campaign fails")

    def _record_probe_crash(self) -> None:
        """The kernel took its worker down on the capability probes: check the case closest
        to the probes' inputs (the probes run first inside every check) in a fresh worker and
        record what happened; a crash there is the failure, else the probe crash itself."""
        from flashcheck.verify.cases import Case
        from flashcheck.verify.check import Verdict

        print(f"note: {self.probe_crash}")
        case = Case(B=1, Hq=2, Hkv=2, Nq=4, Nk=4, D=16, dtype=self.draw_dtypes[0])
        verdict = self.sup.check(case, fresh=True, confirm=False)
        if verdict.status != "fail":
            verdict = Verdict(case=case, kernel=self.kernel_spec, device=self.device,
                              status="fail", failure="crashed", reason=self.probe_crash)
        self._write(case, verdict)

    def run(self) -> int:
        # SIGTERM (e.g. `timeout`) becomes the same as Ctrl-C, and neither is lost
        # (verify/interrupts.py: prop() checks before each example)
        try:
            with interrupts.interruptible():
                return self._run()
        finally:
            self.sup.close()

    def _run(self) -> int:
        from hypothesis.errors import Flaky, Unsatisfiable

        self.out.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        self.t_wall0 = time.time()  # files older than this are not this campaign's
        self.deadline = t0 + 60.0 * self.minutes if self.minutes is not None else None
        what = f"fuzz[{self.kernel_spec}]"
        print(f"fuzz: kernel {self.kernel_spec} on {self.device} (supervised workers); dtypes "
              f"{', '.join(self.draw_dtypes)}; N <= {self.max_n}; "
              + (f"{self.examples} examples" if self.examples else f"{self.minutes} min")
              + (f"; seed {self.seed} (no example database)" if self.seed is not None
                 else f"; database {self.db or self.out / 'hypothesis-db'}")
              + ("; case timeout " + (f"{self.case_timeout:g} s" if self.case_timeout
                                      else "auto")))
        for line in domain_notes(self.capabilities):
            print(f"fuzz: {line}")
        round_no = 0
        interrupted = False
        state: dict = {}
        with Progress(what, self.examples, budget_s=None if self.deadline is None
                      else self.deadline - t0, quiet=self.quiet) as bar:
            try:
                self._recheck_leftovers()
                if self.probe_crash is not None:
                    self._record_probe_crash()
                while self.probe_crash is None:
                    left = ((self.examples - self.calls + self._n_not_run())
                            if self.examples is not None else 10**9)
                    if left <= 0 or self._past_deadline():
                        break
                    state = {"key": None, "cls": None, "fresh": False, "fresh_runs": 0,
                             "timeouts": 0, "best": None, "first": None, "last": None,
                             "outcomes": {}}
                    try:
                        self._run_once(bar, min(left, reuse_round(round_no))
                                       if self.reuse_compiled else left, state, round_no)
                    except _StopCampaign:
                        if state["best"] is not None:
                            bar.close()
                            self._record(state, stopped=True)
                        break
                    except _StopShrink:
                        bar.close()
                        self._record(state, stopped=True)
                        self._record_strays()
                        if not self.keep_going:
                            break
                    except _Found:
                        bar.close()
                        self._record(state)
                        self._record_strays()
                        if not self.keep_going:
                            break
                    except Flaky:
                        bar.close()
                        if state["best"] is None:
                            raise
                        self._record(state, flaky=True)
                        self._record_strays()
                        if not self.keep_going:
                            break
                    except Unsatisfiable:
                        raise ValueError(f"fuzz: the kernel {self.kernel_spec!r} ran none of "
                                         "the drawn cases on this device (all outside its "
                                         "domain)") from None
                    else:
                        self._record_strays()
                        if not self.reuse_compiled:
                            break  # the example budget ran out without a new failure
                        # --reuse-compiled: the next round draws from the pool as it is now
                    round_no += 1
            except KeyboardInterrupt:
                interrupts.clear()
                interrupted = True
                bar.close()
                print("fuzz: interrupted; keeping what was found")
                if state.get("best") is not None and signature(*state["best"]) not in \
                        self.known:
                    self._record(state, stopped=True)
                self._record_strays()
        wall = time.monotonic() - t0
        print(f"fuzz: {self.calls - self._n_not_run()} examples in {wall:.1f} s"
              + (" (interrupted)" if interrupted else "")
              + f"; {len(self.found)} distinct failure(s)"
              + (f" in {self.out / 'failures'}" if self.found else "")
              + f"; {self.sup.started} worker process(es)")
        import json

        # What a campaign of several workers (verify/scale.py) adds up.
        (self.out / "summary.json").write_text(json.dumps({
            "kernel": self.kernel_spec, "device": self.device, "seed": self.seed,
            "examples": self.calls - self._n_not_run(), "not_run": self._n_not_run(),
            "wall_s": round(wall, 1), "interrupted": interrupted,
            "failures": [str(p) for p in self.found],
            "exit": 1 if self.found or interrupted else 0,
        }, indent=1) + "\n")
        if self.not_run:
            n = self._n_not_run()
            print(f"fuzz: {n} drawn case(s) not run (the kernel rejected them, or its declared "
                  f"supports() did); declare these in its capabilities (docs/contracts.md "
                  f"§2) so the campaign draws inside them:")
            for count, why, seen in sorted(self.not_run.values(), key=lambda e: -e[0])[:10]:
                more = f" (and {len(seen) - 1} more like it)" if len(seen) > 1 else ""
                print(f"  {count} x not run: {why}{more}")
        if interrupted and not self.found:
            # An interrupt (Ctrl-C, SIGTERM, a CI time limit) is not a pass: the campaign did
            # not run what it was asked to (--minutes ending it is the budget, not this).
            print("fuzz: interrupted before its budget ended: not a pass (exit 1)")
        return 1 if self.found or interrupted else 0


def example_database(db: str | None, out: Path):
    """Hypothesis's example database for a campaign: ``DIR/hypothesis-db`` (None), a
    directory, or ``redis://HOST:PORT/N`` (``RedisExampleDatabase``, needs the ``redis``
    package); workers of one campaign share it (verify/scale.py)."""
    from hypothesis.database import DirectoryBasedExampleDatabase

    if db is None:
        return DirectoryBasedExampleDatabase(str(out / "hypothesis-db"))
    if db.startswith(("redis://", "rediss://", "unix://")):
        try:
            import redis
            from hypothesis.extra.redis import RedisExampleDatabase
        except ImportError as e:
            raise ValueError(f"--db {db}: a Redis database needs the redis package "
                             f"(pip install redis): {e}") from None
        return RedisExampleDatabase(redis.Redis.from_url(db))
    if "://" in db:
        raise ValueError(f"--db must be a directory or redis://HOST:PORT/N, got {db!r}")
    return DirectoryBasedExampleDatabase(db)


def shrink_key_of_sig(sig: tuple) -> tuple:
    """The :func:`shrink_key` part of a :func:`signature`."""
    return tuple(sig[1:]) if sig and sig[0] == "root-cause" else (sig[0],)


def shrink_key_of(verdict_dict: dict) -> tuple:
    """:func:`shrink_key` of a verdict as stored in a case file."""
    from flashcheck.verify.supervise import root_cause

    return root_cause(verdict_dict) or (verdict_dict.get("failure"),)


def _fail_rate(runs: list) -> float:
    """Share of failing runs in :meth:`Campaign._classify_flaky`'s pairs (0 when none ran;
    a run the kernel refused is not a failure)."""
    flat = [r for pair in runs for r in pair]
    return sum(r.startswith("fail") for r in flat) / len(flat) if flat else 0.0


def _brief(verdict: Any) -> str:
    """``pass`` or ``fail (class)`` or ``not_run``: one verdict in a word or two."""
    if verdict.status == "fail":
        return f"fail ({verdict.failure})"
    return verdict.status


def _plain_verdict(verdict: Any) -> dict:
    d = verdict.to_dict()
    d.pop("case", None)
    return d

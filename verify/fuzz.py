"""``flashcheck fuzz``: a time- or example-boxed Hypothesis campaign against one kernel.

The campaign runs a ``@given(cases(...))`` property programmatically. Each example is checked
with ``check_case``; the error ratio (observed / tolerance) is passed to ``target()`` so the
search climbs toward the worst cases, and the case is ``note()``-d. A failing verdict raises,
Hypothesis shrinks it, and the final (shrunk) example is re-checked and written as
``DIR/failures/<id>.json`` (case file: case, kernel spec, versions, device, verdict) plus
``DIR/failures/<id>.md``.

- Draws stay inside the kernel's capabilities on this device: its dtypes minus those it
  declares ``not_run`` here, its mask kinds, extensions, GQA and backward.
- The example database is ``DIR/hypothesis-db`` (``DirectoryBasedExampleDatabase``): a rerun
  with the same DIR first replays what failed before.
- ``seed`` fixes Hypothesis's random choices (``hypothesis.seed``), so the same seed, kernel
  and device give the same campaign. A seeded run does not use the database (Hypothesis's
  own rule for ``@seed``: replaying saved examples first would change the sequence).
- ``keep_going``: after a failure, the campaign restarts and treats failures of an already
  recorded kind (failure class + worst tensor + configuration) as uninteresting, so every
  recorded failure is distinct and shrunk, until the budget ends.

Caveats: the time box is checked between examples, so one slow example can overrun it; and
once a failure is being shrunk the clock is no longer checked (Hypothesis bounds shrinking
itself), so a campaign can end later than ``minutes`` by the length of one shrink.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verify import report as R
from verify.progress import Progress

DEFAULT_EXAMPLES = 200
# Largest sequence length drawn by default. The CPU runs the Triton interpreter (seconds per
# case at N = 64) and the fp64 reference is O(N^2) per head; on a GPU, 2048 is where the
# references still fit comfortably alongside the kernel.
DEFAULT_MAX_N = {"cpu": 64, "cuda": 2048}
# target() needs a finite score; an unbounded ratio (NaN output) is a failure anyway and
# stops the search, so any value far above 1 serves.
TARGET_CAP = 1e6


class _StopCampaign(BaseException):
    """The time budget is spent. A BaseException, so Hypothesis does not take it for a
    failure of the property and shrink it; it propagates out of the run."""


class _Found(AssertionError):
    """A failing verdict inside the property (Hypothesis shrinks on it)."""

    def __init__(self, case: Any, verdict: Any) -> None:
        super().__init__(verdict.summary())
        self.case = case
        self.verdict = verdict


def signature(case: Any, verdict: Any) -> tuple[str, str, str]:
    """What makes two failures the same: failure class, worst tensor, configuration.

    ``verdict`` is a Verdict or its ``to_dict()`` (as stored in a case file).
    """
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


@dataclass
class Campaign:
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
    found: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.examples is not None and self.examples < 1:
            raise ValueError(f"--examples must be >= 1, got {self.examples}")
        if self.minutes is not None and not (math.isfinite(self.minutes) and self.minutes > 0):
            raise ValueError(f"--minutes must be a finite number > 0, got {self.minutes}")
        if self.examples is not None and self.minutes is not None:
            raise ValueError("give --examples or --minutes, not both")
        if self.examples is None and self.minutes is None:
            self.examples = DEFAULT_EXAMPLES
        import torch

        dev = torch.device(self.device).type
        if self.max_n is None:
            self.max_n = DEFAULT_MAX_N[dev]
        caps = self.kernel.capabilities
        self.capabilities = caps
        self.draw_dtypes = draw_dtypes(caps, self.device, self.dtypes)
        from verify.strategies import cases

        # Built once here so bad bounds surface as a usage error before anything runs.
        self.strategy = cases(dtypes=self.draw_dtypes, max_n=self.max_n, capabilities=caps)
        self.calls = 0
        self.known: set[tuple[str, str, str]] = set()

    # -- one Hypothesis run ---------------------------------------------------------------

    def _property(self, bar: Progress, deadline: float | None):
        from hypothesis import note, target

        from verify.check import check_case, error_ratio

        state = {"failing": False}

        def prop(case) -> None:
            if deadline is not None and not state["failing"] and time.monotonic() > deadline:
                raise _StopCampaign
            self.calls += 1
            note(case.short())
            verdict = check_case(self.kernel, case, self.device)
            bar.advance(case.short()[:60])
            if verdict.status == "not_run":
                from hypothesis import reject

                reject()
            ratio = error_ratio(verdict)
            target(min(ratio, TARGET_CAP) if math.isfinite(ratio) else TARGET_CAP,
                   label="error ratio")
            if verdict.status == "fail" and signature(case, verdict) not in self.known:
                state["failing"] = True
                raise _Found(case, verdict)

        return prop

    def _run_once(self, bar: Progress, max_examples: int, deadline: float | None,
                  round_no: int) -> None:
        from hypothesis import HealthCheck, Phase, Verbosity, given, settings
        from hypothesis import seed as hyp_seed
        from hypothesis.database import DirectoryBasedExampleDatabase

        db = DirectoryBasedExampleDatabase(str(self.out / "hypothesis-db"))
        test = given(self.strategy)(self._property(bar, deadline))
        test = settings(database=db, max_examples=max_examples, deadline=None,
                        phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target,
                                Phase.shrink),
                        suppress_health_check=list(HealthCheck),
                        report_multiple_bugs=False, verbosity=Verbosity.quiet,
                        print_blob=False)(test)
        if self.seed is not None:
            test = hyp_seed(self.seed + round_no)(test)
        test()

    # -- the campaign ---------------------------------------------------------------------

    def _record(self, exc: _Found) -> None:
        """Re-check the shrunk case, write its case file, print the summary and replay."""
        from verify.check import check_case
        from verify.sweep import write_failure

        case, verdict = exc.case, exc.verdict
        again = check_case(self.kernel, case, self.device)
        if again.status == "fail":
            verdict = again
        else:
            print(f"note: the shrunk case did not fail when re-checked ({again.status}); "
                  "recording the failing run (nondeterministic kernel?)")
        path = write_failure(self.out / "failures", case, verdict,
                             kernel_spec=self.kernel_spec, device=self.device)
        self.known.add(signature(case, verdict))
        self.found.append(path)
        print(f"FAIL {verdict.summary()}")
        print(f"  case:   {case.short()}")
        print(f"  file:   {path} (+ {path.with_suffix('.md').name})")
        print(f"  replay: {R.replay_command(str(path), self.kernel_spec, self.device)}")

    def run(self) -> int:
        from hypothesis.errors import Flaky, Unsatisfiable

        self.out.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        deadline = t0 + 60.0 * self.minutes if self.minutes is not None else None
        what = f"fuzz[{self.kernel_spec}]"
        print(f"fuzz: kernel {self.kernel_spec} on {self.device}; dtypes "
              f"{', '.join(self.draw_dtypes)}; N <= {self.max_n}; "
              + (f"{self.examples} examples" if self.examples else f"{self.minutes} min")
              + (f"; seed {self.seed} (no example database)" if self.seed is not None
                 else f"; database {self.out / 'hypothesis-db'}"))
        round_no = 0
        with Progress(what, self.examples, budget_s=None if deadline is None
                      else deadline - t0, quiet=self.quiet) as bar:
            while True:
                left = (self.examples - self.calls) if self.examples is not None else 10**9
                if left <= 0 or (deadline is not None and time.monotonic() > deadline):
                    break
                try:
                    self._run_once(bar, left, deadline, round_no)
                except _StopCampaign:
                    break
                except _Found as e:
                    bar.close()
                    self._record(e)
                    if not self.keep_going:
                        break
                except Flaky as e:
                    bar.close()
                    print(f"note: Hypothesis reports a flaky failure: "
                          f"{str(e).splitlines()[0]}")
                    break
                except Unsatisfiable:
                    raise ValueError(f"fuzz: the kernel {self.kernel_spec!r} ran none of the "
                                     "drawn cases on this device (all outside its domain)") \
                        from None
                else:
                    break  # the example budget of this round ran out without a new failure
                round_no += 1
        wall = time.monotonic() - t0
        print(f"fuzz: {self.calls} examples in {wall:.1f} s; "
              f"{len(self.found)} distinct failure(s)"
              + (f" in {self.out / 'failures'}" if self.found else ""))
        return 1 if self.found else 0

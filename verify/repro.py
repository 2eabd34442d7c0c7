"""``flashcheck repro``: replay one case (a case file, or tensors captured from training).

Exit status is what ``git bisect run`` expects: 0 when the case passes, 1 when it fails, and
125 ("skip this commit") when the kernel cannot run the case here (outside its declared
domain on this device), so a bisection is not misled by commits where the question cannot
be asked.

A case file may have a tensor file beside it (``NAME.npz`` / ``NAME.pt``, same stem); then the
captured tensors are the inputs and the case supplies the structural flags. ``--tensors FILE``
replays a tensor file on its own; the flags (``--is-causal``, ``--window``, ``--scale``, ...)
say how it was called. Tensor files are read without pickle (``np.load(allow_pickle=False)``,
``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

EXIT_PASS, EXIT_FAIL, EXIT_SKIP = 0, 1, 125
# Replays of a case file recorded as ``flaky`` or ``nondeterministic`` (unless --repeat says
# otherwise): at least FLAKY_REPEATS checks, enough to show a failure rate; a first-use bug
# fails the first one already. While none has failed the replay goes on, up to
# flaky_replays(): a kernel wrong at random with probability q per check passes 8 of them
# with (1-q)^8, 0.4% at q = 1/2, which a CI job that replays such a file meets once in ~300.
FLAKY_REPEATS = 8
# The chance that a kernel still failing at its recorded rate passes the whole replay.
FLAKY_MISS = 1e-6
# One-sided 99% normal quantile: the recorded rate's Wilson lower bound, so that a rate
# measured on 10 runs is not taken at face value (4 of 10 -> 0.14, 7 of 10 -> 0.35).
_Z99 = 2.326
# At most this many checks: a rate too low to bound within it (1 of 10 -> 0.014 needs ~990)
# stops here, and the output says how sure the pass is.
FLAKY_MAX_REPLAYS = 200


@dataclass(frozen=True)
class Target:
    """What to replay, and the kernel and device recorded with it (if any)."""

    case: Any  # verify.cases.Case or TensorCase
    kernel_spec: str | None
    device_hint: str | None
    source: str
    recorded_failure: str | None = None  # the failure class in the case file, if any
    # failing and total checks behind that class (fresh-worker runs of a flaky failure, the
    # confirmations of a nondeterministic one), if the file says
    recorded_rate: tuple[int, int] | None = None
    # the kernels' FLASHCHECK_* settings the case file records (set again for the replay)
    settings: dict[str, str] = dataclasses.field(default_factory=dict)


def rate_lower_bound(failed: int, runs: int, z: float = _Z99) -> float:
    """Wilson score lower bound of a failure rate seen as ``failed`` of ``runs``."""
    if runs <= 0 or failed <= 0:
        return 0.0
    p, z2 = failed / runs, z * z
    centre = p + z2 / (2 * runs)
    spread = z * math.sqrt(p * (1 - p) / runs + z2 / (4 * runs * runs))
    return max(0.0, (centre - spread) / (1 + z2 / runs))


def flaky_replays(rate: tuple[int, int] | None) -> int:
    """Checks after which a kernel failing at the recorded rate's lower bound q has passed
    them all with probability <= FLAKY_MISS: ceil(ln MISS / ln(1 - q)), within
    [FLAKY_REPEATS, FLAKY_MAX_REPLAYS]; FLAKY_REPEATS when no rate is recorded."""
    q = rate_lower_bound(*rate) if rate else 0.0
    if not 0.0 < q < 1.0:
        return FLAKY_REPEATS
    n = math.ceil(math.log(FLAKY_MISS) / math.log1p(-q))
    return min(FLAKY_MAX_REPLAYS, max(FLAKY_REPEATS, n))


def _recorded_rate(verdict: dict) -> tuple[int, int] | None:
    """(failed, runs) behind a case file's verdict: the fresh-worker runs of a ``flaky``
    failure; for ``nondeterministic``, the first run and every confirmation agreed."""
    failure = verdict.get("failure")
    if failure == "flaky":
        flaky = (verdict.get("observations") or {}).get("flaky") or {}
        runs = [r for pair in flaky.get("reruns_fresh_worker") or [] for r in pair]
        return (sum(r.startswith("fail") for r in runs), len(runs)) if runs else None
    if failure == "nondeterministic":
        agreed = (verdict.get("observations") or {}).get("rechecks_agreed")
        n = 1 + (agreed if isinstance(agreed, int) and agreed >= 0 else 0)
        return (n, n)
    return None


def _recorded_settings(path, settings: Any) -> dict[str, str]:
    """A case file's ``settings``: an object of ``FLASHCHECK_*`` names to strings, none of
    the harness's own (:data:`report.HARNESS_ONLY_SETTINGS`). ValueError naming the file."""
    from flashcheck.verify.report import HARNESS_ONLY_SETTINGS

    ok = isinstance(settings, dict) and all(
        isinstance(k, str) and k.startswith("FLASHCHECK_") and k not in HARNESS_ONLY_SETTINGS
        and isinstance(v, str) for k, v in settings.items())
    if not ok:
        raise ValueError(f"{path}: settings must map FLASHCHECK_* variable names (not "
                         f"{', '.join(HARNESS_ONLY_SETTINGS)}) to strings, got {settings!r}")
    return dict(settings)


def replay_settings(recorded: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """The case file's recorded settings that the replay's worker sets (those this process's
    environment lacks: one set here, even empty, wins, so that a replay can run without a
    setting), and a line per variable saying which value runs."""
    env, lines = {}, []
    for k, v in sorted(recorded.items()):
        if k not in os.environ:
            env[k] = v
            lines.append(f"{k}={v} (from the case file)")
        elif os.environ[k] != v:
            lines.append(f"{k}={os.environ[k]} (from the environment; the case file's: {v})")
    return env, lines


def load_target(*, case_path: str | None, tensors_path: str | None, is_causal: bool = False,
                scale: float | None = None, window: tuple[int, int] | None = None,
                causal_alignment: str = "top_left", backward: bool = True) -> Target:
    """Read a case file (with its tensor file, if one sits beside it) or a tensor file.

    Raises ValueError naming the file on malformed input.
    """
    from flashcheck.verify.cases import TensorCase, load_case_file, tensors_path_for

    if (case_path is None) == (tensors_path is None):
        raise ValueError("repro: give exactly one of CASE.json or --tensors FILE")
    if case_path is not None:
        case, meta = load_case_file(case_path)
        beside = tensors_path_for(case_path)
        if beside is not None:
            case = TensorCase.from_file(beside, case=case)
        device = meta.get("device")
        if isinstance(device, str):
            device = device.split(":")[0]
            if device not in ("cpu", "cuda"):
                device = None
        else:
            device = None
        spec = meta.get("kernel") if isinstance(meta.get("kernel"), str) else None
        recorded = meta.get("verdict") if isinstance(meta.get("verdict"), dict) else {}
        return Target(case=case, kernel_spec=spec, device_hint=device, source=str(case_path),
                      recorded_failure=recorded.get("failure"),
                      recorded_rate=_recorded_rate(recorded),
                      settings=_recorded_settings(case_path, meta.get("settings", {})))
    captured = TensorCase.from_file(tensors_path, backward=backward)
    case = dataclasses.replace(captured.case, is_causal=is_causal, scale=scale, window=window,
                               causal_alignment=causal_alignment)
    return Target(case=TensorCase.from_file(tensors_path, case=case, backward=backward),
                  kernel_spec=None, device_hint=None, source=str(tensors_path))


def replay(kernel: Any, target: Target, *, device: str, kernel_spec: str,
           case_timeout: float | None = None, repeat: int | None = None,
           strict_subnormals: bool = False, family: str = "lazy") -> int:
    """Check the case in a supervised worker process (verify/supervise.py; ``kernel`` is not
    used, the worker resolves ``kernel_spec``), ``repeat`` times in that worker. Without
    ``repeat``: once, or for a case file recorded as ``flaky`` or ``nondeterministic``
    FLAKY_REPEATS times and then on while none has failed, up to
    :func:`flaky_replays` of the recorded rate. Prints the per-tensor table of the first
    failing run (else the first run); returns the exit status: 1 when any run fails (a crash
    or a timeout included), 125 when the case is outside the kernel's domain. ``family``:
    check_case's ("full": every member judges a passing case too)."""
    from flashcheck.verify import report as R
    from flashcheck.verify.supervise import Supervisor
    from flashcheck.verify.sweep import verdict_record

    if repeat is not None and not (isinstance(repeat, int) and repeat >= 1):
        raise ValueError(f"--repeat must be an integer >= 1, got {repeat!r}")
    varies = target.recorded_failure in ("flaky", "nondeterministic")
    if repeat is not None:
        least = most = repeat
    elif varies:
        least, most = FLAKY_REPEATS, flaky_replays(target.recorded_rate)
    else:
        least = most = 1
    env, set_lines = replay_settings(target.settings)
    verdicts = []
    with Supervisor(kernel_spec, device, case_timeout=case_timeout,
                    strict_subnormals=strict_subnormals, family=family, env=env) as sup:
        sup.start()
        while len(verdicts) < most:
            if len(verdicts) >= least and any(v.status == "fail" for v in verdicts):
                break
            verdicts.append(sup.check(target.case, confirm=False))
    failing = [v for v in verdicts if v.status == "fail"]
    verdict = failing[0] if failing else verdicts[0]
    record = verdict_record(target.case, verdict)
    print(f"case:   {target.case.short()}  ({target.source})")
    print(f"kernel: {kernel_spec} on {device}")
    for line in set_lines:
        print(f"set:    {line}")
    print(f"status: {verdict.status}" + (f" ({verdict.failure})" if verdict.failure else ""))
    if len(verdicts) > 1:
        print(f"runs:   {len(failing)} of {len(verdicts)} failed: {_run_words(verdicts)}")
    if varies and repeat is None and not failing and target.recorded_rate:
        q = rate_lower_bound(*target.recorded_rate)
        if q > 0:
            print(f"        recorded {target.recorded_rate[0]} failing of "
                  f"{target.recorded_rate[1]} runs (rate >= {q:.2g} at 99%): a kernel "
                  f"still failing that often passes {len(verdicts)} runs with probability "
                  f"{(1 - q) ** len(verdicts):.1g}")
    if verdict.status != "pass":
        print(verdict.summary())
    if verdict.observations.get("stack"):
        print("worker stack:\n" + verdict.observations["stack"])
    print(R.render_verdict_table(record))
    if failing:
        return EXIT_FAIL
    if all(v.status == "not_run" for v in verdicts):
        print(f"not run: {verdict.reason} (exit {EXIT_SKIP}: git bisect's 'skip')")
        return EXIT_SKIP
    return EXIT_PASS


def _run_words(verdicts: list) -> str:
    """Each run's outcome in order, repeats folded: "pass x3, fail (numerical), pass"."""
    words = [v.status + (f" ({v.failure})" if v.failure else "") for v in verdicts]
    out: list[list] = []
    for w in words:
        if out and out[-1][0] == w:
            out[-1][1] += 1
        else:
            out.append([w, 1])
    return ", ".join(w if n == 1 else f"{w} x{n}" for w, n in out)

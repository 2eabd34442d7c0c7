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
from dataclasses import dataclass
from typing import Any

EXIT_PASS, EXIT_FAIL, EXIT_SKIP = 0, 1, 125
# Replays of a case file recorded as ``flaky`` (unless --repeat says otherwise): a kernel
# wrong at random with probability q per check passes all of them with (1-q)^8, under 0.4%
# for q = 1/2; a first-use bug fails the first one already.
FLAKY_REPEATS = 8


@dataclass(frozen=True)
class Target:
    """What to replay, and the kernel and device recorded with it (if any)."""

    case: Any  # verify.cases.Case or TensorCase
    kernel_spec: str | None
    device_hint: str | None
    source: str
    recorded_failure: str | None = None  # the failure class in the case file, if any


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
                      recorded_failure=recorded.get("failure"))
    captured = TensorCase.from_file(tensors_path, backward=backward)
    case = dataclasses.replace(captured.case, is_causal=is_causal, scale=scale, window=window,
                               causal_alignment=causal_alignment)
    return Target(case=TensorCase.from_file(tensors_path, case=case, backward=backward),
                  kernel_spec=None, device_hint=None, source=str(tensors_path))


def replay(kernel: Any, target: Target, *, device: str, kernel_spec: str,
           case_timeout: float | None = None, repeat: int | None = None,
           strict_subnormals: bool = False) -> int:
    """Check the case in a supervised worker process (verify/supervise.py; ``kernel`` is not
    used, the worker resolves ``kernel_spec``), ``repeat`` times in that worker (default 1,
    or FLAKY_REPEATS for a case file recorded as ``flaky``); print the per-tensor table of the
    first failing run (else the first run); returns the exit status: 1 when any run fails
    (a crash or a timeout included), 125 when the case is outside the kernel's domain."""
    from flashcheck.verify import report as R
    from flashcheck.verify.supervise import Supervisor
    from flashcheck.verify.sweep import verdict_record

    if repeat is None:
        repeat = FLAKY_REPEATS if target.recorded_failure == "flaky" else 1
    if not (isinstance(repeat, int) and repeat >= 1):
        raise ValueError(f"--repeat must be an integer >= 1, got {repeat!r}")
    verdicts = []
    with Supervisor(kernel_spec, device, case_timeout=case_timeout,
                    strict_subnormals=strict_subnormals) as sup:
        sup.start()
        for _ in range(repeat):
            verdicts.append(sup.check(target.case, confirm=False))
    failing = [v for v in verdicts if v.status == "fail"]
    verdict = failing[0] if failing else verdicts[0]
    record = verdict_record(target.case, verdict)
    print(f"case:   {target.case.short()}  ({target.source})")
    print(f"kernel: {kernel_spec} on {device}")
    print(f"status: {verdict.status}" + (f" ({verdict.failure})" if verdict.failure else ""))
    if repeat > 1:
        words = [v.status + (f" ({v.failure})" if v.failure else "") for v in verdicts]
        print(f"runs:   {len(failing)} of {repeat} failed: {', '.join(words)}")
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

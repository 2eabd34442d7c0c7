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


@dataclass(frozen=True)
class Target:
    """What to replay, and the kernel and device recorded with it (if any)."""

    case: Any  # verify.cases.Case or TensorCase
    kernel_spec: str | None
    device_hint: str | None
    source: str


def load_target(*, case_path: str | None, tensors_path: str | None, is_causal: bool = False,
                scale: float | None = None, window: tuple[int, int] | None = None,
                causal_alignment: str = "top_left", backward: bool = True) -> Target:
    """Read a case file (with its tensor file, if one sits beside it) or a tensor file.

    Raises ValueError naming the file on malformed input.
    """
    from verify.cases import TensorCase, load_case_file, tensors_path_for

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
        return Target(case=case, kernel_spec=spec, device_hint=device, source=str(case_path))
    captured = TensorCase.from_file(tensors_path, backward=backward)
    case = dataclasses.replace(captured.case, is_causal=is_causal, scale=scale, window=window,
                               causal_alignment=causal_alignment)
    return Target(case=TensorCase.from_file(tensors_path, case=case, backward=backward),
                  kernel_spec=None, device_hint=None, source=str(tensors_path))


def replay(kernel: Any, target: Target, *, device: str, kernel_spec: str) -> int:
    """Check the case, print the per-tensor table; returns the exit status."""
    from verify import report as R
    from verify.check import check_case
    from verify.sweep import verdict_record

    verdict = check_case(kernel, target.case, device)
    record = verdict_record(target.case, verdict)
    print(f"case:   {target.case.short()}  ({target.source})")
    print(f"kernel: {kernel_spec} on {device}")
    print(f"status: {verdict.status}" + (f" ({verdict.failure})" if verdict.failure else ""))
    if verdict.status != "pass":
        print(verdict.summary())
    print(R.render_verdict_table(record))
    if verdict.status == "pass":
        return EXIT_PASS
    if verdict.status == "not_run":
        print(f"not run: {verdict.reason} (exit {EXIT_SKIP}: git bisect's 'skip')")
        return EXIT_SKIP
    return EXIT_FAIL

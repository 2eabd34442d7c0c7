"""One case in, one :class:`Verdict` out (docs/contracts.md §4).

:func:`check_case` steps:

1. ``kernel.supports(case)``; outside the domain -> ``not_run`` with the reason.
2. Fresh inputs (``case.materialize(device)`` once, or the captured tensors given); each
   consumer below gets its own layout-preserving clone. Steps 3-6 and 8 (the judging) run
   on :func:`oracle_device`: the CPU for a small generated case of a GPU kernel, else the
   kernel's device ("the device" below); the kernel then gets its own placement of the
   same drawn tensors on its device.
3. The float64 reference on the device (out, lse; dq, dk, dv by autograd with dO), copied
   (on the device).
4. The family of correct implementation choices (``reference.family.run_family``: the
   emulated blocked kernel with one legitimate choice changed per member) on the same
   inputs; the worst member's max abs error and RMSE per tensor set the rule
   (verify/bounds.py), and the report names that member.
5. Floors and a-priori bounds (verify/bounds.py), copied (on the device).
6. Poison: every device buffer of steps 3-5 is filled with NaN before it is freed, so a
   kernel returning ``torch.empty`` that lands on the reference's or baseline's memory
   reads NaN, not a correct answer.
7. The kernel: forward twice (on fresh clones; bitwise repeatability), backward when the
   case asks for it and the kernel has one. Checked: it did not raise inside its domain,
   inputs unchanged bitwise, output not aliasing an input, shape/dtype/device, NaN/Inf
   where the reference is finite.
8. Metrics (verify/metrics.py) -> tolerance -> verdict.

Failure classes: ``raised``, ``input_mutated``, ``aliased_output``, ``bad_output`` (shape,
dtype or device), ``masked_rows`` (a fully-masked query row's output is not 0),
``nonfinite``, ``nondeterministic``, ``subnormals_flushed`` (only with
``strict_subnormals``), ``numerical``. A subnormal result returned as 0 is otherwise an
observation (``observations["subnormals_flushed"]``: count per tensor), not a failure. A
``raised`` verdict records ``observations["exception"]`` (type, message, innermost frame in
the kernel's code) for root-cause deduplication. The supervised workers add ``crashed``,
``timeout``, ``cuda_error`` and ``harness_error``, and ``fuzz`` adds ``flaky``
(verify/supervise.py, verify/fuzz.py).

:func:`check_nan_propagation` is a separate observation (reported, never failed): a NaN is
put into one key (or query) element, and the rows that became NaN are compared with the
rows whose softmax touches that element.

Caveats: the reference, bounds and baseline are dense float64/emulated computations:
memory O(B * Hq * Nq * Nk) several times. Timings synchronise CUDA around each step.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field

import torch
from flashcheck.verify import ORACLE_DEVICES, ORACLE_ENV
from flashcheck.verify.adapters import (
    Kernel,
    as_kernel,
    describe_exception,
    exception_info,
    is_clear_rejection,
    kernel_source_root,
)
from flashcheck.verify.bounds import (
    K_RULE,
    TENSORS,
    effective_samples,
    error_model,
    exact_operands,
    ftz_allowance,
    rms_tolerance,
    tolerance,
)
from flashcheck.verify.cases import Case, Inputs
from flashcheck.verify.metrics import abs_error, overflow_threshold, tensor_metrics

__all__ = ["TensorReport", "Verdict", "check_case", "release_cache", "error_ratio",
           "check_nan_propagation", "BASELINE_BLOCK", "ORACLE_DEVICES", "oracle_device"]

# Tile sizes of the emulated baseline member. Large tiles keep the Python loop short; other
# tilings are members of the family themselves (reference/family.py).
BASELINE_BLOCK = (128, 128)
# The family member whose error tensor estimates the number of independent rounding sources
# (effective_samples), and the one that strict_subnormals removes.
BASELINE_MEMBER = "fa2_128"
FTZ_MEMBER = "ftz"
GRADS = ("dq", "dk", "dv")
# Where the judging runs (steps 3-6 and 8) when the kernel runs on a GPU. A small case's
# judging is ~2,000 launches of tiny float64 tensors: ~45 ms of one process's time on a GPU,
# and N worker processes time-share the GPU for them (no MPS), so they stop scaling at ~4.
# The same case judged on one CPU core takes 8-60 ms (measured for B*Hq*Nq*Nk*D up to 2**21
# on a 2-core CI machine: median 8 ms below 2**12, 50 ms at 2**20) and leaves the GPU to the
# kernel alone. Hence: judged on the CPU up to this work, on the kernel's device above it
# (where one bmm of the bounds already costs more on a core than the launches on a GPU).
# The choice depends on the case only, so a case file replays to the same verdict.
ORACLE_CPU_MAX_WORK = 1 << 21
# Out of GPU memory, a case is run again after these pauses (s), one run each: the processes
# of a campaign share the GPU (up to 16 workers, one per core), and a peer's largest case
# holds its float64 tensors for its judging, 0.3-2.2 s (reference + baseline + bounds of the
# B*Hq*Nq*Nk*D = 2**32 cases kept in docs/reports/h200), so 1 s then 4 s outlast a peer's
# case and the one it starts next; 5 s in all is a twelfth of the case timeout's 60 s base
# (verify/supervise.py BASE_TIMEOUT_S).
OOM_PAUSES_S = (1.0, 4.0)
# Cached, unused GPU memory a worker keeps between cases (release_cache): PyTorch's allocator
# keeps every block a case freed, so N workers that each once judged a large case hold N
# times its peak (7-15 GiB each in a 16-process run on the H200) and starve the next one.
# 1 GiB each is 16 GiB for 16 workers, a fifth of an 80 GiB H100; a case that freed more
# than that allocated over 1 GiB, and re-allocating it costs a few cudaMalloc calls (ms).
KEEP_CACHED_BYTES = 1 << 30
_FAIL_ORDER = ("raised", "input_mutated", "aliased_output", "bad_output", "masked_rows",
               "nonfinite", "nondeterministic", "subnormals_flushed", "numerical")


def _num(x: float):
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def _unnum(x):
    return float(x) if x in ("nan", "inf", "-inf") else x


@dataclass
class TensorReport:
    """Errors, tolerance and bound of one tensor. ``tol`` is the tolerance at the worst
    element (the one with the largest err / tol); ``ratio`` is that largest err / tol."""

    name: str
    max_abs: float
    max_rel: float
    rmse: float
    bias: float
    max_ulps: float
    worst_index: tuple
    got: float
    want: float
    n_bad: int
    numel: int
    tol: float
    baseline_err: float
    apriori: float
    ratio: float
    ratio_apriori: float
    passed: bool
    note: str = ""
    rmse_tol: float = math.nan  # tolerance on the RMSE (verify/bounds.py, rms_tolerance)
    baseline_rmse: float = math.nan
    ratio_rmse: float = 0.0  # rmse / rmse_tol; ``ratio`` is max(elementwise, this)
    # Effective independent error samples (verify/bounds.py, effective_samples); below
    # N_EFF_MIN the RMSE rule does not apply (rmse_tol = inf).
    n_eff: float = math.nan
    # The family members (reference/family.py) whose max abs error and RMSE set the
    # tolerances: the correct implementation choice this tensor is measured against.
    member: str = ""
    rmse_member: str = ""
    # What set ``tol`` at the worst element: "family" (K x the members' worst error),
    # "floor" (every member near exact there, section 6 of docs/bounds.md), "flush" (an
    # element in the flush-to-zero regime: the ftz member's row allowance, the a-priori
    # flush allowance, or a 0 at the subnormal threshold) or "spread" (an element where a
    # member overflows and others do not: K x the finite members' error there).
    tol_source: str = ""

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["worst_index"] = list(self.worst_index)
        return {k: _num(v) for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: dict) -> TensorReport:
        kw = {f.name: _unnum(d[f.name]) for f in dataclasses.fields(cls) if f.name in d}
        kw["worst_index"] = tuple(d.get("worst_index", ()))
        return cls(**kw)

    def message(self) -> str:
        idx = ", ".join(str(i) for i in self.worst_index)
        err = abs(self.got - self.want) if math.isfinite(self.got) else math.inf
        rule = ""
        if self.name in K_RULE and math.isfinite(self.baseline_err) and self.baseline_err > 0:
            k = K_RULE[self.name]
            member = f"family member {self.member or 'baseline'} {self.baseline_err:.1e}"
            if self.tol_source in ("floor", "flush", "spread"):
                what = {"floor": "floor", "flush": "flush-to-zero allowance",
                        "spread": "the error of the members finite where another "
                                  "overflows"}[self.tol_source]
                rule = f" = {what}; {k:g} × {member} is {k * self.baseline_err:.1e}"
            else:
                rule = f" = {self.tol / self.baseline_err:.2g} × {member}"
        text = (f"{self.name}: {self.n_bad}/{self.numel} elements off (worst at [{idx}]: "
                f"got {self.got:.4g}, want {self.want:.4g}, |err| {err:.1e} "
                f"{'>' if self.n_bad else '<='} tol {self.tol:.1e}{rule})")
        if self.ratio_rmse > 1:
            k = ""
            if math.isfinite(self.baseline_rmse) and self.baseline_rmse > 0:
                k = (f" = {self.rmse_tol / self.baseline_rmse:.2g} × family member "
                     f"{self.rmse_member or 'baseline'} {self.baseline_rmse:.1e}")
            text += f", rmse {self.rmse:.1e} > tol {self.rmse_tol:.1e}{k}"
        return text + (f"; {self.note}" if self.note else "")


@dataclass
class Verdict:
    case: Case
    kernel: str
    device: str
    status: str  # "pass", "fail", "not_run"
    failure: str | None = None
    reason: str = ""
    tensors: dict[str, TensorReport] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    not_run_tensors: dict[str, str] = field(default_factory=dict)
    observations: dict = field(default_factory=dict)
    case_file: str | None = None

    def to_dict(self) -> dict:
        return {
            "case": self.case.to_dict(),
            "kernel": self.kernel,
            "device": self.device,
            "status": self.status,
            "failure": self.failure,
            "reason": self.reason,
            "tensors": {k: t.to_dict() for k, t in self.tensors.items()},
            "timings": {k: _num(v) for k, v in self.timings.items()},
            "not_run_tensors": dict(self.not_run_tensors),
            "observations": self.observations,
            "error_ratio": _num(error_ratio(self)),
        }

    @classmethod
    def from_dict(cls, d: dict) -> Verdict:
        return cls(
            case=Case.from_dict(d["case"]), kernel=d["kernel"], device=d["device"],
            status=d["status"], failure=d.get("failure"), reason=d.get("reason", ""),
            tensors={k: TensorReport.from_dict(t) for k, t in (d.get("tensors") or {}).items()},
            timings={k: _unnum(v) for k, v in (d.get("timings") or {}).items()},
            not_run_tensors=dict(d.get("not_run_tensors") or {}),
            observations=dict(d.get("observations") or {}),
        )

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def summary(self) -> str:
        """The mismatch message: tensor, elements off, worst index with both values, the
        bound, and the replay command when ``case_file`` is set."""
        if self.status == "not_run":
            return f"not run: {self.reason}"
        if self.status == "pass":
            return f"pass (error ratio {error_ratio(self):.2f}) {self.case.short()}"
        bad = [t.message() for t in self.tensors.values() if not t.passed]
        parts = [f"{self.failure}: {self.reason}"] if self.reason else [f"{self.failure}"]
        if self.failure in ("numerical", "nonfinite") and bad:
            parts = bad
        text = "; ".join(parts)
        if self.case_file:
            text += f"; replay: flashcheck repro {self.case_file}"
        return text


def error_ratio(verdict: Verdict) -> float:
    """Max over tensors of err / tol (> 1 fails); 0 when nothing was compared."""
    ratios = [t.ratio for t in verdict.tensors.values()]
    return max(ratios, default=0.0)


# ------------------------------------------------------------------------------------------
# helpers


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


class _Clock:
    def __init__(self, device: str):
        self.device = device
        self.t: dict[str, float] = {}

    def __call__(self, name: str):
        clock = self

        class _Span:
            def __enter__(self):
                _sync(clock.device)
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                _sync(clock.device)
                clock.t[name] = clock.t.get(name, 0.0) + time.perf_counter() - self.t0

        return _Span()


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _named_inputs(inputs: Inputs) -> dict[str, torch.Tensor]:
    names = ("query", "key", "value", "attn_mask", "grad_out")
    return {n: getattr(inputs, n) for n in names if getattr(inputs, n) is not None}


def _mutated(inputs: Inputs, snapshot: Inputs) -> list[str]:
    snap = _named_inputs(snapshot)
    return [n for n, t in _named_inputs(inputs).items()
            if not torch.equal(_storage_bytes(t), _storage_bytes(snap[n]))]


def _span(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def _aliases(out: torch.Tensor, inputs: Inputs) -> list[str]:
    if out.numel() == 0:
        return []
    lo, hi = _span(out)
    return [n for n, t in _named_inputs(inputs).items()
            if t.device == out.device and t.numel() and _span(t)[0] < hi and lo < _span(t)[1]]


def _poison(*tensors) -> None:
    with torch.no_grad():
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.detach().fill_(math.nan)


def _leaves(inputs: Inputs, grad: bool) -> Inputs:
    if not grad:
        return inputs
    for n in ("query", "key", "value"):
        getattr(inputs, n).requires_grad_(True)
    return inputs


def _allowed_bias(inputs: Inputs):
    from flashcheck.reference.masks import structural_mask

    nq, nk = inputs.query.shape[2], inputs.key.shape[2]
    allowed = structural_mask(nq, nk, is_causal=inputs.is_causal,
                              causal_alignment=inputs.causal_alignment, window=inputs.window,
                              device=inputs.query.device)
    m = inputs.attn_mask
    bias = None
    if m is not None and m.dtype == torch.bool:
        allowed = allowed & m
    elif m is not None:
        bias = m
    return allowed, bias


def _sdpa_kwargs(inputs: Inputs) -> dict:
    return dict(attn_mask=inputs.attn_mask, is_causal=inputs.is_causal, scale=inputs.scale,
                enable_gqa=inputs.enable_gqa, window=inputs.window,
                causal_alignment=inputs.causal_alignment)


def _reference(inputs: Inputs, backward: bool) -> dict[str, torch.Tensor]:
    from flashcheck.reference import attention_fp64

    leaves = [getattr(inputs, n).detach().to(torch.float64).requires_grad_(backward)
              for n in ("query", "key", "value")]
    with torch.enable_grad():
        out, lse = attention_fp64(*leaves, return_lse=True, **_sdpa_kwargs(inputs))
    res = {"out": out.detach(), "lse": lse.detach()}
    if backward:
        grads = torch.autograd.grad(out, leaves, inputs.grad_out.to(torch.float64))
        res.update(zip(GRADS, grads, strict=True))
    return res


def declared_fast_exp(declared, dtype: str) -> float:
    """``error_model``'s ``fast_exp``: the fast exp's largest relative error where the kernel
    declares ``fwd_fast_exp`` and the inputs are below fp32 (where the family's members
    for it apply), else 0."""
    from flashcheck.reference.online import FAST_EXP_REL

    return FAST_EXP_REL if ("fwd_fast_exp" in declared
                            and dtype in ("float16", "bfloat16")) else 0.0


def _family(inputs: Inputs, ref: dict, backward: bool, *, tf32: bool,
            strict_subnormals: bool, declared=(), only: tuple[str, ...] | None = None
            ) -> tuple[dict, dict, dict, dict, list]:
    """Every applicable member of the family of correct implementation choices
    (``reference.family``) on the same inputs.

    Returns, per tensor: (worst max abs error, worst RMSE) over the members, the members
    that set them, the baseline member's error tensor (for :func:`effective_samples`), the
    flush-to-zero allowance, where a member overflows (below), the per-element spread
    there, and the device buffers to poison. A member whose result is ±inf where the exact
    value is finite rounded a value near the dtype's largest finite number past the overflow
    threshold: a correct kernel can do the same, so that inf is accepted from the kernel too.
    A member whose result is NaN there made an intermediate overflow, which its choice makes
    in any kernel that makes it (fp16 GQA dK per query head beyond 65504 with opposite signs
    in one group: FlashAttention-2's dk_expanded sums +inf and -inf where the exact dK is
    3538), so a NaN is accepted from the kernel there too, and named in its report
    (``overflow``: per tensor (the members' ±inf there, 0 elsewhere; per member that is
    NaN somewhere, where it is)). Every element where
    some member is not finite is left out of the members' tensor-wide error statistics: a
    non-finite error there would make the whole tensor's tolerance inf or NaN. The members
    that stay finite there are still correct answers: ``spread`` holds, per tensor, the
    largest of their errors at each such element (0 elsewhere) and where those elements
    are, so that a kernel's value there is judged by them, element by element (fp16 dq
    where the exact value is -115843: the defaults give -inf, the q_prescaled member
    -62752, a kernel that prescales Q the same). The
    flush-to-zero member is not part of the tensor-wide worst: where it flushes, its error
    is the size of the flushed values themselves (up to 1e6x the other members' on tiny
    inputs), which would excuse anything anywhere. It counts per element instead, on the
    elements its flushing changed (:data:`FTZ_MEMBER`; ``(allowance, touched)`` per
    tensor, or nothing when ``strict_subnormals``)."""
    from flashcheck.reference.family import family_members, run_family

    q = inputs.query
    members = family_members(q.dtype, gqa=q.shape[1] != inputs.key.shape[1], tf32=tf32,
                             declared=declared)
    if strict_subnormals:
        members.pop(FTZ_MEMBER, None)
    if only is not None:
        members = {m: kw for m, kw in members.items() if m in only}
    kw = _sdpa_kwargs(inputs)
    mask = kw.pop("attn_mask")
    res = run_family(q, inputs.key, inputs.value, inputs.grad_out if backward else None, mask,
                     members=members, **kw)
    names = [m for m in res if m != FTZ_MEMBER]
    tensors = ["out", *GRADS] if backward else ["out"]
    stats, err_t, ftz, overflow, spread = [], {}, {}, {}, {}
    zero = torch.zeros((), dtype=torch.float64, device=q.device)
    for n in tensors:
        finite_ref = torch.isfinite(ref[n])
        lost = None  # where some member is non-finite and the exact value is not
        for m in res:
            bad = ~torch.isfinite(res[m][n]) & finite_ref
            if bool(bad.any()):
                lost = bad if lost is None else lost | bad
                ovf = torch.isinf(res[m][n]) & finite_ref
                infs, nan_at = overflow.get(n, (zero, {}))
                infs = torch.where(ovf, res[m][n].to(torch.float64), infs)
                nan = bad & ~ovf  # not finite and not inf
                if bool(nan.any()):
                    nan_at = {**nan_at, m: nan}
                overflow[n] = (infs, nan_at)
        allow = None
        for m in names:
            e = abs_error(res[m][n], ref[n])  # stays on the device
            if lost is not None:
                # A member finite where another is not: its error there is its own
                # element's allowance (the spread of the members that stayed finite), not
                # part of the tensor-wide worst (one element beyond the dtype's range would
                # set every element's tolerance).
                fin = lost & torch.isfinite(res[m][n])
                mine = torch.where(fin, e, zero)
                allow = mine if allow is None else torch.maximum(allow, mine)
                e = torch.where(lost, zero, e)
            if m == BASELINE_MEMBER:
                err_t[n] = e
            stats += [e.max(), torch.sqrt((e ** 2).mean())] if e.numel() else [
                torch.zeros((), dtype=torch.float64, device=e.device)] * 2
        if FTZ_MEMBER in res and BASELINE_MEMBER in res:
            # Per row (the last dim: a query row of out/dq, a key row of dk/dv), the largest
            # error of the member where its flushing changed the result, on every element of
            # a row it changed. Which P_ij / dS_ij of row i fall under the threshold depends
            # on rounding near it, and each dropped term reaches every d of the row through
            # V_j, K_j or Q_i: another correct flushing kernel has errors of the same scale in
            # that row, on other elements (the flush_to_zero control: up to 12x the member
            # elementwise, 1.02x its row maximum, fp16 dO = normal(0.001)).
            touched = res[FTZ_MEMBER][n] != res[BASELINE_MEMBER][n]
            e = torch.where(touched, abs_error(res[FTZ_MEMBER][n], ref[n]),
                            torch.zeros((), dtype=torch.float64, device=q.device))
            if e.dim():
                e, touched = (e.amax(-1, keepdim=True).expand_as(e),
                              touched.any(-1, keepdim=True).expand_as(touched))
            ftz[n] = (e, touched)
        if lost is not None and allow is not None:
            spread[n] = (allow, lost)
    flat = torch.stack(stats).tolist() if stats else []  # one transfer: each float() syncs
    errs, who = {}, {}
    for i, n in enumerate(tensors):
        row = flat[i * 2 * len(names):(i + 1) * 2 * len(names)]
        mx, rm = row[0::2], row[1::2]
        j, k = max(range(len(names)), key=mx.__getitem__), max(range(len(names)),
                                                                 key=rm.__getitem__)
        errs[n], who[n] = (mx[j], rm[k]), (names[j], names[k])
    scratch = [t for r in res.values() for t in r.values()]
    return errs, who, err_t, ftz, overflow, spread, scratch


def _check_output(name: str, t, like: torch.Tensor, want_shape) -> str | None:
    if not isinstance(t, torch.Tensor):
        return f"{name} is {type(t).__name__}, not a tensor"
    if tuple(t.shape) != tuple(want_shape):
        return f"{name} has shape {tuple(t.shape)}, expected {tuple(want_shape)}"
    if t.dtype != like.dtype:
        return f"{name} has dtype {t.dtype}, expected the input dtype {like.dtype}"
    if t.device != like.device:
        return f"{name} is on {t.device}, expected {like.device}"
    return None


def _report(name: str, got: torch.Tensor, want: torch.Tensor, tol: torch.Tensor,
            apriori: torch.Tensor, baseline: tuple[float, float] | None, rmse_tol: float,
            out_dtype, n_eff: float = math.nan,
            members: tuple[str, str] = ("", ""),
            flushed: torch.Tensor | None = None,
            overflow: tuple | None = None, flush_ok: bool = False,
            spread: torch.Tensor | None = None) -> TensorReport:
    """``flushed``: the elements the flush-to-zero member changed; they are judged by its
    per-element allowance (in ``tol``) and left out of the RMSE rule. ``overflow``
    (``_family``): ±inf where a family member overflowed, 0 elsewhere, the same inf from the
    kernel accepted there; where a member's intermediate overflowed into NaN (per member,
    where), a NaN from the kernel accepted there, and the members NaN at those elements
    named in the note. ``flush_ok``
    (the default subnormal policy): a 0 where the exact value is within the element's
    tolerance of the output dtype's subnormal range is a flushed result that a correct
    kernel could have computed as a subnormal; it counts as exact and, like the flushed
    elements, is left out of the RMSE. ``spread``: the elements
    judged by the members that stayed finite where another overflowed (in ``tol`` and
    ``flushed`` too)."""
    # An exact value beyond the output dtype's range rounds to +-inf under IEEE: that inf is
    # the correctly rounded answer, not a non-finite failure. A finite value there is judged
    # against the exact one, by the tolerance: a correct kernel's rounding can keep it just
    # inside the range (the q_prescaled member: dq 63392 where the exact value is 75715 and
    # every other member overflows; fp16, logits normal(30), dO normal(100)).
    # Likewise an inf of the exact value's sign where the exact value lies within its
    # tolerance of the overflow threshold (the largest finite value plus half its spacing,
    # above which round-to-nearest gives inf): some value inside the tolerance rounds to
    # that inf (sdpa-efficient on the H200: fp16 dk inf where the exact value is 65512.3
    # and the tolerance 432; every value from 65520 up rounds to inf).
    od = getattr(torch, out_dtype) if isinstance(out_dtype, str) else out_dtype
    rounded = want.to(od)
    g64 = got.to(want.device, torch.float64)
    over = torch.isinf(rounded) & torch.isfinite(want) & (g64 == rounded.to(want.dtype))
    near = want.abs() + tol.to(want.device) >= overflow_threshold(od)
    over = over | (torch.isinf(g64) & torch.isfinite(want) & near
                   & (torch.sign(g64) == torch.sign(want)))
    want = torch.where(over, g64, want)  # the kernel's inf, or its equal correct rounding
    member_nan = None
    if overflow is not None:
        infs, nan_at = overflow
        ovf = infs.to(want.device)
        same = torch.isinf(ovf) & (g64 == ovf)
        want = torch.where(same, ovf, want)
        if nan_at:
            nan_at = {m: at.to(want.device) for m, at in nan_at.items()}
            member_nan = torch.stack(list(nan_at.values())).any(0) & torch.isnan(g64)
            want = torch.where(member_nan, g64, want)  # NaN == NaN: no error there
            # the members NaN where the kernel's accepted NaNs are, not anywhere in the tensor
            who_nan = [m for m, at in nan_at.items() if bool((at & member_nan).any())]
    if flush_ok and od in _MIN_NORMAL:
        g = got.to(want.device)
        zero = (g == 0) & (want.abs() < _MIN_NORMAL[od] + tol.to(want.device))
        if bool(zero.any()):
            want = torch.where(zero, torch.zeros_like(want), want)
            flushed = zero if flushed is None else (flushed.to(zero.device) | zero)
    err = abs_error(got.to(want.device), want)
    met = tensor_metrics(got, want, dtype=out_dtype, err=err)
    with torch.no_grad():
        ratio_e = torch.where(err > 0, err / tol, torch.zeros_like(err))
        ratio_a = torch.where(err > 0, err / apriori, torch.zeros_like(err))
    if err.numel():  # one device-to-host transfer for the scalars (each is a sync on a GPU)
        flat_t = torch.argmax(ratio_e.flatten())
        n_bad, flat, ratio, ratio_ap, got_v, want_v, tol_v, apr_max = torch.stack([
            (ratio_e > 1).sum().to(torch.float64), flat_t.to(torch.float64), ratio_e.max(),
            ratio_a.max(),
            got.detach().flatten()[flat_t.to(got.device)].to(err.device, torch.float64),
            want.flatten()[flat_t],
            tol.flatten()[flat_t.to(tol.device)].to(err.device, torch.float64),
            apriori.max().to(err.device, torch.float64),
        ]).tolist()
        n_bad, flat = int(n_bad), int(flat)
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), err.shape))
    else:
        n_bad, flat, ratio, ratio_ap, got_v, want_v, tol_v, apr_max = 0, 0, 0.0, 0.0, 0.0, \
            0.0, 0.0, 0.0
        idx = ()
    rmse = met.rmse
    if flushed is not None and bool(flushed.any()):
        # The flushed elements' errors count as 0, over the same element count as the
        # members' RMSE (dropping them from the mean instead would inflate the kernel's).
        kept = torch.where(flushed.to(err.device), torch.zeros_like(err), err)
        rmse = float(torch.sqrt((kept * kept).mean()))
    ratio_rmse = rmse / rmse_tol if rmse_tol > 0 else (math.inf if rmse > 0 else 0.0)
    baseline_err, baseline_rmse = baseline if baseline is not None else (math.nan, math.nan)
    source = ""
    if idx:
        if spread is not None and bool(spread.flatten()[flat]):
            source = "spread"
        elif flushed is not None and bool(flushed.flatten()[flat]):
            source = "flush"
        elif name in K_RULE and tol_v > K_RULE[name] * baseline_err * (1 + 1e-6):
            source = "floor"
        elif name in K_RULE and math.isfinite(baseline_err):
            source = "family"
    note = ""
    if met.n_nonfinite:
        note = f"{met.n_nonfinite} NaN/Inf where the reference differs"
    if member_nan is not None and bool(member_nan.any()):
        note = "; ".join(filter(None, (note, (
            f"{int(member_nan.sum())} NaN accepted where {', '.join(who_nan)} "
            f"overflow{'s' if len(who_nan) == 1 else ''} in an intermediate"))))
    return TensorReport(
        name=name, max_abs=met.max_abs, max_rel=met.max_rel, rmse=met.rmse, bias=met.bias,
        max_ulps=met.max_ulps, worst_index=idx,
        got=got_v, want=want_v,
        n_bad=n_bad, numel=met.numel,
        tol=tol_v,
        baseline_err=baseline_err,
        apriori=apr_max,
        ratio=max(ratio, ratio_rmse), ratio_apriori=ratio_ap,
        passed=n_bad == 0 and ratio_rmse <= 1 and met.n_nonfinite == 0, note=note,
        rmse_tol=rmse_tol, baseline_rmse=baseline_rmse, ratio_rmse=ratio_rmse, n_eff=n_eff,
        member=members[0], rmse_member=members[1], tol_source=source,
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, for a bitwise comparison. A dense copy first: ``contiguous()``
    returns a tensor with size-1 dims as it is, whatever their strides (a (1, 1, 1, 1)
    transposed view keeps stride 2 in its last dim), and a dtype view needs stride 1 there."""
    return t.detach().clone(memory_format=torch.contiguous_format).view(torch.uint8)


# Smallest positive normal number per input dtype: a non-zero result below it is subnormal.
_MIN_NORMAL = {torch.float16: 2.0**-14, torch.bfloat16: 2.0**-126, torch.float32: 2.0**-126}


def _flushed_subnormals(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> int:
    """Elements whose exact value rounds to a non-zero subnormal of ``dtype`` and that the
    kernel returned as exactly 0: a flush-to-zero somewhere on the way (DESIGN §5)."""
    tiny = _MIN_NORMAL[dtype]
    w = want.to(dtype).to(torch.float64)
    sub = (w != 0) & (w.abs() < tiny)
    return int((sub & (got.to(sub.device) == 0)).sum())


def _dead_rows(allowed: torch.Tensor, bias) -> torch.Tensor:
    """(B|1, H|1, Nq) bool: query rows with no key allowed (every score masked or -inf)."""
    live = allowed if bias is None else allowed & (bias > -math.inf)
    return ~live.any(dim=-1)


def _masked_rows_nonzero(out: torch.Tensor, dead: torch.Tensor) -> str:
    """'' when every fully-masked query row of ``out`` is 0 (contracts.md §2), else the
    divergence: how many rows, and the worst one with its value."""
    dead = dead.to(out.device).expand(out.shape[:-1])
    if not bool(dead.any()):
        return ""
    mag = torch.where(dead[..., None], out.detach().to(torch.float64).abs().nan_to_num(math.inf),
                      torch.zeros((), dtype=torch.float64, device=out.device))
    row_mag = mag.amax(dim=-1)
    n_bad = int((row_mag > 0).sum())
    if not n_bad:
        return ""
    flat = int(torch.argmax(mag.flatten()))
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), mag.shape))
    return (f"output non-zero on {n_bad} of {int(dead.sum())} fully-masked query rows "
            f"(contract: 0; worst at {list(idx)}: got {float(out.flatten()[flat]):.4g})")


def _to_device_inputs(inputs: Inputs, device: str) -> Inputs:
    moved = {n: (t.to(device) if t is not None else None)
             for n, t in ((n, getattr(inputs, n)) for n in
                          ("query", "key", "value", "attn_mask", "grad_out"))}
    return dataclasses.replace(inputs, **moved)


# ------------------------------------------------------------------------------------------
# the check


def oracle_device(case, device: str, oracle: str | None = None) -> str:
    """The device that judges ``case`` for a kernel on ``device``: ``oracle`` "device" (the
    kernel's), or "auto" (default; the environment's FLASHCHECK_ORACLE_DEVICE, set by the
    CLI's --oracle-device, where ``oracle`` is None): the CPU for a generated case of at most
    ORACLE_CPU_MAX_WORK = B*Hq*Nq*Nk*D on a GPU kernel (see the constant), else the
    kernel's device. A captured (tensor) case is judged on the kernel's device."""
    if oracle is None:
        oracle = os.environ.get(ORACLE_ENV) or "auto"
    if oracle not in ORACLE_DEVICES:
        raise ValueError(f"oracle device must be one of {', '.join(ORACLE_DEVICES)} "
                         f"(--oracle-device / {ORACLE_ENV}), got {oracle!r}")
    if oracle == "device" or torch.device(device).type == "cpu" or not isinstance(case, Case):
        return device
    work = case.B * case.Hq * case.Nq * case.Nk * case.D
    return "cpu" if work <= ORACLE_CPU_MAX_WORK else device


def release_cache(device: str, keep: int = KEEP_CACHED_BYTES) -> bool:
    """Give PyTorch's cached, unused GPU memory on ``device`` back to the driver when it
    exceeds ``keep`` bytes (KEEP_CACHED_BYTES); True when it did. Nothing on the CPU."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return False
    if torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev) <= keep:
        return False
    torch.cuda.empty_cache()
    return True


def check_case(kernel: Kernel | object | str, case: Case, device: str, *, baseline: bool = True,
               inputs: Inputs | None = None, drawn: dict | None = None,
               strict_subnormals: bool = False, family: str = "lazy",
               oracle: str | None = None) -> Verdict:
    """Run ``kernel`` on ``case`` and judge it (module docstring). Out of GPU memory, in the
    judging or in the kernel, the whole check is run again after the cache is released and a
    pause (OOM_PAUSES_S, one run per pause): the processes of a campaign share the GPU, and a
    peer's case holds memory only for a while. The verdict then records each out-of-memory
    run in ``observations["oom_retried"]``. Out of memory on the last run: the kernel's is a
    ``raised`` failure, the judging's propagates (a supervised worker's ``harness_error``).
    ``inputs`` given: those
    (captured) tensors instead of ``case.materialize(device)``; ``drawn``: ``case.draw()``
    done beforehand (a sweep draws the next case while this one runs).
    ``strict_subnormals``: a subnormal result flushed to 0 is a failure
    (``subnormals_flushed``) instead of an observation, and the flush-to-zero member leaves
    the family of correct implementations.
    ``family``: "lazy" (default) judges the kernel against the baseline member first and
    runs the rest of the family only where that fails: every member's error is at least the
    baseline's, so a pass against the baseline is a pass against the family, and correct
    kernels cost one member instead of ~8. "full" always runs every member, so the report
    names the member that sets each tensor's tolerance on passing cases too.
    ``oracle``: where the reference, family, bounds and metrics run (:func:`oracle_device`);
    the kernel always runs on ``device``."""
    kw = dict(baseline=baseline, inputs=inputs, drawn=drawn, strict_subnormals=strict_subnormals,
              family=family, oracle=oracle)
    retried: list[str] = []
    for pause in (*OOM_PAUSES_S, None):
        try:
            verdict = _check_once(kernel, case, device, oom_raises=pause is not None, **kw)
        except torch.OutOfMemoryError as e:
            if pause is None:
                raise
            retried.append(describe_exception(e))
            release_cache(device, keep=0)
            time.sleep(pause)
            continue
        if retried:
            verdict.observations["oom_retried"] = retried
        return verdict
    raise AssertionError("unreachable: the last run returns or raises")


def _check_once(kernel, case: Case, device: str, *, baseline: bool, inputs: Inputs | None,
                drawn: dict | None, strict_subnormals: bool, family: str, oracle: str | None,
                oom_raises: bool) -> Verdict:
    """One run of :func:`check_case`; ``oom_raises``: the kernel's own out-of-memory error
    propagates (to be retried) instead of becoming a ``raised`` verdict."""
    if family not in ("lazy", "full"):
        raise ValueError(f"family must be 'lazy' or 'full', got {family!r}")
    t_start = time.perf_counter()
    k = as_kernel(kernel, device)
    verdict = Verdict(case=case, kernel=k.spec, device=device, status="not_run")
    ok, reason = k.supports(case, device)
    if not ok:
        verdict.reason = reason
        return verdict
    backward = case.backward
    if backward:
        has_bwd, why = k.supports_backward(case, device)
        if not has_bwd:
            backward = False
            verdict.not_run_tensors = {n: why for n in GRADS}
    clock = _Clock(device)

    # Drawn once; every consumer (reference, baseline, each kernel run) gets its own
    # layout-preserving copy, so nothing is shared with the kernel and the inputs are drawn
    # once instead of three times (drawing is CPU work, a large share of a small case).
    # The judging may run on the CPU (oracle_device): then the kernel gets the same drawn
    # tensors laid out on its own device.
    odev = device if inputs is not None else oracle_device(case, device, oracle)
    if inputs is not None:
        master = _to_device_inputs(inputs, device)
    elif drawn is not None or odev != device:
        drawn = case.draw() if drawn is None else drawn
        master = case.place(drawn, odev)
    else:  # a Case draws; a TensorCase loads its captured tensors
        master = case.materialize(device)
    kmaster = master if odev == device else case.place(drawn, device)
    if odev != device:
        verdict.observations["judged_on"] = odev  # the report says where the oracles ran
    fresh = master.clone
    inp = fresh()
    with clock("reference"):
        ref_dev = _reference(inp, backward)
    base_errs: dict[str, tuple[float, float]] = {}
    base_err_t: dict[str, torch.Tensor] = {}
    members: dict[str, tuple[str, str]] = {}
    ftz: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    overflow: dict[str, tuple] = {}
    spread: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    scratch: list = []
    # TF32 dot products: asked for by the case, or declared by the kernel (capabilities
    # tf32=True: its fp32 products always round their operands to TF32).
    tf32 = case.tf32 or (case.dtype == "float32" and k.declared.get("tf32") is True)
    fam_kw = dict(tf32=tf32, strict_subnormals=strict_subnormals,
                  declared=k.declared.get("family", ()))
    if baseline:
        with clock("baseline"):
            base_errs, members, base_err_t, ftz, overflow, spread, scratch = _family(
                inp, ref_dev, backward, **fam_kw,
                only=(BASELINE_MEMBER,) if family == "lazy" else None)
    with clock("bounds"):
        allowed, bias = _allowed_bias(inp)
        grad_out, scale = inp.grad_out if backward else None, float(inp.effective_scale)
        # The float64 operands and exact softmax, computed once for error_model and
        # ftz_allowance; several (B, Hq, Nq, Nk) float64 tensors, released once both ran.
        exact = exact_operands(inp.query, inp.key, inp.value, grad_out, allowed=allowed,
                               bias=bias, scale=scale)
        model = error_model(inp.query, inp.key, inp.value, grad_out, allowed=allowed,
                            bias=bias, scale=scale, dtype=case.dtype, tf32=tf32, exact=exact,
                            fast_exp=declared_fast_exp(fam_kw["declared"], case.dtype))
        flush = None if strict_subnormals else ftz_allowance(
            allowed, bias, (inp.query.shape[0], inp.query.shape[1], inp.query.shape[2],
                            inp.key.shape[2]), inp.key.shape[1], inp.query.dtype,
            operands=(inp.query, inp.key, inp.value, grad_out, scale), exact=exact)
        del exact
        # Copies stay on the device (metrics there are the bulk of a small case's time on
        # a GPU); the originals are poisoned below.
        ref = {n: t.to(torch.float64, copy=True) for n, t in ref_dev.items()}
        apr, n_eff, floors = {}, {}, {}
        for n in ref:
            apr[n] = model[n].apriori.clone()  # kept for the report; the original is poisoned
            floors[n] = (model[n].floor.clone(), model[n].floor_acc.clone(),
                         model[n].order_share)
            if n in base_err_t:
                n_eff[n] = effective_samples(base_err_t[n], model[n].n_sources)

        flushed: dict[str, torch.Tensor] = {}
        spread_at: dict[str, torch.Tensor] = {}

        def tolerances(errs: dict, ftz: dict, spread: dict) -> tuple[dict, dict]:
            """Tolerances, RMSE tolerances, and in ``flushed`` the elements in the
            flush-to-zero regime (changed by the ftz member, or where the flush allowance
            exceeds K x the members' error): judged elementwise, left out of the RMSE.
            Likewise, in ``spread_at``, the elements where a member overflows and another
            does not: K x the finite members' error there (``_family``'s spread)."""
            tols, rms_tols = {}, {}
            flushed.clear()
            spread_at.clear()
            for n in ref:
                base = errs.get(n)
                floor, floor_acc, share = floors[n]
                tols[n] = tolerance(n, floor, None if base is None else base[0], apr[n],
                                    ftz[n][0] if n in ftz else None)
                mask = ftz[n][1] if n in ftz else None
                if flush is not None and n in flush:
                    allow = flush[n].to(tols[n].device)
                    tols[n] = torch.maximum(tols[n], allow)
                    if base is not None and n in K_RULE:
                        beyond = (allow > K_RULE[n] * base[0]).expand(tols[n].shape)
                        mask = beyond if mask is None else mask | beyond
                if n in spread and n in K_RULE:
                    allow, at = spread[n]
                    tols[n] = torch.maximum(tols[n], K_RULE[n] * allow.to(tols[n].device))
                    spread_at[n] = at
                    mask = at if mask is None else mask | at
                if mask is not None:
                    flushed[n] = mask
                rms_tols[n] = rms_tolerance(n, floor_acc, None if base is None else base[1],
                                            apr[n], n_eff.get(n, math.inf), share)
            return tols, rms_tols

        tols, rms_tols = tolerances(base_errs, ftz, spread)
    _poison(*ref_dev.values(), *scratch, *(x for b in model.values()
                                           for x in (b.floor, b.apriori, b.floor_acc)))
    del ref_dev, scratch, model

    # The kernel, on fresh inputs (twice, for repeatability).
    run1, run2 = _leaves(kmaster.clone(), backward), _leaves(kmaster.clone(), backward)
    snapshot = run1.clone()
    verdict.timings = clock.t

    def fail(cls: str, why: str) -> Verdict:
        verdict.status, verdict.failure, verdict.reason = "fail", cls, why
        verdict.timings["total"] = time.perf_counter() - t_start
        return verdict

    outs = []
    for i, run in enumerate((run1, run2)):
        try:
            with clock("kernel_fwd" if i == 0 else "kernel_fwd_repeat"), torch.enable_grad():
                outs.append(k.call(run))
        except Exception as e:
            if oom_raises and isinstance(e, torch.OutOfMemoryError):
                raise
            if is_clear_rejection(e) and not k.declares_domain:
                # A probed (undeclared) domain: a clear rejection is "outside the domain".
                verdict.reason = describe_exception(e)
                verdict.timings["total"] = time.perf_counter() - t_start
                return verdict
            verdict.observations["exception"] = exception_info(e, kernel_source_root(k),
                                                               "forward")
            return fail("raised", f"forward raised: {describe_exception(e)}")
    (out, lse), (out2, _) = outs
    bad = _check_output("output", out, run1.query, run1.query.shape)
    if bad:
        return fail("bad_output", bad)
    mutated = _mutated(run1, snapshot)
    if mutated:
        return fail("input_mutated", f"forward changed {', '.join(mutated)}")
    alias = _aliases(out, run1)
    if alias:
        return fail("aliased_output", f"output shares memory with {', '.join(alias)}")
    nondet = "" if torch.equal(_bits(out), _bits(out2)) else (
        "two forward calls on identical inputs gave different bits")
    del out2, run2

    got = {"out": out.detach()}
    if lse is not None:
        got["lse"] = lse.detach()
    if backward:
        try:
            with clock("kernel_bwd"):
                grads = torch.autograd.grad(out, [run1.query, run1.key, run1.value],
                                            run1.grad_out, allow_unused=True)
        except Exception as e:
            if oom_raises and isinstance(e, torch.OutOfMemoryError):
                raise
            verdict.observations["exception"] = exception_info(e, kernel_source_root(k),
                                                               "backward")
            return fail("raised", f"backward raised: {describe_exception(e)}")
        for n, g, like in zip(GRADS, grads, (run1.query, run1.key, run1.value), strict=True):
            if g is None:
                return fail("bad_output", f"backward gave no gradient for {n}")
            bad = _check_output(n, g, like, like.shape)
            if bad:
                return fail("bad_output", bad)
            got[n] = g
        mutated = _mutated(run1, snapshot)
        if mutated:
            return fail("input_mutated", f"backward changed {', '.join(mutated)}")

    out_dtype = case.torch_dtype
    if "lse" in got and got["lse"].shape != ref["lse"].shape:
        if got["lse"].numel() != ref["lse"].numel():
            return fail("bad_output", f"lse has shape {tuple(got['lse'].shape)}, "
                                      f"expected {tuple(ref['lse'].shape)}")
        got["lse"] = got["lse"].reshape(ref["lse"].shape)

    def judge() -> None:
        for n in TENSORS:
            if n in got:
                verdict.tensors[n] = _report(
                    n, got[n], ref[n], tols[n], apr[n], base_errs.get(n), rms_tols[n],
                    got[n].dtype if n == "lse" else out_dtype, n_eff.get(n, math.nan),
                    members.get(n, ("", "")), flushed.get(n), overflow.get(n),
                    flush_ok=not strict_subnormals and n != "lse", spread=spread_at.get(n))

    judge()
    if baseline and family == "lazy" and any(not t.passed for t in verdict.tensors.values()):
        # Off against the baseline member (or an inf it does not share): the whole family
        # decides.
        with clock("family"):
            base_errs, members, _, ftz, overflow, spread, scratch = _family(
                fresh(), ref, backward, **fam_kw)
            del scratch
            tols, rms_tols = tolerances(base_errs, ftz, spread)
        judge()
    flushed = {n: k for n in verdict.tensors if n != "lse"
               for k in [_flushed_subnormals(got[n], ref[n], out_dtype)] if k}
    if flushed:
        verdict.observations["subnormals_flushed"] = flushed
    masked = _masked_rows_nonzero(got["out"], _dead_rows(allowed, bias))
    verdict.timings["total"] = time.perf_counter() - t_start
    bad_tensors = [t for t in verdict.tensors.values() if not t.passed]
    if masked:
        verdict.status, verdict.failure, verdict.reason = "fail", "masked_rows", masked
    elif any(t.note for t in bad_tensors):
        names = ", ".join(t.name for t in bad_tensors if t.note)
        verdict.status, verdict.failure = "fail", "nonfinite"
        verdict.reason = f"NaN/Inf where the reference is finite in {names}"
    elif nondet:
        verdict.status, verdict.failure, verdict.reason = "fail", "nondeterministic", nondet
    elif strict_subnormals and flushed:
        verdict.status, verdict.failure = "fail", "subnormals_flushed"
        verdict.reason = "flushes subnormal results to 0 (--strict-subnormals): " + ", ".join(
            f"{n} {k}" for n, k in flushed.items())
    elif bad_tensors:
        verdict.status, verdict.failure = "fail", "numerical"
        verdict.reason = "; ".join(t.message() for t in bad_tensors)
    else:
        verdict.status = "pass"
    return verdict


def check_nan_propagation(kernel, case: Case, device: str, *, target: str = "key",
                          index: tuple[int, int, int, int] = (0, 0, 0, 0)) -> dict:
    """Put a NaN at ``index`` of the query or key and compare the output rows that became
    NaN with the rows that should (those whose softmax touches that element, i.e. allowed by
    the structure and bool mask). An observation, never a failure."""
    if target not in ("key", "query"):
        raise ValueError(f"target must be 'key' or 'query', got {target!r}")
    k = as_kernel(kernel, device)
    ok, reason = k.supports(case, device)
    if not ok:
        return {"kind": "nan_propagation", "status": "not_run", "reason": reason}
    inp = case.materialize(device)
    t = getattr(inp, target)
    if len(index) != 4 or not all(0 <= i < s for i, s in zip(index, t.shape, strict=True)):
        raise ValueError(f"index must address {target} of shape {tuple(t.shape)}, got {index}")
    with torch.no_grad():
        t[index] = math.nan
    b, h, n, _ = index
    allowed, _ = _allowed_bias(inp)
    allowed = allowed.expand(case.B, case.Hq, case.Nq, case.Nk)
    expected = torch.zeros(case.B, case.Hq, case.Nq, dtype=torch.bool, device=allowed.device)
    if target == "query":
        expected[b, h, n] = bool(allowed[b, h, n].any())
    else:
        g = case.Hq // case.Hkv
        heads = slice(h * g, (h + 1) * g)
        expected[b, heads] = allowed[b, heads, :, n]
    try:
        with torch.no_grad():
            out, _ = k.call(inp)
    except Exception as e:
        return {"kind": "nan_propagation", "status": "raised", "reason": describe_exception(e)}
    nan_rows = torch.isnan(out).any(-1).cpu()
    expected = expected.cpu()

    def rows(mask):
        return [list(map(int, r)) for r in torch.nonzero(mask).tolist()]

    return {
        "kind": "nan_propagation", "status": "observed", "target": target,
        "index": list(index), "expected_rows": rows(expected), "nan_rows": rows(nan_rows),
        "missing": rows(expected & ~nan_rows), "extra": rows(nan_rows & ~expected),
        "match": bool(torch.equal(expected, nan_rows)),
    }

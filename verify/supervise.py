"""Supervised worker processes: the kernel runs in a child process, never in the caller.

Like libFuzzer's fork mode or pytest-xdist's worker restart, the parent (a campaign, a sweep,
``repro``) only hands cases out and collects verdicts; a worker resolves the kernel spec,
materialises each case, runs the kernel and judges it (:func:`verify.check.check_case`).
Workers are reused while healthy, so compiled Triton kernels stay warm, and replaced after a
crash, a timeout or a CUDA error that leaves the context unusable.

Protocol (one pipe per worker, pickled tuples; a case is the :class:`~verify.cases.Case` or
``TensorCase`` dataclass, a verdict travels as ``Verdict.to_dict()``):

- parent -> worker: ``("check", case, next_case)``, ``("caps", None)``, ``("api", None)``,
  ``("stop", None)``;
  ``next_case`` (or None) is drawn in a thread while ``case`` runs.
- worker -> parent: ``("ready", info)`` or ``("spec_error", message)`` once; then
  ``("verdict", verdict_dict, poisoned)``, ``("caps", dict)``, ``("api", name)`` or
  ``("harness_error", text,
  exception_info)`` (the case becomes a ``harness_error`` failure; the worker is replaced).

What the parent makes of a worker that does not answer:

- ``crashed``: the worker died while the case ran (the signal or the exit status is named).
- ``timeout``: no verdict within the case timeout. The worker's Python stacks are dumped
  first (``faulthandler`` on SIGUSR1), then it is killed.
- ``cuda_error`` (decided in the worker): the kernel raised a CUDA error (illegal address,
  launch failure, device-side assert, ...) or one surfaced at the synchronize after the case.
  The worker exits, since its CUDA context is unusable, and the case is re-run in a fresh
  worker to confirm it. A crash in a worker that had run earlier cases is confirmed the same
  way.

For all three, the innermost frame in the kernel's own code comes from the worker's
``faulthandler`` dump (a fatal signal or the SIGUSR1 before a kill); with the class, the
exception type (or signal) and the message with numbers stripped it forms the root cause
(:func:`root_cause`) by which failures are deduplicated.

Several GPUs: with ``device="cuda"`` and more than one visible GPU, worker n runs on GPU
n mod count (``CUDA_VISIBLE_DEVICES`` set in the worker before its first CUDA call), so
``run``/``gate --jobs J`` spread over the GPUs of a node.

Write-ahead: with ``failures_dir`` set, each case is written as ``inflight/inflight-<id>.json``
(a case file whose verdict says ``in_flight``) before it is sent; a crash or a timeout turns
it into ``failures/<class>-<id>.json`` at once, a verdict removes it. A parent killed while a
case runs leaves the in-flight file behind, and the next campaign in the same directory
re-checks it first.

Processes come from the ``forkserver`` start method: a server process, started clean (exec,
as with ``spawn``), imports torch, Triton and the harness once; never the kernel, and never
CUDA, so no CUDA context is ever forked. A worker is then a fork of that server (measured on
the CPU: 12 ms from start to ready for sdpa-math, against 1.8 s for a new interpreter that
imports torch and the harness), which is what makes "every shrink candidate of a crash in a
fresh worker" affordable. ``spawn`` is used where forkserver does not exist.

Caveat: a worker that hangs inside a C call holding no Python frame of the kernel dumps only
the harness's frames; its root cause then has the frame ``?``.
"""

from __future__ import annotations

import multiprocessing
import os
import platform
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait as _wait_conns
from pathlib import Path
from typing import Any

# Failure classes decided by the supervisor (a worker that did not answer, or one whose
# harness raised: ``harness_error``) or the worker (a CUDA error). Written at once; shrinking
# one of them runs every candidate in a fresh worker.
CRASH_CLASSES = ("crashed", "timeout", "cuda_error", "harness_error")
# Classes deduplicated by root cause (class, exception type, message without numbers,
# innermost kernel frame) instead of by (class, worst tensor, configuration).
ROOT_CAUSE_CLASSES = ("raised", *CRASH_CLASSES)

# Default case timeout = BASE_TIMEOUT_S + TIMEOUT_MEDIAN_FACTOR x the median case time. The
# base is what any case may take on top of the typical one: on a GPU, a case that meets new
# variants of our Triton kernel compiles up to four kernels (fwd, dkdv, dq, preprocess), and
# the slowest sm_90 variants compile in under 11 s each (docs/kernel.md, "Compiled
# variants", on a 2-core CPU), so under ~45 s; on the CPU, the slowest case of the sweep in
# the Triton interpreter took 8.3 s (below). A minute keeps those from reading as hangs and
# still catches a hang in about a minute.
BASE_TIMEOUT_S = 60.0
# Measured on the CPU sweep (fixed_sweep("cpu"), a worker's first case left out): sdpa-math
# median 0.029 s, slowest 0.155 s (5.3x); our Triton kernel in the interpreter median 1.05 s,
# slowest 8.3 s (7.9x). 20x the median is over twice the largest spread seen.
TIMEOUT_MEDIAN_FACTOR = 20.0
# Case times kept for the median: a few hundred cases follow a shift in the draw (a long
# campaign climbs toward larger N) without remembering the start forever.
TIMING_WINDOW = 256
# Starting a worker (fork, set up, import the kernel module; a Triton kernel module on a cold
# disk takes several seconds) gets this long before it counts as a failure to start.
START_TIMEOUT_S = 300.0
# After SIGUSR1 a hung worker gets this long to write its stacks before SIGKILL; faulthandler
# writes from the signal handler, a few ms in practice.
DUMP_GRACE_S = 1.0
# How often a waiting parent looks at its workers even when no pipe is readable (a worker
# killed from outside whose pipe end stays open in a grandchild). Short enough for the
# timeouts' resolution, long enough to cost nothing.
POLL_S = 0.5
# How often a worker checks that the campaign process still exists (_watch_parent): a worker
# left behind by a killed campaign goes within a second, at the cost of one kill(pid, 0).
PARENT_POLL_S = 1.0

# Substrings (lower case) of a CUDA error that leaves the context unusable. From the CUDA
# runtime's error strings (cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorAssert,
# cudaErrorMisalignedAddress, cudaErrorIllegalInstruction, ...) as torch and Triton raise them.
CUDA_ERROR_MARKERS = (
    "illegal memory access", "an illegal address", "illegal address",
    "unspecified launch failure", "launch failure", "device-side assert",
    "misaligned address", "illegal instruction", "cuda error", "cuda_error_",
    "hardware stack error", "uncorrectable ecc",
)


# The verdict of a write-ahead file (``inflight/inflight-<id>.json``).
INFLIGHT_VERDICT = {"status": "in_flight", "failure": None,
                    "reason": "written before the case ran; a file left here means the "
                              "campaign stopped while it ran"}


class SupervisorError(RuntimeError):
    """A worker could not be started, or the harness itself raised inside one (a bug in the
    harness, not a kernel failure). The CLI prints it as one line and exits 2."""


class ProbeCrashed(SupervisorError):
    """The kernel crashed or hung on the tiny inputs that probe its capabilities: a failure
    of the kernel (``fuzz`` records it and exits 1), not a usage error."""


@dataclass
class _Worker:
    proc: Any
    conn: Any
    dump: str
    started: float
    state: str = "starting"  # "starting", "idle", "busy", "dead"
    info: dict = field(default_factory=dict)
    cases: int = 0  # cases finished in this worker
    slot_case: int | None = None  # index (in the current batch) of the running case
    t0: float = 0.0
    limit: float = 0.0
    inflight: Path | None = None

    def exit_text(self) -> str:
        self.proc.join(2.0)
        code = self.proc.exitcode
        if code is None:
            return "the worker stopped answering (still running)"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"killed by {name} (signal {-code})"
        return f"exited with status {code}"

    def signal_name(self) -> str:
        code = self.proc.exitcode
        if code is not None and code < 0:
            try:
                return signal.Signals(-code).name
            except ValueError:
                return f"signal {-code}"
        return f"exit {code}"


# ------------------------------------------------------------------------------------------
# the worker side


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when its parent goes (a killed campaign leaves no orphan
    spinning in a hung kernel)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except Exception:
        pass


def _watch_parent(pid: int) -> None:
    """Exit when the campaign process is gone. A worker is forked from the forkserver, not
    from the campaign, so PDEATHSIG fires only when the server goes, and the server stays up
    while any worker holds its liveness pipe: without this a worker stuck in a hung kernel
    would outlive a killed campaign, and keep the server alive too."""
    while True:
        time.sleep(PARENT_POLL_S)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(70)
        except PermissionError:
            pass


def watch_parent(pid: int) -> None:
    """Start the daemon thread of :func:`_watch_parent` in this process."""
    import threading

    threading.Thread(target=_watch_parent, args=(pid,), daemon=True,
                     name="watch-parent").start()


def _is_cuda_error(text: str) -> bool:
    low = text.lower()
    return any(m in low for m in CUDA_ERROR_MARKERS)


def visible_gpus(device: str) -> list[str] | None:
    """The GPUs to spread workers over: the ids visible to this process when ``device`` is
    "cuda" (no index) and there are several, else None (every worker on the one device)."""
    import torch

    if device != "cuda":
        return None
    count = torch.cuda.device_count()
    if count <= 1:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x.strip() for x in visible.split(",") if x.strip()] if visible else []
    return ids[:count] if len(ids) >= count else [str(i) for i in range(count)]


def _worker_main(conn, spec: str, device: str, threads: int | None, dump_path: str,
                 parent_pid: int, strict_subnormals: bool = False,
                 gpu: str | None = None, family: str = "lazy",
                 env: dict[str, str] | None = None) -> None:
    # the parent's kernel settings (and a replay's from its case file) before the kernel is
    # imported: a module may read one at import (FLASHCHECK_GLUON_SCHEDULE)
    os.environ.update(env or {})
    if gpu is not None:
        # One GPU per worker, set before the first CUDA call of the process (the forkserver
        # imported torch but never initialised CUDA): the kernel sees it as cuda:0.
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    import concurrent.futures as cf
    import faulthandler
    import traceback

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what an interrupt does
    _die_with_parent()
    watch_parent(parent_pid)
    dump = open(dump_path, "w")  # noqa: SIM115 (open for the process's lifetime)
    faulthandler.enable(dump, all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, dump, all_threads=True)
    import torch

    if threads:
        # The cores are shared out: J workers with a full-width OpenMP pool each would
        # oversubscribe the machine and slow every CPU-side step by orders of magnitude.
        torch.set_num_threads(threads)
    from flashcheck.verify.adapters import describe_exception, kernel_source_root, resolve_kernel
    from flashcheck.verify.cases import Case
    from flashcheck.verify.check import check_case, release_cache

    try:
        kernel = resolve_kernel(spec, device)
    except Exception as e:
        conn.send(("spec_error", str(e).splitlines()[0] if str(e) else describe_exception(e)))
        return
    conn.send(("ready", {"pid": os.getpid(), "kernel_root": kernel_source_root(kernel)}))
    cuda = torch.device(device).type == "cuda"
    drawing = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="draw")
    # FLASHCHECK_WORKER_CPROFILE=PATH: profile the worker, written to PATH.<pid> when it is
    # told to stop (scripts/gpu/throughput.py --cprofile reads them).
    prof_path = os.environ.get("FLASHCHECK_WORKER_CPROFILE")
    prof = None
    if prof_path:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    pending: tuple[Any, Any] | None = None  # (case, future of case.draw())
    while True:
        try:
            op, payload, *rest = conn.recv()
        except (EOFError, OSError):
            return
        t_recv = time.perf_counter()
        if op == "stop":
            if prof is not None:
                prof.disable()
                prof.dump_stats(f"{prof_path}.{os.getpid()}")
            return
        case = None
        try:
            if op == "caps":
                caps = {k: v for k, v in kernel.capabilities.items() if not callable(v)}
                conn.send(("caps", caps))
                continue
            if op == "api":
                conn.send(("api", kernel.api))
                continue
            case, hint = payload, (rest[0] if rest else None)
            drawn = None
            if pending is not None and pending[0] == case:
                try:
                    drawn = pending[1].result()
                except Exception:
                    drawn = None  # the case's own draw raises the same error where it always did
            pending = None
            # type(), not isinstance: a TensorCase passes attribute reads through to its Case
            if hint is not None and type(hint) is Case:
                pending = (hint, drawing.submit(hint.draw))
            verdict = check_case(kernel, case, device, drawn=drawn,
                                 strict_subnormals=strict_subnormals, family=family)
            poisoned = False
            if verdict.failure == "raised" and _is_cuda_error(verdict.reason):
                verdict.failure, poisoned = "cuda_error", True
            elif cuda:
                try:
                    torch.cuda.synchronize()
                    # the GPU is shared with the campaign's other workers: a large case's
                    # freed blocks go back to the driver, not into this process's cache
                    release_cache(device)
                except Exception as e:  # a sticky error from an asynchronous launch
                    poisoned = True
                    verdict.status, verdict.failure = "fail", "cuda_error"
                    verdict.reason = f"CUDA error at the synchronize after the case: " \
                                     f"{describe_exception(e)}"
            # the worker's whole time on the case: check_case, the wait for the drawn inputs,
            # the synchronize, the verdict's dict (the parent adds the round trip)
            verdict.timings["worker"] = time.perf_counter() - t_recv
            d = verdict.to_dict()
            d.pop("case")  # the parent has it (a TensorCase's dict does not load as a Case)
            conn.send(("verdict", d, poisoned))
            if poisoned:
                return
        except Exception as e:
            if case is None or not _is_cuda_error(str(e)):
                # A case the harness could not judge (a bug of ours, or a kernel output it
                # cannot read): the parent keeps the case as a failure and replaces this
                # worker, whose state is unknown from here on.
                from flashcheck.verify.adapters import exception_info

                conn.send(("harness_error", traceback.format_exc(),
                           exception_info(e, kernel_source_root(kernel), "harness")))
                continue
            # An asynchronous CUDA error of the kernel surfacing in a later harness call: the
            # case fails with it and the context is unusable.
            from flashcheck.verify.adapters import exception_info
            from flashcheck.verify.check import Verdict

            verdict = Verdict(case=case, kernel=spec, device=device, status="fail",
                              failure="cuda_error",
                              reason=f"CUDA error after the kernel ran: {describe_exception(e)}")
            verdict.observations["exception"] = exception_info(e, kernel_source_root(kernel),
                                                               "harness")
            d = verdict.to_dict()
            d.pop("case")
            conn.send(("verdict", d, True))
            return


# ------------------------------------------------------------------------------------------
# the parent side

_CTX = None

# The Triton interpreter's tl.dot is numpy.matmul, i.e. OpenBLAS's sgemm, and OpenBLAS picks
# its kernel, and with it the order in which it sums K, by CPU model: on one host the gate's
# fp32 large_logits case had a dv error of 2.3e-03 under one core type and 8.6e-05 under
# another, from the same input bits. Workers start under one core type that every x86-64 CPU
# runs (SSE3), so a CPU run computes the same bits on any x86-64 host: the CPU gate's
# budgets and a case file's replay carry across machines. Other architectures keep
# OpenBLAS's choice (their budgets are keyed apart: verify/gate.py device_model).
CPU_ARITHMETIC_ENV = {"OPENBLAS_CORETYPE": "Prescott"}


def pins_cpu_arithmetic() -> bool:
    """Whether workers run under :data:`CPU_ARITHMETIC_ENV` (x86-64 hosts)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def _context():
    """The forkserver context, its server preloading torch, Triton and the harness (module
    docstring); spawn where there is no forkserver. Set up before the server starts, so it
    and every worker load OpenBLAS under :data:`CPU_ARITHMETIC_ENV`."""
    global _CTX
    if _CTX is None:
        if pins_cpu_arithmetic():
            os.environ.update(CPU_ARITHMETIC_ENV)
        if "forkserver" in multiprocessing.get_all_start_methods():
            _CTX = multiprocessing.get_context("forkserver")
            # Never the kernel, never anything that initialises CUDA: imports only.
            _CTX.set_forkserver_preload(["torch", "triton", "flashcheck.verify.check",
                                        "flashcheck.verify.supervise"])
        else:
            _CTX = multiprocessing.get_context("spawn")
    return _CTX


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def kernel_frame(dump: str, kernel_root: str | None) -> str:
    """The innermost frame of the kernel's own code in a faulthandler dump (which lists the
    most recent call first), as ``file.py:LINE in func``; ``?`` when there is none."""
    frames = [m.groupdict() for m in _FRAME.finditer(dump)]
    for f in frames:
        if kernel_root and os.path.abspath(f["file"]).startswith(kernel_root):
            return f"{os.path.basename(f['file'])}:{f['line']} in {f['func']}"
    return "?"


def _stack_text(dump: str, limit: int = 12) -> str:
    """The first thread's stack of a dump, at most ``limit`` frames, for the case file."""
    lines = dump.strip().splitlines()
    keep, frames = [], 0
    for ln in lines:
        keep.append(ln)
        if ln.strip().startswith("File "):
            frames += 1
            if frames >= limit:
                break
    return "\n".join(keep)


def _recv(w: _Worker):
    """The worker's next message, or None when its end of the pipe is gone (it died)."""
    try:
        return w.conn.recv()
    except (EOFError, OSError):
        return None


class Supervisor:
    """Runs cases in supervised worker processes (module docstring).

    ``case_timeout``: seconds per case, or None for the default derived from observed case
    times (:meth:`timeout`). ``failures_dir``: where crash/timeout failures are written at
    once (and ``<failures_dir>/../inflight`` holds the write-ahead files); None: neither.
    ``threads``: torch threads per worker (None: leave the default). ``family``: check_case's
    in every worker ("lazy" or "full"). Every worker sets this process's kernel settings
    (``report.kernel_settings``) and ``env`` over them (``repro``: those its case file
    records) before it loads the kernel; the in-flight case files record them.
    """

    def __init__(self, kernel_spec: str, device: str, *, case_timeout: float | None = None,
                 failures_dir: str | Path | None = None, threads: int | None = None,
                 strict_subnormals: bool = False, family: str = "lazy",
                 env: dict[str, str] | None = None) -> None:
        if case_timeout is not None and not case_timeout > 0:
            raise ValueError(f"--case-timeout must be a number > 0, got {case_timeout}")
        if family not in ("lazy", "full"):
            raise ValueError(f"family must be 'lazy' or 'full', got {family!r}")
        self.spec = kernel_spec
        self.device = device
        self.case_timeout = case_timeout
        self.failures_dir = None if failures_dir is None else Path(failures_dir)
        self.inflight_dir = None if failures_dir is None else Path(failures_dir).parent / \
            "inflight"
        self.threads = threads
        self.strict_subnormals = strict_subnormals  # check_case's, in every worker
        self.family = family
        from flashcheck.verify.report import kernel_settings

        # this process's kernel settings as they are now (not as the forkserver's environment
        # was when it started), under the ones given
        self.env = {**kernel_settings(), **(env or {})}
        self._tmp = tempfile.mkdtemp(prefix="flashcheck-workers-")
        self._n = 0
        self._slots: list[_Worker | None] = []
        self._spare: _Worker | None = None
        self._times: deque[float] = deque(maxlen=TIMING_WINDOW)
        self.kernel_root: str | None = None
        self._inflight_head: str | None = None
        self.started = 0  # workers started, for reports and tests
        # Several GPUs: worker n runs on GPU n mod count (round robin over the spawns).
        self.gpus = visible_gpus(device)

    # -- workers ---------------------------------------------------------------------------

    def _spawn(self) -> _Worker:
        ctx = _context()
        parent, child = ctx.Pipe()
        self._n += 1
        dump = os.path.join(self._tmp, f"worker-{self._n}.log")
        gpu = self.gpus[(self._n - 1) % len(self.gpus)] if self.gpus else None
        proc = ctx.Process(target=_worker_main, name=f"flashcheck-worker-{self._n}",
                           args=(child, self.spec, self.device, self.threads, dump,
                                 os.getpid(), self.strict_subnormals, gpu, self.family,
                                 self.env))
        proc.start()
        child.close()
        self.started += 1
        return _Worker(proc=proc, conn=parent, dump=dump, started=time.perf_counter())

    def _take_spare(self) -> _Worker:
        w = self._spare if self._spare is not None else self._spawn()
        self._spare = None
        return w

    def _on_ready(self, w: _Worker, msg: tuple) -> None:
        if msg[0] == "spec_error":
            self._retire(w)
            from flashcheck.verify.adapters import SpecError

            raise SpecError(msg[1])
        if msg[0] != "ready":
            self._retire(w)
            raise SupervisorError(f"worker sent {msg[0]!r} before 'ready'")
        w.info = msg[1]
        w.state = "idle"
        self.kernel_root = w.info.get("kernel_root")

    def _await_ready(self, w: _Worker) -> None:
        end = time.perf_counter() + START_TIMEOUT_S
        while w.state == "starting":
            left = end - time.perf_counter()
            if left <= 0:
                self._kill(w)
                raise SupervisorError(f"a worker for {self.spec!r} did not start within "
                                      f"{START_TIMEOUT_S:g} s")
            if w.conn.poll(min(left, POLL_S)):
                msg = _recv(w)
                if msg is None:
                    why = w.exit_text()
                    raise SupervisorError(f"the worker for {self.spec!r} died while starting "
                                          f"(importing the kernel): {why}{self._dump_tail(w)}")
                self._on_ready(w, msg)
            elif not w.proc.is_alive():
                raise SupervisorError(f"the worker for {self.spec!r} died while starting: "
                                      f"{w.exit_text()}{self._dump_tail(w)}")

    def _dump_tail(self, w: _Worker) -> str:
        text = self._read_dump(w)
        frame = kernel_frame(text, self.kernel_root)
        return f" (innermost kernel frame: {frame})" if frame != "?" else ""

    @staticmethod
    def _read_dump(w: _Worker) -> str:
        try:
            with open(w.dump, encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def _kill(self, w: _Worker) -> None:
        w.state = "dead"
        if w.proc.is_alive():
            w.proc.kill()
        w.proc.join(5.0)
        w.conn.close()
        try:
            os.unlink(w.dump)
        except OSError:
            pass

    def _retire(self, w: _Worker) -> None:
        """Stop a healthy worker (it exits when it reads "stop"; killed if it does not)."""
        if w.state in ("idle", "starting") and w.proc.is_alive():
            try:
                w.conn.send(("stop", None))
            except OSError:
                pass
            w.proc.join(1.0)
        self._kill(w)

    def close(self) -> None:
        for w in [*self._slots, self._spare]:
            if w is not None and w.state != "dead":
                self._retire(w)
        self._slots, self._spare = [], None
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _worker(self, slot: int, *, fresh: bool) -> _Worker:
        while len(self._slots) <= slot:
            self._slots.append(None)
        w = self._slots[slot]
        if w is not None and (w.state == "dead" or (fresh and w.cases > 0)):
            if w.state != "dead":
                self._retire(w)
            w = None
        if w is None:
            w = self._take_spare()
            self._slots[slot] = w
        return w

    def start(self) -> None:
        """Start the first worker and wait until it has resolved the kernel (a bad spec
        raises SpecError here)."""
        self._await_ready(self._worker(0, fresh=False))

    def capabilities(self) -> dict:
        """The kernel's capabilities, probed inside a worker (callables left out)."""
        return self._ask("caps", "its capabilities were probed")

    def api(self) -> str:
        """The plug-in API the kernel declares (no probing)."""
        return self._ask("api", "its API was read")

    def _ask(self, op: str, what: str):
        """One request to the first worker that is not a case."""
        w = self._worker(0, fresh=False)
        self._await_ready(w)
        w.conn.send((op, None))
        end = time.perf_counter() + self.timeout()
        while True:
            if w.conn.poll(POLL_S):
                msg = _recv(w)
                if msg is None:
                    why = w.exit_text()
                    self._kill(w)
                    raise ProbeCrashed(f"the kernel {self.spec!r} took its worker down while "
                                       f"{what}: {why}")
                if msg[0] == "harness_error":
                    raise SupervisorError(f"probing {self.spec!r} failed: {msg[1].strip()}")
                return msg[1]
            if not w.proc.is_alive() or time.perf_counter() > end:
                why = w.exit_text() if not w.proc.is_alive() else \
                    f"no answer within {self.timeout():g} s"
                self._kill(w)
                raise ProbeCrashed(f"the kernel {self.spec!r} took its worker down while "
                                   f"{what}: {why}")

    # -- timeouts --------------------------------------------------------------------------

    def timeout(self) -> float:
        """The case timeout: ``case_timeout`` when given, else BASE_TIMEOUT_S +
        TIMEOUT_MEDIAN_FACTOR x the median case time. A worker's first case carries the
        compile and import warm-up and is left out of the median (compile time counts once)."""
        if self.case_timeout is not None:
            return self.case_timeout
        med = statistics.median(self._times) if self._times else 0.0
        return BASE_TIMEOUT_S + TIMEOUT_MEDIAN_FACTOR * med

    # -- write-ahead -----------------------------------------------------------------------

    def _write_ahead(self, case: Any) -> Path | None:
        if self.inflight_dir is None:
            return None
        import hashlib
        import json

        from flashcheck.verify.cases import CASE_FILE_FORMAT, CASE_VERSION

        # The case file of save_case_file, written directly: this runs before every case,
        # and the case's JSON serves both the name (as in failure_id) and the content.
        plain = getattr(case, "case", case)  # a TensorCase: its Case (tensors stay where
        payload = plain.to_json(sort_keys=True)  # they are; the in-flight file names them)
        digest = hashlib.sha1((case.to_json(sort_keys=True) if plain is case else
                               repr(case.to_dict())).encode()).hexdigest()[:10]
        if self._inflight_head is None:
            self.inflight_dir.mkdir(parents=True, exist_ok=True)
            self._inflight_head = (
                f'{{"format": {json.dumps(CASE_FILE_FORMAT)}, "version": {CASE_VERSION}, '
                f'"kernel": {json.dumps(self.spec)}, "device": {json.dumps(self.device)}, '
                f'"verdict": {json.dumps(INFLIGHT_VERDICT)}, '
                f'"settings": {json.dumps(self.env)}, "case": ')
        path = self.inflight_dir / f"inflight-{digest}.json"
        with open(path, "w", encoding="utf-8") as f:
            f.write(self._inflight_head + payload + "}\n")
        return path

    @staticmethod
    def _unlink(path: Path | None) -> None:
        if path is not None:
            try:
                path.unlink()
            except OSError:
                pass

    # -- running cases ---------------------------------------------------------------------

    def check(self, case: Any, *, fresh: bool = False, confirm: bool = True) -> Any:
        """One case in one worker (a fresh one when ``fresh``); returns its Verdict."""
        out: dict[int, Any] = {}
        self.run([case], fresh=fresh, confirm=confirm, results=out)
        return out[0]

    def run(self, cases: list[Any], *, jobs: int = 1, fresh: bool = False,
            confirm: bool = True, results: dict[int, Any] | None = None,
            stop: Callable[[], str | None] | None = None,
            on_result: Callable[[int, Any], None] | None = None) -> dict[int, Any]:
        """Check ``cases`` in ``jobs`` workers; fills and returns ``results`` (index ->
        Verdict). ``fresh``: every case in a worker that ran nothing before. ``stop()``
        returning a reason ends the hand-out (running cases finish). ``on_result(i, v)`` is
        called as results arrive. A KeyboardInterrupt kills the running workers and
        propagates, with ``results`` holding what finished."""
        results = {} if results is None else results
        queue = deque(range(len(cases)))
        busy: dict[int, _Worker] = {}  # slot -> worker running a case
        confirm_idx: list[int] = []
        try:
            while queue or busy:
                if stop is not None and queue and stop() is not None:
                    queue.clear()
                for slot in range(jobs):
                    if not queue or slot in busy:
                        continue
                    w = self._worker(slot, fresh=fresh)
                    if w.state == "starting":
                        self._await_ready(w)
                    i = queue.popleft()
                    hint = cases[queue[0]] if (jobs == 1 and queue and not fresh) else None
                    w.inflight = self._write_ahead(cases[i])
                    w.slot_case, w.t0, w.limit = i, time.perf_counter(), self.timeout()
                    w.state = "busy"
                    w.conn.send(("check", cases[i], hint))
                    busy[slot] = w
                if fresh and self._spare is None:
                    # Forks and starts while this case runs: the next fresh case (the next
                    # shrink candidate) finds it ready.
                    self._spare = self._spawn()
                if not busy:
                    continue
                now = time.perf_counter()
                wait_s = max(0.0, min(min(w.t0 + w.limit - now for w in busy.values()), POLL_S))
                ready = _wait_conns([w.conn for w in busy.values()], timeout=wait_s)
                for slot, w in list(busy.items()):
                    alive = w.proc.is_alive()
                    # A worker that exits right after its last message (a poisoned one) has
                    # the message in the pipe: read it before calling the exit a crash.
                    if w.conn in ready or (not alive and w.conn.poll(0)):
                        msg = _recv(w)
                    elif not alive:
                        msg = None
                    elif time.perf_counter() > w.t0 + w.limit:
                        msg = ("timeout",)
                    else:
                        continue
                    del busy[slot]
                    i = w.slot_case
                    verdict = self._judge(w, cases[i], msg)
                    if (confirm and verdict.failure in ("crashed", "cuda_error")
                            and w.cases > 0):
                        confirm_idx.append(i)
                    if w.state != "dead":
                        w.cases += 1
                    results[i] = verdict
                    if on_result is not None:
                        on_result(i, verdict)
        except KeyboardInterrupt:
            for w in busy.values():
                self._unlink(w.inflight)  # interrupted, not failed
                self._kill(w)
            raise
        if confirm_idx:
            self._confirm_all(cases, results, confirm_idx, jobs=jobs, stop=stop)
        return results

    def _confirm_all(self, cases, results, idx: list[int], *, jobs: int, stop) -> None:
        """Confirm crashes / CUDA errors in fresh workers: one re-run per root cause (its
        first case), ``jobs`` at a time; the other cases of a root cause get that re-run's
        answer. When ``stop()`` has a reason (a time budget spent), nothing is re-run and
        each verdict says so: the failures are kept either way."""
        groups: dict = {}
        for i in idx:
            groups.setdefault(root_cause(results[i]) or i, []).append(i)
        why = stop() if stop is not None else None
        if why is not None:
            for i in idx:
                v = results[i]
                v.observations["confirmed"] = {"reproduced": None, "fresh_worker": "not run"}
                v.reason += f"; not re-run in a fresh worker ({why})"
                self._rewrite(cases[i], v)
            return
        heads = [members[0] for members in groups.values()]
        again = self.run([cases[i] for i in heads], jobs=jobs, fresh=True, confirm=False)
        for k, members in enumerate(groups.values()):
            for i in members:
                self._annotate(cases[i], results[i], again[k],
                               None if i == members[0] else cases[members[0]])

    def _judge(self, w: _Worker, case: Any, msg: tuple | None) -> Any:
        from flashcheck.verify.check import Verdict

        elapsed = time.perf_counter() - w.t0
        if msg is not None and msg[0] == "verdict":
            plain = getattr(case, "case", case)  # a TensorCase describes itself by its Case
            verdict = Verdict.from_dict({**msg[1], "case": plain.to_dict()})
            verdict.case = case
            verdict.timings["roundtrip"] = elapsed  # from the send to the verdict's arrival
            if w.cases > 0 and verdict.status != "not_run":
                self._times.append(elapsed)
            if msg[2]:  # poisoned: the worker exits by itself
                w.state = "dead"
                self._kill(w)
            else:
                w.state = "idle"
            self._unlink(w.inflight)
            if verdict.failure in CRASH_CLASSES:
                self._write_now(case, verdict)
            return verdict
        verdict = Verdict(case=case, kernel=self.spec, device=self.device, status="fail")
        if msg is not None and msg[0] == "harness_error":
            # Kept like a crash: the case file is the failure, never a lost case.
            exc = msg[2] if len(msg) > 2 else {"type": "?", "message": "", "frame": "?",
                                               "where": "harness"}
            verdict.failure = "harness_error"
            verdict.reason = (f"the harness could not judge the case: {exc['type']}: "
                              f"{exc['message']} (at {exc['frame']}); a flashcheck bug, or a "
                              f"kernel output it cannot read")
            verdict.timings = {"total": elapsed}
            verdict.observations["exception"] = exc
            verdict.observations["traceback"] = msg[1].strip()
            self._kill(w)
            self._write_now(case, verdict)
            self._unlink(w.inflight)
            return verdict
        if msg is None:
            why = w.exit_text()
            sig = w.signal_name()
            dump = self._read_dump(w)
            verdict.failure = "crashed"
            verdict.reason = f"the worker process died while the case ran: {why}"
            exc_type = sig
        else:
            limit = w.limit
            dump = self._dump_stacks(w)
            verdict.failure = "timeout"
            verdict.reason = f"no verdict within the case timeout of {limit:.3g} s"
            exc_type = "timeout"
        frame = kernel_frame(dump, self.kernel_root)
        if frame != "?":
            verdict.reason += f"; innermost kernel frame: {frame}"
        verdict.timings = {"total": elapsed}
        verdict.observations["exception"] = {"type": exc_type, "message": "", "frame": frame,
                                             "where": "worker"}
        if dump.strip():
            verdict.observations["stack"] = _stack_text(dump)
        self._kill(w)
        self._write_now(case, verdict)
        self._unlink(w.inflight)
        return verdict

    def _dump_stacks(self, w: _Worker) -> str:
        """SIGUSR1 (faulthandler dumps every thread's stack), then wait for the text."""
        if hasattr(signal, "SIGUSR1") and w.proc.is_alive():
            size0 = os.path.getsize(w.dump) if os.path.exists(w.dump) else 0
            try:
                os.kill(w.proc.pid, signal.SIGUSR1)
            except OSError:
                return self._read_dump(w)
            end = time.perf_counter() + DUMP_GRACE_S
            while time.perf_counter() < end:
                time.sleep(0.02)
                if os.path.exists(w.dump) and os.path.getsize(w.dump) > size0:
                    time.sleep(0.05)  # let the rest of the dump land
                    break
            return self._read_dump(w)[size0:] if size0 else self._read_dump(w)
        return self._read_dump(w)

    def _write_now(self, case: Any, verdict: Any) -> None:
        """The in-flight file becomes the failure: written before anything else happens."""
        if self.failures_dir is None:
            return
        from flashcheck.verify.sweep import write_failure

        write_failure(self.failures_dir, case, verdict, kernel_spec=self.spec,
                      device=self.device)

    def _rewrite(self, case: Any, verdict: Any) -> None:
        if verdict.case_file or self.failures_dir is not None:
            self._write_now(case, verdict)  # rewrite with the confirmation

    def _annotate(self, case: Any, verdict: Any, again: Any, via: Any = None) -> Any:
        """Record in ``verdict`` whether the fresh-worker re-run ``again`` reproduced it
        (``via``: the case of the same root cause that was re-run instead)."""
        same = again.failure == verdict.failure
        verdict.observations["confirmed"] = {
            "reproduced": same, "fresh_worker": f"{again.status}"
            + (f" ({again.failure})" if again.failure else "")}
        if via is not None:
            verdict.observations["confirmed"]["via"] = via.short()
        where = "in a fresh worker" + ("" if via is None else
                                       f" (same root cause, re-run as {via.short()})")
        verdict.reason += (f"; reproduced {where}" if same else
                           f"; NOT reproduced {where} ({again.status}"
                           + (f": {again.failure}" if again.failure else "")
                           + "): an earlier case in the same worker may have caused it")
        self._rewrite(case, verdict)
        return verdict

    def _confirm(self, case: Any, verdict: Any) -> Any:
        """Re-run a crash / CUDA error from a worker that had run earlier cases in a fresh
        worker; the verdict says whether it reproduced."""
        return self._annotate(case, verdict, self.check(case, fresh=True, confirm=False))


# ------------------------------------------------------------------------------------------
# root causes

_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_NUMBER_LISTS = re.compile(r"#(?:\s*[,x×]\s*#)+")


def normalise_message(text: str) -> str:
    """A message with numbers, shapes and addresses stripped: ``D=8 < 16 at 0x7f..`` and
    ``D=4 < 16 at 0x55..`` read the same."""
    text = _NUMBERS.sub("#", text)
    text = _NUMBER_LISTS.sub("#", text)
    return " ".join(text.split())


def root_cause(verdict: Any) -> tuple[str, str, str, str] | None:
    """(class, exception type or signal, normalised message, innermost kernel frame) for a
    raised / crashed / timeout / cuda_error failure; None for the other classes.

    ``verdict`` is a Verdict or its ``to_dict()``."""
    if isinstance(verdict, dict):
        failure, reason = verdict.get("failure"), verdict.get("reason") or ""
        obs = verdict.get("observations") or {}
    else:
        failure, reason, obs = verdict.failure, verdict.reason, verdict.observations
    if failure not in ROOT_CAUSE_CLASSES:
        return None
    exc = obs.get("exception") or {}
    if not exc:  # a verdict written before exceptions were recorded: the reason is all
        return (str(failure), "?", normalise_message(reason), "?")
    where = exc.get("where", "")
    return (str(failure), f"{where}:{exc.get('type', '?')}",
            normalise_message(exc.get("message", "")), exc.get("frame", "?"))

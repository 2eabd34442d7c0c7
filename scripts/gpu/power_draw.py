"""Forwards under sustained load: time per launch beside the GPU's SM clock and power.

    python3 scripts/gpu/power_draw.py --out FILE.json [--dtype float16 --d 64 --n 16384]
        [--causal] [--impls auto,off,cudnn] [--base TREE] [--seconds 3] [--phases 4]

On the H100 (power limit 700 W) the benchmark's forwards run under the software power cap:
nvidia-smi's clock-event reason 0x4 is active in nearly every timing after the first of a
process, and the SM clock the power controller settles on moves between rounds (1.26-1.98
GHz), with each timing's milliseconds following it (docs/benchmarks/sweep.md round 28). A
kernel that needs fewer cycles can then still read slower if it draws more power per cycle.
This script runs each implementation's forward back to back for ``--seconds`` (``--phases``
times, the order rotated each phase) while nvidia-smi logs the SM clock, the board power and
the clock-event reasons every 100 ms, and reports per implementation: milliseconds per
launch (wall clock over the phase), the mean SM clock and power of the phase's samples
(its first 0.3 s left out: the clock settles), the share of samples under the power cap,
the cycles per launch (ms x clock) and the energy per launch (ms x power).

Implementations: "auto", "tile", "persistent", "off" (our forward under that
``kernels._common.gluon`` mode; "off" is the Triton forward) and "cudnn" (SDPA's cuDNN backend).
``--base TREE`` adds "base": the forward of another checkout's kernels (e.g. the issue-time
tree, ``git archive 5db18f4 kernels flashcheck pyproject.toml``), under its own defaults. Its
``flashcheck`` package cannot share a process with this one, so it runs in a worker process
that compiles first and then times one phase per request; the phases still alternate on the
one GPU, beside the one nvidia-smi log. Inputs as the benchmark's (B*H*N = 2^20, H = 16,
``requires_grad``; the same seed in both processes).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

IMPLS = ("auto", "tile", "persistent", "off", "cudnn", "base")
# nvidia-smi's clocks_event_reasons bit for the software power cap (nvml
# nvmlClocksEventReasonSwPowerCap = 0x4)
SW_POWER_CAP = 0x4
SETTLE_S = 0.3  # a phase's first samples, left out: the clock moves to its level after a switch
QUERY = "timestamp,clocks.sm,power.draw,clocks_event_reasons.active"


# the columns parse_smi reads, by the names nvidia-smi's header gives them (a query's
# aliases print under their canonical names: clocks.sm as clocks.current.sm,
# clocks_throttle_reasons.active as clocks_event_reasons.active)
_COLUMNS = {"timestamp": "timestamp", "clocks.current.sm": "mhz", "power.draw": "watts",
            "clocks_event_reasons.active": "reasons"}


def parse_smi(text: str) -> list[tuple[float, float, float, int]]:
    """nvidia-smi ``--format=csv`` log -> (epoch s, SM MHz, W, clock-event reasons) per
    sample. The columns are found by the header's names (a log with more columns, e.g.
    the temperature, parses the same); without a header, QUERY's order. Lines that do not
    parse (a cut last line) are skipped."""
    where = dict(timestamp=0, mhz=1, watts=2, reasons=3)
    out = []
    for rec in csv.reader(io.StringIO(text)):
        names = [c.strip().split(" [")[0] for c in rec]
        if "timestamp" in names:
            where = {_COLUMNS[n]: i for i, n in enumerate(names) if n in _COLUMNS}
            continue
        try:
            t = datetime.datetime.strptime(rec[where["timestamp"]].strip(),
                                           "%Y/%m/%d %H:%M:%S.%f").timestamp()
            out.append((t, float(rec[where["mhz"]].split()[0]),
                        float(rec[where["watts"]].split()[0]),
                        int(rec[where["reasons"]].strip(), 16)))
        except (ValueError, IndexError, KeyError):
            continue
    return out


def join(phases: list[dict], samples: list[tuple[float, float, float, int]]) -> list[dict]:
    """Each phase (impl, start, end, launches) with its samples' mean clock and power, the
    share of them under the software power cap, ms, cycles and energy per launch. A phase
    with no sample after its settling time gets None for what samples give."""
    rows = []
    for ph in phases:
        ms = (ph["end"] - ph["start"]) * 1e3 / ph["launches"]
        win = [s for s in samples if ph["start"] + SETTLE_S <= s[0] <= ph["end"]]
        row = dict(ph, ms=ms, samples=len(win), mhz=None, watts=None, capped=None,
                   mcycles=None, mj=None)
        if win:
            mhz = statistics.fmean(s[1] for s in win)
            watts = statistics.fmean(s[2] for s in win)
            row.update(mhz=mhz, watts=watts,
                       capped=sum(bool(s[3] & SW_POWER_CAP) for s in win) / len(win),
                       mcycles=ms * mhz / 1e3, mj=ms * watts)
        rows.append(row)
    return rows


def summary(rows: list[dict]) -> dict:
    """Per implementation, the median over its phases of each measure."""
    out = {}
    for impl in dict.fromkeys(r["impl"] for r in rows):
        mine = [r for r in rows if r["impl"] == impl]
        out[impl] = {key: (statistics.median(v) if (v := [r[key] for r in mine
                                                          if r[key] is not None]) else None)
                     for key in ("ms", "mhz", "watts", "capped", "mcycles", "mj")}
    return out


def _impls(text: str) -> list[str]:
    got = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in got if s not in IMPLS]
    if not got or bad:
        raise argparse.ArgumentTypeError(f"--impls takes a comma list of {', '.join(IMPLS)}; "
                                         f"got {text!r}")
    return got


def _phase(run, sync, seconds: float) -> tuple[float, float, int]:
    """``run`` back to back, 8 launches between synchronisations, for ``seconds``:
    (start, end, launches), wall clock."""
    n, t0 = 0, time.time()
    while time.time() - t0 < seconds:
        for _ in range(8):
            run()
        n += 8
        sync()
    return t0, time.time(), n


def _warm(run, sync) -> None:
    """Three calls before the phases (compile, autotune, plan), then a synchronisation."""
    for _ in range(3):
        run()
    sync()


def _serve(run, sync, lines, out) -> None:
    """The worker's loop: each request line is a phase's seconds, each reply one JSON line
    {"start", "end", "launches"}; an empty line or the end of input stops it."""
    for line in lines:
        if not line.strip():
            return
        t0, t1, n = _phase(run, sync, float(line))
        out.write(json.dumps(dict(start=t0, end=t1, launches=n)) + "\n")
        out.flush()


def _load_tree(tree: str):
    """The ``flashcheck.kernels`` package of the checkout at ``tree`` (put first on the
    path before anything imports flashcheck: this process then runs that tree alone)."""
    sys.path.insert(0, tree)
    from flashcheck import kernels
    return kernels


def _inputs(args):
    import torch
    B, H = (1 << 20) // (16 * args.n), 16
    gen = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(B, H, args.n, args.d, device="cuda", dtype=getattr(torch, args.dtype),
                        generator=gen).requires_grad_() for _ in range(3)]


def _worker(args) -> int:
    """``--worker``: the base tree's forward, compiled, then timed per request on stdin."""
    import torch
    kernels = _load_tree(args.base)
    q, k, v = _inputs(args)

    def run():
        return kernels.attention(q, k, v, is_causal=args.causal)
    _warm(run, torch.cuda.synchronize)
    print("ready", flush=True)
    _serve(run, torch.cuda.synchronize, sys.stdin, sys.stdout)
    return 0


class _Base:
    """The worker process of ``--base``: started (and compiled) before the phases."""

    def __init__(self, args):
        cmd = [sys.executable, __file__, "--worker", "--out", "-", "--base", args.base,
               "--dtype", args.dtype, "--d", str(args.d), "--n", str(args.n)]
        self.proc = subprocess.Popen(cmd + (["--causal"] if args.causal else []),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.tree = args.base
        self._reply("ready", "before its forward ran")

    def _reply(self, starts: str, when: str) -> str:
        """The worker's next line that starts with ``starts``; what else it prints goes to
        stderr. A worker that exits first raises, naming the tree and its exit status."""
        for line in self.proc.stdout:
            if line.startswith(starts):
                return line
            sys.stderr.write(line)
        raise RuntimeError(f"the --base worker ({self.tree}) stopped {when} "
                           f"(exit {self.proc.wait()}); its error is above")

    def phase(self, seconds: float) -> tuple[float, float, int]:
        self.proc.stdin.write(f"{seconds}\n")
        self.proc.stdin.flush()
        got = json.loads(self._reply("{", "mid-run"))
        return got["start"], got["end"], got["launches"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def _run(args) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashcheck import kernels

    q, k, v = _inputs(args)

    def fn(impl):
        if impl == "cudnn":
            def run():
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
            return run

        def ours():
            with kernels._common.gluon(impl):
                return kernels.attention(q, k, v, is_causal=args.causal)
        return ours

    for impl in args.impls:
        if impl != "base":  # the worker warms its own
            _warm(fn(impl), torch.cuda.synchronize)
    base = _Base(args) if "base" in args.impls else None
    phases = []
    try:
        for p in range(args.phases):
            order = args.impls[p % len(args.impls):] + args.impls[:p % len(args.impls)]
            for impl in order:
                if impl == "base":
                    t0, t1, n = base.phase(args.seconds)
                else:
                    t0, t1, n = _phase(fn(impl), torch.cuda.synchronize, args.seconds)
                phases.append(dict(phase=p, impl=impl, start=t0, end=t1, launches=n))
                print(f"phase {p} {impl:10s} {(t1 - t0) * 1e3 / n:.3f} ms/launch", flush=True)
    finally:
        if base is not None:
            base.close()
    return phases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON report")
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="float16")
    ap.add_argument("--d", type=int, choices=(64, 128), default=64)
    ap.add_argument("--n", type=int, choices=(1024, 4096, 16384), default=16384)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--impls", type=_impls, default=["auto", "off", "cudnn"],
                    help=f"comma list of {', '.join(IMPLS)} (default auto,off,cudnn)")
    ap.add_argument("--base", help="another checkout's tree: its forward as impl \"base\"")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=3.0, help="per phase (1..30, default 3)")
    ap.add_argument("--phases", type=int, default=4, help="alternations (1..20, default 4)")
    args = ap.parse_args(argv)
    if not 1 <= args.seconds <= 30:
        ap.error(f"--seconds must be in 1..30, got {args.seconds}")
    if not 1 <= args.phases <= 20:
        ap.error(f"--phases must be in 1..20, got {args.phases}")
    if args.base is not None:
        if not os.path.isfile(os.path.join(args.base, "flashcheck", "__init__.py")):
            ap.error(f"--base must be a checkout's tree holding flashcheck/__init__.py, got "
                     f"{args.base!r}")
        args.base = os.path.abspath(args.base)
        if "base" not in args.impls:
            args.impls = [*args.impls, "base"]
    elif "base" in args.impls:
        ap.error("--impls names base, which needs --base TREE")
    if args.worker:
        if args.base is None:
            ap.error("--worker needs --base TREE")
        return _worker(args)
    if shutil.which("nvidia-smi") is None:
        ap.error("nvidia-smi is not on PATH: this script reads the GPU's clock and power "
                 "through it (an NVIDIA GPU and driver are needed)")
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv", "-lms", "100"],
                           stdout=subprocess.PIPE, text=True)
    try:
        phases = _run(args)
    finally:
        smi.terminate()
        text = smi.communicate(timeout=10)[0]
    import torch
    import triton
    rows = join(phases, parse_smi(text))
    rep = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, dtype=args.dtype, d=args.d, n=args.n,
               causal=args.causal, base=args.base, rows=rows, summary=summary(rows))
    with open(args.out, "w") as f:
        json.dump(rep, f, indent=1)
    print(json.dumps(rep["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

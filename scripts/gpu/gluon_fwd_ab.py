"""The Gluon forward of this tree against another tree's, in one process: bits, then time.

    python3 scripts/gpu/gluon_fwd_ab.py --old .ab/OLD --out FILE.json [--rounds 5]
                                        [--d 128,64] [--n 4096] [--variants c3,early+split]
                                        [--no-bits] [--prewarm J]

``--old`` is a checkout of this repository (``git archive COMMIT | tar -x -C .ab/OLD``; the
device call carries ``.ab``): its ``kernels/flash_attention_gluon.py`` is loaded beside the
package's own under another module name (both use this tree's ``kernels/_common.py``), so
that a change of the forward's schedule alone is compared without a process or a machine
between the two.

1. Bits: for every problem of ``PROBLEMS`` (head dims 64 and 128, fp16 and bf16, causal and
   not, GQA, unequal lengths; per tile and persistent grids), O and the base-2 lse of both
   forwards on the same inputs must be equal bit for bit (a schedule change moves no
   arithmetic); any difference is listed and the exit status is 1.
2. Time: bf16 and fp16, head dims ``--d`` (default 128 and 64), lengths ``--n`` (default
   4096; powers of two from 1K to 64K), the benchmark matrix's rows (``kernels/bench.py``: B
   and H; off the matrix's 1K, 4K and 16K by its rule), causal and not, in the
   default grid ("auto"): per round the old forward, the new one and cuDNN's
   (``scaled_dot_product_attention`` under the cuDNN backend), in an order that alternates
   between rounds; the median of ``triton.testing.do_bench`` per timing, then per
   configuration the median over rounds and the ratios old / new and cuDNN / new (above 1:
   the new one is faster).
3. ``--variants``: schedules of the new forward besides its default, each a "+"-joined set
   of ``c3`` (three consumer warpgroups at D = 64), ``c2`` (two), ``early`` (P rounded as
   soon as made) and ``split`` (the causal loop split at the diagonal):
   ``flash_attention_gluon.schedule``'s arguments. Each is bit-checked against the old
   forward like the default, and timed beside it as "new+NAME" with the ratio
   new+NAME / new (below 1: the variant is faster).

``--prewarm J``: J processes of this script first compile, side by side, every kernel the
run will launch (their shares of the bit problems and of the timed configurations; the
Triton cache is on disk), so the timed process compiles nothing; ``prewarm_s`` in the
report. ``--no-bits`` skips 1. (compiled one after the other, the bits of five forwards on
32 problems ran past 420 s on an H100); the report's ``bits`` is then empty and its timings
say nothing of equality. Each timed row is written as it comes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from functools import partial
from pathlib import Path

import torch
from flashcheck.kernels import _common, bench
from flashcheck.kernels import flash_attention_gluon as new
from flashcheck.kernels._common import Problem

# (B, Hq, Hkv, Nq, Nk, D, causal, grid)
PROBLEMS = [
    (2, 4, 4, 1024, 1024, 128, False, "tile"), (2, 4, 4, 1024, 1024, 128, True, "tile"),
    (2, 4, 2, 1024, 2048, 128, False, "persistent"), (2, 4, 2, 1024, 2048, 128, True, "persistent"),
    (1, 8, 8, 4096, 4096, 128, False, "persistent"), (1, 8, 8, 4096, 4096, 128, True, "persistent"),
    (1, 4, 1, 8192, 8192, 128, False, "tile"), (1, 4, 1, 8192, 8192, 128, True, "tile"),
    (2, 4, 4, 2048, 2048, 64, False, "persistent"), (2, 4, 2, 2048, 2048, 64, True, "persistent"),
    (1, 2, 2, 8192, 8192, 64, True, "tile"), (3, 2, 2, 256, 128, 128, False, "persistent"),
    # D 64 query lengths whose last tile of three consumers' rows is ragged (one or two of
    # them past the queries), a single tile included
    (1, 2, 2, 128, 1024, 64, False, "persistent"), (2, 2, 1, 256, 256, 64, True, "persistent"),
    (1, 3, 3, 256, 8192, 64, False, "tile"), (1, 2, 2, 1024, 8192, 64, True, "tile"),
]


# Timed lengths: powers of two whose benchmark row has B >= 1 (B = TOKENS // (HEADS * N)).
LENGTHS = tuple(1 << k for k in range(10, 17) if bench.TOKENS // (bench.HEADS << k) >= 1)


def timed(ds: list[int], ns: list[int]) -> list[dict]:
    """The timed configurations: the benchmark matrix's rows (``kernels.bench``: dtype,
    causal, B = TOKENS / (H N) and H) with these head dims and lengths, the matrix's order
    (length, head dim, dtype, causal); lengths off the matrix (2K, 8K, 32K, 64K) by the
    same rule."""
    return bench.configurations(False, ns=ns, ds=sorted(ds, reverse=True))


def _lengths(text: str) -> list[int]:
    try:
        ns = [int(x) for x in text.split(",")]
    except ValueError:
        ns = []
    if not ns or any(n not in LENGTHS for n in ns):
        raise argparse.ArgumentTypeError(
            f"must be comma-separated lengths from {', '.join(map(str, LENGTHS))}, got {text!r}")
    return ns


def _problem(B, Hq, Hkv, Nq, Nk, D, causal) -> Problem:
    return Problem(B=B, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=D, scale=D ** -0.5, has_lo=False,
                   has_hi=causal, lo_off=0, hi_off=0, is_causal=causal, mask=None,
                   mask_kind=0)


def load_old(tree: Path):
    path = tree / "kernels" / "flash_attention_gluon.py"
    if not path.is_file():
        raise SystemExit(f"--old: no {path}")
    spec = importlib.util.spec_from_file_location("flash_attention_gluon_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bits(old, variants: list[str] = (), share: tuple[int, int] = (0, 1)) -> list[dict]:
    """Every problem of PROBLEMS in bf16 and fp16, the new forward in its default schedule
    and in each of ``variants``, against the old one (run once per problem): bit for bit.
    ``share=(i, J)``: the i-th of J interleaved shares of the (dtype, problem) pairs."""
    rows = []
    pairs = [(dt, pr) for dt in (torch.bfloat16, torch.float16) for pr in PROBLEMS]
    for dtype, (B, Hq, Hkv, Nq, Nk, D, causal, grid) in pairs[share[0]::share[1]]:
        g = torch.Generator(device="cuda").manual_seed(hash((B, Hq, Nq, Nk, D)) % 2**31)
        q = torch.randn(B, Hq, Nq, D, device="cuda", dtype=dtype, generator=g)
        k = torch.randn(B, Hkv, Nk, D, device="cuda", dtype=dtype, generator=g)
        v = torch.randn(B, Hkv, Nk, D, device="cuda", dtype=dtype, generator=g)
        p = _problem(B, Hq, Hkv, Nq, Nk, D, causal)
        with _common.gluon(grid):
            o1, l1 = old.forward(q, k, v, p)
        for name in ("", *variants):
            with _common.gluon(grid), new.schedule(**variant(name)):
                o2, l2 = new.forward(q, k, v, p)
            torch.cuda.synchronize()
            same = torch.equal(o1.view(torch.int16), o2.view(torch.int16)) and torch.equal(
                l1.view(torch.int32), l2.view(torch.int32))
            rows.append(dict(variant=name or "default", dtype=str(dtype).split(".")[1],
                             B=B, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=D, causal=causal,
                             grid=grid, bitwise_equal=same,
                             o_max_diff=float((o1.float() - o2.float()).abs().max()),
                             lse_max_diff=float((l1 - l2).abs().max())))
            print(("same " if same else "DIFFERENT ") + json.dumps(rows[-1]), flush=True)
    return rows


def variant(name: str) -> dict:
    """The schedule's arguments for a variant name (``flash_attention_gluon.schedule_spec``);
    "" is the default schedule (no arguments)."""
    return new.schedule_spec(name) if name else {}


def _inputs(c: dict):
    """Fresh q, k, v and the problem of a timed configuration (:func:`timed`)."""
    dtype = getattr(torch, c["dtype"])
    q, k, v = (torch.randn(c["B"], c["H"], c["N"], c["D"], device="cuda", dtype=dtype)
               for _ in range(3))
    return q, k, v, _problem(c["B"], c["H"], c["H"], c["N"], c["N"], c["D"], c["causal"])


def scheduled(name: str, fn):
    """``fn`` run under the new forward's schedule ``name`` (:func:`variant`)."""
    kw = variant(name)

    def run():
        with new.schedule(**kw):
            return fn()
    return run


def timings(old, rounds: int, configs: list[dict], variants: list[str] = (),
            on_row=None) -> list[dict]:
    """Each configuration timed (module docstring, 2.); ``on_row(rows)`` after each one, so
    that a run cut at its limit keeps the rows it timed."""
    import torch.nn.functional as F
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn(q, k, v, causal):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    out = []
    for c in configs:
        dt, D, N, causal, B, H = (c[x] for x in ("dtype", "D", "N", "causal", "B", "H"))
        q, k, v, p = _inputs(c)
        fns = {"old": partial(old.forward, q, k, v, p), "new": partial(new.forward, q, k, v, p),
               "cudnn": partial(cudnn, q, k, v, causal)}
        for name in variants:
            fns[f"new+{name}"] = scheduled(name, fns["new"])
        times = {name: [] for name in fns}
        for r in range(rounds):
            order = list(fns) if r % 2 == 0 else list(reversed(list(fns)))
            for name in order:
                times[name].append(triton.testing.do_bench(fns[name], return_mode="median"))
        med = {name: statistics.median(ts) for name, ts in times.items()}
        flops = 4 * B * H * N * N * D / (2 if causal else 1)
        row = dict(dtype=dt, D=D, N=N, B=B, H=H, causal=causal, rounds=times,
                   median_ms=med, old_over_new=med["old"] / med["new"],
                   cudnn_over_new=med["cudnn"] / med["new"],
                   variant_over_new={name[4:]: med[name] / med["new"] for name in med
                                     if name.startswith("new+")},
                   tflops={name: flops / (m * 1e-3) / 1e12 for name, m in med.items()})
        out.append(row)
        if on_row is not None:
            on_row(out)
        print(f"{dt} D{D} N{N} causal={causal}: old {med['old']:.3f} new {med['new']:.3f} cuDNN "
              f"{med['cudnn']:.3f} ms; old/new {row['old_over_new']:.3f}, cuDNN/new "
              f"{row['cudnn_over_new']:.3f}" + "".join(
                  f"; {name} {med[name]:.3f} ({med[name] / med['new']:.3f})"
                  for name in med if name.startswith("new+")), flush=True)
    return out


def warm(old, variants: list[str], configs: list[dict], share: tuple[int, int],
         bits_too: bool = True) -> None:
    """Compile into the Triton cache what :func:`bits` (``bits_too``) and :func:`timings`
    launch: the ``share`` of the bit problems (run as :func:`bits` runs them) and of
    ``configs`` (each forward called once), nothing timed (``--prewarm``'s processes)."""
    if bits_too:
        bits(old, variants, share)
    for c in configs[share[0]::share[1]]:
        q, k, v, p = _inputs(c)
        old.forward(q, k, v, p)
        for name in ("", *variants):
            scheduled(name, partial(new.forward, q, k, v, p))()
    torch.cuda.synchronize()


def prewarm(argv: list[str], jobs: int) -> float:
    """``jobs`` processes of this script with ``argv`` and ``--warm i/jobs`` side by side,
    each compiling its share (:func:`warm`; their output discarded): the timed process then
    finds every kernel in the Triton cache. Returns the seconds they took; any of them
    failing stops the run (its last lines on stderr)."""
    import subprocess
    import time
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, __file__, *argv, "--warm", f"{i}/{jobs}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for i in range(jobs)]
    errs = []
    for p in procs:  # each pipe read to its end: a child's stderr never fills it and blocks
        _, err = p.communicate()
        errs.append((p.returncode, err))
    bad = [(i, rc, err) for i, (rc, err) in enumerate(errs) if rc != 0]
    if bad:
        i, rc, err = bad[0]
        raise SystemExit(f"gluon_fwd_ab: --prewarm process {i} exited {rc}:\n{err[-2000:]}")
    return time.monotonic() - t0


def _share(ap, text: str) -> tuple[int, int]:
    i, _, j = text.partition("/")
    try:
        share = (int(i), int(j))
    except ValueError:
        share = (0, 0)
    if not 0 <= share[0] < share[1]:
        ap.error(f"--warm must be I/J with 0 <= I < J, got {text!r}")
    return share


def _ints(ap, name: str, text: str, allowed: set[int]) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or any(v not in allowed for v in vals):
        ap.error(f"{name} must be a comma-separated list from {sorted(allowed)}, got {text!r}")
    return vals


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=Path, required=True, help="the other tree")
    ap.add_argument("--out", type=Path, required=True, help="JSON report")
    ap.add_argument("--rounds", type=int, default=5, help="timing rounds (1..50, default 5)")
    ap.add_argument("--d", default="128,64", help="timed head dims (64 and/or 128)")
    ap.add_argument("--n", default=[4096], type=_lengths,
                    help="timed lengths, comma-separated, powers of two from 1024 to 65536 "
                         "(the benchmark's rows: B = 2^20 / (16 N), H = 16)")
    ap.add_argument("--no-bits", action="store_true",
                    help="time only: the bit check skipped (for a call short of device time, "
                         "after a run that checked the same trees' bits)")
    ap.add_argument("--prewarm", type=int, default=0, metavar="J",
                    help="J processes first compile everything the run launches, side by "
                         "side (0..32, default 0: each kernel compiled at its first call)")
    ap.add_argument("--warm", default=None, help=argparse.SUPPRESS)  # i/J: one such process
    ap.add_argument("--variants", default="",
                    help="comma-separated schedules of the new forward to check and time "
                         "besides its default, each a +-joined set of c2, c3, c3long, early, split")
    args = ap.parse_args(argv)
    if not 1 <= args.rounds <= 50:
        ap.error(f"--rounds must be in 1..50, got {args.rounds}")
    if not 0 <= args.prewarm <= 32:
        ap.error(f"--prewarm must be in 0..32, got {args.prewarm}")
    share = None if args.warm is None else _share(ap, args.warm)
    ds = _ints(ap, "--d", args.d, {64, 128})
    variants = [x for x in args.variants.split(",") if x]
    for name in variants:
        try:
            variant(name)
        except ValueError as exc:
            ap.error(f"--variants: {exc}")
    if not (torch.cuda.is_available() and new.AVAILABLE):
        raise SystemExit("gluon_fwd_ab: needs an sm_90 GPU and a Triton with Gluon")
    old = load_old(args.old)
    configs = timed(ds, args.n)
    if share is not None:
        warm(old, variants, configs, share, bits_too=not args.no_bits)
        return 0
    import triton
    rep = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, old=str(args.old))
    if args.prewarm:
        rep["prewarm_s"] = prewarm(list(sys.argv[1:] if argv is None else argv), args.prewarm)
        print(f"prewarm: {args.prewarm} processes, {rep['prewarm_s']:.0f} s", flush=True)
    rep["bits"] = [] if args.no_bits else bits(old, variants)
    args.out.write_text(json.dumps(rep, indent=1))

    def write(rows):
        rep["timings"] = rows
        args.out.write_text(json.dumps(rep, indent=1))
    timings(old, args.rounds, configs, variants, on_row=write)
    differ = [r for r in rep["bits"] if not r["bitwise_equal"]]
    print("bits: not checked (--no-bits)" if args.no_bits else
          f"bits: {len(rep['bits']) - len(differ)} of {len(rep['bits'])} equal")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())

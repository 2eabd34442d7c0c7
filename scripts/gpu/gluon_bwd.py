"""The five-product Gluon backward (kernels/flash_attention_gluon_bwd.py) on the H200: every
form timed and checked beside our Triton backward and cuDNN's.

    . scripts/gpu/triton_slim.sh use     # triton 3.9: its Gluon has the bulk reduce-add
    python3 scripts/gpu/gluon_bwd.py --out FILE.json [--d 128,64] [--forms split,writer]
    python3 scripts/gpu/gluon_bwd.py --check-small     (under compute-sanitizer)
    python3 scripts/gpu/gluon_bwd.py --table FILE.json [FILE.json ...]  (Markdown, anywhere)

Per head dim and causal or not (bf16, B = H = 16, N = 4096, the bench's shape): our whole
backward (``flash_attention._backward``, deterministic: the Triton kernels) and cuDNN's
(``torch.autograd.grad`` through SDPA's cuDNN backend), then the whole ``_backward`` under
each Gluon form (``_common.gluon_bwd``: "split" and "writer" with ``deterministic=False``;
their ordered variants with ``deterministic=True``, causal included): the Triton
preprocess, the accumulator (zeroed for the adds as they come), the kernel and dQ's cast,
which is what a user's call costs. Each is checked against our Triton backward (largest
|difference| per gradient, and its ratio to 4 units in the last place of the gradient's
largest entry), run twice for ``repeats_equal``, and counted (``LAUNCHES``: the call took
the Gluon path). ``profile``: the GPU kernels of five calls of each backward by name
(torch.profiler), so that a whole call's time can be read against its kernels'. Medians of
``triton.testing.do_bench`` (ms). ``--forms``: only these forms (the session runs the forms
as their adds come and the ordered ones in two calls, so that a hang of one cannot take the
other's timings). The JSON is rewritten before each form with that form marked "did not
finish", so a call killed at its time limit leaves which form it was in.

``--check-small``: every form once at a small shape (B 1, H 2, Hkv 2/1, N 256, D 128,
causal and not) against our backward, no timing: for compute-sanitizer's racecheck,
memcheck and synccheck. Exit 1 if any form disagrees.

The kernels of the first timings (the per-warpgroup adds, per-element atomics, the staged
diagnostic: docs/benchmarks/sweep.md round 18) are in that round's commits.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch
from flashcheck.kernels import _common
from flashcheck.kernels import flash_attention as fa
from flashcheck.kernels import flash_attention_gluon_bwd as gb
from flashcheck.kernels.bench import kernel_times

# (name, mode, deterministic): each mode's form as its adds come, then its ordered variant
FORMS = tuple((gb.form_name(mode, det), mode, det) for det in (False, True) for mode in gb.FORMS)
NAMES = tuple(name for name, _, _ in FORMS)
# --check-small's shape and its (Hkv, causal) configurations, in the order it runs them
# (scripts/gpu/race_trace.py compiles the same kernels to trace racecheck's reports)
SMALL = dict(B=1, H=2, N=256, D=128)
SMALL_CONFIGS = tuple((hkv, causal) for hkv in (2, 1) for causal in (False, True))


def _inputs(B, Hq, Hkv, N, D, causal, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, do = (torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
             for _ in range(2))
    k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    p = _common.validate(q, k, v, None, 0.0, causal, None, Hq != Hkv, None, "top_left")
    o, lse = fa._forward(q, k, v, p, False)
    return q, k, v, do, o, lse, p


def _ulps(got, want) -> dict:
    """Largest |got - want| per gradient, and its ratio to 4 units in the last place of the
    gradient's largest entry (bf16: 2^-8 relative; the forms differ from ours in fp32
    summation order and in dQ's scale applied per tile, not in the formula)."""
    res = {}
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        diff = float((a.float() - b.float()).abs().max())
        res[f"{name}_max_abs"] = diff
        res[f"{name}_per_4ulp"] = diff / (4 * 2.0 ** -8 * float(b.float().abs().max()))
    return res


def worst_ulps(ulps: dict) -> float:
    """The largest of :func:`_ulps`'s ratios to 4 units in the last place."""
    return max(v for k, v in ulps.items() if k.endswith("_per_4ulp"))


def _form_call(mode: str, deterministic: bool, args):
    def call():
        with _common.gluon_bwd(mode):
            return fa._backward(*args, deterministic, False)
    return call


UNFINISHED = "did not finish: a hang, or the call's time limit"


def _on_gpu(out: Path, dims: tuple[int, ...], forms: tuple[str, ...]) -> int:
    import torch.nn.functional as F
    import triton
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def bench(fn):
        return triton.testing.do_bench(fn, return_mode="median")

    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, gluon_available=gb.AVAILABLE, rows=[])
    for D in dims:
        for causal in (False, True):
            q, k, v, do, o, lse, p = _inputs(16, 16, 16, 4096, D, causal)
            args = (do, q, k, v, o, lse, p)
            ours = _form_call("off", True, args)  # the Triton kernels
            want = ours()
            row = dict(D=D, causal=causal, ours_ms=bench(ours), ours_kernels=kernel_times(ours))
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                y = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                row["cudnn_ms"] = bench(partial(torch.autograd.grad, y, (qg, kg, vg), do,
                                                retain_graph=True))
            res["rows"].append(row)
            for name, mode, det in FORMS:
                if name not in forms:
                    continue
                row[name] = dict(error=UNFINISHED)
                out.write_text(json.dumps(res, indent=1))
                call = _form_call(mode, det, args)
                try:
                    before = gb.LAUNCHES[0]
                    first, again = call(), call()
                    torch.cuda.synchronize()
                    row[name] = dict(
                        gluon_launches=gb.LAUNCHES[0] - before,
                        repeats_equal=all(torch.equal(a, b)
                                          for a, b in zip(first, again, strict=True)),
                        **_ulps(first, want), ms=bench(call), kernels=kernel_times(call))
                except Exception as e:  # noqa: BLE001 - reported per form
                    row[name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            print(json.dumps(row), flush=True)
            out.write_text(json.dumps(res, indent=1))
    return 0


def table(*runs: dict) -> str:
    """The Markdown table of runs' JSON, one after the other: per row our whole backward,
    cuDNN's, and each form's time, its speed against cuDNN (cuDNN's time over its own), its
    largest difference from ours in units of the 4-ulp check, and whether two calls gave the
    same bits."""
    head = ["| D | causal | ours | cuDNN | form | ms | × cuDNN | × ours | worst / 4 ulps "
            "| repeats equal | Gluon launches |",
            "|---|---|---:|---:|---|---:|---:|---:|---:|---|---:|"]
    lines = []
    for row in (row for res in runs for row in res["rows"]):
        for name, _, _ in FORMS:
            f = row.get(name)
            if f is None:
                continue
            lead = (f"| {row['D']} | {'yes' if row['causal'] else 'no'} | {row['ours_ms']:.2f} "
                    f"| {row['cudnn_ms']:.2f} | {name} |")
            if "error" in f:
                lines.append(f"{lead} {f['error']} | | | | | |")
                continue
            worst = worst_ulps(f)
            lines.append(f"{lead} {f['ms']:.2f} | {row['cudnn_ms'] / f['ms']:.3f} | "
                         f"{row['ours_ms'] / f['ms']:.3f} | {worst:.3g} | "
                         f"{'yes' if f['repeats_equal'] else 'no'} | {f['gluon_launches']} |")
    return "\n".join(head + lines) + "\n"


def _check_small() -> int:
    bad = 0
    for hkv, causal in SMALL_CONFIGS:
        q, k, v, do, o, lse, p = _inputs(SMALL["B"], SMALL["H"], hkv, SMALL["N"], SMALL["D"],
                                         causal)
        args = (do, q, k, v, o, lse, p)
        want = _form_call("off", True, args)()  # the Triton kernels
        for name, mode, det in FORMS:
            before = gb.LAUNCHES[0]
            got = _form_call(mode, det, args)()
            torch.cuda.synchronize()
            worst = worst_ulps(_ulps(got, want))
            ok = worst <= 1 and gb.LAUNCHES[0] == before + 1
            bad += not ok
            print(f"{'ok ' if ok else 'BAD'} {name} causal={causal} "
                  f"hkv={hkv}: launches {gb.LAUNCHES[0] - before}, max |diff| / 4 ulps "
                  f"{worst:.3g}", flush=True)
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="JSON of the GPU run")
    ap.add_argument("--d", default="128,64", help="head dims, e.g. 128")
    ap.add_argument("--check-small", action="store_true",
                    help="every form once at a small shape against ours (for compute-sanitizer)")
    ap.add_argument("--forms", default=",".join(NAMES),
                    help="only these forms, separated by commas (default: all)")
    ap.add_argument("--table", type=Path, nargs="+", metavar="JSON",
                    help="print the Markdown table of earlier runs' JSON and exit")
    args = ap.parse_args(argv)
    if args.table is not None:
        try:
            print(table(*(json.loads(path.read_text()) for path in args.table)), end="")
        except (OSError, ValueError, KeyError, TypeError) as e:
            ap.error(f"--table: not a gluon_bwd.py result ({type(e).__name__}: {e})")
        return 0
    forms = tuple(args.forms.split(","))
    if not args.forms or any(name not in NAMES for name in forms):
        ap.error(f"--forms must be among {', '.join(NAMES)} separated by commas, "
                 f"got {args.forms!r}")
    try:
        dims = tuple(int(x) for x in args.d.split(","))
    except ValueError:
        dims = ()
    if not dims or any(d not in (64, 128) for d in dims):
        ap.error(f"--d must be head dims 64 and/or 128 separated by commas, got {args.d!r}")
    if args.out is None and not args.check_small:
        ap.error("--out is required (or --check-small)")
    if not gb.AVAILABLE:
        print("gluon_bwd: this Triton's Gluon has no bulk reduce-add (tma.async_atomic_add); "
              "on the H200: . scripts/gpu/triton_slim.sh use", file=sys.stderr)
        return 2
    if args.check_small:
        return _check_small()
    return _on_gpu(args.out, dims, forms)


if __name__ == "__main__":
    sys.exit(main())

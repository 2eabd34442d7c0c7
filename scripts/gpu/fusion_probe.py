"""Our kernel's error on case files under compile-option variants (CUDA only).

    python3 scripts/gpu/fusion_probe.py CASE.json [CASE.json ...] [--out JSON] [--tensors DIR]

For each case file: the case's inputs on the GPU, the exact (float64) out, lse and
gradients, then our kernel's forward and backward in four variants: Triton's defaults;
floating-point contraction (FMA fusion) off in every kernel (``enable_fp_fusion=False``);
off in the forward only; off in the backward only (the delta preprocess, dK/dV and dQ
kernels). Per variant: the largest absolute error of out, the base-2 lse, dq, dk and dv,
and where the largest dq error sits. Which arithmetic the compiler chose is what moves
between the variants; the kernel source is the same. ``--tensors DIR``: each variant's
out, lse (base 2), dq, dk, dv saved as DIR/<case file stem>.<variant>.pt (CPU tensors), to
compare with emulated choices on a machine without the GPU (the case's inputs materialize
the same on the CPU).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

VARIANTS = {"default": (True, True), "no_fusion": (False, False),
            "fwd_no_fusion": (False, True), "bwd_no_fusion": (True, False)}


class _Opts:
    """A launch path (``fixed[grid]``) with extra compile options."""

    def __init__(self, fn, opts: dict):
        self.fn, self.opts = fn, opts

    def __getitem__(self, grid):
        launch = self.fn[grid]
        return lambda *a, **k: launch(*a, **k, **self.opts)


def _run(fa, inp, fwd_fusion: bool, bwd_fusion: bool):
    from flashcheck.kernels._common import gluon, validate
    paths, pre = dict(fa._PATHS), fa._bwd_preprocess
    # the Triton kernels' fusion is probed: their forward, not the Gluon one
    with gluon("off"):
        try:
            for kind, (fixed, tuned, outer, inner) in paths.items():
                on = fwd_fusion if kind == "fwd" else bwd_fusion
                fa._PATHS[kind] = (_Opts(fixed, dict(enable_fp_fusion=on)), tuned, outer,
                                   inner)
            fa._bwd_preprocess = _Opts(pre, dict(enable_fp_fusion=bwd_fusion))
            q, k, v = inp.query, inp.key, inp.value
            p = validate(q, k, v, inp.attn_mask, 0.0, inp.is_causal, inp.scale,
                         inp.enable_gqa, inp.window, inp.causal_alignment)
            out, lse = fa._forward(q, k, v, p, False)
            dq, dk, dv = fa._backward(inp.grad_out, q, k, v, out, lse, p, True, False)
            torch.cuda.synchronize()
        finally:
            fa._PATHS.update(paths)
            fa._bwd_preprocess = pre
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


def probe(path: str, tensors: str | None = None) -> dict:
    from flashcheck.kernels import flash_attention as fa
    from flashcheck.verify.cases import load_case_file
    from flashcheck.verify.check import _reference

    case, _ = load_case_file(path)
    inp = case.materialize("cuda")
    ref = _reference(inp, True)
    exact = {n: ref[n].detach().to(torch.float64) for n in ("out", "dq", "dk", "dv")}
    exact["lse"] = ref["lse"].detach().to(torch.float64) / math.log(2.0)
    res = {"case": case.short(), "variants": {}}
    for name, (f, b) in VARIANTS.items():
        got = _run(fa, inp, f, b)
        if tensors:
            from pathlib import Path
            Path(tensors).mkdir(parents=True, exist_ok=True)
            torch.save({t: x.detach().cpu() for t, x in got.items()},
                       Path(tensors) / f"{Path(path).stem}.{name}.pt")
        row = {}
        for t, want in exact.items():
            g = got[t].to(torch.float64)
            ok = torch.isfinite(want)
            err = torch.where(ok, (g - want).abs(), torch.zeros_like(want))
            row[t] = float(err.max())
            if t == "dq":
                i = int(err.argmax())
                idx = list(torch.unravel_index(torch.tensor(i), err.shape))
                row["dq_worst"] = dict(index=[int(x) for x in idx], got=float(g.flatten()[i]),
                                       want=float(want.flatten()[i]))
        res["variants"][name] = row
        print(f"{name:14s} " + "  ".join(f"{t} {row[t]:.3g}" for t in exact)
              + f"  dq worst {row['dq_worst']}", flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tensors", default=None, metavar="DIR",
                    help="save each variant's out, lse, dq, dk, dv under DIR")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("fusion_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=__import__("triton").__version__)
    results = []
    for path in args.cases:
        print(f"== {path}", flush=True)
        results.append(dict(probe(path, args.tensors), file=path))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

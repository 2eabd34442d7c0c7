"""Compiled FlexAttention on strided views: is a view with last-dim stride 2 read right?

For each (dtype, D, Nq, Nk) the same values run through ``torch.compile(flex_attention,
dynamic=False, fullgraph=True)`` four ways: contiguous, and as the view
``buf[:, :, :N, :2*D:2]`` of a (B, H, N + 1, 2·D + 2) buffer (the harness's ``strided``
layout, docs/contracts.md §1) whose elements outside the view are NaN, zero, or random
finite values. Forward and dQ/dK/dV of each are compared with the contiguous run and
with a float64 softmax(QKᵀ·scale)V: a kernel that reads views right gives the contiguous
answer whatever the neighbours hold.

    python scripts/gpu/flex_strided.py --out flex_strided.json
    python scripts/gpu/flex_strided.py --eager --device cpu --configs 3   # the control

One JSON row per (configuration, neighbours): the max |difference| from the contiguous
run per tensor, the max error against float64, NaN counts."""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
from flashcheck.verify.cases import _lay_out


def view_of(x: torch.Tensor, fill: str, gen: torch.Generator) -> torch.Tensor:
    """``x`` (B, H, N, D) in the harness's ``strided`` layout (``verify.cases``), the other
    elements of its buffer ``fill``: "nan" (the harness's own), "zero" or "random"."""
    view = _lay_out(x.cpu(), "strided", x.device)
    if fill == "nan":
        return view
    base = view._base
    buf = (torch.randn(base.shape, generator=gen).to(base.dtype) if fill == "random"
           else torch.zeros(base.shape, dtype=base.dtype)).to(base.device)
    out = buf.as_strided(view.shape, view.stride(), view.storage_offset())
    out.copy_(view)
    return out


def run(fn, q, k, v, do):
    """Output and, where ``do`` is given, dQ, dK, dV."""
    q, k, v = (t.detach().requires_grad_(do is not None) for t in (q, k, v))
    out = fn(q, k, v)
    if do is None:
        return [out.detach()]
    out.backward(do)
    return [out.detach(), q.grad, k.grad, v.grad]


def reference(q, k, v, do, scale):
    q, k, v = (t.detach().double().requires_grad_(do is not None) for t in (q, k, v))
    p = torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1)
    out = p @ v
    if do is None:
        return [out.detach()]
    out.backward(do.double())
    return [out.detach(), q.grad, k.grad, v.grad]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="flex_strided.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--eager", action="store_true",
                    help="flex_attention uncompiled (its unfused path: the control)")
    ap.add_argument("--configs", type=int, default=0,
                    help="only the first N configurations (0: all 17)")
    args = ap.parse_args(argv)
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention if args.eager else torch.compile(
        flex_attention, dynamic=False, fullgraph=True)
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 4096
    grads = not args.device.startswith("cpu")  # flex has no backward on the CPU
    rows, gen = [], torch.Generator().manual_seed(0)
    env = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()
           if torch.cuda.is_available() else "none"}
    # the campaign's failing shapes first (D 45 and 16, Nk 87 and 1), then the controls
    configs = [(torch.float16, D, nq, nk) for D in (45, 16, 32, 28, 64)
               for nq, nk in ((87, 87), (75, 1), (128, 128))]
    configs += [(torch.float32, D, 87, 87) for D in (45, 28)]
    configs = configs[: args.configs or None]
    for dtype, D, Nq, Nk in configs:
        B, H = 1, 2
        q, k, v = (torch.randn(B, H, n, D, generator=gen).to(dtype)
                   for n in (Nq, Nk, Nk))
        do = torch.randn(B, H, Nq, D, generator=gen).to(dtype)
        q, k, v, do = (t.to(args.device) for t in (q, k, v, do))
        do = do if grads else None
        scale = 1 / math.sqrt(D)
        ref = reference(q, k, v, do, scale)
        base = None
        for fill in ("contiguous", "nan", "zero", "random"):
            row = {"dtype": str(dtype)[6:], "D": D, "Nq": Nq, "Nk": Nk, "neighbours": fill}
            rows.append(row)
            try:
                got = run(fn, *((q, k, v) if fill == "contiguous" else
                                (view_of(t, fill, gen) for t in (q, k, v))), do)
            except Exception as e:  # noqa: BLE001 - recorded, e.g. out of shared memory
                row["raised"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                if fill == "contiguous":
                    break  # nothing to compare the views with
                continue
            base = got if base is None else base
            names = ("out", "dq", "dk", "dv")[: len(got)]
            for name, g, b, r in zip(names, got, base, ref, strict=True):
                row[name] = {
                    "vs_contiguous": float((g.double() - b.double()).abs().nan_to_num(
                        math.inf).max()),
                    "vs_float64": float((g.double() - r).abs().nan_to_num(math.inf).max()),
                    "nan": int(g.isnan().sum()),
                }
            bad = [n for n in names if row[n]["vs_contiguous"] != 0]
            print(f"{row['dtype']:8} D{D:<3} Nq{Nq:<4} Nk{Nk:<4} {fill:10} "
                  + ("same bits as contiguous" if not bad else "DIFFERS: " + ", ".join(
                      f"{n} {row[n]['vs_contiguous']:.3g} (vs f64 {row[n]['vs_float64']:.3g},"
                      f" {row[n]['nan']} NaN)" for n in bad)), flush=True)
        with open(args.out, "w") as f:  # after each configuration: a run cut short keeps it
            json.dump({"env": env, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

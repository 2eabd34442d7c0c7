"""Where does SDPA-math's backward on a device depart from the same arithmetic on the CPU?

For a case file, runs the math backend's stages one by one in the case's dtype, on
``--device`` and on the CPU, from the same inputs, and reports each stage's largest
difference in units of the dtype's subnormal spacing and relative to the stage's size:

    S = scale Q K^T (+ mask)   P = softmax(S)   dP = dO V^T
    dS = softmax_backward(dP, P)   dQ = scale dS K   dK = scale dS^T Q   dV = P^T dO

Each device stage starts from the CPU's previous stage (moved to the device), so a
difference is the stage's own, not inherited. Divergence 5 of docs/reports/README.md
(sdpa-math, fp32, tied keys, tiny dO: dq 150 subnormal spacings off on CUDA, 18 on the CPU)
is what it is for:

    python scripts/gpu/math_stages.py \
        docs/reports/h200/runs/sdpa-math/failures/numerical-9d68678be5.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from verify.cases import load_case_file
from verify.check import _allowed_bias


def _stages(allowed, bias, scale):
    """(name, function, names of its inputs, name of its output or None) for each stage;
    later stages read the named outputs."""
    def s_fn(q, k):
        s = (q @ k.transpose(-1, -2)) * scale
        s = s.masked_fill(~allowed.to(s.device), float("-inf"))
        return s if bias is None else s + bias.to(s.device)

    def ds_fn(dp, p):
        return torch._softmax_backward_data(dp, p, -1, p.dtype)

    return [
        ("S = scale Q K^T", s_fn, ("q", "k"), "s"),
        ("P = softmax(S)", lambda s: torch.softmax(s, -1), ("s",), "p"),
        ("dP = dO V^T", lambda do, v: do @ v.transpose(-1, -2), ("do", "v"), "dp"),
        ("dS = softmax_backward", ds_fn, ("dp", "p"), "ds"),
        ("dQ = scale dS K", lambda ds, k: (ds @ k) * scale, ("ds", "k"), None),
        ("dK = scale dS^T Q", lambda ds, q: (ds.transpose(-1, -2) @ q) * scale, ("ds", "q"),
         None),
        ("dV = P^T dO", lambda p, do: p.transpose(-1, -2) @ do, ("p", "do"), None),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("case", help="a flashcheck case file")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None, help="also write the table as JSON")
    args = ap.parse_args(argv)
    case, _ = load_case_file(args.case)
    if case.Hq != case.Hkv:
        raise SystemExit(f"case: Hq = Hkv needed (got {case.Hq} and {case.Hkv}); GQA cases "
                         "are not supported here")
    inp = case.materialize("cpu")
    allowed, bias = _allowed_bias(inp)
    allowed = allowed.expand(case.B, case.Hq, case.Nq, case.Nk)
    scale = float(inp.effective_scale)
    env = {"q": inp.query.contiguous(), "k": inp.key.contiguous(), "v": inp.value.contiguous(),
           "do": inp.grad_out.contiguous()}
    dt = inp.query.dtype
    spacing = torch.finfo(dt).smallest_normal * torch.finfo(dt).eps
    rows = []
    for name, fn, ins, out in _stages(allowed, bias, scale):
        cpu = fn(*(env[n] for n in ins))
        dev = fn(*(env[n].to(args.device) for n in ins)).cpu()
        fin = torch.isfinite(cpu) & torch.isfinite(dev)
        diff = torch.where(fin, (dev.double() - cpu.double()).abs(),
                           torch.zeros((), dtype=torch.float64))
        worst = int(diff.argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), diff.shape))
        finite = cpu.double().abs()[torch.isfinite(cpu)]  # S has -inf where masked
        size = float(finite.max()) if finite.numel() else 0.0
        rows.append({"stage": name, "max_diff": float(diff.max()),
                     "in_subnormal_spacings": float(diff.max() / spacing),
                     "relative_to_max": float(diff.max()) / size if size else 0.0,
                     "nonfinite_mismatch": int((torch.isfinite(cpu)
                                                != torch.isfinite(dev)).sum()),
                     "worst_index": idx, "device_value": float(dev[idx]),
                     "cpu_value": float(cpu[idx])})
        if out is not None:
            env[out] = cpu
    print(f"case: {case.short()}  device: {args.device}  dtype: {case.dtype}")
    for r in rows:
        print(f"{r['stage']:24s} max diff {r['max_diff']:.3g} = "
              f"{r['in_subnormal_spacings']:.3g} spacings ({r['relative_to_max']:.2g} of max) "
              f" at {r['worst_index']}: "
              f"{r['device_value']:.6g} vs {r['cpu_value']:.6g}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"case": case.to_dict(), "device": args.device, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

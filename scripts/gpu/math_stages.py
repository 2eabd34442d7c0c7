"""Where does SDPA-math's backward on a device depart from the same arithmetic on the CPU?

For a case file, runs the math backend's stages one by one in the case's dtype, on
``--device`` and on the CPU, from the same inputs, and reports each stage's largest
difference in units of the dtype's subnormal spacing and relative to the stage's size:

    S = (rQ)(rK)^T (+ mask)   P = softmax(S)   dP = dO V^T
    dS = softmax_backward(dP, P)   dQ = r dS (rK)   dK = r dS^T (rQ)   dV = P^T dO

with r = sqrt(scale): the math backend scales Q and K by r each before the product (its
forward equals this bit for bit on the CPU). Each device stage starts from the CPU's previous
stage (moved to the device), so a difference is the stage's own, not inherited. Then the
backend itself (``F.scaled_dot_product_attention`` under ``SDPBackend.MATH``, autograd) runs
on both, and its dq, dk, dv are compared with each other and with the float64 reference.
Divergence 5 of docs/reports/README.md (sdpa-math, fp32, tied keys, tiny dO: dq 150
subnormal spacings off on CUDA, 18 on the CPU) is what it is for:

    python scripts/gpu/math_stages.py \
        docs/reports/h200/earlier-failures/sdpa-math/numerical-9d68678be5.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from flashcheck.verify.cases import load_case_file
from flashcheck.verify.check import _allowed_bias


def _stages(allowed, bias, scale):
    """(name, function, names of its inputs, name of its output or None) for each stage;
    later stages read the named outputs."""
    r = scale ** 0.5

    def s_fn(q, k):
        s = (q * r) @ (k * r).transpose(-1, -2)
        s = s.masked_fill(~allowed.to(s.device), float("-inf"))
        return s if bias is None else s + bias.to(s.device)

    def ds_fn(dp, p):
        return torch._softmax_backward_data(dp, p, -1, p.dtype)

    return [
        ("S = (rQ)(rK)^T", s_fn, ("q", "k"), "s"),
        ("P = softmax(S)", lambda s: torch.softmax(s, -1), ("s",), "p"),
        ("dP = dO V^T", lambda do, v: do @ v.transpose(-1, -2), ("do", "v"), "dp"),
        ("dS = softmax_backward", ds_fn, ("dp", "p"), "ds"),
        ("dQ = r dS (rK)", lambda ds, k: (ds @ (k * r)) * r, ("ds", "k"), None),
        ("dK = r dS^T (rQ)", lambda ds, q: (ds.transpose(-1, -2) @ (q * r)) * r, ("ds", "q"),
         None),
        ("dV = P^T dO", lambda p, do: p.transpose(-1, -2) @ do, ("p", "do"), None),
    ]


def _row(stage, a, b, size, spacing) -> dict:
    """One table row: the largest |a - b| where both are finite, in subnormal spacings and
    relative to ``size``, with its index and both values (``device_value`` is a's,
    ``cpu_value`` b's: the CPU's, or for a backend row against float64 the reference's)."""
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    diff = torch.where(fa & fb, (a.double() - b.double()).abs(),
                       torch.zeros((), dtype=torch.float64))
    worst = int(diff.argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), diff.shape))
    big = float(diff.max())
    return {"stage": stage, "max_diff": big, "in_subnormal_spacings": big / spacing,
            "relative_to_max": big / size if size else 0.0,
            "nonfinite_mismatch": int((fa != fb).sum()), "worst_index": idx,
            "device_value": float(a[idx]), "cpu_value": float(b[idx])}


def _backend_grads(inp, allowed, bias, is_causal, device):
    """dq, dk, dv of the math backend on ``device`` (the case's mask as an additive mask,
    unless plain causal)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.to(device).detach().requires_grad_() for t in (inp.query, inp.key, inp.value))
    mask = None
    if not is_causal:
        mask = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, float("-inf"))
        mask = (mask if bias is None else mask + bias.to(q.dtype)).to(device)
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                             scale=float(inp.effective_scale))
    out.backward(inp.grad_out.to(device))
    return {n: t.grad.cpu() for n, t in (("dq", q), ("dk", k), ("dv", v))}


def _backend_rows(case, inp, allowed, bias, device, spacing):
    """The backend's gradients: device against CPU, and each against float64."""
    from flashcheck.verify.check import _reference

    plain_causal = (case.is_causal and case.causal_alignment == "top_left"
                    and case.window is None and case.mask["kind"] == "none")
    ref = _reference(inp.clone(), True)
    cpu = _backend_grads(inp, allowed, bias, plain_causal, "cpu")
    dev = _backend_grads(inp, allowed, bias, plain_causal, device)
    rows = []
    for n in ("dq", "dk", "dv"):
        want = ref[n].cpu().double()
        size = float(want.abs().max())
        for what, a, b in (("device", dev[n], want), ("cpu", cpu[n], want),
                           ("device vs cpu", dev[n], cpu[n])):
            rows.append(_row(f"backend {n}: {what}", a, b, size, spacing))
    return rows


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
        finite = cpu.double().abs()[torch.isfinite(cpu)]  # S has -inf where masked
        rows.append(_row(name, dev, cpu, float(finite.max()) if finite.numel() else 0.0,
                         spacing))
        if out is not None:
            env[out] = cpu
    rows += _backend_rows(case, inp, allowed, bias, args.device, spacing)
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

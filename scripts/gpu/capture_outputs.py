"""A kernel's forward output and gradients on one case file, saved for analysis elsewhere.

    python3 scripts/gpu/capture_outputs.py CASE.json --kernel SPEC --device cuda --out F.pt

The inputs are the case's own draw (``Case.materialize``: drawn on the CPU from its seed,
then moved), the kernel is called as ``check_case`` calls it (the adapter's ``call``), and
the backward takes the case's dO. Saves ``{"out", "dq", "dk", "dv"}`` as CPU tensors in the
kernel's dtypes, with the case's JSON and the versions: what a family member emulated on
the CPU can then be compared with element by element, without the GPU.
"""

from __future__ import annotations

import argparse
import json

import torch


def capture(case_path: str, spec: str, device: str) -> dict:
    from flashcheck.verify import report as R
    from flashcheck.verify.adapters import resolve_kernel
    from flashcheck.verify.cases import load_case_file

    case, _ = load_case_file(case_path)
    inp = case.materialize(device)
    for n in ("query", "key", "value"):
        getattr(inp, n).requires_grad_(True)
    kernel = resolve_kernel(spec, device)
    with torch.enable_grad():
        out, _ = kernel.call(inp)
        grads = torch.autograd.grad(out, [inp.query, inp.key, inp.value], inp.grad_out)
    res = {n: t.detach().cpu() for n, t in zip(("out", "dq", "dk", "dv"), (out, *grads),
                                                   strict=True)}
    res["case"] = case.to_json()
    res["kernel"] = spec
    res["versions"] = json.dumps(R.versions())
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case")
    ap.add_argument("--kernel", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    res = capture(args.case, args.kernel, args.device)
    torch.save(res, args.out)
    print(f"wrote {args.out}: " + ", ".join(
        f"{n} {tuple(res[n].shape)} {res[n].dtype}" for n in ("out", "dq", "dk", "dv")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

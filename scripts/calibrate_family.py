"""Calibrate K: how far a correct implementation choice sits from the rest of the family.

For every case (the CPU profile's fixed sweep plus drawn cases, seeded), every applicable
member of ``reference.family`` runs on the same inputs and is compared with the float64
reference. Leave-one-out: a member's max abs error (and RMSE) over the worst of the *other*
members is how far a correct choice that the family did not name would sit above the
tolerance's yardstick. Its maximum over cases, per tensor, is the spread K must cover.

    OMP_NUM_THREADS=1 python scripts/calibrate_family.py --draws 200 --seed 0 --out F.json

Every member runs, the opt-in ones (``OPT_IN``) too: a default member is compared with the
other default ones (the spread K must cover), an opt-in one with all the default ones (how
far above them it sits, the reason it is opt-in). Writes per regime ("normal";
"subnormal": tiny inputs or dO; "floor": K_RULE x the other members' max error is below the
floor, which then sets the tolerance) and tensor: the maximum
leave-one-out ratio of the default members (max abs, and RMSE where the RMSE rule applies,
n_eff >= N_EFF_MIN) with the member and case that set it, and per regime and member its
worst ratio to the rest.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
from flashcheck.reference.family import OPT_IN, OPT_IN_MEMBERS, family_members, run_family
from flashcheck.verify.bounds import K_RULE, N_EFF_MIN, effective_samples, error_model
from flashcheck.verify.cases import Case
from flashcheck.verify.check import GRADS, _allowed_bias, _reference, _sdpa_kwargs
from flashcheck.verify.metrics import abs_error
from flashcheck.verify.strategies import cases, fixed_sweep
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hseed


def member_errors(case: Case) -> dict | None:
    inp = case.materialize("cpu")
    ref = _reference(inp.clone(), case.backward)
    members = family_members(case.torch_dtype, gqa=case.Hq != case.Hkv, tf32=case.tf32,
                             declared=OPT_IN)
    kw = _sdpa_kwargs(inp)
    mask = kw.pop("attn_mask")
    res = run_family(inp.query, inp.key, inp.value, inp.grad_out if case.backward else None,
                     mask, members=members, **kw)
    allowed, bias = _allowed_bias(inp)
    model = error_model(inp.query, inp.key, inp.value, inp.grad_out if case.backward else None,
                        allowed=allowed, bias=bias, scale=float(inp.effective_scale),
                        dtype=case.dtype, tf32=case.tf32)
    out = {}
    for n in ["out", *GRADS] if case.backward else ["out"]:
        errs = {m: abs_error(r[n], ref[n]) for m, r in res.items()}
        if not next(iter(errs.values())).numel():
            continue
        n_eff = effective_samples(errs["fa2_128"], model[n].n_sources)
        out[n] = {"n_eff": n_eff, "floor": float(model[n].floor.max()),
                  **{m: (float(e.max()), float(e.pow(2).mean().sqrt()))
                     for m, e in errs.items()}}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-n", type=int, default=96)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    drawn: list[Case] = []

    @hseed(a.seed)
    @settings(max_examples=a.draws, database=None, deadline=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(cases(dtypes=("float16", "bfloat16", "float32"), max_n=a.max_n))
    def collect(c):
        drawn.append(c)

    collect()
    all_cases = [c for c in fixed_sweep("cpu")] + drawn
    worst: dict = {}
    per_member: dict = {}
    t0 = time.time()
    for c in all_cases:
        try:
            errs = member_errors(c)
        except Exception as e:  # report, never hide
            print(f"skip {c.short()}: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        for n, d in errs.items():
            # The flush-to-zero member is judged per element where it flushes (verify/bounds.py),
            # not by its tensor-wide error: it is left out of the spread.
            names = [m for m in d if m not in ("n_eff", "floor", "ftz")]
            default = [m for m in names if m not in OPT_IN_MEMBERS]
            if len(default) < 2:
                continue
            for m in names:
                # a default member against the other default ones; an opt-in one against
                # all the default ones (how far above them it sits)
                rest = [o for o in default if o != m]
                rest_abs = max(d[o][0] for o in rest)
                rest_rms = max(d[o][1] for o in rest)
                ra = d[m][0] / rest_abs if rest_abs > 0 else (math.inf if d[m][0] > 0 else 0)
                rr = (d[m][1] / rest_rms if rest_rms > 0 else 0) if d["n_eff"] >= N_EFF_MIN \
                    else 0.0
                # Tiny inputs or dO put results in the subnormal range, where one rounding is
                # a large relative error and members differ by whole spacings: kept apart.
                # Where K x the other members' error is below the floor, the floor sets the
                # tolerance and K plays no part (e.g. one key per row: the others are exact
                # and fa2_cuda_softmax's P of the max key is 1 +- u): kept apart too.
                regime = ("subnormal" if "tiny" in c.short() else
                          "floor" if K_RULE[n] * rest_abs <= d["floor"] else "normal")
                w = worst.setdefault(regime, {}).setdefault(
                    n, {"abs": (0, "", ""), "rms": (0, "", "")})
                if m in OPT_IN_MEMBERS:
                    pass  # not part of the default spread K covers
                elif ra > w["abs"][0] and math.isfinite(ra):
                    w["abs"] = (ra, m, c.short())
                if m not in OPT_IN_MEMBERS and rr > w["rms"][0]:
                    w["rms"] = (rr, m, c.short())
                pm = per_member.setdefault(regime, {}).setdefault(m, {}).setdefault(
                    n, [0.0, "", 0.0, ""])
                if math.isfinite(ra) and ra > pm[0]:
                    pm[0], pm[1] = ra, c.short()
                if rr > pm[2]:
                    pm[2], pm[3] = rr, c.short()
    res = {"cases": len(all_cases), "seconds": round(time.time() - t0, 1),
           "draws": a.draws, "seed": a.seed, "torch": torch.__version__,
           "leave_one_out_max": worst, "per_member": per_member}
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        open(a.out, "w").write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

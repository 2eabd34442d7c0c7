"""Sort a sweep's failures into the divergence classes of docs/reports/README.md, from their
case files (the inputs are redrawn on the CPU from each file's seed).

1. fully-masked rows: the worst element of a failing out or dq is in a query row with no
   allowed key (structural mask, boolean mask, or an additive bias that is -inf on the
   whole row); the reference gives 0 there.
2. subnormals: otherwise, the inputs or dO come from the ``tiny`` distribution (subnormal in
   the dtype), so the gradients, and with tiny inputs the output, are subnormal.
5. other: neither; each is listed with its worst ratio and failing tensors.

    python scripts/classify_failures.py docs/reports/h200/runs/sdpa-cudnn [more runs...]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch
from flashcheck.verify.cases import load_case_file
from flashcheck.verify.check import _allowed_bias

WORST = re.compile(r"(\w+): \d+/\d+ elements off \(worst at \[([\d, ]+)\]")


def dead_rows(case) -> torch.Tensor:
    """(B, Hq, Nq) bool: the query rows with no allowed key."""
    allowed, bias = _allowed_bias(case.materialize("cpu"))
    if bias is not None:
        allowed = allowed & torch.isfinite(bias)
    return ~allowed.expand(case.B, case.Hq, case.Nq, case.Nk).any(-1)


def worst_in_dead_row(case, summary: str) -> bool:
    """Whether a failing out or dq has its worst element in a row with no allowed key."""
    dead = dead_rows(case)
    for name, idx in WORST.findall(summary):
        b, h, i, _ = (int(x) for x in idx.split(","))
        if name in ("out", "dq") and bool(dead[b, h, i]):
            return True
    return False


def classify(run_dir: Path) -> dict:
    report = json.loads((run_dir / "report.json").read_text())
    configs = {c["label"]: c for c in report["configs"]}
    out = {"kernel": run_dir.name, "summary": report.get("summary"), "classes": {},
           "other": []}
    for f in report["failures"]:
        path = run_dir / "failures" / Path(f["case_file"]).name
        case, _ = load_case_file(path)
        cfg = configs.get(f["config"], {})
        bad = [n for n, t in (cfg.get("tensors") or {}).items() if not t.get("passed", True)]
        if worst_in_dead_row(case, f["summary"]):
            cls = "1. fully-masked rows"
        elif "tiny" in (case.dist.get("kind"), case.grad_dist.get("kind")):
            cls = "2. subnormals"
        else:
            cls = "5. other"
            out["other"].append({"case_file": str(path), "case": case.short(),
                                 "worst_ratio": cfg.get("worst_ratio"), "tensors": bad,
                                 "summary": f["summary"].split("; replay:")[0]})
        out["classes"][cls] = out["classes"].get(cls, 0) + 1
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="sweep output folders (report.json)")
    ap.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = ap.parse_args(argv)
    results = [classify(r) for r in args.runs]
    names = ["1. fully-masked rows", "2. subnormals", "5. other"]
    print("| kernel | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for r in results:
        print(f"| {r['kernel']} | " + " | ".join(str(r["classes"].get(n, 0)) for n in names)
              + " |")
    for r in results:
        for o in r["other"]:
            print(f"\n{r['kernel']}: {o['case']} (ratio {o['worst_ratio']:.3g}; "
                  f"{', '.join(o['tensors'])})\n  {o['summary']}\n  {o['case_file']}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Two benchmark runs of ``kernels.bench`` row by row: is every configuration of ours at
least as fast as before?

    python3 scripts/bench_compare.py OLD.json NEW.json [--impl triton-fa2 ...] [--md F]

For each row of ``--impl`` (default: ours, deterministic and atomic) present in both runs
with a time, the speed ratio old ms / new ms (> 1: the new run is faster), and beside it the
same ratio of cuDNN's row (``--ref``, default sdpa-cudnn) for that configuration: the
machine's drift between the two runs, since the runs may be days apart on different
machines of one kind. A row is "slower" when its ratio is below 1 and "slower beyond drift"
when it is also below the reference's ratio times (1 - ``--noise``) (default
:data:`NOISE`). Exit 1 if any row is slower beyond drift, else 0; 2 on bad input. Changes
smaller than the noise are a question for an A/B in one process (scripts/gpu/ab_time.py),
not for two runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

KEY = ("dtype", "D", "causal", "N", "pass")
# Three pairs of full runs of the same kernels on H100s put single rows of ours below
# cuDNN's drift by up to 4.5 % (sweep.md round 26, fp16 D 128 causal 4K forward 0.964
# against 1.009), 7 rows past 5 % (round 27) and 9.2 % (round 28: round 27's run against a
# 2-round rerun, bf16 D 128 4K forward 0.924 against 1.018; two more rows past 5 %, 8.9 and
# 6.5): between-run noise the rounds of one run do not show, since the forwards run under the
# H100's software power cap and the clock it settles on moves between rounds (1.26-1.98 GHz,
# round 28). 10 %: the worst same-code row, rounded up; the smallest change two runs can
# tell apart.
NOISE = 0.10


def _rows(path: Path) -> tuple[dict, dict]:
    data = json.loads(path.read_text())
    out = {}
    for r in data["rows"]:
        if isinstance(r.get("ms"), (int, float)) and r["ms"] > 0:
            out[(r["impl"], *(r[k] for k in KEY))] = r["ms"]
    return data.get("meta", {}), out


def compare(old: dict, new: dict, impls: list[str], ref: str, noise: float) -> list[dict]:
    """One entry per row of ``impls`` timed in both runs (see the module docstring)."""
    result = []
    for key in sorted(k for k in old if k in new and k[0] in impls):
        ratio = old[key] / new[key]
        rkey = (ref, *key[1:])
        drift = old[rkey] / new[rkey] if rkey in old and rkey in new else None
        verdict = "ok" if ratio >= 1.0 else (
            "slower beyond drift" if drift is None or ratio < drift * (1.0 - noise)
            else "slower, within drift")
        result.append(dict(zip(("impl", *KEY), key, strict=True), old_ms=old[key], new_ms=new[key],
                           ratio=ratio, ref_ratio=drift, verdict=verdict))
    return result


def markdown(result: list[dict], old_meta: dict, new_meta: dict, ref: str) -> str:
    def versions(m):
        return (f"{m.get('gpu', '?')}, {m.get('date', '?')}, torch {m.get('torch', '?')}, "
                f"triton {m.get('triton', '?')}")
    lines = [f"old: {versions(old_meta)}", "", f"new: {versions(new_meta)}", "",
             f"ratio = old ms / new ms (> 1: faster now); {ref} = the same ratio of {ref}'s "
             "row (the machines' drift)", "",
             "| dtype | D | causal | N | impl | pass | old ms | new ms | ratio "
             f"| {ref} | verdict |",
             "|---|---|---|---|---|---|---:|---:|---:|---:|---|"]
    for r in result:
        ref_cell = f"{r['ref_ratio']:.3f}" if r["ref_ratio"] is not None else "n/a"
        lines.append(f"| {r['dtype']} | {r['D']} | {'yes' if r['causal'] else 'no'} | {r['N']} "
                     f"| {r['impl']} | {r['pass']} | {r['old_ms']:.3f} | {r['new_ms']:.3f} "
                     f"| {r['ratio']:.3f} | {ref_cell} | {r['verdict']} |")
    slower = [r for r in result if r["verdict"] != "ok"]
    beyond = [r for r in result if r["verdict"] == "slower beyond drift"]
    lines += ["", f"{len(result)} rows in both runs; {len(result) - len(slower)} at least as "
              f"fast; {len(slower) - len(beyond)} slower within drift; {len(beyond)} slower "
              "beyond drift"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--impl", nargs="+", default=["triton-fa2", "triton-fa2-atomic"])
    ap.add_argument("--ref", default="sdpa-cudnn")
    ap.add_argument("--noise", type=float, default=NOISE)
    ap.add_argument("--md", type=Path, default=None, help="also write the table here")
    args = ap.parse_args(argv)
    if not 0.0 <= args.noise < 1.0:
        print(f"--noise must be in [0, 1), got {args.noise}", file=sys.stderr)
        return 2
    try:
        (om, old), (nm, new) = _rows(args.old), _rows(args.new)
    except (OSError, ValueError, KeyError) as e:
        print(f"cannot read the runs: {e}", file=sys.stderr)
        return 2
    result = compare(old, new, args.impl, args.ref, args.noise)
    if not result:
        print(f"no row of {args.impl} is timed in both runs", file=sys.stderr)
        return 2
    md = markdown(result, om, nm, args.ref)
    print(md, end="")
    if args.md:
        args.md.write_text(md)
    return 1 if any(r["verdict"] == "slower beyond drift" for r in result) else 0


if __name__ == "__main__":
    sys.exit(main())

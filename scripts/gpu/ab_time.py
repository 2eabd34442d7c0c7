"""Our kernel from two source trees, timed in alternation on one GPU (an A/B of a speed change).

    python3 scripts/gpu/ab_time.py --a . --b .ab/OLD [--d 64] [--n 1024,4096] [--rounds 3]
                                   --out FILE.json

A tree is a checkout of this repository (the package ``flashcheck`` maps its ``kernels/``);
``git archive COMMIT | tar -x -C .ab/OLD`` here makes one, and the device call carries
``.ab``. Each round times every configuration of the benchmark matrix with head dim ``--d``
and length in ``--n`` (``kernels.bench.configurations``: bf16 and fp16, causal and not, B*H*N
= 2^20) once per tree, A then B, each in a fresh process with that tree first on the path,
our deterministic kernel only, in the benchmark's autotune mode and with its timing
(``kernels.bench._bench_one``: median of ``triton.testing.do_bench``, forward, backward,
forward+backward). Alternating the trees over several rounds separates a difference of the
code from drift of the machine, which a comparison of two benchmark runs made at different
times cannot (the D = 64 rows of docs/benchmarks/bench_nvidia_h200.md against the earlier
run: 5-7 % apart with the same compiled code). ``FILE.json`` holds every time and, per
configuration and pass, the median over rounds of each tree and their ratio B / A.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

_WORKER = r"""
import json, sys
import torch
from flashcheck import kernels
from flashcheck.kernels import bench
cfgs = [c for c in bench.configurations(False) if c["D"] == {d} and c["N"] in {ns}]
rows = []
with kernels.tuning("autotune"):
    for cfg in cfgs:
        rows += bench._bench_one(cfg, "triton-fa2")
        torch.cuda.empty_cache()
print("AB_ROWS " + json.dumps(rows))
"""


def _time_tree(tree: Path, d: int, ns: list[int], timeout_s: float) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(tree.resolve()), FLASHCHECK_AUTOTUNE_CACHE="0")
    proc = subprocess.run([sys.executable, "-c", _WORKER.format(d=d, ns=ns)], env=env,
                          cwd=tree, capture_output=True, text=True, timeout=timeout_s)
    for line in proc.stdout.splitlines():
        if line.startswith("AB_ROWS "):
            return json.loads(line[len("AB_ROWS "):])
    raise RuntimeError(f"{tree}: no timings (exit {proc.returncode}): {proc.stderr[-800:]}")


def summarize(times: dict[str, list[list[dict]]]) -> list[dict]:
    """Per (configuration, pass): each tree's median over rounds and the ratio B / A."""
    def key(r):
        return (r["dtype"], r["D"], r["causal"], r["N"], r["pass"])

    per: dict[tuple, dict[str, list[float]]] = {}
    for tree, rounds in times.items():
        for rows in rounds:
            for r in rows:
                if r.get("ms") is not None:
                    per.setdefault(key(r), {}).setdefault(tree, []).append(r["ms"])
    out = []
    for k, by_tree in sorted(per.items()):
        a, b = (statistics.median(by_tree[t]) if by_tree.get(t) else None for t in ("a", "b"))
        out.append(dict(zip(("dtype", "D", "causal", "N", "pass"), k, strict=True),
                        a_ms=a, b_ms=b, b_over_a=(b / a) if a and b else None,
                        a_all=by_tree.get("a", []), b_all=by_tree.get("b", [])))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", type=Path, required=True, help="tree A (e.g. this checkout)")
    ap.add_argument("--b", type=Path, required=True, help="tree B (e.g. an earlier commit)")
    ap.add_argument("--d", type=int, default=64, help="head dim of the matrix rows (64 or 128)")
    ap.add_argument("--n", default="1024,4096", help="sequence lengths, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per tree and round")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.d not in (64, 128):
        ap.error(f"--d must be 64 or 128 (the benchmark's head dims), got {args.d}")
    try:
        ns = [int(x) for x in args.n.split(",")]
    except ValueError:
        ap.error(f"--n must be comma-separated integers, got {args.n!r}")
    if not set(ns) <= {1024, 4096, 16384}:
        ap.error(f"--n must be among the benchmark's lengths 1024, 4096, 16384, got {ns}")
    if not 1 <= args.rounds <= 20:
        ap.error(f"--rounds must be in 1..20, got {args.rounds}")
    for name in ("a", "b"):
        tree = getattr(args, name)
        if not (tree / "flashcheck" / "__init__.py").is_file():
            ap.error(f"--{name}: {tree} is not a checkout of this repository "
                     "(no flashcheck/__init__.py)")
    times: dict[str, list[list[dict]]] = {"a": [], "b": []}
    for i in range(args.rounds):
        for name in ("a", "b"):
            times[name].append(_time_tree(getattr(args, name), args.d, ns, args.timeout_s))
            print(f"round {i + 1}: tree {name} timed", flush=True)
    summary = summarize(times)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(a=str(args.a), b=str(args.b), d=args.d, n=ns,
                                        rounds=args.rounds, summary=summary, times=times),
                                   indent=1) + "\n")
    for s in summary:
        ratio = "n/a" if s["b_over_a"] is None else f"{s['b_over_a']:.3f}"
        print(f"{s['dtype']:8s} D={s['D']} causal={s['causal']!s:5s} N={s['N']:5d} "
              f"{s['pass']:7s} A {s['a_ms']} ms  B {s['b_ms']} ms  B/A {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

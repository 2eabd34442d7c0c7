"""Our kernel from two source trees, timed in alternation on one GPU (an A/B of a speed change).

    python3 scripts/gpu/ab_time.py --a . --b .ab/OLD [--d 64] [--n 1024,4096] [--rounds 3]
                                   --out FILE.json

A tree is a checkout of this repository (the package ``flashcheck`` maps its ``kernels/``);
``git archive COMMIT | tar -x -C .ab/OLD`` here makes one, and the device call carries
``.ab``. Each round times every configuration of the benchmark matrix with head dim ``--d``
and length in ``--n`` (``kernels.bench.configurations``: bf16 and fp16, causal and not, B*H*N
= 2^20) once per tree, A then B in odd rounds and B then A in even ones (so that an effect
of the order, such as the GPU's clocks after the other tree's run, does not read as a
difference of the code), each in a fresh process with that tree first on the path,
our deterministic kernel only, in the benchmark's autotune mode and with its timing
(``kernels.bench._bench_one``: median of ``triton.testing.do_bench``, forward, backward,
forward+backward). Alternating the trees over several rounds separates a difference of the
code from drift of the machine, which a comparison of two benchmark runs made at different
times cannot (the D = 64 rows of docs/benchmarks/bench_nvidia_h200.md against the earlier
run: 5-7 % apart with the same compiled code). ``FILE.json`` holds every time and, per
configuration and pass, the median over rounds of each tree and their ratio B / A, and
each run's autotune picks (kernel, tuning key -> point); the log names every key whose pick
differs between the trees in a round, since in autotune mode a change to the candidate
lists moves the timed launch points without changing any compiled kernel.
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
sys.path.insert(0, {here!r})
from ab_time import autotune_picks
from flashcheck.kernels import flash_attention
print("AB_PICKS " + json.dumps(autotune_picks(flash_attention)))
"""


def autotune_picks(fa) -> dict:
    """The autotuners' choices so far in this process: per kernel ("fwd", "dkdv", "dq"),
    tuning key (repr) -> "[(tile name, size), ...] wWARPS sSTAGES". ``fa`` is the kernel
    module (``flashcheck.kernels.flash_attention`` of the tree being timed)."""
    picks = {}
    for kind in ("fwd", "dkdv", "dq"):
        cache = getattr(getattr(fa, f"_{kind}_tuned", None), "cache", None) or {}
        picks[kind] = {repr(key): f"{sorted(c.kwargs.items())} w{c.num_warps} s{c.num_stages}"
                       for key, c in cache.items()}
    return picks


def round_order(i: int) -> tuple[str, str]:
    """The trees in the order round ``i`` (from 0) times them: A first in every other round."""
    return ("a", "b") if i % 2 == 0 else ("b", "a")


def _time_tree(tree: Path, d: int, ns: list[int], timeout_s: float) -> tuple[list, dict]:
    """(timing rows, the autotuner's pick per kernel and tuning key) of one tree."""
    # the tree first; the caller's path after it, so that a Triton carried there
    # (scripts/gpu/triton_slim.sh use) times both trees
    path = os.pathsep.join(p for p in (str(tree.resolve()), os.environ.get("PYTHONPATH", ""))
                           if p)
    env = dict(os.environ, PYTHONPATH=path, FLASHCHECK_AUTOTUNE_CACHE="0")
    code = _WORKER.format(d=d, ns=ns, here=str(Path(__file__).resolve().parent))
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree,
                          capture_output=True, text=True, timeout=timeout_s)
    found = {}
    for line in proc.stdout.splitlines():
        for tag in ("AB_ROWS", "AB_PICKS"):
            if line.startswith(tag + " "):
                found[tag] = json.loads(line[len(tag) + 1:])
    if "AB_ROWS" not in found:
        raise RuntimeError(f"{tree}: no timings (exit {proc.returncode}): "
                           f"{proc.stderr[-800:]}")
    return found["AB_ROWS"], found.get("AB_PICKS", {})


def pick_differences(a: dict, b: dict) -> list[str]:
    """Lines naming each (kernel, tuning key) whose autotune pick differs between two
    trees' runs, or that only one of them tuned: where the code may be the same and the
    launch point not."""
    out = []
    for kind in sorted(set(a) | set(b)):
        pa, pb = a.get(kind, {}), b.get(kind, {})
        for key in sorted(set(pa) | set(pb)):
            if pa.get(key) != pb.get(key):
                out.append(f"{kind} {key}: A {pa.get(key, 'not tuned')} | "
                           f"B {pb.get(key, 'not tuned')}")
    return out


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
    picks: dict[str, list[dict]] = {"a": [], "b": []}
    for i in range(args.rounds):
        for name in round_order(i):
            rows, picked = _time_tree(getattr(args, name), args.d, ns, args.timeout_s)
            times[name].append(rows)
            picks[name].append(picked)
            print(f"round {i + 1}: tree {name} timed", flush=True)
        for line in pick_differences(picks["a"][-1], picks["b"][-1]):
            print(f"round {i + 1}: autotune pick differs: {line}", flush=True)
    summary = summarize(times)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(a=str(args.a), b=str(args.b), d=args.d, n=ns,
                                        rounds=args.rounds, summary=summary, times=times,
                                        picks=picks), indent=1) + "\n")
    for s in summary:
        ratio = "n/a" if s["b_over_a"] is None else f"{s['b_over_a']:.3f}"
        print(f"{s['dtype']:8s} D={s['D']} causal={s['causal']!s:5s} N={s['N']:5d} "
              f"{s['pass']:7s} A {s['a_ms']} ms  B {s['b_ms']} ms  B/A {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

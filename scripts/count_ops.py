"""How many operator calls and host syncs one case's judging makes, per stage of
``check_case`` (a PyTorch dispatch mode counts every ATen call; a sync is an operator that
must read a result back: ``.item()``, ``nonzero``, ``unique`` ...). On a GPU each non-view
call is a launch, and N worker processes time-share the GPU for them.

    OMP_NUM_THREADS=1 python scripts/count_ops.py --cases 30 [--kernel sdpa-math] [--top 12]

The cases are the GPU profile's sweep at N <= 512 (scripts/gpu/throughput.py's small cases),
run on the CPU.
"""

from __future__ import annotations

import argparse
import collections
import time

from flashcheck.verify import check as C
from flashcheck.verify.adapters import resolve_kernel
from flashcheck.verify.strategies import fixed_sweep
from torch.utils._python_dispatch import TorchDispatchMode

SYNCS = {"_local_scalar_dense", "is_nonzero", "item", "equal", "nonzero", "unique_dim",
         "_unique2", "masked_select", "unique_consecutive"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=30)
    ap.add_argument("--kernel", default="sdpa-math")
    ap.add_argument("--top", type=int, default=12, help="most called operators per stage")
    args = ap.parse_args(argv)
    stage = ["outside the stages (kernel checks, metrics, report)"]
    ops, syncs = collections.Counter(), collections.Counter()
    names = collections.defaultdict(collections.Counter)

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            n = func.__name__.split(".")[0]
            ops[stage[0]] += 1
            names[stage[0]][n] += 1
            syncs[stage[0]] += n in SYNCS
            return func(*args, **(kwargs or {}))

    span_of = C._Clock.__call__

    def labelled(self, name):  # check_case's timed stages name the counts
        span = span_of(self, name)

        class Span:
            def __enter__(self):
                stage[0] = name
                return span.__enter__()

            def __exit__(self, *exc):
                stage[0] = "outside the stages (kernel checks, metrics, report)"
                return span.__exit__(*exc)

        return Span()

    C._Clock.__call__ = labelled
    cases = [c for c in fixed_sweep("gpu") if max(c.Nq, c.Nk) <= 512][:args.cases]
    kernel = resolve_kernel(args.kernel, "cpu")
    t0 = time.perf_counter()
    with Count():
        for c in cases:
            C.check_case(kernel, c, "cpu")
    n = len(cases)
    print(f"{n} cases in {time.perf_counter() - t0:.1f} s; per case:")
    for s in ops:
        print(f"  {s:55s} {ops[s] / n:8.1f} operator calls {syncs[s] / n:6.1f} syncs")
        print("     " + ", ".join(f"{a} {b / n:.0f}" for a, b in names[s].most_common(args.top)))
    print(f"  {'total':55s} {sum(ops.values()) / n:8.1f} operator calls "
          f"{sum(syncs.values()) / n:6.1f} syncs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

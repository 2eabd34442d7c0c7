"""The deterministic backward with its dQ kernel on a second CUDA stream, timed against as-is.

    python3 scripts/gpu/bwd_streams.py [--d 64,128] [--rounds 3] --out FILE.json

The dK/dV and dQ kernels read the same inputs (Q, K, V, dO, lse and the preprocess's delta)
and write disjoint outputs, so nothing orders them but the launch order on one stream. Here
the dQ launch waits only for the preprocess (an event recorded before the dK/dV launch) and
runs on a side stream, and the caller's stream waits for it before the backward returns: the
two kernels' programs may then share the GPU, the dK/dV kernel's tail filled by dQ programs.
Nothing in the package changes: ``flash_attention._launch`` is wrapped for the run. Each
round times, per configuration (bf16, B = H = 16, N = 4096, causal and not, each ``--d``),
the backward as-is and with the side stream, in alternating order (median of
``triton.testing.do_bench``), and checks dQ, dK, dV bit for bit equal between the two.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys

import torch


@contextlib.contextmanager
def side_stream_dq():
    """``_backward`` with the dQ kernel on a side stream (see the module docstring)."""
    from flashcheck.kernels import flash_attention as fa

    orig = fa._launch
    side = torch.cuda.Stream()
    ready = []

    def launch(kind, *a, **k):
        main = torch.cuda.current_stream()
        if kind == "dkdv":
            ev = torch.cuda.Event()
            ev.record(main)
            ready.append(ev)
            return orig(kind, *a, **k)
        if kind == "dq" and ready:
            side.wait_event(ready.pop())
            with torch.cuda.stream(side):
                orig(kind, *a, **k)
            main.wait_stream(side)
            return None
        return orig(kind, *a, **k)

    fa._launch = launch
    try:
        yield
    finally:
        fa._launch = orig


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", default="64,128", help="head dims, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import triton
    import triton.testing
    from flashcheck.kernels import flash_attention as fa
    from flashcheck.kernels._common import validate

    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, rows=[])
    for D in (int(x) for x in args.d.split(",")):
        for causal in (False, True):
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, do = (torch.randn(16, 16, 4096, D, device="cuda", dtype=torch.bfloat16,
                                       generator=g) for _ in range(4))
            p = validate(q, k, v, None, 0.0, causal, None, False, None, "top_left")
            out, lse = fa._forward(q, k, v, p, False)

            def bwd(do=do, q=q, k=k, v=v, out=out, lse=lse, p=p):
                return fa._backward(do, q, k, v, out, lse, p, True, False)

            plain = bwd()
            with side_stream_dq():
                two = bwd()
            torch.cuda.synchronize()
            same = all(torch.equal(a, b) for a, b in zip(plain, two, strict=True))
            times = {"one stream": [], "two streams": []}
            for r in range(args.rounds):
                order = ("one stream", "two streams") if r % 2 == 0 else (
                    "two streams", "one stream")
                for name in order:
                    ctx = side_stream_dq() if name == "two streams" else contextlib.nullcontext()
                    with ctx:
                        times[name].append(triton.testing.do_bench(bwd, return_mode="median"))
            row = dict(D=D, causal=causal, bitwise_equal=same, ms=times,
                       median={n: statistics.median(t) for n, t in times.items()})
            row["ratio"] = row["median"]["two streams"] / row["median"]["one stream"]
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

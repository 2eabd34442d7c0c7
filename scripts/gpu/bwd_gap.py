"""The backward's time, taken four ways, to tell why kernels/bench.py's backward-only row and
its forward+backward row less the forward disagree (sweep.md round 20: the causal ordered
Gluon backward 7.2 ms alone, 6.5 from the other rows, on an H100).

    python3 scripts/gpu/bwd_gap.py --out FILE.json [--causal no,yes] [--reps N] [--d 64|128]

For our default entry (deterministic) and ``deterministic=False``, bf16, B = H = 16,
N = 4096, D = 128 (the quick bench's shape; ``--d 64`` the bench's D = 64 row, whose
forward+backward in round 22 of sweep.md took 0.6-1.6 ms more than its forward and
backward rows), each way of timing a backward:

- ``replay_flush``: the bench's own, ``triton.testing.do_bench`` of
  ``out.backward(do, retain_graph=True)`` (an L2 flush before each call);
- ``replay``: the same replay, CUDA events around each call, no flush;
- ``fresh``: a new forward before each backward, events around the backward alone;
- ``fwd_bwd_less_fwd``: do_bench of forward+backward less do_bench of the forward;

medians in ms, and per way the GPU kernels of 5 calls by name (``kernels.bench.kernel_times``:
which kernel's time moves). Run under triton 3.9 for the Gluon backward
(``. scripts/gpu/triton_slim.sh use``); the header records the backward mode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from flashcheck.kernels.bench import int_in

SHAPE = dict(B=16, H=16, N=4096, D=128)


def _events_ms(fn, before, reps: int) -> float:
    """Median of ``reps`` calls of ``fn`` timed with CUDA events, ``before()`` untimed
    ahead of each."""
    import torch
    times = []
    for _ in range(reps):
        before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(causal: bool, deterministic: bool, reps: int, d: int = SHAPE["D"]) -> dict:
    import torch
    from flashcheck.kernels import bench
    from flashcheck.kernels import flash_attention as fa
    from triton.testing import do_bench

    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (SHAPE["B"], SHAPE["H"], SHAPE["N"], d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
               .requires_grad_() for _ in range(3))
    do = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    grads = [q, k, v]

    def fwd():
        return fa.attention_ext(q, k, v, is_causal=causal, deterministic=deterministic)

    def clear():
        for t in grads:
            t.grad = None

    fwd().backward(do)  # compile and tune, untimed
    torch.cuda.synchronize()
    out = fwd()
    replay = (lambda: out.backward(do, retain_graph=True))
    held = {}

    def fresh_forward():
        clear()
        held["out"] = fwd()

    def fresh_backward():
        held["out"].backward(do)

    t_f = do_bench(fwd, return_mode="median")
    t_fb = do_bench(lambda: fwd().backward(do), grad_to_none=grads, return_mode="median")
    ways = {
        "replay_flush": do_bench(replay, grad_to_none=grads, return_mode="median"),
        "replay": _events_ms(replay, clear, reps),
        "fresh": _events_ms(fresh_backward, fresh_forward, reps),
        "fwd_bwd_less_fwd": t_fb - t_f,
    }
    kernels = {"replay": bench.kernel_times(lambda: (clear(), replay())),
               "fwd_bwd": bench.kernel_times(lambda: (clear(), fwd().backward(do))),
               "fwd": bench.kernel_times(fwd)}
    return dict(causal=causal, deterministic=deterministic, D=d, fwd_ms=t_f, fwd_bwd_ms=t_fb,
                backward_ms=ways, kernels_ms=kernels)


def _causals(text: str) -> tuple[bool, ...]:
    words = text.split(",")
    if any(w not in ("no", "yes") for w in words):
        raise argparse.ArgumentTypeError(f"must be no and/or yes separated by commas, got {text!r}")
    return tuple(w == "yes" for w in words)


def _head_dim(text: str) -> int:
    if text not in ("64", "128"):
        raise argparse.ArgumentTypeError(f"must be 64 or 128 (the bench's head dims), got {text!r}")
    return int(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON written")
    ap.add_argument("--causal", type=_causals, default=(False, True), metavar="no,yes")
    ap.add_argument("--reps", type=int_in(1, 1000), default=50,
                    help="event-timed calls per way (1-1000)")
    ap.add_argument("--d", type=_head_dim, default=SHAPE["D"], help="head dim: 64 or 128")
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("bwd_gap: needs a CUDA GPU", file=sys.stderr)
        return 2
    from flashcheck.kernels import bench
    res = dict(bench.run_meta(), shape=dict(SHAPE, D=args.d), rows=[])
    for causal in args.causal:
        for det in (True, False):
            row = measure(causal, det, args.reps, args.d)
            res["rows"].append(row)
            print(json.dumps({k: row[k] for k in ("causal", "deterministic", "backward_ms")}),
                  flush=True)
            args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

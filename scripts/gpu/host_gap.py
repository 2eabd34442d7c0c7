"""Where the whole backward's time goes beyond its kernels: host work, gaps, syncs.

    python3 scripts/gpu/host_gap.py --out FILE.json          (on a CUDA GPU)

bf16, B = H = 16, N = 4096, D 128 and 64, causal and not. Per configuration and for ours
(``_backward``, the deterministic default; ``_forward``) and cuDNN's (autograd through SDPA;
its forward), alternated
over ``--rounds`` rounds: ``triton.testing.do_bench``'s median (the bench's timer); the
same call captured once in a CUDA graph and replayed (no host work on the timed path);
the kernels' own durations from the profiler; the host time of one call while the GPU is
busy; and whether the call synchronises with the device
(``torch.cuda.set_sync_debug_mode``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from functools import partial
from pathlib import Path

import torch
from flashcheck.kernels.bench import kernel_times


def _graph_ms(fn, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _host_ms(fn, reps=20):
    big = torch.empty(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    for _ in range(20):  # keep the GPU busy so that no call waits for it
        big @ big
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) / reps * 1e3
    torch.cuda.synchronize()
    return host


def _syncs(fn):
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            fn()
        return [str(x.message)[:200] for x in w]
    finally:
        torch.cuda.set_sync_debug_mode("default")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    import torch.nn.functional as F
    import triton
    import triton.testing
    from flashcheck.kernels import _common
    from flashcheck.kernels import flash_attention as fa
    from torch.nn.attention import SDPBackend, sdpa_kernel

    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, rows=[])
    for D in (128, 64):
        for causal in (False, True):
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, do = (torch.randn(16, 16, 4096, D, device="cuda", dtype=torch.bfloat16,
                                       generator=g) for _ in range(4))
            p = _common.validate(q, k, v, None, 0.0, causal, None, False, None, "top_left")
            o, lse = fa._forward(q, k, v, p, False)
            ours = partial(fa._backward, do, q, k, v, o, lse, p, True, False)
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                y = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
            cudnn = partial(torch.autograd.grad, y, (qg, kg, vg), do, retain_graph=True)

            def cudnn_fwd(q=q, k=k, v=v, causal=causal):
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            fns = (("ours", ours), ("cudnn", cudnn),
                   ("ours_fwd", partial(fa._forward, q, k, v, p, False)),
                   ("cudnn_fwd", cudnn_fwd))
            row = dict(D=D, causal=causal, rounds=[])
            for _ in range(args.rounds):
                rnd = {}
                for name, fn in fns:
                    rnd[name] = dict(do_bench=triton.testing.do_bench(fn, return_mode="median"))
                    if name != "cudnn":  # autograd's engine cannot be captured here
                        rnd[name]["graph"] = _graph_ms(fn)
                row["rounds"].append(rnd)
            for name, fn in fns:
                row[name] = dict(kernels=kernel_times(fn), host_ms=_host_ms(fn),
                                 syncs=_syncs(fn))
            print(json.dumps(row), flush=True)
            res["rows"].append(row)
            args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Whether the backward's two speeds follow where its tensors lie (sweep.md rounds 21–22:
the causal ordered Gluon backward at 6.2 ms in one process and 7.3 in another, on the same
GPU at the same clocks, cuDNN unchanged).

    python3 scripts/gpu/bwd_alloc.py --out FILE.json [--allocs N] [--seed S] [--empty-cache]
                                     [--small-pad] [--turn-stride 1|32]

In one process, for each of ``--allocs`` placements (a pad tensor of random size, kept alive,
moves the next allocations), fresh q, k, v, dO (bf16, B = H = 16, N = 4096, D = 128) and the
backward timed twice with the bench's own ``do_bench`` (L2 flush before each call), some
other work between the two: ours deterministic and ``deterministic=False``, causal, and
cuDNN's causal backward on the same tensors as the control. Two speeds that follow the
placement show as pairs that agree with each other and disagree across placements; speeds
that do not repeat within a placement point elsewhere (the schedule, the process). The
tensors' addresses are recorded with each row. ``--empty-cache``: the caching allocator
emptied before each placement and between the timed implementations, as ``kernels.bench``
empties it after every row (each row then on freshly mapped memory). ``--small-pad``: also a
pad below 1 MiB, which moves what the allocator's small pool hands out next: among it the
deterministic backward's turn counters (one int32 per query tile and head-dim half, 128 KiB
at this shape, polled by every program's writer warp), which the large pads never move.
``--turn-stride 32``: the counters a 128-byte line apart
(``flash_attention_gluon_bwd.TURN_STRIDE``), so that no two share a line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from flashcheck.kernels.bench import int_in

SHAPE = (16, 16, 4096, 128)


def _timed_backward(fwd, do, grads) -> float:
    from triton.testing import do_bench
    out = fwd()
    return do_bench(lambda: out.backward(do, retain_graph=True), grad_to_none=grads,
                    return_mode="median")


def placement(i: int, rng: random.Random, pads: list, empty_cache: bool = False,
              small_pad: bool = False) -> dict:
    import torch
    import torch.nn.functional as F
    from flashcheck.kernels import flash_attention as fa
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if empty_cache:
        torch.cuda.empty_cache()
    pad_bytes = rng.randrange(0, 64 << 20, 4096)
    pads.append(torch.empty(pad_bytes, dtype=torch.uint8, device="cuda"))
    small_bytes = rng.randrange(0, 1 << 20, 512) if small_pad else 0
    pads.append(torch.empty(small_bytes, dtype=torch.uint8, device="cuda"))
    gen = torch.Generator(device="cuda").manual_seed(i)
    q, k, v = (torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16, generator=gen)
               .requires_grad_() for _ in range(3))
    do = torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16, generator=gen)
    grads = [q, k, v]
    impls = {
        "ours_det": lambda: fa.attention_ext(q, k, v, is_causal=True, deterministic=True),
        "ours_atomic": lambda: fa.attention_ext(q, k, v, is_causal=True, deterministic=False),
    }

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    impls["cudnn"] = cudnn
    row = dict(placement=i, pad_bytes=pad_bytes, small_pad_bytes=small_bytes,
               ptrs={n: t.data_ptr() for n, t in zip("qkvd", (q, k, v, do), strict=True)}, ms={})
    for _ in range(2):  # the second time after the others ran
        for name, fwd in impls.items():
            row["ms"].setdefault(name, []).append(_timed_backward(fwd, do, grads))
            if empty_cache:
                torch.cuda.empty_cache()
    return row


def _stride(text: str) -> int:
    """A turn stride the backward accepts (flash_attention_gluon_bwd.TURN_STRIDES)."""
    from flashcheck.kernels.flash_attention_gluon_bwd import TURN_STRIDES
    if text not in TURN_STRIDES:
        raise argparse.ArgumentTypeError(f"must be {' or '.join(TURN_STRIDES)}, got {text!r}")
    return int(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON written")
    ap.add_argument("--allocs", type=int_in(1, 200), default=16, help="placements (1-200)")
    ap.add_argument("--seed", type=int, default=0, help="the pads' sizes")
    ap.add_argument("--empty-cache", action="store_true",
                    help="empty the caching allocator between timings, as kernels.bench does")
    ap.add_argument("--small-pad", action="store_true",
                    help="also a pad below 1 MiB per placement (moves the small pool's blocks)")
    ap.add_argument("--turn-stride", type=_stride, default=1,
                    help="the ordered backward's turn counters this many int32 apart "
                         "(TURN_STRIDES: 1 or 32)")
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("bwd_alloc: needs a CUDA GPU", file=sys.stderr)
        return 2
    from flashcheck.kernels import bench
    from flashcheck.kernels import flash_attention_gluon_bwd as gb
    gb.TURN_STRIDE = args.turn_stride
    res = dict(bench.run_meta(), shape=SHAPE, empty_cache=args.empty_cache,
               small_pad=args.small_pad, turn_stride=args.turn_stride, rows=[])
    rng, pads = random.Random(args.seed), []
    for i in range(args.allocs):
        row = placement(i, rng, pads, args.empty_cache, args.small_pad)
        res["rows"].append(row)
        print(json.dumps({"placement": i, "ms": {k: [round(x, 3) for x in v]
                                                for k, v in row["ms"].items()}}), flush=True)
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

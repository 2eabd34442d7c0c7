"""Speed of our varlen and paged-decode kernels beside their peers, as JSON (CUDA only).

    python scripts/gpu/bench_ragged.py --out bench_ragged.json [--quick]

varlen (prefill over packed sequences, causal, GQA 32/8, D = 128, fp16 and bf16): 8
sequences with seeded lengths in [256, 4096] (one 4096 among them), forward and forward +
backward, against FlexAttention compiled with a document block mask (``create_block_mask``
over document ids: only the blocks of a sequence's own causal triangle run) and SDPA called
once per sequence. decode (one new token, paged cache): 32 sequences with seeded cache
lengths in [512, 8192], against SDPA per sequence on the keys gathered from the pages and,
when importable, fasterkernels' Triton ``paged_flash_decode`` (page 16 and 256).

Timing: ``triton.testing.do_bench`` (median of its repetitions, the L2 cache flushed between
them). TFLOP/s count the causal half of each sequence's QKᵀ and PV (4·Lq·Lk·D·H / 2 per
sequence; backward 2.5× the forward); decode GB/s count the K and V bytes of the valid keys.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

HQ, HKV, D = 32, 8, 128


def _lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    out = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    out[0] = hi
    return out


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")


def _bench(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100))


def _varlen_rows(dtype, quick: bool) -> list[dict]:
    from flashcheck.kernels import attention_varlen
    from flashcheck.verify.ragged import sdpa_varlen
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    lens = _lengths(4 if quick else 8, 256, 2048 if quick else 4096, 0)
    total = sum(lens)
    cu = _cu(lens)
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(total, HQ, D, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(total, HKV, D, device="cuda", dtype=dtype, generator=g)
            for _ in range(2))
    do = torch.randn_like(q)
    flops = sum(4 * n * n * D * HQ / 2 for n in lens)
    doc = torch.repeat_interleave(torch.arange(len(lens), device="cuda"),
                                  torch.tensor(lens, device="cuda"))

    def doc_causal(b, h, qi, kj):
        return (doc[qi] == doc[kj]) & (kj <= qi)

    mask = create_block_mask(doc_causal, 1, 1, total, total, device="cuda")
    flex = torch.compile(flex_attention, dynamic=False)
    m = max(lens)
    runs = {
        "triton-varlen": lambda a, b, c: attention_varlen(a, b, c, cu, cu, m, m, is_causal=True),
        "flex-document-mask": lambda a, b, c: flex(
            a.transpose(0, 1).unsqueeze(0), b.transpose(0, 1).unsqueeze(0),
            c.transpose(0, 1).unsqueeze(0), block_mask=mask, enable_gqa=True)[0].transpose(0, 1),
        "sdpa-per-sequence": lambda a, b, c: sdpa_varlen(a, b, c, cu, cu, m, m, is_causal=True),
    }
    rows = []
    for name, fn in runs.items():
        row = {"api": "varlen", "kernel": name, "dtype": str(dtype).removeprefix("torch."),
               "seqlens": lens, "Hq": HQ, "Hkv": HKV, "D": D, "causal": True}
        try:
            fwd = _bench(lambda fn=fn: fn(q, k, v))
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]

            def fb(fn=fn, leaves=leaves):
                out = fn(*leaves)
                torch.autograd.grad(out, leaves, do)

            both = _bench(fb)
            row.update(fwd_ms=fwd, fwd_bwd_ms=both, fwd_tflops=flops / fwd / 1e9,
                       fwd_bwd_tflops=3.5 * flops / both / 1e9)
        except Exception as e:  # a peer that cannot run this shape: recorded, not fatal
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _decode_rows(dtype, page: int, quick: bool) -> list[dict]:
    from flashcheck.kernels import attention_decode
    from flashcheck.verify.ragged import sdpa_decode

    lens = _lengths(8 if quick else 32, 512, 8192, 2)
    B = len(lens)
    need = [-(-n // page) for n in lens]
    pool = sum(need)
    perm = torch.randperm(pool, generator=torch.Generator().manual_seed(3))
    width = max(need)
    table = torch.zeros(B, width, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at:at + n].to(torch.int32)
        at += n
    table = table.cuda()
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(4)
    q = torch.randn(B, 1, HQ, D, device="cuda", dtype=dtype, generator=g)
    kc, vc = (torch.randn(pool, page, HKV, D, device="cuda", dtype=dtype, generator=g)
              for _ in range(2))
    kv_bytes = 2 * sum(lens) * HKV * D * q.element_size()
    runs = {"triton-decode": lambda: attention_decode(q, kc, vc, seqlens, table),
            "sdpa-per-sequence": lambda: sdpa_decode(q, kc, vc, seqlens, table)}
    try:
        from fskernels.paged_attn.triton_paged_attn import paged_flash_decode

        kt, vt = kc.transpose(1, 2), vc.transpose(1, 2)
        runs["fasterkernels-paged"] = lambda: paged_flash_decode(q[:, 0], kt, vt, table,
                                                                 seqlens, page)
    except ImportError:
        pass
    rows = []
    for name, fn in runs.items():
        row = {"api": "decode", "kernel": name, "dtype": str(dtype).removeprefix("torch."),
               "page_size": page, "cache_seqlens": lens, "Nq": 1, "Hq": HQ, "Hkv": HKV,
               "D": D}
        try:
            ms = _bench(fn)
            row.update(ms=ms, kv_gbps=kv_bytes / ms / 1e6)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="fewer, shorter sequences")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_ragged: needs CUDA", file=sys.stderr)
        return 2
    import triton

    rows = []
    for dtype in (torch.float16, torch.bfloat16):
        rows += _varlen_rows(dtype, args.quick)
        for page in (16, 256):
            rows += _decode_rows(dtype, page, args.quick)
    doc = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "command": " ".join(sys.argv), "rows": rows}
    Path(args.out).write_text(json.dumps(doc, indent=1, allow_nan=True) + "\n")
    bad = [r for r in rows if r["kernel"].startswith("triton") and "error" in r]
    return 1 if bad or any(math.isnan(r.get("ms", 0.0)) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

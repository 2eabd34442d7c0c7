"""Shared-memory wavefronts of a warpgroup's fp32 accumulator stored to an NVMMA-swizzled
tile, as the Gluon backward stages its dQ tile for the bulk add (no GPU).

    python3 scripts/smem_bank_conflicts.py [--cols 64] [--swizzle 128 64 32]
                                           [--b 16 --h 16 --n 4096 --d 128]

The wgmma accumulator layout (m64nNk16, fp32): thread t of a warp holds rows t // 4 and
t // 4 + 8 of its warp's 16, columns 8 j + 2 (t % 4) + {0, 1}, so one 64-bit store per
(row half, j) writes 8 bytes per thread. The NVMMA shared layout of swizzle S bytes stores
the tile as column blocks of S bytes, each rows x S, with 16-byte chunk c of row r at
c ^ ((r // (128 / S)) % (S / 16)). The hardware splits a warp's 64-bit store into two
half-warps of 128 bytes; a half-warp takes as many wavefronts as the most distinct 4-byte
words any one of the 32 banks receives. At S = 128 a half-warp's rows r and r ^ 1 land on
the same two chunks: 2 wavefronts where 1 does.

With --b/--h/--n/--d it also predicts the conflicts ncu counts
(``l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum``: wavefronts beyond one per
half-warp) for the deterministic backward's dQ stores at that shape: every (key block,
query tile) of both consumer warpgroups stores a [64, D / 2] tile. The H100 profile of
docs/benchmarks/profile_h100.md (B = H = 16, N = 4096, D = 128) measured 135.7 M, all
stores of the kernel; this model gives 134.2 M for the dQ tiles alone at S = 128, 0 at 32.
"""

from __future__ import annotations

import argparse
import sys

ROWS = 64  # one warpgroup's accumulator rows (4 warps x 16)
BANKS, WORD = 32, 4


def address(r: int, c: int, swizzle: int, rows: int = ROWS) -> int:
    """Byte offset of fp32 element (r, c) in an NVMMA tile of ``rows`` rows, swizzle S."""
    per_phase, max_phase = 128 // swizzle, swizzle // 16
    block, cc = divmod(c, swizzle // WORD)
    chunk = cc * WORD // 16
    phase = (r // per_phase) % max_phase
    return block * rows * swizzle + r * swizzle + (chunk ^ phase) * 16 + (cc * WORD) % 16


def store_wavefronts(swizzle: int, j: int, row0: int = 0, half: int = 0) -> list[int]:
    """Wavefronts of each half-warp for one warp's 64-bit store of column group ``j``
    (rows row0 + t // 4 (+ 8 for ``half`` 1))."""
    out = []
    for threads in (range(16), range(16, 32)):
        words: dict[int, set[int]] = {}
        for t in threads:
            r, c = row0 + t // 4 + 8 * half, 8 * j + 2 * (t % 4)
            a = address(r, c, swizzle)
            for w in (a, a + WORD):
                words.setdefault((w // WORD) % BANKS, set()).add(w // WORD)
        out.append(max(len(s) for s in words.values()))
    return out


def tile_excess(swizzle: int, cols: int) -> int:
    """Wavefronts beyond one per half-warp for one warpgroup's whole [64, cols] tile."""
    excess = 0
    for warp in range(ROWS // 16):
        for half in (0, 1):
            for j in range(cols // 8):
                excess += sum(w - 1 for w in store_wavefronts(swizzle, j, 16 * warp, half))
    return excess


def predicted_conflicts(swizzle: int, b: int, h: int, n: int, d: int) -> int:
    """ncu's store bank conflicts of the dQ tiles for one non-causal backward (B, H, N, D):
    N / 128 programs per head, each two warpgroups over N / 64 query tiles."""
    tiles = b * h * (n // 128) * 2 * (n // 64)
    return tiles * tile_excess(swizzle, d // 2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cols", type=int, default=64, help="fp32 columns of the tile (D / 2)")
    ap.add_argument("--swizzle", type=int, nargs="+", default=[128, 64, 32])
    for name in ("b", "h", "n", "d"):
        ap.add_argument(f"--{name}", type=int, default=None)
    args = ap.parse_args(argv)
    bad = [s for s in args.swizzle if s not in (32, 64, 128)]
    if bad:
        print(f"--swizzle must be among 32, 64, 128, got {bad}", file=sys.stderr)
        return 2
    if args.cols <= 0 or args.cols % 8:
        print(f"--cols must be a positive multiple of 8, got {args.cols}", file=sys.stderr)
        return 2
    shape = [args.b, args.h, args.n, args.d]
    if any(v is not None for v in shape):
        if any(v is None or v <= 0 for v in shape) or args.n % 128:
            print("--b, --h, --n and --d go together, each > 0, --n a multiple of 128",
                  file=sys.stderr)
            return 2
    for s in args.swizzle:
        per_store = store_wavefronts(s, 0)
        line = (f"swizzle {s:3d}: {per_store} wavefronts per half-warp store (1 is the least); "
                f"excess per [64, {args.cols}] tile {tile_excess(s, args.cols)}")
        if args.b is not None:
            line += f"; predicted store conflicts {predicted_conflicts(s, *shape):,}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

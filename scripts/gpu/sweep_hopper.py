"""Launch-configuration sweep of our kernel's three kernels on a Hopper GPU.

    python3 scripts/gpu/sweep_hopper.py --jobs 14 --out DIR [--d D] [--dtype bfloat16]
                                        [--set SET]   (SET: one of SETS below)

``--d`` defaults to the head dim the set is meant for (``SET_D``: 64 for the D 64 sets,
else 128).

Each variant is (kind, point, tma, ws) with kind "fwd", "dkdv" or "dq", point = (outer,
inner, warps, stages) as in ``kernels._common`` and tma/ws the Hopper flags. Three phases:

1. compile: ``--jobs`` processes share Triton's cache and run every variant once on a small
   problem (B=1, H=2, N=512, causal and not), recording the compile time, an exception if
   any, and the largest difference of O, dQ, dK, dV from the same call with every kernel
   on the pointer path at the table's point (0 for a descriptor variant of the table's
   point; a rounding-level difference where the tile shape changes the order of the sums);
2. time: one process, alone on the GPU, times each variant that compiled at the benchmark
   shape (B=16, H=16, N=4096) with ``triton.testing.do_bench`` (median): a fwd variant as
   ``_forward``; a dkdv or dq variant as the whole deterministic ``_backward`` with the other
   kernel at the table's point; cuDNN (SDPA) beside them;
3. ``sweep.json``: every variant's compile record and times, and the best variant per
   (kind, causal).

Variants are forced by patching ``_common.launch_point`` and
``flash_attention._hopper_flags`` for the run; nothing here changes the package. The
rounds behind the committed tables: docs/benchmarks/sweep/ and docs/benchmarks/sweep.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

# The set that decided kernels._common's tables (docs/benchmarks/sweep.md): the forward's
# 256-row tiles (two 128-row halves) beside the best 128-row ones, and the backward kernels'
# points on the pointer path, with descriptors, and with descriptors and warp specialisation.
FWD_POINTS = [(256, 64, 8, 2), (256, 64, 8, 3), (256, 64, 8, 4), (256, 32, 8, 3),
              (256, 128, 8, 2), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 2)]
DKDV_POINTS = [(128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3),
               (64, 32, 4, 3), (128, 64, 8, 1)]
DQ_POINTS = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (128, 128, 8, 2),
             (64, 64, 4, 3)]
MODES = ((False, False), (True, False), (True, True))  # (tma, ws)
# The "rows" set: the dK/dV kernel with its per-row lse and delta read through descriptors
# (ROWS) beside the table's descriptor path without them, with and without warp
# specialisation, at the points of the table's neighbourhood.
ROWS_POINTS = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (128, 32, 8, 4),
               (64, 64, 4, 3), (128, 64, 8, 1)]
ROWS_MODES = ((True, False, False), (True, False, True), (True, True, True))  # tma, ws, rows
# The "early" set: each backward kernel at its table point with its dP product issued before
# the exponentials (EARLY) or after them, the other kernel at its table point and flags (so
# both EARLY=False variants time the table's backward).
EARLY_VARIANTS = [("dkdv", (128, 64, 8, 2), False, True, False),
                  ("dkdv", (128, 64, 8, 2), False, True, True),
                  ("dkdv", (128, 64, 8, 3), False, True, True),
                  ("dkdv", (128, 64, 8, 2), True, True, True),
                  ("dq", (128, 64, 8, 3), True, False, False),
                  ("dq", (128, 64, 8, 3), True, False, True),
                  ("dq", (128, 64, 8, 2), True, False, True)]  # kind, point, ws, rows, early
# The "reduce" set: the non-deterministic backward (dQ added inside the dK/dV kernel) at the
# dK/dV table point, dQ tiles by one bulk reduce-add each through a descriptor or by
# per-element fp32 atomics, EARLY off and on.
REDUCE_VARIANTS = [(reduce, early) for reduce in (True, False) for early in (False, True)]
# The "occupancy" set: the forward as PERSIST programs per multiprocessor looping over the
# tiles (0: one program per tile), and 128-row tiles at 4 warps held as two 64-row halves
# (HALVES; two programs fit on a multiprocessor at 2 stages), beside the same points plain;
# each (point, persist, halves). And the dK/dV kernel at 4 warps (64-row key tiles: two or
# more programs per multiprocessor) with the table's flags (descriptors, ROWS), EARLY off
# and on; each (point, early).
PERSIST_VARIANTS = [((256, 64, 8, 3), 0, False), ((256, 64, 8, 3), 1, False),
                    ((256, 64, 8, 4), 0, False), ((256, 64, 8, 4), 1, False),
                    ((128, 64, 4, 2), 0, False), ((128, 64, 4, 2), 0, True),
                    ((128, 64, 4, 2), 2, True), ((128, 64, 4, 3), 0, True),
                    ((128, 32, 4, 2), 0, True), ((128, 32, 4, 3), 0, True)]
OCC_DKDV = [((64, 32, 4, 3), False), ((64, 32, 4, 3), True), ((64, 32, 4, 2), True),
            ((64, 64, 4, 2), True), ((128, 64, 8, 2), True)]
# The "dkdv4" set: the dK/dV kernel at 4 warps around the occupancy set's best point, with
# the table's point first and last in the same run (EARLY as the table takes it: without a
# band only; its two times show the run's drift); each (point, early), descriptors and ROWS
# on.
DKDV4 = [((64, 64, 4, 2), False), ((64, 64, 4, 2), True), ((64, 64, 4, 3), False),
         ((64, 64, 4, 3), True), ((64, 64, 4, 1), True), ((64, 32, 4, 2), False),
         ((64, 32, 4, 2), True), ((64, 32, 4, 3), True)]
# The "dq4" set: the dQ kernel at 4 warps (two programs per multiprocessor where registers
# and shared memory allow), descriptors on, warp specialisation off (it does not compile at
# 4 warps), EARLY off and on, beside the table's point first and last; each (point, early).
DQ4 = [((64, 64, 4, 2), False), ((64, 64, 4, 2), True), ((64, 64, 4, 3), False),
       ((64, 128, 4, 2), False), ((128, 64, 4, 2), False), ((64, 32, 4, 3), False)]
# The "dkdv64" set (head dim 64, SET_D): the dK/dV kernel's autotune candidates at head dim 64
# before and after the 4-warp change of the D 128 grid (which the D 64 rows shared), and the
# 4-warp 64-row points, on the pointer path with the table's flags; the table's point as it
# was before this set (128, 64, 8, 3) timed first and last (its two times are the run's
# drift); the benchmark's autotune mode picks among some of them.
DKDV64 = [(64, 32, 4, 3), (128, 64, 8, 1), (128, 64, 8, 2), (64, 32, 4, 2), (64, 64, 4, 2),
          (64, 64, 4, 3)]
# The "d64" set (head dim 64, SET_D): the three kernels at head dim 64 with descriptors, which
# only the D 128 rows were swept with, beside their table points on the pointer path; the
# forward also at 256-row tiles (two 128-row halves, as at D 128) and 8 warps; each
# (kind, point, tma, ws, rows, early, halves). The table's points are those of commit
# 7a2d11f.
D64_VARIANTS = [("fwd", (128, 64, 4, 3), False, False, False, False, False),
                ("fwd", (128, 64, 4, 3), True, False, False, False, False),
                ("fwd", (128, 64, 4, 2), True, False, False, False, True),
                ("fwd", (128, 64, 8, 3), False, False, False, False, False),
                ("fwd", (128, 128, 4, 3), True, False, False, False, False),
                ("fwd", (256, 64, 8, 3), False, False, False, False, False),
                ("fwd", (256, 64, 8, 3), True, False, False, False, False),
                ("fwd", (256, 64, 8, 4), True, False, False, False, False),
                ("dq", (128, 64, 8, 3), False, False, False, False, False),
                ("dq", (128, 64, 8, 3), True, False, False, False, False),
                ("dq", (128, 64, 8, 3), True, True, False, False, False),
                ("dq", (128, 64, 8, 3), True, False, False, True, False),
                ("dq", (64, 64, 4, 2), True, False, False, False, False),
                ("dq", (128, 128, 8, 3), True, False, False, False, False),
                ("dkdv", (64, 64, 4, 3), False, False, False, False, False),
                ("dkdv", (64, 64, 4, 3), True, False, False, False, False),
                ("dkdv", (64, 64, 4, 3), True, False, True, False, False),
                ("dkdv", (64, 64, 4, 3), True, False, True, True, False),
                ("dkdv", (64, 64, 4, 2), False, False, False, False, False),
                ("dkdv", (64, 64, 4, 2), True, False, True, False, False)]
# The "ws" set: every kernel with descriptors and a warp-specialised tile loop (Triton's
# producer/consumer split of the loop, which newer Triton releases extend on Hopper), the
# forward at 256-row tiles (two 128-row halves) and at the 128-row points such a split is
# built for, 8 and 4 warps; the backward kernels at their table points with the split on;
# the non-causal table's forward point (3 stages) first and last, for the causal rows too
# (the causal table's has 4), and its descriptor form without the split. Each (kind, point,
# tma, ws, rows, early).
WS_TABLE = ("fwd", (256, 64, 8, 3), False, False, False, False)
WS_VARIANTS = [("fwd", (256, 64, 8, 3), True, False, False, False),
               ("fwd", (256, 64, 8, 3), True, True, False, False),
               ("fwd", (256, 64, 8, 2), True, True, False, False),
               ("fwd", (256, 128, 8, 2), True, True, False, False),
               ("fwd", (128, 128, 8, 3), True, True, False, False),
               ("fwd", (128, 128, 8, 2), True, True, False, False),
               ("fwd", (128, 64, 8, 3), True, True, False, False),
               ("fwd", (128, 128, 4, 2), True, True, False, False),
               ("fwd", (128, 64, 4, 3), True, True, False, False),
               ("dq", (128, 64, 8, 3), True, True, False, False),
               ("dkdv", (64, 64, 4, 2), True, False, True, True),
               ("dkdv", (64, 64, 4, 2), True, True, True, True),
               ("dkdv", (128, 64, 8, 2), True, True, True, True)]
# The "confirm128" and "confirm64" sets: the candidates that rounds 11 and 12 timed once
# faster than the table, each alternated with the table's point (table, candidates, table,
# candidates, table), so that every candidate time has a table time on either side; the
# table's point and flags as of commit 7a2d11f, when those rounds ran. Each
# (causal, table variant, candidate variants), a variant being (kind, point, tma, ws, rows,
# early).
CONFIRM = {
    "confirm128": [(True, ("fwd", (256, 64, 8, 4), False, False, False, False),
                    [("fwd", (128, 128, 8, 3), True, True, False, False),
                     ("fwd", (128, 128, 8, 3), True, False, False, False)])],
    "confirm64": [(False, ("dkdv", (64, 64, 4, 3), False, False, False, False),
                   [("dkdv", (64, 64, 4, 3), True, False, True, False)]),
                  (True, ("dkdv", (64, 64, 4, 2), False, False, False, False),
                   [("dkdv", (64, 64, 4, 3), True, False, True, False),
                    ("dkdv", (64, 64, 4, 3), True, False, True, True)]),
                  (True, ("dq", (128, 64, 8, 3), False, False, False, False),
                   [("dq", (128, 64, 8, 3), True, False, False, False),
                    ("dq", (128, 64, 8, 3), True, True, False, False)])],
}
CONFIRM_REPEATS = 2
SETS = ("tables", "rows", "early", "reduce", "occupancy", "dkdv4", "dq4", "dkdv64", "d64", "ws",
        *CONFIRM)
# The head dim each set is run with unless --d says otherwise.
SET_D = {"dkdv64": 64, "d64": 64, "confirm64": 64}


def _flagged(var: tuple, causal: bool, **over) -> dict:
    """A variant given as (kind, point, tma, ws, rows, early), ``over`` replacing or adding
    flags; the other kernel at its table point and flags."""
    kind, pt, tma, ws, rows, early = var
    return dict(kind=kind, point=list(pt), tma=tma, ws=ws, rows=rows, early=early,
                others="table", causal=causal) | over


def variants(which: str = "tables") -> list[dict]:
    if which not in SETS:
        raise ValueError(f"--set must be one of {SETS}, got {which!r}")
    out = []
    if which == "dq4":
        table = [((128, 64, 8, 3), True, False)]  # (point, ws, early)
        for causal in (False, True):
            for pt, ws, early in table + [(pt, False, e) for pt, e in DQ4] + table:
                out.append(dict(kind="dq", point=list(pt), tma=True, ws=ws, early=early,
                                others="table", causal=causal))
        return out
    if which in CONFIRM:
        for causal, table, cands in CONFIRM[which]:
            out += [_flagged(var, causal) for var in [table] + (cands + [table]) * CONFIRM_REPEATS]
        return out
    if which == "ws":
        for causal in (False, True):
            out += [_flagged(var, causal, early=var[5] and not causal)
                    for var in [WS_TABLE] + WS_VARIANTS + [WS_TABLE]]
        return out
    if which == "d64":
        for causal in (False, True):
            out += [_flagged(var[:6], causal, halves=var[6]) for var in D64_VARIANTS]
        return out
    if which == "dkdv64":
        table = [(128, 64, 8, 3)]  # HEURISTIC_TABLE's D <= 64 point before round 10
        for causal in (False, True):
            for pt in table + DKDV64 + table:
                out.append(dict(kind="dkdv", point=list(pt), tma=False, ws=False, rows=False,
                                early=False, others="table", causal=causal))
        return out
    if which == "dkdv4":
        for causal in (False, True):
            table = [((128, 64, 8, 2), not causal)]
            for pt, early in table + DKDV4 + table:
                out.append(dict(kind="dkdv", point=list(pt), tma=True, ws=False, rows=True,
                                early=early, others="table", causal=causal))
        return out
    if which == "occupancy":
        for causal in (False, True):
            for pt, persist, halves in PERSIST_VARIANTS:
                for tma in (False, True) if pt[0] == 128 else (False,):
                    out.append(dict(kind="fwd", point=list(pt), tma=tma, ws=False,
                                    persist=persist, halves=halves, causal=causal))
            for pt, early in OCC_DKDV:
                out.append(dict(kind="dkdv", point=list(pt), tma=True, ws=False, rows=True,
                                early=early, others="table", causal=causal))
        return out
    if which == "reduce":
        for causal in (False, True):
            for reduce, early in REDUCE_VARIANTS:
                out.append(dict(kind="dkdv", point=[128, 64, 8, 2], tma=True, ws=False,
                                rows=True, early=early, atomic=True, reduce=reduce,
                                others="table", causal=causal))
        # Smaller query tiles: a smaller dQ tile in registers beside dK and dV.
        for causal in (False, True):
            out.append(dict(kind="dkdv", point=[128, 32, 8, 2], tma=True, ws=False, rows=True,
                            early=False, atomic=True, reduce=True, others="table",
                            causal=causal))
        return out
    if which == "early":
        for causal in (False, True):
            for kind, pt, ws, rows, early in EARLY_VARIANTS:
                out.append(dict(kind=kind, point=list(pt), tma=True, ws=ws, rows=rows,
                                early=early, others="table", causal=causal))
        return out
    if which == "rows":
        for causal in (False, True):
            for pt, (tma, ws, rows) in itertools.product(ROWS_POINTS, ROWS_MODES):
                out.append(dict(kind="dkdv", point=list(pt), tma=tma, ws=ws, rows=rows,
                                causal=causal))
        return out
    for causal in (False, True):
        for pt, tma in itertools.product(FWD_POINTS, (False, True)):
            out.append(dict(kind="fwd", point=list(pt), tma=tma, ws=False, causal=causal))
        for kind, pts in (("dkdv", DKDV_POINTS), ("dq", DQ_POINTS)):
            for pt, (tma, ws) in itertools.product(pts, MODES):
                out.append(dict(kind=kind, point=list(pt), tma=tma, ws=ws, causal=causal))
        # For reference: dQ by fp32 atomics inside the dK/dV kernel (deterministic=False).
        out.append(dict(kind="dkdv", point=[128, 64, 8, 2], tma=True, ws=False,
                        atomic=True, causal=causal))
    return out


def _forced(var: dict | None):
    """Context: the package launches ``var`` for its kind (point, TMA, WS, ROWS, EARLY,
    PERSIST, HALVES);
    every other kind at the table's point, on the pointer path unless ``var["others"]`` is
    "table" (then with the table's flags too). The forward is the Triton one throughout (its
    Gluon path off: the sweep times the Triton kernels' launch points)."""
    from flashcheck.kernels import _common
    from flashcheck.kernels import flash_attention as fa

    class Ctx:
        def __enter__(self):
            self.orig_lp = _common.launch_point
            self.orig_hf = fa._hopper_flags
            self.orig_ur = _common.use_reduce
            self.gluon = _common.gluon("off")
            self.gluon.__enter__()
            if var is not None and "reduce" in var:
                _common.use_reduce = lambda device: bool(var["reduce"])

            def lp(kind, *a, **k):
                if var is not None and kind == var["kind"]:
                    return tuple(var["point"])
                return self.orig_lp(kind, *a, **k)

            def hf(kind, p, q, streamed, rows=()):
                flags = self.orig_hf(kind, p, q, streamed, rows)
                mine = var is not None and kind == var["kind"]
                if var is not None and not mine and var.get("others") == "table":
                    return flags
                for name in ("EARLY", "HALVES"):
                    if name in flags:
                        flags[name] = bool(mine and var.get(name.lower()))
                if "PERSIST" in flags:
                    flags["PERSIST"] = int(var.get("persist", 0)) if mine else 0
                flags["TMA"] = bool(mine and var["tma"] and fa._tma_layout_ok(*streamed))
                flags["WS"] = bool(mine and var["ws"] and flags["TMA"])
                if "ROWS" in flags:
                    flags["ROWS"] = bool(mine and var.get("rows") and flags["TMA"]
                                         and all(fa._rows_layout_ok(t) for t in rows))
                return flags

            _common.launch_point = lp
            fa._hopper_flags = hf
            return self

        def __exit__(self, *exc):
            _common.launch_point = self.orig_lp
            fa._hopper_flags = self.orig_hf
            _common.use_reduce = self.orig_ur
            self.gluon.__exit__(*exc)
            return False

    return Ctx()


def _problem(B, H, N, D, dtype, causal, seed=0):
    from flashcheck.kernels._common import validate
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=dtype, generator=g)
                   for _ in range(4))
    p = validate(q, k, v, None, 0.0, causal, None, False, None, "top_left")
    return q, k, v, do, p


def _fwd_bwd(q, k, v, do, p, deterministic=True):
    from flashcheck.kernels import flash_attention as fa
    out, lse = fa._forward(q, k, v, p, False)
    dq, dk, dv = fa._backward(do, q, k, v, out, lse, p, deterministic, False)
    return out, dq, dk, dv


def compile_shard(shard: int, shards: int, dtype, D: int, out_path: Path,
                  which: str = "tables") -> None:
    todo = variants(which)[shard::shards]
    refs = {}
    with open(out_path, "a") as f:
        for j, var in enumerate(todo):
            rec = dict(var, index=shard + j * shards)
            t0 = time.time()
            try:
                c = var["causal"]
                if c not in refs:
                    args = _problem(1, 2, 512, D, dtype, c)
                    with _forced(None):
                        refs[c] = (args, _fwd_bwd(*args))
                args, ref = refs[c]
                with _forced(var):
                    got = _fwd_bwd(*args, deterministic=not var.get("atomic"))
                torch.cuda.synchronize()
                rec["max_diff"] = [float((a.float() - b.float()).abs().max()) for a, b in
                                   zip(got, ref, strict=True)]
                rec["ok"] = all(d == d for d in rec["max_diff"]) and max(rec["max_diff"]) < 0.5
            except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
                rec["ok"] = False
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rec["compile_s"] = round(time.time() - t0, 1)
            f.write(json.dumps(rec) + "\n")
            f.flush()


def load_compiled(path: Path) -> list[dict]:
    """The compile records in the set's order. The shards finish in any order; timing
    follows the set's (a set that times the table's point first and last, or alternates it
    with a candidate, brackets the machine's drift only if they are timed in that order)."""
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(recs, key=lambda r: r["index"])


def _bench(fn) -> tuple[float, float]:
    """(seconds of the first call, median ms of do_bench)."""
    import triton.testing
    t0 = time.time()
    fn()
    torch.cuda.synchronize()
    return round(time.time() - t0, 2), triton.testing.do_bench(fn, return_mode="median")


def _cudnn(q, k, v, do, causal: bool) -> dict:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        _, fwd = _bench(lambda: F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal))
        _, bwd = _bench(lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True))
    return dict(fwd_ms=fwd, bwd_ms=bwd)


def _time_variant(var: dict, q, k, v, do, p, out, lse) -> dict:
    from flashcheck.kernels import flash_attention as fa
    rec = dict(var)
    try:
        with _forced(var):
            if var["kind"] == "fwd":
                rec["first_call_s"], rec["ms"] = _bench(lambda: fa._forward(q, k, v, p, False))
            else:
                det = not var.get("atomic")
                rec["first_call_s"], rec["ms"] = _bench(
                    lambda: fa._backward(do, q, k, v, out, lse, p, det, False))
    except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
        rec["time_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return rec


def time_all(dtype, D: int, compiled: list[dict], log) -> dict:
    from flashcheck.kernels import flash_attention as fa

    res = {"cudnn": {}, "variants": []}
    for causal in (False, True):
        q, k, v, do, p = _problem(16, 16, 4096, D, dtype, causal)
        res["cudnn"][str(causal)] = c = _cudnn(q, k, v, do, causal)
        log(f"cudnn causal={causal} fwd {c['fwd_ms']:.3f} ms bwd {c['bwd_ms']:.3f} ms")
        with _forced(None):
            out, lse = fa._forward(q, k, v, p, False)
        for var in compiled:
            if var["causal"] == causal:
                rec = _time_variant(var, q, k, v, do, p, out, lse)
                res["variants"].append(rec)
                log(f"{var['kind']} {var['point']} tma={var['tma']} ws={var['ws']} "
                    f"rows={bool(var.get('rows'))} early={bool(var.get('early'))} "
                    f"persist={var.get('persist', 0)} halves={bool(var.get('halves'))} "
                    f"reduce={var.get('reduce')} "
                    f"atomic={bool(var.get('atomic'))} causal={causal}: "
                    f"{rec.get('ms', rec.get('time_error'))}")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=14)
    ap.add_argument("--out", required=True)
    ap.add_argument("--d", type=int, default=None,
                    help="head dim (default: the set's, SET_D; 128 unless named there)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shard", default=None, help="internal: i/n, compile phase")
    ap.add_argument("--compile-timeout", type=float, default=300)
    ap.add_argument("--set", default="tables", choices=SETS,
                    help="which variants: the set behind the tables, the dK/dV row set, "
                         "the backward kernels' dP order, the non-deterministic dQ adds, or "
                         "the persistent forward and 128-row tiles as halves")
    args = ap.parse_args(argv)
    if args.d is None:
        args.d = SET_D.get(args.set, 128)
    dtype = getattr(torch, args.dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    comp = out / "compile.jsonl"
    if args.shard:
        i, n = (int(x) for x in args.shard.split("/"))
        compile_shard(i, n, dtype, args.d, comp, args.set)
        return 0
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, __file__, "--out", str(out), "--d", str(args.d),
                               "--dtype", args.dtype, "--set", args.set,
                               "--shard", f"{i}/{args.jobs}"])
             for i in range(args.jobs)]
    deadline = time.time() + args.compile_timeout
    for pr in procs:
        try:
            pr.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pr.kill()
    compile_s = time.time() - t0
    recs = load_compiled(comp)
    ok = [r for r in recs if r["ok"]]
    print(f"compiled {len(ok)}/{len(variants(args.set))} variants in {compile_s:.0f} s "
          f"({len(recs) - len(ok)} failed, {len(variants(args.set)) - len(recs)} not reached)",
          flush=True)
    for r in recs:
        if not r["ok"] or max(r["max_diff"]) > 0:
            print("  compile:", json.dumps(r), flush=True)
    timed = time_all(dtype, args.d, ok, lambda m: print(m, flush=True))
    best = {}
    for r in timed["variants"]:
        if "ms" not in r:
            continue
        key = f"{r['kind']} causal={r['causal']}"
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    summary = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=__import__("triton").__version__, d=args.d, dtype=args.dtype,
                   compile_s=round(compile_s, 1), compile=recs, timing=timed, best=best)
    (out / "sweep.json").write_text(json.dumps(summary, indent=1))
    for key, r in best.items():
        print("best", key, r["point"], "tma", r["tma"], "ws", r["ws"], "rows",
              bool(r.get("rows")), "early", bool(r.get("early")), "persist",
              r.get("persist", 0), "halves", bool(r.get("halves")), f"{r['ms']:.3f} ms",
              flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("FLASHCHECK_AUTOTUNE_CACHE", "0")
    sys.exit(main())

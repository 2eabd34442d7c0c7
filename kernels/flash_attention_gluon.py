"""The FA2-order forward for Hopper in Gluon: warp-specialised, two or three consumer
warpgroups.

Gluon (``triton.experimental.gluon``) is Triton's lower-level language: layouts, shared
memory, mbarriers, TMA and ``wgmma`` are explicit. Triton's pipeliner waits on every score
product right after issuing it (docs/benchmarks/sweep.md rounds 11 and 14), so a tile's
exponentials never run under the next tile's products; here they do. Per program (NC · 64
query rows of one batch and head; NC, the consumers, in :data:`SCHEDULE` by head dim: 2, or
3 at D = 64 from 8K queries on, as FlashAttention-3 tiles D ≤ 64):

- a producer warp (``_loads``) issues every TMA load: Q once per warpgroup, then K and V
  tile by tile into ``STAGES``-deep rings, refilling a slot once every consumer released it
  (its ``empty`` mbarrier counts NC arrivals);
- NC consumer warpgroups (``_consume``, 4 warps each, 64 query rows each, partitions of
  their own so that their barriers span 128 threads and they drift freely) run
  FlashAttention-3's order per key tile j (``_attend``): issue S(j+1) = Q K(j+1)ᵀ, rescale
  O, issue O += P(j) V(j), then wait for S(j+1) and run its softmax while P(j) V(j) still
  runs (a store of the row sums to shared memory keeps ptxas from placing the wait for
  P(j) V(j) ahead of the exponentials: ``_attend``); each ends with its own epilogue
  (lse; O through its Q buffer, free by then, and a TMA store);
- where the query length is not a multiple of the program's rows (NC = 3: 8192 and 16384
  are not multiples of 192), the last tile's consumers past the queries compute and
  store nothing (``_skip``): they take their Q and release every key tile, so that the
  barriers' phases run on as in a whole tile. Every consumer computes its 64 rows as in any
  other tile: the bits do not depend on NC.

Schedules (:func:`schedule`, by name :func:`schedule_spec`; none moves a bit; the defaults
by head dim in :data:`SCHEDULE`, set from GPU timings): "c3", three consumers at D = 64
("c2": two; "c3long", the default there: two below 8K queries, three from them);
"early", P rounded into P V's operand layout as soon as the softmax has made it, so that its
fp32 copy is dead before the wait (the three consumers' 160 registers then hold S, P and O
with few spills), 4-7 % faster at D = 64 ("late": not early); "split", the causal loop
split at the diagonal, the key tiles below it without the mask (no spills left at
D = 128: ``scripts/ptxas_report.py``, tests/test_flash_gluon.py). The default is early P at
D = 64 with three consumers from 8K queries on and, at D = 128, the PTX the kernel
compiled to before the schedules existed.
``FLASHCHECK_GLUON_SCHEDULE`` sets schedules by head dim at import (``64=early``:
:func:`schedule_env`), so that a candidate default runs through the gate and campaigns as
it would ship.

The persistent grid, ``_fwd_persistent_kernel``: one program per multiprocessor over every
tile (``_tile``: a (batch, head)'s query tiles consecutive, so that the programs running at
once share its K and V in L2; causal ones in pairs of equal work, a head's u-th longest
then its u-th shortest, where a head has an even count, else longest first). The rings'
positions run on across tiles; each warpgroup hands its Q buffer back as soon as its last
Q Kᵀ product has completed (the producer loads the next tile's Q and K/V under this tile's
last P V and epilogue), and stores O from a buffer of its own (32 KiB more shared memory),
whose bulk store is waited for only before that buffer is written again. Each tile's
arithmetic is the per-tile kernel's: the same bits. The default mode ("auto",
``_common.gluon_grid``) launches it up to ``_common.GLUON_PERSISTENT_MAX_KEYS`` keys
(D = 128: 4096, D = 64: 16384; measured faster there than per tile and than the Triton
forward, slower than per tile above: sweep.md round 21) and the per-tile grid above;
``FLASHCHECK_GLUON=tile`` or ``persistent`` takes one grid wherever the path runs.

The arithmetic is the Triton forward's, product for product: the same 128-key tiles give
the same P, lse and O up to the order of the fp32 accumulation over the head dim inside
``wgmma`` (bit for bit with 64-key tiles; docs/benchmarks/sweep.md round 17), the scale
folded with log2(e) into one fp32 constant, ``exp2``, P rounded to the input dtype before
P V, the lse in base-2 units for the shared backward.

Where it runs (:func:`eligible`; everything else takes the Triton forward): CUDA sm_90,
float16/bfloat16, head dims 64 and 128 (``_common.gluon_grid``; "tile" takes 64 only
where keys > 4096, ``_common.GLUON_FWD_MIN_KEYS``), query and key lengths multiples of 128,
Q, K and V contiguous (B, H, N, D) at 16-byte aligned addresses (the bulk tensor copy's rule),
no mask, and either no band or the causal one with ``hi_off == 0`` (top-left; bottom-right
with Nq == Nk), GQA included, in either tuning mode (one fixed configuration: autotune
mode tunes the Triton kernels of the other calls); ``_common.set_gluon("off")`` (or
``FLASHCHECK_GLUON=off``) turns it off. ``LAUNCHES`` counts its calls.

Caveats: written against Triton 3.6's Gluon (sm_90a; it compiles under 3.9 too, where the
TMA copies are renamed); where Gluon does not import or has no ``warp_specialize``,
:func:`eligible` is False and the Triton forward runs. Not run by the CPU interpreter
(Gluon has none); ``tests/test_flash_gluon.py`` compiles it for sm_90a without a GPU.
"""

from __future__ import annotations

import contextlib
import os

import torch
from flashcheck.kernels import _common
from flashcheck.kernels._common import INTERPRET, Problem

try:  # pragma: no cover - depends on the installed Triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # Triton 3.6 names the TMA copies async_copy_*; later releases async_load/async_store.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    AVAILABLE = hasattr(gl, "warp_specialize")
except ImportError:  # pragma: no cover
    AVAILABLE = False

BLOCK_M = 64  # query rows per consumer warpgroup
BLOCK_N = 128  # keys per tile
STAGES = 2  # K/V ring depth: 2 x 2 x 32 KiB at D = 128, beside Q's 2 x 16 KiB
# The consumers' schedule by head dim, read at each launch: "consumers", the consumer
# warpgroups per program (2 or 3: a program's tile is consumers · 64 query rows, each K/V
# tile loaded serves them all; three fit D = 64 only, their S, P and O in 160 registers with
# early P, shared memory 112 KiB; at D = 128 two), and :func:`_attend`'s EARLY_P and SPLIT:
# P rounded into P V's operand layout as soon as made, and the causal loop split at the
# diagonal. None moves a bit. Early P is 4-7 % faster at D = 64 on every timed row of an
# H100, not at D = 128 (sweep.md round 31): on at D = 64 since its GPU checks passed (round
# 33: GPU tests, sanitizers, gate, campaigns). The split is not faster anywhere: off. Three
# consumers are faster on long queries only: "c3_from", the query length from which a launch
# takes three consumers instead of "consumers" (None: never). FLASHCHECK_GLUON_SCHEDULE sets
# them at import (:func:`schedule_env`). Three consumers at D = 64 against two, both with
# early P, H100, 5-7 rounds: 0.93-0.96x the time at 8K queries on all eight rows of two runs
# (round 35: the same kernels' old/new noise 0.99-1.00x), 0.94-0.97x at 16K (round 34) and
# 0.86-0.93x at 32K and 64K (round 35: 1.06-1.15x cuDNN's speed there); 0.98-1.00x at 4K
# (within the noise), 1.49-1.55x at 2K causal and 1.25-1.28x at 1K causal (the last tile
# ragged, a consumer idle): three from 8K on.
C3_FROM = 8192
SCHEDULE = {128: {"consumers": 2, "c3_from": None, "early_p": False, "split": False},
            64: {"consumers": 2, "c3_from": C3_FROM, "early_p": True, "split": False}}
PRODUCER_REGS = 24  # the producer warp's registers per thread: the least setmaxnreg allows
MAXNREG = 168  # the two-consumer kernel's (regs(2)[0])


def regs(nc: int) -> tuple[int, int]:
    """(maxnreg, the consumers' setmaxnreg) of a program with ``nc`` consumer warpgroups and
    the producer's: (nc + 1) warpgroups share the 65536 registers of a multiprocessor, each
    count rounded down to setmaxnreg's multiple of 8; the producer keeps PRODUCER_REGS and
    the consumers split the rest. Two: 65536 / 384 → 168, (168·384 − 24·128) / 256 = 240;
    three: 65536 / 512 = 128, (128·512 − 24·128) / 384 → 160."""
    if nc not in (2, 3):
        raise ValueError(f"consumers per program must be 2 or 3, got {nc}")
    threads = 128 * (nc + 1)
    maxnreg = 65536 // threads // 8 * 8
    return maxnreg, (maxnreg * threads - PRODUCER_REGS * 128) // (128 * nc) // 8 * 8


def flags(head_dim: int) -> dict:
    """The consumers' schedule for this head dim (:data:`SCHEDULE`; D = 128's elsewhere)."""
    return SCHEDULE.get(head_dim, SCHEDULE[128])


def consumers(head_dim: int, nq: int = 0) -> int:
    """Consumer warpgroups per program for this head dim and query length (:data:`SCHEDULE`:
    three from its ``c3_from`` queries on, where set)."""
    f = flags(head_dim)
    return 3 if f["c3_from"] is not None and nq >= f["c3_from"] else f["consumers"]


# a schedule's parts by name, each the :data:`SCHEDULE` entries it sets at one head dim:
# c2 and c3 a count at every length, c3long two below C3_FROM queries and three from it
SCHEDULE_PARTS = {"c2": dict(consumers=2, c3_from=None), "c3": dict(consumers=3, c3_from=None),
                  "c3long": dict(consumers=2, c3_from=C3_FROM),
                  "early": dict(early_p=True), "late": dict(early_p=False),
                  "split": dict(split=True)}


def schedule_flags(name: str) -> dict:
    """The :data:`SCHEDULE` entries a "+"-joined name over :data:`SCHEDULE_PARTS` sets
    (``c3+early+split``), later parts over earlier ones."""
    kw = {}
    for part in name.split("+"):
        if part not in SCHEDULE_PARTS:
            raise ValueError(f"schedule: each part must be one of {sorted(SCHEDULE_PARTS)}, "
                             f"got {part!r} in {name!r}")
        kw.update(SCHEDULE_PARTS[part])
    return kw


def schedule_spec(name: str) -> dict:
    """:func:`schedule`'s arguments for a schedule's name (:func:`schedule_flags`; its
    consumer count and length rule as ``consumers64`` and ``c3_from64``); the timing and
    sanitizer scripts take schedules by name."""
    kw = schedule_flags(name)
    for k in ("consumers", "c3_from"):
        if k in kw:
            kw[f"{k}64"] = kw.pop(k)
    return kw


def schedule_env(text: str) -> dict[int, dict]:
    """The :data:`SCHEDULE` entries by head dim that ``FLASHCHECK_GLUON_SCHEDULE`` names:
    comma-separated ``D=NAME`` (``64=early`` or ``64=c3+early,128=split``; empty: none), D
    one of the table's head dims, NAME as :func:`schedule_flags` takes it, three consumers at
    D = 64 only. A candidate default runs on the GPU (gate, campaigns, sanitizers) without a
    source edit."""
    out: dict[int, dict] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        d, sep, name = item.partition("=")
        if not sep or not d.strip().isdigit() or int(d) not in SCHEDULE:
            raise ValueError(f"FLASHCHECK_GLUON_SCHEDULE: each item must be D=NAME with D one "
                             f"of {sorted(SCHEDULE)}, got {item!r} in {text!r}")
        try:
            f = schedule_flags(name.strip())
        except ValueError as e:
            raise ValueError(f"FLASHCHECK_GLUON_SCHEDULE: {e}") from None
        if (f.get("consumers", 2) != 2 or f.get("c3_from")) and int(d) != 64:
            raise ValueError(f"FLASHCHECK_GLUON_SCHEDULE: three consumers fit D = 64 only, "
                             f"got {item!r}")
        out.setdefault(int(d), {}).update(f)
    return out


def _set(entries: dict[int, dict]) -> None:
    """:data:`SCHEDULE`'s entries set by head dim."""
    for d, f in entries.items():
        SCHEDULE[d].update(f)


_set(schedule_env(os.environ.get("FLASHCHECK_GLUON_SCHEDULE", "")))


@contextlib.contextmanager
def schedule(consumers64: int | None = None, early_p: bool | None = None,
             split: bool | None = None, c3_from64: int | None | type(...) = ...):
    """Within the block, launches take these (None: as they are) as :data:`SCHEDULE`'s
    consumer count at D = 64 (at every length, unless ``c3_from64`` is given too: the query
    length from which three, None for never) and its flags at every head dim; restored
    after, also on an error."""
    if consumers64 is not None:
        regs(consumers64)  # the count checked
    if c3_from64 is not ... and c3_from64 is not None and not (
            isinstance(c3_from64, int) and not isinstance(c3_from64, bool) and c3_from64 > 0):
        raise ValueError(f"c3_from64 must be a query length > 0 or None, got {c3_from64!r}")
    saved = {d: dict(f) for d, f in SCHEDULE.items()}
    try:
        if consumers64 is not None:
            SCHEDULE[64].update(consumers=consumers64, c3_from=None)
        if c3_from64 is not ...:
            SCHEDULE[64]["c3_from"] = c3_from64
        for f in SCHEDULE.values():
            f.update({k: bool(v) for k, v in (("early_p", early_p), ("split", split))
                      if v is not None})
        yield
    finally:
        _set(saved)


LAUNCHES = [0]  # calls of forward() since import (tests and the GPU session read it)

if AVAILABLE:
    @gluon.jit
    def _softmax(s, m_i, l_i, start_m, start_n, qk_scale, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, s_layout: gl.constexpr):
        """P (unnormalised, fp32) of one tile's scores, the rescale factor, new l and m:
        the Triton forward's _softmax_step without mask or bias."""
        if CAUSAL:
            if start_n + BLOCK_N > start_m:
                rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
                cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                ok = gl.expand_dims(rows, 1) >= gl.expand_dims(cols, 0)
                s = gl.where(ok, s, -float("inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, alpha, l_i, m_new

    @gluon.jit
    def _loads(args):
        """The producer warp (see the module docstring); the sizes come from the buffers'
        shapes."""
        (q_desc, k_desc, v_desc, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bars, k_ready,
         k_empty, v_ready, v_empty, q_row0, kv_row0, lse_row0, start_m, n_tiles, N_Q,
         qk_scale, held) = args
        NC: gl.constexpr = q_smem.type.shape[0]
        BM: gl.constexpr = q_smem.type.shape[1]
        for c in gl.static_range(NC):  # (a block past the queries too: see _skip)
            mbarrier.expect(q_bars.index(c), q_desc.block_type.nbytes)
            _tma_load(q_desc, [q_row0 + start_m + c * BM, 0], q_bars.index(c),
                      q_smem.index(c))
        _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, kv_row0,
                 0, n_tiles)

    @gluon.jit
    def _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, kv_row0,
                 base, n_tiles):
        """``n_tiles`` K and V tiles from row ``kv_row0`` into the rings, the first at ring
        position ``base``, each slot refilled once every consumer released it."""
        BN: gl.constexpr = k_smem.type.shape[1]
        NS: gl.constexpr = k_smem.type.shape[0]
        for j in range(n_tiles):
            slot = (base + j) % NS
            # a fresh mbarrier counts as phase 1 complete: the first pass waits for nothing
            free = (((base + j) // NS) & 1) ^ 1
            mbarrier.wait(k_empty.index(slot), free)
            mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
            _tma_load(k_desc, [kv_row0 + j * BN, 0], k_ready.index(slot), k_smem.index(slot))
            mbarrier.wait(v_empty.index(slot), free)
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            _tma_load(v_desc, [kv_row0 + j * BN, 0], v_ready.index(slot), v_smem.index(slot))

    @gluon.jit
    def _attend(qs, q_bar, q_phase, q_free, k_smem, v_smem, k_ready, k_empty, v_ready,
                v_empty, held, base, my_m, n_tiles, qk_scale, CAUSAL: gl.constexpr,
                RELEASE_Q: gl.constexpr, EARLY_P: gl.constexpr, SPLIT: gl.constexpr):
        """One consumer warpgroup's 64 query rows from ``my_m`` against ``n_tiles`` key
        tiles of the rings, whose first is ring position ``base`` (slot ``base % NS``): the
        unnormalised O, l and m. Under causal, key tiles past its own rows are waited for
        and released, not computed, so that the other warpgroup's arrivals complete each
        slot's phase. ``RELEASE_Q``: arrive on ``q_free`` once no product reads Q.

        ``held`` (64 fp32 of shared memory, written, never read) keeps the softmax under
        P(j) V(j): the compiler's scheduler (ptxas) otherwise places the wait for that
        product right after the row maximum, ahead of the exponentials it was meant to
        overlap (``WARPGROUP.DEPBAR.LE gsb0, 0x0`` before 64 of the loop's 66 ``MUFU.EX2``,
        all 66 under causal, in the SASS of ptxas 12.8 and 13.4); it does not move that wait
        above a store to shared memory, and storing l, which sums every exponential of the
        tile, puts all of them ahead of the wait (``scripts/ptxas_report.py``'s
        ``exp_wait_order``, tests/test_flash_gluon.py). The bits are unchanged.

        ``EARLY_P``: P rounded into P V's operand layout right after its softmax, not as
        P V is issued (its fp32 copy then dies before the wait). ``SPLIT`` (causal): the
        key tiles wholly below the diagonal in a loop without the mask, then those it
        crosses in one with it. Neither changes a bit (:data:`SCHEDULE`)."""
        BM: gl.constexpr = qs.type.shape[0]
        BN: gl.constexpr = k_smem.type.shape[1]
        HD: gl.constexpr = k_smem.type.shape[2]
        NS: gl.constexpr = k_smem.type.shape[0]
        dtype: gl.constexpr = qs.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HD, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                     k_width=2)
        orow: gl.constexpr = gl.SliceLayout(1, o_layout)
        srow: gl.constexpr = gl.SliceLayout(1, s_layout)
        if CAUSAL:
            n_own = gl.minimum(gl.cdiv(my_m + BM, BN), n_tiles)
        else:
            n_own = n_tiles

        m_i = gl.full([BM], -float("inf"), gl.float32, layout=srow)
        l_i = gl.zeros([BM], gl.float32, layout=srow)
        acc = gl.zeros([BM, HD], gl.float32, layout=o_layout)
        s_zero = gl.zeros([BM, BN], gl.float32, layout=s_layout)

        mbarrier.wait(q_bar, q_phase)
        mbarrier.wait(k_ready.index(base % NS), (base // NS) & 1)
        s = warpgroup_mma(qs, k_smem.index(base % NS).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        mbarrier.arrive(k_empty.index(base % NS), count=1)
        p, alpha, l_i, m_i = _softmax(s, m_i, l_i, my_m, 0, qk_scale, BM, BN, CAUSAL,
                                      s_layout)
        if EARLY_P:
            p = gl.convert_layout(p.to(dtype), p_layout)

        if CAUSAL and SPLIT:  # key tiles wholly below the diagonal, then those it crosses
            n_free = gl.minimum(my_m // BN, n_own)
            for j in range(0, n_free - 1):
                acc, p, alpha, l_i, m_i = _step(qs, k_smem, v_smem, k_ready, k_empty, v_ready,
                                                v_empty, held, base, j, acc, p, alpha, l_i,
                                                m_i, my_m, qk_scale, False, EARLY_P, s_zero,
                                                p_layout)
            for j in range(gl.maximum(n_free - 1, 0), n_own - 1):
                acc, p, alpha, l_i, m_i = _step(qs, k_smem, v_smem, k_ready, k_empty, v_ready,
                                                v_empty, held, base, j, acc, p, alpha, l_i,
                                                m_i, my_m, qk_scale, True, EARLY_P, s_zero,
                                                p_layout)
        else:
            for j in range(0, n_own - 1):
                acc, p, alpha, l_i, m_i = _step(qs, k_smem, v_smem, k_ready, k_empty, v_ready,
                                                v_empty, held, base, j, acc, p, alpha, l_i,
                                                m_i, my_m, qk_scale, CAUSAL, EARLY_P, s_zero,
                                                p_layout)
        if RELEASE_Q:  # the last Q Kᵀ product has completed
            mbarrier.arrive(q_free, count=1)

        j = base + n_own - 1
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow), 1)
        mbarrier.wait(v_ready.index(j % NS), (j // NS) & 1)
        if EARLY_P:
            acc = warpgroup_mma(p, v_smem.index(j % NS), acc, is_async=True)
        else:
            acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(j % NS),
                                acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(j % NS), count=1)
        _release(k_ready, k_empty, v_ready, v_empty, base + n_own, base + n_tiles)
        return acc, l_i, m_i

    @gluon.jit
    def _step(qs, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, held, base, j, acc, p,
              alpha, l_i, m_i, my_m, qk_scale, MASK: gl.constexpr, EARLY_P: gl.constexpr,
              s_zero, p_layout: gl.constexpr):
        """One key tile of :func:`_attend`'s loop: S(j+1) issued, O rescaled, P(j) V(j)
        issued, S(j+1)'s softmax (``MASK``: the causal mask where it crosses the diagonal)
        under P(j) V(j); ``EARLY_P`` as there."""
        NS: gl.constexpr = k_smem.type.shape[0]
        BM: gl.constexpr = qs.type.shape[0]
        BN: gl.constexpr = k_smem.type.shape[1]
        orow: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
        stage = (base + j) % NS
        nxt = (base + j + 1) % NS
        mbarrier.wait(k_ready.index(nxt), ((base + j + 1) // NS) & 1)
        mbarrier.wait(v_ready.index(stage), ((base + j) // NS) & 1)
        s_next = warpgroup_mma(qs, k_smem.index(nxt).permute((1, 0)), s_zero, use_acc=False,
                               is_async=True)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow), 1)
        if EARLY_P:
            acc = warpgroup_mma(p, v_smem.index(stage), acc, is_async=True)
        else:
            acc = warpgroup_mma(gl.convert_layout(p.to(qs.dtype), p_layout),
                                v_smem.index(stage), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_next, ))
        mbarrier.arrive(k_empty.index(nxt), count=1)
        p, alpha, l_i, m_i = _softmax(s, m_i, l_i, my_m, (j + 1) * BN, qk_scale, BM, BN, MASK,
                                      s_zero.type.layout)
        if EARLY_P:
            p = gl.convert_layout(p.to(qs.dtype), p_layout)
        held.store(l_i)  # every exponential before the wait (see _attend's docstring)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(stage), count=1)
        return acc, p, alpha, l_i, m_i

    @gluon.jit
    def _release(k_ready, k_empty, v_ready, v_empty, lo, hi):
        """Ring positions ``lo`` to ``hi`` (exclusive) waited for and released, not read:
        the other warpgroups' arrivals then complete each slot's phase."""
        NS: gl.constexpr = k_ready.type.shape[0]
        for t in range(lo, hi):
            ph = (t // NS) & 1
            mbarrier.wait(k_ready.index(t % NS), ph)
            mbarrier.arrive(k_empty.index(t % NS), count=1)
            mbarrier.wait(v_ready.index(t % NS), ph)
            mbarrier.arrive(v_empty.index(t % NS), count=1)

    @gluon.jit
    def _skip(q_bar, q_phase, q_free, k_ready, k_empty, v_ready, v_empty, base, n_tiles,
              RELEASE_Q: gl.constexpr):
        """A consumer warpgroup whose 64 rows lie past the queries (the last tile where the
        query length is not a multiple of a program's rows): its Q (loaded all the same,
        rows of the next head or zeros past the tensor) waited for and, ``RELEASE_Q``,
        handed back, so that the barriers' phases run on as for the others, and the key
        tiles released (:func:`_release`). Nothing is computed or stored."""
        mbarrier.wait(q_bar, q_phase)
        if RELEASE_Q:
            mbarrier.arrive(q_free, count=1)
        _release(k_ready, k_empty, v_ready, v_empty, base, base + n_tiles)

    @gluon.jit
    def _finish(acc, l_i, m_i, lse_ptr, lse_row0, my_m, o_buf, o_desc, o_row0):
        """A warpgroup's epilogue: lse (base 2), and O normalised and stored from ``o_buf``
        to rows ``o_row0 + my_m`` onward by a bulk copy (not waited for)."""
        BM: gl.constexpr = o_buf.type.shape[0]
        orow: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
        srow: gl.constexpr = l_i.type.layout
        out = acc / gl.expand_dims(gl.convert_layout(l_i, orow), 1)
        offs = my_m + gl.arange(0, BM, layout=srow)
        gl.store(lse_ptr + lse_row0 + offs, m_i + gl.log2(l_i))
        o_buf.store(out.to(o_buf.dtype))
        fence_async_shared()
        _tma_store(o_desc, [o_row0 + my_m, 0], o_buf)

    @gluon.jit
    def _consume(args, C: gl.constexpr, CAUSAL: gl.constexpr, EARLY_P: gl.constexpr,
                 SPLIT: gl.constexpr, RAGGED: gl.constexpr):
        """Consumer warpgroup ``C``: query rows start_m + C·BM onward (see the module
        docstring)."""
        (q_desc, k_desc, v_desc, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bars, k_ready,
         k_empty, v_ready, v_empty, q_row0, kv_row0, lse_row0, start_m, n_tiles, N_Q,
         qk_scale, held) = args
        BM: gl.constexpr = q_smem.type.shape[1]
        my_m = start_m + C * BM
        qs = q_smem.index(C)
        if not RAGGED or my_m < N_Q:
            acc, l_i, m_i = _attend(qs, q_bars.index(C), 0, q_bars.index(C), k_smem, v_smem,
                                    k_ready, k_empty, v_ready, v_empty, held.index(C), 0,
                                    my_m, n_tiles, qk_scale, CAUSAL, False, EARLY_P, SPLIT)
            # Q's buffer is free: every product reading it has completed.
            _finish(acc, l_i, m_i, lse_ptr, lse_row0, my_m, qs, o_desc, q_row0)
            tma.store_wait(pendings=0)
        else:
            _skip(q_bars.index(C), 0, q_bars.index(C), k_ready, k_empty, v_ready, v_empty, 0,
                  n_tiles, False)

    @gluon.jit
    def _tile(t, n_m, N_Q, N_K, H_Q, GROUP, H_KV, BM2: gl.constexpr, BN: gl.constexpr,
              CAUSAL: gl.constexpr, PAIRED: gl.constexpr):
        """The persistent order's tile ``t``: (q_row0, kv_row0, start_m, n_tiles). A (batch,
        head)'s query tiles are consecutive (the programs running at once share its K and V
        in L2), the causal ones longest first (the last tiles handed out are the shortest);
        ``PAIRED`` (causal, ``n_m`` even): its tiles in pairs, the u-th longest then the u-th
        shortest, whose key tiles add up to the same for every pair (:func:`_slot` gives a
        program whole pairs)."""
        bh = t // n_m
        i = t % n_m
        if CAUSAL:
            if PAIRED:
                u = i // 2
                i = u + (1 - i % 2) * (n_m - 1 - 2 * u)
            else:
                i = n_m - 1 - i
        q_row0, kv_row0 = _rows(bh, N_Q, N_K, H_Q, GROUP, H_KV)
        start_m = i * BM2
        return q_row0, kv_row0, start_m, _key_tiles(start_m, N_K, BM2, BN, CAUSAL)

    @gluon.jit
    def _slot(s, PAIRED: gl.constexpr):
        """This program's ``s``-th tile in :func:`_tile`'s order: every ``num_programs``-th
        tile from ``program_id``; ``PAIRED``, every ``num_programs``-th pair of tiles. Dealt
        out one by one, the causal tiles' lengths repeat with the programs' stride, and the
        programs whose tiles are the longer ones finish last: on 132 programs the busiest
        has 1.12x the mean work at N = 4096, 1.30x at 1024, 1.05x at 16384 (key tiles per
        query tile, plus one for its epilogue); in pairs of equal sum 1.03x at each, the
        last round's pairs (a grid over the tiles, scheduled as programs finish: 1.02x)."""
        if PAIRED:
            return 2 * (gl.program_id(0) + (s // 2) * gl.num_programs(0)) + s % 2
        else:
            return gl.program_id(0) + s * gl.num_programs(0)

    @gluon.jit
    def _slots(total, PAIRED: gl.constexpr):
        """How many of the ``total`` tiles this program takes (:func:`_slot`; the launcher
        starts at most one program per tile, or per pair)."""
        if PAIRED:
            return 2 * gl.cdiv(total // 2 - gl.program_id(0), gl.num_programs(0))
        else:
            return gl.cdiv(total - gl.program_id(0), gl.num_programs(0))

    @gluon.jit
    def _rows(bh, N_Q, N_K, H_Q, GROUP, H_KV):
        """The first query row of (batch x query head) ``bh`` and the first key row of its
        head's keys (GQA: the group's)."""
        b = bh // H_Q
        h = bh % H_Q
        return bh * N_Q, (b * H_KV + h // GROUP) * N_K

    @gluon.jit
    def _key_tiles(start_m, N_K, BM2: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr):
        """How many key tiles the ``BM2`` query rows from ``start_m`` read (under causal, up to
        their last row)."""
        if CAUSAL:
            return gl.minimum(gl.cdiv(start_m + BM2, BN), N_K // BN)
        else:
            return N_K // BN

    @gluon.jit
    def _loads_persistent(args, CAUSAL: gl.constexpr, PAIRED: gl.constexpr):
        """The persistent producer warp: per tile of this program, each warpgroup's Q once
        its previous Q is free, then K and V as in :func:`_loads`, the rings' positions
        running on across tiles."""
        (q_desc, k_desc, v_desc, o_desc, lse_ptr, q_smem, k_smem, v_smem, o_smem, q_bars,
         q_free, k_ready, k_empty, v_ready, v_empty, n_m, total, N_Q, N_K, H_Q, GROUP, H_KV,
         qk_scale, held) = args
        NC: gl.constexpr = q_smem.type.shape[0]
        BM: gl.constexpr = q_smem.type.shape[1]
        BN: gl.constexpr = k_smem.type.shape[1]
        base = 0
        n = 0
        for s in range(0, _slots(total, PAIRED)):
            q_row0, kv_row0, start_m, n_tiles = _tile(_slot(s, PAIRED), n_m, N_Q, N_K, H_Q,
                                                      GROUP, H_KV, NC * BM, BN, CAUSAL,
                                                      PAIRED)
            for c in gl.static_range(NC):
                mbarrier.wait(q_free.index(c), (n & 1) ^ 1)
                mbarrier.expect(q_bars.index(c), q_desc.block_type.nbytes)
                _tma_load(q_desc, [q_row0 + start_m + c * BM, 0], q_bars.index(c),
                          q_smem.index(c))
            _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                     kv_row0, base, n_tiles)
            base += n_tiles
            n += 1

    @gluon.jit
    def _consume_persistent(args, C: gl.constexpr, CAUSAL: gl.constexpr,
                            PAIRED: gl.constexpr, EARLY_P: gl.constexpr, SPLIT: gl.constexpr,
                            RAGGED: gl.constexpr):
        """Persistent consumer warpgroup ``C``: per tile of this program, its 64 rows (Q
        released to the producer once its last product has completed), and the epilogue
        through a buffer of its own, whose bulk store runs under the next tile; rows past
        the queries are skipped (:func:`_skip`)."""
        (q_desc, k_desc, v_desc, o_desc, lse_ptr, q_smem, k_smem, v_smem, o_smem, q_bars,
         q_free, k_ready, k_empty, v_ready, v_empty, n_m, total, N_Q, N_K, H_Q, GROUP, H_KV,
         qk_scale, held) = args
        NC: gl.constexpr = q_smem.type.shape[0]
        BM: gl.constexpr = q_smem.type.shape[1]
        BN: gl.constexpr = k_smem.type.shape[1]
        base = 0
        n = 0
        for s in range(0, _slots(total, PAIRED)):
            q_row0, kv_row0, start_m, n_tiles = _tile(_slot(s, PAIRED), n_m, N_Q, N_K, H_Q,
                                                      GROUP, H_KV, NC * BM, BN, CAUSAL,
                                                      PAIRED)
            my_m = start_m + C * BM
            if not RAGGED or my_m < N_Q:
                acc, l_i, m_i = _attend(q_smem.index(C), q_bars.index(C), n & 1,
                                        q_free.index(C), k_smem, v_smem, k_ready, k_empty,
                                        v_ready, v_empty, held.index(C), base, my_m, n_tiles,
                                        qk_scale, CAUSAL, True, EARLY_P, SPLIT)
                tma.store_wait(pendings=0)  # the previous tile's O has left the buffer
                _finish(acc, l_i, m_i, lse_ptr, q_row0, my_m, o_smem.index(C), o_desc,
                        q_row0)
            else:
                _skip(q_bars.index(C), n & 1, q_free.index(C), k_ready, k_empty, v_ready,
                      v_empty, base, n_tiles, True)
            base += n_tiles
            n += 1
        tma.store_wait(pendings=0)

    @gluon.jit
    def _buffers(q_desc, k_desc, v_desc, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 HEAD_D: gl.constexpr, STAGES: gl.constexpr, NC: gl.constexpr):
        """Both kernels' shared memory: each of the ``NC`` warpgroups' Q buffer, the K and V
        rings, and their mbarriers, initialised (an ``empty`` slot counts every consumer's
        arrival)."""
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [NC, BLOCK_M, HEAD_D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
        q_bars = gl.allocate_shared_memory(gl.int64, [NC, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(NC):
            mbarrier.init(q_bars.index(c), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=NC)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=NC)
        # each consumer's l, stored every key tile and never read (_attend's ``held``)
        held = gl.allocate_shared_memory(gl.float32, [NC, BLOCK_M],
                                         gl.SwizzledSharedLayout(1, 1, 1, [0]))
        return q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty, held

    @gluon.jit
    def _fwd_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, N_Q, N_K, H_Q,
                    GROUP, H_KV, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    HEAD_D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                    NC: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                    PRODUCER_REGS: gl.constexpr, EARLY_P: gl.constexpr, SPLIT: gl.constexpr,
                    RAGGED: gl.constexpr):
        """One program per (NC · 64 query rows, batch x query head)."""
        pid_m = gl.program_id(0)
        q_row0, kv_row0 = _rows(gl.program_id(1), N_Q, N_K, H_Q, GROUP, H_KV)
        start_m = pid_m * (NC * BLOCK_M)
        n_tiles = _key_tiles(start_m, N_K, NC * BLOCK_M, BLOCK_N, CAUSAL)

        q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty, held = _buffers(
            q_desc, k_desc, v_desc, BLOCK_M, BLOCK_N, HEAD_D, STAGES, NC)

        args = (q_desc, k_desc, v_desc, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bars,
                k_ready, k_empty, v_ready, v_empty, q_row0, kv_row0, q_row0, start_m,
                n_tiles, N_Q, qk_scale, held)
        if NC == 2:
            gl.warp_specialize([(_consume, (args, 0, CAUSAL, EARLY_P, SPLIT, RAGGED)),
                                (_consume, (args, 1, CAUSAL, EARLY_P, SPLIT, RAGGED)),
                                (_loads, (args, ))], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([(_consume, (args, 0, CAUSAL, EARLY_P, SPLIT, RAGGED)),
                                (_consume, (args, 1, CAUSAL, EARLY_P, SPLIT, RAGGED)),
                                (_consume, (args, 2, CAUSAL, EARLY_P, SPLIT, RAGGED)),
                                (_loads, (args, ))],
                               [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])

    @gluon.jit
    def _fwd_persistent_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, N_Q, N_K,
                               H_Q, GROUP, H_KV, BH, BLOCK_M: gl.constexpr,
                               BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                               STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                               PAIRED: gl.constexpr, NC: gl.constexpr,
                               CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                               EARLY_P: gl.constexpr, SPLIT: gl.constexpr,
                               RAGGED: gl.constexpr):
        """One program per multiprocessor over every (NC · 64 query rows, batch x query
        head) tile in :func:`_tile`'s order, dealt out by :func:`_slot`."""
        dtype: gl.constexpr = q_desc.dtype
        if RAGGED:
            n_m = gl.cdiv(N_Q, NC * BLOCK_M)
        else:
            n_m = N_Q // (NC * BLOCK_M)
        total = n_m * BH
        q_smem, k_smem, v_smem, q_bars, k_ready, k_empty, v_ready, v_empty, held = _buffers(
            q_desc, k_desc, v_desc, BLOCK_M, BLOCK_N, HEAD_D, STAGES, NC)
        o_smem = gl.allocate_shared_memory(dtype, [NC, BLOCK_M, HEAD_D], o_desc.layout)
        q_free = gl.allocate_shared_memory(gl.int64, [NC, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(NC):
            mbarrier.init(q_free.index(c), count=1)

        args = (q_desc, k_desc, v_desc, o_desc, lse_ptr, q_smem, k_smem, v_smem, o_smem,
                q_bars, q_free, k_ready, k_empty, v_ready, v_empty, n_m, total, N_Q, N_K,
                H_Q, GROUP, H_KV, qk_scale, held)
        if NC == 2:
            gl.warp_specialize([(_consume_persistent, (args, 0, CAUSAL, PAIRED, EARLY_P,
                                                     SPLIT, RAGGED)),
                                (_consume_persistent, (args, 1, CAUSAL, PAIRED, EARLY_P,
                                                       SPLIT, RAGGED)),
                                (_loads_persistent, (args, CAUSAL, PAIRED))], [4, 1],
                               [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([(_consume_persistent, (args, 0, CAUSAL, PAIRED, EARLY_P,
                                                     SPLIT, RAGGED)),
                                (_consume_persistent, (args, 1, CAUSAL, PAIRED, EARLY_P,
                                                       SPLIT, RAGGED)),
                                (_consume_persistent, (args, 2, CAUSAL, PAIRED, EARLY_P,
                                                       SPLIT, RAGGED)),
                                (_loads_persistent, (args, CAUSAL, PAIRED))], [4, 4, 1],
                               [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


def on_sm90(t: torch.Tensor) -> bool:
    """``t`` on an sm_90 GPU, outside the interpreter: where this module's kernels (and the
    backward's, flash_attention_gluon_bwd) run."""
    return not INTERPRET and t.is_cuda and torch.cuda.get_device_capability(t.device) == (9, 0)


def supported(p: Problem, dtype: torch.dtype, contiguous: bool) -> bool:
    """Whether the problem is one this kernel computes (the device aside; ``contiguous``:
    Q, K and V contiguous and 16-byte aligned): see the module docstring's list. Pure: no
    device query, so the CPU suite tests it."""
    rows_ok = p.Nq % (2 * BLOCK_M) == 0 and p.Nk % BLOCK_N == 0 and p.Nq > 0 and p.Nk > 0
    band_ok = not p.has_lo and (not p.has_hi or p.hi_off == 0)
    return (dtype in (torch.float16, torch.bfloat16) and contiguous and rows_ok and band_ok
            and p.mask is None and _common.gluon_grid(p.D, p.Nk) is not None)


def tma_ready(*tensors: torch.Tensor) -> bool:
    """Every tensor contiguous at a 16-byte aligned address: what the bulk tensor copies of
    this module's kernels (and the backward's, flash_attention_gluon_bwd) read as (rows, D)."""
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors)


def descriptor(t: torch.Tensor, rows: int, cols: int,
               swizzle: int | None = None) -> TensorDescriptor:
    """A tensor descriptor of ``t`` as a 2-D (rows·…, D) array in blocks of (rows, cols),
    NVMMA-swizzled for ``t``'s dtype (fp16, bf16 or fp32): the default swizzle for the block
    unless ``swizzle`` names its width in bytes (32, 64 or 128)."""
    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
           torch.float32: gl.float32}[t.dtype]
    if swizzle is None:
        layout = gl.NVMMASharedLayout.get_default_for([rows, cols], gdt)
    else:
        layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle,
                                      element_bitwidth=gdt.primitive_bitwidth, rank=2)
    return TensorDescriptor.from_tensor(t.reshape(-1, t.shape[-1]), [rows, cols], layout)


def fits(p: Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """The call's side of :func:`eligible`: Gluon available and not switched off
    (``_common.set_gluon``), and :func:`supported` on these tensors' dtype, contiguity and
    16-byte alignment. No device query (the sm_90a compile report installs it as
    ``eligible`` on CPU tensors)."""
    return (AVAILABLE and _common.get_gluon() != "off"
            and supported(p, q.dtype, tma_ready(q, k, v)))


def eligible(p: Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the forward of this call runs here: :func:`fits`, on an sm_90 GPU, outside
    the interpreter."""
    return fits(p, q, k, v) and on_sm90(q)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: Problem):
    """(out, lse) as the Triton forward returns them: out (B, Hq, Nq, D) in q's dtype, lse
    (B, Hq, Nq) fp32 in base-2 units. Only for calls :func:`eligible` accepts."""
    out = torch.empty((p.B, p.Hq, p.Nq, p.D), dtype=q.dtype, device=q.device)
    lse = torch.empty((p.B, p.Hq, p.Nq), dtype=torch.float32, device=q.device)

    LAUNCHES[0] += 1
    descs = (descriptor(q, BLOCK_M, p.D), descriptor(k, BLOCK_N, p.D),
             descriptor(v, BLOCK_N, p.D), descriptor(out, BLOCK_M, p.D), lse,
             p.scale * _common.LOG2E, p.Nq, p.Nk, p.Hq, p.group, p.Hkv)
    sched = flags(p.D)
    nc = consumers(p.D, p.Nq)
    maxnreg, consumer_regs = regs(nc)
    meta = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_D=p.D, STAGES=STAGES, CAUSAL=p.has_hi,
                NC=nc, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=PRODUCER_REGS,
                EARLY_P=sched["early_p"], SPLIT=sched["split"],
                RAGGED=p.Nq % (nc * BLOCK_M) != 0, num_warps=4, maxnreg=maxnreg)
    # the last tile takes the rows left (a multiple of 64: supported's rows_ok)
    tiles = (-(-p.Nq // (nc * BLOCK_M)), p.B * p.Hq)
    # (a CPU tensor only under the sm_90a compile check, which launches nothing)
    with _common.device_ctx(q):
        if _common.gluon_grid(p.D, p.Nk) == "persistent":
            paired = p.has_hi and tiles[0] % 2 == 0  # _slot: causal tiles in pairs
            units = tiles[0] * tiles[1] // (2 if paired else 1)
            programs = min(units, _common.sm_count(q.device))
            _fwd_persistent_kernel[(programs,)](*descs, tiles[1], PAIRED=paired, **meta)
        else:
            _fwd_kernel[tiles](*descs, **meta)
    return out, lse

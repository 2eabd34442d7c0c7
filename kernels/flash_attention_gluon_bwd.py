"""The five-product backward for Hopper in Gluon: dK, dV and dQ in one kernel.

The Triton backward (``flash_attention._backward``) is deterministic by construction: one
kernel accumulates dK/dV per key tile and another dQ per query tile, so the scores and dP
are computed twice (seven products per tile pair). This kernel computes them once (five
products) and adds each program's share of dQ into an fp32 accumulator by bulk tensor
reduce-adds (``cp.reduce.async.bulk``, Gluon's ``tma.async_atomic_add``). Per program, 128
keys of one batch and kv head:

- a producer warp (``_loads``) loads K and V once, then streams Q and dO tiles of 64 query
  rows through two-slot rings (``ready``/``empty`` mbarriers; a slot is refilled when both
  consumers have released it); under GQA it streams every query head of the group in turn;
- two consumer warpgroups (``_consume``, 64 keys each) run per query tile i: issue
  Sᵀ = K Q(i)ᵀ and dPᵀ = V dO(i)ᵀ; wait for Sᵀ (dPᵀ still in flight), Pᵀ = exp2(Sᵀ·c −
  lse(i)); issue dV += Pᵀ dO(i); wait for dPᵀ, dSᵀ = Pᵀ ∘ (dPᵀ − δ(i)); issue dK += dSᵀ Q(i);
  both write their dSᵀ rows into one 128-key buffer (an mbarrier counts the two writers; a
  slot per tile parity) and each multiplies all 128 keys' dS by its half of K's columns,
  so that each warpgroup's dQ tile is 64 × D/2 and every dQ element is added once per
  program. dQ's tile, scaled, is staged in shared memory and added by one bulk reduce-add;
- "writer" forms: the adds come from a warp of their own (``_writer``), fed by a two-slot
  staging ring per warpgroup, so that the consumers never wait on them;
- "ordered" forms (the deterministic class): the adds in a fixed order. A counter per
  (query tile, head-dim half) gives each program its turn: at its step i a program adds
  when the counter reads i // 2, so a tile's previous adder is the program with the next
  128 keys, which visited it two steps earlier; the first adder stores the tile, so the
  accumulator needs no zeros (under GQA the same per query head: a program takes the
  group's heads in turn, each head's tiles in the same order, with counters of their own).
  A program hands a tile's turn over once its copies have written, after it has issued
  the next tile's, so that waiting for the writes is off the path of the next copy (the
  writer forms take one turn per tile for both halves, the split forms one per half).
  Each program takes its (keys, head) from a ticket (an atomic counter read once at its
  start), so a program only ever waits on programs that started before it, whatever order
  the hardware launches them in. Under causal, program p visits query tiles 2p, 2p+1, ...
  (the rows that see its keys): tile T's adders are programs T//2, T//2 - 1, ..., 0, a
  chain without cycles, and the tickets hand out a head's programs last keys first, so the
  turns finish even one program at a time. Non-causal, the programs visit all tiles
  rotated by their first key (tile (2p + i) mod N/64 at step i), so that no two programs
  are on one tile at one step; the order is cyclic, and the turns finish on the condition
  that every program of a head can be resident at once (the tickets hand out a head's
  programs together; :func:`eligible` requires N/128 programs per head at most the
  multiprocessor count; one program fits per multiprocessor). Bitwise repeatable: the
  order depends on the program's (keys, head), not on which hardware block computes it.
  Should a GPU not hold them after all (shared under MPS), a turn waited for longer than
  :data:`TURN_LIMIT_NS` traps: the call ends in a CUDA error instead of hanging.

The arithmetic of the Triton backward: P and dS rounded to the input dtype before their
products, fp32 accumulators, base-2 lse, dK scaled once at the end; dQ's tiles are scaled
before their adds (the Triton dQ kernel scales its sum: one fp32 rounding apart). Delta =
rowsum(dO ∘ O) is the Triton preprocess kernel's, computed by the caller.

Where it runs (:func:`eligible`): CUDA sm_90, a Triton whose Gluon has the bulk reduce-add
(3.9; not 3.6), float16/bfloat16, head dim 64 or 128, Nq = Nk a multiple of 128, Q, K, V and
dO contiguous (B, H, N, D) at 16-byte aligned addresses, no mask, no band but the causal one
(top-left), GQA included (dK/dV in one fp32 accumulator over the group); the non-causal
ordered forms N/128 at most the multiprocessor count. ``_common.set_gluon_bwd``
(``FLASHCHECK_GLUON_BWD``) chooses the form: "auto" (the default: writer), "split",
"writer" or "off": calls with ``deterministic=False`` take the form as its adds come,
deterministic calls its ordered variant; everything else takes the Triton kernels.
Not run by the CPU interpreter (Gluon has none); ``tests/test_flash_gluon_bwd.py``
compiles every form for sm_90a without a GPU.
"""

from __future__ import annotations

import torch
from flashcheck.kernels import _common
from flashcheck.kernels import flash_attention_gluon as _fwd
from flashcheck.kernels._common import Problem

# Gluon's names as the forward imports them; the bulk tensor reduce-add is Triton 3.9's (3.6's
# Gluon has none).
AVAILABLE = _fwd.AVAILABLE and hasattr(getattr(_fwd, "tma", None), "async_atomic_add")
if AVAILABLE:  # pragma: no cover - depends on the installed Triton
    from flashcheck.kernels.flash_attention_gluon import (
        _tma_load,
        _tma_store,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # 3.9 / earlier

BLOCK_N = 64  # keys per consumer warpgroup (two per program)
BLOCK_M = 64  # query rows per streamed tile
STAGES = 2  # Q/dO ring depth: 2 x 2 x 16 KiB at D = 128, beside K, V (64 KiB) and dS (32 KiB)
# 12 warps (4 + 4 + 1 + the writer's 1, by warpgroup) share 65536 registers: 168 each as
# launched (setmaxnreg's multiple of 8 below 170); the producer's (and writer's) warpgroup
# drops to 24, the least setmaxnreg allows, and the consumers rise to 240, as in
# flash_attention_gluon.
MAXNREG = 168
FORMS = ("split", "writer")
# A turn waits for the programs with the next keys to get a tile step or two ahead: some
# microseconds. A minute means they cannot run at all (the non-causal forms' programs of a
# head not resident at once, as on a GPU shared under MPS): the waiting program traps, so
# that the call ends in a CUDA error ("an illegal instruction") instead of hanging.
TURN_LIMIT_NS = 60 * 10 ** 9
# The ordered forms' turn counters lie TURN_STRIDE int32 apart: 1 packs 32 to a 128-byte line
# (the default: what every GPU run so far measured); 32 gives each its own line, so that a
# writer polling its counter shares no line with counters that other programs release. Read
# per call; FLASHCHECK_GLUON_BWD_TURN_STRIDE sets it at import (the placement experiment of
# sweep.md round 22: `session.sh stateb`). The results are the same bits either way.
TURN_STRIDES = ("1", "32")
TURN_STRIDE = int(_common.env_choice("FLASHCHECK_GLUON_BWD_TURN_STRIDE", TURN_STRIDES, "1"))
# The swizzle (bytes) of the fp32 dQ tile each consumer stages in shared memory for its bulk
# add. 128, the default for a [64, D/2] fp32 block, puts rows r and r ^ 1 of a half-warp's
# 64-bit stores on the same 16-byte chunks: two wavefronts per half-warp where one does
# (scripts/smem_bank_conflicts.py); 32 lays a half-warp's four rows side by side in 128
# contiguous bytes (one wavefront), at four times the bulk operations per tile. Read per
# call; FLASHCHECK_GLUON_BWD_DQ_SWIZZLE sets it at import (the experiment of `session.sh
# dqswz`). The results are the same bits either way.
DQ_SWIZZLES = ("128", "32")
DQ_SWIZZLE = int(_common.env_choice("FLASHCHECK_GLUON_BWD_DQ_SWIZZLE", DQ_SWIZZLES, "128"))
LAUNCHES = [0]  # calls of backward() since import (tests and the GPU session read it)

if AVAILABLE:
    _TURN_LIMIT = gl.constexpr(TURN_LIMIT_NS)

    @gluon.jit
    def _loads(q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_bars,
               q_ready, q_empty, row0, q_row0, start_n, m_lo, n_qtiles, n_ctx, n_group, rot):
        """The producer warp: each consumer's K and V once, then Q and dO tile by tile."""
        BN: gl.constexpr = k_smem.type.shape[0] // 2
        BM: gl.constexpr = q_smem.type.shape[1]
        NS: gl.constexpr = q_smem.type.shape[0]
        for c in gl.static_range(2):
            mbarrier.expect(kv_bars.index(c),
                            k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            rows = row0 + start_n + c * BN
            _tma_load(k_desc, [rows, 0], kv_bars.index(c), k_smem.slice(c * BN, BN))
            _tma_load(v_desc, [rows, 0], kv_bars.index(c), v_smem.slice(c * BN, BN))
        for j in range(n_group * n_qtiles):  # the group's query heads in turn (GQA)
            i = j % n_qtiles
            slot = j % NS
            # a fresh mbarrier counts as phase 1 complete: the first pass waits for nothing
            mbarrier.wait(q_empty.index(slot), ((j // NS) & 1) ^ 1)
            mbarrier.expect(q_ready.index(slot),
                            q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            m = q_row0 + (j // n_qtiles) * n_ctx + (m_lo + i * BM + rot) % n_ctx
            _tma_load(q_desc, [m, 0], q_ready.index(slot), q_smem.index(slot))
            _tma_load(do_desc, [m, 0], q_ready.index(slot), do_smem.index(slot))

    @gluon.jit
    def _now():
        """The GPU's global nanosecond timer."""
        return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [],
                                         dtype=gl.int64, is_pure=False, pack=1)

    @gluon.jit
    def _turn(sem, rank):
        """The ordered forms: wait until the counter reads ``rank`` (acquire). At its step
        i a program's rank on its tile is i // 2 (a tile's adders come one per program,
        every other step). A wait past :data:`TURN_LIMIT_NS` traps: a CUDA error, not a
        hang. The previous adder's bulk copy wrote the tile through the async proxy and
        this program's will too, with the turn passed through the generic one between
        them: a proxy fence after the acquire orders this program's copy after it."""
        if gl.atomic_add(sem, 0, sem="acquire") != rank:
            start = _now()
            while gl.atomic_add(sem, 0, sem="acquire") != rank:
                if _now() - start > _TURN_LIMIT:
                    _asm("trap;")
        _asm("fence.proxy.async.global;")

    @gluon.jit
    def _asm(instruction: gl.constexpr):
        """One PTX instruction for its effect (a trap, a fence)."""
        gl.inline_asm_elementwise(instruction + " mov.u32 $0, 0;", "=r", [],
                                  dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _put(dq_desc, rows, col, staged, first):
        """A staged dQ half into the accumulator by one bulk copy: a store from the tile's
        first adder of an ordered form (so the accumulator needs no zeros), else a
        reduce-add."""
        if first:
            _tma_store(dq_desc, [rows, col], staged)
        else:
            tma.async_atomic_add(dq_desc, [rows, col], staged)

    @gluon.jit
    def _hand_over(sem, PENDING: gl.constexpr):
        """The ordered forms: once every bulk copy of this thread but the last ``PENDING``
        has written, the counter's next turn (release). The turn of a tile is handed over
        after the next tile's copies are issued, so that the wait for a copy's writes is
        off the path of the next one; the turns stay free of cycles (a program waits on a
        hand-over of an earlier step of the program with the next keys)."""
        tma.store_wait(pendings=PENDING, read_only=False)
        _barrier()
        gl.atomic_add(sem, 1, sem="release")

    @gluon.jit
    def _writer(dq_desc, sem_ptr, dq_smem, dq_full, dq_free, q_row0, m_lo, n_qtiles, n_ctx,
                n_group, rot, ORDERED: gl.constexpr, TURN_STRIDE: gl.constexpr):
        """The writer forms' adding warp: the consumers' staged dQ halves tile by tile (half
        0, then 1), each slot handed back once its copy has read it. Ordered, one turn per
        tile for both halves (the tile's half-0 counter), waited for before the halves are
        staged and handed over after the next tile's copies are issued."""
        BM: gl.constexpr = dq_smem.type.shape[1]
        HH: gl.constexpr = dq_smem.type.shape[2]
        prev = sem_ptr
        for j in range(n_group * n_qtiles):
            i = j % n_qtiles
            m = q_row0 + (j // n_qtiles) * n_ctx + (m_lo + i * BM + rot) % n_ctx
            if ORDERED:
                sem = sem_ptr + (m // BM) * (2 * TURN_STRIDE)
                _turn(sem, i // 2)
                for c in gl.static_range(2):
                    w = c * 2 + j % 2
                    mbarrier.wait(dq_full.index(w), (j // 2) & 1)
                    _put(dq_desc, m, c * HH, dq_smem.index(w), i // 2 == 0)
                if j > 0:
                    _hand_over(prev, 2)  # the previous tile's two copies have written
                prev = sem
                tma.store_wait(pendings=0)
                for c in gl.static_range(2):
                    mbarrier.arrive(dq_free.index(c * 2 + j % 2), count=1)
            else:
                for c in gl.static_range(2):
                    w = c * 2 + j % 2
                    mbarrier.wait(dq_full.index(w), (j // 2) & 1)
                    tma.async_atomic_add(dq_desc, [m, c * HH], dq_smem.index(w))
                    tma.store_wait(pendings=0)
                    mbarrier.arrive(dq_free.index(w), count=1)
        if ORDERED:
            _hand_over(prev, 0)

    @gluon.jit
    def _consume(args, C: gl.constexpr, CAUSAL: gl.constexpr, ORDERED: gl.constexpr,
                 WRITER: gl.constexpr, TURN_STRIDE: gl.constexpr):
        """Consumer warpgroup ``C``: keys start_n + C·BN onward, and dQ's head-dim half C
        over both warpgroups' keys (see the module docstring). Under causal both take every
        query tile from the program's first (dQ needs both halves); the masked rows
        contribute zeros."""
        (q_desc, dk_desc, dv_desc, dq_desc, lse_ptr, delta_ptr, sem_ptr, k_smem, v_smem,
         q_smem, do_smem, ds_smem, dq_smem, kv_bars, q_ready, q_empty, ds_ready, dq_full,
         dq_free, row0, q_row0, start_n, m_lo, n_qtiles, n_ctx, n_group, rot, qk_scale,
         sm_scale) = args
        BN: gl.constexpr = k_smem.type.shape[0] // 2
        HD: gl.constexpr = k_smem.type.shape[1]
        HH: gl.constexpr = HD // 2
        BM: gl.constexpr = q_smem.type.shape[1]
        NS: gl.constexpr = q_smem.type.shape[0]
        dtype: gl.constexpr = q_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HD, 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HH, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                     k_width=2)
        cols: gl.constexpr = gl.SliceLayout(0, s_layout)
        my_n = start_n + C * BN
        ks = k_smem.slice(C * BN, BN)
        vs = v_smem.slice(C * BN, BN)
        k_half = k_smem.slice(C * HH, HH, dim=1)  # both warpgroups' keys, this half of D
        dk = gl.zeros([BN, HD], gl.float32, layout=acc_layout)
        dv = gl.zeros([BN, HD], gl.float32, layout=acc_layout)
        s_zero = gl.zeros([BN, BM], gl.float32, layout=s_layout)
        dq_zero = gl.zeros([BM, HH], gl.float32, layout=dq_layout)
        prev = sem_ptr  # the ordered split form's previous turn (handed over a tile late)
        mbarrier.wait(kv_bars.index(C), 0)
        for j in range(n_group * n_qtiles):  # the group's query heads in turn (GQA)
            i = j % n_qtiles
            qb = q_row0 + (j // n_qtiles) * n_ctx  # this query head's rows
            slot = j % NS
            m0 = (m_lo + i * BM + rot) % n_ctx
            mbarrier.wait(q_ready.index(slot), (j // NS) & 1)
            qs = q_smem.index(slot)
            dos = do_smem.index(slot)
            st = warpgroup_mma(ks, qs.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dpt = warpgroup_mma(vs, dos.permute((1, 0)), s_zero, use_acc=False,
                                is_async=True)
            st = warpgroup_mma_wait(num_outstanding=1, deps=(st, ))
            offs_m = m0 + gl.arange(0, BM, layout=cols)
            lse = gl.load(lse_ptr + qb + offs_m)
            pt = gl.exp2(st * qk_scale - gl.expand_dims(lse, 0))
            if CAUSAL:
                keys = my_n + gl.arange(0, BN, layout=gl.SliceLayout(1, s_layout))
                pt = gl.where(gl.expand_dims(offs_m, 0) >= gl.expand_dims(keys, 1), pt, 0.0)
            dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), dos, dv,
                               is_async=True)
            dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt, ))
            delta = gl.load(delta_ptr + qb + offs_m)
            dst = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
            dk = warpgroup_mma(gl.convert_layout(dst, a_layout), qs, dk, is_async=True)
            # both warpgroups' dSᵀ rows into one buffer (a slot per tile parity: the slot's
            # previous readers finished their products before their last hand-over)
            dsf = ds_smem.index(j % 2)
            dsf.slice(C * BN, BN, dim=0).store(dst)
            fence_async_shared()
            mbarrier.arrive(ds_ready.index(j % 2), count=1)
            mbarrier.wait(ds_ready.index(j % 2), (j // 2) & 1)
            dq = warpgroup_mma(dsf.permute((1, 0)), k_half, dq_zero, use_acc=False,
                               is_async=True)
            dv, dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, dq))
            dq = dq * sm_scale
            if WRITER:
                # staged in this warpgroup's slot of its two-slot ring; the writer adds it
                w = C * 2 + j % 2
                mbarrier.wait(dq_free.index(w), ((j // 2) & 1) ^ 1)
                dq_smem.index(w).store(dq)
                fence_async_shared()
                mbarrier.arrive(dq_full.index(w), count=1)
            else:
                staged = dq_smem.index(C)
                tma.store_wait(pendings=0)  # the previous tile's copy has read the buffer
                staged.store(dq)
                fence_async_shared()
                if ORDERED:  # this half's counter of the tile
                    sem = sem_ptr + (((qb + m0) // BM) * 2 + C) * TURN_STRIDE
                    _turn(sem, i // 2)
                    _put(dq_desc, qb + m0, C * HH, staged, i // 2 == 0)
                    if j > 0:
                        _hand_over(prev, 1)  # the previous tile's copy has written
                    prev = sem
                else:
                    tma.async_atomic_add(dq_desc, [qb + m0, C * HH], staged)
            mbarrier.arrive(q_empty.index(slot), count=1)
        if ORDERED and not WRITER:
            _hand_over(prev, 0)
        # the other warpgroup's dQ products read this one's K rows (k_half): one more turn
        # of ds_ready, so that neither overwrites its K rows below while the other reads them
        jn = n_group * n_qtiles
        mbarrier.arrive(ds_ready.index(jn % 2), count=1)
        mbarrier.wait(ds_ready.index(jn % 2), (jn // 2) & 1)
        # dK's scale once at the end, as the Triton kernel does; out through K's / V's buffers
        ks.store((dk * sm_scale).to(dtype))
        vs.store(dv.to(dtype))
        fence_async_shared()
        _tma_store(dk_desc, [row0 + my_n, 0], ks)
        _tma_store(dv_desc, [row0 + my_n, 0], vs)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _bwd_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, lse_ptr,
                    delta_ptr, sem_ptr, ticket_ptr, qk_scale, sm_scale, N_CTX, GROUP,
                    BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr,
                    STAGES: gl.constexpr, CAUSAL: gl.constexpr, ORDERED: gl.constexpr,
                    WRITER: gl.constexpr, TURN_STRIDE: gl.constexpr):
        """One program per (128 keys, batch x kv head); under GQA dK/dV accumulate over the
        group's query heads in one fp32 accumulator."""
        dtype: gl.constexpr = q_desc.dtype
        if ORDERED:
            # the program's (keys, head) from its ticket: programs that wait on others take
            # theirs after them (the module docstring); a head's programs consecutively,
            # under causal last keys first (each waits on the one with the next keys)
            n_prog = N_CTX // (2 * BLOCK_N)
            ticket = gl.atomic_add(ticket_ptr, 1)
            bh = ticket // n_prog
            pid_n = ticket % n_prog
            if CAUSAL:
                pid_n = n_prog - 1 - pid_n
        else:
            pid_n = gl.program_id(0)
            bh = gl.program_id(1)
        row0 = bh * N_CTX  # K, V, dK, dV rows
        q_row0 = bh * GROUP * N_CTX  # the group's first query head's rows
        start_n = pid_n * (2 * BLOCK_N)
        if CAUSAL:
            m_lo = start_n  # query rows above the keys see none of them
        else:
            m_lo = 0
        n_qtiles = (N_CTX - m_lo) // BLOCK_M
        if ORDERED and not CAUSAL:
            rot = start_n  # the programs visit the query tiles rotated by their first key
        else:
            rot = 0

        k_smem = gl.allocate_shared_memory(dtype, [2 * BLOCK_N, HEAD_D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2 * BLOCK_N, HEAD_D], v_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], do_desc.layout)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=128, element_bitwidth=dtype.primitive_bitwidth, rank=2)
        ds_smem = gl.allocate_shared_memory(dtype, [2, 2 * BLOCK_N, BLOCK_M], ds_layout)
        kv_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        if WRITER:  # a two-slot staging ring per warpgroup
            dq_smem = gl.allocate_shared_memory(gl.float32, [4, BLOCK_M, HEAD_D // 2],
                                                dq_desc.layout)
            dq_full = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
            dq_free = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
            for w in gl.static_range(4):
                mbarrier.init(dq_full.index(w), count=1)
                mbarrier.init(dq_free.index(w), count=1)
        else:  # one staging buffer per warpgroup
            dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_D // 2],
                                                dq_desc.layout)
            dq_full = q_ready  # unused
            dq_free = q_ready
        for c in gl.static_range(2):
            mbarrier.init(kv_bars.index(c), count=1)
            mbarrier.init(ds_ready.index(c), count=2)
        for s in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(s), count=1)
            mbarrier.init(q_empty.index(s), count=2)

        args = (q_desc, dk_desc, dv_desc, dq_desc, lse_ptr, delta_ptr, sem_ptr, k_smem,
                v_smem, q_smem, do_smem, ds_smem, dq_smem, kv_bars, q_ready, q_empty,
                ds_ready, dq_full, dq_free, row0, q_row0, start_n, m_lo, n_qtiles, N_CTX,
                GROUP, rot, qk_scale, sm_scale)
        loads = (q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_bars,
                 q_ready, q_empty, row0, q_row0, start_n, m_lo, n_qtiles, N_CTX, GROUP, rot)
        if WRITER:
            gl.warp_specialize([(_consume, (args, 0, CAUSAL, ORDERED, WRITER, TURN_STRIDE)),
                                (_consume, (args, 1, CAUSAL, ORDERED, WRITER, TURN_STRIDE)),
                                (_loads, loads),
                                (_writer, (dq_desc, sem_ptr, dq_smem, dq_full, dq_free, q_row0,
                                           m_lo, n_qtiles, N_CTX, GROUP, rot, ORDERED,
                                           TURN_STRIDE))],
                               [4, 1, 1], [240, 24, 24])
        else:
            gl.warp_specialize([(_consume, (args, 0, CAUSAL, ORDERED, WRITER, TURN_STRIDE)),
                                (_consume, (args, 1, CAUSAL, ORDERED, WRITER, TURN_STRIDE)),
                                (_loads, loads)], [4, 1], [240, 24])


def supported(p: Problem, dtype: torch.dtype, contiguous: bool) -> bool:
    """Whether the problem is one this kernel computes, in every form (the device aside;
    ``contiguous``: Q, K, V and dO contiguous and 16-byte aligned). Pure: no device query,
    so the CPU suite tests it."""
    rows_ok = p.Nq == p.Nk and p.Nq > 0 and p.Nq % (2 * BLOCK_N) == 0
    band_ok = not p.has_lo and (not p.has_hi or p.hi_off == 0)
    return (dtype in (torch.float16, torch.bfloat16) and p.D in (64, 128) and contiguous
            and rows_ok and band_ok and p.mask is None)


def form_name(mode: str, deterministic: bool) -> str:
    """The name of a mode's form (a member of FORMS) for calls of this determinism: the
    mode itself as its adds come, "<mode>_ordered" for deterministic calls."""
    return mode + "_ordered" if deterministic else mode


def form(deterministic: bool) -> str | None:
    """The kernel form a call of this determinism takes under the current mode
    (``_common.get_gluon_bwd``): None (the Triton kernels), else ``form_name``'s."""
    mode = _common.get_gluon_bwd()
    if mode == "off":
        return None
    return form_name(_common.GLUON_BWD_AUTO if mode == "auto" else mode, deterministic)


def fits(p: Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
         deterministic: bool) -> bool:
    """The call's side of :func:`eligible`: Gluon's bulk reduce-add available, a form
    switched on for this determinism (:func:`form`), and :func:`supported` on these tensors.
    No device query (the sm_90a compile check calls it on CPU tensors)."""
    return (AVAILABLE and form(deterministic) is not None
            and supported(p, q.dtype, _fwd.tma_ready(q, k, v, do)))


def eligible(p: Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             do: torch.Tensor, deterministic: bool) -> bool:
    """Whether this call's backward runs here: :func:`fits`, on an sm_90 GPU, outside the
    interpreter; the non-causal ordered forms also need every program of a head resident
    at once (N/128 at most the multiprocessor count, one program per multiprocessor: their
    turns are cyclic over a head's programs). The causal ones need nothing more (their turns
    are a chain, handed out in its order)."""
    if not fits(p, q, k, v, do, deterministic) or not _fwd.on_sm90(q):
        return False
    return (not deterministic or p.has_hi
            or p.Nk // (2 * BLOCK_N) <= _common.sm_count(q.device))


def backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             lse: torch.Tensor, delta: torch.Tensor, p: Problem, deterministic: bool):
    """(dq, dk, dv) in the inputs' dtype, from the forward's base-2 ``lse`` and ``delta``
    (both fp32, (B, Hq, N)). Only for calls :func:`fits` accepts (:func:`eligible` on a
    GPU)."""
    name = form(deterministic)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    # dQ's fp32 accumulator: zeros for the adds as they come; the ordered forms' first adder
    # of each tile stores it, and their turn counters are one per (query tile, head-dim half),
    # followed by the programs' ticket counter
    if deterministic:
        acc = torch.empty((p.B, p.Hq, p.Nq, p.D), dtype=torch.float32, device=q.device)
        turns = p.B * p.Hq * (p.Nq // BLOCK_M) * 2 * TURN_STRIDE
        sem = torch.zeros(turns + 1, dtype=torch.int32, device=q.device)
        ticket = sem[turns:]
    else:
        acc = torch.zeros((p.B, p.Hq, p.Nq, p.D), dtype=torch.float32, device=q.device)
        sem = ticket = lse  # not read

    desc = _fwd.descriptor
    LAUNCHES[0] += 1
    with _common.device_ctx(q):
        _bwd_kernel[(p.Nk // (2 * BLOCK_N), p.B * p.Hkv)](
            desc(q, BLOCK_M, p.D), desc(k, BLOCK_N, p.D), desc(v, BLOCK_N, p.D),
            desc(do, BLOCK_M, p.D), desc(dk, BLOCK_N, p.D), desc(dv, BLOCK_N, p.D),
            desc(acc, BLOCK_M, p.D // 2, DQ_SWIZZLE), lse, delta,
            sem, ticket, p.scale * _common.LOG2E, p.scale, p.Nk, p.group, BLOCK_N=BLOCK_N,
            BLOCK_M=BLOCK_M, HEAD_D=p.D, STAGES=STAGES, CAUSAL=p.has_hi,
            ORDERED=deterministic, WRITER=name.startswith("writer"), TURN_STRIDE=TURN_STRIDE,
            num_warps=4, maxnreg=MAXNREG)
    return acc.to(q.dtype), dk, dv

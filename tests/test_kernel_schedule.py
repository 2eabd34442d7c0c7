"""The kernel's schedule choices change the speed, never the bits.

Each choice (``_common.SCHEDULE_TABLE``, the 256-row forward tile) must give results
bit-identical to the plain path: tensor-descriptor loads read the same operands (zeros past
the sequence and the head dim, as the masked pointer loads), the split forward runs per row
the same operations in the same order, and last-tile-first only reorders programs. Under
the interpreter (CPU) the descriptor path is forced with ``_common.tma("on")``, the 256-row
tile by pinning the forward's launch point; on CUDA the same tests run on the device.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from flashcheck.kernels import _common
from flashcheck.kernels import flash_attention as fa

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.float16  # runs on both: bf16 is wrong under the interpreter

CASES = [
    # (Nq, Nk, D, Hq, Hkv, kwargs)
    (40, 45, 24, 4, 2, dict(is_causal=True, enable_gqa=True)),
    (33, 17, 16, 2, 2, dict()),
    (48, 70, 32, 2, 1, dict(window=(5, 3), enable_gqa=True)),
    (37, 50, 72, 2, 2, dict(is_causal=True, causal_alignment="bottom_right")),
]


def _inputs(Nq, Nk, D, Hq, Hkv, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, Hq, Nq, D, generator=g).to(DTYPE).to(DEVICE)
    k = torch.randn(2, Hkv, Nk, D, generator=g).to(DTYPE).to(DEVICE)
    v = torch.randn(2, Hkv, Nk, D, generator=g).to(DTYPE).to(DEVICE)
    do = torch.randn(2, Hq, Nq, D, generator=g).to(DTYPE).to(DEVICE)
    return q, k, v, do


def _fwd_bwd(q, k, v, do, **kw):
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out = fa.attention(qg, kg, vg, **kw)
    out.backward(do)
    return out.detach(), qg.grad, kg.grad, vg.grad


def _assert_bitwise(a, b):
    for name, x, y in zip(("out", "dq", "dk", "dv"), a, b, strict=True):
        assert torch.equal(x, y), f"{name}: max diff {(x.float() - y.float()).abs().max()}"


@pytest.mark.parametrize("case", range(len(CASES)))
def test_descriptor_loads_are_bit_identical_to_pointer_loads(case):
    Nq, Nk, D, Hq, Hkv, kw = CASES[case]
    q, k, v, do = _inputs(Nq, Nk, D, Hq, Hkv, seed=case)
    with _common.tma("off"):
        plain = _fwd_bwd(q, k, v, do, **kw)
    with _common.tma("on"):
        p = _common.validate(q, k, v, None, 0.0, kw.get("is_causal", False), None,
                             kw.get("enable_gqa", False), kw.get("window"),
                             kw.get("causal_alignment", "top_left"))
        assert all(fa._hopper_flags(kind, p, q, (k, v))["TMA"] for kind in _common.KINDS)
        tma = _fwd_bwd(q, k, v, do, **kw)
    _assert_bitwise(plain, tma)


def test_row_statistics_through_descriptors_only_where_their_row_stride_allows():
    # The dK/dV kernel reads lse and delta through (B x H, Nq) descriptors when Nq * 4 bytes
    # is a multiple of 16; CASES has both kinds (Nq 40, 48 and 33, 37), each bit-identical
    # above. Here the flag itself, and the kernels' results on both sides of the rule.
    for nq, expect in ((40, True), (33, False), (48, True), (37, False)):
        q, k, v, do = _inputs(nq, 24, 16, 2, 2, seed=nq)
        p = _common.validate(q, k, v, None, 0.0, True, None, False, None, "top_left")
        rows = (torch.zeros(2, 2, nq, device=DEVICE), torch.zeros(2, 2, nq, device=DEVICE))
        with _common.tma("on"):
            assert fa._hopper_flags("dkdv", p, q, (q, do), rows)["ROWS"] is expect
            assert "ROWS" not in fa._hopper_flags("dq", p, q, (k, v))
            tma = _fwd_bwd(q, k, v, do, is_causal=True)
        with _common.tma("off"):
            assert fa._hopper_flags("dkdv", p, q, (q, do), rows)["ROWS"] is False
            plain = _fwd_bwd(q, k, v, do, is_causal=True)
        _assert_bitwise(plain, tma)
    assert not fa._rows_layout_ok(torch.zeros(2, 2, 40)[..., 1:])   # not contiguous


def test_descriptor_path_with_a_strided_layout_and_a_mask():
    # (B, N, H, D) storage viewed as (B, H, N, D): row stride H*D, head stride D.
    g = torch.Generator().manual_seed(5)
    base = [torch.randn(2, 40, 3, 32, generator=g).to(DTYPE).to(DEVICE) for _ in range(4)]
    q, k, v, do = (t.transpose(1, 2) for t in base)
    mask = (torch.rand(40, 40, generator=g) > 0.3).to(DEVICE)
    with _common.tma("off"):
        plain = _fwd_bwd(q, k, v, do, attn_mask=mask)
    with _common.tma("on"):
        tma = _fwd_bwd(q, k, v, do, attn_mask=mask)
    _assert_bitwise(plain, tma)


def test_layouts_the_copy_engine_refuses_fall_back_to_pointer_loads():
    q, k, v, do = _inputs(20, 20, 16, 2, 2)
    assert fa._tma_layout_ok(q, k)
    odd = torch.randn(2, 2, 20, 3).to(DTYPE).to(DEVICE)       # row stride 6 bytes
    assert not fa._tma_layout_ok(odd)
    shifted = torch.randn(2 * 2 * 20 * 16 + 1).to(DTYPE).to(DEVICE)[1:].view(2, 2, 20, 16)
    assert not fa._tma_layout_ok(shifted)                      # base 2 bytes off 16
    one_batch = torch.randn(1, 2, 20, 16).to(DTYPE).to(DEVICE).as_strided(
        (1, 2, 20, 16), (7, 320, 16, 1))                       # size-1 dim, odd stride
    assert fa._tma_layout_ok(one_batch)
    p = _common.validate(odd, odd, odd, None, 0.0, False, None, False, None, "top_left")
    with _common.tma("on"):
        assert fa._hopper_flags("fwd", p, odd, (odd, odd))["TMA"] is False
        with_fallback = _fwd_bwd(odd, odd, odd, torch.ones_like(odd))
    with _common.tma("off"):
        plain = _fwd_bwd(odd, odd, odd, torch.ones_like(odd))
    _assert_bitwise(plain, with_fallback)


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("tma", ["off", "on"])
def test_the_dp_product_issued_early_is_bit_identical(case, tma, monkeypatch):
    # EARLY moves the backward kernels' dP product before the exponentials: same operations,
    # same order per element. Forced on for both backward kernels, with and without
    # descriptors, against the table's order; one case with an additive mask as well.
    Nq, Nk, D, Hq, Hkv, kw = CASES[case]
    q, k, v, do = _inputs(Nq, Nk, D, Hq, Hkv, seed=20 + case)
    if case == 1:
        kw = dict(kw, attn_mask=torch.randn(Nq, Nk, generator=torch.Generator().manual_seed(3))
                  .to(DTYPE).to(DEVICE))
    orig = fa._hopper_flags
    results = []
    for early in (False, True):
        def flags(kind, *a, _e=early, **k_):
            f = orig(kind, *a, **k_)
            if kind != "fwd":
                assert "EARLY" in f
                f["EARLY"] = _e
            return f

        monkeypatch.setattr(fa, "_hopper_flags", flags)
        with _common.tma(tma):
            results.append(_fwd_bwd(q, k, v, do, **kw))
    _assert_bitwise(*results)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_256_row_tile_as_two_halves_is_bit_identical(case, monkeypatch):
    Nq, Nk, D, Hq, Hkv, kw = CASES[case]
    q, k, v, _do = _inputs(Nq, Nk, D, Hq, Hkv, seed=10 + case)
    orig = _common.launch_point
    results = []
    for rows in (128, 256):
        monkeypatch.setattr(_common, "launch_point", lambda kind, *a, _r=rows, **k_: (
            (_r, 16, 4, 1) if kind == "fwd" else orig(kind, *a, **k_)))
        p = _common.validate(q, k, v, None, 0.0, kw.get("is_causal", False), None,
                             kw.get("enable_gqa", False), kw.get("window"),
                             kw.get("causal_alignment", "top_left"))
        results.append(fa._forward(q, k, v, p, False))
    (o1, l1), (o2, l2) = results
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


# The package's own, captured before any test patches them (a patch wraps these, never an
# earlier patch).
_HOPPER_FLAGS, _LAUNCH_POINT = fa._hopper_flags, _common.launch_point


def _forced_forward(monkeypatch, q, k, v, p, rows: int, **forced):
    """Our forward at launch point (rows, 16, 4, 1) with its flags ``forced`` (and three
    multiprocessors for a persistent launch), plus the per-tile counts it records."""
    orig_flags, orig_point = _HOPPER_FLAGS, _LAUNCH_POINT

    def flags(kind, *a, **k_):
        f = orig_flags(kind, *a, **k_)
        if kind == "fwd":
            assert set(forced) <= set(f)
            f.update(forced)
        return f

    monkeypatch.setattr(fa, "_hopper_flags", flags)
    monkeypatch.setattr(_common, "launch_point", lambda kind, *a, **k_: (
        (rows, 16, 4, 1) if kind == "fwd" else orig_point(kind, *a, **k_)))
    monkeypatch.setattr(_common, "sm_count", lambda device: 3)
    stats = []
    out, lse = fa._forward(q, k, v, p, False, stats)
    return out, lse, stats[0][1]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_persistent_forward_and_smaller_halves_are_bit_identical(case, monkeypatch):
    # PERSIST: 3 or 6 programs loop over every query tile (in the grid's order, last tile
    # first under a causal band): the same bits and the same edge/full tile counts per tile.
    # HALVES: a 32-row tile held as two 16-row halves, as the 256-row tile is: the same bits
    # as 16-row tiles (each product has 16 rows either way; the interpreter's matmul may sum
    # differently for another row count).
    Nq, Nk, D, Hq, Hkv, kw = CASES[case]
    q, k, v, _do = _inputs(Nq, Nk, D, Hq, Hkv, seed=30 + case)
    p = _common.validate(q, k, v, None, 0.0, kw.get("is_causal", False), None,
                         kw.get("enable_gqa", False), kw.get("window"),
                         kw.get("causal_alignment", "top_left"))

    def fwd(rows, persist=0, halves=False):
        return _forced_forward(monkeypatch, q, k, v, p, rows, PERSIST=persist, HALVES=halves)

    plain = {rows: fwd(rows) for rows in (16, 256)}
    for rows, persist in ((16, 1), (16, 2), (256, 1)):
        for name, a, b in zip(("out", "lse", "tile counts"), plain[rows], fwd(rows, persist),
                              strict=True):
            assert torch.equal(a, b), (rows, persist, name)
    for persist in (0, 1):
        got = fwd(32, persist, halves=True)
        assert torch.equal(plain[16][0], got[0]) and torch.equal(plain[16][1], got[1]), persist


def test_schedule_table_covers_every_launch_and_rejects_bad_input():
    for kind in _common.KINDS:
        for elem, bd, band in itertools.product((2, 4), (16, 32, 64, 128, 256), (False, True)):
            flags = _common.schedule(kind, elem, bd, band)
            assert set(flags) == {"tma", "ws", "reverse", "rows", "early", "persist", "halves"}
            assert not flags["ws"] or flags["tma"], "warp specialisation needs TMA"
            assert not flags["early"] or kind != "fwd", "EARLY orders the backward's dP"
            assert not (flags["persist"] or flags["halves"]) or kind == "fwd", \
                "PERSIST and HALVES are the forward's"
            assert not flags["rows"] or (flags["tma"] and kind == "dkdv"), \
                "row statistics through descriptors: the dK/dV kernel's, with TMA"
    with pytest.raises(ValueError, match="TMA mode must be one of"):
        _common.set_tma("sometimes")
    with pytest.raises(ValueError, match="kind must be one of"):
        _common.schedule("bwd", 2, 128)
    # "auto" never takes descriptors off sm_90+ CUDA devices (the interpreter included).
    with _common.tma("auto"):
        assert not _common.use_tma("dq", torch.device("cpu"), 2, 128)
    with _common.tma("off"):
        assert not _common.use_tma("dq", torch.device(DEVICE), 2, 128)


def test_schedule_under_a_band_at_head_dim_64():
    """Sweep rounds 12-13: at BLOCK_D <= 64 the dK/dV kernel reads through descriptors with
    its row statistics, EARLY under a band only; the dQ kernel through descriptors under a
    band only. At D = 128 EARLY stays off under a band (that kernel spills there)."""
    for band in (False, True):
        dkdv = _common.schedule("dkdv", 2, 64, band)
        assert dkdv["tma"] and dkdv["rows"] and dkdv["early"] == band
        assert _common.schedule("dq", 2, 64, band)["tma"] == band
        assert _common.schedule("dkdv", 2, 128, band)["early"] == (not band)
    assert _common.heuristic_point("dkdv", 64, 2, True) == (64, 64, 4, 3)


@pytest.mark.parametrize("D, causal, mode, early", [
    (64, True, "on", True), (64, True, "off", False), (64, False, "off", False),
    (128, True, "on", False), (128, False, "on", True), (128, False, "off", True)])
def test_early_under_a_band_only_with_descriptors(D, causal, mode, early):
    q, k, v, _do = _inputs(32, 32, D, 2, 2)
    p = _common.validate(q, k, v, None, 0.0, causal, None, False, None, "top_left")
    with _common.tma(mode):
        flags = fa._hopper_flags("dkdv", p, q, (q, q), rows=())
    assert flags["TMA"] == (mode == "on")
    assert flags["EARLY"] == early


def test_autotune_pre_hook_gives_descriptors_the_config_block():
    t = torch.randn(1, 2, 64, 32).to(DTYPE)
    d = fa._descriptor(t, 16, 32)
    fa._tma_pre_hook(("DESC_K", "DESC_V"), "BLOCK_N")(
        {"DESC_K": d, "DESC_V": t, "BLOCK_N": 64, "BLOCK_D": 32})
    assert list(d.block_shape) == [1, 1, 64, 32]
    r = fa._row_descriptor(torch.zeros(1, 2, 64), 16)
    fa._tma_pre_hook(("DESC_Q",), "BLOCK_M", ("DESC_LSE",))(
        {"DESC_Q": d, "DESC_LSE": r, "BLOCK_M": 32, "BLOCK_D": 32})
    assert list(r.block_shape) == [1, 32] and list(d.block_shape) == [1, 1, 32, 32]


def test_last_tile_first_only_under_an_upper_bounded_band():
    q, k, v, _do = _inputs(32, 32, 16, 2, 2)

    def flags(kind, **kw):
        p = _common.validate(q, k, v, None, 0.0, kw.get("is_causal", False), None, False,
                             kw.get("window"), "top_left")
        return fa._hopper_flags(kind, p, q, (k, v))["REVERSE"]

    assert flags("fwd", is_causal=True) and flags("dq", is_causal=True)
    assert not flags("dkdv", is_causal=True)          # its longest tiles are the first ones
    assert not flags("fwd") and not flags("fwd", window=(4, 4))


def test_reduced_dq_accumulator_goes_to_the_kernel_as_a_descriptor(monkeypatch):
    # The bulk reduce-add path (deterministic=False, use_reduce) cannot run under the
    # interpreter; its launch can: the fp32 accumulator replaces DQ (argument 9) as a
    # descriptor with the kernel's query-tile rows, ATOMIC_DQ is 2, and the autotuner's
    # reset_to_zero can zero it through the descriptor.
    captured = {}
    use_reduce = _common.use_reduce

    class _Capture:
        def __getitem__(self, grid):
            def run(*args, **kw):
                captured.update(args=args, kw=kw)
            return run

    monkeypatch.setitem(fa._PATHS, "dkdv", (_Capture(), _Capture(), "BLOCK_N", "BLOCK_M"))
    monkeypatch.setattr(_common, "use_reduce", lambda device: True)
    q, k, v, do = _inputs(40, 40, 24, 2, 2)
    p = _common.validate(q, k, v, None, 0.0, True, None, False, None, "top_left")
    out, lse = fa._forward(q, k, v, p, False)
    fa._backward(do, q, k, v, out, lse, p, False, False)
    acc, kw = captured["args"][9], captured["kw"]
    assert kw["ATOMIC_DQ"] == 2
    assert isinstance(acc, fa._AccumDescriptor)
    assert acc.base.dtype == torch.float32 and tuple(acc.base.shape) == (2, 2, 40, 24)
    assert acc.block_shape == [1, 1, kw["BLOCK_M"], fa.block_d(24)]
    acc.base.fill_(1.0)
    acc.zero_()
    assert not acc.base.any()
    captured.clear()
    monkeypatch.setattr(_common, "use_reduce", lambda device: False)
    fa._backward(do, q, k, v, out, lse, p, False, False)
    assert captured["kw"]["ATOMIC_DQ"] == 1 and isinstance(captured["args"][9], torch.Tensor)
    with _common.tma("on"):
        assert not use_reduce(torch.device("cpu"))   # no descriptor reduce off the GPU

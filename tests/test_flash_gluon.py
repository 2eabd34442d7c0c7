"""The forward's Gluon path (kernels/flash_attention_gluon.py): where it runs, what it compiles
to, and, on an sm_90 GPU, that it gives the Triton forward's results.

On the CPU: the pure predicate (``supported``) over every condition, the switch, and the
kernel compiled for sm_90a without a GPU (scripts/ptxas_report.py's stand-in driver, in a
subprocess without the interpreter) with its structure read from the PTX. On an sm_90 GPU:
the Gluon forward against the Triton one (``_common.set_gluon("off")``) on causal, GQA,
unequal lengths and both head dims, forward and backward, and the calls it must leave to the
Triton forward.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from flashcheck.kernels import _common
from flashcheck.kernels import flash_attention as fa
from flashcheck.kernels import flash_attention_gluon as fg
from flashcheck.kernels._common import Problem
from script_modules import compile_for_sm90, load

ROOT = Path(__file__).resolve().parent.parent
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _problem(Nq=1024, Nk=1024, D=128, causal=False, hi_off=0, has_lo=False, mask=None,
             Hq=4, Hkv=2):
    return Problem(B=2, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=D, scale=D ** -0.5, has_lo=has_lo,
                   has_hi=causal, lo_off=0, hi_off=hi_off, is_causal=causal, mask=mask,
                   mask_kind=0 if mask is None else 1)


@pytest.mark.parametrize("kw, dtype, contiguous, want", [
    (dict(), torch.bfloat16, True, True),
    (dict(causal=True), torch.float16, True, True),
    (dict(Nq=128, Nk=8192, D=64), torch.bfloat16, True, True),  # D 64 past 4096 keys
    (dict(Nq=256, Nk=384, Hq=8, Hkv=1), torch.float16, True, True),  # MQA, Nq != Nk
    (dict(), torch.float32, True, False),  # fp32: the Triton forward
    (dict(D=64), torch.bfloat16, True, True),  # D 64 at 1024 keys: the persistent grid
    (dict(Nk=4096, D=64), torch.bfloat16, True, True),
    (dict(D=96), torch.bfloat16, True, False),
    (dict(Nq=1000), torch.bfloat16, True, False),  # rows not a multiple of 128
    (dict(Nk=1000), torch.bfloat16, True, False),
    (dict(causal=True, hi_off=24), torch.bfloat16, True, False),  # bottom-right, Nk > Nq
    (dict(has_lo=True), torch.bfloat16, True, False),  # a window's lower edge
    (dict(mask=torch.ones(1, dtype=torch.bool)), torch.bfloat16, True, False),
    (dict(), torch.bfloat16, False, False),  # not contiguous (B, H, N, D)
])
def test_supported_takes_exactly_its_problems(kw, dtype, contiguous, want):
    assert fg.supported(_problem(**kw), dtype, contiguous) is want


@pytest.mark.parametrize("D, Nk, want", [
    # (head dim, keys) -> the grid per mode: auto, tile, persistent, off
    (128, 128, ("persistent", "tile", "persistent", None)),
    (128, 4096, ("persistent", "tile", "persistent", None)),
    (128, 4224, ("tile", "tile", "persistent", None)),  # past the persistent grid's 4096
    (128, 16384, ("tile", "tile", "persistent", None)),
    (64, 1024, ("persistent", None, "persistent", None)),  # per tile measured slower here
    (64, 4096, ("persistent", None, "persistent", None)),
    (64, 4224, ("persistent", "tile", "persistent", None)),
    (64, 16384, ("persistent", "tile", "persistent", None)),
    (64, 16512, ("tile", "tile", "persistent", None)),
    (96, 1024, (None, None, None, None)),
])
def test_the_grid_per_mode_follows_the_measured_tables(D, Nk, want):
    """``gluon_grid``: "auto" takes the persistent grid up to GLUON_PERSISTENT_MAX_KEYS and
    per tile above (where GLUON_FWD_MIN_KEYS allows); "tile" and "persistent" one grid over
    the union of those domains' own; "off" none."""
    assert _common.GLUON_PERSISTENT_MAX_KEYS == {128: 4096, 64: 16384}
    assert _common.GLUON_FWD_MIN_KEYS == {128: 1, 64: 4097}
    got = []
    for mode in ("auto", "tile", "persistent", "off"):
        with _common.gluon(mode):
            got.append(_common.gluon_grid(D, Nk))
    assert tuple(got) == want


def test_eligible_never_off_the_gpu_and_the_switch_is_checked():
    q = torch.zeros(2, 4, 1024, 128, dtype=torch.float16)
    k = torch.zeros(2, 2, 1024, 128, dtype=torch.float16)
    assert not fg.eligible(_problem(), q, k, k)
    assert _common.get_gluon() == "auto"
    with pytest.raises(ValueError,
                       match=r"Gluon mode must be one of \('auto', 'tile', 'persistent', 'off'\)"):
        _common.set_gluon("on")
    env = {**os.environ, "FLASHCHECK_GLUON": "fast"}
    res = subprocess.run([sys.executable, "-c", "import flashcheck.kernels"], env=env,
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode != 0 and "FLASHCHECK_GLUON must be one of" in res.stderr


@pytest.mark.parametrize("mode, dims", [("auto", {64, 128}), ("persistent", {64, 128}),
                                         ("tile", {128})])
def test_the_forward_domain_campaign_entry_draws_the_head_dims_its_mode_takes(mode, dims):
    """scripts/gpu/gluon_domain.py: head dim 64 only where the mode takes it at every length
    the entry draws (128 to 2048 keys), so that no case of its campaign leaves the path."""
    with _common.gluon(mode):
        entry = load("scripts/gpu/gluon_domain.py", f"gluon_domain_{mode}")
        assert entry.attention.capabilities["head_dims"] == dims
        assert all(_common.gluon_grid(d, n) for d in dims for n in range(128, 2049, 128))


@pytest.mark.skipif(not fg.AVAILABLE, reason="this Triton's Gluon has no warp_specialize")
def test_the_timing_script_names_each_grid_by_the_kernel_it_runs(monkeypatch):
    """scripts/gpu/gluon_fwd.py's "2wg 64x128 stages=2" is the per-tile grid and "2wg
    persistent" the persistent one, at every shape: under the default mode "auto" both
    names once ran the persistent grid at 4096 keys (one kernel timed twice)."""
    script = load("scripts/gpu/gluon_fwd.py", "gluon_fwd_grids")
    grids = []
    monkeypatch.setattr(fg, "forward", lambda q, k, v, p: grids.append(
        _common.gluon_grid(p.D, p.Nk)))
    q = torch.empty(1, 1, 4096, 128, dtype=torch.bfloat16)
    for name in ("2wg 64x128 stages=2", "2wg persistent"):
        script.forward(q, q, q, False, **script.VARIANTS[name])
    assert grids == ["tile", "persistent"]


def test_the_ab_scripts_bit_problems_run_the_grids_they_name():
    """scripts/gpu/gluon_fwd_ab.py's bit check: every problem is one the Gluon forward takes
    (fp16 and bf16, contiguous), and under the grid it names the forward launches that grid
    (``forward`` launches the per-tile kernel for any other answer, which would leave a
    persistent-grid change unchecked); both grids, both head dims, causal or not."""
    script = load("scripts/gpu/gluon_fwd_ab.py", "gluon_fwd_ab_problems")
    seen = set()
    for (B, Hq, Hkv, Nq, Nk, D, causal, grid) in script.PROBLEMS:
        p = script._problem(B, Hq, Hkv, Nq, Nk, D, causal)
        with _common.gluon(grid):
            assert _common.gluon_grid(D, Nk) == grid, (D, Nk, grid)
            for dtype in (torch.float16, torch.bfloat16):
                assert fg.supported(p, dtype, True), (B, Hq, Hkv, Nq, Nk, D, causal)
        seen.add((grid, D, causal))
    assert {(g, d, c) for g in ("tile", "persistent") for d in (64, 128)
            for c in (False, True)} <= seen
    # at D 64 with three consumers (the c3 variant), problems whose last tile leaves one or
    # two of them without rows
    ragged = {Nq % (3 * fg.BLOCK_M) // fg.BLOCK_M for (_, _, _, Nq, _, D, _, _)
              in script.PROBLEMS if D == 64}
    assert ragged >= {1, 2}, ragged


@pytest.mark.skipif(not fg.AVAILABLE, reason="this Triton's Gluon has no warp_specialize")
def test_fits_is_the_calls_side_without_a_device_query():
    """``fits`` (what the sm_90a compile report installs as ``eligible``) takes the domain on
    CPU tensors, follows the switch, and refuses misaligned or non-contiguous inputs;
    ``eligible`` adds the device and stays false here."""
    q = torch.zeros(2, 4, 1024, 128, dtype=torch.float16)
    k = torch.zeros(2, 2, 1024, 128, dtype=torch.float16)
    p = _problem()
    assert fg.fits(p, q, k, k) and not fg.eligible(p, q, k, k)
    with _common.gluon("off"):
        assert not fg.fits(p, q, k, k)
    with _common.gluon("persistent"):
        assert fg.fits(p, q, k, k)
    assert fg.fits(p, q, k, k)
    shifted = torch.zeros(2 * 4 * 1024 * 128 + 1, dtype=torch.float16)[1:].view(2, 4, 1024, 128)
    assert shifted.data_ptr() % 16 != 0 and not fg.fits(p, shifted, k, k)
    assert not fg.fits(p, q.transpose(1, 2).contiguous().transpose(1, 2), k, k)


# The Gluon forward's four launches (per tile and persistent, causal or not) at head dim D
# under the schedule kw, compiled for sm_90a (the H200's 132 multiprocessors for the
# persistent grid; at D 64 the per-tile grid takes only more than 4096 keys).
_COMPILE = r"""
from flashcheck.kernels import _common
from flashcheck.kernels import flash_attention_gluon as g
from flashcheck.kernels._common import Problem
_common.sm_count = lambda device: 132
D, kw = json.loads(sys.argv[2])
for mode, Nk in (("tile", 8192 if D == 64 else 2048), ("auto", 4096 if D == 64 else 2048)):
    for causal in (False, True):
        q = torch.empty(2, 4, 1024, D, dtype=torch.bfloat16)
        k = torch.empty(2, 2, Nk, D, dtype=torch.bfloat16)
        p = Problem(B=2, Hq=4, Hkv=2, Nq=1024, Nk=Nk, D=D, scale=D ** -0.5,
                    has_lo=False, has_hi=causal, lo_off=0, hi_off=0, is_causal=causal,
                    mask=None, mask_kind=0)
        comp.tag = f"{mode} causal={causal}"
        with _common.gluon(mode), g.schedule(**kw):
            g.forward(q, k, k, p)
print(json.dumps(comp.records))
"""


def _compile(D: int, kw: dict, ptx_dir: Path) -> list[dict]:
    """:data:`_COMPILE`'s records (registers, spills, shared memory, PTX hash per launch),
    its PTX and cubins kept under ``ptx_dir``."""
    res = compile_for_sm90(_COMPILE.replace("json.loads(sys.argv[2])", repr([D, kw])),
                           ptx_dir, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    recs = json.loads(res.stdout.strip().splitlines()[-1])
    assert [(r["launch"].split()[0], r["kernel"]) for r in recs] == [
        ("tile", "_fwd_kernel")] * 2 + [("auto", "_fwd_persistent_kernel")] * 2
    return recs


def test_compiles_for_sm90_with_its_partitions_and_overlap(tmp_path):
    """The kernel for sm_90a (no GPU), one program per tile and persistent: spills as
    measured per ptxas release (below), shared memory within the H200's 227 KiB (the
    persistent kernel's O has buffers of its own), and in the PTX the partitions' register
    budgets (240 for the consumers, 24 for the producer) and the consumer loop's two
    products committed back to back, the scores waited on with the P V product still in
    flight (``wgmma.wait_group 1``); only the persistent kernel strides over the tiles by
    the grid's size. In the SASS, the exponentials ahead of the wait for P V."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    if not fg.AVAILABLE:
        pytest.skip("this Triton has no Gluon warp_specialize")
    recs = _compile(128, {}, tmp_path)
    for r in recs:
        assert r["registers"] == fg.MAXNREG and r["shared_bytes"] <= 227 * 1024, r
        # Spills by ptxas release (ptxas -v, bf16 D 128): per tile 0 / 4 bytes (not causal
        # / causal) with 13.0, the H200's, and 0 / 32 with 13.4; persistent 0 / 24 and
        # 12 / 308 (causal tiles in pairs). The persistent causal kernel's are the mask's 32
        # column indices per thread, hoisted out of the loops and kept across tiles: 13.4
        # puts them in local memory (re-read as each tile starts), 13.0 mostly recomputes
        # them (the ``split`` schedule leaves none: test_schedules_compile_...).
        limit = 64 if r["kernel"] == "_fwd_kernel" else 512
        assert r["spill_store_bytes"] <= limit, r
    ptxs = {p.name: p.read_text() for p in tmp_path.glob("*.ptx")}
    assert len(ptxs) == 4
    for name, text in ptxs.items():
        assert ("%nctaid.x" in text) == name.startswith("_fwd_persistent_kernel"), name
    for text in ptxs.values():
        assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240;", text)
        assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", text)
        lines = [x.strip() for x in text.splitlines()
                 if "wgmma.commit" in x or "wgmma.wait" in x or "ex2.approx" in x]
        seq = ["commit" if "commit" in x else ("wait " + x.split()[-1].rstrip(";"))
               if "wait" in x else "ex2" for x in lines]
        # the loop: both products committed, then the scores waited on with P V in flight
        # (where the exponentials land in the text depends on the compiler's block order)
        joined = " ".join(seq)
        assert "commit commit wait 1" in joined and seq.count("ex2") >= 64, joined[-400:]
    # In the SASS, each consumer's loop runs a tile's 64 exponentials (and the rescale
    # factor's) before waiting for the previous tile's P V: without _attend's ``held`` store
    # ptxas put that wait ahead of 64 of the 66 (0 of 66 under causal), so P V overlapped
    # only the row maximum.
    _loops_overlap(tmp_path, recs, consumers=2)


def _loops_overlap(ptx_dir: Path, recs: list[dict], consumers: int, split: bool = False):
    """Each compiled kernel's consumer loops in the SASS (one per consumer warpgroup; with
    the ``split`` schedule, causal, two: the key tiles below the diagonal, then those it
    crosses) run a tile's exponentials before waiting for the previous tile's P V."""
    rep = load("scripts/ptxas_report.py")
    launches = {r["ptx_sha256"]: r["launch"] for r in recs}
    assert len(launches) == len(recs)
    for cubin in ptx_dir.glob("*.cubin"):
        loops = rep.exp_wait_order(cubin)
        causal = launches[cubin.stem.rsplit("-", 1)[1]].endswith("causal=True")
        assert len(loops) == consumers * (1 + (causal and split)), (cubin.name, loops)
        for loop in loops:
            assert loop["exp_before_wait"] >= 65 and loop["exp_after_wait"] == 0, (
                cubin.name, loop)


def test_the_consumer_counts_and_their_register_budgets():
    """Two consumer warpgroups by default (240 registers each, the producer 24, 168 per
    thread for the launch); three as a D 64 schedule (160 each, 128 for the launch: 4
    warpgroups share the 65536); no other count. The schedule flags by head dim, early P at
    D 64 the only one on by default; ``schedule`` sets them at every head dim and restores
    them."""
    assert fg.regs(2) == (168, 240) == (fg.MAXNREG, 240)
    assert fg.regs(3) == (128, 160)
    for nc in (2, 3):
        maxnreg, consumer = fg.regs(nc)
        assert maxnreg * 128 * (nc + 1) <= 65536
        assert consumer * 128 * nc + fg.PRODUCER_REGS * 128 <= maxnreg * 128 * (nc + 1)
    assert (fg.consumers(128), fg.consumers(64)) == (2, 2)
    default = {d: {"consumers": 2, "c3_from": fg.C3_FROM if d == 64 else None,
                   "early_p": d == 64, "split": False} for d in (128, 64)}
    assert fg.SCHEDULE == default and fg.flags(96) == fg.flags(128)
    # three consumers at D 64 from 8K queries on, by default; never at D 128
    assert fg.C3_FROM == 8192
    assert [fg.consumers(64, n) for n in (1024, 4096, 8191, 8192, 16384, 65536)] == \
        [2, 2, 2, 3, 3, 3]
    assert fg.consumers(128, 65536) == 2 and fg.consumers(96, 65536) == 2
    with fg.schedule(consumers64=3, split=True):
        assert fg.consumers(64) == 3 and fg.consumers(128) == 2
        assert fg.SCHEDULE == {d: {"consumers": 3 if d == 64 else 2, "c3_from": None,
                                   "early_p": d == 64, "split": True} for d in (128, 64)}
    with fg.schedule(consumers64=2):  # a count alone: that count at every length
        assert fg.consumers(64, 65536) == 2
    with fg.schedule(c3_from64=4096):
        assert [fg.consumers(64, n) for n in (4095, 4096)] == [2, 3]
    for bad in (0, -1, 2.5, "16K", True):
        with pytest.raises(ValueError, match="c3_from64 must be a query length > 0 or None"), \
                fg.schedule(c3_from64=bad):
            pass
    with pytest.raises(RuntimeError), fg.schedule(early_p=True):
        assert fg.flags(64)["early_p"] and fg.flags(128)["early_p"]
        raise RuntimeError
    assert fg.consumers(64) == 2 and fg.SCHEDULE == default
    with pytest.raises(ValueError, match="must be 2 or 3, got 4"):
        fg.regs(4)
    with pytest.raises(ValueError, match="must be 2 or 3, got 4"), fg.schedule(consumers64=4):
        pass
    assert fg.consumers(64) == 2 and fg.SCHEDULE == default


def test_schedules_by_name_and_from_the_environment():
    """A schedule's name sets its parts in order; ``FLASHCHECK_GLUON_SCHEDULE`` names one per
    head dim, read at import; a bad item is an error naming the variable, the item and what
    it may be."""
    assert fg.schedule_flags("c3+early+split") == dict(consumers=3, c3_from=None, early_p=True,
                                                        split=True)
    assert fg.schedule_flags("early+late") == dict(early_p=False)
    assert fg.schedule_spec("c3+late") == dict(consumers64=3, c3_from64=None, early_p=False)
    assert fg.schedule_spec("c3long") == dict(consumers64=2, c3_from64=fg.C3_FROM)
    assert fg.schedule_env("") == {}
    assert fg.schedule_env("64=early") == {64: dict(early_p=True)}
    assert fg.schedule_env(" 64=c3+early , 128=split") == {
        64: dict(consumers=3, c3_from=None, early_p=True), 128: dict(split=True)}
    for text, match in (("96=early", r"D one of \[64, 128\], got '96=early'"),
                        ("early", r"D=NAME .* got 'early'"),
                        ("64=fast", r"one of \['c2', 'c3', 'c3long', 'early', 'late', 'split'\], "
                                    "got 'fast'"),
                        ("128=c3", "three consumers fit D = 64 only, got '128=c3'"),
                        ("128=c3long", "three consumers fit D = 64 only, got '128=c3long'")):
        with pytest.raises(ValueError, match="FLASHCHECK_GLUON_SCHEDULE: .*" + match):
            fg.schedule_env(text)
    code = ("import json; from flashcheck.kernels import flash_attention_gluon as g; "
            "print(json.dumps([g.SCHEDULE, g.consumers(64)]))")
    run = functools.partial(subprocess.run, [sys.executable, "-c", code], capture_output=True,
                            text=True, timeout=300)
    env = dict(os.environ, FLASHCHECK_GLUON_SCHEDULE="64=c3+late,128=split")
    out = run(env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [
        {"64": dict(consumers=3, c3_from=None, early_p=False, split=False),
         "128": dict(consumers=2, c3_from=None, early_p=False, split=True)}, 3]
    bad = run(env=dict(os.environ, FLASHCHECK_GLUON_SCHEDULE="64=fast"))
    assert bad.returncode != 0 and "FLASHCHECK_GLUON_SCHEDULE" in bad.stderr


@pytest.mark.parametrize("D, kw, consumers, regs, spill_limit", [
    # ptxas 13.4, bf16, spill-store bytes per tile / persistent, not causal / causal:
    # 28 / 272 and 156 / 724, a few stores per tile in two of the three consumers' loops
    (64, dict(consumers64=3, early_p=True, split=True), 3, 128, 1024),
    (128, dict(early_p=True, split=True), 2, 168, 32),  # none in any of the four
])
def test_schedules_compile_with_their_budgets_and_overlap(D, kw, consumers, regs, spill_limit,
                                                          tmp_path):
    """The schedules besides the default (``flash_attention_gluon.schedule``), compiled for
    sm_90a: at D 64 three consumer warpgroups (192-row tiles, budgets 160 and the
    producer's 24 in the PTX), P rounded as soon as made and the causal loop split; each
    consumer loop in the SASS with a tile's exponentials ahead of its wait for P V."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    if not fg.AVAILABLE:
        pytest.skip("this Triton has no Gluon warp_specialize")
    recs = _compile(D, kw, tmp_path)
    consumer_regs = fg.regs(consumers)[1]
    for r in recs:
        assert r["registers"] == regs and r["shared_bytes"] <= 227 * 1024, r
        assert r["spill_store_bytes"] <= spill_limit, r
    for text in (p.read_text() for p in tmp_path.glob("*.ptx")):
        incs = re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+);", text)
        assert incs.count(str(consumer_regs)) >= consumers - 1, incs
        assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", text)
    _loops_overlap(tmp_path, recs, consumers, split=True)


needs_sm90 = pytest.mark.skipif(not SM90 or not fg.AVAILABLE,
                                reason="the Gluon forward runs on sm_90 GPUs only")


def _qkv(B, Hq, Hkv, Nq, Nk, D, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, Hkv, Nk, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, Hkv, Nk, D, device="cuda", dtype=dtype, generator=g)
    return q, k, v


@needs_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("shape, kw", [
    ((2, 4, 4, 1024, 1024, 128, torch.bfloat16), dict(is_causal=True)),
    ((2, 8, 2, 256, 640, 128, torch.float16), dict(enable_gqa=True)),
    ((1, 4, 1, 384, 384, 128, torch.bfloat16),
     dict(is_causal=True, causal_alignment="bottom_right", enable_gqa=True, scale=0.3)),
    ((1, 2, 2, 512, 256, 128, torch.bfloat16), dict(is_causal=True)),  # rows past the keys
    ((1, 2, 2, 256, 640, 128, torch.float16), dict(is_causal=True)),  # top-left, Nk > Nq
    ((1, 2, 2, 128, 8192, 64, torch.float16), dict()),
    ((1, 2, 2, 8192, 8192, 64, torch.bfloat16), dict(is_causal=True)),
    ((2, 4, 2, 1024, 1024, 64, torch.float16), dict(is_causal=True, enable_gqa=True)),
    ((1, 4, 4, 640, 4096, 64, torch.bfloat16), dict()),
])
@pytest.mark.parametrize("mode", ["tile", "persistent", "auto"])
def test_gluon_forward_gives_the_triton_forward_results(shape, kw, mode):
    """Out within 2 units in the last place of the dtype at its largest entry (another
    accumulation order inside the head-dim products) and lse within 8 fp32 ulps; the
    gradients through the shared backward from either forward's lse agree as closely. The
    persistent kernel computes each tile as the other does: the same bits."""
    B, Hq, Hkv, Nq, Nk, D, dtype = shape
    q, k, v = _qkv(B, Hq, Hkv, Nq, Nk, D, dtype)
    do = torch.randn_like(q)
    causal = kw.get("is_causal", False)
    p = _common.validate(q, k, v, None, 0.0, causal, kw.get("scale"),
                         kw.get("enable_gqa", False), None,
                         kw.get("causal_alignment", "top_left"))
    with _common.gluon(mode):
        if not fg.eligible(p, q, k, v):
            assert mode == "tile" and D == 64 and Nk <= 4096
            pytest.skip("D 64 at 4096 keys or fewer: outside the per-tile grid's domain")
        grid = _common.gluon_grid(D, Nk)
    before = fg.LAUNCHES[0]
    with _common.gluon(mode):
        got = fa._forward(q, k, v, p, False)
    assert fg.LAUNCHES[0] == before + 1
    with _common.gluon("tile"):
        if grid == "persistent" and fg.eligible(p, q, k, v):  # each tile's bits per tile
            per_tile = fa._forward(q, k, v, p, False)
            assert torch.equal(got[0], per_tile[0]) and torch.equal(got[1], per_tile[1])
            before += 1
    with _common.gluon("off"):
        want = fa._forward(q, k, v, p, False)
    assert fg.LAUNCHES[0] == before + 1
    eps = torch.finfo(dtype).eps
    bound = 2 * eps * float(want[0].float().abs().max())
    assert float((got[0].float() - want[0].float()).abs().max()) <= bound
    lse_bound = 8 * torch.finfo(torch.float32).eps * float(want[1].abs().max().clamp(min=1))
    assert float((got[1] - want[1]).abs().max()) <= lse_bound

    def grads():
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        fa.attention(qg, kg, vg, **kw).backward(do)
        return qg.grad, kg.grad, vg.grad

    with _common.gluon(mode):
        g_gluon = grads()
    with _common.gluon("off"):
        g_triton = grads()
    for a, b in zip(g_gluon, g_triton, strict=True):
        assert float((a.float() - b.float()).abs().max()) <= 4 * eps * float(
            b.float().abs().max())


@needs_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("shape, causal", [
    ((1, 2, 2, 128, 1024, 64), False),  # one tile, its third consumer past the queries
    ((2, 2, 1, 256, 256, 64), True),  # the last tile's rows one consumer's worth
    ((1, 4, 4, 640, 4096, 64), False), ((2, 4, 2, 1024, 1024, 64), True),
    ((1, 3, 3, 256, 8192, 64), False), ((1, 2, 2, 1024, 8192, 64), True),  # past 4096 keys
    ((2, 4, 2, 1024, 1024, 128), True), ((1, 4, 1, 384, 640, 128), True),
    ((1, 2, 2, 256, 8192, 128), False),
])
@pytest.mark.parametrize("mode", ["tile", "persistent"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_schedules_give_the_default_bits(shape, causal, mode, dtype):
    """Every schedule (three consumers at D 64: 192-row tiles, the last one ragged; P
    rounded as soon as made; the causal loop split at the diagonal) computes each 64 rows
    as the default does: O and lse bit for bit. A consumer past the queries that stored its
    rows would write the next head's first 64 (O and lse are one array over the heads),
    racing with the program that owns them: with several heads per problem the comparison
    sees it unless every such store comes first."""
    B, Hq, Hkv, Nq, Nk, D = shape
    q, k, v = _qkv(B, Hq, Hkv, Nq, Nk, D, dtype, seed=Nq + Nk)
    p = _common.validate(q, k, v, None, 0.0, causal, None, Hq != Hkv, None, "top_left")
    with _common.gluon(mode):
        if not fg.eligible(p, q, k, v):
            pytest.skip("outside this grid's domain")
        want = fg.forward(q, k, v, p)
        for kw in (dict(consumers64=3), dict(early_p=True), dict(early_p=False),
                   dict(split=True), dict(consumers64=3, early_p=True, split=True)):
            if "consumers64" in kw and D != 64:
                continue
            with fg.schedule(**kw):
                got = fg.forward(q, k, v, p)
            torch.cuda.synchronize()
            for a, b in zip(want, got, strict=True):
                assert not a.isnan().any() and torch.equal(
                    a.view(-1).view(torch.int8), b.view(-1).view(torch.int8)), kw


@needs_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("kw", [
    dict(attn_mask=True), dict(window=(8, 0)), dict(Nq=1000), dict(dtype=torch.float32),
    dict(transposed=True)])
def test_calls_outside_its_domain_take_the_triton_forward(kw):
    Nq = kw.get("Nq", 256)
    q, k, v = _qkv(1, 2, 2, Nq, 256, 128, kw.get("dtype", torch.bfloat16))
    mask = torch.ones(Nq, 256, dtype=torch.bool, device="cuda") if kw.get("attn_mask") \
        else None
    if kw.get("transposed"):
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    before = fg.LAUNCHES[0]
    fa.attention(q, k, v, attn_mask=mask, window=kw.get("window"))
    torch.cuda.synchronize()
    assert fg.LAUNCHES[0] == before


def test_the_bench_header_names_the_gluon_forward_mode(monkeypatch):
    """kernels/bench.py's meta["gluon_fwd"]: the mode the run took, or that this Triton
    cannot build the Gluon forward and the Triton forward ran."""
    from flashcheck.kernels import bench
    monkeypatch.setattr(fg, "AVAILABLE", True)
    assert bench.gluon_fwd_meta() == ("auto (persistent to 4096 keys at D 128, to 16384 keys "
                                      "at D 64; per tile above)")
    with _common.gluon("tile"):
        assert bench.gluon_fwd_meta() == "tile"
    with _common.gluon("persistent"):
        assert bench.gluon_fwd_meta() == "persistent"
        monkeypatch.setattr(fg, "AVAILABLE", False)
        meta = bench.gluon_fwd_meta()
    assert meta.startswith("persistent asked, not available under triton ") and \
        meta.endswith("(no Gluon warp_specialize): the Triton forward ran")
    with _common.gluon("off"):
        assert bench.gluon_fwd_meta() == "off"
    assert "Gluon forward persistent; Gluon backward off;" in bench.format_table(
        [], {"gluon_fwd": "persistent"})

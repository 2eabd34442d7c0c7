"""The backward's Gluon path (kernels/flash_attention_gluon_bwd.py): where it runs, the switch
that selects its form, what it compiles to, and, on an sm_90 GPU under a Triton whose Gluon
has the bulk reduce-add, that it gives the Triton backward's gradients.

On the CPU: the pure predicate (``supported``) over every condition, the switch and its
errors, the launcher's glue (``_backward`` hands an eligible call the Triton preprocess's
delta and returns what the kernel returns; the kernel stood in by a float64 reference of
its contract), and every form compiled for sm_90a without a GPU (scripts/ptxas_report.py's
stand-in driver, in a subprocess without the interpreter) with its structure read from the
PTX. On an sm_90 GPU: every form against the Triton backward (causal, GQA, both head dims,
both dtypes), the ordered forms bitwise repeatable, and the calls left to the Triton kernels.
"""

from __future__ import annotations

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
from flashcheck.kernels import flash_attention_gluon_bwd as gb
from flashcheck.kernels._common import INTERPRET, Problem
from script_modules import compile_for_sm90, load
from test_flash_gluon import _problem

ROOT = Path(__file__).resolve().parent.parent
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("kw, dtype, contiguous, want", [
    (dict(), torch.bfloat16, True, True),
    (dict(causal=True), torch.float16, True, True),
    (dict(D=64, Hq=8, Hkv=1), torch.bfloat16, True, True),  # MQA: the group loop
    (dict(causal=True, Hq=2, Hkv=2), torch.bfloat16, True, True),  # MHA, causal
    (dict(), torch.float32, True, False),
    (dict(D=96), torch.bfloat16, True, False),
    (dict(D=256), torch.bfloat16, True, False),
    (dict(Nq=1024, Nk=2048), torch.bfloat16, True, False),  # Nq != Nk
    (dict(Nq=1152, Nk=1152), torch.bfloat16, True, True),  # 9 x 128
    (dict(Nq=1000, Nk=1000), torch.bfloat16, True, False),
    (dict(Nq=64, Nk=64), torch.bfloat16, True, False),  # below one program's keys
    (dict(causal=True, hi_off=24), torch.bfloat16, True, False),  # another band
    (dict(has_lo=True), torch.bfloat16, True, False),  # a window's lower edge
    (dict(mask=torch.ones(1, dtype=torch.bool)), torch.bfloat16, True, False),
    (dict(), torch.bfloat16, False, False),  # not contiguous (B, H, N, D)
])
def test_supported_takes_exactly_its_problems(kw, dtype, contiguous, want):
    """Every form, the ordered ones included, takes the same problems."""
    assert gb.supported(_problem(**kw), dtype, contiguous) is want


def test_the_switch_chooses_the_form_and_names_its_values():
    """The default, "auto", takes writer's forms; "off" none (the Triton kernels)."""
    assert _common.get_gluon_bwd() == "auto" and _common.GLUON_BWD_AUTO == "writer"
    assert (gb.form(False), gb.form(True)) == ("writer", "writer_ordered")
    with _common.gluon_bwd("off"):
        assert gb.form(False) is None and gb.form(True) is None
    with _common.gluon_bwd("split"):
        assert (gb.form(False), gb.form(True)) == ("split", "split_ordered")
    with _common.gluon_bwd("writer"):
        assert (gb.form(False), gb.form(True)) == ("writer", "writer_ordered")
    assert _common.get_gluon_bwd() == "auto"
    with pytest.raises(ValueError,
                       match=r"Gluon backward mode must be one of \('auto', 'off', 'split', "
                             r"'writer'\), got 'on'"):
        _common.set_gluon_bwd("on")
    env = {**os.environ, "FLASHCHECK_GLUON_BWD": "fast"}
    res = subprocess.run([sys.executable, "-c", "import flashcheck.kernels"], env=env,
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode != 0 and "FLASHCHECK_GLUON_BWD must be one of" in res.stderr


@pytest.mark.skipif(not gb.AVAILABLE, reason="this Triton's Gluon has no bulk reduce-add")
def test_fits_is_the_calls_side_without_a_device_query():
    """``fits`` takes the domain on CPU tensors where a form is switched on (the default
    "auto" too; "off" not) and this Triton has the kernel, refuses dO (or any input)
    misaligned or not contiguous; ``eligible`` adds the device and stays false here."""
    q = torch.zeros(2, 4, 1024, 128, dtype=torch.float16)
    k = torch.zeros(2, 2, 1024, 128, dtype=torch.float16)
    p = _problem()
    assert gb.fits(p, q, k, k, q, False) is gb.AVAILABLE  # "auto" by default
    assert not gb.eligible(p, q, k, k, q, True)
    with _common.gluon_bwd("off"):
        assert not gb.fits(p, q, k, k, q, False)
    with _common.gluon_bwd("split"):
        assert gb.fits(p, q, k, k, q, False) and not gb.eligible(p, q, k, k, q, False)
        assert gb.fits(p, q, k, k, q, True)  # the ordered form (GQA), non-causal and causal
        assert gb.fits(_problem(causal=True), q, k, k, q, True)
        expanded = torch.zeros(1, dtype=torch.float16).expand_as(q)  # dO of a .sum()
        assert not gb.fits(p, q, k, k, expanded, False)
        shifted = torch.zeros(q.numel() + 1, dtype=torch.float16)[1:].view(q.shape)
        assert shifted.data_ptr() % 16 != 0 and not gb.fits(p, q, k, k, shifted, False)


@pytest.mark.skipif(not INTERPRET, reason="the glue is checked under the interpreter")
def test_backward_hands_an_eligible_call_the_preprocessed_delta(monkeypatch):
    """``_backward`` on a call ``eligible`` accepts: the Triton preprocess computes delta =
    rowsum(dO ∘ O), the Gluon launcher gets (dO, Q, K, V, lse, delta, problem, determinism)
    and its gradients are returned as they are; with the kernel stood in by a float64
    reference of its contract, they match autograd's through SDPA (GQA, causal)."""
    seen = {}

    def reference(q, k, v, do, is_causal, scale=None):  # float64 SDPA's gradients
        with torch.enable_grad():  # (the stand-in runs inside autograd's backward)
            qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
            out = torch.nn.functional.scaled_dot_product_attention(
                qd, kd, vd, is_causal=is_causal, scale=scale, enable_gqa=True)
            return torch.autograd.grad(out, (qd, kd, vd), do.double())

    def kernel(do, q, k, v, lse, delta, p, deterministic):
        seen.update(delta=delta.clone(), deterministic=deterministic)
        dq, dk, dv = reference(q, k, v, do, p.is_causal, p.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    monkeypatch.setattr(gb, "eligible", lambda *a: True)
    monkeypatch.setattr(gb, "backward", kernel)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 256, 64, generator=g, dtype=torch.float16)
    k, v = (torch.randn(1, 2, 256, 64, generator=g, dtype=torch.float16) for _ in range(2))
    do = torch.randn(1, 4, 256, 64, generator=g, dtype=torch.float16)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out = fa.attention_atomic(qg, kg, vg, is_causal=True, enable_gqa=True)
    out.backward(do)
    assert seen["deterministic"] is False
    want_delta = (out.detach().float() * do.float()).sum(-1)
    assert torch.allclose(seen["delta"], want_delta, rtol=1e-5, atol=1e-5)
    for got, w in zip((qg.grad, kg.grad, vg.grad), reference(q, k, v, do, True), strict=True):
        # the stand-in's own result, rounded to fp16 once
        assert torch.allclose(got.double(), w, rtol=2 ** -10, atol=2 ** -14)


_COMPILE = r"""
from flashcheck.kernels import _common
from flashcheck.kernels import flash_attention_gluon_bwd as gb
from flashcheck.kernels._common import Problem
from flashcheck.kernels._common import Problem
if not gb.AVAILABLE:
    print(json.dumps("no-bulk")); sys.exit(0)
comp.only = "_bwd_kernel"
for mode in ("split", "writer"):
    for D in (128, 64):
        for causal, det, hkv in ((False, False, 2), (True, False, 1), (False, True, 2),
                                 (False, True, 1), (True, True, 2)):
            q = torch.empty(1, 2, 1024, D, dtype=torch.bfloat16)
            kv = torch.empty(1, hkv, 1024, D, dtype=torch.bfloat16)
            r = torch.empty(1, 2, 1024)
            p = Problem(B=1, Hq=2, Hkv=hkv, Nq=1024, Nk=1024, D=D, scale=D ** -0.5,
                        has_lo=False, has_hi=causal, lo_off=0, hi_off=0, is_causal=causal,
                        mask=None, mask_kind=0)
            comp.tag = f"{mode} D={D} causal={causal} ordered={det} hkv={hkv}"
            with _common.gluon_bwd(mode):
                assert gb.fits(p, q, kv, kv, q, det), comp.tag
                gb.backward(q, q, kv, kv, r, r, p, det)
# the dQ staging tile's 32-byte swizzle (FLASHCHECK_GLUON_BWD_DQ_SWIZZLE=32), ordered MHA
gb.DQ_SWIZZLE = 32
q = torch.empty(1, 2, 1024, 128, dtype=torch.bfloat16)
p = Problem(B=1, Hq=2, Hkv=2, Nq=1024, Nk=1024, D=128, scale=128 ** -0.5, has_lo=False,
            has_hi=False, lo_off=0, hi_off=0, is_causal=False, mask=None, mask_kind=0)
for mode in ("split", "writer"):
    comp.tag = f"{mode} D=128 causal=False ordered=True hkv=2 dq_swizzle=32"
    with _common.gluon_bwd(mode):
        gb.backward(q, q, q, q, torch.empty(1, 2, 1024), torch.empty(1, 2, 1024), p, True)
print(json.dumps(comp.records))
"""


def test_every_form_compiles_for_sm90_with_its_partitions_and_bulk_adds(tmp_path):
    """Each form for sm_90a (no GPU; and the ordered forms with the dQ tile's 32-byte
    swizzle): registers as launched, shared memory within the
    H200's 227 KiB, spills of at most a few hundred bytes (measured: up to 344 at D 128 under
    causal), the partitions' budgets (240 for the consumers, 24 for the producer and the
    writer) and each program's dQ halves going out as bulk tensor reduce-adds; only the
    ordered forms take a ticket and wait for a turn (acquire, then a proxy fence), trapping
    past the turn's time limit, and only they store a tile's first dQ half instead of adding
    it."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    res = compile_for_sm90(_COMPILE, tmp_path, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    recs = json.loads(res.stdout.strip().splitlines()[-1])
    if recs == "no-bulk":
        pytest.skip("this Triton's Gluon has no bulk tensor reduce-add (tma.async_atomic_add)")
    assert len(recs) == 22 and {r["kernel"] for r in recs} == {"_bwd_kernel"}
    for r in recs:
        assert r["registers"] == gb.MAXNREG and r["spill_store_bytes"] <= 512, r
        assert r["shared_bytes"] <= 227 * 1024, r
        if "D=64" in r["launch"]:
            assert r["spill_store_bytes"] == 0, r
    ptx = {p.name: p.read_text() for p in tmp_path.glob("*.ptx")}
    assert len(ptx) == 22
    for text in ptx.values():
        assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240;", text)
        assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", text)
        assert "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add" in text
    # the ordered forms (2 forms x 2 head dims x non-causal MHA and GQA, causal GQA, and the
    # two with the 32-byte dQ swizzle) wait for turns, and only they take a ticket
    ordered = [text for text in ptx.values() if "acquire" in text]
    assert len(ordered) == 14
    assert sum("atom.global.gpu.acq_rel.add" in text for text in ptx.values()) == 14
    assert all("atom.global.gpu.acq_rel.add" in text for text in ordered)
    # a turn that waits past TURN_LIMIT_NS (read from the global timer) traps; a turn taken
    # is followed by a proxy fence before the copy
    limit = re.compile(rf"setp\.\w+\.s64\s+%p\d+, %rd\d+, "
                       rf"({gb.TURN_LIMIT_NS}|{gb.TURN_LIMIT_NS + 1});")
    for text in ptx.values():
        assert bool("%globaltimer" in text and "trap;" in text and limit.search(text)
                    and "fence.proxy.async.global;" in text) == (text in ordered)
    for text in ptx.values():
        # dK and dV out by bulk stores (two per consumer); in the ordered forms each add site
        # has a bulk store beside it (the tile's first adder stores)
        stores = text.count("cp.async.bulk.tensor.2d.global.shared::cta")
        adds = text.count("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add")
        assert stores == 4 + (adds if "acquire" in text else 0), (stores, adds)
    # the 32-byte swizzle's dQ tile goes out in boxes of 32-byte rows: more bulk adds than
    # the default's 128-byte boxes, the same kernel otherwise
    by_tag = {r["launch"]: ptx[f"_bwd_kernel-{r['ptx_sha256']}.ptx"] for r in recs}
    reduce_add = "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add"
    for mode in ("split", "writer"):
        tag = f"{mode} D=128 causal=False ordered=True hkv=2"
        assert (by_tag[tag + " dq_swizzle=32"].count(reduce_add)
                > by_tag[tag].count(reduce_add)), mode


needs_gluon_bwd = pytest.mark.skipif(
    not SM90 or not gb.AVAILABLE,
    reason="the Gluon backward runs on sm_90 GPUs under a Triton with Gluon's bulk reduce-add")


def _qkv(B, Hq, Hkv, N, D, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, do = (torch.randn(B, Hq, N, D, device="cuda", dtype=dtype, generator=g)
             for _ in range(2))
    k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=dtype, generator=g)
            for _ in range(2))
    return q, k, v, do


def _grads(q, k, v, do, deterministic, **kw):
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    fa.attention_ext(qg, kg, vg, deterministic=deterministic, **kw).backward(do)
    return qg.grad, kg.grad, vg.grad


@needs_gluon_bwd
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["split", "writer"])
@pytest.mark.parametrize("shape, kw, deterministic", [
    ((2, 4, 4, 1024, 128, torch.bfloat16), dict(is_causal=True), False),
    ((2, 8, 2, 512, 128, torch.float16), dict(enable_gqa=True), False),
    ((1, 4, 1, 384, 64, torch.bfloat16), dict(is_causal=True, enable_gqa=True, scale=0.3),
     False),
    ((1, 2, 2, 1024, 64, torch.float16), dict(), False),
    ((2, 4, 4, 1024, 128, torch.bfloat16), dict(), True),
    ((1, 2, 2, 768, 64, torch.float16), dict(scale=0.2), True),
    ((2, 8, 2, 512, 128, torch.bfloat16), dict(enable_gqa=True), True),
    ((2, 4, 4, 1024, 128, torch.bfloat16), dict(is_causal=True), True),
    ((1, 4, 1, 384, 64, torch.float16), dict(is_causal=True, enable_gqa=True, scale=0.3),
     True),
    # causal, the ordered forms need no bound on N: 160 programs per head, more than any
    # sm_90 GPU's multiprocessors (132 on the H200)
    ((1, 2, 1, 20480, 64, torch.bfloat16), dict(is_causal=True, enable_gqa=True), True),
])
def test_gluon_backward_gives_the_triton_backward_gradients(mode, shape, kw, deterministic):
    """dQ, dK, dV within 4 units in the last place of the dtype at each tensor's largest
    entry of the Triton backward's (the same rounding of P and dS to the input dtype; the
    fp32 sums in another order, dQ's tiles scaled before their adds); the ordered forms
    give the same bits twice (causal too, with more programs per head than multiprocessors:
    their turns are a chain handed out by tickets in its order)."""
    B, Hq, Hkv, N, D, dtype = shape
    q, k, v, do = _qkv(B, Hq, Hkv, N, D, dtype)
    with _common.gluon_bwd("off"):  # the Triton backward (the default takes writer's form)
        want = _grads(q, k, v, do, True, **kw)
    before = gb.LAUNCHES[0]
    with _common.gluon_bwd(mode):
        got = _grads(q, k, v, do, deterministic, **kw)
        again = _grads(q, k, v, do, deterministic, **kw) if deterministic else got
    assert gb.LAUNCHES[0] == before + (2 if deterministic else 1)
    eps = torch.finfo(dtype).eps
    for a, b in zip(got, want, strict=True):
        assert float((a.float() - b.float()).abs().max()) <= 4 * eps * float(
            b.float().abs().max())
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True))


def _launch_stand_in(monkeypatch, causal):
    """_bwd_kernel replaced by a stand-in that records its arguments (``seen["args"]``,
    ``seen["kw"]``), and CPU inputs for one launch: (seen, q, lse-shaped r, problem)."""
    seen = {}

    class Kernel:  # stands in for _bwd_kernel[grid](...)
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.update(args=args, kw=kw)

    monkeypatch.setattr(gb, "_bwd_kernel", Kernel())
    q = torch.zeros(1, 2, 1024, 128, dtype=torch.bfloat16)
    r = torch.zeros(1, 2, 1024)
    p = Problem(B=1, Hq=2, Hkv=2, Nq=1024, Nk=1024, D=128, scale=0.1, has_lo=False,
                has_hi=causal, lo_off=0, hi_off=0, is_causal=causal, mask=None, mask_kind=0)
    return seen, q, r, p


@pytest.mark.skipif(not gb.AVAILABLE, reason="needs Gluon's bulk reduce-add (to import)")
def test_the_turn_counters_lie_turn_stride_apart(monkeypatch):
    """The ordered forms' launcher: one zeroed counter per (query tile, head-dim half),
    TURN_STRIDE int32 apart, the programs' ticket counter after them; TURN_STRIDE is read per
    call and handed to the kernel (32: a 128-byte line each)."""
    seen, q, r, p = _launch_stand_in(monkeypatch, causal=True)
    for stride in (1, 32):
        monkeypatch.setattr(gb, "TURN_STRIDE", stride)
        gb.backward(q, q, q, q, r, r, p, True)
        sem, ticket = seen["args"][9], seen["args"][10]
        turns = 1 * 2 * (1024 // gb.BLOCK_M) * 2 * stride
        assert sem.dtype == torch.int32 and sem.numel() == turns + 1 and not sem.any()
        assert ticket.numel() == 1 and ticket.data_ptr() == sem.data_ptr() + 4 * turns
        assert seen["kw"]["TURN_STRIDE"] == stride and seen["kw"]["ORDERED"] is True


@needs_gluon_bwd
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["split", "writer"])
def test_the_turn_stride_leaves_the_ordered_gradients_bitwise(mode, monkeypatch):
    """A counter per 128-byte line (TURN_STRIDE 32) changes where the turns are polled, not
    the order of the adds: the same bits as the packed counters, causal and not."""
    q, k, v, do = _qkv(2, 4, 4, 1024, 128, torch.bfloat16)
    with _common.gluon_bwd(mode):
        for causal in (False, True):
            packed = _grads(q, k, v, do, True, is_causal=causal)
            monkeypatch.setattr(gb, "TURN_STRIDE", 32)
            spread = _grads(q, k, v, do, True, is_causal=causal)
            monkeypatch.setattr(gb, "TURN_STRIDE", 1)
            assert all(torch.equal(a, b) for a, b in zip(packed, spread, strict=True))


@pytest.mark.skipif(not gb.AVAILABLE, reason="needs Gluon's bulk reduce-add (to import)")
def test_the_dq_tile_takes_the_swizzle_dq_swizzle_names(monkeypatch):
    """The launcher builds dQ's descriptor (and so the staging tile, which takes its layout)
    with DQ_SWIZZLE, read per call; Q, K, V, dO, dK and dV keep their blocks' defaults."""
    seen, q, r, p = _launch_stand_in(monkeypatch, causal=False)
    for swizzle in (128, 32):
        monkeypatch.setattr(gb, "DQ_SWIZZLE", swizzle)
        gb.backward(q, q, q, q, r, r, p, True)
        descs = seen["args"][:7]
        assert descs[6].layout.swizzle_byte_width == swizzle
        assert descs[6].layout.element_bitwidth == 32 and descs[6].block_shape == [64, 64]
        assert all(d.layout.swizzle_byte_width == 128 for d in descs[:6])


@needs_gluon_bwd
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["split", "writer"])
def test_the_dq_swizzle_leaves_the_gradients_bitwise(mode, monkeypatch):
    """The dQ tile's 32-byte swizzle changes where a tile waits in shared memory and how many
    boxes carry it out, not what is added in which order: the ordered forms give the same
    bits as with the default swizzle, causal and not, at both head dims; its adds as they
    come agree with them within 4 units in the last place at each tensor's largest entry."""
    for D in (128, 64):
        q, k, v, do = _qkv(2, 4, 4, 1024, D, torch.bfloat16)
        with _common.gluon_bwd(mode):
            for causal in (False, True):
                default = _grads(q, k, v, do, True, is_causal=causal)
                monkeypatch.setattr(gb, "DQ_SWIZZLE", 32)
                swizzled = _grads(q, k, v, do, True, is_causal=causal)
                atomic = _grads(q, k, v, do, False, is_causal=causal)
                monkeypatch.setattr(gb, "DQ_SWIZZLE", 128)
                assert all(torch.equal(a, b) for a, b in zip(default, swizzled, strict=True))
                # dQ's fp32 adds in another order: the bound of the Triton comparison above
                eps = torch.finfo(torch.bfloat16).eps
                for a, b in zip(atomic, default, strict=True):
                    assert float((a.float() - b.float()).abs().max()) <= 4 * eps * float(
                        b.float().abs().max())


@needs_gluon_bwd
@pytest.mark.gpu
@pytest.mark.parametrize("kw", [
    dict(attn_mask=True), dict(window=(8, 0)), dict(N=1000), dict(dtype=torch.float32),
    dict(deterministic=True, N="more programs per head than multiprocessors")])
def test_calls_outside_its_domain_take_the_triton_backward(kw):
    N = kw.get("N", 256)
    if isinstance(N, str):  # the non-causal ordered forms' bound (eligible)
        N = 128 * (_common.sm_count(torch.device("cuda")) + 1)
    q, k, v, do = _qkv(1, 2, 2, N, 128, kw.get("dtype", torch.bfloat16))
    mask = torch.ones(N, N, dtype=torch.bool, device="cuda") if kw.get("attn_mask") else None
    before = gb.LAUNCHES[0]
    with _common.gluon_bwd("split"):
        _grads(q, k, v, do, kw.get("deterministic", False), attn_mask=mask,
               window=kw.get("window"), is_causal=kw.get("is_causal", False))
    torch.cuda.synchronize()
    assert gb.LAUNCHES[0] == before


@pytest.mark.skipif(not gb.AVAILABLE or not INTERPRET,
                    reason="needs Gluon's bulk reduce-add (to import) and the interpreter")
def test_the_campaign_entries_fail_a_call_that_left_the_gluon_backward(monkeypatch):
    """scripts/gpu/gluon_bwd_domain.py: its capabilities pass the contract check, importing
    it switches a form on, and a backward that did not run the Gluon kernel exactly once
    raises AssertionError (a failure to the harness, not a skip); with the kernel stood in
    (counting its launch) both entries pass gradients through."""
    from flashcheck.verify.capabilities import check_capabilities

    monkeypatch.setattr(_common, "_gluon_bwd_mode", ["off"])
    dom = load("scripts/gpu/gluon_bwd_domain.py")
    assert _common.get_gluon_bwd() == "split"
    for entry in (dom.attention, dom.attention_ordered):
        check_capabilities(entry.capabilities)
    assert dom.attention.capabilities["deterministic_backward"] is False
    assert dom.attention_ordered.capabilities["deterministic_backward"] is True

    def stand_in(do, q, k, v, lse, delta, p, deterministic):
        gb.LAUNCHES[0] += 1
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 128, 64, generator=g, dtype=torch.float16).requires_grad_()
               for _ in range(3))
    with pytest.raises(AssertionError, match="did not run the Gluon kernel once"):
        dom.attention(q, k, v).sum().backward()
    monkeypatch.setattr(gb, "eligible", lambda *a: True)
    monkeypatch.setattr(gb, "backward", stand_in)
    for entry in (dom.attention, dom.attention_ordered):
        q.grad = None
        entry(q, k, v).backward(torch.ones(1, 2, 128, 64, dtype=torch.float16))
        assert q.grad is not None and not q.grad.any()


def _turns(n_ctx: int, resident: int, group: int = 1, causal: bool = False,
           heads: int = 2, last_keys_first: bool = True) -> bool:
    """The ordered forms' turns, modelled: ``heads`` kv heads of N/128 programs each, run on
    ``resident`` slots; a program takes the next ticket as it starts (ticket t: head t // P,
    program p = t % P, under causal P - 1 - p when ``last_keys_first``, as the kernel
    does). Program p (first key 128p) takes the group's query heads in turn and visits
    each head's query tiles: non-causal tile (2p + i) mod N/64 at step i, causal tile 2p + i
    (the rows that see its keys); it adds when that tile's counter reads i // 2, and hands
    the turn over (the counter's increment) when it takes its next turn, or at its end. True
    if every add happens (each counter value taken once, every tile by all the programs
    whose keys it sees), False on a deadlock."""
    P, Q = n_ctx // (2 * gb.BLOCK_N), n_ctx // gb.BLOCK_M
    counters = [0] * (heads * group * Q)
    step: dict[int, int] = {}  # running ticket -> its next step
    held: dict[int, int] = {}  # running ticket -> the counter it has yet to hand over
    taken = 0

    def program(t):
        h, p = divmod(t, P)
        return h, (P - 1 - p if causal and last_keys_first else p)

    def tiles(p):
        return Q - 2 * p if causal else Q

    while taken < heads * P or step:
        while len(step) < resident and taken < heads * P:
            step[taken], taken = 0, taken + 1
        moved = False
        for t in list(step):
            h, p = program(t)
            g, i = divmod(step[t], tiles(p))
            tile = (2 * p + i) if causal else (2 * p + i) % Q
            c = (h * group + g) * Q + tile
            if counters[c] == i // 2:
                if t in held:
                    counters[held[t]] += 1
                held[t] = c
                step[t] += 1
                moved = True
                if step[t] == group * tiles(p):
                    counters[held.pop(t)] += 1
                    del step[t]
        if not moved:
            return False
    assert counters == [min(P, T // 2 + 1) if causal else P for T in range(Q)] * (heads * group)
    return True


@pytest.mark.parametrize("n_ctx", [256, 1024, 4096])
def test_ordered_turns_finish_where_eligible_lets_them_run(n_ctx):
    """What ``eligible`` rests on. Non-causal, each tile's counter is taken by the programs
    of its head one at a time in a cycle: the turns finish when a head's N/128 programs can
    all be resident, and deadlock when they cannot (hence the bound on N/128). Causal, the
    turns are a chain (a tile's adders, last keys first), handed out by the tickets in its
    order: they finish one program at a time, and would deadlock on a GPU with fewer slots
    than a head's programs if the tickets went first keys first."""
    P = n_ctx // (2 * gb.BLOCK_N)
    for group in (1, 4):  # MHA; a GQA group of four query heads per program
        assert _turns(n_ctx, P, group) and _turns(n_ctx, P + 5, group)
        assert not _turns(n_ctx, P - 1, group)
        assert _turns(n_ctx, 1, group, causal=True) and _turns(n_ctx, P + 5, group, causal=True)
        assert _turns(n_ctx, P, group, causal=True, last_keys_first=False)
        assert not _turns(n_ctx, P - 1, group, causal=True, last_keys_first=False)


@pytest.mark.parametrize("argv, message", [
    (["--d", "96", "--out", "x.json"], "--d must be head dims 64 and/or 128"),
    (["--d", "128,x", "--out", "x.json"], "--d must be head dims 64 and/or 128"),
    ([], "--out is required (or --check-small)"),
    (["--forms", "split,fast", "--out", "x.json"],
     "--forms must be among split, writer, split_ordered, writer_ordered"),
    (["--forms", "", "--out", "x.json"], "--forms must be among"),
])
def test_the_timing_script_names_a_bad_argument(argv, message, capsys):
    script = load("scripts/gpu/gluon_bwd.py")
    with pytest.raises(SystemExit) as exc:
        script.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_the_timing_script_tables_a_run(tmp_path, capsys):
    """``--table``: one line per form and row, speed as cuDNN's time over the form's, the worst
    difference in 4-ulp units, an error kept as text (a form a killed call left unfinished
    among them), runs' rows one after the other; a file that is not a result exits 2."""
    script = load("scripts/gpu/gluon_bwd.py")
    form = dict(gluon_launches=1, repeats_equal=True, dq_per_4ulp=0.25, dk_per_4ulp=0.5,
                dv_per_4ulp=0.125, ms=11.0)
    res = {"rows": [dict(D=128, causal=False, ours_ms=13.2, cudnn_ms=10.45, split=form,
                         writer=dict(error="RuntimeError: boom"),
                         split_ordered={**form, "ms": 12.0})]}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(res))
    assert script.main(["--table", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + 3
    assert lines[2] == ("| 128 | no | 13.20 | 10.45 | split | 11.00 | 0.950 | 1.200 | 0.5 | yes "
                        "| 1 |")
    assert "| writer | RuntimeError: boom |" in lines[3] and "split_ordered | 12.00" in lines[4]
    second = tmp_path / "ordered.json"
    second.write_text(json.dumps({"rows": [dict(D=64, causal=True, ours_ms=4.0, cudnn_ms=3.0,
                                                writer_ordered=dict(error=script.UNFINISHED))]}))
    assert script.main(["--table", str(path), str(second)]) == 0
    both = capsys.readouterr().out.splitlines()
    assert len(both) == 2 + 4 and both[:5] == lines
    lines = both
    assert lines[5].startswith("| 64 | yes | 4.00 | 3.00 | writer_ordered | did not finish")
    path.write_text("[]")
    with pytest.raises(SystemExit) as exc:
        script.main(["--table", str(path)])
    assert exc.value.code == 2 and "not a gluon_bwd.py result" in capsys.readouterr().err


def _bwd39_out(tmp_path, racecheck_errors=0, ordered_rows=4):
    """A bwd39 phase's output as `collect` leaves it: the writer's ordered form unfinished
    at one row and failing a GPU test, everything else clean; the ordered call's first
    ``ordered_rows`` rows (fewer: it ended there)."""
    def form(ms, **kw):
        return dict(gluon_launches=2, repeats_equal=True, dq_per_4ulp=0.3, dk_per_4ulp=0.2,
                    dv_per_4ulp=0.1, ms=ms, **kw)

    def rows(forms):
        return [dict(D=D, causal=c, ours_ms=13.0, cudnn_ms=10.0,
                     **{name: form(ms) for name, ms in forms.items()})
                for D in (128, 64) for c in (False, True)]

    tmp_path.mkdir()
    (tmp_path / "bwd39.json").write_text(json.dumps(
        {"rows": rows({"split": 10.5, "writer": 10.8})}))
    ordered = rows({"split_ordered": 11.0, "writer_ordered": 10.6})
    ordered[3]["split_ordered"]["ms"] = 13.5  # D 64 causal: slower than ours (13.0)
    ordered[1]["writer_ordered"] = {"error": load("scripts/gpu/gluon_bwd.py").UNFINISHED}
    (tmp_path / "bwd39_ordered.json").write_text(json.dumps({"rows": ordered[:ordered_rows]}))
    (tmp_path / "bwd39-pytest.log").write_text(
        "FAILED tests/test_flash_gluon_bwd.py::test_gluon_backward_gives_the_triton_backward_"
        "gradients[shape4-kw4-True-writer] - AssertionError\n1 failed, 60 passed in 80s\n"
        "exit=1\n")
    for tool in ("racecheck", "memcheck", "synccheck"):
        errors = racecheck_errors if tool == "racecheck" else 0
        (tmp_path / f"bwd39-{tool}.log").write_text(
            f"ok split causal=False hkv=2: launches 1, max |diff| / 4 ulps 0.2\n"
            f"========= ERROR SUMMARY: {errors} errors\nexit=0\n")
    for entry in ("attention", "attention_ordered"):
        for mode in ("split", "writer"):
            d = tmp_path / f"bwd39-fuzz-{entry}-{mode}"
            d.mkdir()
            (d / "summary.json").write_text(json.dumps(
                {"workers": 3, "examples": 120, "failures": [], "exit": 0}))
    return tmp_path


def test_the_bwd39_verdict_takes_the_mode_whose_forms_all_pass(tmp_path, capsys):
    """scripts/gpu/bwd39_verdict.py: a form unfinished at a row, or failing a GPU test that
    names it, fails its mode; the passing mode is taken, with its ordered form's speed
    against cuDNN and the acceptance command; racecheck's errors, which name no kernel,
    fail every form (exit 1), and so do rows an ended call never reached for its forms; a
    folder without the phase's output exits 2."""
    script = load("scripts/gpu/bwd39_verdict.py")
    out = _bwd39_out(tmp_path / "a")
    assert script.main([str(out), "--json", str(tmp_path / "v.json")]) == 0
    text = capsys.readouterr().out
    v = json.loads((tmp_path / "v.json").read_text())
    assert v["passing_modes"] == ["split"] and v["take"] == "split"
    probs = v["forms"]["writer_ordered"]["problems"]
    assert any("D=128 causal=True: did not finish" in p for p in probs)
    assert any("True-writer]" in p for p in probs)
    assert v["forms"]["writer"]["problems"] == [] and v["forms"]["split"]["problems"] == []
    assert v["forms"]["split_ordered"]["d128_x_cudnn"] == {"false": 10 / 11, "true": 10 / 11}
    assert v["forms"]["split_ordered"]["meets_target"] is True
    assert v["forms"]["split_ordered"]["slower_than_ours"] == ["D=64 causal=True"]
    assert v["forms"]["split"]["slower_than_ours"] == []
    assert "FLASHCHECK_GLUON_BWD=split KERNEL_MIN=10" in text
    g = v["forms"]["split_ordered"]["geomean_x_cudnn"]
    assert g == pytest.approx((10 / 11) ** 0.75 * (10 / 13.5) ** 0.25) and f"{g:.3f}x" in text
    assert "Slower than our Triton backward at D=64 causal=True: a default must route" in text

    out = _bwd39_out(tmp_path / "b", racecheck_errors=3)
    assert script.main([str(out)]) == 1
    text = capsys.readouterr().out
    assert "racecheck: 3 reported error(s)" in text and "No mode passes" in text
    # the ordered call ended after two rows: the rows it never reached fail both its forms
    out = _bwd39_out(tmp_path / "c", ordered_rows=2)
    assert script.main([str(out), "--json", str(tmp_path / "c.json")]) == 1
    v = json.loads((tmp_path / "c.json").read_text())
    for form in ("split_ordered", "writer_ordered"):
        assert {p for p in v["forms"][form]["problems"] if "not reached" in p} == {
            f"timing D=64 causal={c}: not reached (the call ended first)" for c in (False, True)}
    assert v["forms"]["split"]["problems"] == []
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        script.main([str(tmp_path)])
    assert exc.value.code == 2 and "DIR must hold the bwd39 phase's output" in \
        capsys.readouterr().err


def test_the_bench_header_says_when_the_gluon_backward_asked_for_could_not_run(monkeypatch):
    """kernels/bench.py's meta["gluon_bwd"]: the mode where the kernel can be built, and
    where this Triton cannot build it, that the Triton kernels ran in its place (a bench
    under triton 3.6 with the switch on measures the Triton kernels)."""
    from flashcheck.kernels import bench
    with _common.gluon_bwd("off"):
        assert bench.gluon_bwd_meta() == "off"
    monkeypatch.setattr(gb, "AVAILABLE", True)
    assert bench.gluon_bwd_meta() == "auto (writer)"
    monkeypatch.setattr(gb, "AVAILABLE", False)
    assert bench.gluon_bwd_meta().startswith("auto (the default) not available under triton ")
    with _common.gluon_bwd("writer"):
        monkeypatch.setattr(gb, "AVAILABLE", True)
        assert bench.gluon_bwd_meta() == "writer"
        monkeypatch.setattr(gb, "AVAILABLE", False)
        meta = bench.gluon_bwd_meta()
    assert meta.startswith("writer asked, not available under triton ") and \
        meta.endswith("the Triton kernels ran")


def test_the_bwd39_verdict_reads_racecheck_summaries_and_tells_the_loader_probe_apart(tmp_path):
    """bwd39_verdict.py on compute-sanitizer's logs as the H200 wrote them: racecheck's
    hazards (its summary line, not ERROR SUMMARY) fail every form with the source lines they
    name; memcheck's refused cuFuncSetAttribute in Triton's loadBinary (the oversized
    shared-memory probe triton 3.9 falls back from) fails nothing, but errors past the print
    limit, which cannot be told apart, do; 'N errors were not printed' is not counted twice."""
    script = load("scripts/gpu/bwd39_verdict.py")
    probe = ("========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to \"invalid argument\""
             " on CUDA API call to cuFuncSetAttribute.\n"
             "=========     Saved host backtrace up to driver entry point at error\n"
             "=========         Host Frame: loadBinary [0x4c33] in cuda_utils.so\n"
             "=========         Host Frame:  [0x18218f] in python3\n=========\n")
    race = ("========= Error: Race reported between Write access at _bwd_kernel+0x4790 in "
            "flash_attention_gluon_bwd.py:325\n=========     and Read access at "
            "_bwd_kernel+0x4850 in flash_attention_gluon_bwd.py:325 [5 hazards]\n")

    def problems(tool, text):
        p = {form: [] for form in script.FORMS}
        script._sanitizer(tool, text, p)
        assert all(v == p[script.FORMS[0]] for v in p.values())  # no kernel named: all
        return p[script.FORMS[0]]

    racecheck = problems("racecheck", race + "========= RACECHECK SUMMARY: 1 hazard displayed "
                         "(5 errors, 0 warnings)\nexit=0\n")
    assert racecheck == ["racecheck: 5 reported error(s) at flash_attention_gluon_bwd.py:325, "
                         "exit 0"]
    clean = "ok split causal=False hkv=1: launches 1\n========= ERROR SUMMARY: {} errors\nexit=0\n"
    assert problems("memcheck", probe * 3 + clean.format(3)) == []
    assert problems("memcheck", probe * 3 + clean.format(5) + "========= ERROR SUMMARY: 2 "
                    "errors were not printed. Use --print-limit option\n") == \
        ["memcheck: 2 reported error(s) (besides 3 of Triton's loader probe), exit 0"]
    assert problems("synccheck", "ok\n") == ["synccheck: no error summary (the run did not "
                                             "finish), exit None"]


def test_the_bwd39_verdict_accepts_racecheck_reports_traced_to_the_hand_off(tmp_path, capsys):
    """With --race-sass (race_trace.py compile's folder), racecheck's reports fail nothing
    when every error is a displayed report traced to Triton's warp-specialize hand-off;
    errors not displayed, or a report on a kernel's own buffer, still fail every form."""
    from tests.test_race_trace import _sass_dir

    script = load("scripts/gpu/bwd39_verdict.py")
    (tmp_path / "sass").mkdir()
    sass = _sass_dir(tmp_path / "sass")
    race = ("========= Error: Race reported between Write access at _bwd_kernel+0x4790 in "
            "bwd.py:325\n=========     and Read access at _bwd_kernel+0x4850 in bwd.py:325 "
            "[5 hazards]\n=========\nok  split causal=False hkv=2: launches 1\n")

    def run(errors, log=race):
        p, notes = {form: [] for form in script.FORMS}, []
        script._sanitizer("racecheck", log + "========= RACECHECK SUMMARY: 1 hazard displayed "
                          f"({errors} errors, 0 warnings)\nexit=0\n", p, sass, notes)
        assert all(v == p[script.FORMS[0]] for v in p.values())
        return p[script.FORMS[0]], notes

    assert run(1) == ([], [f"racecheck: all 1 reports traced to Triton's warp-specialize "
                           f"hand-off (race_trace.py, machine code of {sass})"])
    assert run(3) == (["racecheck: 3 error(s); race_trace.py: 0 of 1 displayed touch the "
                       "kernels' own buffers or could not be placed, 2 not displayed"], [])
    assert run(1, race.replace("0x4790 in", "0x4860 in"))[0] == [
        "racecheck: 1 error(s); race_trace.py: 1 of 1 displayed touch the kernels' own "
        "buffers or could not be placed"]
    out = _bwd39_out(tmp_path / "out")
    with pytest.raises(SystemExit) as exc:
        script.main([str(out), "--race-sass", str(tmp_path / "out")])
    assert exc.value.code == 2
    assert "--race-sass must be race_trace.py compile's folder" in capsys.readouterr().err

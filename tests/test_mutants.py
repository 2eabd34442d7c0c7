"""The mutant catalogue itself: each module is well-formed and wrong only where it says.

For every mutant this checks, against the float64 oracle, that on a "quiet" case (inputs
where its docstring says the bug cannot bite) it is as accurate as its correct base, and on a
"biting" case (inputs where the docstring says it bites) it is far off, non-finite, or (for
the adversarial ones) misbehaves in the way it is built to. That pins each docstring's claim;
whether the harness finds the biting inputs on its own is `tests/test_selftest.py`'s job.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
from pathlib import Path

import pytest
import torch
from flashcheck.reference.exact import attention_fp64
from flashcheck.verify.cases import Case
from flashcheck.verify.mutants import CATALOGUE, Mutant, by_name
from flashcheck.verify.mutants._blocked import BlockedAttention
from flashcheck.verify.mutants._ragged import DecodeAttention, VarlenAttention
from flashcheck.verify.mutants._triton_fwd import TritonForward
from flashcheck.verify.ragged import call_ragged

from flashcheck import verify

# Unit roundoff per dtype (docs: bf16 2^-8, fp16 2^-11, fp32 2^-24).
UNIT = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}
# A quiet mutant does the base's operations, in another order or with up to a few extra
# roundings to the input dtype (fp16 accumulator: acc, l, out), so its error stays within
# 4x the base's error or 4 unit roundoffs of the output's magnitude.
QUIET_FACTOR = 4.0
# A biting mutant must be off by far more than any rounding: 64x the quiet tolerance
# (the smallest planted error, fp16 accumulation on fp32 inputs, is ~2^11 times it).
BITE_FACTOR = 64.0

# Precision mutants whose error is a small multiple of a correct kernel's on their biting
# case: name -> the smallest ratio of their error to the base's error there (BITE_FACTOR is
# for bugs far above any rounding). p_bf16_for_fp16 rounds P with 2^-8 instead of 2^-11;
# its out error was 3.4x the base's on its biting case.
# ds_bf16_for_dk rounds dK's dS with 2^-8 instead of 2^-11; its dk error was 3-8x the
# base's (fp16, N 64-256, D 16-128).
PRECISION_BITE = {"p_bf16_for_fp16": 2.5, "ds_bf16_for_dk": 2.5}

BASE = dict(B=2, Hq=2, Hkv=2, Nq=16, Nk=16, D=16, dtype="float32", backward=False, seed=1)
GRAD = dict(backward=True)



def _varlen(lq, lk, **kw):
    """Overrides of BASE for a varlen case with these sequence lengths."""
    return dict(B=1, Nq=sum(lq), Nk=sum(lk), layout="bnhd", api="varlen",
                ragged={"seqlens_q": lq, "seqlens_k": lk}, **kw)


def _decode(lens, page=16, nq=2):
    """Overrides of BASE for a decode case with these cache lengths."""
    return dict(B=len(lens), Nq=nq, Nk=max(lens), layout="bnhd", api="decode",
                ragged={"cache_seqlens": lens, "page_size": page, "spare_blocks": 1})


# name -> (quiet case overrides or None, biting case overrides)
CASES: dict[str, tuple[dict | None, dict]] = {
    "rescale_div_l": (dict(Nk=16), dict(Nk=40)),
    "tail_unmasked": (dict(Nk=32), dict(Nk=37)),
    "causal_off_by_one": (dict(Nk=24), dict(Nk=24, is_causal=True)),
    "no_max_subtraction": (dict(Nk=24), dict(Nk=24, dist={"kind": "large_logits"})),
    "lse_without_log": (dict(Nk=1, **GRAD), dict(Nk=24, **GRAD)),
    "wrong_delta": (dict(Nk=24), dict(Nk=24, **GRAD)),
    "gqa_head_mapping": (dict(Hq=4, Hkv=1), dict(Hq=4, Hkv=2)),
    "scale_ignored": (dict(scale=None), dict(scale=0.5)),
    "mask_batch0": (
        dict(mask={"kind": "random", "shape": "hqk", "density": 0.5}),
        dict(mask={"kind": "key_padding", "shape": "bk", "lengths": [16, 5]}),
    ),
    "contiguous_strides": (dict(layout="contiguous"), dict(layout="bnhd")),
    "nan_dead_rows": (dict(), dict(mask={"kind": "dead_rows", "shape": "bhqk", "rows": 0.25})),
    "fp16_accumulation": (dict(dtype="float16"), dict(Nk=64)),
    "causal_alignment_ignored": (
        dict(Nk=32, is_causal=True),
        dict(Nk=32, is_causal=True, causal_alignment="bottom_right"),
    ),
    "window_off_by_one": (dict(window=(-1, 0)), dict(window=(3, 0))),
    "dk_unscaled": (dict(Nk=24), dict(Nk=24, **GRAD)),
    "gqa_grad_overwrite": (dict(Hq=4, Hkv=4, **GRAD), dict(Hq=4, Hkv=2, **GRAD)),
    "pv_fp16_accumulation": (dict(dtype="bfloat16"), dict(Nk=64)),
    "p_bf16_for_fp16": (dict(dtype="bfloat16", Nk=48), dict(dtype="float16", Nk=48)),
    "ds_bf16_for_dk": (dict(dtype="bfloat16", Nk=48, **GRAD),
                       dict(dtype="float16", Nk=48, **GRAD)),
    "lse_input_dtype": (
        dict(Nk=24, **GRAD),
        dict(Nk=24, dtype="bfloat16", dist={"kind": "large_logits"}, **GRAD),
    ),
    "varlen_neighbour_keys": (_varlen([16], [16]), _varlen([8, 8], [8, 8])),
    "varlen_cu_off_by_one": (_varlen([16], [16]), _varlen([8, 8], [8, 8])),
    "varlen_causal_global": (_varlen([8, 8], [8, 8], is_causal=True),
                             _varlen([8, 8], [4, 12], is_causal=True)),
    "decode_block_table_ignored": (None, _decode([20, 33])),  # every drawn table is shuffled
    "decode_page_off_by_one": (_decode([16, 9]), _decode([40, 33])),
    "decode_merge_no_rescale": (_decode([16, 9]), _decode([40, 33])),
    "decode_tail_unmasked": (_decode([32, 16]), _decode([37, 20])),
    "uninitialized_output": (None, dict()),
    "mutates_inputs": (dict(), dict()),
    "shape_cache": (dict(), dict()),
    "zero_small_outputs": (None, dict(Nk=64)),
    "key_subsample": (dict(Nk=32), dict(Nk=48)),
}


def _fresh(m: Mutant):
    """A new instance of the mutant (stateful ones must not share a cache across tests)."""
    att = m.load()
    return type(att)() if isinstance(att, (BlockedAttention, TritonForward)) else att


def _base_for(m: Mutant):
    api = m.load().capabilities.get("api", "dense")
    if api != "dense":
        return VarlenAttention() if api == "varlen" else DecodeAttention()
    return TritonForward() if m.impl == "triton" else BlockedAttention()


# The Triton mutants run on CUDA, or on the CPU under the interpreter only.
_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _run(kernel, case: Case):
    """(out, grads or None, inputs before the call, inputs after the call); outputs on CPU."""
    inp = case.materialize(_DEVICE)
    before = inp.clone()
    if case.backward:
        for t in (inp.query, inp.key, inp.value):
            t.requires_grad_(True)
    if inp.api_args is not None:
        out = call_ragged(kernel, inp)[0]
    else:
        out = kernel(inp.query, inp.key, inp.value, **inp.kwargs())
    grads = None
    if case.backward:
        grads = tuple(g.cpu() for g in
                      torch.autograd.grad(out, (inp.query, inp.key, inp.value), inp.grad_out))
    return out.detach().cpu(), grads, before, inp


def _errors(case: Case, out, grads) -> dict[str, tuple[float, float]]:
    """name -> (max abs error vs the float64 oracle, max |oracle|); inf if non-finite."""
    inp = case.materialize("cpu")
    leaves = [t.double().requires_grad_(case.backward) for t in (inp.query, inp.key, inp.value)]
    ref = attention_fp64(*leaves, **inp.kwargs())
    got = {"out": out}
    want = {"out": ref.detach()}
    if case.backward:
        ref_grads = torch.autograd.grad(ref, leaves, inp.grad_out.double())
        got.update(zip(("dq", "dk", "dv"), grads, strict=True))
        want.update(zip(("dq", "dk", "dv"), ref_grads, strict=True))
    res = {}
    for name, g in got.items():
        w = want[name]
        err = (g.double() - w).abs().max().item() if torch.isfinite(g).all() else float("inf")
        res[name] = (err, w.abs().max().item())
    return res


def _tolerance(base_err: float, scale: float, dtype) -> float:
    return QUIET_FACTOR * max(base_err, UNIT[dtype] * scale)


def test_catalogue_covers_the_package():
    folder = Path(verify.mutants.__file__).parent
    files = {p.stem for p in folder.glob("*.py") if not p.stem.startswith("_")}
    assert files == {m.name for m in CATALOGUE}
    assert set(CASES) == files
    assert sum(m.kind == "bug" for m in CATALOGUE) >= 14
    assert len({m.name for m in CATALOGUE}) == len(CATALOGUE)


@pytest.mark.parametrize("m", CATALOGUE, ids=lambda m: m.name)
def test_module_shape(m: Mutant):
    mod = importlib.import_module(f"flashcheck.verify.mutants.{m.name}")
    assert mod.__doc__ and len(mod.__doc__.split()) > 20, "docstring must name bug and inputs"
    assert isinstance(mod.capabilities, dict) and mod.capabilities is mod.attention.capabilities
    assert m.kind in ("bug", "adversarial") and m.impl in ("triton", "pytorch")
    tree = ast.parse(m.path.read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(i and i.split(".")[0] == "kernels" for i in imported)
    assert (m.impl == "triton") == ("flashcheck.verify.mutants._triton_fwd" in imported)


def test_by_name_rejects_unknown():
    with pytest.raises(ValueError, match="mutant must be one of"):
        by_name("no_such_mutant")


@pytest.mark.parametrize(
    "m", [m for m in CATALOGUE if CASES[m.name][0] is not None], ids=lambda m: m.name
)
def test_quiet_where_the_bug_cannot_bite(m: Mutant):
    """Mutants wrong on every input (uninitialized_output, zero_small_outputs) have none."""
    quiet, _ = CASES[m.name]
    case = Case(**{**BASE, **quiet})
    base_err = _errors(case, *_run(_base_for(m), case)[:2])
    errs = _errors(case, *_run(_fresh(m), case)[:2])
    for name, (err, mag) in errs.items():
        tol = _tolerance(base_err[name][0], mag, case.torch_dtype)
        assert err <= tol, f"{m.name} quiet case {case.short()}: {name} err {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("m", CATALOGUE, ids=lambda m: m.name)
def test_bites_where_the_docstring_says(m: Mutant):
    _, bite = CASES[m.name]
    case = Case(**{**BASE, **bite})
    kernel = _fresh(m)
    if m.name == "shape_cache":  # the first case of a shape primes the cache
        _run(kernel, dataclasses.replace(case, seed=case.seed + 1))
    out, grads, before, after = _run(kernel, case)
    if m.name == "mutates_inputs":
        assert not torch.equal(before.query, after.query.detach())
        return
    base_out, base_grads = _run(_base_for(m), case)[:2]
    base_err = _errors(case, base_out, base_grads)
    errs = _errors(case, out, grads)
    if m.name in PRECISION_BITE:
        worst = max(err / base_err[n][0] for n, (err, _) in errs.items())
        assert worst > PRECISION_BITE[m.name], f"{m.name} did not bite on {case.short()}: {errs}"
        return
    worst = max(err / _tolerance(base_err[n][0], mag, case.torch_dtype)
                for n, (err, mag) in errs.items())
    assert worst > BITE_FACTOR, f"{m.name} did not bite on {case.short()}: {errs}"

"""verify.adapters: spec parsing, capability probing, mask folding, the domain guard."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.fixtures_kernels import blocked_attention, blocked_attention_plain
from verify.adapters import SpecError, as_kernel, check_domain_guard, resolve_kernel
from verify.cases import Case


def test_module_attr_spec():
    k = resolve_kernel("tests.fixtures_kernels:blocked_attention", "cpu")
    assert k.fn is blocked_attention and k.name == "blocked_attention"
    assert k.extensions() == ("window", "causal_alignment")


def test_file_spec_loads_by_path(tmp_path):
    f = tmp_path / "my_kernel.py"
    f.write_text("import torch\n"
                 "def attn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,\n"
                 "         scale=None, enable_gqa=False):\n"
                 "    return torch.nn.functional.scaled_dot_product_attention(\n"
                 "        query, key, value, attn_mask=attn_mask, is_causal=is_causal,\n"
                 "        scale=scale, enable_gqa=enable_gqa)\n")
    k = resolve_kernel(f"{f}:attn", "cpu")
    assert k.name == "attn" and k.fn.__module__.startswith("flashcheck_kernel_")


@pytest.mark.parametrize("name", ["sdpa-math", "reference", "online", "flex"])
def test_builtins_resolve(name):
    k = resolve_kernel(name, "cpu")
    assert k.spec == name and callable(k.fn)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nonsense", "expected MODULE:ATTR"),
        ("no_such_module_xyz:attention", "module 'no_such_module_xyz' not found"),
        ("tests.fixtures_kernels:missing", "has no attribute 'missing'"),
        ("/nonexistent/dir/k.py:attention", "does not exist"),
        (":attention", "both sides"),
    ],
)
def test_bad_specs_raise_one_line(spec, message):
    with pytest.raises(SpecError, match=message) as info:
        resolve_kernel(spec, "cpu")
    assert "\n" not in str(info.value) and isinstance(info.value, ValueError)


def _no_bf16(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
    if query.dtype == torch.bfloat16:
        raise NotImplementedError("bfloat16 is not supported by this kernel")
    return blocked_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                             enable_gqa)


def test_probing_records_rejected_dtype_with_reason():
    k = as_kernel(_no_bf16, "cpu")
    ok, reason = k.supports(Case(B=1, Hq=1, Hkv=1, Nq=4, Nk=4, D=16, dtype="bfloat16"), "cpu")
    assert not ok and "bfloat16 is not supported" in reason
    assert k.supports(Case(B=1, Hq=1, Hkv=1, Nq=4, Nk=4, D=16, dtype="float16"), "cpu")[0]
    caps = k.capabilities
    assert caps["dtypes"] == ("float16", "float32") and caps["backward"] and caps["gqa"]
    assert "dtype=bfloat16" in caps["probed_not_run"]


FOLD_CASES = [
    Case(B=1, Hq=2, Hkv=1, Nq=9, Nk=21, D=16, is_causal=True, causal_alignment="bottom_right",
         seed=1),
    Case(B=2, Hq=2, Hkv=2, Nq=17, Nk=17, D=8, window=(3, 2), seed=2),
    Case(B=1, Hq=2, Hkv=2, Nq=12, Nk=20, D=16, is_causal=True, window=(4, -1),
         causal_alignment="bottom_right", mask={"kind": "random", "density": 0.7}, seed=3),
    Case(B=1, Hq=2, Hkv=2, Nq=12, Nk=12, D=16, is_causal=True,
         mask={"kind": "bias", "neginf_prob": 0.1}, seed=4),
]


@pytest.mark.parametrize("case", FOLD_CASES, ids=lambda c: c.short())
def test_mask_folding_equals_extension_path(case):
    native, folded = as_kernel(blocked_attention, "cpu"), as_kernel(blocked_attention_plain, "cpu")
    inputs = case.materialize("cpu")
    _, kw = folded.arguments(inputs)
    assert "window" not in kw and "causal_alignment" not in kw
    out_native, _ = native.call(inputs)
    out_folded, _ = folded.call(inputs)
    assert torch.equal(out_native, out_folded)


def test_sdpa_gets_causal_folded_when_a_mask_is_present():
    case = dataclasses.replace(FOLD_CASES[3])
    k = resolve_kernel("sdpa-math", "cpu")
    _, kw = k.arguments(case.materialize("cpu"))
    assert kw["is_causal"] is False and kw["attn_mask"] is not None


def _garbage_outside(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                     scale=None, enable_gqa=False):
    return torch.zeros_like(query)


_garbage_outside.capabilities = {"dtypes": ("float16", "float32"), "head_dims": (1, 128)}


def _strict(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False):
    if query.dtype not in (torch.float16, torch.float32) or query.shape[-1] > 128:
        raise ValueError("query: dtype must be float16/float32 and head dim <= 128")
    return torch.zeros_like(query)


_strict.capabilities = dict(_garbage_outside.capabilities)


@pytest.mark.parametrize("fn, status", [(_garbage_outside, "outside_domain_accepted"),
                                        (_strict, "raised")])
def test_domain_guard(fn, status):
    findings = check_domain_guard(fn, "cpu")
    assert {f.probe for f in findings} == {"head_dim=512", "dtype=float64"}
    assert all(f.status == status for f in findings), findings

"""verify.adapters: spec parsing, capability probing, mask folding, the domain guard."""

from __future__ import annotations

import dataclasses
import functools
import logging

import pytest
import torch
from flashcheck.verify.adapters import SpecError, as_kernel, check_domain_guard, resolve_kernel
from flashcheck.verify.cases import Case

from tests.fixtures_kernels import blocked_attention, blocked_attention_plain


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


def _no_mask_with_causal(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                         scale=None, enable_gqa=False):
    if attn_mask is not None and is_causal:
        raise ValueError("attn_mask: must be None when is_causal=True")
    return blocked_attention_plain(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                   enable_gqa)


def test_a_kernel_refusing_a_mask_with_is_causal_gets_the_causal_structure_folded_in():
    """Probed, not declared: a kernel that (like SDPA's math path) refuses is_causal with an
    attn_mask gets the causal structure folded into the mask, so those cases run and pass;
    one that takes the pair is called with both."""
    from flashcheck.verify.check import check_case

    case = FOLD_CASES[3]
    refusing = as_kernel(_no_mask_with_causal, "cpu")
    assert refusing.capabilities["causal_with_mask"] is False
    _, kw = refusing.arguments(case.materialize("cpu"))
    assert kw["is_causal"] is False and kw["attn_mask"] is not None
    assert check_case(refusing, case, "cpu").status == "pass"
    taking = as_kernel(blocked_attention_plain, "cpu")
    assert taking.capabilities["causal_with_mask"] is True
    _, kw = taking.arguments(case.materialize("cpu"))
    assert kw["is_causal"] is True and kw["attn_mask"] is not None


def test_raw_sdpa_refusing_the_pair_on_one_layout_is_not_run_there_not_a_failure():
    """torch's SDPA on a CPU takes is_causal with a mask for contiguous inputs (the probe
    runs) and refuses it for strided ones ("Explicit attn_mask should not be set when
    is_causal=True"): a clear rejection, so "not run: reason", never a failure."""
    from flashcheck.verify.check import check_case

    k = resolve_kernel("torch.nn.functional:scaled_dot_product_attention", "cpu")
    for layout in ("contiguous", "strided"):
        case = dataclasses.replace(FOLD_CASES[3], layout=layout, dtype="float32")
        v = check_case(k, case, "cpu")
        assert v.status in ("pass", "not_run"), (layout, v.status, v.reason)
        if v.status == "not_run":
            assert "should not be set when is_causal" in v.reason


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


# -- declared domains and probes inside them ------------------------------------------------


def _multiple_of_16(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                    scale=None, enable_gqa=False):
    n, d = query.shape[2], query.shape[3]
    if n % 16 or key.shape[2] % 16 or d not in (16, 32, 64):
        raise ValueError(f"query: N must be a multiple of 16 and D in {{16, 32, 64}}, got "
                         f"N={n}, D={d}")
    return blocked_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                             enable_gqa)


_multiple_of_16.capabilities = {"seq_multiple": 16, "head_dims": {16, 32, 64}}


def test_probes_stay_inside_the_declared_domain():
    """Undeclared dtypes, masks, GQA and backward are probed with N = 16 and D in the set:
    the kernel's rejection of N = 4 never takes a dtype out."""
    k = as_kernel(_multiple_of_16, "cpu")
    caps = k.capabilities
    assert caps["dtypes"] == ("float16", "bfloat16", "float32")
    assert caps["masks"] == ("bool", "additive") and caps["gqa"] and caps["backward"] is True
    assert caps["probed_not_run"] == {} and caps["probe_rejected_cases"] == {}
    assert k.supports(Case(B=1, Hq=2, Hkv=1, Nq=32, Nk=48, D=64, dtype="bfloat16"))[0]
    ok, reason = k.supports(Case(B=1, Hq=1, Hkv=1, Nq=24, Nk=24, D=64))
    assert not ok and "multiples of 16" in reason
    ok, reason = k.supports(Case(B=1, Hq=1, Hkv=1, Nq=16, Nk=16, D=48))
    assert not ok and "head dim 48 not in declared head_dims [16, 32, 64]" in reason
    assert {f.probe for f in check_domain_guard(_multiple_of_16, "cpu")} == {"head_dim=512"}


def _bf16_needs_long_rows(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                          scale=None, enable_gqa=False):
    if query.dtype == torch.bfloat16 and query.shape[2] < 64:
        raise NotImplementedError("bfloat16 needs N >= 64")
    return blocked_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                             enable_gqa)


def test_one_rejected_probe_shape_keeps_the_dtype_and_the_case_is_not_run():
    from flashcheck.verify.check import check_case

    k = as_kernel(_bf16_needs_long_rows, "cpu")
    caps = k.capabilities
    assert "bfloat16" in caps["dtypes"] and "dtype=bfloat16" not in caps["probed_not_run"]
    assert "bfloat16 needs N >= 64" in caps["probe_rejected_cases"]["dtype=bfloat16"]
    small = Case(B=1, Hq=1, Hkv=1, Nq=8, Nk=8, D=16, dtype="bfloat16", backward=False)
    assert k.supports(small)[0]
    v = check_case(k, small, "cpu")
    assert v.status == "not_run" and "bfloat16 needs N >= 64" in v.reason
    v = check_case(k, dataclasses.replace(small, Nq=64, Nk=64), "cpu")
    assert v.status == "pass", v.reason


def _declared_rules(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                    scale=None, enable_gqa=False):
    return blocked_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                             enable_gqa)


@pytest.mark.parametrize("caps, case, want", [
    ({"same_seqlen": True}, dict(Nq=8, Nk=12), "Nq=8 != Nk=12 (declared same_seqlen)"),
    ({"max_seqlen": 10}, dict(Nq=8, Nk=12), "sequence length 12 > declared max_seqlen 10"),
    ({"layouts": ("contiguous",)}, dict(layout="strided"), "layout strided not in declared"),
    ({"seq_multiple": {"causal": 8, "noncausal": 1}}, dict(Nq=12, is_causal=True),
     "causal cases need multiples of 8"),
    ({"supports": lambda c: "no GQA with 3 heads" if c.Hq == 3 else None}, dict(Hq=3),
     "no GQA with 3 heads"),
])
def test_declared_rules_decide_without_running(caps, case, want):
    fn = functools.partial(_declared_rules)
    fn.capabilities = caps
    k = as_kernel(fn, "cpu")
    base = dict(B=1, Hq=1, Hkv=1, Nq=8, Nk=8, D=16)
    ok, reason = k.supports(Case(**{**base, **case}))
    assert not ok and want in reason
    assert k.supports(Case(**base))[0]


@pytest.mark.parametrize("declared, dtype, causal, ok", [
    ("causal_only", "float16", True, True),
    ("causal_only", "float16", False, False),
    ({"float16": True, "float32": False}, "float32", True, False),
    ({"float16": True, "float32": False}, "float16", False, True),
    ({"float32": False}, "bfloat16", False, True),  # left out: probed (the kernel has one)
])
def test_backward_declared_per_dtype_or_causal_only(declared, dtype, causal, ok):
    fn = functools.partial(_declared_rules)
    fn.capabilities = {"backward": declared}
    k = as_kernel(fn, "cpu")
    case = Case(B=1, Hq=1, Hkv=1, Nq=8, Nk=8, D=16, dtype=dtype, is_causal=causal)
    has, why = k.supports_backward(case)
    assert has is ok and (ok or "declares backward" in why)


@pytest.mark.parametrize("caps, key", [
    ({"seq_multiple": -16}, "seq_multiple"),
    ({"head_dims": "64"}, "head_dims"),
    ({"supports": lambda c: False}, "supports"),
    ({"headdims": (1, 64)}, "headdims"),
])
def test_bad_declared_capabilities_name_the_key(caps, key):
    """A bad entry is a SpecError when the kernel is resolved; a ``supports`` returning
    something else than None or a reason, a ValueError when it is called."""
    fn = functools.partial(_declared_rules)
    fn.capabilities = caps
    with pytest.raises(ValueError, match=key):
        k = as_kernel(fn, "cpu")
        k.supports(Case(B=1, Hq=1, Hkv=1, Nq=8, Nk=8, D=16))


def test_compiled_kernels_are_compiled_on_every_call_never_run_eagerly():
    """Dynamo runs a function eagerly, silently, once it has compiled it recompile_limit
    times (one graph per shape under dynamic=False): FlexAttention's adapters would then
    check its eager path. Their compiled_static, called as every kernel under test is
    (run_compiled), compiles every one of 12 shapes."""
    import torch._dynamo
    from flashcheck.verify.adapters import compiled_static, run_compiled

    def f(x, s):
        return (x * s).sum(-1)

    def counting(counter):
        def backend(gm, example_inputs):
            counter.append(len(example_inputs))
            return gm.forward
        return backend

    class Warnings(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("torch._dynamo hit config.recompile_limit"):
                hits.append(record)

    hits, log, seen = [], logging.getLogger("torch._dynamo.convert_frame"), Warnings()
    log.addHandler(seen)
    try:
        with torch._dynamo.config.patch(recompile_limit=8):
            torch._dynamo.reset()
            plain, graphs = [], []
            run = torch.compile(f, dynamic=False, backend=counting(plain))
            for k in range(1, 13):
                run(torch.ones(k, 3), 2.0)
            assert len(plain) == 8  # the hazard: shapes 9-12 ran eagerly
            assert hits  # and Dynamo warned
            hits.clear()
            torch._dynamo.reset()
            call = compiled_static(f, backend=counting(graphs))
            for k in range(1, 13):
                got = run_compiled(call, torch.ones(k, 3), 2.0)
                assert torch.equal(got, torch.full((k,), 6.0))
            assert len(graphs) == 12
            # the limit was reached (and handled) at the ninth shape, without Dynamo's warning
            assert not hits and not log.filters
    finally:
        log.removeHandler(seen)
    torch._dynamo.reset()


def test_a_users_compiled_kernel_is_checked_compiled_on_every_case():
    """A kernel the user compiled (plain torch.compile, dynamic=False) checked on 10 shapes
    in one process, the recompile limit at 4: every call runs a compiled graph (the
    function's body runs only while Dynamo traces it), none its eager self."""
    import torch._dynamo
    import torch.nn.functional as F
    from flashcheck.verify.cases import Case
    from flashcheck.verify.check import check_case

    traced, graphs = [0], []

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                  scale=None, enable_gqa=False):
        traced[0] += 1  # Python runs this body only while tracing, or when run eagerly
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                              is_causal=is_causal, scale=scale)

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    kernel = torch.compile(attention, dynamic=False, backend=backend)
    kernel.capabilities = {"dtypes": ("float32",), "gqa": False, "masks": ("bool",),
                           "backward": False}
    with torch._dynamo.config.patch(recompile_limit=4):
        torch._dynamo.reset()
        for n in range(3, 13):
            case = Case(B=1, Hq=1, Hkv=1, Nq=n, Nk=n, D=8, dtype="float32", seed=n,
                        backward=False)
            assert check_case(kernel, case, "cpu").status == "pass"
    torch._dynamo.reset()
    assert len(graphs) >= 10 and traced[0] == len(graphs), (traced, len(graphs))


def test_flex_on_cuda_declares_the_head_dims_its_compiler_takes():
    """FlexAttention's lowering refuses head dims below 16: declared, so that campaigns draw
    inside its domain (the CPU's eager path takes every head dim)."""
    from flashcheck.verify.adapters import FLEX_CUDA_HEAD_DIMS, _flex_kernel
    from flashcheck.verify.capabilities import check_capabilities
    from flashcheck.verify.ragged import peer

    assert FLEX_CUDA_HEAD_DIMS == (16, 256)
    for caps in (_flex_kernel("cuda").capabilities, peer("flex-varlen", "cuda").capabilities):
        assert check_capabilities(caps)["head_dims"] == FLEX_CUDA_HEAD_DIMS
    assert "head_dims" not in _flex_kernel("cpu").capabilities
    assert "head_dims" not in peer("flex-varlen", "cpu").capabilities

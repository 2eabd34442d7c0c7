"""The varlen and paged-decode APIs in the harness (verify/ragged.py).

What is pinned here: a ragged case validates its fields and names the bad one; its dense
equivalent's mask is, sequence by sequence, the rule of the API; the paged cache holds each
key where the block table says and garbage everywhere else; a case file round-trips; the
PyTorch peers pass and the catalogue's ragged bases are as good as a correct kernel; the
command line runs, refuses a contradictory ``--api``, and a ragged campaign's failure replays
from its case file. Our Triton kernels under the whole harness (a 60-example campaign each,
~115 s and ~50 s here) run in CI's ``tox -e controls`` beside the controls campaign, so this
suite stays inside its 10 minutes; tests/test_kernel_ragged.py checks them directly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from flashcheck.reference.masks import structural_mask
from flashcheck.verify import cli
from flashcheck.verify.cases import Case, load_case_file
from flashcheck.verify.check import check_case
from flashcheck.verify.ragged import GARBAGE_SCALE, api_args, paged_cache
from flashcheck.verify.strategies import cases, fixed_sweep
from hypothesis import given, settings


def _varlen(lq, lk, **kw) -> Case:
    return Case(B=kw.pop("B", 1), Hq=kw.pop("Hq", 2), Hkv=kw.pop("Hkv", 1), Nq=sum(lq), Nk=sum(lk),
                D=kw.pop("D", 16), layout="bnhd", api="varlen",
                ragged={"seqlens_q": lq, "seqlens_k": lk}, **kw)


def _decode(lens, *, nq=2, page=16, spare=2, **kw) -> Case:
    return Case(B=len(lens), Hq=kw.pop("Hq", 4), Hkv=kw.pop("Hkv", 2), Nq=nq, Nk=max(lens),
                D=kw.pop("D", 16), layout="bnhd", api="decode", backward=False,
                ragged={"cache_seqlens": lens, "page_size": page, "spare_blocks": spare}, **kw)


@pytest.mark.parametrize(("make", "match"), [
    (lambda: _varlen([3, 1], [2, 2], B=2), "B must be 1"),
    (lambda: Case(B=1, Hq=1, Hkv=1, Nq=5, Nk=4, D=8, layout="bnhd", api="varlen",
                  ragged={"seqlens_q": [3, 1], "seqlens_k": [2, 2]}), "Nq and Nk must be"),
    (lambda: Case(B=1, Hq=1, Hkv=1, Nq=4, Nk=4, D=8, api="varlen",
                  ragged={"seqlens_q": [3, 1], "seqlens_k": [2, 2]}), "layout must be 'bnhd'"),
    (lambda: _varlen([3, 1], [2]), r"ragged.seqlens_k must be a list of 2 ints"),
    (lambda: _varlen([3, -1], [2, 2]), r"ragged.seqlens_q must be a list"),
    (lambda: _decode([5, 1]), r"ragged.cache_seqlens must be a list of 2 ints in \[2,"),
    (lambda: _decode([5, 9], nq=17), r"Nq \(new tokens\) must be in \[1, 16\]"),
    (lambda: _decode([5, 9], page=0), r"ragged.page_size must be an int in \[1, 4096\]"),
    (lambda: _decode([5, 9], spare=-1), r"ragged.spare_blocks must be an int in \[0, 64\]"),
    (lambda: _decode([5, 9], is_causal=True), "is_causal and window must be unset"),
    (lambda: Case(B=1, Hq=1, Hkv=1, Nq=2, Nk=2, D=8, api="paged"), "api must be one of"),
    (lambda: Case(B=1, Hq=1, Hkv=1, Nq=2, Nk=2, D=8, ragged={"seqlens_q": [2]}),
     "ragged must be null for api 'dense'"),
])
def test_bad_ragged_case_names_the_field(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_varlen_mask_is_each_sequences_rule_on_its_block():
    lq, lk = [3, 0, 5, 2], [4, 2, 3, 0]
    c = _varlen(lq, lk, is_causal=True, causal_alignment="bottom_right", window=(2, -1))
    mask = c.materialize().attn_mask[0, 0]
    q0 = k0 = 0
    for a, b in zip(lq, lk, strict=True):
        want = torch.zeros(c.Nq, c.Nk, dtype=torch.bool)
        if a and b:
            want[q0:q0 + a, k0:k0 + b] = structural_mask(
                a, b, is_causal=True, causal_alignment="bottom_right", window=(2, -1),
                device="cpu")
        assert torch.equal(mask[q0:q0 + a], want[q0:q0 + a])
        q0, k0 = q0 + a, k0 + b
    # the fourth sequence has no key: its rows are fully masked (output 0 by contract)
    assert not mask[-2:].any()


def test_decode_mask_and_paged_cache():
    c = _decode([37, 16, 5], nq=3, page=16, spare=2)
    inp = c.materialize()
    pos = torch.tensor([37, 16, 5])[:, None] - 3 + torch.arange(3)
    want = torch.arange(37)[None, None, :] <= pos[:, :, None]
    assert torch.equal(inp.attn_mask[:, 0], want)
    a = inp.api_args
    table, lens = a["block_table"], a["cache_seqlens"].tolist()
    assert lens == [37, 16, 5] and table.dtype == torch.int32
    kc = paged_cache(inp.key, a, 0)
    assert kc.shape == (3 + 1 + 1 + 2, 16, 2, 16)
    used = torch.zeros(kc.shape[:2], dtype=torch.bool)
    for b, n in enumerate(lens):
        for j in range(n):
            blk, slot = table[b, j // 16].item(), j % 16
            assert torch.equal(kc[blk, slot], inp.key[b, :, j])
            used[blk, slot] = True
    # every other slot is garbage, far larger than any key the case drew
    assert kc[~used].abs().amax() > 4 * inp.key.abs().amax()
    assert kc[~used].abs().amax() < GARBAGE_SCALE * 8  # finite: a P = 0 product stays 0
    # the table is a seeded permutation: a new seed moves the pages, the same seed does not
    again = api_args(c, "cpu")["block_table"]
    moved = api_args(Case.from_dict({**c.to_dict(), "seed": 1}), "cpu")["block_table"]
    assert torch.equal(again, table) and not torch.equal(moved, table)


@pytest.mark.parametrize("case", [
    _varlen([3, 0, 5], [4, 2, 3], is_causal=True),
    _decode([20, 3], nq=2, page=4),
], ids=["varlen", "decode"])
def test_case_file_round_trip_and_dense_json_unchanged(case, tmp_path):
    assert Case.from_json(case.to_json()) == case
    assert json.loads(case.to_json())["api"] == case.api
    dense = Case(B=1, Hq=1, Hkv=1, Nq=2, Nk=2, D=8)
    assert "api" not in dense.to_dict() and "ragged" not in dense.to_dict()


@pytest.mark.parametrize(("spec", "case"), [
    ("sdpa-varlen", _varlen([5, 0, 9, 1], [6, 3, 9, 0], is_causal=True,
                            causal_alignment="bottom_right")),
    ("sdpa-varlen", _varlen([7, 4], [7, 12], window=(3, 1), dtype="float32")),
    ("sdpa-decode", _decode([33, 17, 4], nq=4, page=16)),
    ("verify/mutants/_ragged.py:VarlenAttention", _varlen([6, 2], [2, 6], is_causal=True,
                                                           Hq=4, Hkv=2)),
], ids=["sdpa_varlen_br", "sdpa_varlen_window", "sdpa_decode", "varlen_base"])
def test_correct_ragged_kernels_pass(spec, case):
    if spec.endswith("VarlenAttention"):
        from flashcheck.verify.mutants._ragged import VarlenAttention

        spec = VarlenAttention()
    v = check_case(spec, case, "cpu")
    assert v.status == "pass", v.summary()


def test_decode_base_passes_and_kernel_of_another_api_is_not_run():
    from flashcheck.verify.mutants._ragged import DecodeAttention

    case = _decode([40, 9], nq=1, page=16)
    assert check_case(DecodeAttention(), case, "cpu").status == "pass"
    v = check_case("sdpa-math", case, "cpu")
    assert v.status == "not_run" and "the kernel's API is dense" in v.reason


@settings(max_examples=40, deadline=None, database=None)
@given(cases(capabilities={"api": "varlen", "gqa": True, "backward": True,
                           "extensions": ("window", "causal_alignment")}, max_n=40))
def test_varlen_strategy_draws_valid_cases(c):
    assert c.api == "varlen" and c.B == 1 and c.layout == "bnhd"
    assert len(c.ragged["seqlens_q"]) == len(c.ragged["seqlens_k"]) <= 6
    assert max(c.ragged["seqlens_q"] + c.ragged["seqlens_k"]) <= 40


@settings(max_examples=40, deadline=None, database=None)
@given(cases(capabilities={"api": "decode", "page_sizes": (16, 64), "max_new_tokens": 4},
             max_n=70))
def test_decode_strategy_stays_in_the_declared_domain(c):
    assert c.api == "decode" and not c.backward
    assert c.ragged["page_size"] in (16, 64) and 1 <= c.Nq <= 4
    assert min(c.ragged["cache_seqlens"]) >= c.Nq


@pytest.mark.parametrize("api", ["varlen", "decode"])
def test_fixed_sweeps_cover_the_themes(api):
    for profile in ("cpu", "gpu"):
        sweep = fixed_sweep(profile, api)
        assert {c.dtype for c in sweep} == {"float16", "bfloat16", "float32"}
        assert all(c.api == api for c in sweep)
    if api == "varlen":
        lens = [c.ragged["seqlens_q"] for c in fixed_sweep("cpu", api)]
        assert any(0 in x for x in lens) and any(1 in x for x in lens)
        assert any(c.causal_alignment == "bottom_right" for c in fixed_sweep("cpu", api))
    else:
        pages = {c.ragged["page_size"] for c in fixed_sweep("cpu", api)}
        assert {16, 256} <= pages
        assert any(c.Nq > 1 for c in fixed_sweep("cpu", api))


def test_cli_api_contradiction_is_a_usage_error(capsys):
    rc = cli.main(["fuzz", "--kernel", "sdpa-varlen", "--api", "decode", "--device", "cpu",
                   "--examples", "2", "--quiet"])
    assert rc == 2
    assert "declares the varlen API" in capsys.readouterr().err


def test_ragged_mutant_campaign_keeps_a_case_that_replays(tmp_path, capsys):
    out = tmp_path / "fz"
    spec = "verify/mutants/decode_tail_unmasked.py:attention"
    rc = cli.main(["fuzz", "--kernel", spec, "--device", "cpu", "--examples", "60",
                   "--seed", "0", "--out", str(out), "--quiet"])
    assert rc == 1
    files = sorted((out / "failures").glob("numerical-*.json"))
    assert len(files) == 1
    case, meta = load_case_file(files[0])
    assert case.api == "decode" and case.ragged["cache_seqlens"][0] % case.ragged[
        "page_size"] != 0
    capsys.readouterr()
    assert cli.main(["repro", str(files[0]), "--kernel", spec, "--device", "cpu"]) == 1
    assert cli.main(["repro", str(files[0]), "--kernel", spec, "--device", "cpu", "--api",
                     "varlen"]) == 2


def test_cpu_flash_sdpa_per_sequence_passes_at_large_logits():
    """A false alarm found by the varlen sweep: PyTorch's CPU flash SDPA backend (fp32,
    logits ~1e4) recomputes the scores in its backward with another GEMM blocking than its
    forward, dv 1.06x the rule before the ``bwd_scores_k16`` member named that choice."""
    case, _ = load_case_file(Path(__file__).parent / "data" / "sdpa_varlen_cpu_bwd_scores.json")
    v = check_case("sdpa-varlen", case, "cpu")
    assert v.status == "pass", v.summary()

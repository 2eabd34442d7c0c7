"""scripts/gpu/capture_outputs.py: a kernel's outputs on a case file, saved for comparison
with the family's members elsewhere (how sdpa-efficient's H100 false alarm was traced)."""

from __future__ import annotations

import json

import torch
from flashcheck.verify.cases import Case, save_case_file

from tests.script_modules import load


def test_capture_saves_what_the_kernel_returns_on_the_cases_own_draw(tmp_path):
    cap = load("scripts/gpu/capture_outputs.py", "capture_outputs_test")
    case = Case(B=1, Hq=2, Hkv=1, Nq=5, Nk=7, D=8, dtype="float16", is_causal=True, seed=3)
    path = tmp_path / "case.json"
    save_case_file(path, case, kernel="sdpa-math", device="cpu")
    out = tmp_path / "got.pt"
    assert cap.main([str(path), "--kernel", "sdpa-math", "--device", "cpu",
                     "--out", str(out)]) == 0
    got = torch.load(out)
    assert got["kernel"] == "sdpa-math" and json.loads(got["case"]) == case.to_dict()
    assert "torch" in json.loads(got["versions"])
    inp = case.materialize("cpu")
    q, k, v = (t.detach().clone().requires_grad_() for t in (inp.query, inp.key, inp.value))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):  # the sdpa-math built-in's backend
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                enable_gqa=True)
    grads = torch.autograd.grad(want, (q, k, v), inp.grad_out)
    for n, w in zip(("out", "dq", "dk", "dv"), (want, *grads), strict=True):
        assert got[n].dtype == torch.float16 and got[n].shape == w.shape, n
        assert torch.equal(got[n], w.detach()), n  # the same draw and the same call

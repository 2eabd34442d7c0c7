"""``run_cases(jobs=N)``: worker processes give the same records as one process, keep the
budget, and turn a crashing worker into a failure of its case instead of a hang or lost
results."""

from __future__ import annotations

import json
import textwrap

import pytest
from flashcheck.verify.adapters import resolve_kernel
from flashcheck.verify.strategies import fixed_sweep
from flashcheck.verify.sweep import run_cases

SPEC = "sdpa-math"


def _key(rec):
    tensors = {k: (t["max_abs"], t["ratio"]) for k, t in rec["tensors"].items()}
    return rec["summary"].split(" [")[0], rec["status"], rec["failure"], tensors


@pytest.fixture(scope="module")
def cases():
    return fixed_sweep("cpu")[:8]


def test_parallel_records_equal_serial(cases, tmp_path):
    kernel = resolve_kernel(SPEC, "cpu")
    serial = run_cases(kernel, cases, "cpu", kernel_spec=SPEC, failures_dir=None, quiet=True)
    parallel = run_cases(None, cases, "cpu", kernel_spec=SPEC, failures_dir=None, quiet=True,
                         jobs=2)
    assert [r["case"] for r in parallel] == [c.to_dict() for c in cases]  # order kept
    assert [r["status"] for r in parallel] == ["pass"] * len(cases)
    assert [_key(r) for r in parallel] == [_key(r) for r in serial]


def test_parallel_budget_reports_the_rest_not_run(cases):
    recs = run_cases(None, cases, "cpu", kernel_spec=SPEC, failures_dir=None, quiet=True,
                     jobs=2, budget_s=1e-9)
    assert {r["status"] for r in recs} == {"not_run"}
    assert all("--budget-s" in r["reason"] for r in recs)


def test_crashing_worker_fails_exactly_its_cases_not_a_hang(cases, tmp_path):
    """A kernel that takes its worker down fails the case that was running (``crashed``, with
    the exit status), and only that one: the worker is replaced and the rest still pass. The
    crashes share one root cause, so one failure file stands for all of them."""
    crash = tmp_path / "crash.py"
    nq = cases[2].Nq
    crash.write_text(textwrap.dedent(f"""
        import os
        import torch.nn.functional as F

        def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False):
            if q.shape[-2] == {nq} and q.shape[0] == 2:
                os._exit(3)  # a kernel that takes the process down
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                                  is_causal=is_causal, scale=scale,
                                                  enable_gqa=enable_gqa)
    """))
    spec = f"{crash}:attention"
    recs = run_cases(None, cases, "cpu", kernel_spec=spec, failures_dir=tmp_path / "f",
                     quiet=True, jobs=2)
    assert len(recs) == len(cases)
    crashing = [c.Nq == nq and c.B == 2 for c in cases]
    assert any(crashing)
    assert [r["failure"] for r in recs] == ["crashed" if x else None for x in crashing]
    crashed = [r for r in recs if r["failure"] == "crashed"]
    assert all("exited with status 3" in r["reason"] for r in crashed)
    assert len({r["case_file"] for r in crashed}) == 1
    assert len(list((tmp_path / "f").glob("*.json"))) == 1
    hits = crashed[0]["observations"]["root_cause"]["hits"]
    assert hits == len(crashed)
    json.dumps(recs)  # the records still make a report


def test_jobs_must_be_positive(cases):
    with pytest.raises(ValueError, match="jobs must be an integer >= 1"):
        run_cases(None, cases, "cpu", kernel_spec=SPEC, failures_dir=None, jobs=0)


def test_prefetched_draws_equal_fresh_draws_and_errors_fall_back(cases):
    """The serial sweep draws case i+1 in a thread while case i runs: the drawn tensors are
    the ones a fresh ``draw`` gives, bit for bit; a draw that raises is handed back as None,
    so the caller's own draw raises the same error where it always did."""
    import dataclasses

    import torch
    from flashcheck.verify.sweep import Prefetch

    # large logits at a tiny scale: q and k are scaled past fp16's range, so draw() raises
    bad = dataclasses.replace(cases[0], dtype="float16", D=1, scale=1e-6,
                              dist={"kind": "large_logits", "target": 1e6})
    todo = [*cases[:3], bad, cases[3]]
    drawing = Prefetch(todo)
    try:
        got = [drawing.take(i) for i in range(len(todo))]
    finally:
        drawing.close()
    assert got[3] is None
    with pytest.raises(ValueError, match="overflows float16"):
        bad.draw()
    for case, drawn in zip([*cases[:3], cases[3]], [*got[:3], got[4]], strict=True):
        fresh = case.draw()
        for name, t in fresh.items():
            if t is None:
                assert drawn[name] is None
            else:
                assert torch.equal(t.view(torch.uint8), drawn[name].view(torch.uint8)), name

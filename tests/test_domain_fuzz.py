"""Campaigns against kernels with a narrow declared domain (tests/domain_kernels.py): every
drawn case lies inside it (the kernels raise a failure otherwise), the campaign runs its whole
example budget there, and undeclared rejections are reported as "not run: reason"."""

from __future__ import annotations

from pathlib import Path

import pytest
from flashcheck.verify import cli
from flashcheck.verify.fuzz import Campaign

KFILE = str(Path(__file__).with_name("domain_kernels.py"))


class _Watched(Campaign):
    """A campaign that keeps every (case, verdict) its property saw."""

    def _observe(self, case, verdict) -> None:
        self.seen.append((case, verdict))


def _campaign(tmp_path, attr: str, examples: int) -> tuple[int, list]:
    c = _Watched(kernel=None, kernel_spec=f"{KFILE}:{attr}", device="cpu",
                 out=tmp_path / "fz", examples=examples, seed=0, quiet=True)
    c.seen = []
    return c.run(), c.seen


def test_seq_multiple_and_head_dim_set_get_a_full_campaign(tmp_path, capsys):
    """The acceptance run: `python -m flashcheck fuzz --kernel tests/domain_kernels.py:attention
    --device cpu --examples 60 --seed 0` exits 0 with 60 examples, none outside the domain
    (the kernel raises on one, which would be a failure)."""
    rc = cli.main(["fuzz", "--kernel", f"{KFILE}:attention", "--device", "cpu",
                   "--examples", "60", "--seed", "0", "--out", str(tmp_path / "cli"),
                   "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "fuzz: 60 examples" in out and "0 distinct failure(s)" in out
    assert "not run" not in out


def test_seq_multiple_and_head_dim_set_draws_cover_the_domain(tmp_path):
    rc, seen = _campaign(tmp_path, "attention", 60)
    assert rc == 0 and len(seen) == 60
    assert all(v.status == "pass" for _, v in seen)
    cases = [c for c, _ in seen]
    assert all(c.Nq % 16 == 0 and c.Nk % 16 == 0 and c.D in (16, 32, 64) for c in cases)
    assert {c.D for c in cases} == {16, 32, 64}
    assert {c.Nq for c in cases} > {16} and any(c.Nq != c.Nk for c in cases)


@pytest.mark.parametrize("attr, inside", [
    ("same_seqlen", lambda c: c.Nq == c.Nk),
    ("causal_multiple", lambda c: max(c.Nq, c.Nk) <= 96 and c.Nq % (32 if c.is_causal else 8)
     == 0 and c.Nk % (32 if c.is_causal else 8) == 0),
    ("causal_only_backward", lambda c: c.backward == c.is_causal),
])
def test_campaign_draws_inside_the_declared_rules(tmp_path, attr, inside):
    rc, seen = _campaign(tmp_path, attr, 30)
    assert rc == 0 and len(seen) == 30
    assert all(v.status == "pass" for _, v in seen), [v.reason for _, v in seen]
    assert all(inside(c) for c, _ in seen)
    assert {c.is_causal for c, _ in seen} == {True, False}
    if attr == "causal_only_backward":  # gradients are checked where declared
        assert any("dq" in v.tensors for c, v in seen if c.is_causal)


def test_supports_callable_cases_are_not_run_and_reported(tmp_path, capsys):
    rc, seen = _campaign(tmp_path, "even_head_dims", 30)
    out = capsys.readouterr().out
    assert rc == 0
    odd = [v for c, v in seen if c.D % 2]
    assert odd and all(v.status == "not_run" and "odd head dim" in v.reason for v in odd)
    assert any(v.status == "pass" for _, v in seen)
    assert "not run: odd head dim" in out


def test_undeclared_rejection_is_one_case_not_a_whole_dtype(tmp_path, capsys):
    rc, seen = _campaign(tmp_path, "undeclared_even_n", 30)
    out = capsys.readouterr().out
    assert rc == 0
    assert "dtypes float16, bfloat16, float32" in out  # probed on even N: every dtype kept
    odd = [v for c, v in seen if c.Nq % 2]
    assert odd and all(v.status == "not_run" and "Nq must be even" in v.reason for v in odd)
    assert {c.dtype for c, v in seen if v.status == "pass"} == {"float16", "bfloat16",
                                                               "float32"}
    assert "not run: ValueError: query: Nq must be even" in out


def test_bad_capabilities_are_a_usage_error(tmp_path, capsys):
    f = tmp_path / "k.py"
    f.write_text("from tests.domain_kernels import attention as _a\n"
                 "def attention(*args, **kw):\n    return _a(*args, **kw)\n"
                 "attention.capabilities = {'seq_multiple': {'causal': 128}}\n")
    rc = cli.main(["fuzz", "--kernel", f"{f}:attention", "--device", "cpu", "--examples", "3",
                   "--out", str(tmp_path / "fz"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "capabilities['seq_multiple'] must be" in err and "'noncausal'" in err

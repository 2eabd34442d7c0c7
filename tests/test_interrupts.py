"""A SIGTERM or Ctrl-C whose KeyboardInterrupt Python drops still stops the campaign
(verify/interrupts.py).

Python runs a signal handler wherever the interpreter is, a garbage-collector callback
included, and drops an exception raised there ("Exception ignored in ..."). A SIGTERM that
landed in Hypothesis's gc callback once left `flashcheck fuzz` running on after `timeout`
had asked it to stop. Here the handler runs inside a gc callback on purpose.
"""

from __future__ import annotations

import gc
import json
import signal

import pytest
from flashcheck.verify import interrupts

# The dropped KeyboardInterrupts are the point: Python reports each as unraisable.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _dropped(signum: int = signal.SIGTERM) -> None:
    """The handler run inside a gc callback, where its KeyboardInterrupt is dropped."""
    def cb(phase, info):
        if phase == "start":
            gc.callbacks.remove(cb)
            signal.getsignal(signum)(signum, None)
    gc.callbacks.append(cb)
    gc.collect()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_dropped_interrupt_is_raised_again_at_the_next_check(signum):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with interrupts.interruptible():
        interrupts.check()  # nothing pending: no raise
        _dropped(signum)  # the KeyboardInterrupt went nowhere ...
        with pytest.raises(KeyboardInterrupt):
            interrupts.check()  # ... and comes back here
        interrupts.check()  # raised once
        _dropped(signum)
        interrupts.clear()  # handled elsewhere: not raised again
        interrupts.check()
    assert {s: signal.getsignal(s) for s in before} == before


def test_the_handler_raises_where_it_can():
    with interrupts.interruptible(), pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGTERM)


def test_a_fuzz_campaign_stops_at_the_next_example_and_is_not_a_pass(tmp_path):
    """The dropped SIGTERM after the third example: the campaign checks no further example,
    keeps what it has and exits 1 (interrupted), as for a SIGTERM that got through."""
    from flashcheck.verify.fuzz import Campaign

    class Dropped(Campaign):
        def _observe(self, case, verdict):
            if self.calls == 3:
                _dropped()

    out = tmp_path / "fz"
    campaign = Dropped(None, kernel_spec="sdpa-math", device="cpu", out=out, minutes=None,
                       examples=100_000, seed=7, quiet=True, max_n=16, dtypes=["float32"])
    assert campaign.run() == 1
    assert campaign.calls == 3
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["exit"] == 1


def test_run_cases_stops_at_the_next_poll(tmp_path, monkeypatch):
    """`run`, `gate` and `repro` (verify/sweep.py run_cases): the dropped SIGTERM after the
    second result stops the cases left, recorded as interrupted, not passed."""
    from flashcheck.verify import sweep
    from flashcheck.verify.cases import Case

    class Watched(sweep.Progress):
        def advance(self, *a, **k):
            self.results = getattr(self, "results", 0) + 1
            if self.results == 2:
                _dropped()
            return super().advance(*a, **k)

    monkeypatch.setattr(sweep, "Progress", Watched)
    cases = [Case(B=1, Hq=1, Hkv=1, Nq=4 + i, Nk=4, D=8, dtype="float32") for i in range(40)]
    records = sweep.run_cases(None, cases, "cpu", kernel_spec="sdpa-math",
                              failures_dir=tmp_path / "f", jobs=1, quiet=True)
    assert len(records) == len(cases)
    assert 0 < sweep.interrupted(records) <= len(cases) - 2

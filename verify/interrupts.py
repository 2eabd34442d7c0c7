"""SIGTERM and Ctrl-C in a campaign's process: a KeyboardInterrupt that is never lost.

``flashcheck fuzz``, ``run``, ``gate`` and ``repro`` turn SIGTERM (a CI time limit,
``timeout``) into the same KeyboardInterrupt as Ctrl-C, and stop keeping what was found, with
exit 1 (an interrupted campaign is not a pass). Python runs a signal handler between the
bytecodes of whatever code is running at the time, a garbage-collector callback or a
``__del__`` included, and an exception raised there is printed as "Exception ignored in ..."
and dropped: a SIGTERM that landed in Hypothesis's gc callback left a fuzz campaign running
on with 100,000 examples to go. So the handler also records the signal, and the campaigns
call :func:`check` at their safe points (before each example, at each poll of the workers),
which raises it again; :func:`clear` when the interrupt has been handled.
"""

from __future__ import annotations

import contextlib
import signal

_PENDING: list[int] = []  # signals whose KeyboardInterrupt may not have reached the campaign


def _handler(signum, frame) -> None:
    _PENDING.append(signum)
    raise KeyboardInterrupt


def check() -> None:
    """Raise KeyboardInterrupt if a signal came since the last :func:`clear` (its own raise
    may have been dropped)."""
    if _PENDING:
        _PENDING.clear()
        raise KeyboardInterrupt


def clear() -> None:
    """The interrupt has been handled: nothing left to raise again."""
    _PENDING.clear()


@contextlib.contextmanager
def interruptible():
    """Within the block SIGTERM and SIGINT raise KeyboardInterrupt and are remembered for
    :func:`check`; the previous handlers are restored after. In the main thread only (where
    Python lets a handler be set); elsewhere the block runs with the handlers as they are."""
    _PENDING.clear()
    try:
        previous = {s: signal.signal(s, _handler) for s in (signal.SIGTERM, signal.SIGINT)}
    except ValueError:  # not the main thread
        previous = {}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _PENDING.clear()

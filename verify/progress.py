"""A tiny progress indicator for the CLI, written to stderr.

On a terminal it redraws one line (``\\r``) with a bar, the count and the elapsed time. When
stderr is not a terminal (CI logs, pipes) a bar would fill the log with carriage returns, so
it prints a plain progress line at most every ``every_s`` seconds instead. ``quiet=True``
silences both. No dependency (tqdm is deliberately not used).

Caveat: the total may be unknown (a time-boxed fuzz campaign); then the line shows the count
and the elapsed time only, or the fraction of the time budget when ``budget_s`` is given.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

_BAR_WIDTH = 28


class Progress:
    """Counts work items and shows how far along the job is.

    Use as a context manager; call ``advance(label)`` once per item.
    """

    def __init__(
        self,
        what: str,
        total: int | None = None,
        *,
        budget_s: float | None = None,
        quiet: bool = False,
        stream: TextIO | None = None,
        every_s: float = 10.0,
    ) -> None:
        if total is not None and total < 0:
            raise ValueError(f"total must be >= 0 or None, got {total}")
        if every_s <= 0:
            raise ValueError(f"every_s must be > 0, got {every_s}")
        self.what = what
        self.total = total
        self.budget_s = budget_s
        self.quiet = quiet
        self.stream = stream if stream is not None else sys.stderr
        self.every_s = every_s
        self.count = 0
        self.t0 = time.monotonic()
        self._last_line = self.t0
        self._drawn = False
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def _fraction(self) -> float | None:
        if self.total:
            return min(1.0, self.count / self.total)
        if self.budget_s:
            return min(1.0, self.elapsed() / self.budget_s)
        return None

    def _text(self, label: str) -> str:
        frac = self._fraction()
        count = f"{self.count}/{self.total}" if self.total is not None else f"{self.count}"
        head = f"{self.what} {count} {self.elapsed():6.1f}s"
        if frac is not None:
            head = f"{head} {frac * 100:3.0f}%"
        return f"{head} {label}" if label else head

    def advance(self, label: str = "", n: int = 1) -> None:
        self.count += n
        if self.quiet:
            return
        now = time.monotonic()
        if self.tty:
            frac = self._fraction()
            bar = ""
            if frac is not None:
                filled = int(round(frac * _BAR_WIDTH))
                bar = "[" + "#" * filled + "." * (_BAR_WIDTH - filled) + "] "
            line = (bar + self._text(label))[:118]
            self.stream.write("\r" + line.ljust(118))
            self.stream.flush()
            self._drawn = True
        elif now - self._last_line >= self.every_s or (
            self.total is not None and self.count == self.total
        ):
            self._last_line = now
            self.stream.write(self._text(label) + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._drawn and not self.quiet:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False

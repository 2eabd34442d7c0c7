"""The ``flashcheck`` command line (placeholder until the harness lands)."""

from __future__ import annotations

import sys

from verify import __version__


def main(argv: list[str] | None = None) -> int:
    print(f"flashcheck {__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""flashcheck's harness: cases, strategies, metrics, bounds, adapters, check, report, CLI."""

__version__ = "0.1.0"

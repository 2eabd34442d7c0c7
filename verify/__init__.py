"""flashcheck's harness: cases, strategies, metrics, bounds, adapters, check, report, CLI."""

__version__ = "0.1.0"

# Where a GPU kernel's cases are judged (verify.check.oracle_device): the choices of
# --oracle-device, and the variable that carries the choice to every worker process. Here,
# not in verify.check, so the CLI and the pytest plugin can read them before anything imports
# torch or a kernel.
ORACLE_DEVICES = ("auto", "device")
ORACLE_ENV = "FLASHCHECK_ORACLE_DEVICE"

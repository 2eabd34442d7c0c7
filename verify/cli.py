"""The ``flashcheck`` command line (also ``python -m flashcheck``).

Subcommands: ``run`` (default sweep + report), ``fuzz`` (Hypothesis campaign), ``repro``
(replay one case; ``git bisect run`` friendly), ``gate`` (CI gate against committed error
budgets), ``compare`` (cross-kernel table from report.json files), ``bench`` and ``mutants``
(delegated to ``kernels.bench`` and ``verify.selftest``).

Exit codes: 0 all within bounds; 1 a numerical (or other verdict) failure was found; 2 usage or
environment error, reported as one line on stderr without a traceback. ``repro`` also exits
125 when the case cannot run with that kernel on that device (the kernel declares it outside
its domain there): ``git bisect run`` reads 125 as "skip this commit", where 2 would mark the
commit bad.

Why the CLI sets ``TRITON_INTERPRET=1`` itself for ``--device cpu``: Triton reads that
variable when ``@triton.jit`` decorates a function, that is, when a kernel module is imported,
and bakes the choice (compile for a GPU, or interpret on the CPU) into the function object. So
it must be in the environment before anything imports a kernel; setting it later has no effect
on kernels already imported. Every import of the harness that can reach a kernel is therefore
done inside the command functions, after the device is settled.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import NoReturn

from flashcheck.verify import ORACLE_DEVICES, ORACLE_ENV, __version__
from flashcheck.verify.supervise import SupervisorError

DEFAULT_OUT = "flashcheck-out"
DEFAULT_KERNEL = "triton"


class UsageError(Exception):
    """Bad command-line input or environment: one line on stderr, exit 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2), instead of usage text plus the message."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


# ------------------------------------------------------------------------------- arg types


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {v}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return v


def _seed(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**32), got {text!r}") \
            from None
    if not 0 <= v < 2**32:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**32), got {v}")
    return v


def _window(text: str) -> tuple[int, int]:
    try:
        left, right = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be LEFT,RIGHT with ints >= -1 (-1: unbounded), got {text!r}") from None
    if left < -1 or right < -1:
        raise argparse.ArgumentTypeError(f"must be LEFT,RIGHT with ints >= -1, got {text!r}")
    return left, right


# ------------------------------------------------------------------------------- device


def settle_device(requested: str | None) -> str:
    """The device to use; sets TRITON_INTERPRET=1 for the CPU (see the module docstring)."""
    import torch

    if requested is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        device = requested
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available here "
                         "(torch.cuda.is_available() is False); use --device cpu")
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    return device


# ------------------------------------------------------------------------------- commands


def command_supervisor(args: argparse.Namespace, device: str, out: Path):
    """The supervised workers of a ``run`` or ``gate`` command (``sweep.run_cases``'s, made
    first so that its first worker also answers ``settle_api``)."""
    from flashcheck.verify.sweep import supervisor_for

    return supervisor_for(args.kernel, device, jobs=args.jobs, case_timeout=args.case_timeout,
                          failures_dir=out / "failures",
                          strict_subnormals=args.strict_subnormals)


def settle_api(args: argparse.Namespace, sup) -> str:
    """The plug-in API of ``--kernel`` (its declared capabilities['api'], read in the
    supervised worker ``sup``); a ``--api`` that contradicts it is a usage error."""
    api = sup.api()
    if args.api is not None and args.api != api:
        raise UsageError(f"--api {args.api}: the kernel {args.kernel!r} declares the {api} API "
                         f"(capabilities['api']; a kernel of the {args.api} API declares "
                         f"capabilities = {{'api': '{args.api}', ...}})")
    return api


def cmd_run(args: argparse.Namespace) -> int:
    from flashcheck.verify import report as R

    device = settle_device(args.device)
    profile = args.profile or ("gpu" if device == "cuda" else "cpu")
    from flashcheck.verify.strategies import fixed_sweep
    from flashcheck.verify.sweep import interrupted, run_cases

    out = Path(args.out)
    # The kernel is resolved and run only inside supervised workers (verify/supervise.py).
    with command_supervisor(args, device, out) as sup:
        sweep = fixed_sweep(profile, settle_api(args, sup))
        records = run_cases(None, sweep, device, kernel_spec=args.kernel,
                            failures_dir=out / "failures", what=f"run[{profile}]",
                            quiet=args.quiet, budget_s=args.budget_s, jobs=args.jobs,
                            case_timeout=args.case_timeout,
                            strict_subnormals=args.strict_subnormals, supervisor=sup)
    header = R.make_header(kernel=args.kernel, device=device, command=args.argv,
                           profile=profile)
    rep = R.build_report(records, header=header)
    paths = R.write_report(rep, out)
    print(R.render_terminal_table(rep))
    print("report: " + ", ".join(str(p) for p in paths.values()))
    R.print_failures(rep, more_in=out / "failures")
    unchecked = interrupted(records)
    if unchecked:  # an interrupt is not a pass (--budget-s stopping it is)
        print(f"run: interrupted: {unchecked} of {len(records)} cases not run")
        return 1
    return 1 if rep["summary"]["fail"] else 0


def cmd_fuzz(args: argparse.Namespace) -> int:
    device = settle_device(args.device)
    from flashcheck.verify.fuzz import Campaign

    if args.workers > 1:  # N fuzz processes sharing one example database (verify/scale.py)
        from flashcheck.verify.scale import example_shares, run_workers

        if args.examples is not None:
            example_shares(args.examples, args.workers)  # a usage error before anything runs
        return run_workers(args, device)
    # This process draws and shrinks; the kernel runs only in supervised workers.
    campaign = Campaign(None, kernel_spec=args.kernel, device=device, out=Path(args.out),
                        examples=args.examples, minutes=args.minutes, seed=args.seed,
                        keep_going=args.keep_going, dtypes=args.dtypes, max_n=args.max_n,
                        quiet=args.quiet, case_timeout=args.case_timeout,
                        strict_subnormals=args.strict_subnormals, db=args.db, api=args.api,
                        reuse_compiled=args.reuse_compiled)
    return campaign.run()


def cmd_repro(args: argparse.Namespace) -> int:
    from flashcheck.verify.repro import load_target, replay

    if (args.case is None) == (args.tensors is None):
        raise UsageError("repro: give exactly one of CASE.json or --tensors FILE")
    target = load_target(case_path=args.case, tensors_path=args.tensors,
                         is_causal=args.is_causal, scale=args.scale, window=args.window,
                         causal_alignment=args.causal_alignment,
                         backward=not args.forward_only)
    device = settle_device(args.device or target.device_hint)
    spec = args.kernel or target.kernel_spec or DEFAULT_KERNEL
    if args.api is not None and args.api != target.case.api:
        raise UsageError(f"--api {args.api}: the case is of the {target.case.api} API")
    return replay(None, target, device=device, kernel_spec=spec,
                  case_timeout=args.case_timeout, repeat=args.repeat,
                  strict_subnormals=args.strict_subnormals, family=args.family)


def cmd_gate(args: argparse.Namespace) -> int:
    from flashcheck.verify import gate

    device = settle_device(args.device)
    profile = "gpu" if device == "cuda" else "cpu"
    model = gate.device_model(device)
    out = Path(args.out)
    with command_supervisor(args, device, out) as sup:
        api = settle_api(args, sup)
        budgets = Path(args.budgets) if args.budgets else gate.default_budgets_path(
            args.kernel, profile, model)
        if not args.update and not budgets.exists():
            raise UsageError(f"--budgets {budgets}: no such file: no budgets for this device "
                             f"({model}); create them with 'flashcheck gate --update --kernel "
                             f"{args.kernel} --device {device}' and commit the file")
        corpus = Path(args.corpus) if args.corpus else gate.default_corpus()
        return gate.run_gate(None, kernel_spec=args.kernel, device=device, profile=profile,
                             budgets_path=budgets, corpus=corpus, update=args.update,
                             out=out, quiet=args.quiet, command=args.argv, jobs=args.jobs,
                             case_timeout=args.case_timeout, model=model,
                             strict_subnormals=args.strict_subnormals, api=api,
                             supervisor=sup)


def cmd_compare(args: argparse.Namespace) -> int:
    from flashcheck.verify.report import compare_reports

    table = compare_reports(args.reports)
    if args.out:
        Path(args.out).write_text(table)
        print(f"wrote {args.out}")
    else:
        print(table, end="")
    return 0


def _delegate(name: str, argv: list[str]) -> int:
    """``bench`` and ``mutants``: settle the device from their own --device, then hand over."""
    device = None
    for i, a in enumerate(argv):
        if a == "--device" and i + 1 < len(argv):
            device = argv[i + 1]
        elif a.startswith("--device="):
            device = a.split("=", 1)[1]
    if device not in (None, "cpu", "cuda"):
        raise UsageError(f"--device must be cpu or cuda, got {device!r}")
    if "-h" not in argv and "--help" not in argv:
        settle_device(device)
    if name == "bench":
        from flashcheck.kernels.bench import main as bench_main

        return bench_main(argv)
    from flashcheck.verify.selftest import main as selftest_main

    return selftest_main(argv)


# ------------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="flashcheck",
                description="Correctness and numerical verification of flash-attention kernels.")
    p.add_argument("--version", action="version", version=f"flashcheck {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    def common(sp: argparse.ArgumentParser, *, kernel_default: str | None = DEFAULT_KERNEL,
               kernel_required: bool = False) -> None:
        sp.add_argument("--kernel", default=kernel_default, required=kernel_required,
                        metavar="SPEC",
                        help="built-in name, MODULE:ATTR or path/to/file.py:ATTR "
                             f"(default: {kernel_default})")
        sp.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda if available, else cpu (Triton interpreter)")
        sp.add_argument("--path", action="append", default=[], metavar="DIR",
                        help="directory to import MODULE:ATTR kernels from, besides the "
                             "working directory (repeatable)")
        sp.add_argument("--api", choices=("dense", "varlen", "decode"), default=None,
                        help="the kernel's plug-in API: dense (SDPA), varlen (packed "
                             "sequences) or decode (paged KV cache); default: the kernel's "
                             "capabilities['api'], else dense. Given, it must match")

    def quiet(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--quiet", "-q", action="store_true", help="no progress output")

    def case_timeout(sp: argparse.ArgumentParser) -> None:
        # Every command that judges cases takes --case-timeout, and --strict-subnormals too.
        sp.add_argument("--strict-subnormals", action="store_true",
                        help="a subnormal result flushed to 0 fails (subnormals_flushed), and "
                             "flush-to-zero is no longer a correct implementation choice "
                             "(default: accepted, reported as an observation)")
        sp.add_argument("--oracle-device", choices=ORACLE_DEVICES, default=None,
                        help="where the reference, family and bounds judge a case of a GPU "
                             "kernel: auto (default) the CPU for small cases "
                             "(B*Hq*Nq*Nk*D <= 2**21), which N workers then do not share the "
                             "GPU for, the GPU above; device: always the kernel's device")
        sp.add_argument("--case-timeout", type=_positive_float, default=None, metavar="S",
                        help="seconds one case may take before its worker is killed and the "
                             "case recorded as a 'timeout' failure (default: 60 s + 20x the "
                             "median case time, a worker's first case left out)")

    def jobs(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--jobs", "-j", type=_positive_int, default=1, metavar="N",
                        help="check cases in N worker processes (default 1); cold GPU "
                             "sweeps are compile-bound and scale with it")

    sp = sub.add_parser("run", help="the default sweep plus the per-configuration report")
    common(sp)
    sp.add_argument("--profile", choices=("cpu", "gpu"), default=None,
                    help="sweep profile (default: by device)")
    sp.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                    help=f"report directory (default: {DEFAULT_OUT})")
    sp.add_argument("--budget-s", type=_positive_float, default=None, metavar="S",
                    help="start no new case after S seconds; the rest are reported as not run")
    jobs(sp)
    case_timeout(sp)
    quiet(sp)
    sp.set_defaults(func=cmd_run)

    sp = sub.add_parser("fuzz", help="a Hypothesis campaign that climbs toward worst cases")
    common(sp, kernel_default=None, kernel_required=True)
    box = sp.add_mutually_exclusive_group()
    box.add_argument("--examples", type=_positive_int, default=None, metavar="N",
                     help="stop after N examples (default: 200 unless --minutes is given)")
    box.add_argument("--minutes", type=_positive_float, default=None, metavar="M",
                     help="stop after M minutes of wall time")
    sp.add_argument("--seed", type=_seed, default=None, metavar="S",
                    help="make the campaign reproducible")
    sp.add_argument("--out", default=f"{DEFAULT_OUT}/fuzz", metavar="DIR",
                    help=f"example database and failures (default: {DEFAULT_OUT}/fuzz)")
    sp.add_argument("--keep-going", action="store_true",
                    help="collect distinct failures until the budget ends")
    sp.add_argument("--workers", type=_positive_int, default=1, metavar="N",
                    help="N fuzz processes sharing the example database, failures merged "
                         "into DIR/failures (default: 1)")
    sp.add_argument("--db", default=None, metavar="DIR|redis://HOST:PORT/N",
                    help="the example database (default: DIR/hypothesis-db); a Redis URL "
                         "shares one campaign across hosts")
    sp.add_argument("--dtypes", nargs="+", choices=("float16", "bfloat16", "float32"),
                    default=None, help="dtypes to draw (default: all the kernel runs here)")
    sp.add_argument("--max-n", type=_positive_int, default=None, metavar="N",
                    help="largest sequence length to draw (default: by device)")
    sp.add_argument("--reuse-compiled", action="store_true",
                    help="draw 3 cases in 4 with the shapes, dtype and flags of a case this "
                         "campaign already ran (new batch, mask values and inputs), so a "
                         "compiling kernel runs variants it has built; the 4th draws freely")
    case_timeout(sp)
    quiet(sp)
    sp.set_defaults(func=cmd_fuzz)

    sp = sub.add_parser("repro", help="replay one case; exit 0 pass, 1 fail (git bisect run)")
    sp.add_argument("case", nargs="?", default=None, metavar="CASE.json")
    common(sp, kernel_default=None)
    sp.add_argument("--tensors", default=None, metavar="FILE",
                    help="captured tensors (.npz or .pt, loaded without pickle)")
    sp.add_argument("--is-causal", action="store_true", help="with --tensors: causal")
    sp.add_argument("--causal-alignment", choices=("top_left", "bottom_right"),
                    default="top_left", help="with --tensors")
    sp.add_argument("--window", type=_window, default=None, metavar="LEFT,RIGHT",
                    help="with --tensors: sliding window")
    sp.add_argument("--scale", type=_positive_float, default=None, help="with --tensors")
    sp.add_argument("--forward-only", action="store_true",
                    help="with --tensors: do not check gradients")
    sp.add_argument("--repeat", type=_positive_int, default=None, metavar="N",
                    help="check the case N times in one worker; exit 1 if any run fails "
                         "(default 1; for a case file recorded as 'flaky' or "
                         "'nondeterministic' at least 8, on until one fails or a kernel "
                         "failing at the recorded rate would have, at most 200)")
    sp.add_argument("--family", choices=("lazy", "full"), default="lazy",
                    help="lazy (default): judge against the baseline member, the whole "
                         "family only where that fails; full: against every member, so a "
                         "passing case's table names the member that sets each tensor's "
                         "tolerance and its margin")
    case_timeout(sp)
    sp.set_defaults(func=cmd_repro)

    sp = sub.add_parser("gate", help="CI gate: fixed sweep + regression corpus vs budgets")
    common(sp)
    sp.add_argument("--budgets", default=None, metavar="FILE",
                    help="budgets JSON (default: verify/budgets/<kernel>-<profile>.json)")
    sp.add_argument("--update", action="store_true",
                    help="rewrite the budgets from this run and show the diff")
    sp.add_argument("--corpus", default=None, metavar="DIR",
                    help="regression case files (default: tests/regressions)")
    sp.add_argument("--out", default=f"{DEFAULT_OUT}/gate", metavar="DIR",
                    help=f"report and failures (default: {DEFAULT_OUT}/gate)")
    jobs(sp)
    case_timeout(sp)
    quiet(sp)
    sp.set_defaults(func=cmd_gate)

    sp = sub.add_parser("compare", help="cross-kernel Markdown table from report.json files")
    sp.add_argument("reports", nargs="+", metavar="REPORT.json")
    sp.add_argument("--out", default=None, metavar="FILE.md")
    sp.set_defaults(func=cmd_compare)

    for name, text in (("bench", "speed side by side (kernels.bench)"),
                       ("mutants", "the mutation self-test kill table (verify.selftest)")):
        sp = sub.add_parser(name, help=text, add_help=False)
        sp.add_argument("rest", nargs=argparse.REMAINDER)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in ("bench", "mutants"):
            return _delegate(argv[0], argv[1:])
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help, --version, or a usage error already printed
            return e.code if isinstance(e.code, int) else 2
        args.argv = ["flashcheck", *argv]
        if getattr(args, "path", None):
            # Before any worker starts: the workers' interpreter inherits sys.path and
            # PYTHONPATH (a replay command printed later carries --path too).
            from flashcheck.verify.adapters import add_search_paths
            os.environ["PYTHONPATH"] = os.pathsep.join(
                add_search_paths(args.path)
                + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x])
        if getattr(args, "oracle_device", None):
            # Read by check_case in every worker, which inherit it.
            os.environ[ORACLE_ENV] = args.oracle_device
        if args.command is None:
            parser.print_help()
            return 2
        return args.func(args)
    except UsageError as e:
        print(f"flashcheck: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, NotImplementedError, OSError, SupervisorError) as e:
        # Raised while reading the command's inputs (kernel spec, case file, budgets): the
        # harness catches everything a kernel raises inside check_case itself, so what reaches
        # here is a usage or environment problem.
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if isinstance(e, SupervisorError):  # the harness's own traceback: all of it
            msg = str(e)
        print(f"flashcheck: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("flashcheck: interrupted", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""pytest plugin (entry point ``pytest11``): ``pytest --flashcheck-kernel SPEC``.

Checks a kernel from a project's own test run, so its CI gets one test (one JUnit
``testcase``) per configuration of ``flashcheck gate`` and a fuzz campaign, beside the
project's own tests:

- one item per configuration of the gate's sweep: the fixed sweep of the device's profile
  (``verify.strategies.fixed_sweep``) plus one configuration per regression-corpus file
  (``regression=<stem>``), grouped and labelled as the gate's report does
  (``verify.report.config_label``, ``verify.gate.regression_key``). The test id is the label.
  It fails when a case fails its verdict (the message is the verdict summary: tensor, worst
  index, got / want, tolerance and the family member behind it, case file, replay command)
  or, with ``--flashcheck-budgets``, when the configuration's worst error ratio exceeds its
  committed budget or it has none (``verify.gate.compare_to_budgets``); it is skipped, with
  the reasons, when no case of it ran (all outside the kernel's domain on this device).
- one item ``flashcheck-fuzz``: a ``flashcheck fuzz`` campaign (``verify.fuzz.Campaign``) of
  ``--flashcheck-minutes``, seeded; it fails when the campaign found anything, listing the
  case files and their replay commands.

Cases run as in the CLI: in supervised worker processes (verify/supervise.py), never in the
pytest process. One :class:`~verify.supervise.Supervisor` per pytest process serves every
configuration item, so its worker imports the kernel (and compiles it) once.

The plugin is loaded by every pytest run in an environment where flashcheck is installed,
the kernel's own test suite included. Importing it imports pytest and the standard library
only, and without ``--flashcheck-kernel`` it adds options and nothing else (``-p
no:flashcheck`` removes it altogether).

pytest-xdist: collection is a pure function of the options and the corpus files, so every
worker collects the same items in the same order; each worker process has its own supervisor.

Caveat: no combined report.json is written (under xdist each worker sees only its items);
the JUnit file (``--junitxml``) is the per-configuration record, ``flashcheck gate`` the
report.
"""

from __future__ import annotations

import fnmatch
import math
import os
from pathlib import Path
from typing import Any

import pytest

# --flashcheck-minutes default: 30 s of fuzzing per test run. On the CPU a small-domain kernel
# runs ~30 examples/s (measured: 60 examples of tests/data/userproj's kernel in 2.1 s, after
# ~6 s of worker start and capability probes); the Triton interpreter ~1 example/s. A CI job
# gets a few hundred, or a few dozen, fresh cases per run, without owning the job's time.
DEFAULT_MINUTES = 0.5
DEFAULT_SEED = 0
DEFAULT_OUT = "flashcheck-out/pytest"
FUZZ_ID = "flashcheck-fuzz"
ROOT_ID = "flashcheck"
_SEED_LIMIT = 2**32  # Hypothesis seeds, as `flashcheck fuzz --seed`
_OPTIONS = ("device", "minutes", "examples", "seed", "budgets", "out", "profile", "configs",
            "corpus", "case_timeout", "strict_subnormals", "oracle_device")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("flashcheck", "flashcheck: check an attention kernel (inert "
                                          "without --flashcheck-kernel)")
    group.addoption("--flashcheck-kernel", default=None, metavar="SPEC",
                    help="kernel spec to check (MODULE:ATTR, path.py:ATTR or a built-in "
                         "name); adds one test per gate configuration and a fuzz test")
    group.addoption("--flashcheck-device", default=None, metavar="{cpu,cuda}",
                    help="device (default: cuda if available, else cpu)")
    group.addoption("--flashcheck-profile", default=None, metavar="{cpu,gpu}",
                    help="sweep profile (default: by device, as 'flashcheck gate')")
    group.addoption("--flashcheck-minutes", default=None, metavar="M",
                    help=f"fuzz test length in minutes, >= 0 (default {DEFAULT_MINUTES}; "
                         "0: no fuzz test)")
    group.addoption("--flashcheck-examples", default=None, metavar="N",
                    help="stop the fuzz test after N examples too, N >= 1 (default: no cap)")
    group.addoption("--flashcheck-seed", default=None, metavar="S",
                    help=f"fuzz seed in [0, 2**32) (default {DEFAULT_SEED})")
    group.addoption("--flashcheck-budgets", default=None, metavar="PATH",
                    help="budgets file as in 'flashcheck gate' (default: none; each "
                         "configuration is judged by its own verdicts only)")
    group.addoption("--flashcheck-corpus", default=None, metavar="DIR",
                    help="regression case files (default: as 'flashcheck gate')")
    group.addoption("--flashcheck-configs", action="append", default=None, metavar="PATTERN",
                    help="only configurations whose label contains PATTERN (a glob when it "
                         "has * ? or [); repeatable, any match keeps one")
    group.addoption("--flashcheck-out", default=None, metavar="DIR",
                    help=f"case files of failures (default: {DEFAULT_OUT})")
    group.addoption("--flashcheck-case-timeout", default=None, metavar="S",
                    help="seconds one case may take before its worker is killed and the case "
                         "fails as 'timeout', > 0 (default: as flashcheck fuzz, 60 s + 20x "
                         "the median case time)")
    group.addoption("--flashcheck-strict-subnormals", action="store_const", const=True,
                    default=None, help="a subnormal result flushed to 0 fails, and "
                                       "flush-to-zero leaves the family (as the CLI flag)")
    group.addoption("--flashcheck-oracle-device", default=None, metavar="auto|device",
                    help="where a GPU kernel's cases are judged, as --oracle-device (default "
                         "auto: small cases on the CPU)")


def pytest_configure(config: pytest.Config) -> None:
    spec = config.getoption("flashcheck_kernel")
    if spec is None:
        given = [f"--flashcheck-{o.replace('_', '-')}" for o in _OPTIONS
                 if config.getoption(f"flashcheck_{o}") is not None]
        if given:
            raise pytest.UsageError(f"{', '.join(given)}: needs --flashcheck-kernel SPEC")
        return
    config.pluginmanager.register(FlashcheckSession(Settings(config, spec)),
                                  "flashcheck-session")


# ------------------------------------------------------------------------------- options


def _number(option: str, text: str, kind: type, lo: float, hi: float | None, rng: str):
    """``text`` as ``kind`` within [lo, hi) (hi None: unbounded); UsageError naming the option
    and the allowed range otherwise."""
    try:
        v = kind(text)
    except ValueError:
        raise pytest.UsageError(f"{option} must be {rng}, got {text!r}") from None
    if not (math.isfinite(v) and v >= lo and (hi is None or v < hi)):
        raise pytest.UsageError(f"{option} must be {rng}, got {text}")
    return v


class Settings:
    """The validated options (one instance per pytest process, xdist workers included)."""

    def __init__(self, config: pytest.Config, spec: str) -> None:
        opt = config.getoption
        if not spec.strip():
            raise pytest.UsageError("--flashcheck-kernel must be a kernel spec, got ''")
        self.spec = spec.strip()
        m = opt("flashcheck_minutes")
        self.minutes = DEFAULT_MINUTES if m is None else _number(
            "--flashcheck-minutes", m, float, 0.0, None, "a finite number >= 0 (0: no fuzz test)")
        n = opt("flashcheck_examples")
        self.examples = None if n is None else _number(
            "--flashcheck-examples", n, int, 1, None, "an integer >= 1")
        s = opt("flashcheck_seed")
        self.seed = DEFAULT_SEED if s is None else _number(
            "--flashcheck-seed", s, int, 0, _SEED_LIMIT, "an integer in [0, 2**32)")
        t = opt("flashcheck_case_timeout")
        self.case_timeout = None if t is None else _number(
            "--flashcheck-case-timeout", t, float, math.ulp(0.0), None, "a number > 0")
        self.strict_subnormals = bool(opt("flashcheck_strict_subnormals"))
        oracle = opt("flashcheck_oracle_device")
        if oracle is not None:
            from flashcheck.verify import ORACLE_DEVICES, ORACLE_ENV

            if oracle not in ORACLE_DEVICES:
                raise pytest.UsageError(f"--flashcheck-oracle-device must be "
                                        f"{' or '.join(ORACLE_DEVICES)}, got {oracle!r}")
            os.environ[ORACLE_ENV] = oracle  # read by check_case in every worker
        profile = opt("flashcheck_profile")
        if profile not in (None, "cpu", "gpu"):
            raise pytest.UsageError(f"--flashcheck-profile must be cpu or gpu, got {profile!r}")
        device = opt("flashcheck_device")
        if device not in (None, "cpu", "cuda"):
            raise pytest.UsageError(f"--flashcheck-device must be cpu or cuda, got {device!r}")
        from flashcheck.verify.cli import UsageError, settle_device

        try:  # also sets TRITON_INTERPRET=1 for the CPU, before any worker starts
            self.device = settle_device(device)
        except UsageError as e:
            raise pytest.UsageError(str(e).replace("--device", "--flashcheck-device")) from None
        self.profile = profile or ("gpu" if self.device == "cuda" else "cpu")
        here = Path(config.invocation_params.dir)
        self.out = here / (opt("flashcheck_out") or DEFAULT_OUT)
        from flashcheck.verify import gate

        corpus = opt("flashcheck_corpus")
        if corpus is not None and not (here / corpus).is_dir():
            raise pytest.UsageError(f"--flashcheck-corpus {corpus}: not a directory")
        self.corpus = here / corpus if corpus is not None else gate.default_corpus()
        self.model = gate.device_model(self.device)
        self.budgets_path = None
        self.budgets = None
        b = opt("flashcheck_budgets")
        if b is not None:
            self.budgets_path = here / b
            try:
                self.budgets = gate.load_budgets(self.budgets_path)
                gate.check_device_model(self.budgets, self.budgets_path, self.model)
            except OSError as e:
                raise pytest.UsageError(f"--flashcheck-budgets {b}: cannot read it "
                                        f"({e.strerror or e})") from None
            except ValueError as e:
                raise pytest.UsageError(str(e).replace("--budgets",
                                                       "--flashcheck-budgets")) from None
        self.patterns = list(opt("flashcheck_configs") or [])
        self.configs, self.total = self._plan()
        if self.patterns and not self.configs:
            raise pytest.UsageError(f"--flashcheck-configs {' '.join(self.patterns)}: matches "
                                    f"none of the {self.total} configuration labels")

    def _selected(self, label: str) -> bool:
        if not self.patterns:
            return True
        return any(fnmatch.fnmatchcase(label, p) if any(c in p for c in "*?[") else p in label
                   for p in self.patterns)

    def _plan(self) -> tuple[list[tuple[str, list[Any], list[Any]]], int]:
        """The gate's configurations in label order: (label, cases, report key per case or
        None for the case's own ``config_key``), and how many there are before filtering.
        Deterministic (fixed sweep, sorted corpus files): xdist workers must agree."""
        from flashcheck.verify import gate
        from flashcheck.verify import report as R

        try:
            all_cases, all_keys, self.n_sweep = gate.gate_cases(self.profile, self.corpus)
        except (OSError, ValueError) as e:
            raise pytest.UsageError(f"--flashcheck-corpus {self.corpus}: {e}") from None
        self.n_regressions = len(all_cases) - self.n_sweep
        groups: dict[str, tuple[list[Any], list[Any]]] = {}
        for case, key in zip(all_cases, all_keys, strict=True):
            label = R.config_label(case.config_key() if key is None else key)
            cases, keys = groups.setdefault(label, ([], []))
            cases.append(case)
            keys.append(key)
        labels = sorted(groups, key=R._natural)
        return [(lab, *groups[lab]) for lab in labels if self._selected(lab)], len(labels)


# ------------------------------------------------------------------------------- items


class FlashcheckFailure(Exception):
    """A verdict, a budget or a campaign failed: reported as its message alone (the
    harness's traceback says nothing about the kernel)."""


class _Item(pytest.Item):
    def __init__(self, *, session_plugin: FlashcheckSession, **kw: Any) -> None:
        super().__init__(**kw)
        self.fc = session_plugin

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, FlashcheckFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)


class ConfigItem(_Item):
    """One configuration of the gate: its cases, judged together."""

    def __init__(self, *, cases: list[Any], keys: list[Any], **kw: Any) -> None:
        super().__init__(**kw)
        self.cases = cases
        self.keys = keys

    def runtest(self) -> None:
        self.fc.run_config(self)

    def reportinfo(self):
        return self.path, None, f"flashcheck configuration {self.name}"


class FuzzItem(_Item):
    """The time-boxed campaign."""

    def runtest(self) -> None:
        self.fc.run_fuzz()

    def reportinfo(self):
        return self.path, None, f"flashcheck fuzz campaign ({FUZZ_ID})"


class FlashcheckRoot(pytest.Collector):
    """The parent of the plugin's items (node id ``flashcheck``; JUnit classname)."""

    def collect(self):  # the items are made by FlashcheckSession, not collected
        return []


# ------------------------------------------------------------------------------- session


class FlashcheckSession:
    """Registered by :func:`pytest_configure` when ``--flashcheck-kernel`` is given."""

    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self._sup = None
        self._header = None

    # -- hooks -----------------------------------------------------------------------------

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        s = self.s
        picked = (f"{len(s.configs)} of {s.total} configurations (--flashcheck-configs)"
                  if s.patterns else f"{s.total} configurations")
        model = f" ({s.model})" if s.model != s.device else ""
        lines = [f"flashcheck: kernel {s.spec} on {s.device}{model}, profile {s.profile}: "
                 f"{picked} from {s.n_sweep} sweep cases + {s.n_regressions} regression cases "
                 f"({s.corpus})"]
        if s.budgets is not None:
            lines.append(f"flashcheck: budgets {s.budgets_path}: a configuration also fails "
                         "when its worst error ratio exceeds its budget, or it has none")
        else:
            lines.append("flashcheck: no budgets (--flashcheck-budgets): configurations are "
                         "judged by their own verdicts only")
        lines.append("flashcheck: fuzz " + (
            f"{s.minutes:g} min" + (f" or {s.examples} examples" if s.examples else "")
            + f", seed {s.seed}" if s.minutes > 0 else "off (--flashcheck-minutes 0)")
            + f"; failures in {s.out}")
        return lines

    @pytest.hookimpl(tryfirst=True)  # before -k / -m deselection, which then sees our items
    def pytest_collection_modifyitems(self, session: pytest.Session, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        root = FlashcheckRoot.from_parent(session, name=ROOT_ID, nodeid=ROOT_ID)
        ours: list[pytest.Item] = []
        if self.s.minutes > 0:  # first: the longest item starts early under xdist
            ours.append(FuzzItem.from_parent(root, name=FUZZ_ID, session_plugin=self))
        for label, cases, keys in self.s.configs:
            ours.append(ConfigItem.from_parent(root, name=label, cases=cases, keys=keys,
                                               session_plugin=self))
        items.extend(ours)
        # Counted as collected, as if the root had collected them ("collected N items").
        config.hook.pytest_collectreport(
            report=pytest.CollectReport(root.nodeid, "passed", None, list(ours)))

    def pytest_sessionfinish(self) -> None:
        if self._sup is not None:
            self._sup.close()
            self._sup = None

    # -- running ---------------------------------------------------------------------------

    def _supervisor(self):
        if self._sup is None:
            from flashcheck.verify.supervise import Supervisor

            self._sup = Supervisor(self.s.spec, self.s.device,
                                   failures_dir=self.s.out / "failures",
                                   case_timeout=self.s.case_timeout,
                                   strict_subnormals=self.s.strict_subnormals)
        return self._sup

    def _report_header(self) -> dict[str, Any]:
        if self._header is None:
            from flashcheck.verify import report as R

            self._header = R.make_header(kernel=self.s.spec, device=self.s.device,
                                         command=["pytest", "--flashcheck-kernel", self.s.spec],
                                         profile=self.s.profile)
        return self._header

    def run_config(self, item: ConfigItem) -> None:
        from flashcheck.verify import gate
        from flashcheck.verify import report as R
        from flashcheck.verify.adapters import SpecError
        from flashcheck.verify.supervise import SupervisorError
        from flashcheck.verify.sweep import interrupted, run_cases

        s = self.s
        try:
            records = run_cases(None, item.cases, s.device, kernel_spec=s.spec,
                                failures_dir=s.out / "failures", what=item.name, quiet=True,
                                supervisor=self._supervisor())
        except (SpecError, SupervisorError) as e:
            raise FlashcheckFailure(f"kernel {s.spec!r} on {s.device}: {e}") from None
        if interrupted(records):
            raise KeyboardInterrupt
        for rec, key in zip(records, item.keys, strict=True):
            if key is not None:
                rec["config"] = key
        rep = R.build_report(records, header=self._report_header())
        (config,) = rep["configs"]
        assert config["label"] == item.name, (config["label"], item.name)
        if config["status"] == "fail":
            raise FlashcheckFailure(_failure_text(config, rep["failures"], records))
        if config["status"] == "not_run":
            pytest.skip("not run: " + "; ".join(f"{r['reason']}" + (
                f" ({r['count']} cases)" if r["count"] > 1 else "")
                for r in config["not_run"]))
        if s.budgets is not None:
            rows, _ = gate.compare_to_budgets(rep, s.budgets)
            row = next(r for r in rows if r["label"] == item.name)
            if row["status"] == "fail":
                raise FlashcheckFailure(f"configuration {item.name}: {row['why']} "
                                        f"(budgets {s.budgets_path})")

    def run_fuzz(self) -> None:
        from flashcheck.verify import report as R
        from flashcheck.verify.adapters import SpecError
        from flashcheck.verify.fuzz import Campaign
        from flashcheck.verify.supervise import SupervisorError

        s = self.s
        try:
            campaign = Campaign(None, kernel_spec=s.spec, device=s.device, out=s.out / "fuzz",
                                minutes=s.minutes, seed=s.seed, quiet=True,
                                case_timeout=s.case_timeout,
                                strict_subnormals=s.strict_subnormals)
            # Both bounds (the CLI takes one): set after the check of __post_init__; the
            # campaign stops at whichever comes first.
            campaign.examples = s.examples
            campaign.run()
        except (SpecError, SupervisorError, ValueError) as e:
            raise FlashcheckFailure(f"fuzz: kernel {s.spec!r} on {s.device}: {e}") from None
        if campaign.found:
            lines = [f"fuzz ({s.minutes:g} min, seed {s.seed}): {len(campaign.found)} distinct "
                     f"failure(s) of {s.spec} on {s.device}:"]
            for path in campaign.found:
                lines += [f"FAIL {_case_file_summary(path)}",
                          f"  case file: {path}",
                          f"  replay: {R.replay_command(str(path), s.spec, s.device)}"]
            raise FlashcheckFailure("\n".join(lines))


def _failure_text(config: dict[str, Any], failures: list[dict[str, Any]],
                  records: list[dict[str, Any]]) -> str:
    """The failing cases of one configuration: each verdict summary with its case file and
    replay command, and the per-tensor table of the first."""
    from flashcheck.verify import report as R

    n = config["counts"]["fail"]
    lines = [f"{n} of {config['cases']} case(s) fail in configuration {config['label']}:"]
    for f in failures:
        lines.append(f"FAIL {f['summary']}")
        if f["case_file"]:
            lines += [f"  case file: {f['case_file']}", f"  replay: {f['replay']}"]
    first = next(r for r in records if r["status"] == "fail")
    lines += ["", R.render_verdict_table(first)]
    return "\n".join(lines)


def _case_file_summary(path: Path) -> str:
    """The verdict summary stored in a failure's case file (its class when unreadable)."""
    from flashcheck.verify.cases import load_case_file
    from flashcheck.verify.check import Verdict

    try:
        case, meta = load_case_file(path)
        d = dict(meta.get("verdict") or {})
        d.setdefault("case", case.to_dict())
        d.setdefault("kernel", meta.get("kernel", ""))
        d.setdefault("device", meta.get("device", ""))
        return Verdict.from_dict(d).summary()
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{Path(path).stem} (case file unreadable: {e})"


__all__ = ["ConfigItem", "FuzzItem", "FlashcheckFailure", "FlashcheckSession", "Settings",
           "pytest_addoption", "pytest_configure"]

"""Registers, spills and shared memory of our kernels on sm_90a, compiled without a GPU.

    python3 scripts/ptxas_report.py --out docs/benchmarks/ptxas_sm90.json [--sweep]
        [--d 128] [--dtype bfloat16] [--ptx-dir DIR] [--schedule c3+early+split]

Triton lowers a kernel to PTX for any target on any machine; the PTX assembler that ships
with Triton's NVIDIA backend (``ptxas -v``) then reports each kernel's registers per thread
and the bytes it spills to local memory. This runs the package's own launchers
(``_forward``, ``_backward``) on CPU tensors of the benchmark shape (B=16, H=16, N=4096)
with a stand-in driver that reports an sm_90 device, and compiles each launch instead of
running it: the kernels, constexprs, tile sizes, warps and stages are exactly those a
launch on the H200 gets (the heuristic table's points and ``SCHEDULE_TABLE``'s flags), or,
with ``--sweep``, every variant of ``scripts/gpu/sweep_hopper.py``.

What it is for: spills and register counts are the first thing to read about a variant
before spending GPU time on it (the dK/dV kernel's 255 registers and spills in the ncu
profile, docs/benchmarks/profile_h200.md, show here too); and the PTX hashes tell whether a
change to the kernels' source changes the compiled code at all (a refactor that leaves
every hash equal needs no re-timing: ``--against`` an earlier report lists the launches
whose code differs and exits 1 if any does). ``--schedule`` compiles the Gluon forward under
one of its schedules (``flash_attention_gluon.schedule_spec``); with ``--ptx-dir`` each
Gluon forward record also lists its consumer loops from the SASS (:func:`exp_wait_order`:
instructions, exponentials before and after the wait for P V, spill stores and loads
inside the loop). Static numbers, not speed: Triton's version decides
the code (the H200 runs triton 3.6; run this under the same version for figures that
match it).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parent.parent
H200_SMEM = 232448  # the H200's opt-in shared memory per block (bytes)
SHAPE = dict(B=16, H=16, N=4096)  # the benchmark shape (kernels.bench, sweep_hopper)
SHOWN = ("BLOCK_M", "BLOCK_N", "BLOCK_D", "TMA", "WS", "REVERSE", "BAND", "ATOMIC_DQ", "ROWS",
         "EARLY", "PERSIST", "HALVES", "NC", "EARLY_P", "SPLIT", "RAGGED")
GLUON_FWD = ("_fwd_kernel", "_fwd_persistent_kernel")  # the Gluon forward's two kernels
KERNELS = {"fwd": "_fwd_kernel_impl", "dkdv": "_bwd_dkdv_kernel_impl",
           "dq": "_bwd_dq_kernel_impl"}  # the Gluon forward is "_fwd_kernel"


def _script(name: str):
    """scripts/gpu/NAME.py as a module (registered under NAME: dataclasses look it up)."""
    spec = importlib.util.spec_from_file_location(name, _ROOT / f"scripts/gpu/{name}.py")
    mod = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ptxas() -> str:
    """The ptxas Triton's NVIDIA backend assembles sm_90 code with."""
    from triton.backends.nvidia import compiler
    return compiler.get_ptxas(90).path


def code_of(ptx: str) -> str:
    """The PTX without its source positions: ``.loc``/``.file`` directives, the labels that
    only mark inlined scopes for them (``$L__tmpN``), the DWARF sections and comments. Moving
    code between lines or helper functions changes those and nothing else."""
    body = ptx.split("\t.section\t.debug", 1)[0]
    keep = []
    for line in body.splitlines():
        t = line.split("//", 1)[0].rstrip()
        if not t.strip() or t.lstrip().startswith((".loc", ".file")) or re.fullmatch(
                r"\$L__tmp\d+:", t.strip()):
            continue
        keep.append(t)
    return "\n".join(keep)


def sass_of(cubin: Path) -> list[tuple[int, str]]:
    """(address, instruction) of every SASS instruction in ``cubin``: scripts/gpu/race_trace.py's
    cuobjdump and reader."""
    rt = _script("race_trace")
    text = subprocess.run([rt.cuobjdump(), "-sass", str(cubin)], capture_output=True,
                          text=True, check=True).stdout
    return rt.read_sass(text)


def exp_wait_order(cubin: Path) -> list[dict]:
    """Per innermost loop of ``cubin`` (a backward branch's body holding no other) with two
    wgmma groups (``HGMMA``) and exponentials (``MUFU.EX2``), where the exponentials land
    against the loop's last wait for every outstanding wgmma group
    (``WARPGROUP.DEPBAR.LE gsb0, 0x0``): the
    forward's steady state overlaps a tile's exponentials with the previous tile's P V only
    when they come before that wait (kernels/flash_attention_gluon.py, ``_attend``)."""
    sass = sass_of(cubin)
    loops = []
    for addr, ins in sass:
        m = re.search(r"\bBRA (0x[0-9a-f]+)", ins)
        start = int(m.group(1), 16) if m else addr
        if start >= addr:
            continue
        body = [x for a, x in sass if start <= a <= addr]
        # (the waits' retry blocks after the last EXIT branch back into the code: no loop)
        if (sum("HGMMA" in x for x in body) < 12 or not any("MUFU.EX2" in x for x in body)
                or any(x.split()[-1] == "EXIT" for x in body)):
            continue
        waits = [i for i, x in enumerate(body) if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in x]
        last = waits[-1] if waits else len(body)
        loops.append(dict(start=start, end=addr, instructions=len(body),
                          exp_before_wait=sum("MUFU.EX2" in x for x in body[:last]),
                          exp_after_wait=sum("MUFU.EX2" in x for x in body[last:]),
                          spill_stores=sum(bool(re.search(r"\bSTL\b", x)) for x in body),
                          spill_loads=sum(bool(re.search(r"\bLDL\b", x)) for x in body)))
    return [x for x in loops if not any(y is not x and x["start"] <= y["start"]
                                        and y["end"] <= x["end"] for y in loops)]


class _Compiler:
    """Stands in for the GPU: an sm_90 driver, and a compile step that records each kernel
    (registers, spills, shared memory, the hash of its PTX without source positions) and
    launches nothing."""

    def __init__(self, ptx_dir: Path | None):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", 90, 128)
        self.ptx_dir = ptx_dir
        self.records: list[dict] = []
        self.tag = ""
        self.only: str | None = None
        self._seen: dict = {}

    def install(self) -> None:
        from triton import knobs
        from triton.runtime import driver
        from triton.runtime.jit import JITFunction

        target = self.target

        class _Driver:
            def get_current_target(self):
                return target

            def get_current_device(self):
                return 0

            def get_current_stream(self, device=None):
                return 0

            def get_active_torch_device(self):
                return torch.device("cpu")

        driver.set_active(_Driver())
        # ptxas's -v log on stdout; always_compile: a cached kernel would not run ptxas.
        knobs.nvidia.dump_ptxas_log = True
        knobs.compilation.always_compile = True
        me = self

        def _do_compile(jit, key, signature, device, constexprs, options, attrs, warmup):
            me.compile(jit, key, signature, constexprs, options, attrs)
            return None  # nothing to launch

        JITFunction._do_compile = _do_compile

    def compile(self, jit, key, signature, constexprs, options, attrs) -> None:
        name = jit.fn.__name__
        if self.only is not None and name != self.only:
            return  # a sweep variant's other kernels: the table's, reported once
        memo = (name, str(key))
        if memo not in self._seen:
            src = jit.ASTSource(jit, signature, constexprs, attrs)
            # Triton's own ptxas call (its options, its ptxas) prints its -v log here.
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                k = jit.compile(src, target=self.target, options=options.__dict__)
            log = buf.getvalue()
            ptx = k.asm["ptx"]
            digest = hashlib.sha256(code_of(ptx).encode()).hexdigest()[:16]
            loops = None
            if self.ptx_dir is not None:  # the PTX, and the machine code beside it
                self.ptx_dir.mkdir(parents=True, exist_ok=True)
                (self.ptx_dir / f"{name}-{digest}.ptx").write_text(ptx)
                cubin = self.ptx_dir / f"{name}-{digest}.cubin"
                cubin.write_bytes(k.asm["cubin"])
                if name in GLUON_FWD:
                    loops = [{x: loop[x] for x in ("instructions", "exp_before_wait",
                                                   "exp_after_wait", "spill_stores",
                                                   "spill_loads")}
                             for loop in exp_wait_order(cubin)]
            regs = re.search(r"Used (\d+) registers", log)
            spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
            if regs is None:
                raise RuntimeError(f"{name}: no ptxas -v log from Triton's compile "
                                   f"(knobs.nvidia.dump_ptxas_log); got {log[:200]!r}")
            # constexprs is keyed by argument path: (i,) for the kernel's i-th parameter.
            named = {jit.params[path[0]].name: v for path, v in constexprs.items()
                     if len(path) == 1 and isinstance(v, (bool, int))}
            self._seen[memo] = dict(
                kernel=name, warps=options.num_warps, stages=options.num_stages,
                registers=int(regs.group(1)),
                spill_store_bytes=int(spill.group(1)) if spill else None,
                spill_load_bytes=int(spill.group(2)) if spill else None,
                shared_bytes=k.metadata.shared, ptx_sha256=digest,
                constexprs={n: named[n] for n in SHOWN if n in named},
                **({} if loops is None else dict(loops=loops)))
        self.records.append(dict(self._seen[memo], launch=self.tag))


def _patch_for_h200() -> None:
    """The launch points and flags an sm_90 device gets, on CPU tensors; the forward's Gluon
    path where an sm_90 device takes it (a sweep variant turns it off: sweep_hopper._forced)."""
    from flashcheck.kernels import _common
    from flashcheck.kernels import flash_attention_gluon as fg
    fg.eligible = fg.fits
    _common.launch_point = lambda kind, bd, elem, causal, device: _common.fixed_point(
        kind, bd, elem, causal, H200_SMEM)
    _common.use_tma = lambda kind, device, elem, bd, band=False: bool(
        _common.schedule(kind, elem, bd, band)["tma"])
    _common.use_reduce = lambda device: True
    _common.sm_count = lambda device: 132  # the H200's multiprocessors


def _problem(D: int, dtype: torch.dtype, causal: bool):
    from flashcheck.kernels import _common
    shape = (SHAPE["B"], SHAPE["H"], SHAPE["N"], D)
    q, k, v, do = (torch.empty(shape, dtype=dtype) for _ in range(4))
    # validate() refuses CPU tensors without the interpreter and bf16 on the CPU; the
    # Problem it returns holds no dtype, so fp16 stand-ins give the same one.
    was, _common.INTERPRET = _common.INTERPRET, True
    try:
        h = torch.float16
        p = _common.validate(q.to(h), k.to(h), v.to(h), None, 0.0, causal, None, False, None,
                             "top_left")
    finally:
        _common.INTERPRET = was
    return q, k, v, do, p


def run(*, D: int, dtype: torch.dtype, sweep: bool, ptx_dir: Path | None,
        which: str = "tables", schedule: str = "") -> dict:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("ptxas_report: unset TRITON_INTERPRET (this compiles for sm_90a)")
    comp = _Compiler(ptx_dir)
    comp.install()
    _patch_for_h200()
    from flashcheck.kernels import flash_attention as fa
    from flashcheck.kernels import flash_attention_gluon as fg

    sw = _script("sweep_hopper")
    with fg.schedule(**(fg.schedule_spec(schedule) if schedule else {})):
        _compile_all(comp, fa, sw, D, dtype, sweep, which)
    import triton
    ver = subprocess.run([_ptxas(), "--version"], capture_output=True, text=True).stdout
    return dict(
        command="python3 scripts/ptxas_report.py " + " ".join(sys.argv[1:]),
        triton=triton.__version__, torch=torch.__version__,
        ptxas=(re.findall(r"release [\d.]+, V[\d.]+", ver) or [ver.strip()])[0],
        target="sm_90a", shape=dict(SHAPE, D=D), dtype=str(dtype).replace("torch.", ""),
        **({"schedule": schedule} if schedule else {}), kernels=comp.records)


def _compile_all(comp, fa, sw, D, dtype, sweep, which) -> None:
    """Every launch of the table (and, ``sweep``, of the sweep's variants) compiled."""
    todo = [None] + (sw.variants(which) if sweep else [])
    for var in todo:
        for causal in (False, True):
            if var is not None and var["causal"] != causal:
                continue
            q, k, v, do, p = _problem(D, dtype, causal)
            comp.only = None if var is None else KERNELS[var["kind"]]
            comp.tag = ("table" if var is None else
                        f"{var['kind']} {tuple(var['point'])} tma={var['tma']} ws={var['ws']}"
                        f"{' rows' if var.get('rows') else ''}"
                        f"{' early' if var.get('early') else ''}"
                        f"{' atomic' if var.get('atomic') else ''}"
                        f"{' reduce' if var.get('reduce') else ''}"
                        f"{' persist=' + str(var['persist']) if var.get('persist') else ''}"
                        f"{' halves' if var.get('halves') else ''}") + f" causal={causal}"
            # The table's launch as it is; a sweep variant forced as the sweep forces it.
            try:
                with contextlib.nullcontext() if var is None else sw._forced(var):
                    out, lse = fa._forward(q, k, v, p, False)
                    fa._backward(do, q, k, v, out, lse, p, not (var or {}).get("atomic"),
                                 False)
            except Exception as e:  # noqa: BLE001 - recorded (the sweep's compile failures)
                if var is None:
                    raise
                comp.records.append(dict(launch=comp.tag, error=f"{type(e).__name__}: "
                                                               f"{str(e)[:200]}"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON report")
    ap.add_argument("--d", type=int, default=128, help="head dim (default 128)")
    ap.add_argument("--dtype", default="bfloat16", choices=("float16", "bfloat16", "float32"))
    ap.add_argument("--sweep", action="store_true",
                    help="also every variant of scripts/gpu/sweep_hopper.py")
    ap.add_argument("--set", default="tables", choices=_script("sweep_hopper").SETS,
                    help="with --sweep: which of sweep_hopper.py's variant sets")
    ap.add_argument("--ptx-dir", type=Path, default=None,
                    help="keep each kernel's PTX and cubin here (named by its PTX's hash)")
    ap.add_argument("--schedule", default="",
                    help="the Gluon forward's schedule, a +-joined set of c2, c3, c3long, early, "
                         "split (default: its own)")
    ap.add_argument("--against", type=Path, default=None, metavar="REPORT",
                    help="an earlier report of the same options: list the launches whose "
                         "code differs; exit 1 if any does (a refactor's check)")
    args = ap.parse_args(argv)
    before = None
    if args.against is not None:
        try:
            before = json.loads(args.against.read_text())
        except (OSError, ValueError) as e:
            ap.error(f"--against: cannot read a report from {args.against}: {e}")
    if not 1 <= args.d <= 256:
        ap.error(f"--d must be in 1..256, got {args.d}")
    if args.schedule:
        from flashcheck.kernels import flash_attention_gluon as fg
        try:
            fg.schedule_spec(args.schedule)
        except ValueError as exc:
            ap.error(f"--schedule: {exc}")
    rep = run(D=args.d, dtype=getattr(torch, args.dtype), sweep=args.sweep,
              ptx_dir=args.ptx_dir, which=args.set, schedule=args.schedule)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # One kernel record per line: the report stays readable and diffs line by line.
    head = json.dumps({k: v for k, v in rep.items() if k != "kernels"}, indent=1)[:-2]
    rows = ",\n  ".join(json.dumps(r) for r in rep["kernels"])
    args.out.write_text(f"{head},\n \"kernels\": [\n  {rows}\n ]\n}}\n")
    for r in rep["kernels"]:
        if "error" in r:
            print(f"{r['launch']:<48} does not compile: {r['error'][:60]}")
            continue
        if r["kernel"] == "_bwd_preprocess":
            continue
        c = r["constexprs"]
        print(f"{r['launch']:<48} {r['kernel']:<22} M{c.get('BLOCK_M')} N{c.get('BLOCK_N')} "
              f"w{r['warps']} s{r['stages']} TMA={int(bool(c.get('TMA')))} "
              f"WS={int(bool(c.get('WS')))}: {r['registers']} regs, spill "
              f"{r['spill_store_bytes']}/{r['spill_load_bytes']} B, smem {r['shared_bytes']}"
              + ("".join(f"; loop {x['instructions']} ins, ex2 {x['exp_before_wait']}/"
                         f"{x['exp_after_wait']}, STL {x['spill_stores']}"
                         for x in r.get("loops", []))))
    if before is not None:
        changed = differences(before, rep)
        for line in changed:
            print(f"differs: {line}")
        print(f"against {args.against}: {len(rep['kernels'])} kernels, "
              f"{len(changed)} with other code")
        return 1 if changed else 0
    return 0


def differences(before: dict, after: dict) -> list[str]:
    """Launches whose compiled code (or compile error) differs between two reports of the
    same options, or that only one of them has."""
    opts = ("triton", "target", "shape", "dtype", "schedule")
    if any(before.get(k) != after.get(k) for k in opts):
        return [f"the reports differ in {[k for k in opts if before.get(k) != after.get(k)]}"]

    def keyed(rep):
        return {(r["launch"], r.get("kernel", "")): r.get("ptx_sha256", r.get("error"))
                for r in rep["kernels"]}

    b, a = keyed(before), keyed(after)
    return [f"{launch} {kernel}".strip() for (launch, kernel) in sorted(set(a) | set(b))
            if a.get((launch, kernel)) != b.get((launch, kernel))]


if __name__ == "__main__":
    sys.exit(main())

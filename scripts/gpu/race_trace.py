"""racecheck's reports on the Gluon kernels, traced to the instructions and the shared memory
they touch.

    python3 scripts/gpu/race_trace.py compile --out DIR [--ptxas PATH]     (no GPU needed)
        [--cases sanitize --ns 128,256 --ds 128]
    python3 scripts/gpu/race_trace.py trace LOG --sass DIR [--out REPORT.md]
    python3 scripts/gpu/race_trace.py compare DIR DEVICE_SASS_DIR

``compile`` builds, for sm_90a and without a GPU (scripts/ptxas_report.py's stand-in driver),
exactly the kernels ``scripts/gpu/gluon_bwd.py --check-small`` launches: the Gluon forward
that makes each configuration's inputs and every form's ``_bwd_kernel``, per configuration
(Hkv 2 and 1, causal and not, B 1, H 2, N 256, D 128, bf16). Each goes to DIR as
``TAG.{cubin,sass,ttgir,alloc.mlir,json}`` (TAG ``fwd-causal0-hkv2``,
``writer_ordered-causal1-hkv1``, ...): the machine code by the ``cuobjdump`` Triton's package
carries, the TTGIR and the same after Triton's shared-memory allocation pass (every buffer's
``allocation.offset``), and the metadata (shared bytes, ptxas and triton versions). The
machine code is the device's when the ptxas is: ``--ptxas`` (default: the one Triton would
take for sm_90, ``TRITON_PTXAS_BLACKWELL_PATH``) must be the release the GPU session's
triton used (the session's ``env-*.txt`` prints it); its PTX ISA version follows from it.

``--cases sanitize`` builds instead the Gluon forward that ``scripts/gpu/sanitize_cases.py
--ns NS --ds DS`` launches (plain and causal, fp16; ``FLASHCHECK_GLUON=persistent`` its
persistent grid), tagged ``fwd-N128-D128-causal``, ...

``trace`` reads racecheck's output of that run (``--racecheck-report`` hazard or the default
summary; the script's "ok"/"BAD" lines name the form and configuration of the reports
before them) and, for each report, prints the instruction at each reported offset with the
ones around it, and the shared bytes the report is about (the address racecheck names less
the 0x400 of the block's reserved window, or the bytes of an access whose operand adds no
per-thread register) placed in the kernel's layout after allocation: one of the kernel's
own buffers (its ``local_alloc``s, their mbarriers included), Triton's warp-specialize area
(the captures the default partition hands the others, and the state byte per warp that
releases them into their partitions), an operation's scratch, or nothing. An offset whose
instruction is not a shared-memory access of the reported kind says that the machine code
is not the one the GPU ran. Exit 1 if any report touches one of the kernel's own buffers,
cannot be placed, or lands on such an instruction.

``compare`` says, for each kernel compile built, whether the device compiled the same machine
code (an identical instruction list among the SASS ``session.sh bwdrace`` dumped there); exit
1 if any has none.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent.parent
GLUON_KERNELS = ("_fwd_kernel", "_fwd_persistent_kernel", "_bwd_kernel")
WINDOW = 0x400  # racecheck's __shared__ addresses start at the block's 1 KiB reserved window
CONTEXT = 6  # instructions shown before and after each reported one

# ------------------------------------------------------------------------------------------
# compile


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def cuobjdump() -> str:
    """The cuobjdump Triton's package carries, else the one on PATH."""
    import triton
    own = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    if own.is_file():
        return str(own)
    from shutil import which
    found = which("cuobjdump")
    if found is None:
        raise SystemExit("race_trace: no cuobjdump (neither Triton's package nor PATH has one)")
    return found


def compile_all(out: Path, ptxas: str | None, cases: str = "check-small",
                ns: tuple[int, ...] = (128, 256), ds: tuple[int, ...] = (128, )) -> list[str]:
    """Compile into ``out`` every Gluon kernel that ``cases`` launches: "check-small",
    ``gluon_bwd.py --check-small``'s; "sanitize", ``sanitize_cases.py --ns NS --ds DS``'s
    (the forward, plain and causal, fp16, in the Gluon mode ``FLASHCHECK_GLUON`` names).
    The tags."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("race_trace: unset TRITON_INTERPRET (this compiles for sm_90a)")
    if ptxas:
        os.environ["TRITON_PTXAS_BLACKWELL_PATH"] = ptxas
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    sys.path.insert(0, str(_ROOT))
    import torch
    import triton
    from triton.backends.compiler import GPUTarget

    rep = _load("ptxas_report", _ROOT / "scripts/ptxas_report.py")
    comp = rep._Compiler(None)
    comp.install()
    comp.target = GPUTarget("cuda", 90, 32)  # the device's: sm_90, 32 threads per warp
    rep._patch_for_h200()
    from flashcheck.kernels import _common
    from flashcheck.kernels import flash_attention as fa
    from flashcheck.kernels import flash_attention_gluon_bwd as gb

    small = _load("gluon_bwd", _ROOT / "scripts/gpu/gluon_bwd.py")
    from triton.backends.nvidia.compiler import get_ptxas
    ver = subprocess.run([get_ptxas(90).path, "--version"], capture_output=True,
                         text=True).stdout
    ptxas_ver = "ptxas " + ((re.findall(r"release [\d.]+, V[\d.]+", ver) or [ver.strip()])[0])
    out.mkdir(parents=True, exist_ok=True)
    cuobj = cuobjdump()
    tags: list[str] = []
    state = {"tag": None}

    def compile_one(jit, key, signature, constexprs, options, attrs) -> None:
        name = jit.fn.__name__
        if name not in GLUON_KERNELS or state["tag"] is None:
            return
        tag = state["tag"]
        src = jit.ASTSource(jit, signature, constexprs, attrs)
        with contextlib.redirect_stdout(io.StringIO()):
            k = jit.compile(src, target=comp.target, options=options.__dict__)
        (out / f"{tag}.cubin").write_bytes(k.asm["cubin"])
        (out / f"{tag}.ttgir").write_text(k.asm["ttgir"])
        (out / f"{tag}.alloc.mlir").write_text(allocated_ir(out / f"{tag}.ttgir"))
        sass = subprocess.run([cuobj, "-sass", str(out / f"{tag}.cubin")], capture_output=True,
                              text=True, check=True).stdout
        (out / f"{tag}.sass").write_text(sass)
        (out / f"{tag}.json").write_text(json.dumps(dict(
            kernel=name, tag=tag, shared=k.metadata.shared, num_warps=k.metadata.num_warps,
            triton=triton.__version__, ptxas=ptxas_ver, target="sm_90a"), indent=1))
        tags.append(tag)
        state["tag"] = None  # one kernel per tag

    comp.compile = compile_one
    if cases == "sanitize":
        for N in ns:
            for D in ds:
                for mode in ("plain", "causal"):  # the mask takes the Triton forward
                    q = torch.empty(1, 2, N, D, dtype=torch.float16)
                    state["tag"] = f"fwd-N{N}-D{D}-{mode}"
                    fa._forward(q, q, q, _validated(_common, q, q, mode == "causal"), False)
                    print("compiled", state["tag"] or tags[-1], flush=True)
        return tags
    bf16 = torch.bfloat16
    for hkv, causal in small.SMALL_CONFIGS:
        B, H, N, D = (small.SMALL[n] for n in ("B", "H", "N", "D"))
        q = torch.empty(B, H, N, D, dtype=bf16)
        kv = torch.empty(B, hkv, N, D, dtype=bf16)
        p = _validated(_common, q, kv, causal)
        state["tag"] = f"fwd-causal{int(causal)}-hkv{hkv}"
        fa._forward(q, kv, kv, p, False)
        lse = torch.empty(B, H, N)
        for name, mode, det in small.FORMS:
            state["tag"] = f"{name}-causal{int(causal)}-hkv{hkv}"
            with _common.gluon_bwd(mode):
                gb.backward(q, q, kv, kv, lse, lse, p, det)
            print("compiled", state["tag"] or tags[-1], flush=True)
    return tags


def _validated(_common, q, kv, causal):
    """check-small's Problem on CPU stand-ins (validate() refuses CPU tensors unless it
    believes the interpreter runs, and bf16 there; the Problem holds no dtype)."""
    import torch
    was, _common.INTERPRET = _common.INTERPRET, True
    try:
        h = torch.float16
        return _common.validate(q.to(h), kv.to(h), kv.to(h), None, 0.0, causal, None,
                                q.shape[1] != kv.shape[1], None, "top_left")
    finally:
        _common.INTERPRET = was


# ------------------------------------------------------------------------------------------
# the log

_SUMMARY = re.compile(r"Race reported between (Read|Write) access at (\w+)\+0x([0-9a-f]+)"
                      r" in (\S+)")
_AND = re.compile(r"^=+\s+and (Read|Write) access at (\w+)\+0x([0-9a-f]+) in (\S+)"
                  r"(?: \[(\d+) hazards?\])?")
_HAZARD = re.compile(r"Potential (\w+) hazard detected at __shared__ 0x([0-9a-f]+) in block "
                     r"\((\d+),(\d+),(\d+)\)")
_THREAD = re.compile(r"^=+\s+(Read|Write) Thread \((\d+),(\d+),(\d+)\) at (\w+)\+0x([0-9a-f]+)"
                     r" in (\S+)")
_RESULT = re.compile(r"^(ok |BAD) (\w+) causal=(True|False) hkv=(\d+)")
_CASE = re.compile(r"^ok N=(\d+) D=(\d+) (\w+)")  # sanitize_cases.py's


@dataclass
class Access:
    kind: str  # "Read" or "Write"
    kernel: str
    offset: int
    source: str
    hazards: int | None = None  # the summary's count for this pair
    thread: int | None = None  # the hazard report's thread (x)


@dataclass
class Report:
    accesses: list[Access]
    address: int | None = None  # __shared__ address (hazard reports only)
    hazard: str = ""  # RAW / WAR / WAW (hazard reports only)
    # the run it is in: (form, causal, hkv) of gluon_bwd.py --check-small, or ("sanitize",
    # N, D, mode) of sanitize_cases.py
    config: tuple | None = None
    line: int = 0


def parse_log(text: str) -> list[Report]:
    """Every report of racecheck's output, each with the configuration of the
    ``--check-small`` run it belongs to (the first "ok"/"BAD" line after it)."""
    reports: list[Report] = []
    open_ = None
    pending: list[Report] = []
    for n, line in enumerate(text.splitlines(), 1):
        m = _SUMMARY.search(line)
        if m:
            open_ = Report([Access(m[1], m[2], int(m[3], 16), m[4])], line=n)
            reports.append(open_)
            pending.append(open_)
            continue
        m = _HAZARD.search(line)
        if m:
            open_ = Report([], address=int(m[2], 16), hazard=m[1], line=n)
            reports.append(open_)
            pending.append(open_)
            continue
        m = _AND.match(line)
        if m and open_ is not None:
            open_.accesses.append(Access(m[1], m[2], int(m[3], 16), m[4],
                                         hazards=int(m[5]) if m[5] else None))
            continue
        m = _THREAD.match(line)
        if m and open_ is not None:
            open_.accesses.append(Access(m[1], m[5], int(m[6], 16), m[7], thread=int(m[2])))
            continue
        m = _RESULT.match(line)
        c = _CASE.match(line)
        if m or c:
            for r in pending:
                r.config = ((m[2], m[3] == "True", int(m[4])) if m else
                            ("sanitize", int(c[1]), int(c[2]), c[3]))
            pending, open_ = [], None
            continue
        if not line.strip("= \t"):
            open_ = None
    return reports


# ------------------------------------------------------------------------------------------
# the machine code and the layout

_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_MEM = re.compile(r"\[([^\]]*)\]")
# Which way a shared-memory instruction goes: loads read, stores write; atomics, mbarrier
# operations (SYNCS), bulk and tensor copies and warpgroup MMAs may do either or both.
_READS = ("LDS", "LDSM")
_WRITES = ("STS", "STSM")
_EITHER = ("ATOMS", "SYNCS", "UTMALDG", "UTMASTG", "UTMAREDG", "UBLKCP", "UBLKRED", "HGMMA")


def _opcode(insn: str) -> str:
    """The instruction's opcode with its modifiers (``@!P6 STS.64 [..]`` -> ``STS.64``)."""
    words = insn.split()
    return words[1] if words[0].startswith("@") and len(words) > 1 else words[0]


def directions(insn: str) -> set[str]:
    """{"Read"}, {"Write"}, both, or none (not a shared-memory access) for an instruction."""
    op = _opcode(insn).split(".")[0]
    if op in _READS:
        return {"Read"}
    if op in _WRITES:
        return {"Write"}
    return {"Read", "Write"} if op in _EITHER else set()


def read_sass(text: str) -> list[tuple[int, str]]:
    """(offset, instruction) of the machine code, in order."""
    return [(int(m[1], 16), m[2].strip()) for m in map(_INSN.search, text.splitlines()) if m]


def footprint(insn: str) -> tuple[int, int, bool] | None:
    """(offset, bytes, exact) of the instruction's shared-memory operand: the immediate
    (``[UR4+0x30150]`` -> 0x30150) and the access width (``.U8`` 1, ``.64`` 8, ``.128`` 16,
    else 4); ``exact`` when no per-thread register is added (``[R8+UR5+0x3014c]`` is a
    warp's own byte above 0x3014c, not 0x3014c itself)."""
    m = _MEM.search(insn)
    if m is None:
        return None
    imm = re.findall(r"0x([0-9a-f]+)", m[1])
    op = _opcode(insn)
    width = next((w for suf, w in ((".128", 16), (".64", 8), (".U16", 2), (".S16", 2),
                                   (".U8", 1), (".S8", 1)) if suf in op), 4)
    exact = re.search(r"(?<![U\w])R(?!Z)\d+", m[1]) is None
    return (int(imm[-1], 16) if imm else 0), width, exact


_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "i64": 8, "i32": 4, "i16": 2, "i8": 1, "i1": 1}
_OP = re.compile(r"^\s*(?:(%[\w.]+)(?::\d+)? = )?([a-z_]+\.[\w.]+)")
_OFFSET = re.compile(r"allocation\.offset = (\d+) : i32")
_SIZE = re.compile(r"allocation\.size = (\d+) : i32")
_MEMDESC = re.compile(r"!ttg\.memdesc<([0-9x]+)x([a-z]+\d+),")
_REGION = re.compile(r"^\s*(default \{|partition\d+)")
_SHARED = re.compile(r'"?ttg\.shared"? = (\d+) : i32')


@dataclass
class Area:
    start: int
    end: int
    kind: str  # "kernel" (a local_alloc), "captures", "warp_state", "scratch"
    what: str

    def __str__(self) -> str:
        return f"{self.what} 0x{self.start:x}-0x{self.end:x}"


@dataclass
class Layout:
    areas: list[Area] = field(default_factory=list)
    total: int = 0

    def place(self, start: int | None, width: int = 1) -> tuple[str, str]:
        """(region, what) of the shared bytes [start, start + width): region "kernel" (one of
        the kernel's own buffers), "warp_specialize" (Triton's captures or per-warp state; a
        partition's scratch may share the captures' bytes: every area hit is named),
        "scratch" or "unplaced"."""
        if start is None:
            return "unplaced", "no address (a per-thread register in both operands)"
        hits = [a for a in self.areas if a.start < start + width and start < a.end]
        span = f"0x{start:x}" + (f"-0x{start + width:x}" if width > 1 else "")
        if not hits:
            return "unplaced", f"{span}: in no area of the kernel's layout"
        kinds = {a.kind for a in hits}
        region = ("kernel" if "kernel" in kinds else
                  "warp_specialize" if kinds & {"captures", "warp_state"} else "scratch")
        return region, f"{span} in " + "; ".join(map(str, hits))


def read_layout(mlir: str) -> Layout:
    """The shared-memory areas of a kernel from its TTGIR after Triton's shared-memory
    allocation pass (``allocation.offset`` / ``allocation.size`` on each op that has one)."""
    lay = Layout()
    m = _SHARED.search(mlir)
    lay.total = int(m[1]) if m else 0
    where = ""
    for line in mlir.splitlines():
        r = _REGION.match(line)
        if r:
            where = "default" if r[1].startswith("default") else r[1]
        off = _OFFSET.search(line)
        op = _OP.match(line)
        if off is None or op is None:
            continue
        start, name, kind = int(off[1]), op[1] or "", op[2]
        size = _SIZE.search(line)
        if kind == "ttg.local_alloc":
            md = _MEMDESC.search(line)
            n = 1
            for d in md[1].split("x"):
                n *= int(d)
            bits = _BYTES.get(md[2], 1)
            lay.areas.append(Area(start, start + n * bits, "kernel",
                                  f"{name} ({md[1]}x{md[2]})"))
        elif kind == "tt.func":
            lay.areas.append(Area(start, lay.total, "warp_state",
                                  "warp-specialize state (a byte per worker warp)"))
        elif kind == "ttg.warp_specialize":
            lay.areas.append(Area(start, start + int(size[1]) if size else lay.total,
                                  "captures", "warp-specialize captures"))
        else:
            end = start + (int(size[1]) if size else 1)
            lay.areas.append(Area(start, end, "scratch",
                                  f"scratch of {kind}{' ' + name if name else ''}"
                                  f"{' in ' + where if where else ''}"))
    lay.areas.sort(key=lambda a: (a.start, a.end))
    return lay


def allocated_ir(ttgir_path: Path) -> str:
    """The kernel's TTGIR after Triton's shared-memory allocation (the passes make_llir runs
    up to it, for sm_90)."""
    from triton._C.libtriton import ir, nvidia, passes
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    ctx = ir.context()
    ir.load_dialects(ctx)
    CUDABackend(GPUTarget("cuda", 90, 32)).load_dialects(ctx)
    mod = ir.parse_mlir_module(str(ttgir_path), ctx)
    mod.context = ctx
    pm = ir.pass_manager(ctx)
    passes.ttgpuir.add_combine_tensor_select_and_if(pm)
    passes.ttgpuir.add_allocate_warp_groups(pm, False)
    passes.convert.add_scf_to_cf(pm)
    passes.gluon.add_inliner(pm)
    nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(pm, 90, 90)
    pm.run(mod, "race_trace")
    return str(mod)


# ------------------------------------------------------------------------------------------
# the trace


def _tag(report: Report, acc: Access) -> str | None:
    """The compiled kernel an access of ``report`` is in (compile's tag)."""
    if report.config is None or acc.kernel not in GLUON_KERNELS:
        return None
    fwd = acc.kernel.startswith("_fwd")
    if report.config[0] == "sanitize":
        _, n, d, mode = report.config
        return f"fwd-N{n}-D{d}-{mode}" if fwd else None
    form, causal, hkv = report.config
    return f"{'fwd' if fwd else form}-causal{int(causal)}-hkv{hkv}"


def trace(reports: list[Report], sass_dir: Path, brief: bool = False) -> tuple[str, int]:
    """The Markdown trace of ``reports`` and how many touch the kernel's own buffers or could
    not be placed. ``brief``: each pair of instructions (in the same compiled kernels) shown
    once, with how many reports it has, their addresses and every report's verdict."""
    cache: dict[str, tuple[list, Layout, dict]] = {}
    kernel_of = {path.stem: json.loads(path.read_text()).get("kernel")
                 for path in sorted(sass_dir.glob("*.json"))}

    def code(tag: str):
        if tag not in cache:
            meta = json.loads((sass_dir / f"{tag}.json").read_text())
            lay = read_layout((sass_dir / f"{tag}.alloc.mlir").read_text())
            if lay.total != meta["shared"]:
                raise SystemExit(f"race_trace: {tag}: the allocation's {lay.total} bytes are "
                                 f"not the compiled kernel's {meta['shared']}")
            insns = read_sass((sass_dir / f"{tag}.sass").read_text())
            at = {off: j for j, (off, _) in reversed(list(enumerate(insns)))}
            cache[tag] = (insns, lay, at)  # at: offset -> index of its first instruction
        return cache[tag]

    def fits(tag: str | None, accesses: list[Access]) -> bool:
        """Whether each access lands on a shared-memory instruction of its direction in
        ``tag``'s machine code."""
        if tag is None or not (sass_dir / f"{tag}.sass").is_file():
            return False
        insns, _, at = code(tag)
        return all(acc.offset in at and acc.kind in directions(insns[at[acc.offset]][1])
                   for acc in accesses)

    bad = 0
    entries: dict = {}  # key -> [first report's lines, its reports, their verdicts]
    for i, r in enumerate(reports, 1):
        lines: list[str] = []
        cfg = ("run unknown" if r.config is None else
               "N={1}, D={2}, {3}".format(*r.config) if r.config[0] == "sanitize" else
               "{}, causal={}, hkv={}".format(*r.config))
        head = f"### Report {i} (log line {r.line}; {cfg})"
        if r.address is not None:
            head += f": {r.hazard} at __shared__ 0x{r.address:x}"
        lines += [head, ""]
        # The run a report is in: the log's next "ok"/"BAD" line names it, but
        # compute-sanitizer passes the program's output on late, so a report can sit before
        # the line of an earlier run. Where the named run's machine code does not fit both
        # accesses, every compiled kernel of that name whose code fits is taken instead (a
        # report fails unless each of them places it in the warp-specialize area).
        named = [_tag(r, acc) for acc in r.accesses]
        tags: list[str | None] = [None]
        if len(set(named)) == 1 and fits(named[0], r.accesses):
            tags = named[:1]
        elif len({acc.kernel for acc in r.accesses}) == 1:
            tags = [t for t, k in kernel_of.items()
                    if k == r.accesses[0].kernel and fits(t, r.accesses)] or [None]
            if tags != [None]:
                lines += [f"(the log's run{' ' + named[0] if named[0] else ''} does not fit "
                          f"its offsets; the compiled code that does: "
                          f"{', '.join(f'`{t}`' for t in tags)})", ""]
        verdicts = []
        for n, tag in enumerate(tags):
            got, verdict = _place(r, tag, named, code, sass_dir)
            verdicts += verdict
            if n == 0:
                lines += got
            else:
                lines += [f"- also `{tag}`: {', '.join(verdict)}", ""]
        bad += any(v != "warp_specialize" for v in verdicts)
        lines.append("")
        key = (i,) if not brief else (tuple(tags), tuple(
            (a.kind, a.kernel, a.offset) for a in r.accesses))
        entry = entries.setdefault(key, [lines, [], set()])
        entry[1].append(r)
        entry[2].update(verdicts)
    out: list[str] = []
    for first, same, verdicts in entries.values():
        out += first
        if len(same) > 1:
            addrs = sorted({f"0x{r.address:x}" for r in same if r.address is not None})
            out += [f"(the same instructions in {len(same)} reports, log lines "
                    f"{', '.join(str(r.line) for r in same)}"
                    + (f"; __shared__ {', '.join(addrs)}" if addrs else "")
                    + f"; verdicts: {', '.join(sorted(verdicts))})", "", ""]
    return "\n".join(out), bad


def _place(r: Report, tag: str | None, named: list, code, sass_dir: Path):
    """Markdown lines placing ``r``'s accesses in ``tag``'s code and layout (None: each in
    the kernel the log names, ``named``), and each access's verdict: the layout region,
    "unplaced" or "mismatch"."""
    found = []  # (access, tag, index of its instruction or None, why not)
    for acc, own in zip(r.accesses, named, strict=True):
        t = tag or own
        if t is None or not (sass_dir / f"{t}.sass").is_file():
            what = (t if t else f"{acc.kernel}, not a Gluon kernel"
                    if r.config else "an unknown run")
            found.append((acc, t, None, f"no machine code for {what}"))
            continue
        j = code(t)[2].get(acc.offset)
        found.append((acc, t, j,
                      "" if j is not None else f"no instruction at that offset in {t}.sass"))
    # the bytes both accesses touch: racecheck's address, else the footprint of an access
    # whose operand has no per-thread register
    where: tuple[int, int] | None = None
    if r.address is not None:
        where = (r.address - WINDOW, 1)
    else:
        for _acc, t, j, _why in found:
            fp = None if j is None else footprint(code(t)[0][j][1])
            if fp is not None and fp[2]:
                where = fp[:2]
                break
    lines, verdicts = [], []
    for acc, t, j, why in found:
        who = f"{acc.kind} at {acc.kernel}+0x{acc.offset:x}" + (
            f" ({acc.hazards} hazards)" if acc.hazards else "") + (
            f" by thread {acc.thread}" if acc.thread is not None else "")
        if j is None:
            lines.append(f"- {who}: {why}")
            verdicts.append("unplaced")
            continue
        insns, lay, _ = code(t)
        if acc.kind not in directions(insns[j][1]):
            # the device compiled other code than this (another ptxas release?)
            lines.append(f"- {who} in `{t}`: `{insns[j][1]}` is not a shared-memory "
                         f"{acc.kind.lower()}: is this the machine code the GPU ran?")
            verdicts.append("mismatch")
            continue
        region, what = lay.place(*(where or (None,)))
        verdicts.append(region)
        lines.append(f"- {who} in `{t}`: `{insns[j][1]}` -> {what}")
        lines.append("")
        lines.append("  ```")
        for k in range(max(0, j - CONTEXT), min(len(insns), j + CONTEXT + 1)):
            mark = "  <-" if k == j else ""
            lines.append(f"  /*{insns[k][0]:04x}*/ {insns[k][1]}{mark}")
        lines += ["  ```", ""]
    return lines, verdicts


def compare(local: Path, device: Path) -> tuple[str, int]:
    """Which of ``local``'s kernels (compile's TAG.sass) the device compiled identically
    (an instruction list equal to one of ``device``'s ``*.sass``, session.sh bwdrace's
    dumps): the lines, and how many have no identical device kernel."""
    theirs = {tuple(read_sass(p.read_text(errors="replace"))): p.name
              for p in sorted(device.glob("*.sass"))}
    lines, missing = [], 0
    for p in sorted(local.glob("*.sass")):
        same = theirs.get(tuple(read_sass(p.read_text())))
        missing += same is None
        lines.append(f"{p.stem}: " + (f"identical to the device's {same}" if same else
                                      "no identical kernel among the device's"))
    return "\n".join(lines), missing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile", help="the Gluon kernels of a sanitizer run, for sm_90a")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--ptxas", default=None,
                   help="the ptxas to assemble with (the GPU session's release)")
    c.add_argument("--cases", choices=("check-small", "sanitize"), default="check-small",
                   help="gluon_bwd.py --check-small's (default) or sanitize_cases.py's")
    c.add_argument("--ns", default="128,256", help="with --cases sanitize: its --ns")
    c.add_argument("--ds", default="128", help="with --cases sanitize: its --ds")
    t = sub.add_parser("trace", help="racecheck's reports traced to instructions")
    t.add_argument("log", type=Path, help="racecheck's output of gluon_bwd.py --check-small")
    t.add_argument("--sass", type=Path, required=True, help="compile's --out")
    t.add_argument("--out", type=Path, default=None, help="the Markdown trace (default: stdout)")
    t.add_argument("--brief", action="store_true",
                   help="each pair of instructions once, with its reports' count and addresses")
    k = sub.add_parser("compare", help="is compile's machine code the device's?")
    k.add_argument("local", type=Path, help="compile's --out")
    k.add_argument("device", type=Path, help="the device's SASS (session.sh bwdrace: sass/)")
    args = ap.parse_args(argv)
    if args.cmd == "compare":
        for name, d in (("LOCAL", args.local), ("DEVICE", args.device)):
            if not d.is_dir() or not any(d.glob("*.sass")):
                ap.error(f"{name} must be a directory of .sass files, got {d}")
        text, missing = compare(args.local, args.device)
        print(text)
        return 1 if missing else 0
    if args.cmd == "compile":
        if args.ptxas is not None and not os.access(args.ptxas, os.X_OK):
            ap.error(f"--ptxas must be an executable ptxas, got {args.ptxas!r}")
        try:
            ns, ds = (tuple(int(x) for x in v.split(",")) for v in (args.ns, args.ds))
        except ValueError:
            ap.error(f"--ns and --ds must be integers separated by commas, got {args.ns!r}, "
                     f"{args.ds!r}")
        compile_all(args.out, args.ptxas, args.cases, ns, ds)
        return 0
    try:
        text = args.log.read_text(errors="replace")
    except OSError as e:
        ap.error(f"LOG: cannot read {args.log}: {e}")
    if not args.sass.is_dir():
        ap.error(f"--sass must be a directory of compile's output, got {args.sass}")
    reports = parse_log(text)
    body, bad = trace(reports, args.sass, brief=args.brief)
    metas = sorted(args.sass.glob("*.json"))
    ver = json.loads(metas[0].read_text()) if metas else {}
    head = (f"# racecheck's reports on {args.log.name}, traced to instructions\n\n"
            f"`python3 scripts/gpu/race_trace.py trace {args.log} --sass DIR"
            f"{' --brief' if args.brief else ''}`, DIR from "
            f"`race_trace.py compile --out DIR` (triton {ver.get('triton', '?')}, "
            f"{ver.get('ptxas', 'ptxas ?')}, {ver.get('target', 'sm_90a')}, no GPU).\n\n"
            f"**{bad} of {len(reports)} reports** touch one of the kernel's own buffers, "
            f"cannot be placed, or land on an instruction that does not access shared memory "
            f"as reported; the others touch only Triton's warp-specialize area (the captures "
            f"and the per-warp state bytes).\n\n")
    if args.out is None:
        print(head + body)
    else:
        args.out.write_text(head + body)
        print(head.strip())
    return 1 if bad or not reports else 0


if __name__ == "__main__":
    sys.exit(main())

"""Speed of the Triton kernels beside PyTorch's attention kernels (GPU only).

``python -m kernels.bench [--quick] [--ns N,N] [--rounds R] [--prewarm J] [--out DIR]
[--budget-s S]``;
``flashcheck bench`` calls
:func:`main` with its own argv. In one process, per configuration (dtype in bf16/fp16, D in
64/128, causal or not, N in 1K/4K/16K at a fixed B*H*N = 2^20 tokens, H = 16; ``--quick``:
bf16, D = 128, N = 4K, causal and not), it times:

- this package's FA2 kernel (``kernels.attention``) in the ``"autotune"`` tuning mode
  (``kernels.tuning``; recorded as ``meta["tuning"]``): forward, backward, forward+backward;
  and the same with ``deterministic=False`` (``triton-fa2-atomic``: dQ added inside the
  dK/dV kernel; by bulk reduce-adds of fp32 tiles on sm_90+ unless ``FLASHCHECK_TMA=off``;
  where it applies (triton 3.9, sm_90), the five-product Gluon backward in the form
  ``FLASHCHECK_GLUON_BWD`` names (default "auto": writer; "off": the Triton kernels), and
  the deterministic row its ordered form; recorded as
  ``meta["gluon_bwd"]``; the forward's Gluon mode in ``meta["gluon_fwd"]``);
- SDPA with the flash, cuDNN and efficient backends (``torch.nn.attention.sdpa_kernel``);
- FlexAttention: one ``torch.compile(flex_attention, dynamic=False)`` per process, so each
  shape is compiled exactly once (at its warm-up call); the dynamo recompile limits are
  raised so it never silently falls back to eager, and a row whose warm-up did not compile
  a new graph is marked.

Figures: median time from ``triton.testing.do_bench`` (``--rounds R``: the median of R
such times, each on fresh tensors, the implementations round-robin: :func:`run`); TFLOP/s
with the standard count 4*B*H*Nq*Nk*D (x0.5 causal; backward x2.5; forward+backward x3.5);
peak memory of one forward+backward (``torch.cuda.max_memory_allocated`` after a reset,
minus the inputs).
Output: ``bench_<gpu>.json`` and ``bench_<gpu>.md`` under ``--out`` (default
docs/benchmarks) with the GPU name, driver and versions.

Caveats: a peer that fails or is unsupported becomes a row "n/a: reason"; configurations
not reached within ``--budget-s`` (default 330 s, so that the whole run stays near 6
minutes including start-up) become "n/a: skipped (time budget)". The first call of each
(dtype, D, causal) pays the compilation of the Triton kernels (at most MAX_AUTOTUNE configs
per kernel; later N reuse the binaries, since sequence lengths are not specialised, and only
re-benchmark them for their length bucket); it is made before timing and is not counted.
Compiled kernels are cached on disk by Triton and Inductor, so a second run in the same
environment starts faster. ``--prewarm J`` uses that: J processes first compile every
configuration's Triton and FlexAttention kernels in parallel (untimed; recorded as
``meta["prewarm_s"]``), and the timed process, alone on the GPU, then re-runs the autotune
benchmarks with cached binaries and looks up the compiled graphs. ``--ns`` restricts the
sequence lengths, so that the matrix can be split across runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from flashcheck.kernels import _common

TOKENS = 1 << 20  # B * H * N, fixed so that N = 16K still fits and every row does equal work
HEADS = 16
PASSES = ("fwd", "bwd", "fwd+bwd")
# triton-fa2-atomic: our kernel with deterministic=False (dQ added inside the dK/dV kernel).
PEERS = ("triton-fa2", "triton-fa2-atomic", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient",
         "flex")
# The implementations that compile per shape (--prewarm).
COMPILED = ("triton-fa2", "triton-fa2-atomic", "flex")


def flops(B: int, H: int, Nq: int, Nk: int, D: int, causal: bool, pass_: str) -> float:
    """The standard attention FLOP count: 2 matmuls of 2*Nq*Nk*D each per head forward,
    halved when causal; the backward does 2.5x the forward's work (5 matmuls, one of which
    FA recomputes)."""
    f = 4.0 * B * H * Nq * Nk * D * (0.5 if causal else 1.0)
    return f * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[pass_]


def configurations(quick: bool, ns=(4096, 16384, 1024), ds=(128, 64)) -> list[dict]:
    """Benchmark configurations, most important first (bf16, D=128, N=4K): each length
    ``ns`` (B = TOKENS / (HEADS N)) and head dim ``ds`` in bf16 and fp16, causal and not."""
    out = []
    for n in ns:
        for d in ds:
            for dtype in ("bfloat16", "float16"):
                for causal in (False, True):
                    out.append(dict(dtype=dtype, D=d, causal=causal, N=n,
                                    B=TOKENS // (HEADS * n), H=HEADS))
    if quick:
        out = [c for c in out if c["N"] == 4096 and c["D"] == 128 and c["dtype"] == "bfloat16"]
    return out


def format_table(rows: list[dict], meta: dict) -> str:
    """Markdown table of benchmark rows (one row per configuration, peer and pass)."""
    head = [f"# Attention benchmark on {meta.get('gpu', '?')}", "",
            f"driver {meta.get('driver', '?')}, torch {meta.get('torch', '?')}, "
            f"triton {meta.get('triton', '?')}; tuning {meta.get('tuning', '?')}; "
            f"Gluon forward {meta.get('gluon_fwd', 'auto')}; "
            f"Gluon backward {meta.get('gluon_bwd', 'off')}; "
            f"B*H*N = {TOKENS}, H = {HEADS}; "
            "TFLOP/s = 4*B*H*N^2*D (x0.5 causal, x2.5 bwd, x3.5 fwd+bwd) / median time.", "",
            "| dtype | D | causal | N | B | impl | pass | ms | TFLOP/s | peak MiB | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    if meta.get("rounds", 1) > 1:
        head[2] += (f" {meta['rounds']} rounds: ms is the median, the note gives the rounds'"
                    " range.")
    lines = []
    for r in rows:
        ms = f"{r['ms']:.3f}" if r.get("ms") is not None else "n/a"
        tf = f"{r['tflops']:.1f}" if r.get("tflops") is not None else "n/a"
        mem = f"{r['peak_mib']:.0f}" if r.get("peak_mib") is not None else ""
        note = r.get("note", "")
        if len(r.get("ms_rounds") or ()) > 1:
            span = f"{min(r['ms_rounds']):.3f}-{max(r['ms_rounds']):.3f}"
            note = f"rounds {span}" + (f"; {note}" if note else "")
        lines.append(f"| {r['dtype']} | {r['D']} | {'yes' if r['causal'] else 'no'} | "
                     f"{r['N']} | {r['B']} | {r['impl']} | {r['pass']} | {ms} | {tf} | {mem} | "
                     f"{note} |")
    return "\n".join(head + lines) + "\n"


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_").lower() or "gpu"


def write_outputs(rows: list[dict], meta: dict, out_dir: str | Path) -> tuple[Path, Path]:
    """Write ``bench_<gpu>.json`` and ``bench_<gpu>.md``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"bench_{_slug(meta.get('gpu', 'gpu'))}"
    jp, mp = out / f"{stem}.json", out / f"{stem}.md"
    jp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    mp.write_text(format_table(rows, meta))
    return jp, mp


def na_rows(cfg: dict, impl: str, reason: str) -> list[dict]:
    return [dict(cfg, impl=impl, **{"pass": p}, ms=None, tflops=None, peak_mib=None,
                 note=f"n/a: {reason}") for p in PASSES]


# ----------------------------------------------------------------------------- GPU side


def run_meta() -> dict:
    """The run's GPU, driver, versions, Gluon modes and date (a bench's or a GPU script's JSON)."""
    import triton
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,"
                                 "noheader"], capture_output=True, text=True, timeout=20
                                ).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        driver = "unknown"
    return {"gpu": torch.cuda.get_device_name(), "driver": driver, "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda,
            "gluon_fwd": gluon_fwd_meta(), "gluon_bwd": gluon_bwd_meta(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def gluon_fwd_meta() -> str:
    """The Gluon forward mode as the run took it ("auto" with where it takes the persistent
    grid, "tile", "persistent", "off"), or that this Triton cannot build it and the Triton
    forward ran."""
    from flashcheck.kernels import flash_attention_gluon
    upto = ", ".join(f"to {n} keys at D {d}" for d, n in _common.GLUON_PERSISTENT_MAX_KEYS.items())
    return _gluon_meta(_common.get_gluon(), flash_attention_gluon.AVAILABLE,
                       f"persistent {upto}; per tile above", "no Gluon warp_specialize",
                       "the Triton forward ran")


def gluon_bwd_meta() -> str:
    """The Gluon backward mode as the run took it: the mode ("auto" with the form it takes),
    or where this Triton cannot build the kernel, that the Triton kernels ran in its
    place."""
    from flashcheck.kernels import flash_attention_gluon_bwd
    return _gluon_meta(_common.get_gluon_bwd(), flash_attention_gluon_bwd.AVAILABLE,
                       _common.GLUON_BWD_AUTO, "no Gluon bulk reduce-add",
                       "the Triton kernels ran")


def _gluon_meta(mode: str, available: bool, auto: str, lacks: str, instead: str) -> str:
    """``mode`` as a run took it: "auto (``auto``: what the default takes)", the mode, or
    that this Triton ``lacks`` what it needs and ``instead`` ran."""
    import triton
    if mode == "auto" and available:
        return f"auto ({auto})"
    if mode == "off" or available:
        return mode
    asked = "(the default) not" if mode == "auto" else "asked, not"
    return f"{mode} {asked} available under triton {triton.__version__} ({lacks}): {instead}"


def _peer_fn(impl: str, causal: bool, q):
    """A callable (q, k, v) -> out for one peer, plus a note; raises if unavailable."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if impl == "triton-fa2":
        from flashcheck.kernels import attention
        return (lambda a, b, c: attention(a, b, c, is_causal=causal)), ""
    if impl == "triton-fa2-atomic":
        from flashcheck.kernels.flash_attention import attention_atomic
        return (lambda a, b, c: attention_atomic(a, b, c, is_causal=causal)), \
            "deterministic=False"
    if impl.startswith("sdpa-"):
        backend = {"sdpa-flash": SDPBackend.FLASH_ATTENTION,
                   "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
                   "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}[impl]

        def run(a, b, c):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(a, b, c, is_causal=causal)
        return run, ""
    if impl == "flex":
        from torch.nn.attention.flex_attention import create_block_mask
        compiled = _compiled_flex()
        block_mask = None
        if causal:
            N = q.shape[2]
            block_mask = create_block_mask(lambda b, h, qi, kv: qi >= kv, None, None, N, N,
                                           device=q.device)
        return (lambda a, b, c: compiled(a, b, c, block_mask=block_mask)), ""
    raise ValueError(f"unknown impl {impl!r}")


_FLEX: list = []


def _compiled_flex():
    """``torch.compile(flex_attention, dynamic=False)``, created once per process: every
    shape then compiles once, at its first call, and the graphs are reused."""
    if not _FLEX:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention
        cfg = torch._dynamo.config
        cfg.cache_size_limit = max(cfg.cache_size_limit, 256)
        if hasattr(cfg, "recompile_limit"):
            cfg.recompile_limit = max(cfg.recompile_limit, 256)
        if hasattr(cfg, "accumulated_recompile_limit"):
            cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4096)
        # The backward is timed by replaying one graph (retain_graph=True); compiled autograd
        # graphs that donate their saved buffers refuse that, so donation is turned off.
        import torch._functorch.config as functorch_config
        if hasattr(functorch_config, "donated_buffer"):
            functorch_config.donated_buffer = False
        _FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _FLEX[0]


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def kernel_times(fn, calls: int = 5) -> dict[str, float]:
    """The GPU kernels of ``calls`` calls of ``fn`` by name (``torch.profiler``): ms per
    call each, so that a call's whole time can be read against its kernels'."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key: round(e.device_time_total / 1000 / calls, 3)
            for e in prof.key_averages() if e.device_time_total > 0}


def _bench_one(cfg: dict, impl: str, timed: bool = True) -> list[dict]:
    from triton.testing import do_bench
    dtype = getattr(torch, cfg["dtype"])
    B, H, N, D = cfg["B"], cfg["H"], cfg["N"], cfg["D"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype, generator=gen)
               .requires_grad_() for _ in range(3))
    do = torch.randn(B, H, N, D, device="cuda", dtype=dtype, generator=gen)
    fn, note = _peer_fn(impl, cfg["causal"], q)
    graphs = _compiled_graphs()
    out = fn(q, k, v)  # warm-up: autotuning / compilation, not timed
    out.backward(do)
    torch.cuda.synchronize()
    if not timed:
        return []
    if impl == "flex" and _compiled_graphs() <= graphs:
        note = "not verified compiled: no new dynamo graph for this shape"
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(q, k, v)
    out.backward(do)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    grads = [q, k, v]
    t_f = do_bench(lambda: fn(q, k, v), return_mode="median")
    out = fn(q, k, v)
    t_b = do_bench(lambda: out.backward(do, retain_graph=True), grad_to_none=grads,
                   return_mode="median")
    t_fb = do_bench(lambda: fn(q, k, v).backward(do), grad_to_none=grads, return_mode="median")
    rows = []
    for p, t in zip(PASSES, (t_f, t_b, t_fb), strict=True):
        tf = flops(B, H, N, N, D, cfg["causal"], p) / (t * 1e-3) / 1e12
        rows.append(dict(cfg, impl=impl, **{"pass": p}, ms=t, tflops=tf, peak_mib=peak,
                         note=note))
    return rows


def run(configs: list[dict], budget_s: float, log=print, checkpoint=None,
        rounds: int = 1) -> list[dict]:
    """Time every (configuration, implementation); ``checkpoint(rows)`` is called after each
    configuration, so a run killed from outside keeps what it measured.

    ``rounds`` > 1: each configuration's implementations are timed that many times, round
    by round, every round on fresh tensors and the caching allocator emptied between rows,
    the order of the implementations rotated by one each round (so that no implementation
    always follows the same one). A row's ``ms`` is the median of its rounds', TFLOP/s from
    that; ``ms_rounds`` keeps each round's time. A time that depends on where a row lands
    in the process (its tensors' placement, the rows before it) shows as the spread of
    ``ms_rounds`` instead of deciding the figure."""
    rows: list[dict] = []
    t0 = time.monotonic()
    for cfg in configs:
        if checkpoint is not None and rows:
            checkpoint(rows)
        got: dict[str, list[list[dict]]] = {impl: [] for impl in PEERS}
        for r in range(rounds):
            for impl in PEERS[r % len(PEERS):] + PEERS[:r % len(PEERS)]:
                if got[impl] and got[impl][-1][0]["ms"] is None:
                    continue  # failed or skipped in an earlier round: not retried
                if time.monotonic() - t0 > budget_s:
                    if not got[impl]:
                        got[impl].append(na_rows(cfg, impl, "skipped (time budget)"))
                    continue
                try:
                    one = _bench_one(cfg, impl)
                except Exception as e:  # a peer that fails must not stop the others
                    reason = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
                    one = na_rows(cfg, impl, reason)
                    got[impl] = []  # a failure in any round is the row's verdict
                got[impl].append(one)
                torch.cuda.empty_cache()
        for impl in PEERS:
            merged = merge_rounds(got[impl]) if rounds > 1 else got[impl][0]
            rows += merged
            tf = merged[2]["tflops"]
            log(f"{cfg['dtype']:8s} D={cfg['D']:3d} causal={cfg['causal']!s:5s} N={cfg['N']:5d} "
                f"{impl:15s} fwd+bwd {'n/a' if tf is None else f'{tf:.1f}'} TFLOP/s "
                f"{merged[2]['note']}")
    return rows


def merge_rounds(timed: list[list[dict]]) -> list[dict]:
    """One implementation's rows from its rounds (each a list of :data:`PASSES` rows): the
    median time per pass, TFLOP/s scaled to it, ``ms_rounds`` every round's time. A round
    that failed (``ms`` None) decides the rows by itself."""
    if any(rs[0]["ms"] is None for rs in timed):
        return next(rs for rs in timed if rs[0]["ms"] is None)
    out = []
    for i in range(len(PASSES)):
        each = [rs[i] for rs in timed]
        times = [r["ms"] for r in each]
        ms = statistics.median(times)
        first = each[0]
        out.append(dict(first, ms=ms, tflops=first["tflops"] * first["ms"] / ms,
                        ms_rounds=times))
    return out


def warm(configs: list[dict], shard: int, shards: int) -> None:
    """Compile without timing: this shard's configurations (every ``shards``-th from
    ``shard``) run one forward+backward of each compiled implementation (our kernel in the
    autotune mode, FlexAttention), filling Triton's and Inductor's on-disk caches. The timed
    process then only re-benchmarks the autotune candidates (on a quiet GPU) and looks up the
    compiled graphs."""
    for cfg in configs[shard::shards]:
        for impl in COMPILED:
            try:
                _bench_one(cfg, impl, timed=False)
            except Exception as e:  # noqa: BLE001 - the timed run reports the failure
                print(f"warm {impl} {cfg}: {type(e).__name__}: {e}"[:300], file=sys.stderr)
            torch.cuda.empty_cache()


def prewarm(configs: list[dict], jobs: int, timeout_s: float, quick: bool,
            ns: list[int] | None) -> float:
    """Run :func:`warm` in ``jobs`` subprocesses (compilation is CPU-bound and single-threaded
    per process); returns the seconds it took. A shard that fails or runs past ``timeout_s``
    only leaves its configurations to be compiled by the timed run."""
    t0 = time.monotonic()
    base = [sys.executable, "-m", "flashcheck.kernels.bench", "--out", "unused"]
    if quick:
        base.append("--quick")
    if ns:
        base += ["--ns", ",".join(map(str, ns))]
    # The shards tune on a busy GPU: their autotune results must not be cached for the
    # timed run (which re-tunes alone, with the compiled binaries cached).
    env = dict(os.environ, FLASHCHECK_AUTOTUNE_CACHE="0")
    procs = [subprocess.Popen(base + ["--warm-shard", f"{i}/{jobs}"], env=env)
             for i in range(jobs)]
    for p in procs:
        try:
            p.wait(timeout=max(1.0, timeout_s - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return time.monotonic() - t0


def _ns(text: str) -> list[int]:
    try:
        ns = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated N from 1024, 4096, 16384, "
                                         f"got {text!r}") from None
    bad = [n for n in ns if n not in (1024, 4096, 16384)]
    if bad:
        raise argparse.ArgumentTypeError(f"N must be among 1024, 4096, 16384, got {bad}")
    return ns


def int_in(lo: int, hi: int):
    """An argparse type: an integer from ``lo`` to ``hi``, else an error naming the range."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = lo - 1
        if not lo <= n <= hi:
            raise argparse.ArgumentTypeError(
                f"must be an integer from {lo} to {hi}, got {text!r}")
        return n
    return parse


def _shard(text: str) -> tuple[int, int]:
    try:
        i, j = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be I/J with 0 <= I < J, got {text!r}") from None
    if not 0 <= i < j:
        raise argparse.ArgumentTypeError(f"must be I/J with 0 <= I < J, got {text!r}")
    return i, j


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kernels.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/benchmarks", help="output directory")
    ap.add_argument("--quick", action="store_true",
                    help="bf16, D=128, N=4K, causal and not (2 configurations, < 3 minutes)")
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="stop starting new rows after this many seconds (default 330)")
    ap.add_argument("--ns", type=_ns, default=None, metavar="N,N",
                    help="only these sequence lengths (of 1024, 4096, 16384)")
    ap.add_argument("--prewarm", type=int, default=0, metavar="J",
                    help="first compile every configuration in J parallel processes "
                         "(not timed; 0: compile in the timed process, at each warm-up)")
    ap.add_argument("--prewarm-timeout-s", type=float, default=300.0, metavar="S",
                    help="stop the prewarm processes after S seconds (default 300)")
    ap.add_argument("--rounds", type=int_in(1, 20), default=1, metavar="R",
                    help="time each configuration's implementations R times, round-robin on "
                         "fresh tensors, and report the median (1-20, default 1)")
    ap.add_argument("--warm-shard", type=_shard, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.prewarm < 0:
        print(f"--prewarm must be >= 0, got {args.prewarm}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("kernels.bench needs a CUDA GPU (none found)", file=sys.stderr)
        return 2
    if not math.isfinite(args.budget_s) or args.budget_s <= 0:
        print("--budget-s must be > 0", file=sys.stderr)
        return 2
    from flashcheck import kernels
    configs = [c for c in configurations(args.quick) if not args.ns or c["N"] in args.ns]
    if args.warm_shard is not None:
        with kernels.tuning("autotune"):
            warm(configs, *args.warm_shard)
        return 0
    meta = run_meta()
    meta["quick"] = args.quick
    meta["tuning"] = "autotune"
    meta["rounds"] = args.rounds
    if args.prewarm > 0:
        meta["prewarm_s"] = round(prewarm(configs, args.prewarm, args.prewarm_timeout_s,
                                          args.quick, args.ns), 1)
        print(f"prewarm: {meta['prewarm_s']} s in {args.prewarm} processes", flush=True)
    with kernels.tuning("autotune"):
        rows = run(configs, args.budget_s,
                   checkpoint=lambda rows: write_outputs(rows, meta, args.out),
                   rounds=args.rounds)
    jp, mp = write_outputs(rows, meta, args.out)
    print(f"wrote {jp} and {mp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Long-sequence check: the Triton kernel against the float64 oracle at Nq = Nk = 65536.

For one head (B = H = 1), D = 128, each dtype of ``--dtypes`` (bf16, fp16) and each of
non-causal / causal, this runs ``kernels.attention`` forward and backward, then
``reference.attention_fp64`` forward and backward on the same inputs upcast to float64
(on the same device: fp64 on the GPU), and reports per tensor (out, dq, dk, dv):

- ``max_abs``, ``rmse`` against the oracle; ``rel_max`` = max_abs / max|ref| and
  ``rel_rmse`` = rmse / rms(ref), the error relative to the tensor's magnitude;
- ``scale_rms`` = rms(ref)·(u + u_a·√L), a u·√-type a-priori error scale (not a bound),
  and ``ratio_scale`` = rmse / scale_rms. Derivation: each element of out/dq/dk/dv is an
  L-term fp32 sum (L = Nk for out and dq, Nq for dk and dv) of products whose P or dS
  factor was rounded to the input dtype (relative u each, independent signs, so about u
  relative to the sum's RMS), the result is rounded to the input dtype once more (u), and
  fp32 accumulation adds about u_a·√L (probabilistic rounding-error analysis). A correct
  kernel sits at ratio_scale of order 1; a bug shows as orders of magnitude more;
- for ``out`` also the rigorous a-priori bound of ``reference.emulate_error_bound``
  (worst case, so at this N mostly the 10·N·u_a accumulation allowance) and
  ``ratio_bound`` = max_abs / bound, which must stay <= 1;
- the same-precision baseline when cheap: PyTorch SDPA in the input dtype with an O(N)
  memory backend (flash, else memory-efficient; the math backend only if ``--n`` is small
  enough, see ``MATH_MAX_N``), its max_abs/rmse against the oracle, and ``ratio_base`` =
  kernel max_abs / baseline max_abs. The emulated online model is not run at this size.

It also reports the wall time of the kernel's forward and backward (the last of
``--kernel-repeats`` calls; the first includes compilation and autotuning and is reported
as ``first_call_s``) and of the oracle's (after a tiny warm-up call), the
oracle's peak GPU memory (``torch.cuda.max_memory_allocated``, absolute and above what was
allocated before it started, float64 copies of the inputs included) and the host's peak
RSS. It prints a table as it goes and rewrites the JSON at ``--out`` after every
configuration, so a run cut short keeps what it finished. A configuration that raises is
recorded with its error and the run goes on; the exit status is 1 if any configuration
failed (error, non-finite values, or out above its rigorous bound), else 0.

Run on the GPU:  python scripts/gpu/long_seq.py --out long_seq.json
CPU (tiny, Triton interpreter, fp16 only):
    TRITON_INTERPRET=1 python scripts/gpu/long_seq.py --device cpu --n 256 --dtypes float16

Caveats: the inputs are N(0, 1) (dO too), drawn on the CPU from ``--seed``, so the
scores are small and diffuse; this is a size test, not an adversarial one. bf16 is not run
on the CPU (the Triton interpreter's bf16 arithmetic is wrong: the kernel's ``not_run``
capability). The oracle does not skip fully masked blocks, so causal costs it as much as
non-causal.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import resource
import sys
import time
import traceback

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11}  # 8 and 11 significand bits
U_ACC = 2.0**-24  # fp32 accumulation
TENSORS = ("out", "dq", "dk", "dv")
# The math backend materialises the (N, N) scores in the input dtype several times over
# (scores, softmax, their gradients): 8·N² bytes at N = 16384 is 2 GiB, cheap; at 65536
# it is 32 GiB, not cheap.
MATH_MAX_N = 16384


def log(msg: str) -> None:
    print(msg, flush=True)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _host_peak_rss_mib() -> float:
    # Linux reports ru_maxrss in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _ratio(a: float, b: float) -> float:
    """a / b, with 0/0 = 0 and a/0 = inf (an error where the yardstick is exact)."""
    if b > 0:
        return a / b
    return 0.0 if a == 0 else math.inf


def tensor_errors(got: torch.Tensor, want: torch.Tensor, *, u: float, length: int) -> dict:
    """Error statistics of ``got`` against the float64 ``want`` (see the module docstring)."""
    err = (got.to(torch.float64) - want).abs()
    finite = bool(torch.isfinite(got).all())
    max_abs = float(err.max())
    rmse = float(torch.sqrt((err * err).mean()))
    max_ref = float(want.abs().max())
    rms_ref = float(torch.sqrt((want * want).mean()))
    scale_rms = rms_ref * (u + U_ACC * math.sqrt(length))
    return {
        "finite": finite, "max_abs": max_abs, "rmse": rmse, "max_ref": max_ref,
        "rms_ref": rms_ref,
        "rel_max": _ratio(max_abs, max_ref), "rel_rmse": _ratio(rmse, rms_ref),
        "scale_rms": scale_rms, "ratio_scale": _ratio(rmse, scale_rms),
    }


def _inputs(n: int, d: int, dtype: torch.dtype, seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 1, n, d, generator=g).to(dtype).to(device) for _ in range(4)]


def _fwd_bwd(fn, q, k, v, do, device: str) -> tuple[dict, dict]:
    """Run ``fn`` forward and backward on fresh leaves; results detached, and the timings."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    _sync(device)
    t0 = time.perf_counter()
    out = fn(*leaves)
    _sync(device)
    t1 = time.perf_counter()
    grads = torch.autograd.grad(out, leaves, do)
    _sync(device)
    t2 = time.perf_counter()
    res = dict(zip(TENSORS, (out.detach(), *grads), strict=True))
    return res, {"fwd_s": t1 - t0, "bwd_s": t2 - t1}


def _sdpa_baseline(q, k, v, do, causal: bool, device: str):
    """SDPA in the input dtype with the first backend that runs; (results, backend name)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    if q.shape[2] <= MATH_MAX_N:
        backends.append(SDPBackend.MATH)
    reasons = []
    for b in backends:
        try:
            with sdpa_kernel(b):
                res, _ = _fwd_bwd(
                    lambda a, b_, c: torch.nn.functional.scaled_dot_product_attention(
                        a, b_, c, is_causal=causal),
                    q, k, v, do, device,
                )
            return res, b.name
        except RuntimeError as e:  # backend not available for these inputs
            reasons.append(f"{b.name}: {str(e).splitlines()[0][:120]}")
    return None, "none (" + "; ".join(reasons) + ")"


def _warm_up_oracle(d: int, device: str) -> None:
    """A tiny float64 forward and backward, so that library start-up is not timed."""
    from flashcheck import reference

    q, k, v, do = (t.to(torch.float64) for t in _inputs(8, d, torch.float32, 0, device))
    _fwd_bwd(reference.attention_fp64, q, k, v, do, device)


def run_config(n: int, d: int, dtype_name: str, causal: bool, *, device: str, seed: int,
               baseline: bool, kernel_repeats: int = 2) -> dict:
    """One (dtype, causal) configuration: kernel, baseline, oracle; the result record."""
    from flashcheck import kernels, reference

    rec = {"n": n, "d": d, "dtype": dtype_name, "causal": causal, "device": device}
    reason = kernels.attention.capabilities.get("not_run", {}).get(
        torch.device(device).type, {}).get(dtype_name)
    if reason:
        rec.update(status="not_run", reason=reason)
        return rec
    dtype = DTYPES[dtype_name]
    u = UNIT_ROUNDOFF[dtype_name]
    q, k, v, do = _inputs(n, d, dtype, seed, device)

    def kernel(a, b, c):
        return kernels.attention(a, b, c, is_causal=causal)

    for i in range(kernel_repeats):
        # The first call includes Triton's compilation and autotuning; the last one is timed.
        got, rec["kernel"] = _fwd_bwd(kernel, q, k, v, do, device)
        if i == 0:
            first = rec["kernel"]
    rec["kernel"]["first_call_s"] = first["fwd_s"] + first["bwd_s"]
    base = None
    if baseline:
        base, rec["baseline_backend"] = _sdpa_baseline(q, k, v, do, causal, device)

    _warm_up_oracle(d, device)
    on_cuda = device.startswith("cuda")
    if on_cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        alloc0 = torch.cuda.memory_allocated()
    q64, k64, v64, do64 = (t.to(torch.float64) for t in (q, k, v, do))
    want, rec["oracle"] = _fwd_bwd(
        lambda a, b, c: reference.attention_fp64(a, b, c, is_causal=causal),
        q64, k64, v64, do64, device,
    )
    del q64, k64, v64, do64
    if on_cuda:
        peak = torch.cuda.max_memory_allocated()
        rec["oracle"]["gpu_peak_mib"] = peak / 2**20
        rec["oracle"]["gpu_extra_peak_mib"] = (peak - alloc0) / 2**20
    rec["host_peak_rss_mib"] = _host_peak_rss_mib()

    tensors = {}
    for name in TENSORS:
        length = n  # Nq = Nk = n: the sum length is n for every tensor here
        t = tensor_errors(got[name], want[name], u=u, length=length)
        if base is not None:
            b = tensor_errors(base[name], want[name], u=u, length=length)
            t["base_max_abs"], t["base_rmse"] = b["max_abs"], b["rmse"]
            t["ratio_base"] = _ratio(t["max_abs"], b["max_abs"])
        tensors[name] = t
    qn = q.to(torch.float64).norm(dim=-1).max()
    kn = k.to(torch.float64).norm(dim=-1).max()
    bound = reference.emulate_error_bound(
        dtype, D=d, N=n, score_abs_max=float(qn * kn) / math.sqrt(d),
        v_abs_max=float(v.to(torch.float64).abs().max()),
    )
    tensors["out"]["bound"] = bound
    tensors["out"]["ratio_bound"] = _ratio(tensors["out"]["max_abs"], bound)
    rec["tensors"] = tensors
    failed = (not all(t["finite"] for t in tensors.values())
              or tensors["out"]["ratio_bound"] > 1)
    rec["status"] = "fail" if failed else "ok"
    return rec


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2e}"


def print_record(rec: dict) -> None:
    head = f"{rec['dtype']:8s} causal={str(rec['causal']):5s} N={rec['n']} D={rec['d']}"
    if rec["status"] in ("not_run", "error"):
        log(f"{head}  {rec['status']}: {rec.get('reason') or rec.get('error')}")
        return
    o, kt = rec["oracle"], rec["kernel"]
    mem = (f" gpu peak {o['gpu_peak_mib']:.0f} MiB (+{o['gpu_extra_peak_mib']:.0f})"
           if "gpu_peak_mib" in o else "")
    log(f"{head}  {rec['status']}  kernel fwd {kt['fwd_s']:.3f}s bwd {kt['bwd_s']:.3f}s "
        f"(first call {kt['first_call_s']:.1f}s) | "
        f"oracle fwd {o['fwd_s']:.3f}s bwd {o['bwd_s']:.3f}s{mem} | "
        f"host peak RSS {rec['host_peak_rss_mib']:.0f} MiB | "
        f"baseline: {rec.get('baseline_backend', 'off')}")
    log(f"  {'tensor':6s} {'max_abs':>9s} {'rmse':>9s} {'rel_max':>9s} {'rel_rmse':>9s} "
        f"{'rmse/scl':>9s} {'base_max':>9s} {'k/base':>9s} {'max/bnd':>9s}")
    for name, t in rec["tensors"].items():
        log(f"  {name:6s} {_fmt(t['max_abs']):>9s} {_fmt(t['rmse']):>9s} "
            f"{_fmt(t['rel_max']):>9s} {_fmt(t['rel_rmse']):>9s} {_fmt(t['ratio_scale']):>9s} "
            f"{_fmt(t.get('base_max_abs')):>9s} {_fmt(t.get('ratio_base')):>9s} "
            f"{_fmt(t.get('ratio_bound')):>9s}"
            + ("" if t["finite"] else "  NON-FINITE"))


def _meta(device: str) -> dict:
    meta = {"torch": torch.__version__, "python": platform.python_version(), "device": device}
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    if device.startswith("cuda"):
        meta["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return meta


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=65536, help="Nq = Nk (default 65536)")
    ap.add_argument("--d", type=int, default=128, help="head dim (default 128)")
    ap.add_argument("--dtypes", default="bfloat16,float16",
                    help="comma-separated subset of bfloat16,float16")
    ap.add_argument("--causal", choices=("both", "false", "true"), default="both")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-baseline", action="store_true", help="skip the SDPA baseline")
    ap.add_argument("--kernel-repeats", type=int, default=2,
                    help="kernel fwd+bwd calls per configuration; the last is timed (default 2)")
    ap.add_argument("--out", default="long_seq.json", help="JSON output path")
    args = ap.parse_args(argv)
    if args.n < 1 or args.d < 1 or args.kernel_repeats < 1:
        ap.error(f"--n, --d, --kernel-repeats: expected ints >= 1; got {args.n}, {args.d}, "
                 f"{args.kernel_repeats}")
    args.dtypes = [s.strip() for s in args.dtypes.split(",") if s.strip()]
    bad = [s for s in args.dtypes if s not in DTYPES]
    if bad or not args.dtypes:
        ap.error(f"--dtypes: expected a comma-separated subset of {tuple(DTYPES)}; got {bad}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device: CUDA is not available here; use --device cpu (tiny N)")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        ap.error("--device cpu: run with TRITON_INTERPRET=1 (the Triton interpreter)")
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    causals = {"both": (False, True), "false": (False,), "true": (True,)}[args.causal]
    doc = {"meta": _meta(args.device), "results": []}
    log(f"long_seq: N={args.n} D={args.d} dtypes={args.dtypes} device={args.device} "
        f"{doc['meta']}")
    for dtype_name in args.dtypes:
        for causal in causals:
            try:
                rec = run_config(args.n, args.d, dtype_name, causal, device=args.device,
                                 seed=args.seed, baseline=not args.no_baseline,
                                 kernel_repeats=args.kernel_repeats)
            except Exception as e:  # record and go on with the next configuration
                rec = {"n": args.n, "d": args.d, "dtype": dtype_name, "causal": causal,
                       "device": args.device, "status": "error",
                       "error": f"{type(e).__name__}: {e}",
                       "traceback": traceback.format_exc()}
                log(rec["traceback"])
            finally:
                gc.collect()
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
            doc["results"].append(rec)
            print_record(rec)
            with open(args.out, "w") as f:
                json.dump(doc, f, indent=1)
    bad = [r for r in doc["results"] if r["status"] in ("error", "fail")]
    log(f"wrote {args.out}: {len(doc['results'])} configurations, {len(bad)} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

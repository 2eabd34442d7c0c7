"""The kernel plug-in: turn a spec string or a callable into a :class:`Kernel`.

Spec forms (:func:`resolve_kernel`):

- ``MODULE:ATTR`` — ``importlib.import_module(MODULE).ATTR``;
- ``path/to/file.py:ATTR`` — the file is loaded by path under a unique module name;
- built-in names: ``triton``, ``triton-fa1`` (``kernels.attention`` /
  ``kernels.attention_fa1``), ``reference`` (``reference.attention_fp64`` run in float64 and
  its result rounded to the input dtype — a kernel returning the input dtype, the best any
  kernel can do), ``online`` (``reference.online_attention``, ``precision="emulate"``),
  ``sdpa-math``, ``sdpa-flash``, ``sdpa-efficient``, ``sdpa-cudnn`` (torch SDPA pinned to one
  backend with ``torch.nn.attention.sdpa_kernel``), ``flex`` (FlexAttention with the mask as
  a dense additive ``score_mod``; compiled with ``torch.compile`` on CUDA, eager on the CPU).

A bad spec raises :class:`SpecError` (a ValueError) with one line; the CLI maps it to exit 2.

A :class:`Kernel` knows its capabilities: the callable's declared ``capabilities`` dict
(docs/contracts.md §2; validated, a bad entry is a SpecError naming the key), and for every
feature it does not declare a probe on small cases inside the declared rules (sequence
multiple, head dims, layouts, ``supports``). A *clear* exception (ValueError,
NotImplementedError, TypeError, or a RuntimeError whose message says "not supported"/"No
available kernel"/...) means "outside the domain" and its text is the reason reported as "not
run: reason". A feature is taken out only when a second, larger probe shape is rejected too;
a real case the kernel rejects clearly is "not run" by itself (verify.check). Any other
exception leaves the feature in the domain, so the real case then fails as "raised" instead
of being silently skipped. Probes are cached per (spec, device).

:meth:`Kernel.call` expresses a case through the arguments the kernel takes: window and
bottom-right causal alignment (and ``is_causal`` together with a mask, which SDPA rejects)
are folded into ``attn_mask`` with ``reference.masks.structural_mask`` when the kernel lacks
the extension; bool masks become additive (-inf) ones for kernels that take only those.

Caveats: probing runs the kernel (a few tiny calls per feature, lazily). The ``flex`` adapter
passes the mask as a dense (B, Hq, Nq, Nk) bias captured by ``score_mod``, so it tests
FlexAttention's score path, not its block-sparse path.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import logging
import math
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from flashcheck.verify.capabilities import (
    backward_declared,
    call_supports,
    check_capabilities,
    domain_reason,
    head_dim_reason,
    probe_shape,
)
from flashcheck.verify.cases import MAX_HEAD_DIM, Case, Inputs
from flashcheck.verify.ragged import call_ragged
from flashcheck.verify.ragged import peer as ragged_peer

__all__ = [
    "BUILTINS", "SpecError", "Kernel", "resolve_kernel", "as_kernel", "describe_exception",
    "is_clear_rejection", "check_domain_guard", "GuardFinding", "HEAD_DIM_SAMPLE",
]

HEAD_DIM_SAMPLE = (1, 16, 40, 64, 111, 128, 256)
PROBE_DTYPES = ("float16", "bfloat16", "float32")
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_CLEAR_RUNTIME = (
    "not supported", "no available kernel", "no viable backend", "not implemented", "unsupported",
    "only supports", "is not available", "expected all tensors to be on the same device",
    "must be", "requires", "does not require grad", "should not be set",
)
_SDPA_BACKENDS = {
    "sdpa-math": "MATH",
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
}
# Built-ins of the varlen and decode APIs (verify/ragged.py): ours and PyTorch peers.
RAGGED_BUILTINS = ("triton-varlen", "triton-decode", "sdpa-varlen", "flex-varlen",
                   "sdpa-decode")
BUILTINS = ("triton", "triton-fa1", "reference", "online", *_SDPA_BACKENDS, "flex",
            *RAGGED_BUILTINS)


class SpecError(ValueError):
    """A kernel spec that cannot be resolved (one line; the CLI exits 2)."""


def describe_exception(exc: BaseException) -> str:
    """``Type: message (file:line in func)`` — type, first message line, last frame."""
    msg = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {msg[0] if msg else ''}".rstrip(": ")
    tb = traceback.extract_tb(exc.__traceback__)
    if tb:
        f = tb[-1]
        text += f" ({os.path.basename(f.filename)}:{f.lineno} in {f.name})"
    return text


def kernel_source_root(kernel) -> str | None:
    """Where the kernel's own code lives, for "the innermost frame in the kernel's code": the
    directory of the file defining its callable, or that file alone when it is the harness's
    own (a built-in adapter in verify/). None when there is no source file."""
    fn = getattr(kernel, "fn", kernel)
    owner = getattr(fn, "__self__", None)  # ``_Attention.apply``: the class's module
    fn = owner if isinstance(owner, type) else inspect.unwrap(fn)
    try:
        path = inspect.getsourcefile(fn) or inspect.getfile(fn)
    except TypeError:
        mod = sys.modules.get(getattr(fn, "__module__", "") or "")
        path = getattr(mod, "__file__", None)
    if not path:
        return None
    path = os.path.abspath(path)
    here = os.path.dirname(os.path.abspath(__file__))
    return path if os.path.dirname(path) == here else os.path.dirname(path) + os.sep


def exception_info(exc: BaseException, root: str | None, where: str) -> dict:
    """Type, first message line and innermost frame inside ``root`` (the kernel's code; the
    last frame when none is) of an exception: what root-cause deduplication compares."""
    msg = str(exc).strip().splitlines()
    frames = traceback.extract_tb(exc.__traceback__)
    inner = [f for f in frames if root and os.path.abspath(f.filename).startswith(root)]
    f = (inner or frames or [None])[-1]
    frame = f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}" if f is not None else "?"
    return {"type": type(exc).__name__, "message": msg[0] if msg else "", "frame": frame,
            "where": where}


def is_clear_rejection(exc: BaseException) -> bool:
    """True for an exception that means "outside the domain" (not a crash)."""
    if isinstance(exc, (ValueError, NotImplementedError, TypeError)):
        return True
    if isinstance(exc, RuntimeError):
        low = str(exc).lower()
        return any(s in low for s in _CLEAR_RUNTIME)
    return False


# ------------------------------------------------------------------------------------------
# spec resolution


def _load_file(path: str, spec: str):
    if not os.path.isfile(path):
        raise SpecError(f"kernel spec {spec!r}: file {path!r} does not exist")
    digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
    name = f"flashcheck_kernel_{digest}"
    mod_spec = importlib.util.spec_from_file_location(name, path)
    if mod_spec is None or mod_spec.loader is None:
        raise SpecError(f"kernel spec {spec!r}: cannot load {path!r} as a Python module")
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[name] = module
    try:
        mod_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise SpecError(f"kernel spec {spec!r}: importing {path!r} failed: "
                        f"{describe_exception(e)}") from None
    return module


def add_search_paths(paths=()) -> list[str]:
    """Make ``MODULE:ATTR`` resolve as uvicorn and pytest resolve it: from the working
    directory first, then each of ``paths`` (``--path DIR``), ahead of site-packages. Our
    own code lives under the one name ``flashcheck``, so a kernel repository's own
    ``verify/``, ``reference/`` or ``kernels/`` packages shadow nothing of ours. Returns
    ``paths`` made absolute."""
    dirs = [os.path.abspath(p) for p in paths]
    for d in (*reversed(dirs), os.getcwd()):
        if not os.path.isdir(d):
            raise SpecError(f"--path {d!r}: not a directory")
        if d not in sys.path:
            sys.path.insert(0, d)
    return dirs


def _import(modname: str, spec: str):
    try:
        return importlib.import_module(modname)
    except ModuleNotFoundError as e:
        raise SpecError(f"kernel spec {spec!r}: module {e.name or modname!r} not found") from None
    except Exception as e:
        raise SpecError(f"kernel spec {spec!r}: importing {modname!r} failed: "
                        f"{describe_exception(e)}") from None


def _attr(obj, attr: str, spec: str, where: str):
    target = obj
    for part in attr.split("."):
        if not hasattr(target, part):
            raise SpecError(f"kernel spec {spec!r}: {where} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise SpecError(f"kernel spec {spec!r}: {attr!r} in {where} is not callable")
    return target


def _triton(name: str, spec: str):
    pkg = _import("flashcheck.kernels", spec)
    if not hasattr(pkg, name):
        pkg = _import(f"flashcheck.kernels.{name}", spec)
        return _attr(pkg, "attention", spec, f"module kernels.{name}")
    obj = getattr(pkg, name)
    if inspect.ismodule(obj):
        return _attr(obj, "attention", spec, f"module kernels.{name}")
    return obj


def _reference_kernel():
    ref = _import("flashcheck.reference", "reference")

    def reference(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                  scale=None, enable_gqa=False, *, window=None, causal_alignment="top_left"):
        out = ref.attention_fp64(
            query.to(torch.float64), key.to(torch.float64), value.to(torch.float64),
            attn_mask=attn_mask if attn_mask is None or attn_mask.dtype == torch.bool
            else attn_mask.to(torch.float64),
            dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
            window=window, causal_alignment=causal_alignment,
        )
        return out.to(query.dtype)

    reference.capabilities = {
        "extensions": ("window", "causal_alignment"), "backward": True, "gqa": True,
        "masks": ("bool", "additive"),
    }
    return reference


def _online_kernel():
    ref = _import("flashcheck.reference", "online")
    if not hasattr(ref, "online_attention"):  # exported from its module only
        ref = _import("flashcheck.reference.online", "online")

    def online(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
               scale=None, enable_gqa=False, *, window=None, causal_alignment="top_left"):
        return ref.online_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
            scale=scale, enable_gqa=enable_gqa, window=window,
            causal_alignment=causal_alignment, precision="emulate", order="fa2",
        )

    online.capabilities = {
        "extensions": ("window", "causal_alignment"), "backward": True, "gqa": True,
        "masks": ("bool", "additive"),
    }
    return online


# The opt-in family members PyTorch's CPU flash SDPA kernel makes (reference/family.py).
CPU_FLASH_FAMILY = ("bwd_scores_k16", "grads_input_dtype", "fwd_fast_exp", "bwd_k_prescaled")


def _sdpa_kernel(backend_name: str, device: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
            )

    sdpa.capabilities = {"extensions": (), "causal_with_mask": False}
    if backend_name == "MATH":  # Q and K each times √scale in fp32 (reference/family.py)
        sdpa.capabilities["family"] = ("qk_sqrt_scaled",)
    elif backend_name == "EFFICIENT_ATTENTION":  # fp32 GEMMs as 3xTF32 (reference/family.py)
        sdpa.capabilities["family"] = ("fp32_3xtf32",)
    elif backend_name == "FLASH_ATTENTION" and not str(device).startswith("cuda"):
        # PyTorch's CPU flash kernel recomputes the backward's scores with its own GEMM
        # blocking, keeps dQ/dK/dV in the inputs' dtype between tiles and, below fp32,
        # exponentiates the forward's scores with a fast vectorised exp (as sdpa-varlen,
        # which runs it per sequence: verify/ragged.py)
        sdpa.capabilities["family"] = CPU_FLASH_FAMILY
    return sdpa


def run_compiled(fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` with Dynamo's recompile limit an error, never a silent switch
    to eager code.

    Dynamo keeps at most ``recompile_limit`` graphs of a function (8 by default) and
    ``accumulated_recompile_limit`` in all (256); past either it runs the function eagerly
    without a word. A campaign's worker meets hundreds of shapes, so a ``torch.compile``d
    kernel (FlexAttention: one graph per shape, dtype and scale) would be checked on its
    eager path from the ninth shape on. Here reaching a limit raises; Dynamo's caches are
    then reset (the process's: in a worker, the kernel's) and ``fn`` is called again,
    compiled. Dynamo's warning on reaching the limit is dropped for the call (handled here,
    it would be noise in a campaign's log). Every call of a kernel under test goes through
    this (:meth:`Kernel.call`, the probes); where nothing imported Dynamo it is a plain
    call."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:  # nothing in this process can have been compiled
        return fn(*args, **kwargs)
    log = logging.getLogger(_DYNAMO_LIMIT_LOGGER)
    outermost = _HANDLED_LIMIT not in log.filters
    if outermost:
        log.addFilter(_HANDLED_LIMIT)
    try:
        with dynamo.config.patch(fail_on_recompile_limit_hit=True):
            try:
                return fn(*args, **kwargs)
            except dynamo.exc.FailOnRecompileLimitHit:
                dynamo.reset()
                return fn(*args, **kwargs)
    finally:
        if outermost:
            log.removeFilter(_HANDLED_LIMIT)


# Dynamo warns on reaching a recompile limit ("torch._dynamo hit config.recompile_limit ...",
# ten lines to stderr) before raising; inside run_compiled that is handled (reset, compiled
# again), so the warning is dropped there and only there; elsewhere Dynamo warns as ever.
_DYNAMO_LIMIT_LOGGER = "torch._dynamo.convert_frame"


class _HandledLimitWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("torch._dynamo hit config.")


_HANDLED_LIMIT = _HandledLimitWarning()


def compiled_static(fn: Callable, backend: str | Callable = "inductor") -> Callable:
    """``torch.compile(fn, dynamic=False, fullgraph=True)``: one graph per shape, and a graph
    break an error rather than a fall back to eager code for part of it. Called as a kernel
    under test (through :func:`run_compiled`, as :meth:`Kernel.call` does), every call runs
    compiled however many shapes its worker has met."""
    return torch.compile(fn, dynamic=False, fullgraph=True, backend=backend)


# FlexAttention's compiled kernels take head dims from 16 (its lowering refuses E < 16).
FLEX_CUDA_HEAD_DIMS = (16, MAX_HEAD_DIM)


def _flex_kernel(device: str):
    from torch.nn.attention.flex_attention import flex_attention

    run = compiled_static(flex_attention) if device.startswith("cuda") else flex_attention

    def flex(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        if dropout_p != 0.0:
            raise NotImplementedError(f"flex: dropout_p must be 0.0, got {dropout_p}")
        B, Hq, Nq, _ = query.shape
        Nk = key.shape[2]
        bias = torch.zeros(1, 1, Nq, Nk, dtype=torch.float32, device=query.device)
        if is_causal:
            tri = torch.ones(Nq, Nk, dtype=torch.bool, device=query.device).tril()
            bias = bias.masked_fill(~tri, -math.inf)
        if attn_mask is not None:
            add = (torch.zeros_like(attn_mask, dtype=torch.float32).masked_fill(
                ~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else attn_mask.float())
            bias = bias + add
        bias = bias.expand(B, Hq, Nq, Nk).contiguous()

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[b, h, q_idx, kv_idx]

        return run(query, key, value, score_mod=score_mod, scale=scale, enable_gqa=enable_gqa)

    flex.capabilities = {"extensions": ()}
    if device.startswith("cuda"):
        flex.capabilities["head_dims"] = FLEX_CUDA_HEAD_DIMS
    else:
        # eager, not compiled: an unfused softmax, then P@V (reference/family.py)
        flex.capabilities["family"] = ("p_normalized",)
    return flex


def _builtin(name: str, device: str) -> Callable:
    if name == "triton":
        return _triton("attention", name)
    if name == "triton-fa1":
        return _triton("attention_fa1", name)
    if name == "reference":
        return _reference_kernel()
    if name == "online":
        return _online_kernel()
    if name in _SDPA_BACKENDS:
        return _sdpa_kernel(_SDPA_BACKENDS[name], device)
    if name in ("triton-varlen", "triton-decode"):
        return _triton("attention_" + name.removeprefix("triton-"), name)
    if name in RAGGED_BUILTINS:
        return ragged_peer(name, device)
    return _flex_kernel(device)


def resolve_kernel(spec: str, device: str) -> Kernel:
    """The :class:`Kernel` named by ``spec`` (see the module docstring) on ``device``."""
    if not isinstance(spec, str) or not spec.strip():
        raise SpecError(f"kernel spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if spec in BUILTINS:
        return Kernel(name=spec, spec=spec, fn=_builtin(spec, device), device=device)
    if ":" not in spec:
        raise SpecError(f"kernel spec {spec!r}: expected MODULE:ATTR, path/to/file.py:ATTR "
                        f"or one of {', '.join(BUILTINS)}")
    where, attr = spec.rsplit(":", 1)
    if not where or not attr:
        raise SpecError(f"kernel spec {spec!r}: both sides of ':' must be non-empty")
    if where.endswith(".py") or os.sep in where or "/" in where:
        fn = _attr(_load_file(where, spec), attr, spec, f"file {where!r}")
    else:
        add_search_paths()  # a user's module: from the working directory (ours never need it)
        fn = _attr(_import(where, spec), attr, spec, f"module {where!r}")
    return Kernel(name=attr.split(".")[-1], spec=spec, fn=fn, device=device)


def as_kernel(kernel, device: str) -> Kernel:
    """A :class:`Kernel` from a Kernel, a spec string, or a bare callable."""
    if isinstance(kernel, Kernel):
        return kernel
    if isinstance(kernel, str):
        return resolve_kernel(kernel, device)
    if callable(kernel):
        name = getattr(kernel, "__name__", type(kernel).__name__)
        spec = f"{getattr(kernel, '__module__', '?')}:{getattr(kernel, '__qualname__', name)}"
        return Kernel(name=name, spec=spec, fn=kernel, device=device)
    raise SpecError(f"kernel must be a spec string or a callable, got {type(kernel).__name__}")


# ------------------------------------------------------------------------------------------
# the Kernel object

_PROBE_CACHE: dict[tuple[str, str, str], str | None] = {}
# The mask each attn_mask kind is probed with.
_PROBE_MASKS = {"bool": {"kind": "random", "density": 0.5},
                "additive": {"kind": "bias", "neginf_prob": 0.1}}
# (spec, device, feature) -> reason, for a feature one probe shape rejected and another ran
_PROBE_PARTIAL: dict[tuple[str, str, str], str] = {}


def _probe_label(case: Case) -> str:
    return f"{case.dtype} Nq=Nk={case.Nq} D={case.D} {case.layout}"


def _tiny(dtype: str, D: int, device: str, *, Hq=2, Hkv=2, N=4, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    dt = _DTYPES[dtype]

    def draw(h):
        x = torch.randn(1, h, N, D, generator=g, dtype=torch.float32).to(dt).to(device)
        return x.requires_grad_(requires_grad)

    return draw(Hq), draw(Hkv), draw(Hkv)


def _accepts_kw(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


@dataclass
class Kernel:
    """A kernel under test: its callable plus what it can do (declared or probed).

    ``declared`` is the callable's ``capabilities`` dict, validated
    (:func:`verify.capabilities.check_capabilities`; a bad one raises :class:`SpecError`
    naming the key). Probes decide only what is not declared, one feature at a time, on
    probe cases inside the declared domain (sequence multiple, head dims, layouts,
    ``supports``). A feature is taken out only when every probe case of it (two shapes) is
    clearly rejected; a rejection on one probe shape alone is recorded in
    ``probe_rejected_cases`` and the real cases then run (a clear rejection of one of them
    is "not run: reason").
    """

    name: str
    spec: str
    fn: Callable
    device: str = "cpu"
    declared: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.declared:
            self.declared = getattr(self.fn, "capabilities", None) or {}
        try:
            self.declared = check_capabilities(self.declared)
        except ValueError as e:
            raise SpecError(f"kernel {self.spec!r}: {e}") from None

    # -- probing --------------------------------------------------------------------------

    def _probe_cases(self, dtype: str, *, D: int | None = None, gqa: bool = False,
                     mask: dict | None = None, backward: bool = False,
                     is_causal: bool = False) -> list[Case]:
        """The probe cases of one feature: a small one and a larger one with another head
        dim, both inside the declared domain (the declared ``supports`` too, where it
        accepts any of them)."""
        out: list[Case] = []
        for i, large in enumerate((False, True)):
            shape = probe_shape(self.declared, large=large, D=D)
            c = Case(B=1, Hq=4 if gqa else 2, Hkv=2, dtype=dtype, seed=i, backward=backward,
                     mask=mask or {"kind": "none"}, is_causal=is_causal, **shape)
            if c not in out:
                out.append(c)
        fn = self.declared.get("supports")
        if fn is not None:
            inside = [c for c in out if call_supports(fn, c) is None]
            out = inside or out
        return out

    def _call_tiny(self, dtype="float16", D=16, device=None, N=4):
        """Call the kernel on (1, 2, N, D) random contiguous inputs (the domain guard's
        probes: head dims beyond what a Case holds)."""
        device = device or self.device
        q, k, v = _tiny(dtype, D, device, N=N)
        return run_compiled(self.fn, q, k, v)

    def _run_probe(self, case: Case, device: str) -> None:
        """Call the kernel on a probe case (masks passed as they are, never converted)."""
        inp = case.materialize(device)
        if case.backward:
            for t in (inp.query, inp.key, inp.value):
                t.requires_grad_(True)
        out = run_compiled(self.fn, inp.query, inp.key, inp.value, **inp.kwargs())
        out = out[0] if isinstance(out, tuple) else out
        if case.backward:
            out.float().sum().backward()
            if inp.query.grad is None:
                raise NotImplementedError("backward: no gradient reached the query")

    def _probe(self, feature: str, device: str, probes: list[Case]) -> str | None:
        """Run the probe cases of ``feature``; None when any of them worked (or failed in a
        way that is not a clear rejection), else the reason it is outside the domain.
        Kernels of the varlen and decode APIs are not probed: what they do not declare is
        in the domain, and a clear rejection of a real case is "not run: reason"."""
        if self.api != "dense":
            return None
        key = (self.spec, device, feature)
        if key not in _PROBE_CACHE:
            reasons = []
            for c in probes:
                try:
                    self._run_probe(c, device)
                except Exception as e:  # classify: clear rejection = outside the domain
                    if not is_clear_rejection(e):
                        reasons = []
                        break
                    reasons.append((c, describe_exception(e)))
                    continue
                break
            if reasons and len(reasons) < len(probes):
                c, why = reasons[0]
                _PROBE_PARTIAL[key] = f"{why} (on {_probe_label(c)}; another probe shape ran)"
            ok = not reasons or len(reasons) < len(probes)
            _PROBE_CACHE[key] = None if ok else (
                reasons[0][1] + (f" (on {len(probes)} probe shapes)" if len(probes) > 1
                                 else ""))
        return _PROBE_CACHE[key]

    def _dtype_reason(self, dtype: str, device: str) -> str | None:
        nr = (self.declared.get("not_run") or {}).get(torch.device(device).type, {})
        if dtype in nr:
            return str(nr[dtype])
        if "dtypes" in self.declared:
            ok = dtype in self.declared["dtypes"]
            return None if ok else f"dtype {dtype} not in declared dtypes {self.declared['dtypes']}"
        return self._probe(f"dtype={dtype}", device, self._probe_cases(dtype))

    def _head_dim_reason(self, D: int, dtype: str, device: str) -> str | None:
        if "head_dims" in self.declared:
            return head_dim_reason(self.declared, D)
        return self._probe(f"D={D},{dtype}", device, self._probe_cases(dtype, D=D))

    def _mask_reason(self, kind: str, dtype: str, device: str) -> str | None:
        if "masks" in self.declared:
            ok = kind in self.declared["masks"]
            return None if ok else f"{kind} masks not in declared masks {self.declared['masks']}"
        return self._probe(f"mask={kind},{dtype}", device,
                           self._probe_cases(dtype, mask=_PROBE_MASKS[kind]))

    def causal_with_mask(self, dtype: str, device: str | None = None) -> bool:
        """Whether ``is_causal=True`` may come with an ``attn_mask``: declared, else probed
        with a mask kind the kernel takes (SDPA itself refuses the pair: "Explicit attn_mask
        should not be set when is_causal=True"). When not, the causal structure is folded
        into the mask (:meth:`arguments`), so such cases still run."""
        if "causal_with_mask" in self.declared:
            return bool(self.declared["causal_with_mask"])
        device = device or self.device
        kinds = self.mask_kinds(dtype, device)
        if not kinds:
            return True  # no mask to go with it; nothing to fold
        return self._probe(f"causal_with_mask,{dtype}", device, self._probe_cases(
            dtype, mask=_PROBE_MASKS[kinds[0]], is_causal=True)) is None

    def _flag_reason(self, flag: str, dtype: str, device: str) -> str | None:
        if flag in self.declared:
            return None if self.declared[flag] else f"kernel declares {flag}=False"
        return self._probe(f"{flag},{dtype}", device,
                           self._probe_cases(dtype, **{flag: True}))

    def _backward_reason(self, dtype: str, is_causal: bool, device: str) -> str | None:
        declared = backward_declared(self.declared, dtype, is_causal)
        if declared is True:
            return None
        if declared is False:
            how = self.declared["backward"]
            return ("kernel declares backward='causal_only'" if how == "causal_only" else
                    f"kernel declares backward={{{dtype!r}: False}}" if isinstance(how, dict)
                    else "kernel declares backward=False")
        return self._probe(f"backward,{dtype}", device,
                           self._probe_cases(dtype, backward=True))

    @property
    def declares_domain(self) -> bool:
        """Whether dtypes and head dims are declared (a rejection inside them is a failure)."""
        return "dtypes" in self.declared and "head_dims" in self.declared

    def extensions(self) -> tuple[str, ...]:
        """Extension kwargs the kernel takes (declared; default none)."""
        return tuple(self.declared.get("extensions", ()))

    def mask_kinds(self, dtype: str = "float16", device: str | None = None) -> tuple[str, ...]:
        if self.api != "dense":
            return ()  # no attn_mask in those APIs: the structure is in the sequences
        device = device or self.device
        return tuple(k for k in ("bool", "additive")
                     if self._mask_reason(k, dtype, device) is None)

    @property
    def capabilities(self) -> dict:
        """Declared capabilities, completed by probes (dtypes, head-dim sample, masks, gqa,
        backward per dtype) on this kernel's device. ``probed_not_run`` lists what the probes
        took out and why (declare it to skip the probe); ``probe_rejected_cases`` the
        features that one probe shape rejected and another ran (kept in the domain)."""
        dev = self.device
        caps = dict(self.declared)
        caps.setdefault("extensions", ())
        not_run: dict[str, str] = {}
        dtypes = []
        for dt in PROBE_DTYPES:
            r = self._dtype_reason(dt, dev)
            (not_run.__setitem__(f"dtype={dt}", r) if r else dtypes.append(dt))
        caps.setdefault("dtypes", tuple(dtypes))
        probe_dt = dtypes[0] if dtypes else "float32"
        if "head_dims" not in caps:
            dims = []
            for D in HEAD_DIM_SAMPLE:
                r = self._head_dim_reason(D, probe_dt, dev)
                (not_run.__setitem__(f"D={D}", r) if r else dims.append(D))
            caps["head_dim_sample"] = tuple(dims)
        caps.setdefault("masks", self.mask_kinds(probe_dt, dev))
        caps.setdefault("causal_with_mask", self.causal_with_mask(probe_dt, dev))
        if "gqa" not in caps:
            r = self._flag_reason("gqa", probe_dt, dev)
            caps["gqa"] = r is None
            if r:
                not_run["gqa"] = r
        bwd = caps.get("backward")
        if not isinstance(bwd, (bool, str)):  # absent, or a dict that may leave dtypes out
            per = dict(bwd or {})
            for dt in dtypes:
                if dt not in per:
                    r = self._backward_reason(dt, False, dev)
                    per[dt] = r is None
                    if r:
                        not_run[f"backward,{dt}"] = r
            caps["backward"] = (per[probe_dt] if bwd is None and len(set(per.values())) <= 1
                                and per else per)
        caps["probed_not_run"] = not_run
        caps["probe_rejected_cases"] = {k[2]: v for k, v in _PROBE_PARTIAL.items()
                                        if k[:2] == (self.spec, dev)}
        return caps

    # -- the domain -----------------------------------------------------------------------

    @property
    def api(self) -> str:
        """The plug-in API the kernel declares (``capabilities["api"]``; default dense)."""
        return self.declared.get("api", "dense")

    def supports(self, case: Case, device: str | None = None) -> tuple[bool, str]:
        """(True, "") when ``case`` is inside the kernel's domain on ``device``, else
        (False, reason). Declared rules first, then probes of what is undeclared, then the
        declared ``supports(case)``."""
        device = device or self.device
        if case.api != self.api:
            return False, (f"a {case.api} case; the kernel's API is {self.api} "
                           f"(capabilities['api'])")
        devices = self.declared.get("devices")
        if devices is not None and torch.device(device).type not in devices:
            return False, f"device {device} not in declared devices {tuple(devices)}"
        reason = domain_reason(self.declared, case) or self._dtype_reason(case.dtype, device)
        if reason:
            return False, reason
        for reason in (
            self._head_dim_reason(case.D, case.dtype, device),
            self._flag_reason("gqa", case.dtype, device) if case.Hq != case.Hkv else None,
            self._needs_mask_reason(case, device),
        ):
            if reason:
                return False, reason
        if case.tf32 and case.dtype == "float32" and self.declared.get("tf32") is False:
            return False, "kernel declares tf32=False"
        fn = self.declared.get("supports")
        reason = call_supports(fn, case) if fn is not None else None
        if reason:
            return False, reason
        return True, ""

    def supports_backward(self, case: Case, device: str | None = None) -> tuple[bool, str]:
        r = self._backward_reason(case.dtype, case.is_causal, device or self.device)
        return (r is None), (f"kernel has no backward: {r}" if r else "")

    def _folds(self, case_like, dtype: str, device: str) -> bool:
        """Whether the structure must be folded into attn_mask for this kernel."""
        ext = self.extensions()
        window = case_like.window
        bottom = case_like.causal_alignment == "bottom_right" and (
            case_like.is_causal or window is not None)
        need_ext = (window is not None and "window" not in ext) or (
            bottom and "causal_alignment" not in ext)
        has_mask = getattr(case_like, "attn_mask", None) is not None or (
            isinstance(getattr(case_like, "mask", None), dict)
            and case_like.mask["kind"] != "none")
        causal_plus_mask = case_like.is_causal and has_mask and not self.causal_with_mask(
            dtype, device)
        return need_ext or causal_plus_mask

    def _needs_mask_reason(self, case: Case, device: str) -> str | None:
        if case.api != "dense":  # no attn_mask to fold a missing extension into
            ext = self.extensions()
            need = [n for n, on in (("window", case.window is not None), (
                "causal_alignment", case.causal_alignment == "bottom_right" and (
                    case.is_causal or case.window is not None))) if on and n not in ext]
            return f"kernel lacks the {'/'.join(need)} extension" if need else None
        kind = case.mask["kind"]
        needed = set()
        if kind == "bias":
            needed.add("additive")
        elif kind != "none":
            needed.add("bool")
        if self._folds(case, case.dtype, device):
            needed.add("bool" if kind != "bias" else "additive")
        accepted = set(self.mask_kinds(case.dtype, device))
        if kind != "bias" and needed and "bool" not in accepted and "additive" in accepted:
            needed = {"additive"}  # bool masks are converted to -inf additive ones
        missing = needed - accepted
        if missing:
            return f"kernel takes no {'/'.join(sorted(missing))} attn_mask (needed for this case)"
        return None

    # -- calling --------------------------------------------------------------------------

    def arguments(self, inputs: Inputs) -> tuple[tuple, dict]:
        """Positional and keyword arguments that express ``inputs`` for this kernel."""
        kw = inputs.kwargs()
        dtype = str(inputs.query.dtype).removeprefix("torch.")
        if self._folds(inputs, dtype, str(inputs.query.device)):
            q, k = inputs.query, inputs.key
            nq, nk = q.shape[2], k.shape[2]
            from flashcheck.reference.masks import structural_mask

            allowed = structural_mask(
                nq, nk, is_causal=inputs.is_causal, causal_alignment=inputs.causal_alignment,
                window=inputs.window, device=q.device,
            )
            m = inputs.attn_mask
            if m is None:
                m = allowed
            elif m.dtype == torch.bool:
                m = m & allowed
            else:
                m = m.masked_fill(~allowed, -math.inf)
            kw.pop("window", None)
            kw.pop("causal_alignment", None)
            kw["is_causal"] = False
            kw["attn_mask"] = m
        m = kw["attn_mask"]
        if m is not None and m.dtype == torch.bool and "bool" not in self.mask_kinds(
                dtype, str(inputs.query.device)):
            kw["attn_mask"] = torch.zeros(m.shape, dtype=inputs.query.dtype,
                                          device=m.device).masked_fill(~m, -math.inf)
        return (inputs.query, inputs.key, inputs.value), kw

    def call(self, inputs: Inputs):
        """Run the kernel on ``inputs``; returns (out, lse or None)."""
        if inputs.api_args is not None:
            return run_compiled(call_ragged, self.fn, inputs)
        args, kw = self.arguments(inputs)
        res = run_compiled(self.fn, *args, **kw)
        if isinstance(res, tuple):
            return res[0], (res[1] if len(res) > 1 else None)
        return res, None


# ------------------------------------------------------------------------------------------
# outside-domain guard


@dataclass
class GuardFinding:
    """One outside-domain probe: ``status`` is "raised" (good) or "outside_domain_accepted"."""

    probe: str
    status: str
    reason: str

    def to_dict(self) -> dict:
        return {"probe": self.probe, "status": self.status, "reason": self.reason}


def check_domain_guard(kernel, device: str) -> list[GuardFinding]:
    """Call the kernel on inputs outside its declared domain; it must raise, not return.

    Probes: D = 512 when the declared ``head_dims`` exclude it; float64 when declared
    ``dtypes`` exclude it; K/V on another device than Q (CUDA only). A kernel without a
    declared domain is only probed with the mixed-device inputs.
    """
    k = as_kernel(kernel, device)
    probes: list[tuple[str, Callable[[], object]]] = []
    decl = k.declared
    dt0 = (decl.get("dtypes") or ("float16",))[0]
    n = probe_shape(decl)["Nq"]  # a sequence length inside the declared rules
    if "head_dims" in decl and head_dim_reason(decl, 512) is not None:
        probes.append(("head_dim=512", functools.partial(k._call_tiny, dt0, 512, device, N=n)))
    if "dtypes" in decl and "float64" not in decl["dtypes"]:
        def f64():
            q, kk, v = (t.double() for t in _tiny("float32", 16, device, N=n))
            return run_compiled(k.fn, q, kk, v)
        probes.append(("dtype=float64", f64))
    if torch.device(device).type == "cuda":
        def mixed():
            q, kk, v = _tiny(dt0, 16, device, N=n)
            return run_compiled(k.fn, q, kk.cpu(), v.cpu())
        probes.append(("mixed_devices", mixed))
    findings = []
    for name, thunk in probes:
        try:
            out = thunk()
        except Exception as e:
            findings.append(GuardFinding(name, "raised", describe_exception(e)))
            continue
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        findings.append(GuardFinding(name, "outside_domain_accepted",
                                     f"returned {shape} instead of raising"))
    return findings

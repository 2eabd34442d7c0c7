"""Test-only kernels that misbehave the ways a campaign must survive (verify/supervise.py).

Each is correct (PyTorch's SDPA) except where it misbehaves, so a campaign's shrinker has a
sharp boundary to find: "large" means more than 8 query rows, which the smallest failing case
pins to Nq = 9. The capability probes call kernels with 4 query rows, so probing never trips
them.

- :func:`segv_large`: kills its own process with SIGSEGV (a kernel's invalid memory access).
- :func:`segv_always`: the same on every call, the capability probes included.
- :func:`abort_large`: ``os.abort()`` (a failed C assertion).
- :func:`hang_large`: blocks forever (a deadlock).
- :func:`first_use_wrong`: 1% off the first time a (shape, dtype) is seen in a process, right
  afterwards (a stale cache, an uninitialised buffer reused).
- :func:`random_wrong`: 1% off on 30% of its calls, at random (a race).
- :func:`compiled_until_history`: refuses head dims below 16 in a fresh process, runs them
  1% off once the process has made many calls (a compiled kernel's eager fallback).
- :func:`random_order`: sums the keys in a random order on every call: right to rounding,
  but not bitwise repeatable.
- :func:`compile_error_small_d`: raises a compiler-style error for every head dim below 16
  (the same root cause in every configuration).
- :func:`hostile_output_large`: returns, for more than 8 query rows, a tensor subclass on
  which every torch operation raises: the harness's own code raises on the output after the
  kernel returned, which must still end in a kept case file (``harness_error``).
- :func:`cuda_error_large`: raises the error torch raises after an illegal address, and from
  then on every call in that process raises it (a poisoned CUDA context), so the harness must
  replace the worker. On a CPU this is how the CUDA-error path is exercised.
"""

from __future__ import annotations

import os
import random
import signal
import threading

import torch
import torch.nn.functional as F
from flashcheck.verify.adapters import CPU_FLASH_FAMILY

_LARGE = 8  # more query rows than this trip the misbehaving kernels


def _causal_into_mask(query, key, attn_mask):
    """SDPA refuses a mask together with is_causal: fold the (top-left) causal rule in."""
    causal = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool,
                        device=query.device).tril()
    if attn_mask is None:
        return causal
    if attn_mask.dtype == torch.bool:
        return attn_mask & causal
    return attn_mask.masked_fill(~causal, float("-inf"))


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False):
    if is_causal and attn_mask is not None:
        attn_mask, is_causal = _causal_into_mask(query, key, attn_mask), False
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                          is_causal=is_causal, scale=scale,
                                          enable_gqa=enable_gqa)


def segv_large(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    if query.shape[-2] > _LARGE:
        os.kill(os.getpid(), signal.SIGSEGV)
    return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


class _Hostile(torch.Tensor):
    """A tensor on which every torch operation (even reading .shape) raises."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"hostile output: {getattr(func, '__name__', func)} refused")


def hostile_output_large(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                         scale=None, enable_gqa=False):
    out = _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return out.as_subclass(_Hostile) if query.shape[-2] > _LARGE else out


def abort_large(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
    if query.shape[-2] > _LARGE:
        os.abort()
    return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def hang_large(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    if query.shape[-2] > _LARGE:
        threading.Event().wait()  # never set: a deadlock
    return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


_SEEN: set = set()


def first_use_wrong(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                    scale=None, enable_gqa=False):
    out = _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    shape = (tuple(query.shape), tuple(key.shape), query.dtype)
    if shape not in _SEEN:
        _SEEN.add(shape)
        return out * 1.01
    return out


_CALLS = [0]
# history_wrong turns wrong after this many calls in its process: far more than a fresh
# worker's capability probes and one case, far fewer than a 100-example campaign makes.
_HISTORY_CALLS = 150


def history_wrong(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                  scale=None, enable_gqa=False):
    """Right in a fresh process, wrong once the process has made many calls (a kernel whose
    result depends on what ran before it: a recompiled variant, a grown workspace)."""
    _CALLS[0] += 1
    out = _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return out * 1.01 if _CALLS[0] > _HISTORY_CALLS else out


_SMALL_D = 16  # compiled_until_history refuses head dims below this in a fresh process


def compiled_until_history(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                           scale=None, enable_gqa=False):
    """A compiled kernel whose compiler refuses head dims below 16, until the process has made
    many calls; from then on it runs them on another path, 1% off (a compiler cache past its
    limit running the function eagerly). In a fresh process such a case is not run."""
    _CALLS[0] += 1
    small = query.shape[-1] < _SMALL_D
    if small and _CALLS[0] <= _HISTORY_CALLS:
        raise NotImplementedError(f"head dim must be at least {_SMALL_D}, got "
                                  f"{query.shape[-1]}")
    out = _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return out * 1.01 if small else out


# head dims declared, so that the probes do not take the small ones out of the drawn domain
# (the campaign must draw them for the history to show); the family of the CPU SDPA it
# calls (PyTorch's CPU flash kernel for these cases), so that only its 1% shows
compiled_until_history.capabilities = {"head_dims": (1, 64), "family": CPU_FLASH_FAMILY}


_RNG = random.Random(int.from_bytes(os.urandom(8), "little"))
# random_wrong's chance of a wrong call. A check calls the forward twice, so a case fails
# with probability 1 - 0.7^2 = 0.51 (nondeterministic 0.42, numerical 0.09) and passes with
# 0.49: a campaign finds it at once, and the chance that the shrunk case's eight re-checks all
# give the same failure class, so that it is not recognised as flaky, is 0.42^8 ~ 0.1%
# (verify/fuzz.py, CONFIRM_RUNS).
_P_WRONG = 0.3


def random_wrong(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                 scale=None, enable_gqa=False):
    out = _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return out * 1.01 if _RNG.random() < _P_WRONG else out


def random_order(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                 scale=None, enable_gqa=False):
    """Permutes the keys (and the mask's key axis) at random: the same attention, summed in
    another order."""
    nk = key.shape[-2]
    perm = torch.randperm(nk, generator=torch.Generator().manual_seed(_RNG.getrandbits(62)))
    perm = perm.to(key.device)
    if is_causal:  # keep the causal structure: express it as a mask before permuting
        attn_mask, is_causal = _causal_into_mask(query, key, attn_mask), False
    if attn_mask is not None:
        attn_mask = attn_mask.expand(*attn_mask.shape[:-1], nk).index_select(-1, perm)
    return _sdpa(query, key.index_select(-2, perm), value.index_select(-2, perm), attn_mask,
                 dropout_p, is_causal, scale, enable_gqa)


class CompilationError(Exception):
    """Stands in for triton.compiler.errors.CompilationError (not a clear rejection)."""


def compile_error_small_d(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                          scale=None, enable_gqa=False):
    d = query.shape[-1]
    if d < 16:
        raise CompilationError(f"at 41:12: tl.dot operands of shape ({query.shape[-2]}, {d}) "
                               f"and ({d}, {key.shape[-2]}): K = {d} is below the minimum 16")
    return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


_POISONED = [False]


def cuda_error_large(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                     scale=None, enable_gqa=False):
    if _POISONED[0] or query.shape[-2] > _LARGE:
        _POISONED[0] = True
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel "
                           "errors might be asynchronously reported at some other API call")
    return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def segv_always(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
    """Crashes on every call, the capability probes' included."""
    os.kill(os.getpid(), signal.SIGSEGV)


def _declare_cpu_sdpa_family(*kernels) -> None:
    """Where these do not misbehave they return PyTorch's SDPA, which on the CPU runs its
    flash kernel for most cases: its arithmetic choices are the family's opt-in members
    (the `sdpa-flash` built-in's), declared so that only the misbehaviour fails a case."""
    for k in kernels:
        k.capabilities = {**getattr(k, "capabilities", {}), "family": CPU_FLASH_FAMILY}


_declare_cpu_sdpa_family(segv_large, hostile_output_large, abort_large, hang_large,
                         first_use_wrong, history_wrong, random_wrong, random_order,
                         compile_error_small_d, cuda_error_large)

"""Our kernel restricted to the domain its Gluon backward takes, for campaigns on the H200.

    . scripts/gpu/triton_slim.sh use      # triton 3.9: its Gluon has the bulk reduce-add
    export FLASHCHECK_GLUON_BWD=split     # or writer
    flashcheck fuzz --kernel scripts/gpu/gluon_bwd_domain.py:attention --device cuda ...
    flashcheck fuzz --kernel scripts/gpu/gluon_bwd_domain.py:attention_ordered --device cuda ...

``attention`` is ``flashcheck.kernels.flash_attention.attention_atomic`` (adds as they
come) and ``attention_ordered`` is ``flashcheck.kernels.attention`` (deterministic: the
ordered form), with capabilities narrowed (docs/contracts.md section 2) to the calls
``kernels.flash_attention_gluon_bwd.eligible`` accepts: float16/bfloat16, head dim 64 or
128, Nq = Nk a multiple of 128 (at most 2048, so that the float64 oracles stay quick),
contiguous layout, no mask, no window, causal or not, GQA (dK/dV in one fp32 accumulator
over the group; both entries, the ordered one under causal too). The forward is the
package's (the Gluon forward where it applies). The form is the environment's
``FLASHCHECK_GLUON_BWD`` ("auto", the default, takes writer; "off": importing this module
switches split on). Every backward checks that it ran the Gluon kernel once: one that left it raises
AssertionError, which the harness records as a failure, not a skip. Importing it under a
Triton without Gluon's bulk reduce-add (3.6) raises ImportError with what to do.
"""

from __future__ import annotations

import torch
from flashcheck.kernels import _common
from flashcheck.kernels import flash_attention as fa
from flashcheck.kernels import flash_attention_gluon_bwd as gb

if not gb.AVAILABLE:
    raise ImportError("scripts/gpu/gluon_bwd_domain.py needs triton 3.9's Gluon "
                      "(tma.async_atomic_add); on the H200: . scripts/gpu/triton_slim.sh use")
if _common.get_gluon_bwd() == "off":
    _common.set_gluon_bwd("split")


class _Mark(torch.autograd.Function):
    """Identity. On the output its backward runs before the attention's and notes the
    Gluon launch count; on the query after it, and checks that exactly one launch came
    between."""

    @staticmethod
    def forward(ctx, x, box, check):
        ctx.box, ctx.check = box, check
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if not ctx.check:
            ctx.box.append(gb.LAUNCHES[0])
        elif not ctx.box or gb.LAUNCHES[0] != ctx.box[-1] + 1:
            raise AssertionError("the backward did not run the Gluon kernel once (form "
                                 f"{_common.get_gluon_bwd()!r}; launches {gb.LAUNCHES[0]}, "
                                 f"before {ctx.box[-1] if ctx.box else '?'})")
        return g, None, None


def _run(fn, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window,
         causal_alignment):
    box: list = []
    if query.requires_grad:
        query = _Mark.apply(query, box, True)
    out = fn(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
             window=window, causal_alignment=causal_alignment)
    return _Mark.apply(out, box, False) if out.requires_grad else out


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False, *, window=None, causal_alignment="top_left"):
    return _run(fa.attention_atomic, query, key, value, attn_mask, dropout_p, is_causal, scale,
                enable_gqa, window, causal_alignment)


def attention_ordered(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                      scale=None, enable_gqa=False, *, window=None,
                      causal_alignment="top_left"):
    return _run(fa.attention, query, key, value, attn_mask, dropout_p, is_causal, scale,
                enable_gqa, window, causal_alignment)


_DOMAIN = {
    **fa.capabilities(),
    "dtypes": ("float16", "bfloat16"),
    "head_dims": {64, 128},
    "seq_multiple": 128,
    "same_seqlen": True,
    "max_seqlen": 2048,
    "layouts": ("contiguous",),
    "masks": (),
    "extensions": (),
    "devices": ("cuda",),
    "not_run": {},
}
attention.capabilities = {**_DOMAIN, "deterministic_backward": False}
attention_ordered.capabilities = dict(_DOMAIN)

"""The five-product Gluon backward (scripts/gpu/gluon_bwd.py, the head dim split between its
warpgroups) behind our forward, as a kernel the harness can fuzz on the H200.

    . scripts/gpu/triton_slim.sh use      # triton 3.9: its Gluon has the bulk reduce-add
    flashcheck fuzz --kernel scripts/gpu/gluon_bwd_domain.py:attention --device cuda ...
    flashcheck fuzz --kernel scripts/gpu/gluon_bwd_domain.py:attention_ordered --device cuda ...

``attention``: our Triton forward (``flashcheck.kernels.flash_attention._forward`` with the
Gluon forward switched off, so that the campaign is about the backward), then delta =
rowsum(dO ∘ O) in fp32 and the prototype's dK/dV kernel with dQ added inside by bulk
reduce-adds as they come (``deterministic_backward`` False). ``attention_ordered``: the
same with the adds in a fixed order (non-causal; declared bitwise repeatable). The domain
is the prototype's: float16/bfloat16, head dim 64 or 128, Nq = Nk a multiple of 128 (at
most 2048, so that the float64 oracles stay quick), contiguous (B, H, N, D), no mask, no
window, GQA (dK/dV in one fp32 accumulator over the group; not in the ordered form), causal
(top-left) or not, any scale.
``GLUON_BWD_FORM=writer`` takes the form whose adds (and turns) come from a warp of their
own. Importing it under a triton without Gluon's bulk reduce-add (3.6) raises ImportError
with what to do.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch
from flashcheck.kernels import _common
from flashcheck.kernels import flash_attention as fa

_spec = importlib.util.spec_from_file_location(
    "gluon_bwd", Path(__file__).with_name("gluon_bwd.py"))
gluon_bwd = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("gluon_bwd", gluon_bwd)
_spec.loader.exec_module(gluon_bwd)
# GLUON_BWD_FORM=writer: the adds (and the ordered form's turns) from a warp of their own
_FORM = os.environ.get("GLUON_BWD_FORM", "split")
if _FORM not in ("split", "writer"):
    raise ValueError(f"GLUON_BWD_FORM must be 'split' or 'writer', got {_FORM!r}")
WRITER = _FORM == "writer"
if not gluon_bwd.BULK:
    raise ImportError("scripts/gpu/gluon_bwd_domain.py needs triton 3.9's Gluon "
                      "(tma.async_atomic_add); on the H200: . scripts/gpu/triton_slim.sh use")


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, p, ordered):
        # the Triton forward (Gluon off): a failure here is the backward's or the glue's
        with _common.gluon("off"):
            out, lse = fa._forward(q, k, v, p, False)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.p, ctx.ordered = p, ordered
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        p = ctx.p
        do = do.contiguous()
        delta = (out.float() * do.float()).sum(-1)
        acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
        dk, dv = gluon_bwd.dkdv(q, k, v, do, lse, delta, p.is_causal, acc,
                                ordered=ctx.ordered, bulk=True, split=True, scale=p.scale,
                                writer=WRITER)
        return (acc * p.scale).to(q.dtype), dk, dv, None, None


def _run(ordered, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
         window, causal_alignment):
    p = _common.validate(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                         window, causal_alignment)
    if attn_mask is not None or window is not None or p.Nq != p.Nk:
        raise ValueError("gluon_bwd_domain: no mask, no window, Nq == Nk")
    if ordered and (is_causal or p.Hq != p.Hkv):
        raise ValueError("gluon_bwd_domain: the ordered adds are non-causal, MHA")
    q, k, v = (t.contiguous() for t in (query, key, value))
    return _Attention.apply(q, k, v, p, ordered)


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False, *, window=None, causal_alignment="top_left"):
    return _run(False, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                window, causal_alignment)


def attention_ordered(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                      scale=None, enable_gqa=False, *, window=None,
                      causal_alignment="top_left"):
    return _run(True, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                window, causal_alignment)


def _ordered_supports(case) -> str | None:
    if case.is_causal:
        return "the ordered adds are non-causal"
    if case.Hq != case.Hkv:
        return "the ordered adds are for MHA (no GQA)"
    return None


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
    "gqa": True,
    "devices": ("cuda",),
    "not_run": {},
}
attention.capabilities = {**_DOMAIN, "deterministic_backward": False}
attention_ordered.capabilities = {
    **_DOMAIN, "deterministic_backward": True,
    "supports": _ordered_supports}

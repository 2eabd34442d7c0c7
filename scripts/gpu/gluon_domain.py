"""Our kernel restricted to the domain its Gluon forward takes, for campaigns on the H200.

    flashcheck fuzz --kernel scripts/gpu/gluon_domain.py:attention --device cuda ...
    flashcheck run --kernel scripts/gpu/gluon_domain.py:attention --device cuda ...

``attention`` is ``flashcheck.kernels.attention`` with capabilities narrowed
(docs/contracts.md section 2) to the calls ``kernels.flash_attention_gluon.eligible``
accepts: head dim 128, and 64 where the Gluon mode takes it at these lengths ("auto" and
"persistent": the persistent grid; not "tile"), float16/bfloat16, sequence lengths
multiples of 128 (at most 2048, so that the float64 oracles stay quick), contiguous
layout, no mask, no window, GQA, causal top-left (bottom-right where Nq == Nk, through
``supports``), the backward. The harness's strategies draw inside that domain by
construction, so every case runs the Gluon forward (and the backward from its lse). Each
call checks that it did: a call that left the Gluon path raises AssertionError, which the
harness records as a failure, not a skip.
"""

from __future__ import annotations

from flashcheck.kernels import _common
from flashcheck.kernels import flash_attention as fa
from flashcheck.kernels import flash_attention_gluon as fg

MAX_SEQLEN = 2048


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False, *, window=None, causal_alignment="top_left"):
    before = fg.LAUNCHES[0]
    out = fa.attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                       window=window, causal_alignment=causal_alignment)
    if fg.LAUNCHES[0] != before + 1:
        raise AssertionError("the call did not run the Gluon forward: "
                             f"{tuple(query.shape)} {query.dtype} causal={is_causal} "
                             f"{causal_alignment} strides={query.stride()}")
    return out


def _supports(case) -> str | None:
    if case.is_causal and case.causal_alignment == "bottom_right" and case.Nq != case.Nk:
        return "bottom-right causal with Nq != Nk is the Triton forward's"
    return None


attention.capabilities = {
    **fa.capabilities(),
    "dtypes": ("float16", "bfloat16"),
    "head_dims": {d for d in (64, 128) if _common.gluon_grid(d, 128) is not None
                  and _common.gluon_grid(d, MAX_SEQLEN) is not None},
    "seq_multiple": 128,
    "max_seqlen": MAX_SEQLEN,
    "layouts": ("contiguous",),
    "masks": (),
    "extensions": ("causal_alignment",),
    "devices": ("cuda",),
    "not_run": {},
    "supports": _supports,
}

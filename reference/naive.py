"""The deliberately short textbook attention, in the spirit of FlashAttention's
``attention_ref(upcast, reorder_ops)``.

``naive_attention`` materialises the whole (Nq, Nk) score matrix, applies the masks,
takes a softmax and multiplies by V. With ``upcast=True`` (default) it computes in fp32
(fp64 inputs stay fp64) and rounds the output to the input dtype; with ``upcast=False``
it computes in the input dtype: the "same-dtype naive attention" baseline some tools use
for their tolerance. ``reorder_ops=True`` multiplies q·k by the scale after the product
instead of scaling q before it. Differentiable by plain autograd; fully-masked rows give
0 output and zero gradients.

Caveats: memory O(B·Hq·Nq·Nk); meant for small problems and for reading by eye.
"""

from __future__ import annotations

import torch

from ._validate import check_attention_args
from .masks import combined_mask


def naive_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
    enable_gqa=False, *, window=None, causal_alignment="top_left", upcast=True,
    reorder_ops=False,
):
    """Textbook softmax(q·kᵀ·scale + mask)·v (contracts.md §1); output in the input dtype."""
    p = check_attention_args(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window,
        causal_alignment,
    )
    dtype = query.dtype
    q, k, v = query, key, value
    if upcast:
        work = torch.promote_types(dtype, torch.float32)
        q, k, v = q.to(work), k.to(work), v.to(work)
    k = k.repeat_interleave(p.group, dim=1)
    v = v.repeat_interleave(p.group, dim=1)
    if reorder_ops:
        scores = torch.matmul(q, k.transpose(-2, -1)) * p.scale
    else:
        scores = torch.matmul(q * p.scale, k.transpose(-2, -1))
    allowed, bias = combined_mask(
        attn_mask, (p.B, p.Hq, p.Nq, p.Nk), is_causal=p.is_causal,
        causal_alignment=p.causal_alignment, window=p.window, device=q.device,
    )
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    scores = scores.masked_fill(~allowed, -torch.inf)
    dead = (scores == -torch.inf).all(dim=-1, keepdim=True)
    # A dead row's softmax is 0/0; give it finite scores, then zero its weights.
    attn = torch.softmax(scores.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    return torch.matmul(attn, v).to(dtype)

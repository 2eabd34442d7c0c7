"""A user's attention kernel, checked with ``--kernel mod:attention`` from this directory.

Pure PyTorch: SDPA's math backend in float64, rounded to the input dtype, so it is exact up
to that one rounding and fast on the CPU. Its domain is narrow on purpose, and declared
(docs/contracts.md §2): Nq and Nk multiples of 16, head dims 16, 32 and 64. Outside it the
kernel raises ValueError naming the argument; with ``dtypes`` and ``head_dims`` both declared,
the harness counts such a rejection of a drawn case as a failure, so a case drawn outside the
declared domain cannot pass unseen.

With ``USERPROJ_SHAPES_LOG`` set to a file, every call appends ``Nq Nk D`` to it: the
acceptance test (tests/test_user_project.py) reads what the harness really ran.

At import it checks that the top-level ``verify``, ``reference`` and ``kernels`` are this
project's own packages (their ``USERPROJ_OWN`` marker): flashcheck runs this module in its
worker processes and must never have taken those names there.
"""

from __future__ import annotations

import os

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import kernels
import reference
import verify

for _pkg in (kernels, reference, verify):
    if not getattr(_pkg, "USERPROJ_OWN", False):
        raise ImportError(f"top-level {_pkg.__name__!r} is {_pkg.__file__}, not this project's "
                          "own package: flashcheck leaked a generic import name")

# Sequence lengths the kernel takes: multiples of its (hypothetical) 16-row tile.
SEQ_MULTIPLE = 16
# Head dims it was "compiled" for.
HEAD_DIMS = frozenset({16, 32, 64})


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
    """SDPA's signature; (B, Hq, Nq, D) out in the dtype of ``query``."""
    nq, nk, d = query.shape[-2], key.shape[-2], query.shape[-1]
    log = os.environ.get("USERPROJ_SHAPES_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{nq} {nk} {d}\n")
    if nq % SEQ_MULTIPLE or nk % SEQ_MULTIPLE:
        raise ValueError(f"query/key: sequence lengths must be multiples of {SEQ_MULTIPLE}, "
                         f"got Nq={nq}, Nk={nk}")
    if d not in HEAD_DIMS:
        raise ValueError(f"query: head dim must be one of {sorted(HEAD_DIMS)}, got {d}")
    if dropout_p != 0.0:
        raise NotImplementedError(f"dropout_p must be 0.0, got {dropout_p}")
    if is_causal and attn_mask is not None:
        raise ValueError("is_causal together with attn_mask is not supported "
                         "(declared causal_with_mask=False)")
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.to(torch.float64)
    with sdpa_kernel(SDPBackend.MATH):  # fully masked rows: 0, never NaN (_safe_softmax)
        out = torch.nn.functional.scaled_dot_product_attention(
            query.to(torch.float64), key.to(torch.float64), value.to(torch.float64),
            attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return out.to(query.dtype)


attention.capabilities = {
    "dtypes": ("float16", "bfloat16", "float32"),
    "head_dims": set(HEAD_DIMS),
    "seq_multiple": SEQ_MULTIPLE,
    "masks": ("bool", "additive"),
    "gqa": True,
    "backward": True,
    "causal_with_mask": False,  # SDPA refuses both; the harness folds causal into the mask
    "extensions": (),
}

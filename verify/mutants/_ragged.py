"""Correct PyTorch bases of the varlen and decode mutants, with named hooks.

:class:`VarlenAttention` is the varlen API (verify/ragged.py): one fp32 softmax per sequence
on its slices, the structure (causal/window, each sequence's own Lq, Lk) per sequence,
differentiable through autograd. :class:`DecodeAttention` is the paged decode API as a
split-KV kernel: the keys of a sequence are gathered page by page through the block table,
cut into splits of SPLIT keys, each split gives its normalised fp32 output and (m, l), and
the splits are merged with the max rescaling. A mutant overrides one hook:

- varlen: ``key_range`` (the key slice a sequence reads), ``row_offset`` (where its output
  rows go), ``structure`` (its causal/window mask);
- decode: ``pages`` (the blocks a sequence's keys are read from), ``keys_read`` (how many
  key slots are read), ``visible`` (which of them a query attends), ``merge`` (how the
  splits combine).

Both compute in fp32 and round once, so a correct base is more accurate than the baseline
member; they never import ``kernels/``.
"""

from __future__ import annotations

import torch
from flashcheck.reference.masks import structural_mask

# Keys per split of the decode base: two splits from 17 keys on, so the merge is exercised by
# the CPU suite's short sequences.
SPLIT = 16
_DTYPES = ("float16", "bfloat16", "float32")


def _softmax_parts(q, k, v, allowed, scale):
    """fp32 (out normalised, m, l) of (H, Lq, D) queries against (H, Lk, D) keys; rows with
    no allowed key give out 0, m -inf, l 0."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed, -torch.inf)
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isfinite(m), m, 0.0))
    l = p.sum(-1, keepdim=True)
    out = (p @ v.float()) / torch.where(l > 0, l, 1.0)
    return out, m, l


def _expand(t, group: int):
    return t.repeat_interleave(group, dim=0) if group > 1 else t


class VarlenAttention:
    """The varlen API, correct; subclasses plant one bug through a hook."""

    capabilities = {"api": "varlen", "dtypes": _DTYPES, "head_dims": (1, 256), "gqa": True,
                    "backward": True, "extensions": ("window", "causal_alignment")}

    def key_range(self, b: int, ck: list[int], total_k: int) -> tuple[int, int]:
        return ck[b], ck[b + 1]

    def row_offset(self, b: int, cq: list[int]) -> int:
        return cq[b]

    def structure(self, lq, lk, *, q0, k0, is_causal, causal_alignment, window, device):
        return structural_mask(lq, lk, is_causal=is_causal, causal_alignment=causal_alignment,
                               window=window, device=device)

    def __call__(self, query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                 max_seqlen_k, *, is_causal=False, scale=None, window=None,
                 causal_alignment="top_left"):
        scale = scale if scale is not None else query.shape[-1] ** -0.5
        group = query.shape[1] // key.shape[1]
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        rows = []
        for b in range(len(cq) - 1):
            lq = cq[b + 1] - cq[b]
            q = query[cq[b]:cq[b + 1]].transpose(0, 1)
            lo, hi = self.key_range(b, ck, key.shape[0])
            if lq == 0:
                continue
            if hi <= lo:
                out = q.float() * 0  # no key: 0, on the autograd graph
            else:
                k, v = (_expand(t[lo:hi].transpose(0, 1), group) for t in (key, value))
                allowed = self.structure(lq, hi - lo, q0=cq[b], k0=lo, is_causal=is_causal,
                                         causal_alignment=causal_alignment, window=window,
                                         device=query.device)
                out = _softmax_parts(q, k, v, allowed, scale)[0]
            rows.append((self.row_offset(b, cq), out.transpose(0, 1)))
        result = query.new_zeros(query.shape[0], query.shape[1], value.shape[-1],
                                 dtype=torch.float32)
        for at, out in rows:
            n = min(out.shape[0], result.shape[0] - at)
            result = result.index_copy(0, torch.arange(at, at + n, device=query.device),
                                       out[:n])
        return result.to(query.dtype)


class DecodeAttention:
    """The paged decode API as a correct split-KV kernel; subclasses plant one bug."""

    capabilities = {"api": "decode", "dtypes": _DTYPES, "head_dims": (1, 256), "gqa": True,
                    "backward": False}

    def pages(self, b: int, row: list[int], n_pages: int, pool: int) -> list[int]:
        """The blocks holding sequence b's first n_pages pages (``row``: its table row)."""
        return row[:n_pages]

    def keys_read(self, n: int, page: int) -> int:
        return n

    def visible(self, j, pos, n: int):
        """(Nq, keys) bool: key slot j is attended by the query at position pos."""
        return j[None, :] <= pos[:, None]

    def merge(self, parts):
        """FlashAttention's split-KV combine: weights exp(m_s - m) l_s / Σ."""
        ms = torch.stack([m for _, m, _ in parts])
        m = ms.amax(0)
        m = torch.where(torch.isfinite(m), m, 0.0)
        w = torch.stack([torch.exp(mi - m) * li for _, mi, li in parts])
        total = w.sum(0)
        out = sum(wi * o for wi, (o, _, _) in zip(w, parts, strict=True))
        return out / torch.where(total > 0, total, 1.0)

    def __call__(self, query, k_cache, v_cache, cache_seqlens, block_table, *, scale=None):
        scale = scale if scale is not None else query.shape[-1] ** -0.5
        page = k_cache.shape[1]
        nq = query.shape[1]
        group = query.shape[2] // k_cache.shape[2]
        outs = []
        for b, n in enumerate(cache_seqlens.tolist()):
            n_read = self.keys_read(n, page)
            blocks = torch.tensor(self.pages(b, block_table[b].tolist(), -(-n_read // page),
                                             k_cache.shape[0]),
                                  dtype=torch.long, device=query.device)
            k, v = (_expand(c[blocks].flatten(0, 1)[:n_read].transpose(0, 1), group)
                    for c in (k_cache, v_cache))
            q = query[b].transpose(0, 1)
            pos = n - nq + torch.arange(nq, device=query.device)
            parts = []
            for lo in range(0, n_read, SPLIT):
                j = torch.arange(lo, min(lo + SPLIT, n_read), device=query.device)
                allowed = self.visible(j, pos, n).expand(q.shape[0], -1, -1)
                parts.append(_softmax_parts(q, k[:, j], v[:, j], allowed, scale))
            outs.append(self.merge(parts).transpose(0, 1))
        return torch.stack(outs).to(query.dtype)

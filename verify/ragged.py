"""The varlen and paged-decode APIs (docs/contracts.md §2), as dense problems with a mask.

Beside the dense SDPA signature the harness checks two other plug-in APIs, FlashAttention's
conventions:

- ``varlen``: ``attention_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k,
  max_seqlen_q, max_seqlen_k, *, is_causal=False, scale=None, window=None,
  causal_alignment="top_left")`` with packed ``query`` (total_q, Hq, D) and ``key``/``value``
  (total_k, Hkv, D); sequence b is SDPA on its slices; differentiable.
- ``decode``: ``attention_decode(query, k_cache, v_cache, cache_seqlens, block_table, *,
  scale=None)`` with ``query`` (B, Nq, Hq, D), a paged cache (num_blocks, page_size, Hkv, D)
  and a block table (B, max_blocks); query i of sequence b sits at position
  cache_seqlens[b] − Nq + i and attends keys 0..that position. Forward only.

How a case of either API is judged: its :class:`~verify.cases.Case` describes the *dense
equivalent* problem, and every oracle, the family and the error model run on that, unchanged.

- varlen: B = 1, Nq = total_q, Nk = total_k, layout ``bnhd`` (the dense (1, H, total, D)
  view of a packed (total, H, D) tensor is exactly that layout), and a bool mask
  (1, 1, total_q, total_k) that is block-diagonal over the sequences, with each sequence's
  causal/window rule (its own Lq, Lk for bottom-right alignment) inside its block. A query
  whose sequence has no key is a fully masked row: output 0, gradients 0.
- decode: B sequences, Nq new tokens, Nk = max(cache_seqlens), layout ``bnhd`` ((B, Nq, H, D)
  queries), and a bool mask (B, 1, Nq, Nk): key j of sequence b is allowed for query i iff
  j <= cache_seqlens[b] − Nq + i. The paged cache is built at call time from the dense
  keys/values: sequence b's keys go to pages in the order its block-table row names, the
  block table is a seeded permutation of the pool's blocks (``spare_blocks`` more than the
  sequences need, never read), and every cache slot that holds no key (the tail of a last
  partial page, the spare blocks) is filled with finite garbage: a kernel that reads a slot
  it must mask sees scores and values far from the real ones, never a NaN that a correct
  kernel multiplying by P = 0 could turn into a false alarm.

The dense equivalent's tile structure is not the kernel's: a blocked model over the packed
key axis groups a sequence's keys into tiles that may start mid-sequence. Masked keys add
exactly 0 to the online softmax, so per row this is the same arithmetic as tiles aligned at
the sequence's start with a different tile boundary, a member choice the family already has.
"""

from __future__ import annotations

import torch
from flashcheck.reference.masks import structural_mask
from flashcheck.verify.distributions import stream

__all__ = ["APIS", "RAGGED_APIS", "MAX_NEW_TOKENS", "normalize_ragged", "ragged_mask",
           "api_args", "call_ragged", "short_ragged", "max_seqlens", "paged_cache",
           "config_part", "document_mask"]

APIS = ("dense", "varlen", "decode")
RAGGED_APIS = ("varlen", "decode")
# New tokens per decode call: FlashAttention's kvcache path takes any Nq, but decode (1) and
# speculative decoding (a draft of up to 16 tokens) are what serving stacks call it with.
MAX_NEW_TOKENS = 16
PAGE_SIZE_MAX = 4096  # no cache uses pages of more keys (vLLM: 8-32; FlashAttention: 256)
MAX_SPARE_BLOCKS = 64
# The garbage in cache slots that hold no key: N(0, 1) × this, finite in every dtype (fp16's
# max is 6.5e4). Keys this large give scores ~GARBAGE·|q|·sqrt(D)·scale, far above the real
# ones, so an unmasked slot takes most of its row's softmax weight and moves the output by
# O(|garbage v|), orders above any tolerance.
GARBAGE_SCALE = 64.0


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_list(name: str, v, *, n: int | None, lo: int, hi: int) -> list[int]:
    if (not isinstance(v, (list, tuple)) or (n is not None and len(v) != n) or not v
            or not all(_is_int(x) and lo <= x <= hi for x in v)):
        size = f"{n} " if n is not None else "1 or more "
        raise ValueError(f"ragged.{name} must be a list of {size}ints in [{lo}, {hi}], "
                         f"got {v!r}")
    return [int(x) for x in v]


def normalize_ragged(api: str, ragged, case) -> dict | None:
    """Validate ``case.ragged`` for ``api`` against the dense equivalent's fields; returns
    the normalised dict (None for dense). Raises ValueError naming the field."""
    if api not in APIS:
        raise ValueError(f"api must be one of {list(APIS)}, got {api!r}")
    if api == "dense":
        if ragged is not None:
            raise ValueError("ragged must be null for api 'dense'")
        return None
    if not isinstance(ragged, dict):
        raise ValueError(f"ragged must be an object for api {api!r}, got {ragged!r}")
    if case.layout != "bnhd":
        raise ValueError(f"layout must be 'bnhd' for api {api!r} (packed tokens), got "
                         f"{case.layout!r}")
    if case.mask["kind"] != "none":
        raise ValueError(f"mask must be 'none' for api {api!r}: its structure is in 'ragged'")
    if api == "varlen":
        allowed = {"seqlens_q", "seqlens_k"}
        unknown = sorted(set(ragged) - allowed)
        if unknown:
            raise ValueError(f"ragged: unknown field(s) {unknown}; allowed: {sorted(allowed)}")
        if case.B != 1:
            raise ValueError(f"B must be 1 for api 'varlen' (sequences are in ragged), got "
                             f"{case.B}")
        lq = _int_list("seqlens_q", ragged.get("seqlens_q"), n=None, lo=0, hi=1 << 16)
        lk = _int_list("seqlens_k", ragged.get("seqlens_k"), n=len(lq), lo=0, hi=1 << 16)
        if sum(lq) != case.Nq or sum(lk) != case.Nk:
            raise ValueError(f"Nq and Nk must be the totals of ragged.seqlens_q/_k "
                             f"({sum(lq)}, {sum(lk)}), got Nq={case.Nq}, Nk={case.Nk}")
        return {"seqlens_q": lq, "seqlens_k": lk}
    allowed = {"cache_seqlens", "page_size", "spare_blocks"}
    unknown = sorted(set(ragged) - allowed)
    if unknown:
        raise ValueError(f"ragged: unknown field(s) {unknown}; allowed: {sorted(allowed)}")
    if not 1 <= case.Nq <= MAX_NEW_TOKENS:
        raise ValueError(f"Nq (new tokens) must be in [1, {MAX_NEW_TOKENS}] for api 'decode', "
                         f"got {case.Nq}")
    lens = _int_list("cache_seqlens", ragged.get("cache_seqlens"), n=case.B, lo=case.Nq,
                     hi=1 << 20)
    if max(lens) != case.Nk:
        raise ValueError(f"Nk must be max(ragged.cache_seqlens) = {max(lens)}, got {case.Nk}")
    page = ragged.get("page_size")
    if not _is_int(page) or not 1 <= page <= PAGE_SIZE_MAX:
        raise ValueError(f"ragged.page_size must be an int in [1, {PAGE_SIZE_MAX}], got "
                         f"{page!r}")
    spare = ragged.get("spare_blocks", 0)
    if not _is_int(spare) or not 0 <= spare <= MAX_SPARE_BLOCKS:
        raise ValueError(f"ragged.spare_blocks must be an int in [0, {MAX_SPARE_BLOCKS}], got "
                         f"{spare!r}")
    if case.is_causal or case.window is not None:
        raise ValueError("is_causal and window must be unset for api 'decode' (its causal "
                         "rule is fixed by cache_seqlens)")
    if case.backward:
        raise ValueError("backward must be false for api 'decode' (forward only)")
    return {"cache_seqlens": lens, "page_size": page, "spare_blocks": spare}


def max_seqlens(case) -> tuple[int, int]:
    """The longest query and key sequence of a case (the dense Nq, Nk for dense cases)."""
    r = case.ragged
    if case.api == "varlen":
        return max(r["seqlens_q"]), max(r["seqlens_k"])
    return case.Nq, case.Nk


def short_ragged(case) -> str:
    """The API part of ``Case.short()``."""
    r = case.ragged
    if case.api == "varlen":
        pairs = ",".join(f"{a}/{b}" for a, b in zip(r["seqlens_q"], r["seqlens_k"],
                                                    strict=True))
        return f"varlen[{pairs}]"
    spare = f"+{r['spare_blocks']}" if r["spare_blocks"] else ""
    return (f"decode[{','.join(str(x) for x in r['cache_seqlens'])}] page={r['page_size']}"
            f"{spare}")


def _cu(lens: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    return out


def document_mask(lens_q, lens_k, *, is_causal, causal_alignment, window,
                  device="cpu") -> torch.Tensor:
    """The (Σ lens_q, Σ lens_k) bool mask of packed sequences: block-diagonal, sequence b's
    block its own causal/window rule (``structural_mask`` with its Lq, Lk)."""
    mask = torch.zeros(sum(lens_q), sum(lens_k), dtype=torch.bool, device=device)
    q0 = k0 = 0
    for lq, lk in zip(lens_q, lens_k, strict=True):
        if lq and lk:
            mask[q0:q0 + lq, k0:k0 + lk] = structural_mask(
                lq, lk, is_causal=is_causal, causal_alignment=causal_alignment,
                window=window, device=device)
        q0, k0 = q0 + lq, k0 + lk
    return mask


def ragged_mask(case) -> torch.Tensor:
    """The dense equivalent's bool mask on the CPU (module docstring)."""
    r = case.ragged
    if case.api == "varlen":
        return document_mask(r["seqlens_q"], r["seqlens_k"], is_causal=case.is_causal,
                             causal_alignment=case.causal_alignment,
                             window=case.window)[None, None]
    lens = torch.tensor(r["cache_seqlens"], dtype=torch.long)
    pos = lens[:, None] - case.Nq + torch.arange(case.Nq)[None, :]  # (B, Nq)
    return (torch.arange(case.Nk)[None, None, :] <= pos[:, :, None])[:, None]


def _pages(case) -> tuple[torch.Tensor, int]:
    """The block table (B, max_blocks) int32 and the pool size, drawn from the case seed."""
    r = case.ragged
    page = r["page_size"]
    need = [-(-n // page) for n in r["cache_seqlens"]]
    pool = sum(need) + r["spare_blocks"]
    perm = torch.randperm(pool, generator=stream(case.seed, "block_table"))
    width = max(need)
    table = torch.zeros(len(need), width, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at:at + n].to(torch.int32)
        # entries past the sequence's pages are never read: point them at a real block
        # holding another sequence's keys, the most misleading thing a kernel could read
        table[b, n:] = perm[(at + n) % pool] if n < width else 0
        at += n
    return table, pool


def api_args(case, device) -> dict:
    """What the kernel gets beside the tensors (the ``Inputs.api_args`` of a ragged case)."""
    r = case.ragged
    if case.api == "varlen":
        return {"api": "varlen", "cu_seqlens_q": _cu(r["seqlens_q"]).to(device),
                "cu_seqlens_k": _cu(r["seqlens_k"]).to(device),
                "max_seqlen_q": max(r["seqlens_q"]), "max_seqlen_k": max(r["seqlens_k"]),
                "is_causal": case.is_causal, "causal_alignment": case.causal_alignment,
                "window": case.window}
    table, pool = _pages(case)
    page = r["page_size"]
    g = stream(case.seed, "cache_garbage")
    shape = (pool, page, case.Hkv, case.D)
    garbage = [(torch.randn(shape, generator=g, dtype=torch.float64) * GARBAGE_SCALE)
               .to(case.torch_dtype).to(device) for _ in range(2)]
    # Where key j of sequence b lives in the pool, as a flat slot (block·page + offset), for
    # the keys that exist (``valid``, (B, Nk)): one scatter builds a cache (paged_cache).
    lens = torch.tensor(r["cache_seqlens"], dtype=torch.int32)
    j = torch.arange(case.Nk)
    valid = j[None, :] < lens[:, None]
    slots = (table.long()[:, j // page] * page + j % page)[valid]
    return {"api": "decode", "cache_seqlens": lens.to(device),
            "block_table": table.to(device), "page_size": page, "garbage": garbage,
            "valid": valid.to(device), "slots": slots.to(device)}


def paged_cache(dense: torch.Tensor, args: dict, which: int) -> torch.Tensor:
    """Scatter dense keys (``which`` 0) or values (1), (B, Hkv, Nk, D), into a copy of their
    garbage pool (num_blocks, page_size, Hkv, D) by the block table."""
    pool = args["garbage"][which].clone()
    pool.view(-1, *pool.shape[2:])[args["slots"]] = dense.transpose(1, 2)[args["valid"]]
    return pool


def call_ragged(fn, inputs):
    """Call a varlen/decode kernel on the dense-equivalent ``inputs``; returns its output in
    the dense (B, Hq, Nq, D) view (autograd flows through it) and None for the lse."""
    a = inputs.api_args
    scale = inputs.scale
    if a["api"] == "varlen":
        q, k, v = (t.transpose(1, 2)[0] for t in (inputs.query, inputs.key, inputs.value))
        kw = {"is_causal": a["is_causal"], "scale": scale}
        if a["window"] is not None:
            kw["window"] = a["window"]
        if a["causal_alignment"] != "top_left" and (a["is_causal"] or a["window"] is not None):
            kw["causal_alignment"] = a["causal_alignment"]
        out = fn(q, k, v, a["cu_seqlens_q"], a["cu_seqlens_k"], a["max_seqlen_q"],
                 a["max_seqlen_k"], **kw)
        out = out[0] if isinstance(out, tuple) else out
        if not isinstance(out, torch.Tensor) or out.dim() != 3:
            return out, None  # check_case's output check names the bad shape
        return out.unsqueeze(0).transpose(1, 2), None
    k_cache = paged_cache(inputs.key.detach(), a, 0)
    v_cache = paged_cache(inputs.value.detach(), a, 1)
    out = fn(inputs.query.transpose(1, 2), k_cache, v_cache, a["cache_seqlens"],
             a["block_table"], scale=scale)
    out = out[0] if isinstance(out, tuple) else out
    if not isinstance(out, torch.Tensor) or out.dim() != 4:
        return out, None
    return out.transpose(1, 2), None


def config_part(case) -> str:
    """The report bucket of the API: the sequence count, or the page size."""
    if case.api == "varlen":
        n = len(case.ragged["seqlens_q"])
        return "varlen:" + ("1 seq" if n == 1 else "2-4 seqs" if n <= 4 else ">4 seqs")
    p = case.ragged["page_size"]
    return "decode:" + ("page<=16" if p <= 16 else "page<=64" if p <= 64 else "page>64")


# ----------------------------------------------------------------------------------------
# PyTorch peers: the same APIs through SDPA per sequence, and FlexAttention over the packed
# tokens with a document mask.


def _rows_alive(allowed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` with the rows that have no allowed key set to 0 (the contract's fully masked
    rows; SDPA backends differ there)."""
    return out * allowed.any(-1, keepdim=True).to(out.dtype)


def _sdpa_masked(q, k, v, allowed, scale):
    """SDPA (1, H, Lq, D) against (1, Hkv, Lk, D) under a bool (Lq, Lk) mask, whichever
    backend PyTorch picks; rows without a key give 0."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return _rows_alive(allowed, out)


def sdpa_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                *, is_causal=False, scale=None, window=None, causal_alignment="top_left"):
    """The varlen API as one SDPA call per sequence (PyTorch picks the backend)."""

    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs = []
    for b in range(len(cq) - 1):
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        q = query[cq[b]:cq[b + 1]].transpose(0, 1).unsqueeze(0)
        if lq == 0:
            continue
        if lk == 0:
            outs.append(q[0].transpose(0, 1) * 0)  # no key: 0, still on the autograd graph
            continue
        k, v = (t[ck[b]:ck[b + 1]].transpose(0, 1).unsqueeze(0) for t in (key, value))
        allowed = structural_mask(lq, lk, is_causal=is_causal, causal_alignment=causal_alignment,
                                  window=window, device=query.device)
        outs.append(_sdpa_masked(q, k, v, allowed, scale)[0].transpose(0, 1))
    return torch.cat(outs) if outs else query[:0].clone()


def sdpa_decode(query, k_cache, v_cache, cache_seqlens, block_table, *, scale=None):
    """The decode API as one SDPA call per sequence on its keys gathered from the pages."""

    page = k_cache.shape[1]
    nq = query.shape[1]
    outs = []
    for b, n in enumerate(cache_seqlens.tolist()):
        blocks = block_table[b, : -(-n // page)].long()
        k, v = (c[blocks].flatten(0, 1)[:n].transpose(0, 1).unsqueeze(0)
                for c in (k_cache, v_cache))
        # query i at position n - nq + i: causal, bottom-right aligned
        allowed = structural_mask(nq, n, is_causal=True, causal_alignment="bottom_right",
                                  device=query.device)
        outs.append(_sdpa_masked(query[b].transpose(0, 1).unsqueeze(0), k, v, allowed,
                                 scale)[0].transpose(0, 1))
    return torch.stack(outs)


def _flex_varlen(device: str):
    from flashcheck.verify.adapters import compiled_static
    from torch.nn.attention.flex_attention import flex_attention

    run = compiled_static(flex_attention) if str(device).startswith("cuda") \
        else flex_attention

    def flex_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, *, is_causal=False, scale=None, window=None,
                    causal_alignment="top_left"):
        """FlexAttention over the packed tokens, B = 1, a document mask as an additive
        score_mod bias (one document id per token, and each document's causal/window rule)."""
        lens_q, lens_k = (c.diff().tolist() for c in (cu_seqlens_q, cu_seqlens_k))
        allowed = document_mask(lens_q, lens_k, is_causal=is_causal,
                                causal_alignment=causal_alignment, window=window,
                                device=query.device)
        bias = torch.zeros(allowed.shape, dtype=torch.float32, device=query.device).masked_fill(
            ~allowed, -float("inf"))

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[q_idx, kv_idx]

        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        out = run(q, k, v, score_mod=score_mod, scale=scale,
                  enable_gqa=query.shape[1] != key.shape[1])
        return _rows_alive(allowed, out[0]).transpose(0, 1)

    return flex_varlen


def peer(name: str, device: str):
    """A built-in kernel of the varlen/decode API other than ours, with its capabilities."""
    if name == "sdpa-decode":
        fn = sdpa_decode
        fn.capabilities = {"api": "decode", "gqa": True, "backward": False}
        return fn
    from flashcheck.verify.adapters import CPU_FLASH_FAMILY, FLEX_CUDA_HEAD_DIMS

    fn = sdpa_varlen if name == "sdpa-varlen" else _flex_varlen(device)
    on_cpu = str(device).startswith("cpu")
    fn.capabilities = {"api": "varlen", "gqa": True,
                       # PyTorch's CPU flash SDPA recomputes the backward's scores with its
                       # own GEMM blocking and keeps the gradients in the inputs' dtype (the
                       # opt-in family members)
                       **({"family": CPU_FLASH_FAMILY if on_cpu else ("bwd_scores_k16",)}
                          if name == "sdpa-varlen" else {}),
                       # FlexAttention has no backward on the CPU
                       "backward": name == "sdpa-varlen" or not on_cpu,
                       **({"head_dims": FLEX_CUDA_HEAD_DIMS}
                          if name == "flex-varlen" and not on_cpu else {}),
                       "extensions": ("window", "causal_alignment")}
    return fn

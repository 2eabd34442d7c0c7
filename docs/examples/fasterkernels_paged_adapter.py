"""fasterkernels 0.2.0: fskernels.paged_attn.paged_flash_decode, one new token per sequence, paged KV."""
import torch
from fskernels.paged_attn.triton_paged_attn import paged_flash_decode


def attention_decode(query, k_cache, v_cache, cache_seqlens, block_table, *, scale=None):
    if query.shape[1] != 1:
        raise NotImplementedError(f"{query.shape[1]} new tokens: it decodes one per sequence")
    if scale is not None and scale != query.shape[-1] ** -0.5:
        raise NotImplementedError("scale: it always uses 1/sqrt(D)")
    # its pools are (num_pages, Hkv, page_size, D): the same memory read through a transposed view
    out = paged_flash_decode(query[:, 0], k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                             block_table, cache_seqlens, k_cache.shape[1])
    return out[:, None]


attention_decode.capabilities = {"api": "decode", "dtypes": ("float16", "float32"), "head_dims": {16, 32, 64, 128, 256},
                                 "max_new_tokens": 1, "page_sizes": (16, 32, 64, 128, 256), "gqa": True, "backward": False,
                                 "tf32": torch.cuda.is_available(),
                                 "supports": lambda c: "scale is fixed" if c.scale not in (None, c.D ** -0.5) else None}

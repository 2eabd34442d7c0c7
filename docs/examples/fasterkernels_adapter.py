"""fasterkernels 0.2.0: fskernels.triton.triton_fa2.flash_attention_2_fwd(q, k, v, sm_scale), forward only."""
import torch
from fskernels.triton.triton_fa2 import flash_attention_2_fwd


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
    if attn_mask is not None or dropout_p or enable_gqa or is_causal:
        raise NotImplementedError("attn_mask, dropout_p, enable_gqa and is_causal are not supported")
    d = query.shape[-1]
    if d < 16 or d & (d - 1):
        raise NotImplementedError(f"head dim {d}: tl.arange(0, HEAD_DIM) needs a power of 2 >= 16")
    return flash_attention_2_fwd(query, key, value, sm_scale=scale)


# tf32: on a GPU its fp32 tl.dot runs at Triton's default input_precision, TF32 (exact fp32 in the
# CPU interpreter).
attention.capabilities = {"tf32": torch.cuda.is_available(), "dtypes": ("float16", "float32"), "head_dims": {16, 32, 64, 128, 256},
                          "masks": (), "gqa": False, "backward": False,
                          "supports": lambda c: "is_causal not supported" if c.is_causal else None}

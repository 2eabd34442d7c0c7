"""flash-attention-x 0.0.1: flash_attention_x.flash_attn(q, k, v, causal, sm_scale) on (B, H, N, D)."""
import types
import torch
import triton.language as tl
import flash_attention_x.flash_attention_causal as fax

# CPU patch: forward/backward call torch.cuda.current_device()/set_device(q.device.index).
_cuda = types.SimpleNamespace(current_device=lambda: 0, set_device=lambda index: None)
fax.torch = types.SimpleNamespace(**{n: getattr(torch, n) for n in dir(torch) if n != "cuda"}, cuda=_cuda)
tl.math.max = tl.maximum  # Triton 3 patch: the causal backward calls tl.math.max (removed after Triton 2.x)
def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
              causal_alignment="top_left"):
    if attn_mask is not None or dropout_p or enable_gqa or (is_causal and causal_alignment == "top_left"
                                                            and query.shape[2] != key.shape[2]):
        raise NotImplementedError("no attn_mask, dropout, GQA, or top-left causal with Nq != Nk (bottom-right only)")
    return fax.flash_attn(query, key, value, causal=is_causal, sm_scale=scale)
attention.capabilities = {  # tf32: on a GPU its fp32 tl.dot runs at Triton's default precision, TF32
    "tf32": torch.cuda.is_available(), "dtypes": ("float16", "float32"), "head_dims": {16, 32, 64, 128}, "masks": (),
    "gqa": False, "backward": True, "extensions": ("causal_alignment",), "supports": lambda c: (
        "top-left causal with Nq != Nk" if c.is_causal and c.Nq != c.Nk and c.causal_alignment == "top_left" else None)}

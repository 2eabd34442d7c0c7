"""flash-attention-triton 0.1.1: flash_attention_v2(q, k, v, softmax_scale), always causal (top-left)."""
import inspect
import torch
import flash_attention_triton.flash_attention_2 as fa2

if not torch.cuda.is_available():  # CPU patches (Triton interpreter); on a GPU it runs as published
    # The wrapper asserts q.is_cuda and picks its tiles from the compute capability (never patch this on a GPU:
    # Triton takes its compile target from it). The backward autotunes 2 configs (needs a GPU): keep the first.
    torch.cuda.get_device_capability = lambda device=None: (8, 0)  # Ampere+, Triton >= 3.3 tiles
    del fa2.NEW_AMPERE_PLUS_BACKWARD_AUTOTUNE_CONFIGS_NON_DETERMINISTIC[1:]
    src = inspect.getsource(fa2._flash_attention_forward)
    exec(src.replace("assert q.is_cuda", "assert True or q.is_cuda"), fa2.__dict__)

def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if attn_mask is not None or dropout_p or enable_gqa or not is_causal:
        raise NotImplementedError("attn_mask, dropout_p, enable_gqa and is_causal=False (always causal) unsupported")
    return fa2.flash_attention_v2(query, key, value, softmax_scale=scale)

attention.capabilities = {"dtypes": ("float16",), "head_dims": (1, 256), "masks": (), "gqa": False,
                          "backward": True, "supports": lambda c: None if c.is_causal else "causal only"}

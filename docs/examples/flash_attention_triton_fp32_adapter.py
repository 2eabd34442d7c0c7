"""flash-attention-triton 0.1.1 called with float32 tensors (the wrapper computes them in float16)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flash_attention_triton_adapter import attention as _fp16_adapter  # noqa: E402


def attention(*args, **kwargs):
    return _fp16_adapter(*args, **kwargs)


attention.capabilities = {**_fp16_adapter.capabilities, "dtypes": ("float32",)}

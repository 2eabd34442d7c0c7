"""flash-attn-triton 0.1.1, triton_kernel/flash_attn_dao.py: FlashAttention's Triton kernel
(FlashAttnFunc.apply(q, k, v, bias, causal, softmax_scale) on (B, N, H, D); fp16/bf16, D <= 128,
additive bias of shape (.., 1, Nk) or (.., Nq, Nk), top-left causal, forward and backward)."""
import hashlib
import importlib.util
import os
import re
import tempfile
import torch

# Ported to Triton 3 and loaded from the ported copy of its file. The port is mechanical and
# changes no arithmetic: tl.dot(a, b, trans_b=True) -> tl.dot(a, tl.trans(b)), and trans_a
# likewise (Triton 2.0's keywords, removed since). Loaded from a file, not imported: the
# package's __init__ imports triton.tools.experimental_descriptor, which Triton 3.4+ removed.
_root = importlib.util.find_spec("flash_attn_triton").submodule_search_locations[0]
with open(os.path.join(_root, "triton_kernel", "flash_attn_dao.py")) as _f:
    _src = _f.read()
_src = re.sub(r"tl\.dot\(([^,]+), (\w+), trans_b=True\)", r"tl.dot(\1, tl.trans(\2))", _src)
_src = re.sub(r"tl\.dot\(([^,]+|\w+\.to\(\w+\.dtype\)), (\w+), trans_a=True\)",
              r"tl.dot(tl.trans(\1), \2)", _src)
if not torch.cuda.is_available():  # CPU patch (Triton interpreter): the wrappers assert is_cuda
    _src = _src.replace("assert q.is_cuda", "assert True or q.is_cuda").replace(
        "assert bias.is_cuda", "assert True or bias.is_cuda")
assert "trans_a" not in _src and "trans_b" not in _src
_path = os.path.join(tempfile.gettempdir(), "flash_attn_dao_%s.py" % hashlib.sha1(_src.encode()).hexdigest()[:12])
if not os.path.exists(_path):
    with open(_path + ".tmp%d" % os.getpid(), "w") as _f:
        _f.write(_src)
    os.replace(_path + ".tmp%d" % os.getpid(), _path)
_spec = importlib.util.spec_from_file_location("flash_attn_dao", _path)
dao = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dao)
if not torch.cuda.is_available():
    # The backward autotunes over 2 configs (SEQUENCE_PARALLEL off/on); benchmarking needs a
    # GPU: keep the first on the CPU.
    dao._bwd_kernel.configs = dao._bwd_kernel.configs[:1]


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
    if dropout_p or enable_gqa:
        raise NotImplementedError("dropout_p and enable_gqa are not supported")
    B, H, Nq, _ = query.shape
    Nk = key.shape[2]
    bias = None
    if attn_mask is not None:  # a boolean mask becomes the additive bias users pass (-inf off)
        bias = attn_mask if attn_mask.dtype != torch.bool else torch.zeros(
            attn_mask.shape, dtype=torch.float32, device=attn_mask.device
        ).masked_fill(~attn_mask, float("-inf"))
        if bias.dtype not in (query.dtype, torch.float32):
            bias = bias.float()
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape)).expand(B, H, Nq, Nk)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, N, H, D) views
    return dao.FlashAttnFunc.apply(q, k, v, bias, is_causal, scale).transpose(1, 2)


attention.capabilities = {"dtypes": ("float16", "bfloat16"), "head_dims": (1, 128),
                          "masks": ("bool", "additive"), "mask_broadcast": True,
                          "causal_with_mask": True, "gqa": False, "backward": True}

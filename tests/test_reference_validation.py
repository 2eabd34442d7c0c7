"""Bad input to the reference oracles raises an error that names the argument.

Every oracle shares the checks of ``reference._validate``; each bad input is tried on each
oracle. The message must start with the argument's name (``"key: expected ..."``).
"""

from __future__ import annotations

import math

import pytest
import torch

from flashcheck import reference

ORACLES = {
    "attention_fp64": reference.attention_fp64,
    "online_exact": lambda **kw: reference.online_attention(**kw, precision="exact"),
    "online_emulate": reference.online_attention,
    "naive": reference.naive_attention,
}


def _good(**over):
    g = torch.Generator().manual_seed(0)
    kw = dict(
        query=torch.randn(2, 4, 5, 8, generator=g),
        key=torch.randn(2, 4, 6, 8, generator=g),
        value=torch.randn(2, 4, 6, 8, generator=g),
    )
    kw.update(over)
    return kw


def _t(*shape, dtype=torch.float32, device="cpu"):
    return torch.zeros(*shape, dtype=dtype, device=device)


# (id, overrides, exception, argument named at the start of the message)
BAD = [
    ("query_3d", dict(query=_t(4, 5, 8)), ValueError, "query"),
    ("query_int", dict(query=_t(2, 4, 5, 8, dtype=torch.int32)), ValueError, "query"),
    ("query_empty", dict(query=_t(2, 4, 0, 8)), ValueError, "query"),
    ("query_not_tensor", dict(query=[[1.0]]), ValueError, "query"),
    ("key_batch", dict(key=_t(3, 4, 6, 8)), ValueError, "key"),
    ("key_headdim", dict(key=_t(2, 4, 6, 7)), ValueError, "key"),
    ("key_dtype", dict(key=_t(2, 4, 6, 8, dtype=torch.float16)), ValueError, "key"),
    ("key_device", dict(key=_t(2, 4, 6, 8, device="meta")), ValueError, "key"),
    ("value_shape", dict(value=_t(2, 4, 7, 8)), ValueError, "value"),
    ("value_device", dict(value=_t(2, 4, 6, 8, device="meta")), ValueError, "value"),
    ("heads_without_gqa", dict(key=_t(2, 2, 6, 8), value=_t(2, 2, 6, 8)), ValueError, "key"),
    (
        "heads_not_dividing",
        dict(key=_t(2, 3, 6, 8), value=_t(2, 3, 6, 8), enable_gqa=True), ValueError, "key",
    ),
    ("gqa_not_bool", dict(enable_gqa=1), ValueError, "enable_gqa"),
    ("mask_not_broadcastable", dict(attn_mask=_t(5, 5)), ValueError, "attn_mask"),
    ("mask_5d", dict(attn_mask=_t(1, 2, 4, 5, 6)), ValueError, "attn_mask"),
    ("mask_int", dict(attn_mask=_t(5, 6, dtype=torch.int64)), ValueError, "attn_mask"),
    ("mask_nan", dict(attn_mask=torch.full((5, 6), math.nan)), ValueError, "attn_mask"),
    ("mask_pos_inf", dict(attn_mask=torch.full((5, 6), math.inf)), ValueError, "attn_mask"),
    ("mask_device", dict(attn_mask=_t(5, 6, device="meta")), ValueError, "attn_mask"),
    ("dropout_nonzero", dict(dropout_p=0.1), NotImplementedError, "dropout_p"),
    ("dropout_out_of_range", dict(dropout_p=1.0), ValueError, "dropout_p"),
    ("dropout_negative", dict(dropout_p=-0.1), ValueError, "dropout_p"),
    ("causal_not_bool", dict(is_causal="yes"), ValueError, "is_causal"),
    ("scale_nan", dict(scale=math.nan), ValueError, "scale"),
    ("scale_zero", dict(scale=0.0), ValueError, "scale"),
    ("scale_negative", dict(scale=-1.0), ValueError, "scale"),
    ("scale_inf", dict(scale=math.inf), ValueError, "scale"),
    ("window_below_minus_one", dict(window=(-2, 0)), ValueError, "window"),
    ("window_length", dict(window=(1,)), ValueError, "window"),
    ("window_float", dict(window=(1.5, 2)), ValueError, "window"),
    ("alignment_unknown", dict(causal_alignment="center"), ValueError, "causal_alignment"),
]


@pytest.mark.parametrize("oracle", ORACLES.values(), ids=ORACLES.keys())
@pytest.mark.parametrize("over, exc, arg", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_names_argument(oracle, over, exc, arg):
    with pytest.raises(exc, match=rf"^{arg}: "):
        oracle(**_good(**over))


ONLINE_BAD = [
    ("block_m_zero", dict(block_m=0), "block_m"),
    ("block_n_negative", dict(block_n=-1), "block_n"),
    ("block_m_float", dict(block_m=2.5), "block_m"),
    ("order_unknown", dict(order="fa3"), "order"),
    ("precision_unknown", dict(precision="half"), "precision"),
]


@pytest.mark.parametrize("over, arg", [b[1:] for b in ONLINE_BAD], ids=[b[0] for b in ONLINE_BAD])
def test_online_bad_options_name_argument(over, arg):
    with pytest.raises(ValueError, match=rf"^{arg}: "):
        reference.online_attention(**_good(**over))


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        (dict(D=0, N=4, score_abs_max=1.0, v_abs_max=1.0), "D"),
        (dict(D=4, N=0, score_abs_max=1.0, v_abs_max=1.0), "N"),
        (dict(D=4, N=4, score_abs_max=math.nan, v_abs_max=1.0), "score_abs_max"),
        (dict(D=4, N=4, score_abs_max=1.0, v_abs_max=-1.0), "v_abs_max"),
        (dict(D=4, N=4, score_abs_max=1.0, v_abs_max=1.0, bias_abs_max=math.inf),
         "bias_abs_max"),
    ],
    ids=["D", "N", "score_nan", "v_negative", "bias_inf"],
)
def test_error_bound_bad_input(kwargs, arg):
    with pytest.raises(ValueError, match=rf"^{arg}: "):
        reference.emulate_error_bound("float16", **kwargs)


def test_error_bound_bad_dtype():
    with pytest.raises(ValueError, match=r"^dtype: "):
        reference.emulate_error_bound("int8", D=4, N=4, score_abs_max=1.0, v_abs_max=1.0)


@pytest.mark.parametrize(
    "args, kwargs, arg",
    [
        ((-1, 3), {}, "Nq"),
        ((2, 2.0), {}, "Nk"),
        ((2, 2), dict(window=(-3, 1)), "window"),
        ((2, 2), dict(causal_alignment="left"), "causal_alignment"),
    ],
    ids=["negative_length", "float_length", "window", "alignment"],
)
def test_structural_mask_bad_input(args, kwargs, arg):
    with pytest.raises(ValueError, match=rf"^{arg}: "):
        reference.structural_mask(*args, **kwargs)

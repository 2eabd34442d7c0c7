"""Dense masks for the attention semantics of docs/contracts.md §1.

``structural_mask`` turns ``is_causal`` / ``causal_alignment`` / ``window`` into the (Nq, Nk)
bool tensor (True = may attend) that every implementation must agree on. ``combined_mask``
intersects that structure with a user ``attn_mask`` and returns the pair
``(allowed, bias)`` broadcast to (B, Hq, rows, cols); it can cut out any block of rows and
columns so that the chunked oracles never build an (Nq, Nk) tensor.

Caveats: the returned tensors are broadcast *views* (``expand``) of small tensors; do not
write into them. An additive mask's -inf entries are left in ``bias`` (not folded into
``allowed``): adding -inf to a score is already "masked" for a softmax.
"""

from __future__ import annotations

import numbers

import torch

from ._validate import check_alignment, check_window


def _check_length(name: str, n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise ValueError(f"{name}: expected an int >= 0; got {n!r}")
    return int(n)


def structural_block(
    Nq: int, Nk: int, rows: tuple[int, int], cols: tuple[int, int], *,
    is_causal: bool = False, causal_alignment: str = "top_left",
    window: tuple[int, int] | None = None, device=None,
) -> torch.Tensor | None:
    """Rows ``rows[0]:rows[1]`` and columns ``cols[0]:cols[1]`` of ``structural_mask``.

    Returns None when there is no structural restriction at all (every key allowed).
    """
    check_alignment(causal_alignment)
    window = check_window(window)
    if not is_causal and window is None:
        return None
    off = 0 if causal_alignment == "top_left" else Nk - Nq
    i = torch.arange(rows[0], rows[1], device=device).unsqueeze(1) + off
    j = torch.arange(cols[0], cols[1], device=device).unsqueeze(0)
    allowed = torch.ones(rows[1] - rows[0], cols[1] - cols[0], dtype=torch.bool, device=device)
    if is_causal:
        allowed &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
    return allowed


def structural_mask(
    Nq: int, Nk: int, *, is_causal: bool = False, causal_alignment: str = "top_left",
    window: tuple[int, int] | None = None, device=None,
) -> torch.Tensor:
    """The (Nq, Nk) bool mask of ``is_causal`` and ``window`` (True = query i may see key j).

    With ``off = 0`` (top_left) or ``Nk - Nq`` (bottom_right): causal allows ``j <= i + off``;
    ``window=(left, right)`` allows ``i + off - left <= j <= i + off + right`` (-1 = unbounded).
    Both rules intersect. Without either rule every entry is True.
    """
    Nq = _check_length("Nq", Nq)
    Nk = _check_length("Nk", Nk)
    m = structural_block(
        Nq, Nk, (0, Nq), (0, Nk), is_causal=is_causal, causal_alignment=causal_alignment,
        window=window, device=device,
    )
    if m is None:
        m = torch.ones(Nq, Nk, dtype=torch.bool, device=device)
    return m


def _mask_block(attn_mask: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]):
    """Slice a mask broadcastable to (B, Hq, Nq, Nk) to the given rows/cols (size-1 dims kept)."""
    m = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    if m.shape[2] != 1:
        m = m[:, :, rows[0]:rows[1]]
    if m.shape[3] != 1:
        m = m[:, :, :, cols[0]:cols[1]]
    return m


def combined_mask(
    attn_mask: torch.Tensor | None, shape: tuple[int, int, int, int], *,
    is_causal: bool = False, causal_alignment: str = "top_left",
    window: tuple[int, int] | None = None, rows: tuple[int, int] | None = None,
    cols: tuple[int, int] | None = None, device=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Intersect the structural mask with ``attn_mask`` on a block of (B, Hq, Nq, Nk).

    ``shape`` is (B, Hq, Nq, Nk); ``rows``/``cols`` select ``[start, stop)`` (default: all).
    Returns ``(allowed, bias)``: ``allowed`` a bool tensor expanded to
    (B, Hq, rows, cols); ``bias`` the additive mask on the same block (expanded, in the
    mask's dtype) or None when ``attn_mask`` is None or bool.
    """
    B, Hq, Nq, Nk = shape
    rows = (0, Nq) if rows is None else rows
    cols = (0, Nk) if cols is None else cols
    full = (B, Hq, rows[1] - rows[0], cols[1] - cols[0])
    allowed = structural_block(
        Nq, Nk, rows, cols, is_causal=is_causal, causal_alignment=causal_alignment,
        window=window, device=device,
    )
    if allowed is None:
        allowed = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
    bias = None
    if attn_mask is not None:
        block = _mask_block(attn_mask, rows, cols)
        if attn_mask.dtype == torch.bool:
            allowed = allowed & block
        else:
            bias = block.expand(full)
    return allowed.expand(full), bias

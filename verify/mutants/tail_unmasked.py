"""Mutant (Triton): the last key tile is not masked when Nk is not a multiple of the tile.

The loads of K and V are bounds-masked (out-of-range rows read as zeros) but the scores of
the columns past Nk are not set to -inf, so each padded key gets score 0 (plus nothing) and
takes softmax weight with a zero value vector: l is too large and the output shrinks toward
0. Bites when Nk % 16 != 0 and the padded columns are allowed by the causal/window rules
(non-causal rows, or causal rows i >= Nk when Nq > Nk).
"""

from flashcheck.verify.mutants._triton_fwd import TritonForward


class _TailUnmasked(TritonForward):
    mask_tail = False


attention = _TailUnmasked()
capabilities = attention.capabilities

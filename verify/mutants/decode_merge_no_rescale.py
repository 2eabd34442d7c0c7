"""Mutant: the split-KV merge weights each split by its l alone, without exp(m_s - m).

Each split's output is normalised by its own running max and sum; merging them with weights
l_s / Σ l_s ignores that the splits' maxima differ (the combine step's max rescaling
forgotten). Bites when a sequence has two splits or more (more than 16 keys) whose maxima
differ, i.e. almost always then.
"""

import torch
from flashcheck.verify.mutants._ragged import DecodeAttention


class _MergeNoRescale(DecodeAttention):
    def merge(self, parts):
        w = torch.stack([li for _, _, li in parts])
        total = w.sum(0)
        out = sum(wi * o for wi, (o, _, _) in zip(w, parts, strict=True))
        return out / torch.where(total > 0, total, 1.0)


attention = _MergeNoRescale()
capabilities = attention.capabilities

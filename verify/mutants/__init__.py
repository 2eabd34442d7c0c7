"""The mutant catalogue: wrong attention kernels the harness must catch.

Each entry is a module in this package exporting `attention` (the SDPA signature of
docs/contracts.md section 1, with the `window` and `causal_alignment` extensions) and a
`capabilities` dict. Every module is right except for one planted bug, named in its
docstring with the inputs where it bites, so a harness that misses it has a blind spot on
those inputs. Two kinds:

- "bug": a numerical bug class seen in real attention kernels;
- "adversarial": a kernel built to pass a weak harness (uninitialised output, input
  mutation, per-shape caching, zeroing small outputs, key subsampling).

The mutants share correct bases, `_blocked.py` (PyTorch, forward and FA2 backward with
named hooks), `_triton_fwd.py` (Triton forward with constexpr bug switches) and `_ragged.py`
(the varlen and paged decode APIs, PyTorch, with hooks; those mutants export their varlen or
decode callable as `attention` and declare the API in `capabilities`), and never import
`kernels/`, so they stay independent of the kernel under test.
`verify.selftest` runs the catalogue; `flashcheck fuzz --kernel verify/mutants/NAME.py:attention`
runs one.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

_HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Mutant:
    """One catalogue entry: the module `verify.mutants.<name>` and what its bug is."""

    name: str
    kind: str  # "bug" or "adversarial"
    impl: str  # "triton" or "pytorch"
    bug: str  # one line: the bug and where it bites

    @property
    def path(self) -> Path:
        return _HERE / f"{self.name}.py"

    @property
    def spec(self) -> str:
        """The `--kernel` spec users would pass: path/to/file.py:attention."""
        return f"{self.path}:attention"

    def load(self):
        """The module's `attention` callable."""
        return importlib.import_module(f"{__name__}.{self.name}").attention


CATALOGUE: tuple[Mutant, ...] = (
    Mutant("rescale_div_l", "bug", "pytorch",
           "accumulator divided by l every tile, P@V added unnormalised; Nk > 16"),
    Mutant("tail_unmasked", "bug", "triton",
           "last key tile's padded columns not masked; Nk % 16 != 0"),
    Mutant("causal_off_by_one", "bug", "pytorch",
           "causal rule j <= i + 1: each query sees the next key; is_causal"),
    Mutant("no_max_subtraction", "bug", "pytorch",
           "exp(s) without the running max; overflows on large logits"),
    Mutant("lse_without_log", "bug", "pytorch",
           "saved lse = m, not m + log l; backward only"),
    Mutant("wrong_delta", "bug", "pytorch",
           "backward delta = rowsum(dO*dO), not rowsum(dO*O); dQ, dK"),
    Mutant("gqa_head_mapping", "bug", "pytorch",
           "query head h reads kv head h % Hkv; Hkv > 1 and Hq/Hkv > 1"),
    Mutant("scale_ignored", "bug", "pytorch",
           "scale argument ignored (always 1/sqrt(D)); scale != 1/sqrt(D)"),
    Mutant("mask_batch0", "bug", "triton",
           "batched mask read from batch 0; B > 1 with a per-batch mask"),
    Mutant("contiguous_strides", "bug", "triton",
           "strides derived from the shape; non-contiguous layouts"),
    Mutant("nan_dead_rows", "bug", "pytorch",
           "no -inf guard: NaN on fully-masked rows (and leading masked tiles)"),
    Mutant("fp16_accumulation", "bug", "pytorch",
           "accumulator and l stored in fp16; precision, tight bounds only"),
    Mutant("causal_alignment_ignored", "bug", "pytorch",
           "bottom_right treated as top_left; Nq != Nk with causal/window"),
    Mutant("window_off_by_one", "bug", "pytorch",
           "window left edge exclusive (one key too few); windows that cut rows"),
    Mutant("dk_unscaled", "bug", "pytorch",
           "dK missing the softmax scale; backward only"),
    Mutant("gqa_grad_overwrite", "bug", "pytorch",
           "GQA dK/dV overwritten per query head, not summed; backward, Hq/Hkv > 1"),
    Mutant("pv_fp16_accumulation", "bug", "pytorch",
           "each tile's P@V rounded to fp16 before the fp32 acc; precision, fp32/fp16"),
    Mutant("p_bf16_for_fp16", "bug", "pytorch",
           "P rounded to bf16 (not fp16) before P@V on fp16 inputs; precision, 3-10x"),
    Mutant("lse_input_dtype", "bug", "pytorch",
           "saved lse stored in the input dtype; precision, backward, fp16/bf16"),
    Mutant("ds_bf16_for_dk", "bug", "pytorch",
           "dS rounded to fp16 for dQ but to bf16 for dK on fp16 inputs; precision, dK"),
    Mutant("varlen_neighbour_keys", "bug", "pytorch",
           "varlen: a sequence's keys end one late (its neighbour's first key); 2+ seqs"),
    Mutant("varlen_cu_off_by_one", "bug", "pytorch",
           "varlen: output rows of sequences after the first written one row early"),
    Mutant("varlen_causal_global", "bug", "pytorch",
           "varlen: causal rule on packed token indices; causal, unequal Lq/Lk before b"),
    Mutant("decode_block_table_ignored", "bug", "pytorch",
           "decode: pages read as if the cache were contiguous per sequence"),
    Mutant("decode_page_off_by_one", "bug", "pytorch",
           "decode: page j read from block_table[b, j + 1]; 2+ pages"),
    Mutant("decode_merge_no_rescale", "bug", "pytorch",
           "decode: split-KV merge without the max rescaling; > 16 keys (2+ splits)"),
    Mutant("decode_tail_unmasked", "bug", "pytorch",
           "decode: empty slots of the last partial page attended; Lk % page != 0"),
    Mutant("uninitialized_output", "adversarial", "pytorch",
           "returns torch.empty (may hold the reference's freed output)"),
    Mutant("mutates_inputs", "adversarial", "pytorch",
           "right output, then scales query in place"),
    Mutant("shape_cache", "adversarial", "pytorch",
           "caches one output per shape and replays it"),
    Mutant("zero_small_outputs", "adversarial", "pytorch",
           "flushes |out| < 1e-2 to zero (passes a loose bf16 atol)"),
    Mutant("key_subsample", "adversarial", "pytorch",
           "attends to every other key when Nk > 32"),
)


def by_name(name: str) -> Mutant:
    """The catalogue entry called `name`; ValueError listing the names otherwise."""
    for m in CATALOGUE:
        if m.name == name:
            return m
    raise ValueError(f"mutant must be one of {[m.name for m in CATALOGUE]}, got {name!r}")

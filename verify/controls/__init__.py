"""The control catalogue: correct-but-different kernels the harness must pass.

The other half of the self-test (verify/selftest.py): a harness that kills every mutant but
also fails correct kernels is useless. Each control computes the right answer by a different
route: other tile sizes, FlashAttention-1's update order, fp32 throughout (more accurate than
the baseline), one control per correct implementation choice of docs/DESIGN.md section 5's
family (GQA reduced per head, subnormals flushed, exp2 with a folded scale, the scale fused
into the exponent, Q prescaled, dS scaled before its rounding, the split-KV forward), the
blocked PyTorch base of the mutants, the Triton base of the Triton mutants, and the references
themselves (`reference`: float64 rounded to the input dtype; `online`: the emulated flash
model).
Each entry is a kernel spec for `verify.adapters.resolve_kernel`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

_HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Control:
    """One correct kernel: a module of this package, or a built-in spec name."""

    name: str
    what: str  # one line: how it differs from the baseline
    builtin: bool = False
    # its kernel runs under the Triton interpreter on the CPU: the campaigns that take
    # longest (2,000 examples: 815-2,732 s against 40-144 s for the others), started first
    interpreted: bool = False

    @property
    def spec(self) -> str:
        return self.name if self.builtin else f"{_HERE / self.name}.py:attention"

    @property
    def module_spec(self) -> str:
        """The spec by module, the same on every machine (``spec`` names this one's file)."""
        return self.name if self.builtin else f"{__name__}.{self.name}:attention"


CONTROLS: tuple[Control, ...] = (
    Control("blocked_fa2", "blocked PyTorch FA2, fp32 accumulation, tiles of 16 (mutant base)"),
    Control("blocked_tile64", "blocked PyTorch FA2 with tiles of 64"),
    Control("fa1_order", "FA1 update order: normalised accumulator, no final division"),
    Control("fp32_throughout", "P and dS kept in fp32 (more accurate than the baseline)"),
    Control("gqa_per_head_rounded",
            "GQA dK/dV rounded per query head, then summed (FA2 CUDA backward)"),
    Control("gqa_expand_autograd", "GQA by repeat_interleave of K/V; autograd sums dK/dV"),
    Control("gqa_group_fp32",
            "GQA dK/dV: one fp32 accumulator per kv head, the group's heads added in turn"),
    Control("flush_to_zero", "subnormals flushed to zero (FTZ/DAZ): fp32-range inputs, "
                             "input-dtype P, dS and results"),
    Control("ftz_delta", "flush-to-zero in D = rowsum(dO * O) alone, dP = dO V^T keeping "
                         "subnormals (FA2 CUDA's --use_fast_math preprocessing)"),
    Control("daz_bf16_gemms", "the backward's products read subnormal inputs as zero, D_i "
                              "keeps them (AVX512-BF16 VDPBF16PS: PyTorch's CPU flash "
                              "backward)"),
    Control("fp32_fma_chain", "fp32 dK/dV as running sums, one FMA per product (Triton's "
                              "IEEE fp32 tl.dot on CUDA; declares fp32_fma_chain)"),
    Control("fp32_3xtf32", "every fp32 product as three TF32 products of split operands "
                           "(CUTLASS 3xTF32, PyTorch's memory-efficient SDPA; declares "
                           "fp32_3xtf32)"),
    Control("tf32_matmuls", "every fp32 product's operands rounded to TF32 (declares tf32)"),
    Control("tf32_truncated",
            "every fp32 product's operands truncated to TF32, Hopper wgmma (declares tf32)"),
    Control("exp2_folded_scale", "scale * log2(e) as one fp32 constant, exp2, base-2 lse"),
    Control("exp2_approx", "exp2_folded_scale with exp2 to 22 bits (the GPUs' ex2.approx.f32)"),
    Control("q_prescaled", "Q * scale rounded to the input dtype before QK^T"),
    Control("qk_sqrt_scaled", "Q and K each times fl(sqrt(scale)) in fp32 before QK^T "
                              "(PyTorch's math SDPA; declares qk_sqrt_scaled)"),
    Control("fa2_cuda_softmax",
            "exp2(s * scale_log2 - max_scaled) as one FFMA, O = acc * (1/l) (FA2 CUDA)"),
    Control("ds_scaled_before_round", "scale * dS rounded to the input dtype, not dS"),
    Control("ds_p_rounded", "dS from P as rounded for the dV product, scaled, then rounded "
                            "(CUTLASS memory-efficient backward: PyTorch's efficient SDPA)"),
    Control("split_kv", "split-KV forward: 3 key splits merged by their lse in fp32 (FA2 combine)"),
    Control("bwd_scores_reordered", "backward recomputes QKᵀ in steps of 32 over the head dim"),
    Control("bwd_k_prescaled", "backward recomputes S = Q·fl(K·scale), the forward "
                               "fl(QKᵀ)·scale (PyTorch's CPU flash backward on AVX-512; "
                               "declares bwd_k_prescaled)"),
    Control("bias_fma_split", "QKᵀ·scale + bias as one FMA with the product exact in the "
                              "forward, the product rounded first in the backward "
                              "(declares bias_fma_split)"),
    Control("p_normalized", "softmax over the whole row, P = e^(s-m)/l rounded to the input "
                            "dtype, then P@V (FlexAttention's eager path; declares "
                            "p_normalized)"),
    Control("grads_input_dtype", "dQ/dK/dV held in the input dtype between tiles, each "
                                 "tile's fp32 product added and rounded (PyTorch's CPU flash "
                                 "backward; declares grads_input_dtype)"),
    Control("fwd_fast_exp", "the forward's probabilities from a fast exp (a cubic after range "
                            "reduction, 1e-4), rescale factors and backward exact (PyTorch's "
                            "CPU flash forward below fp32; declares fwd_fast_exp)"),
    Control("triton_fwd", "Triton forward, tiles of 16 (Triton mutant base)", interpreted=True),
    Control("triton_tile32", "Triton forward, tiles of 32", interpreted=True),
    Control("reference", "float64 oracle rounded to the input dtype", builtin=True),
    Control("online", "emulated flash model (reference.online_attention)", builtin=True),
)

"""The family of correct implementation choices (DESIGN.md §5), as ``online_attention`` runs.

A flash kernel is correct if its error is of the size that some legitimate way of computing
attention makes. Each member of ``FAMILY`` is one such way: the emulated blocked kernel of
``reference.online_attention`` (fp32 accumulation, operands in the input dtype) with one
implementation choice changed from the baseline ``fa2_128``. ``FAMILY_NOTES`` names, for
each member, real kernels that make its choice.

- ``FAMILY``: ordered mapping name -> keyword arguments of ``online_attention`` (every
  member spells out its block sizes; the rest default as in ``SWITCH_DEFAULTS``).
- ``family_members(dtype, gqa=, tf32=)``: the members that apply to a problem: the GQA
  members only when Hq != Hkv; ``p_ds_fp32``, ``gqa_per_head_rounded`` and
  ``gqa_expand_autograd`` only below fp32 (for fp32 inputs they *are* the baseline);
  ``tf32`` and ``tf32_truncated`` only for fp32 inputs whose kernel declares TF32;
  ``exp2_approx`` only for fp32 inputs;
  the :data:`OPT_IN` members (``q_prescaled``,
  ``q_exp2_prescaled``, ``split_kv``, ``bwd_scores_k16``, ``qk_sqrt_scaled``,
  ``fp32_fma_chain``, ``fp32_3xtf32``, ``bias_fma_split``, ``p_normalized``,
  ``grads_input_dtype``, ``fwd_fast_exp``) only when the kernel declares them
  (``fp32_fma_chain`` and ``fp32_3xtf32`` for fp32 inputs without TF32 only,
  ``p_normalized``, ``grads_input_dtype`` and ``fwd_fast_exp`` below fp32 only);
  declaring ``split_kv`` brings ``split_kv_halves``, declaring ``bwd_scores_k16`` brings
  ``bwd_scores_k8`` and ``bwd_scores_k1``, declaring ``fwd_fast_exp`` brings
  ``fwd_fast_exp_low`` and ``fwd_fast_exp_high``, declaring ``bias_fma_split`` brings
  ``bias_fma_split_e`` (the same contraction in natural-log units).
- ``run_family(query, key, value, grad_out, ...)``: every member on the same inputs; per
  member the output and (with ``grad_out``) dq, dk, dv, exactly as
  ``online_attention(..., **kwargs)`` and autograd with that ``grad_out`` give them.
  Members share work: one forward per distinct forward configuration, one backward per
  distinct backward configuration (loop order aside: FA1 and FA2 forwards that give the
  same out and lse share the backward), the GQA members differing only in the final
  reduction.

Caveats: the members are single choices away from the baseline (``split_kv`` also takes
16-key tiles, so that the CPU suite's short sequences split), not all their
combinations (a kernel combining two choices is expected to stay within K × the worst of
them; the combination is not run). Block sizes are fixed per member, not per head dim.
``dropout_p`` is not supported. CPU-bound for the sizes of the harness's CPU suite (Python
loops over tiles); see ``run_family``'s docstring for the measured cost.
"""

from __future__ import annotations

import torch

from ._validate import ORDERS, check_attention_args, check_block, check_choice
from .online import SWITCH_DEFAULTS, _make_arith, _reduce_kv_grad, _run_backward, _run_forward

_BASE = dict(block_m=128, block_n=128)

FAMILY: dict[str, dict] = {
    "fa2_128": dict(_BASE),
    "fa2_64x32": dict(block_m=64, block_n=32),
    "fa2_128x16": dict(block_m=128, block_n=16),
    "fa1_order": dict(block_m=64, block_n=32, order="fa1"),
    "exp2_folded": dict(_BASE, scale_at="exp2"),
    "fa2_cuda_softmax": dict(_BASE, scale_at="exp2_fma", normalize="reciprocal"),
    "q_prescaled": dict(_BASE, scale_at="q"),
    "q_exp2_prescaled": dict(_BASE, scale_at="q_exp2"),
    "qk_sqrt_scaled": dict(_BASE, scale_at="qk_sqrt"),
    "p_ds_fp32": dict(_BASE, p_precision="fp32", ds_precision="fp32"),
    "ds_before_round": dict(_BASE, ds_scale="before_round"),
    "ds_p_rounded": dict(_BASE, ds_scale="before_round", ds_p_precision="input"),
    "gqa_group_fp32": dict(_BASE, gqa_reduce="group_fp32"),
    "gqa_per_head_rounded": dict(_BASE, gqa_reduce="per_head_rounded"),
    "gqa_expand_autograd": dict(_BASE, gqa_reduce="expand_autograd"),
    "ftz": dict(_BASE, flush_subnormals=True),
    "tf32": dict(_BASE, tf32=True),
    "exp2_approx": dict(_BASE, scale_at="exp2", exp_accuracy="approx"),
    "tf32_truncated": dict(_BASE, tf32=True, tf32_rounding="truncate"),
    "bwd_scores_k16": dict(_BASE, bwd_scores="k16"),
    "bwd_scores_k8": dict(_BASE, bwd_scores="k8"),
    "bwd_scores_k1": dict(_BASE, bwd_scores="k1"),
    "bwd_k_prescaled": dict(_BASE, bwd_scores="k_prescaled"),
    "split_kv": dict(block_m=128, block_n=16, kv_splits=4),
    "split_kv_halves": dict(block_m=128, block_n=16, kv_splits=2),
    "fp32_fma_chain": dict(_BASE, accumulate="fma_chain", gqa_reduce="group_fp32"),
    "fp32_3xtf32": dict(_BASE, fp32_dot="3xtf32"),
    "bias_fma_split": dict(_BASE, scale_at="exp2", bias_fma="split"),
    "bias_fma_split_e": dict(_BASE, bias_fma="split"),
    "p_normalized": dict(_BASE, normalize="before_pv"),
    # PyTorch's CPU flash backward: 32-row query tiles (its tiling below 192 query rows, the
    # most roundings of its three), 512-key tiles.
    "grads_input_dtype": dict(block_m=32, block_n=512, accumulate="input_dtype"),
    # A forward with a fast vectorised exp (PyTorch's CPU flash forward for fp16/bf16): its
    # probabilities 2^-13 short or long, the two ends of the fast exps' error.
    "fwd_fast_exp_low": dict(_BASE, exp_accuracy="fwd_fast_low"),
    "fwd_fast_exp_high": dict(_BASE, exp_accuracy="fwd_fast_high"),
}

FAMILY_NOTES: dict[str, str] = {
    "fa2_128": "baseline: FA2 loop order, 128x128 tiles, S = (QKᵀ)·scale in fp32, exp, P and dS "
               "rounded to the input dtype, dQ/dK scaled at the end (the harness's baseline; "
               "FlashAttention-2 CUDA backward scales acc_dq/acc_dk at the end too)",
    "fa2_64x32": "smaller tiles: more rescales and a different summation order (Triton "
                 "autotune configs, FlashAttention-2 backward's 64-row tiles)",
    "fa2_128x16": "16-key tiles, the narrowest in use (Triton configs with BLOCK_N = 16: "
                  "our kernel's fp32 launch points at D > 128, the blocked controls): with "
                  "rows alike the per-tile rescales and sums round coherently, so the tile "
                  "width sets the error (fp32 constant_rows, dO = 1, logits ~10: dq 2.2e-5 "
                  "against 3.7e-7 with 32-key tiles and 4.8e-6 with 128); in fp16 too (dk "
                  "1.02e-4 against 6.2e-5 with 32 or 128, outlier inputs and a window)",
    "fa1_order": "K/V tiles outer, O renormalised in HBM after every step (FlashAttention-1, "
                 "Algorithm 1), 32-key tiles: one rounding of O per key tile, so the "
                 "tile width sets the error",
    "exp2_folded": "scale·log2(e) folded into one fp32 constant, exp2 (FlashAttention-2/3 "
                   "softmax_scale_log2, the Triton tutorial's qk_scale = sm_scale * 1.44269504)",
    "fa2_cuda_softmax": "the softmax of FlashAttention-2's CUDA kernels (softmax.h): "
                        "scale·log2(e) fused into the exponent, P = exp2(S·c − m·c) as one "
                        "FFMA of the raw score ('allows the compiler to use the ffma "
                        "instruction'), so P of a row's max key is not exactly 1; and "
                        "O = acc · (1/ℓ). Triton kernels whose qk * qk_scale - m is "
                        "contracted into an FMA make the first choice",
    "q_prescaled": "Q·scale rounded to the input dtype before QKᵀ (Triton kernels that do "
                   "q = (q * sm_scale).to(q.dtype) with exp)",
    "q_exp2_prescaled": "Q·(scale·log2 e) rounded to the input dtype, exp2 (Triton 2.x tutorial "
                        "and kernels derived from it: q = (q * qk_scale).to(tl.float16))",
    "p_ds_fp32": "P and dS kept in fp32 for the P@V, PᵀdO, dS@K and dSᵀQ products "
                 "(implementations that upcast to fp32 throughout, e.g. "
                 "naive_attention(upcast=True); not the math SDPA backend, which rounds to "
                 "the input dtype, DESIGN.md §5)",
    "ds_before_round": "dS·scale rounded to the input dtype, dQ/dK not scaled again "
                       "(FlashAttention's Triton backward, flash_attn_triton.py: "
                       "ds = (p * (dp - Di) * softmax_scale).to(q.dtype))",
    "ds_p_rounded": "dS = P·(dP − delta)·scale with P the input-dtype tile the dV product "
                    "took, then rounded (CUTLASS's memory-efficient backward, PyTorch's "
                    "efficient SDPA and xformers: `accum = (accum - di) * attn` with attn "
                    "read from the fp16/bf16 P tile in shared memory, then `accum * scale`)",
    "gqa_group_fp32": "one fp32 dK/dV accumulator per kv head that every query head of the "
                      "group adds into (Triton GQA kernels looping over the group's heads "
                      "inside the dK/dV program)",
    "gqa_per_head_rounded": "dK/dV per query head rounded to the input dtype, then summed "
                            "over the group (FlashAttention-2 flash_api.cpp: dk_expanded in "
                            "the input dtype, at::sum over the group)",
    "gqa_expand_autograd": "K/V expanded with repeat_interleave before an MHA kernel; "
                           "autograd reduces the per-head gradients in the input dtype",
    "ftz": "subnormals flushed to zero: fp32-range ones in the inputs as read (DAZ), the "
           "intermediates and accumulators; input-dtype ones in P, dS and the results (FTZ "
           "arithmetic; on the H200 flex, sdpa-flash, sdpa-efficient and sdpa-cudnn flush "
           "subnormal gradients and cuDNN subnormal bf16 inputs: docs/reports/README.md). "
           "fp16 subnormal inputs are kept: fp16 loads and tensor-core products keep them",
    "tf32": "every matmul operand rounded to TF32, fp32 accumulation (fp32 kernels with "
            "allow_tf32 / input_precision='tf32'); only when the kernel declares TF32",
    "tf32_truncated": "as tf32, but each operand truncated to TF32 (its 13 low mantissa bits "
                      "dropped) rather than rounded: Hopper tensor cores reading fp32 "
                      "operands without a conversion (Triton's fp32 tl.dot on sm_90 wgmma); "
                      "twice the nearest rounding's error. Found on the H200 with "
                      "flash-attention-x and fasterkernels (docs/reports/outside/)",
    "exp2_approx": "fp32 inputs: exp2 with the scale folded in (as exp2_folded), computed by "
                   "the GPU's approximate ex2.approx.f32, 2^-22 relative (exp2f and __expf "
                   "under --use_fast_math: FlashAttention-2 CUDA, PyTorch's memory-efficient "
                   "SDPA backend; Triton's tl.exp2 and tl.exp). Below fp32 the rounding of P "
                   "to the input dtype dwarfs it",
    "split_kv": "split-KV ('flash-decoding') forward: the keys cut into 4 runs of whole "
                "16-key tiles, each run's online softmax normalised by its own ℓ into an fp32 "
                "O_s with its lse_s, then merged in fp32 (lse = m + log Σ e^(lse_s − m), "
                "O = Σ e^(lse_s − lse)·O_s) and rounded once: FlashAttention-2's split-KV "
                "kernels and combine_attn_seqk_parallel (flash_attn_with_kvcache's num_splits; "
                "mha_fwd, and PyTorch's vendored copy behind the flash SDPA backend, pick "
                "num_splits by a heuristic when batch·heads·row blocks do not fill the GPU), "
                "FlashAttention-3's num_splits and combine kernel, Flash-Decoding, FlashInfer's "
                "merge_state/merge_states, vLLM's merge_attn_states. Real kernels split "
                "thousands of keys in 64-256-key tiles; 16-key tiles make the CPU suite's few "
                "dozen keys split (from 17 keys; all 4 runs from 49 keys; 2 tiles per run at "
                "128 keys). The weights e^(lse_s − lse) carry the roundings of the lse_s, "
                "u_a·|lse| each, which the unsplit rescales cancel: fp32 at large logits "
                "(|lse| ~ 1e4, 128 keys) its output error is up to 5x the other members' "
                "(6 seeds); below fp32 within 1.3x of theirs. Backward: the FA2 backward "
                "(128x16 tiles) from the merged O and lse",
    "qk_sqrt_scaled": "Q and K each multiplied by fl(√scale) in fp32 before QKᵀ, in the "
                      "forward and in the backward (PyTorch's math SDPA backend, "
                      "_scaled_dot_product_attention_math, 'for numerical stability'; fp16/bf16 "
                      "upcast to fp32 first). Each product's rounding perturbs the inputs by "
                      "u_acc relative, which the scores carry coherently: fp32 at logits ~1e4, "
                      "dq 3.4x the other members' (H200 campaign, sdpa-math, D 111: "
                      "√(1/√111) is not a power of two); exact where √scale is (D 16, 256)",
    "fp32_fma_chain": "fp32 inputs, IEEE fp32 dot products: dQ, dK and dV each one running "
                      "fp32 sum, one fused multiply-add per product, in loop order (keys for "
                      "dQ; query rows, a GQA group's heads one after another, for dK/dV). "
                      "Triton's tl.dot(a, b, acc) with input_precision='ieee' lowers to such "
                      "an FMA loop on NVIDIA GPUs (ours: triton, triton-fa1, triton-varlen), "
                      "as do scalar CUDA loops. Terms below half an ulp of the running sum "
                      "are lost: with positive terms (P, dO = 1) a bias that grows with the "
                      "row count (H200, triton-fa1, 1934 rows: dv 3.7x the blocked members', "
                      "mean error -3.6e-5 at 21.5)",
    "fp32_3xtf32": "fp32 inputs, every GEMM as three TF32 tensor-core products (CUTLASS's "
                   "OpMultiplyAddFastF32: each operand split into big = tf32(x) truncated "
                   "and small = tf32(x − big) rounded, small·small dropped): PyTorch's "
                   "memory-efficient SDPA backend for fp32 on sm80 and later "
                   "(gemm_kernel_utils.h, DefaultGemmType<float>), CUTLASS 3xTF32 GEMMs. "
                   "About 2^-20 relative per product against fp32's 2^-24 (H200, "
                   "sdpa-efficient, fp32 D 72: dv 3.8x the IEEE members'; fp32 D 12, logits "
                   "~60: out 4x, at the element the truncated split puts its worst)",
    "split_kv_halves": "split_kv with 2 splits: the split count is each kernel's own (a "
                       "heuristic of the batch, heads and SM count), and where rows are "
                       "alike the merge's lse roundings are coherent, so their error depends "
                       "on where the splits fall (the split_kv control, 3 splits of 16-key "
                       "tiles, fp32 constant_rows: dq 3.9x the 4-split member's, equal to "
                       "this one's); declared with split_kv",
    "bwd_scores_k16": "the backward recomputes S = QKᵀ in another summation order over the "
                      "head dim than the forward whose lse it uses (its own GEMM blocking, or "
                      "MMA k-steps of 16), so P = exp(S − lse) is off by the difference of two "
                      "roundings of each score and a row's P no longer sums to exactly 1. "
                      "PyTorch's CPU flash SDPA backend does this (cpublas GEMMs per kv block "
                      "in each pass): fp32, logits ~1e4, dv 1.06x the rule without it "
                      "(sdpa-varlen, CPU); the scores' rounding at |s| ~1e4 is ~1e-3, which "
                      "P turns into a relative error that dV and dK inherit",
    "bwd_scores_k8": "bwd_scores_k16's choice in steps of 8, the K of the m16n8k8 MMAs (fp16, "
                     "and TF32 for fp32) and of a TF32 wgmma. One summation order is one "
                     "draw of the two roundings' difference: where rows are alike (constant "
                     "rows: every query row's P off by the same amount) it adds coherently "
                     "into dV and one order can be lucky (steps of 16 over D 40 summing "
                     "exactly where steps of 8 do not: dv 4.2x apart, fp32 constant_rows, "
                     "the bwd_scores_reordered control at 1.16-1.53x the rule); declared "
                     "with bwd_scores_k16",
    "bwd_scores_k1": "bwd_scores_k16's choice one product at a time, a fused multiply-add per "
                     "product (a CUDA-core or scalar dot in the backward, a GEMM in the "
                     "forward): the longest chain of roundings, up to 6x the k16/k8 members' "
                     "dq at fp32 logits ~1e3, D 7 (where steps of 8 or 16 reorder nothing); "
                     "declared with bwd_scores_k16",
    "bwd_k_prescaled": "the backward recomputes S as Q·fl(K·scale), the scale folded into the "
                       "packed K operand and rounded in fp32 (a GEMM whose alpha the BLAS "
                       "applies to an operand), where the forward's lse came from "
                       "fl(QKᵀ)·scale: each score another rounding of the forward's. "
                       "PyTorch's CPU flash backward on an AVX-512 machine (its sgemm with "
                       "alpha = scale): fp32 uniform(4), D 10, dv 1.16x the rule without it, "
                       "the member's dv 8.9e-7 from the kernel's where the others' are 1e-5; "
                       "opt-in (the sdpa-flash built-in declares it on the CPU)",
    "bias_fma_split": "exp2_folded with an additive bias, the score s = QKᵀ·c + bias·log2 e "
                      "rounded once by an FMA in each pass but contracted two ways: the "
                      "forward keeps QKᵀ·c exact and adds the rounded bias term, the "
                      "backward adds the exact bias term to the rounded QKᵀ·c, so the "
                      "backward's P = 2^(S − lse) uses another rounding of each score than "
                      "the lse did. The compiler does this with one source line in two "
                      "kernels (our Triton kernels on the H200, fp32 normal(30) inputs with a "
                      "bias, D 11: dq 1.18 against the other members' 0.35, 1.13x the rule; "
                      "this member's dq, dk, dv and out errors equal the kernel's to 2-3 "
                      "digits); opt-in, and declaring it brings bias_fma_split_e",
    "bias_fma_split_e": "the same contraction in natural-log units (scale not folded, exp): "
                        "the forward rounds QKᵀ·scale + bias once with the product exact, "
                        "the backward rounds QKᵀ·scale and then adds the bias. A kernel "
                        "that keeps its scores in natural-log units with one FMA per score "
                        "(tl.exp of qk·sm_scale + bias) makes it; the base-2 member does "
                        "not cover it everywhere: the bias_fma_split control (this "
                        "arithmetic, tiles of 16) failed at 1.08x (1.57x on CI's machine), "
                        "fp32 D 1, logits ~1e3, where this member's errors equal the "
                        "control's bit for bit and the base-2 member's dk is 3.7x smaller",
    "p_normalized": "the probabilities normalised before the P@V product: P = e^(S − m)/ℓ "
                    "over the whole row, rounded to the input dtype, O = P·V with no final "
                    "division (an unfused softmax then a matmul: FlexAttention's eager path, "
                    "which torch 2.13 runs on the CPU, bit for bit on the case below; "
                    "two-pass kernels that form P = exp(S − lse)). Every P is rounded, the "
                    "row max's too (1/k for k tied keys, in the FA2 order 1 exactly), and "
                    "tied scores round alike: bf16 ties(1), window (0, 12), Nq 7, Nk 16: "
                    "out rmse 7.9e-4 against fa2_128's 4.3e-4. Below fp32 only; opt-in "
                    "(the flex built-in declares it on the CPU)",
    "grads_input_dtype": "dQ, dK and dV held in the input dtype between tiles: each tile's "
                         "fp32 product added to the running value, the sum rounded to the "
                         "input dtype after every add, a GQA group's query heads into one "
                         "kv-head accumulator head after head. PyTorch's CPU flash SDPA "
                         "backward (gradient buffers in the inputs' dtype, cpublas GEMMs with "
                         "beta = 1; 32-row query tiles below 192 rows, 512-key tiles): fp16 "
                         "MQA 3/1, Nq 35, Nk 1: dv 1.33x the rule without it (6 fp16 roundings "
                         "where gqa_per_head_rounded makes 3); bf16 GQA 6/3 dk 1.01x. Below "
                         "fp32 only; opt-in (the sdpa-flash built-in declares it on the CPU)",
    "fwd_fast_exp_low": "a forward whose exponentials come from a fast vectorised "
                        "approximation while its rescale factors and the backward's exp "
                        "are accurate: every forward probability short by 2^-13 (the low "
                        "end of such an exp's error), so the lse is ~1.2e-4 low in every "
                        "row, the backward's P rows sum to 1 + 1.2e-4 and dK carries that "
                        "before its terms cancel. PyTorch's CPU flash SDPA forward for "
                        "fp16/bf16 (its exp: -1.08e-4..+1.02e-4, e(0) = 1 - 5.3e-5): fp16 "
                        "causal, Nq = Nk 55, outliers, scale 1.9: dk 1.19x the rule without "
                        "it. Below fp32 only; opt-in, declared as fwd_fast_exp with "
                        "fwd_fast_exp_high (the sdpa-flash built-in declares it on the CPU)",
    "fwd_fast_exp_high": "fwd_fast_exp_low's choice with every forward probability long by "
                         "2^-13 (the high end); each P, its rounding and each gradient term "
                         "move monotonically with a row's lse shift, so the pair brackets a "
                         "kernel whose exp errs anywhere within 2^-13; declared with "
                         "fwd_fast_exp_low",
}

# Switches that change only the backward (the forward of members differing in them is shared).
_BACKWARD_ONLY = ("ds_precision", "ds_scale", "gqa_reduce", "bwd_scores", "accumulate",
                  "ds_p_precision")
_GQA_MEMBERS = ("gqa_group_fp32", "gqa_per_head_rounded", "gqa_expand_autograd")
_LOOP_KEYS = dict(block_m=128, block_n=128, order="fa2")


# Members a kernel must declare (capabilities["family"]) to be judged against, because in
# one regime their error is orders above every other member's and, included by default,
# they would let a kernel that wrong pass there; a kernel that makes the choice says so and
# is then judged by it. Leave-one-out (scripts/calibrate_family.py --draws 1000 --seed 1,
# docs/bounds-calibration.json):
# - q_prescaled, q_exp2_prescaled: rounding Q·scale to the input dtype perturbs every score
#   by up to u·|s|; at bf16 large logits (|s| ~ 1e4) 180-360x the baseline's error on
#   dq/dk/out (bf16, D = 64, large_logits(1e4)).
# - split_kv: the merge weights carry each split's lse rounded at |lse|, u·|lse| ~ 4e-3 at
#   fp32 logits of 5e4, which the unsplit rescales cancel: 1.7e3x the other members' out
#   error and 172x their dq there (split-KV decode kernels declare it; ours does).
# - bwd_scores_k16 (with bwd_scores_k8 and bwd_scores_k1, three orders of the backward's
#   QKᵀ: one order alone is one draw of its difference from the forward's): P = exp(S_bwd −
#   lse) off by two roundings of scores at |s|: up to 18.6x the others' dv and 8.6x their dk
#   on fp32 cases (PyTorch's CPU flash SDPA makes it; the sdpa-varlen peer declares it).
# - qk_sqrt_scaled: Q·√scale and K·√scale rounded in fp32 perturb every score by ~u_acc·|s|:
#   3.4x the other members' dq at fp32 logits ~1e4 (the sdpa-math builtin declares it).
# - fp32_fma_chain: a running sum of n terms loses up to n·u_acc of its mass where a blocked
#   sum loses ~√(block)·u: 8x the others' dv on a 1934-row fp32 case (our Triton kernels
#   declare it).
# - fp32_3xtf32: ~2^-20 per product where the IEEE members make 2^-24: up to 16x their
#   error on every fp32 tensor (the sdpa-efficient builtin declares it).
# - bias_fma_split: the backward's scores another rounding of the forward's (one FMA each,
#   contracted two ways): 3.4x the other members' dq and 3.9x their dk at fp32 logits ~4e3
#   with an additive bias (our Triton kernels on NVIDIA GPUs declare it). The choice is
#   made in base 2 or in natural-log units, two arithmetics whose errors differ by up to
#   3.7x at one element (fp32 D 1): declaring it brings both members.
# - p_normalized: its rounded probabilities are the worst member in many fp16/bf16 cases
#   (calibration: 2.15x the other members' dq, 1.39x their out RMSE), and by default it
#   hid precision mutants case by case (120 drawn fp16/bf16 cases: fp16_accumulation failed
#   7 without it, 0 with it; p_bf16_for_fp16 35 and 26; ds_bf16_for_dk 16 and 13); the
#   `flex` built-in on the CPU (FlexAttention's eager path) declares it.
# - grads_input_dtype: one rounding to the input dtype per query tile (and per head of a
#   GQA group) where the other members round once: 3.4x the others' dv (bf16 GQA 4/2) and
#   2.8x their dk, above K_RULE, so by default it would pass a kernel 3x worse than the
#   rest; a kernel that keeps its gradients in the input dtype says so (the sdpa-flash
#   built-in on the CPU, PyTorch's CPU flash backward, does).
# - fwd_fast_exp: a lse shifted by up to 2^-13 in every row reaches dK through the row sums
#   of P before its terms cancel: up to 4.7x the defaults where the floor sets the rule
#   (docs/bounds.md's calibration), so a kernel with an accurate exp says nothing and one
#   with a fast forward exp says so (the sdpa-flash built-in on the CPU does).
OPT_IN = ("q_prescaled", "q_exp2_prescaled", "split_kv", "bwd_scores_k16", "qk_sqrt_scaled",
          "fp32_fma_chain", "fp32_3xtf32", "bias_fma_split", "p_normalized",
          "grads_input_dtype", "fwd_fast_exp", "bwd_k_prescaled")


# An opt-in choice judged by more than one member (the split count of split-KV is each
# kernel's own): declaring the choice brings all of them.
_OPT_IN_MEMBERS = {"split_kv": ("split_kv", "split_kv_halves"),
                   "bwd_scores_k16": ("bwd_scores_k16", "bwd_scores_k8", "bwd_scores_k1"),
                   "fwd_fast_exp": ("fwd_fast_exp_low", "fwd_fast_exp_high"),
                   "bias_fma_split": ("bias_fma_split", "bias_fma_split_e")}
# Every member that is judged only when declared.
OPT_IN_MEMBERS = tuple(m for c in OPT_IN for m in _OPT_IN_MEMBERS.get(c, (c,)))


def family_members(dtype, *, gqa: bool, tf32: bool, declared=()) -> dict[str, dict]:
    """The members of ``FAMILY`` that apply to a problem (a new dict of copies, in order).

    ``dtype``: the input dtype (torch dtype or name); ``gqa``: Hq != Hkv; ``tf32``: the
    kernel declares TF32 matmuls (meaningful for float32 inputs only; ignored otherwise);
    ``declared``: names of :data:`OPT_IN` members the kernel declares it makes.
    """
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"dtype: expected float16, bfloat16, float32 or float64; got {dtype!r}")
    declared = tuple(declared)
    bad = [d for d in declared if d not in OPT_IN]
    if bad:
        raise ValueError(f"declared: {bad} are not opt-in family members; allowed: {OPT_IN}")
    wide = dtype in (torch.float32, torch.float64)
    skip = {m for c in OPT_IN if c not in declared for m in _OPT_IN_MEMBERS.get(c, (c,))}
    if not gqa:
        skip.update(_GQA_MEMBERS)
    if wide:
        # P, dS and per-head dK/dV are already in the accumulator dtype: rounding them
        # again changes nothing, and these members are the baseline.
        skip.update(("p_ds_fp32", "gqa_per_head_rounded", "gqa_expand_autograd",
                     "p_normalized", "grads_input_dtype"))
        # A fast exp's 2^-13 is far above fp32's rounding of P: a kernel with one in fp32
        # is not a correct one (PyTorch's CPU flash forward takes an accurate exp there).
        skip.update(("fwd_fast_exp_low", "fwd_fast_exp_high"))
    if not (tf32 and dtype == torch.float32):
        skip.update(("tf32", "tf32_truncated"))
    if dtype != torch.float32 or tf32:
        # Below fp32 (and with TF32) the products run on tensor cores: blocked sums; fp32
        # split into TF32 parts is an fp32 choice, and looser TF32 members cover it.
        skip.update(("fp32_fma_chain", "fp32_3xtf32"))
    if dtype != torch.float32:
        # An exponential's 2^-22 is invisible below fp32, where P is rounded to 2^-8..2^-11.
        skip.add("exp2_approx")
    return {name: dict(kw) for name, kw in FAMILY.items() if name not in skip}


def _split(name: str, kw: dict):
    unknown = set(kw) - set(_LOOP_KEYS) - set(SWITCH_DEFAULTS)
    if unknown:
        raise ValueError(f"members[{name!r}]: unknown keyword(s) {sorted(unknown)}")
    loop = {**_LOOP_KEYS, **{k: v for k, v in kw.items() if k in _LOOP_KEYS}}
    sw = {**SWITCH_DEFAULTS, **{k: v for k, v in kw.items() if k in SWITCH_DEFAULTS}}
    return (
        check_block("block_m", loop["block_m"]), check_block("block_n", loop["block_n"]),
        check_choice("order", loop["order"], ORDERS), sw,
    )


def run_family(
    query, key, value, grad_out=None, attn_mask=None, *, members=None, is_causal=False,
    scale=None, enable_gqa=False, window=None, causal_alignment="top_left",
) -> dict[str, dict[str, torch.Tensor]]:
    """Every member on the same inputs: {name: {"out", and with grad_out "dq", "dk", "dv"}}.

    ``members``: name -> keyword arguments of ``online_attention`` (block_m, block_n,
    order and the switches of ``SWITCH_DEFAULTS``); default ``family_members(query.dtype,
    gqa=Hq != Hkv, tf32=False)``. The tensors are those of
    ``online_attention(query, key, value, attn_mask, ..., precision="emulate", **kwargs)``
    and of ``torch.autograd.grad(out, (query, key, value), grad_out)``, bit for bit
    (tests/test_family.py), in the input dtype, detached. The mask gets no gradient.

    Cost (scripts/family_cost.py, one CPU thread, best of 10, forward + backward): fp16
    B=2 Hq=Hkv=4 N=128 D=64, 9 members: 36 ms against 3.9 ms for the baseline alone
    (9.2x; 42 ms, 10.8x, as one call per member); with Hkv=2, 12 members: 42 ms (8.6x).
    At N=512: 527 ms against 51 ms (10.4x). Roughly one baseline per member: the members
    differ in the forward, so only the GQA members, ds_before_round and (one tile per row)
    fa1_order share work. Those figures predate ``split_kv``, which costs about two
    baselines (16-key tiles; run_family with it alone: 6.6 ms against 3.4 ms for fa2_128
    alone at N=128, 93 ms against 53 ms at N=512, on a busier machine).
    """
    p = check_attention_args(
        query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa, window,
        causal_alignment,
    )
    if members is None:
        members = family_members(query.dtype, gqa=p.group > 1, tf32=False)
    query, key, value = (t.detach() for t in (query, key, value))
    fwd_cache: dict = {}
    bwd_cache: dict = {}
    results: dict[str, dict[str, torch.Tensor]] = {}
    with torch.no_grad():
        for name, kw in members.items():
            bm, bn, order, sw = _split(name, kw)
            ar = _make_arith(query.dtype, "emulate", **sw)
            # Every switch but the backward-only ones keys the forward; every switch but the
            # final GQA reduction keys the backward (a new switch is keyed by default).
            fkey = (bm, bn, order, tuple((k, v) for k, v in sorted(sw.items())
                                         if k not in _BACKWARD_ONLY))
            if fkey not in fwd_cache:
                fwd_cache[fkey] = _run_forward(
                    ar, p, query, key, value, attn_mask, order, bm, bn
                )
            out, lse = fwd_cache[fkey]
            res = {"out": out}
            if grad_out is not None:
                # The backward is FA2 whatever the forward's order: it depends on the loop
                # order only through out and lse, so equal out and lse share it.
                bkey = (bm, bn, tuple((k, v) for k, v in sorted(sw.items())
                                      if k != "gqa_reduce"), sw["gqa_reduce"] == "group_fp32")
                grads = next((g for o, lg, g in bwd_cache.get(bkey, [])
                              if o is out or (torch.equal(o, out) and torch.equal(lg, lse))),
                             None)
                if grads is None:
                    grads = _run_backward(
                        ar, p, query, key, value, attn_mask, out, lse, grad_out, bm, bn,
                        False,
                    )
                    bwd_cache.setdefault(bkey, []).append((out, lse, grads))
                dq, dk, dv, _ = grads
                res.update(
                    dq=ar.result(dq, query.dtype), dk=_reduce_kv_grad(ar, p, dk, key.dtype),
                    dv=_reduce_kv_grad(ar, p, dv, value.dtype),
                )
            results[name] = res
    return results

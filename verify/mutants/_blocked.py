"""A correct blocked flash-attention in PyTorch, with named hook points for mutants.

`BlockedAttention` is FlashAttention-2 written with torch ops: the forward walks the keys in
tiles of `block_n` with an online softmax (running max m, running sum l, fp32 accumulator),
rounds P to the input dtype before P@V, and saves lse = m + log l; the backward recomputes P
from lse tile by tile, uses delta = rowsum(dO * O), and rounds P and dS to the input dtype
before their matmuls (FA2 backward). All query rows of all heads are processed at once: rows
are independent in FA2, so vectorising over them does not change any row's arithmetic, only
the key tiling does.

Each step that kernels get wrong is a small method ("hook"). A mutant subclasses
`BlockedAttention`, overrides one hook with the bug, and exports an instance as `attention`,
so the bug is the only code in its module. The hooks, in the order they run:

- `kv_heads(Hq, Hkv, device)`: the kv head read by each query head (GQA mapping).
- `effective_scale(scale, D)`: the softmax scale actually used.
- `structure(Nq, Nk, ...)`: the (Nq, Nk) bool mask of causal/window rules.
- `subnormals(t, dtype, read=False)`: applied to the inputs as read (`read=True`), P, dS and
  the results (default: kept).
- `mm(a, b)`: every matrix product of the algorithm (default: fp32 `a @ b`).
- `logits(q, k_tile, bias, scale, dtype)`: the scores of one key tile, in the units of `exp`.
- `exp(x)`: the exponential of the online softmax and of the backward's recomputed P.
- `running_max(m, s)`: the new running row max.
- `safe_max(m)`: the max used for exp(s - m) (guards rows that are still all -inf).
- `round_p(p, dtype)`: P as fed to P@V (and P^T@dO in the backward).
- `update(acc, pv, alpha, l_prev, l_new)`: the accumulator after one key tile.
- `finalize(acc, l)`: the output from the accumulator and l.
- `log_sum_exp(m, l)`: the lse saved for the backward.
- `store_lse(lse, dtype)`: the lse as stored between the passes (default: fp32).
- `delta(grad_out, out)`: the backward's rowsum(dO * O).
- `ds_scales(scale)`: (factor on dS before it is rounded, factor on dS@K and dS^T@Q).
- `ds_p(p, p_rounded)`: the P that dS = P * (dP - delta) takes (default: the fp32 one).
- `round_ds(ds, dtype)`: dS as fed to the dQ/dK matmuls.
- `dk_ds(ds_raw, ds, dtype)`: dS as fed to the dK matmul (FA2: the same rounded dS as dQ).
- `kv_grad(a, b)`: aᵀ·b, one key tile of dV (a = P) or of dK before its scale (a = dS), per
  query head.
- `dk_tile(ds, q, scale)`: one key tile of dK (per query head).
- `round_head_grad(g, dtype)`: dK/dV per query head before the GQA sum (default: fp32).
- `reduce_kv_grad(g, kv_heads, shape)`: dK/dV per kv head from the per-query-head ones.
- `accumulator_dtype(dtype)`: the storage dtype of acc and l.

A hook whose choice differs between the passes reads `self.in_backward` (True while the
backward runs).

Caveat: it is an emulation for the CPU and for tests (seconds for N in the hundreds), not a
fast kernel. Dropout is not supported (raises NotImplementedError).
"""

from __future__ import annotations

import torch
from flashcheck.reference.masks import structural_mask
from flashcheck.verify.mutants._common import Problem, additive_bias, check_args, full_capabilities

NEG_INF = float("-inf")


class BlockedAttention:
    """Correct FA2-order blocked attention; subclass and override one hook to plant a bug."""

    block_n = 16
    capabilities = full_capabilities()
    in_backward = False  # set by ``backward`` while it runs

    # ---- hooks -------------------------------------------------------------------------
    def kv_heads(self, Hq: int, Hkv: int, device) -> torch.Tensor:
        return torch.arange(Hq, device=device) // (Hq // Hkv)

    def effective_scale(self, scale: float | None, D: int) -> float:
        return scale if scale is not None else D ** -0.5

    def structure(self, Nq, Nk, *, is_causal, causal_alignment, window, device) -> torch.Tensor:
        return structural_mask(Nq, Nk, is_causal=is_causal, causal_alignment=causal_alignment,
                               window=window, device=device)

    def subnormals(self, t: torch.Tensor, dtype: torch.dtype, read: bool = False
                   ) -> torch.Tensor:
        return t

    def logits(self, q, k_tile, bias, scale: float, dtype: torch.dtype) -> torch.Tensor:
        s = self.mm(q, k_tile.transpose(-1, -2)) * scale
        return s if bias is None else s + bias

    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b

    def kv_grad(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.mm(a.transpose(-1, -2), b)

    def exp(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)

    def fwd_p_exp(self, x: torch.Tensor) -> torch.Tensor:
        """The forward's probabilities (not its rescale factors, not the backward's P)."""
        return self.exp(x)

    def running_max(self, m: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return torch.maximum(m, s.amax(dim=-1))

    def safe_max(self, m: torch.Tensor) -> torch.Tensor:
        return torch.where(m == NEG_INF, torch.zeros_like(m), m)

    def round_p(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return p.to(dtype).float()

    def update(self, acc, pv, alpha, l_prev, l_new) -> torch.Tensor:
        return alpha[..., None] * acc + pv

    def finalize(self, acc: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
        safe_l = torch.where(l > 0, l, torch.ones_like(l))
        return torch.where((l > 0)[..., None], acc / safe_l[..., None], torch.zeros_like(acc))

    def log_sum_exp(self, m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
        return torch.where(l > 0, m + torch.log(l), torch.full_like(m, NEG_INF))

    def store_lse(self, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return lse

    def delta(self, grad_out: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return (grad_out.float() * out.float()).sum(dim=-1)

    def ds_scales(self, scale: float) -> tuple[float, float]:
        return 1.0, scale

    def ds_p(self, p: torch.Tensor, p_rounded: torch.Tensor) -> torch.Tensor:
        return p

    def round_ds(self, ds: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return ds.to(dtype).float()

    def dk_ds(self, ds_raw: torch.Tensor, ds: torch.Tensor, dtype: torch.dtype
              ) -> torch.Tensor:
        return ds

    def dk_tile(self, ds: torch.Tensor, q: torch.Tensor, scale: float) -> torch.Tensor:
        return self.kv_grad(ds, q) * scale

    def round_head_grad(self, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return g

    def reduce_kv_grad(self, g: torch.Tensor, kv_heads: torch.Tensor, shape) -> torch.Tensor:
        # One query head at a time, in head order: no atomics (index_add_ on CUDA adds fp32
        # with atomicAdd, which flushes subnormal sums to zero and is not deterministic).
        out = torch.zeros(shape, device=g.device)
        for h, kvh in enumerate(kv_heads.tolist()):
            out[:, kvh] += g[:, h]
        return out

    def accumulator_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    # ---- entry point ---------------------------------------------------------------------
    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                 scale=None, enable_gqa=False, *, window=None, causal_alignment="top_left"):
        caps = self.capabilities
        p = check_args(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                       window, causal_alignment, dtypes=caps["dtypes"],
                       head_dims=caps["head_dims"])
        p = Problem(p.B, p.Hq, p.Hkv, p.Nq, p.Nk, p.D, self.effective_scale(scale, p.D),
                    p.is_causal, p.causal_alignment, p.window)
        bias = additive_bias(attn_mask, p)
        return _BlockedFunction.apply(self, p, bias, query, key, value)

    # ---- the algorithm ------------------------------------------------------------------
    def _tiles(self, p: Problem):
        return [(lo, min(lo + self.block_n, p.Nk)) for lo in range(0, p.Nk, self.block_n)]

    def _scores(self, qf, k_tile, allowed, bias, lo, hi, p: Problem, dtype) -> torch.Tensor:
        # Adding the bias before the structural -inf fill gives the same values as after it
        # (-inf + finite and -inf + -inf are both -inf).
        s = self.logits(qf, k_tile, None if bias is None else bias[..., lo:hi], p.scale, dtype)
        return s.masked_fill(~allowed[:, lo:hi], NEG_INF)

    def _gathered(self, query, key, value, p: Problem):
        kvh = self.kv_heads(p.Hq, p.Hkv, query.device)
        allowed = self.structure(p.Nq, p.Nk, is_causal=p.is_causal,
                                 causal_alignment=p.causal_alignment, window=p.window,
                                 device=query.device)
        return kvh, key.index_select(1, kvh).float(), value.index_select(1, kvh).float(), allowed

    def forward(self, query, key, value, bias, p: Problem):
        """(out in the input dtype, lse fp32 (B, Hq, Nq))."""
        dtype = query.dtype
        acc_dtype = self.accumulator_dtype(dtype)
        _, kf, vf, allowed = self._gathered(query, key, value, p)
        qf = self.subnormals(query.float(), dtype, True)
        kf, vf = self.subnormals(kf, dtype, True), self.subnormals(vf, dtype, True)
        m = torch.full((p.B, p.Hq, p.Nq), NEG_INF, device=query.device)
        l = torch.zeros((p.B, p.Hq, p.Nq), device=query.device, dtype=acc_dtype)
        acc = torch.zeros((p.B, p.Hq, p.Nq, p.D), device=query.device, dtype=acc_dtype)
        for lo, hi in self._tiles(p):
            s = self._scores(qf, kf[..., lo:hi, :], allowed, bias, lo, hi, p, dtype)
            m_new = self.running_max(m, s)
            m_use = self.safe_max(m_new)
            pt = self.fwd_p_exp(s - m_use[..., None])
            alpha = self.exp(m - m_use)
            l_new = alpha * l.float() + pt.sum(dim=-1)
            pv = self.mm(self.subnormals(self.round_p(pt, dtype), dtype), vf[..., lo:hi, :])
            acc = self.update(acc.float(), pv, alpha, l.float(), l_new).to(acc_dtype)
            l, m = l_new.to(acc_dtype), m_new
        out = self.finalize(acc.float(), l.float())
        lse = self.store_lse(self.log_sum_exp(m, l.float()), dtype)
        return self.subnormals(out.to(dtype), dtype), lse

    def backward(self, query, key, value, bias, out, lse, grad_out, p: Problem):
        """FA2 backward: (dq, dk, dv) in the input dtype; ``in_backward`` is True meanwhile."""
        self.in_backward = True
        try:
            return self._backward_pass(query, key, value, bias, out, lse, grad_out, p)
        finally:
            self.in_backward = False

    def _backward_pass(self, query, key, value, bias, out, lse, grad_out, p: Problem):
        dtype = query.dtype
        kvh, kf, vf, allowed = self._gathered(query, key, value, p)
        qf = self.subnormals(query.float(), dtype, True)
        dof = self.subnormals(grad_out.float(), dtype, True)
        kf, vf = self.subnormals(kf, dtype, True), self.subnormals(vf, dtype, True)
        ds_pre, ds_post = self.ds_scales(p.scale)
        delta = self.delta(dof.to(dtype), out)
        lse_use = self.safe_max(lse)
        dq = torch.zeros_like(qf)
        dk_h = torch.zeros_like(kf)
        dv_h = torch.zeros_like(vf)
        for lo, hi in self._tiles(p):
            k_t, v_t = kf[..., lo:hi, :], vf[..., lo:hi, :]
            s = self._scores(qf, k_t, allowed, bias, lo, hi, p, dtype)
            pt = self.exp(s - lse_use[..., None])
            p_r = self.subnormals(self.round_p(pt, dtype), dtype)
            dv_h[..., lo:hi, :] = self.kv_grad(p_r, dof)
            dp = self.mm(dof, v_t.transpose(-1, -2))
            ds_raw = self.ds_p(pt, p_r) * (dp - delta[..., None])
            if ds_pre != 1.0:
                ds_raw = ds_raw * ds_pre
            ds = self.subnormals(self.round_ds(ds_raw, dtype), dtype)
            dq += self.mm(ds, k_t) * ds_post
            dk_h[..., lo:hi, :] = self.dk_tile(self.dk_ds(ds_raw, ds, dtype), qf, ds_post)
        dk = self.reduce_kv_grad(self.round_head_grad(dk_h, dtype), kvh, key.shape)
        dv = self.reduce_kv_grad(self.round_head_grad(dv_h, dtype), kvh, value.shape)
        return tuple(self.subnormals(g.to(dtype), dtype) for g in (dq, dk, dv))


class _BlockedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, impl, p, bias, query, key, value):
        out, lse = impl.forward(query, key, value, bias, p)
        ctx.impl, ctx.p, ctx.bias = impl, p, bias
        ctx.save_for_backward(query, key, value, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.impl.backward(query, key, value, ctx.bias, out, lse, grad_out, ctx.p)
        return None, None, None, dq, dk, dv

"""Attention over RMSNorm + RoPE'd q and k that saves the projections q, k, not the rotated q', k' as well.

    q' = RoPE(RMSNorm(q) · w_q),  k' = RoPE(RMSNorm(k) · w_k)     ops.qk_norm_rope, one pass each (Wan's qk norm)
    o  = softmax(q' k'ᵀ / √Dh) · v              the fused SDPA kernel F.scaled_dot_product_attention would pick
                                                 for these tensors (torch._fused_sdp_choice)

Eager autograd keeps q and k for the norm's backward and q', k' for attention's (with v, o and the log-sum-exp):
the projections twice. Here q, k, v, o and the log-sum-exp are saved. Backward remakes q' and k' with the forward
kernel (bit for bit the forward's), runs that attention kernel's own backward op on them, frees them, then runs the
norm's backward. At S = 32760, D = 1536, bf16: 192 MiB less held through a recomputed Wan block's backward for the
self-attention, 96 MiB for the cross-attention's q (its k is text-sized), for two extra passes over q and k.

The attention kernels are called through their aten ops (`_scaled_dot_product_{cudnn,flash,efficient}_attention`
and their backward ops on CUDA, `_scaled_dot_product_flash_attention_for_cpu` on CPU), which is what
F.scaled_dot_product_attention dispatches to: the forward output is the same kernel's, and selective checkpointing
policies that name these ops (models.checkpointing.keep_attention_context) see them. Where SDPA would pick the math
fallback (or a kernel this file does not know), `rope_attention` runs the plain composition instead.

backend: "torch" the reference (qk_norm_rope_reference then F.scaled_dot_product_attention), "triton" (CUDA, or CPU
under TRITON_INTERPRET=1) and "auto" (Triton where ops.qk_norm_rope would take it) the recomputing function.
"""
from __future__ import annotations

import torch

from ops.attention_backend import kernel_for, sdpa
from ops.qk_norm_rope import (qk_norm_rope, qk_norm_rope_backward, qk_norm_rope_forward, qk_norm_rope_reference,
                              triton_supported)
from ops.triton_setup import BACKENDS

def _kernel_kind(q, k, v, sdpa_backend: str = "auto") -> str | None:
    """The fused kernel SDPA would run for q, k, v [B, H, N, Dh] under autograd and `sdpa_backend`
    (ops/attention_backend.py), or None (math, or unknown)."""
    with torch.enable_grad():
        kind = kernel_for(sdpa_backend, *(t.detach().requires_grad_() for t in (q, k, v)))
    if q.device.type == "cpu":
        return "cpu_flash" if kind == "flash" else None
    return kind if kind in ("flash", "efficient", "cudnn") else None


def _attention_forward(kind, q, k, v):
    """(o, tensors to save, ints to keep) of one of SDPA's kernels; dropout 0, not causal, scale 1/√Dh."""
    aten = torch.ops.aten
    if kind == "cudnn":
        o, lse, cq, ck, mq, mk, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)
        return o, (lse, seed, offset, cq, ck), (mq, mk)
    if kind == "flash":
        o, lse, cq, ck, mq, mk, rng, unused, _ = aten._scaled_dot_product_flash_attention(q, k, v)
        return o, (lse, rng, unused, cq, ck), (mq, mk)
    if kind == "efficient":
        o, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True)
        return o, (lse, seed, offset), ()
    o, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
    return o, (lse,), ()


def _attention_backward(kind, do, q, k, v, o, tensors, ints):
    aten = torch.ops.aten
    if kind == "cudnn":
        lse, seed, offset, cq, ck = tensors
        return aten._scaled_dot_product_cudnn_attention_backward(do, q, k, v, o, lse, seed, offset, None, cq, ck,
                                                                 *ints, 0.0, False)
    if kind == "flash":
        lse, rng, unused, cq, ck = tensors
        return aten._scaled_dot_product_flash_attention_backward(do, q, k, v, o, lse, cq, ck, *ints, 0.0, False,
                                                                 rng, unused)
    if kind == "efficient":
        lse, seed, offset = tensors
        return aten._scaled_dot_product_efficient_attention_backward(do, q, k, v, None, o, lse, seed, offset, 0.0,
                                                                     [True, True, True, False])[:3]
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, k, v, o, tensors[0], 0.0, False)


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.unflatten(-1, (heads, -1)).transpose(1, 2)  # [B, N, D] → [B, H, N, Dh], a view


class _RoPEAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kind, heads, q, k, v, wq, wk, cos_q, sin_q, cos_k, sin_k, eps_q, eps_k):
        qr, rstd_q = qk_norm_rope_forward(q, wq, cos_q, sin_q, eps_q)
        kr, rstd_k = qk_norm_rope_forward(k, wk, cos_k, sin_k, eps_k)
        o, tensors, ints = _attention_forward(kind, _heads(qr, heads), _heads(kr, heads), _heads(v, heads))
        del qr, kr
        ctx.kind, ctx.heads, ctx.ints, ctx.eps = kind, heads, ints, (eps_q, eps_k)
        ctx.save_for_backward(q, k, v, wq, wk, cos_q, sin_q, cos_k, sin_k, rstd_q, rstd_k, o, *tensors)
        return o.transpose(1, 2).flatten(2)

    @staticmethod
    def backward(ctx, do):
        q, k, v, wq, wk, cos_q, sin_q, cos_k, sin_k, rstd_q, rstd_k, o, *tensors = ctx.saved_tensors
        H = ctx.heads
        qr = qk_norm_rope_forward(q, wq, cos_q, sin_q, ctx.eps[0])[0]  # the forward's q', k', bit for bit
        kr = qk_norm_rope_forward(k, wk, cos_k, sin_k, ctx.eps[1])[0]
        dqr, dkr, dv = _attention_backward(ctx.kind, _heads(do.reshape(o.shape[0], o.shape[2], -1), H),
                                           _heads(qr, H), _heads(kr, H), _heads(v, H), o, tensors, ctx.ints)
        del qr, kr
        dq, dwq = qk_norm_rope_backward(dqr.transpose(1, 2).flatten(2), q, wq, cos_q, sin_q, rstd_q)
        del dqr
        dk, dwk = qk_norm_rope_backward(dkr.transpose(1, 2).flatten(2), k, wk, cos_k, sin_k, rstd_k)
        return (None, None, dq, dk, dv.transpose(1, 2).flatten(2), dwq if ctx.needs_input_grad[5] else None,
                dwk if ctx.needs_input_grad[6] else None, None, None, None, None, None, None)


def rope_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, wq: torch.Tensor,
                   wk: torch.Tensor, rope_q: tuple[torch.Tensor, torch.Tensor],
                   rope_k: tuple[torch.Tensor, torch.Tensor], eps_q: float = 1e-6, eps_k: float = 1e-6,
                   backend: str = "auto", sdpa_backend: str = "auto") -> torch.Tensor:
    """Attention of q [B, N, D] over k, v [B, L, D] (D = heads · Dh) after qk_norm_rope of q and k → [B, N, D].

    wq/wk: the RMSNorm weights [D]; rope_q/rope_k: (cos, sin) [N or L, Dh/2] fp32 as ops.qk_norm_rope takes;
    sdpa_backend: the attention kernel (model.attention_backend, ops/attention_backend.py)."""
    if backend not in BACKENDS:
        raise ValueError(f"rope_attention backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if triton_supported(q, wq, *rope_q) and triton_supported(k, wk, *rope_k) else "torch"
    if backend == "torch":
        qr, kr = qk_norm_rope_reference(q, wq, *rope_q, eps_q), qk_norm_rope_reference(k, wk, *rope_k, eps_k)
        return _sdpa(qr, kr, v, heads, sdpa_backend)
    if any(t.requires_grad for t in (*rope_q, *rope_k)):
        raise ValueError("rope_attention: the Triton backend gives no gradient to cos/sin (RoPE3D's are constants); "
                         "detach them or use backend='torch'")
    kind = None
    # head_dim a multiple of 8 on CUDA: SDPA pads other widths before its kernels, whose ops refuse them
    if (not torch.compiler.is_compiling() and q.dtype == k.dtype == v.dtype and q.stride(-1) == 1
            and (q.device.type == "cpu" or q.shape[-1] // heads % 8 == 0)):
        kind = _kernel_kind(_heads(q, heads), _heads(k, heads), _heads(v, heads), sdpa_backend)
    if kind is None:  # SDPA's math path (or a kernel this file does not call): the plain composition
        qr = qk_norm_rope(q, wq, *rope_q, eps_q, backend=backend)
        return _sdpa(qr, qk_norm_rope(k, wk, *rope_k, eps_k, backend=backend), v, heads, sdpa_backend)
    return _RoPEAttention.apply(kind, heads, q, k, v, wq, wk, *rope_q, *rope_k, float(eps_q), float(eps_k))


def _sdpa(q, k, v, heads, sdpa_backend):
    return sdpa(_heads(q, heads), _heads(k, heads), _heads(v, heads), backend=sdpa_backend).transpose(1, 2) \
        .flatten(2).type_as(q)

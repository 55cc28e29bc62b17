"""The transformer MLP `out = W2·GELU_tanh(W1·x + b1) + b2` with a smaller backward footprint.

Eager autograd keeps both the pre-activation h = W1·x + b1 and a = GELU(h) ([tokens, ffn_dim] each, the two largest
tensors of a Wan block: 587 MB apiece at S = 32760, ffn_dim 8960, bf16) and allocates da and dh beside them in
backward. Here only x and h are saved; backward recomputes a from h for dW2 and frees it, then turns da into dh in
place (one Triton pass: da ← da · GELU'(h), fp32 math). Above CHUNK_BYTES per ffn-sized tensor, a (forward and
backward) and da/dh are made a chunk of rows at a time, weight gradients accumulated in place chunk by chunk (addmm:
fp32 inside the matmul, one rounding per chunk, as gradient accumulation), so the block's peak holds h plus two chunk-sized tensors where eager holds three full ones (at S = 32760, bf16:
~0.9 GB less). In one chunk the matmuls are eager's: a is recomputed by the same kernel from the same h, so
dW2 = doutᵀ·a is bit-identical; dh differs from aten's gelu_backward only in fp32 rounding order.

    GELU_tanh(h)  = ½·h·(1 + t),                 t = tanh(√(2/π)·(h + 0.044715·h³))
    GELU_tanh'(h) = ½·(1 + t) + ½·h·(1 − t²)·√(2/π)·(1 + 3·0.044715·h²)

backend: "torch" (plain autograd, the reference), "triton" (the fused backward: CUDA, or CPU under
TRITON_INTERPRET=1), "auto" (Triton on CUDA). Autocast is applied outside the function (the weights are cast to
the autocast dtype there, so their fp32 master copies receive fp32 gradients through the cast).
"""
from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from ops.adaln import BACKENDS, _interpreting, import_triton, require_triton, store_cast

_HAS_TRITON = importlib.util.find_spec("triton") is not None
_BLOCK = 1024
triton = tl = _cast = None  # set on first use by _kernel() (the tests set TRITON_INTERPRET first)


def gelu_ffn_reference(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor,
                       b2: torch.Tensor | None) -> torch.Tensor:
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)


def _gelu_grad_kernel(DA, H, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    da = tl.load(DA + offs, mask=mask, other=0.0).to(tl.float32)
    h = tl.load(H + offs, mask=mask, other=0.0).to(tl.float32)
    u = 0.7978845608028654 * (h + 0.044715 * h * h * h)
    # tanh and 1 − tanh² from e = exp(−2|u|) ∈ (0, 1]: no overflow, and no cancellation in 1 − t² near |t| = 1
    e = tl.exp(-2.0 * tl.abs(u))
    t = tl.where(u < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)
    sech2 = 4.0 * e / ((1.0 + e) * (1.0 + e))
    g = 0.5 * (1.0 + t) + 0.5 * h * sech2 * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * h * h)
    tl.store(DA + offs, _cast(da * g, DA.dtype.element_ty), mask=mask)  # bf16 to nearest even, interpreter too


@functools.lru_cache(maxsize=None)
def _kernel(interpret: bool):
    global triton, tl, _cast
    triton, tl = import_triton("gelu_ffn", interpret, _HAS_TRITON)
    _cast = store_cast(interpret)
    return triton.jit(_gelu_grad_kernel)


def gelu_grad_(da: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """da ← da · GELU_tanh'(h) in place (contiguous tensors of one shape); returns da."""
    if da.shape != h.shape or not (da.is_contiguous() and h.is_contiguous()):
        raise ValueError(f"gelu_grad_: da and h must be contiguous and of one shape, got {tuple(da.shape)}, "
                         f"{tuple(h.shape)}")
    n = da.numel()
    if n:
        _kernel(_interpreting())[(triton.cdiv(n, _BLOCK),)](da, h, n, BLOCK=_BLOCK)
    return da


CHUNK_BYTES = 128 << 20  # the ffn-sized temporaries (a, da/dh) are made a chunk of rows at a time, at most this big


def chunk_rows(rows: int, ffn_dim: int, elem_size: int) -> int:
    """Rows per chunk: the largest multiple of 64 whose [rows, ffn_dim] tensor fits CHUNK_BYTES (all rows if fewer)."""
    r = max(64, CHUNK_BYTES // (ffn_dim * elem_size) // 64 * 64)
    return min(rows, r)


def ffn_forward(x, w1, b1, w2, b2, rows_per_chunk):
    """(out, h, R): the MLP's output, its pre-activation (what backward needs besides x) and the chunk rows used."""
    h = F.linear(x, w1, b1)
    h2, lead = h.reshape(-1, h.shape[-1]), x.shape[:-1]
    R = rows_per_chunk or chunk_rows(h2.shape[0], h2.shape[1], h2.element_size())
    if R >= h2.shape[0]:
        return F.linear(F.gelu(h, approximate="tanh"), w2, b2), h, R
    out2 = h2.new_empty(h2.shape[0], w2.shape[0])  # a = GELU(h) lives one chunk at a time
    for r in range(0, h2.shape[0], R):
        out2[r:r + R] = F.linear(F.gelu(h2[r:r + R], approximate="tanh"), w2, b2)
    return out2.view(*lead, w2.shape[0]), h, R


def ffn_backward(dout, x, w1, w2, h, R, needs, has_b1, has_b2):
    """(dx, dw1, db1, dw2, db2) of ffn_forward from its input x and saved h; needs: the five inputs'
    needs_input_grad."""
    need_x, need_w1, need_b1, need_w2, need_b2 = needs
    need_b1, need_b2 = need_b1 and has_b1, need_b2 and has_b2
    need_dh = need_x or need_w1 or need_b1
    x2, h2 = x.reshape(-1, x.shape[-1]), h.reshape(-1, h.shape[-1])
    dout2 = dout.reshape(-1, dout.shape[-1])
    M = h2.shape[0]
    dx = dw1 = db1 = dw2 = db2 = None
    if R >= M:  # one chunk: the matmuls as eager autograd runs them
        if need_w2:
            dw2 = dout2.t() @ F.gelu(h2, approximate="tanh")  # a recomputed, freed at once
        db2 = dout2.sum(0) if need_b2 else None
        if need_dh:
            dh = gelu_grad_((dout2 @ w2).contiguous(), h2)  # da, turned into dh in place
            dw1 = dh.t() @ x2 if need_w1 else None
            db1 = dh.sum(0) if need_b1 else None
            dx = (dh @ w1).view(x.shape) if need_x else None
        return dx, dw1, db1, dw2, db2
    # chunks of rows: one chunk's a and da/dh at a time; weight gradients accumulate in place (addmm, fp32
    # inside the matmul, one rounding to the weight's dtype per chunk), bias gradients in fp32
    dx2 = torch.empty_like(x2) if need_x else None
    dw1 = torch.zeros_like(w1) if need_w1 else None
    dw2 = torch.zeros_like(w2) if need_w2 else None
    db1 = torch.zeros(w1.shape[0], dtype=torch.float32, device=w1.device) if need_b1 else None
    db2 = torch.zeros(w2.shape[0], dtype=torch.float32, device=w2.device) if need_b2 else None
    for r in range(0, M, R):
        h_c, do_c = h2[r:r + R], dout2[r:r + R]
        if need_w2:
            dw2.addmm_(do_c.t(), F.gelu(h_c, approximate="tanh"))
        if need_b2:
            db2 += do_c.sum(0, dtype=torch.float32)
        if need_dh:
            dh = gelu_grad_((do_c @ w2).contiguous(), h_c)
            if need_w1:
                dw1.addmm_(dh.t(), x2[r:r + R])
            if need_b1:
                db1 += dh.sum(0, dtype=torch.float32)
            if need_x:
                torch.mm(dh, w1, out=dx2[r:r + R])
            del dh
    return (dx2.view(x.shape) if need_x else None, dw1, db1.to(w1.dtype) if need_b1 else None, dw2,
            db2.to(w2.dtype) if need_b2 else None)


class _GeluFFN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, rows_per_chunk):
        out, h, ctx.R = ffn_forward(x, w1, b1, w2, b2, rows_per_chunk)
        ctx.save_for_backward(x, w1, w2, h)
        ctx.has_b1, ctx.has_b2 = b1 is not None, b2 is not None
        return out

    @staticmethod
    def backward(ctx, dout):
        x, w1, w2, h = ctx.saved_tensors
        return (*ffn_backward(dout, x, w1, w2, h, ctx.R, ctx.needs_input_grad[:5], ctx.has_b1, ctx.has_b2), None)


def autocast_args(x: torch.Tensor, *params):
    """The dtype the function's matmuls run in, and params cast to it as autocast would — outside the function, so
    that fp32 master weights receive fp32 gradients through the cast. Outside autocast every param must share
    x's dtype."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        return dtype, [p.to(dtype) if p is not None else None for p in params]
    given = [p for p in params if p is not None]
    if any(p.dtype != x.dtype for p in given):
        raise ValueError(f"x ({x.dtype}) and the weights ({[p.dtype for p in given]}) must share a dtype outside "
                         "autocast")
    return x.dtype, list(params)


def gelu_ffn(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None,
             backend: str = "auto", rows_per_chunk: int | None = None) -> torch.Tensor:
    """W2·GELU_tanh(W1·x + b1) + b2 over the last dim of x (F.linear's layout: w1 [F, D], w2 [D_out, F])."""
    if backend not in BACKENDS:
        raise ValueError(f"gelu_ffn backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if x.is_cuda and _HAS_TRITON else "torch"
    if backend == "torch" or torch.compiler.is_compiling():  # compiled graphs: Inductor plans the saves itself
        return gelu_ffn_reference(x, w1, b1, w2, b2)
    require_triton("gelu_ffn", _HAS_TRITON)
    if x.device.type != "cuda" and not _interpreting():
        raise RuntimeError("gelu_ffn: backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before first use")
    try:
        dtype, (w1, b1, w2, b2) = autocast_args(x, w1, b1, w2, b2)
    except ValueError as e:
        raise ValueError(f"gelu_ffn: {e}") from None
    with torch.autocast(x.device.type, enabled=False):
        return _GeluFFN.apply(x.to(dtype), w1, b1, w2, b2, rows_per_chunk)

"""The transformer MLP `out = W2·GELU_tanh(W1·x + b1) + b2` with a smaller backward footprint.

Eager autograd keeps both the pre-activation h = W1·x + b1 and a = GELU(h) ([tokens, ffn_dim] each, the two largest
tensors of a Wan block: 587 MB apiece at S = 32760, ffn_dim 8960, bf16) and allocates da and dh beside them in
backward. Here only x and h are saved. Backward computes da = dout·W2, then one Triton pass reads da and h once and
writes a into h's place and dh into da's (fp32 math), summing db1 = Σ_rows dh on the way — where eager makes a
(read h, write a), then dh (read da and h, write dh), then db1 (read dh): four passes over ffn-sized tensors instead
of six. Above CHUNK_BYTES per ffn-sized tensor, the forward's a and backward's da/dh are made a chunk of rows at a
time, weight gradients accumulated in place chunk by chunk (addmm: fp32 inside the matmul, one rounding per chunk,
as gradient accumulation), so the block's peak holds h plus one chunk-sized tensor where eager holds three full
ones (at S = 32760, bf16: ~1 GB less). Because h is overwritten, one forward takes one backward (a second, with
retain_graph=True, raises). a and dh differ from aten's gelu / gelu_backward only in fp32 rounding (a tanh made
from exp, below).

    GELU_tanh(h)  = ½·h·(1 + t),                 t = tanh(√(2/π)·(h + 0.044715·h³))
    GELU_tanh'(h) = ½·(1 + t) + ½·h·(1 − t²)·√(2/π)·(1 + 3·0.044715·h²)

backend: "torch" (plain autograd, the reference), "triton" (the fused backward: CUDA, or CPU under
TRITON_INTERPRET=1), "auto" (Triton on CUDA). Autocast is applied outside the function (the weights are cast to
the autocast dtype there, so their fp32 master copies receive fp32 gradients through the cast).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ops.triton_setup import BACKENDS, HAS_TRITON, cdiv, import_triton, interpreting, require_triton, store_cast

triton = tl = _cast = None  # set on first use by _kernel() (ops/triton_setup.py: the interpreter is chosen first)


def gelu_ffn_reference(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor,
                       b2: torch.Tensor | None) -> torch.Tensor:
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)


def _gelu_act_grad_kernel(DA, H, PART, R, F, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr, ITERS: tl.constexpr,
                          HAS_PART: tl.constexpr, EVEN: tl.constexpr):
    # A program owns BLOCK_F features of ITERS·BLOCK_R rows; PART row pid_r holds its column sums of dh (fp32).
    # Offsets inside a BLOCK_R-row block are int32, the block's start an int64 scalar. EVEN: no tile crosses R or F.
    pid_r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    tile = tl.arange(0, BLOCK_R)[:, None] * F + cols[None, :]
    cmask = cols < F
    acc = tl.zeros([BLOCK_R, BLOCK_F], dtype=tl.float32)  # reduced over rows once, at the end
    for i in range(ITERS):
        r0 = (pid_r * ITERS + i) * BLOCK_R
        da_p, h_p = DA + r0.to(tl.int64) * F + tile, H + r0.to(tl.int64) * F + tile
        if EVEN:
            da = tl.load(da_p).to(tl.float32)
            h = tl.load(h_p).to(tl.float32)
        else:
            mask = ((r0 + tl.arange(0, BLOCK_R)) < R)[:, None] & cmask[None, :]
            da = tl.load(da_p, mask=mask, other=0.0).to(tl.float32)
            h = tl.load(h_p, mask=mask, other=0.0).to(tl.float32)
        u = 0.7978845608028654 * (h + 0.044715 * h * h * h)
        # From e = exp(−2|u|) ∈ (0, 1] and r = 1 / (1 + e): 1 + tanh(u) = 2·s·r with s = e (u < 0) or 1, and
        # 1 − tanh² = 4·e·r². No overflow, and no cancellation on either tail; one division.
        e = tl.exp(-2.0 * tl.abs(u))
        r = 1.0 / (1.0 + e)
        sr = tl.where(u < 0, e, 1.0) * r
        g = sr + 2.0 * 0.7978845608028654 * h * e * r * r * (1.0 + 3.0 * 0.044715 * h * h)
        dh = da * g
        if EVEN:
            tl.store(h_p, _cast(h * sr, H.dtype.element_ty))  # a = ½·h·(1 + tanh), to nearest even
            tl.store(da_p, _cast(dh, DA.dtype.element_ty))
        else:
            tl.store(h_p, _cast(h * sr, H.dtype.element_ty), mask=mask)
            tl.store(da_p, _cast(dh, DA.dtype.element_ty), mask=mask)
        if HAS_PART:
            acc += dh  # masked lanes loaded da = 0: they add nothing
    if HAS_PART:
        tl.store(PART + pid_r.to(tl.int64) * F + cols, tl.sum(acc, axis=0), mask=cmask)


@functools.lru_cache(maxsize=None)
def _kernel(interpret: bool):
    global triton, tl, _cast
    triton, tl = import_triton("gelu_ffn", interpret, HAS_TRITON)
    _cast = store_cast(interpret)
    return triton.jit(_gelu_act_grad_kernel)


# (rows per iteration, features per program, iterations per program, warps). CUDA: the best of 16 shapes on the H200
# at Wan 1.3B's chunk (7488 × 8960; the timings against aten's three passes and their command in
# results/step_h200.md): 64 rows of 128 features a program. The interpreter's programs cost ~1 ms each whatever their
# size, so they are made large.
GELU_GRAD_CONFIG = {"cuda": (16, 128, 4, 4), "interpret": (32, 128, 4, 4)}


class ColumnSums:
    """Σ_rows dh over several gelu_act_grad_ calls (the chunks of one MLP backward), reduced once: each call writes
    its per-program partial rows into the next rows of one fp32 buffer, and total() sums them in a fixed order
    (deterministic) — one reduction launch for the whole backward instead of a sum and an add per chunk.
    rows / chunks: the rows of all calls together and their number (the buffer's size: at most one partial row per
    BLOCK_R·ITERS rows of a call, plus one per call)."""

    def __init__(self, rows: int, chunks: int, features: int, device: torch.device,
                 config: tuple[int, int, int, int] | None = None):
        block_r, _, iters, _ = config or GELU_GRAD_CONFIG["interpret" if interpreting() else "cuda"]
        self.config = config
        self.buf = torch.empty((rows // (block_r * iters) + chunks, features), dtype=torch.float32, device=device)
        self.used = 0

    def take(self, n: int) -> torch.Tensor:
        if self.used + n > self.buf.shape[0]:
            raise ValueError(f"ColumnSums: {self.used + n} partial rows asked of {self.buf.shape[0]}: more rows or "
                             "chunks than it was made for, or another launch shape")
        self.used += n
        return self.buf[self.used - n:self.used]

    def total(self) -> torch.Tensor:
        """The fp32 [F] sum of every call's dh so far."""
        return self.buf[:self.used].sum(0)


def gelu_act_grad_(da: torch.Tensor, h: torch.Tensor, db: torch.Tensor | ColumnSums | None = None,
                   config: tuple[int, int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLP backward's elementwise pass, in place and in one read of each: h ← a = GELU_tanh(h) and
    da ← dh = da · GELU_tanh'(h) (fp32 math, each rounded once to its tensor's dtype); with db (fp32 [F]) given,
    db += Σ_rows dh (the unrounded dh, column sums per program then summed in a fixed order: deterministic); with a
    ColumnSums, the per-program sums go to its buffer (made with this call's config), summed by its total().
    da and h: contiguous [R, F] (or any shape, F last) of one shape. Returns (a, dh) — h and da, overwritten."""
    if da.shape != h.shape or not (da.is_contiguous() and h.is_contiguous()) or da.dim() == 0:
        raise ValueError(f"gelu_act_grad_: da and h must be contiguous and of one shape, got {tuple(da.shape)}, "
                         f"{tuple(h.shape)}")
    F_ = h.shape[-1]
    R = h.numel() // F_ if F_ else 0
    sums = db if isinstance(db, ColumnSums) else None
    if sums is not None and (sums.buf.shape[1] != F_ or sums.config != config):
        raise ValueError(f"gelu_act_grad_: a ColumnSums of {sums.buf.shape[1]} features and launch shape "
                         f"{sums.config}, for {F_} features and {config}")
    if sums is None and db is not None and (db.dtype != torch.float32 or tuple(db.shape) != (F_,)):
        raise ValueError(f"gelu_act_grad_: db must be fp32 of shape ({F_},), got {db.dtype} {tuple(db.shape)}")
    if R == 0 or F_ == 0:
        return h, da
    interpret = interpreting()
    kernel = _kernel(interpret)
    block_r, block_f, iters, warps = config or GELU_GRAD_CONFIG["interpret" if interpret else "cuda"]
    n_r = triton.cdiv(R, block_r * iters)
    part = None
    if sums is not None:
        part = sums.take(n_r)
    elif db is not None:
        part = torch.empty((n_r, F_), dtype=torch.float32, device=h.device)
    if block_r * F_ >= 2**31:
        raise ValueError(f"gelu_act_grad_: {block_r} rows of {F_} features overflow the kernel's int32 offsets")
    even = R % (block_r * iters) == 0 and F_ % block_f == 0
    kernel[(n_r, triton.cdiv(F_, block_f))](da, h, part if part is not None else da, R, F_, BLOCK_R=block_r,
                                            BLOCK_F=block_f, ITERS=iters, HAS_PART=part is not None, EVEN=even,
                                            num_warps=warps)
    if db is not None and sums is None:
        db += part.sum(0)
    return h, da


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
    needs_input_grad. h is overwritten (a = GELU(h) is made in its place): one backward per forward."""
    need_x, need_w1, need_b1, need_w2, need_b2 = needs
    need_b1, need_b2 = need_b1 and has_b1, need_b2 and has_b2
    need_dh = need_x or need_w1 or need_b1
    x2, h2 = x.reshape(-1, x.shape[-1]), h.reshape(-1, h.shape[-1])
    dout2 = dout.reshape(-1, dout.shape[-1])
    M = h2.shape[0]
    one = R >= M > 0  # one chunk: the weight gradients are single matmuls, as eager autograd runs them
    dx2 = torch.empty_like(x2) if need_x else None
    dw1 = None if one or not need_w1 else torch.zeros_like(w1)
    dw2 = None if one or not need_w2 else torch.zeros_like(w2)
    db1 = ColumnSums(M, cdiv(M, max(R, 1)), w1.shape[0], w1.device) if need_b1 else None
    db2 = torch.zeros(w2.shape[0], dtype=torch.float32, device=w2.device) if need_b2 else None
    # chunks of rows: one chunk's da/dh at a time (a takes h's place); weight gradients accumulate in place (addmm:
    # fp32 inside the matmul, one rounding to the weight's dtype per chunk), bias gradients in fp32
    for r in range(0, M, max(R, 1)):  # no rows (M = R = 0): no chunk, zero weight gradients
        h_c, do_c, a, dh = h2[r:r + R], dout2[r:r + R], None, None
        if need_b2:
            db2 += do_c.sum(0, dtype=torch.float32)
        if need_dh:
            a, dh = gelu_act_grad_(do_c @ w2, h_c, db1)  # da turned into dh, h into a, db1 summed: one pass
        elif need_w2:
            a = F.gelu(h_c, approximate="tanh")
        if need_w2:
            dw2 = do_c.t() @ a if one else dw2.addmm_(do_c.t(), a)
        if need_w1:
            dw1 = dh.t() @ x2[r:r + R] if one else dw1.addmm_(dh.t(), x2[r:r + R])
        if need_x:
            torch.mm(dh, w1, out=dx2[r:r + R])
        del dh
    return (dx2.view(x.shape) if need_x else None, dw1, db1.total().to(w1.dtype) if need_b1 else None, dw2,
            db2.to(w2.dtype) if need_b2 else None)


def single_backward(ctx, op: str) -> None:
    """Marks ctx's one backward: ffn_backward overwrites the saved pre-activation, so a second backward through one
    forward would read a for h (every op built on ffn_backward calls this first: gelu_ffn, adaln_linear's
    adaln_gelu_ffn, gated_ffn)."""
    if getattr(ctx, "h_consumed", False):
        raise RuntimeError(f"{op}: a second backward through the same forward (retain_graph=True) is not supported "
                           "(the first overwrote the saved pre-activation)")
    ctx.h_consumed = True


class _GeluFFN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, rows_per_chunk):
        out, h, ctx.R = ffn_forward(x, w1, b1, w2, b2, rows_per_chunk)
        ctx.save_for_backward(x, w1, w2, h)
        ctx.has_b1, ctx.has_b2 = b1 is not None, b2 is not None
        return out

    @staticmethod
    def backward(ctx, dout):
        need = ctx.needs_input_grad
        if need[0] or need[1] or (need[2] and ctx.has_b1):  # dh is made: h is overwritten
            single_backward(ctx, "gelu_ffn")
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
        backend = "triton" if x.is_cuda and HAS_TRITON else "torch"
    if backend == "torch" or torch.compiler.is_compiling():  # compiled graphs: Inductor plans the saves itself
        return gelu_ffn_reference(x, w1, b1, w2, b2)
    require_triton("gelu_ffn", HAS_TRITON)
    if x.device.type != "cuda" and not interpreting():
        raise RuntimeError("gelu_ffn: backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before first use")
    try:
        dtype, (w1, b1, w2, b2) = autocast_args(x, w1, b1, w2, b2)
    except ValueError as e:
        raise ValueError(f"gelu_ffn: {e}") from None
    with torch.autocast(x.device.type, enabled=False):
        return _GeluFFN.apply(x.to(dtype), w1, b1, w2, b2, rows_per_chunk)

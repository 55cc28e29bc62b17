"""The Wan block's tail as one op — out = x + gate · MLP(AdaLN(x)) — whose recompute skips the down projection.

    y   = AdaLN(x; scale, shift)                        ops.adaln (fp32 math, y in the matmul dtype)
    h   = W1·y + b1,   a = GELU_tanh(h),   z = W2·a + b2     (ops.gelu_ffn)
    out = (x + z · gate) summed in fp32, in x.dtype          (ops.gated_residual: the same roundings)

Under activation checkpointing a block runs twice before its backward: the forward (its output kept, what it saves
dropped) and the recompute (what it saves kept, its output dropped). The recompute of the block's last op needs only
what that op's backward reads, and this backward never reads z:

    dz    = dout · gate,  Σ_rows dout                   (ops.gated_residual's backward kernel, one pass)
    G     = doutᵀ · a          [D, F] per sample, fp32     (the matmul dW2 would be, kept unscaled)
    dW2   = Σ_b gate_b ⊙ G_b   (row c scaled by gate_b[c]),     db2 = Σ_b gate_b ⊙ Σ_rows dout_b
    dgate = Σ_k W2[c, k] · G_b[c, k]  +  b2[c] · Σ_rows dout     = Σ_rows dout · z,   without z
    dh    = (dz · W2) ⊙ GELU_tanh'(h) with a = GELU(h) in h's place and db1 (ops.gelu_ffn.gelu_act_grad_, one pass),
    dW1   = dhᵀ · y,   dy = dh · W1   → ops.adaln's backward → dx, with dout (the residual) added in that kernel

so the recompute stops after W1·y (torch.utils.checkpoint's early stop, or the offloaded recompute): no down
projection, no GELU, no residual. The forward, whose saved tensors are dropped, makes a = GELU(W1·y + b1) in the
matmul's epilogue (cuBLASLt through torch._addmm_activation; GELU applied to the fp32 accumulator) and never h.
What each part costs on the H200 at Wan 1.3B's widths: results/step_h200.md.

Which pass is running is the caller's to say (`checkpoint_pass`: None | "forward" | "recompute"; the activation
checkpointing in models/checkpointing.py marks a checkpointed block's two calls and the fused Wan block hands the mark
over). A plain call (None) is an ordinary autograd op: z computed, h saved, the same backward.
Per-sample G costs one [D, F] fp32 buffer and one more pass over it a sample (gate_w2_: dW2 and dgate together),
worth it from a few thousand tokens a sample (GATED_TAIL_MIN_TOKENS); per-token gates (Wan 2.2) keep the separate
residual. dW1 accumulates in fp32 over every chunk of every sample as well (one [F, D] buffer), rounded once.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ops.adaln import adaln_backward, adaln_forward, adaln_reference
from ops.adaln_linear import fuses_adaln
from ops.gated_residual import gated_residual_backward, gated_residual_forward, gated_residual_reference
from ops.gelu_ffn import (ColumnSums, autocast_args, chunk_rows, ffn_forward, gelu_act_grad_, gelu_ffn_reference,
                          single_backward)
from ops.triton_setup import BACKENDS, HAS_TRITON, cdiv, import_triton, interpreting, store_cast

triton = tl = _cast = None  # set on first use by _kernel() (ops/triton_setup.py: the interpreter is chosen first)

# Below this many tokens a sample, the per-sample [D, F] passes cost about what skipping the down projection saves
# (Wan 1.3B: ~0.09 ms a sample against 2·S·D·F flops at ~700 TFLOP/s, even near S ≈ 2000).
GATED_TAIL_MIN_TOKENS = 4096

# The passes of an activation-checkpointed block this op tells apart: a plain call, the forward (its output is used,
# what it saves for backward is not: torch.utils.checkpoint's first call, or a forward without autograd) and the
# recompute (what it saves is used, its output is not).
PASSES = (None, "forward", "recompute")


@functools.lru_cache(maxsize=None)
def _has_out_dtype(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether half-precision matmuls here write fp32 and accumulate into it in place (torch.mm / addmm with
    out_dtype: CUDA, torch ≥ 2.9) — checked once on small tensors against an fp32 product."""
    try:
        a = torch.randn(64, 32, device=device).to(dtype)
        b = torch.randn(32, 48, device=device).to(dtype)
        ref = a.float() @ b.float()
        acc = torch.mm(a, b, out_dtype=torch.float32)
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        return acc.dtype == torch.float32 and bool(torch.allclose(acc, 2 * ref, rtol=1e-3, atol=1e-3))
    except (TypeError, RuntimeError, NotImplementedError):  # an older torch, or no such kernel on this device
        return False


def _mm_f32(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc + a·b accumulated in fp32 (acc None: a·b) for a, b in the matmul dtype."""
    if a.is_cuda and a.dtype != torch.float32 and _has_out_dtype(a.device, a.dtype):
        if acc is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    # CPU (the interpreter's tests): an fp32 product; a CUDA torch without out_dtype: one rounding per chunk
    prod = torch.mm(a, b).float() if a.is_cuda and a.dtype != torch.float32 else torch.mm(a.float(), b.float())
    return prod if acc is None else acc.add_(prod)


def _up_gelu(y2: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None) -> torch.Tensor:
    """GELU_tanh(y2·W1ᵀ + b1): on CUDA one cuBLASLt call with the GELU in its epilogue (fp32 accumulator; torch
    falls back to gelu(·, "tanh") where cuBLASLt is not taken). Not on the CPU: its _addmm_activation is erf's GELU."""
    if b1 is None or not y2.is_cuda:
        return F.gelu(F.linear(y2, w1, b1), approximate="tanh")
    return torch._addmm_activation(b1, y2, w1.t(), use_gelu=True)


def gated_tail_applies(x: torch.Tensor, gate: torch.Tensor) -> bool:
    """Whether adaln_gelu_ffn_gated takes these shapes: x [B, N, D] with N ≥ GATED_TAIL_MIN_TOKENS, a per-sample
    gate [B, 1, D], and no graph being compiled (Inductor plans its own saves)."""
    return (x.dim() == 3 and gate.dim() == 3 and tuple(gate.shape) == (x.shape[0], 1, x.shape[2])
            and x.shape[1] >= GATED_TAIL_MIN_TOKENS and not torch.compiler.is_compiling())


def _gate_w2_kernel(G, W2, GATE, DW2, DGATE, D, F, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr,
                    NEED_W2: tl.constexpr, ACC: tl.constexpr, NEED_GATE: tl.constexpr):
    # A program owns BLOCK_D rows of G [D, F] (fp32, contiguous, as W2) and walks their F columns: DW2 ← G·gate
    # (ACC: DW2 += G·gate, fp32) and DGATE[row] = Σ_k G·W2 (fp32, in a fixed order per row).
    rows = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = rows < D
    g = tl.load(GATE + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
    base = rows.to(tl.int64)[:, None] * F
    acc = tl.zeros([BLOCK_D, BLOCK_F], dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        mask = rmask[:, None] & (cols < F)[None, :]
        off = base + cols[None, :]
        gt = tl.load(G + off, mask=mask, other=0.0)
        if NEED_W2:
            if ACC:
                tl.store(DW2 + off, tl.load(DW2 + off, mask=mask, other=0.0) + gt * g, mask=mask)
            else:
                tl.store(DW2 + off, _cast(gt * g, DW2.dtype.element_ty), mask=mask)
        if NEED_GATE:
            acc += gt * tl.load(W2 + off, mask=mask, other=0.0).to(tl.float32)
    if NEED_GATE:
        tl.store(DGATE + rows, tl.sum(acc, axis=1), mask=rmask)


@functools.lru_cache(maxsize=None)
def _kernel(interpret: bool):
    global triton, tl, _cast
    triton, tl = import_triton("adaln_gelu_ffn_gated", interpret, HAS_TRITON)
    _cast = store_cast(interpret)
    return triton.jit(_gate_w2_kernel)


# (rows, features per iteration, warps). CUDA: Wan's [1536, 8960]; the interpreter's programs cost ~1 ms each.
GATE_W2_CONFIG = {"cuda": (4, 512, 4), "interpret": (16, 256, 4)}


def gate_w2_(G: torch.Tensor, w2: torch.Tensor, gate_row: torch.Tensor, dw2: torch.Tensor | None,
             dgate_row: torch.Tensor | None, accumulate: bool) -> None:
    """One pass over a sample's G [D, F] (fp32): dw2 ← G ⊙ gate_row[:, None] rounded to dw2's dtype (accumulate:
    dw2 += that, dw2 fp32) and dgate_row ← Σ_k G ⊙ W2 (fp32 [D]) — where eager runs four passes (G·g, its cast,
    G·W2, the row sum); device times at Wan 1.3B's [1536, 8960]: results/step_h200.md."""
    D, F_ = G.shape
    for name, t, shape in (("G", G, (D, F_)), ("w2", w2, (D, F_)), ("gate_row", gate_row, (D,)),
                           ("dw2", dw2, (D, F_)), ("dgate_row", dgate_row, (D,))):
        if t is not None and (tuple(t.shape) != shape or not t.is_contiguous()):  # the kernel reads rows of F
            raise ValueError(f"gate_w2_: {name} must be contiguous of shape {shape}, got {tuple(t.shape)} with "
                             f"strides {t.stride()}")
    if accumulate and dw2 is not None and dw2.dtype != torch.float32:
        raise ValueError(f"gate_w2_: dw2 accumulates in fp32, got {dw2.dtype}")
    if D == 0 or F_ == 0 or (dw2 is None and dgate_row is None):
        if dgate_row is not None:
            dgate_row.zero_()
        return
    interpret = interpreting()
    kernel = _kernel(interpret)
    block_d, block_f, warps = GATE_W2_CONFIG["interpret" if interpret else "cuda"]
    kernel[(triton.cdiv(D, block_d),)](G, w2, gate_row, dw2 if dw2 is not None else G,
                                       dgate_row if dgate_row is not None else G, D, F_, BLOCK_D=block_d,
                                       BLOCK_F=block_f, NEED_W2=dw2 is not None, ACC=accumulate,
                                       NEED_GATE=dgate_row is not None, num_warps=warps)


def _tail_backward(dz, do2, y, w1, w2, h, gate, R, needs):
    """(dy, dw1, db1, dw2, dgate without b2's share) of the MLP and gate from saved h (overwritten: a takes its
    place); chunks of R rows within a sample (da/dh one chunk at a time), G per sample in fp32."""
    need_w1, need_b1, need_w2, need_gate = needs
    B, N, F_ = h.shape
    D = y.shape[-1]
    h2, y2, dz2 = h.reshape(-1, F_), y.reshape(-1, D), dz.reshape(-1, D)
    dy = torch.empty_like(y2)
    dw1 = None  # fp32, accumulated over every chunk of every sample, rounded once
    # db1's partial rows for every chunk (at S = 32760, F = 8960: ≈ 19 MB held through the chunks), reduced once
    db1 = ColumnSums(B * N, B * cdiv(N, max(R, 1)), F_, y.device) if need_b1 else None
    # B > 1: fp32, accumulated over the samples, rounded once; B = 1: written once, in w2's dtype, made after the
    # chunks (not held through them: the block's peak is there)
    dw2 = torch.zeros(w2.shape, dtype=torch.float32, device=y.device) if need_w2 and B > 1 else None
    dgate = torch.empty(B, D, dtype=torch.float32, device=y.device) if need_gate else None
    w2c = w2.contiguous()
    for b in range(B):
        G = None
        for r in range(b * N, (b + 1) * N, R):
            e = min(r + R, (b + 1) * N)
            # da = dz·W2 turned into dh, h into a, db1 += Σ dh: one pass over the chunk (ops.gelu_ffn)
            a, dh = gelu_act_grad_(dz2[r:e] @ w2, h2[r:e], db1)
            if need_w2 or need_gate:
                G = _mm_f32(G, do2[r:e].t(), a)
            if need_w1:
                dw1 = _mm_f32(dw1, dh.t(), y2[r:e])
            torch.mm(dh, w1, out=dy[r:e])
            del a, dh
        if G is None:  # nothing asked of G (N ≥ 1 here: gated_tail_applies)
            continue
        if need_w2 and B == 1:
            dw2 = torch.empty(w2.shape, dtype=w2.dtype, device=y.device)
        # dW2 (+)= G ⊙ gate_b and dgate_b = Σ_k G ⊙ W2 in one pass over G
        gate_w2_(G, w2c, gate[b, 0].float().contiguous(), dw2, dgate[b] if need_gate else None, accumulate=B > 1)
    if need_w2 and B > 1:
        dw2 = dw2.to(w2.dtype)
    return (dy.view(y.shape), dw1.to(w1.dtype) if need_w1 else None, db1.total().to(w1.dtype) if need_b1 else None,
            dw2, dgate)


class _AdaLNFFNGated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kind, dtype, rows_per_chunk, x, scale, shift, gate, eps, w1, b1, w2, b2):
        y, mean, rstd = adaln_forward(x, scale, shift, eps)
        y = y.to(dtype)
        B, N, D = x.shape
        h_shape = (B, N, w1.shape[0])
        R = rows_per_chunk or chunk_rows(B * N, w1.shape[0], y.element_size())
        if kind == "forward":  # what is saved is dropped: a in the up projection's epilogue, h never made
            a = _up_gelu(y.view(-1, D), w1, b1)
            del y
            z = F.linear(a, w2, b2).view(B, N, -1)
            del a
            out = gated_residual_forward(x, z, gate)
            # stands for h: its shape, dtype and device only (NaN: a saved-tensor hook's copy of it shows, too)
            h = x.new_full((1,), float("nan"), dtype=dtype).expand(h_shape)
        elif kind == "recompute":  # what is saved is used, not the output: no down projection, no residual
            h = F.linear(y, w1, b1)
            # never read (the caller's promise for a recompute); if it were, NaN says so. new_full as the forward's
            # placeholder (a selective checkpoint's recompute may call only ops its forward called), stride 0: nothing
            # written
            out = x.new_full((1,), float("nan")).expand(x.shape)
        else:
            z, h, _ = ffn_forward(y, w1, b1, w2, b2, R)
            del y
            out = gated_residual_forward(x, z, gate)
        ctx.dtype, ctx.R, ctx.eps, ctx.has_b1 = dtype, R, eps, b1 is not None
        ctx.shift_shape, ctx.shift_dtype = list(shift.shape), shift.dtype
        ctx.save_for_backward(x, scale, shift, gate, mean, rstd, w1, w2, b2, h)
        return out

    @staticmethod
    def backward(ctx, dout):
        with torch.autocast(dout.device.type, enabled=False):  # backward under autocast: the forward's dtypes
            return _AdaLNFFNGated._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout):
        single_backward(ctx, "adaln_gelu_ffn_gated")
        x, scale, shift, gate, mean, rstd, w1, w2, b2, h = ctx.saved_tensors
        if h.numel() > 1 and h.stride(-1) == 0:
            raise RuntimeError("adaln_gelu_ffn_gated: backward reached a forward pass's placeholders — "
                               "checkpoint_pass='forward' was given for a call whose saved tensors are used")
        need = ctx.needs_input_grad
        B, N, D = x.shape
        dout = dout.contiguous()
        need_b2, b2_gate = need[11] and b2 is not None, need[6] and b2 is not None
        # dz = dout·gate and the per-sample sums Σ_rows dout in one pass (ops.gated_residual's backward with y = 1):
        # b2's share of dgate is b2·Σ dout, and db2 = Σ_b gate_b·Σ_rows dout_b
        ones = torch.ones(1, 1, D, dtype=ctx.dtype, device=x.device).expand(B, N, D)
        dz, dsum = gated_residual_backward(dout, ones, gate.float(), need_dy=True, need_dgate=need_b2 or b2_gate)
        y = adaln_forward(x, scale, shift, ctx.eps)[0].to(ctx.dtype)  # the forward's y, bit for bit
        dy, dw1, db1, dw2, dgate = _tail_backward(
            dz, dout.view(-1, D).to(ctx.dtype), y, w1, w2, h, gate, ctx.R,
            (need[8], need[9] and ctx.has_b1, need[10], need[6]))
        del y, dz
        # dx = the norm's backward + dout (the residual), summed in the kernel: one rounding, no separate pass
        dx, dscale, dshift = adaln_backward(dy.to(x.dtype), x, scale, mean, rstd, ctx.shift_shape, ctx.shift_dtype,
                                            dres=dout)
        db2 = (gate.float() * dsum).sum((0, 1)).to(b2.dtype) if need_b2 else None
        if need[6]:
            dgate = dgate.view(B, 1, D)
            dgate = (dgate + dsum * b2.float() if b2_gate else dgate).to(gate.dtype)
        return (None, None, None, dx, dscale if need[4] else None, dshift if need[5] else None, dgate, None,
                dw1, db1, dw2, db2)


def adaln_gelu_ffn_gated_reference(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float,
                                   w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None,
                                   gate: torch.Tensor) -> torch.Tensor:
    """The same function in plain PyTorch: the three ops' references composed (z saved by autograd as usual)."""
    return gated_residual_reference(x, gelu_ffn_reference(adaln_reference(x, scale, shift, eps), w1, b1, w2, b2), gate)


def adaln_gelu_ffn_gated(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float, w1: torch.Tensor,
                         b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None, gate: torch.Tensor,
                         backend: str = "auto", rows_per_chunk: int | None = None,
                         checkpoint_pass: str | None = None) -> torch.Tensor:
    """x + gate · (W2·GELU_tanh(W1·AdaLN(x; scale, shift) + b1) + b2), summed in fp32, in x.dtype (see the module
    docstring). backend: "torch" the reference; "triton" (CUDA, or CPU under TRITON_INTERPRET=1) and "auto" (where
    ops.adaln's kernel takes x, else the reference) the op, for the shapes gated_tail_applies accepts (raises on
    others). Compiled graphs take the reference (Inductor plans their saves).

    checkpoint_pass (PASSES): which pass of an activation-checkpointed block this call is. "forward": the output is
    used and nothing saved is (the up projection's epilogue makes a, h is never made); "recompute": what is saved is
    used and the output never read (it is NaN: nothing after this op in the checkpointed region may read it); None:
    a plain call. Without autograd every call is a "forward"."""
    if backend not in BACKENDS:
        raise ValueError(f"adaln_gelu_ffn_gated backend must be one of {BACKENDS}, got {backend!r}")
    if checkpoint_pass not in PASSES:
        raise ValueError(f"adaln_gelu_ffn_gated: checkpoint_pass must be one of {PASSES}, got {checkpoint_pass!r}")
    if not fuses_adaln(x, scale, shift, backend):
        return adaln_gelu_ffn_gated_reference(x, scale, shift, eps, w1, b1, w2, b2, gate)
    if not gated_tail_applies(x, gate):
        raise ValueError(f"adaln_gelu_ffn_gated takes x [B, N ≥ {GATED_TAIL_MIN_TOKENS}, D] and a per-sample gate "
                         f"[B, 1, D]; got x {tuple(x.shape)}, gate {tuple(gate.shape)}")
    try:
        dtype, (w1, b1, w2, b2) = autocast_args(x, w1, b1, w2, b2)
    except ValueError as e:
        raise ValueError(f"adaln_gelu_ffn_gated: {e}") from None
    kind = checkpoint_pass if torch.is_grad_enabled() else "forward"  # no autograd: nothing saved is used
    with torch.autocast(x.device.type, enabled=False):
        return _AdaLNFFNGated.apply(kind, dtype, rows_per_chunk, x, scale, shift, gate, float(eps), w1, b1, w2, b2)

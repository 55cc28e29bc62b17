"""AdaLN feeding matmuls, with the normalised activations recomputed in backward instead of saved.

    y = AdaLN(x; scale, shift)          (ops.adaln: LayerNorm in fp32, then y = x̂ · (1 + scale) + shift)
    adaln_linear:   out_i = y · W_iᵀ + b_i           for each of the given linears (Wan: to_q, to_k, to_v)
    adaln_gelu_ffn: out   = W2 · GELU_tanh(W1 · y + b1) + b2                             (ops.gelu_ffn)

Eager autograd saves y for the matmuls' weight gradients and x for the norm's backward: two tensors of x's size.
Here only x is saved (with the fp32 mean/rstd and the modulation views): backward reruns the forward kernel to make
y again — one read of x and one write of y, bit-identical to the forward's y — uses it for dW_i = dout_iᵀ · y and
frees it before the norm's backward. At S = 32760, D = 1536, bf16 that is 96 MiB less per norm held through a
recomputed Wan block's backward (three norms a block), for ≈ 0.05 ms of bandwidth each on an H200.

Backward: dy = Σ_i dout_i · W_i (addmm into one buffer: one rounding per term, as eager's gradient accumulation;
under autocast each term is rounded to the matmul dtype and summed in x's dtype, as eager's casts do),
dW_i = dout_iᵀ · y, db_i = Σ_rows dout_i; then ops.adaln's backward kernel turns dy into dx, dscale, dshift.

Under autocast the weights are cast outside the function (fp32 masters get fp32 gradients through the cast) and y
is cast to the autocast dtype inside, as nn.Linear under autocast would see it. backend: "torch" runs the plain
composition (the reference: adaln_reference then F.linear / gelu_ffn_reference, y saved as eager saves it); "triton"
and "auto" (Triton when ops.adaln would take it) the recomputing function.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ops.adaln import adaln_backward, adaln_forward, adaln_modulate, triton_supported
from ops.gelu_ffn import autocast_args, ffn_backward, ffn_forward, gelu_ffn_reference, single_backward
from ops.triton_setup import BACKENDS


def bias_grad(d2: torch.Tensor) -> torch.Tensor:
    """Σ_rows d2 of a [rows, D] gradient, in d2's dtype. On CUDA a product with a row of ones (one cuBLAS matmul,
    M = 1; like every half-precision matmul under torch's default allow_bf16/fp16_reduced_precision_reduction, it may
    reduce split-K partials in half precision): faster than aten's column sum at Wan's shapes on the H200, with the
    same relative error against fp64 (timings: results/step_h200.md; tests/test_adaln_linear.py checks the error on
    the GPU)."""
    if d2.is_cuda and d2.dtype in (torch.bfloat16, torch.float16) and d2.shape[0] > 0:
        return d2.new_ones(d2.shape[0]) @ d2
    return d2.sum(0)


class _Linears:
    """out_i = y · W_iᵀ + b_i; params (W_1, b_1, W_2, b_2, …), a bias may be None."""

    def forward(self, y, params):
        pairs = list(zip(params[::2], params[1::2]))
        return tuple(F.linear(y, w, b) for w, b in pairs), params[::2]

    def backward(self, ctx, y, saved, douts, needs):
        y2 = y.reshape(-1, y.shape[-1])
        dy, grads = None, []
        for i, (w, dout) in enumerate(zip(saved, douts)):
            d2 = dout.reshape(-1, dout.shape[-1])
            grads.append(d2.t() @ y2 if needs[2 * i] else None)
            grads.append(bias_grad(d2) if needs[2 * i + 1] and ctx.has_bias[i] else None)
            if dy is None:
                dy = (d2 @ w).to(ctx.x_dtype)
            elif dy.dtype == d2.dtype:
                dy.addmm_(d2, w)
            else:  # autocast: each term rounded to the matmul dtype, summed in x's (eager's casts do the same)
                dy += d2 @ w
        return dy.view(y.shape), grads


class _GeluFFN:
    """ops.gelu_ffn's MLP; params (w1, b1, w2, b2)."""

    def __init__(self, rows_per_chunk):
        self.rows_per_chunk = rows_per_chunk

    def forward(self, y, params):
        w1, b1, w2, b2 = params
        out, h, self.R = ffn_forward(y, w1, b1, w2, b2, self.rows_per_chunk)
        return (out,), (w1, w2, h)

    def backward(self, ctx, y, saved, douts, needs):
        single_backward(ctx, "adaln_gelu_ffn")
        w1, w2, h = saved
        dy, dw1, db1, dw2, db2 = ffn_backward(douts[0], y, w1, w2, h, self.R, (True, *needs),
                                              ctx.has_bias[0], ctx.has_bias[1])
        return dy, [dw1, db1, dw2, db2]


class _AdaLNThen(torch.autograd.Function):
    """AdaLN then a consumer of its output; saves x and the consumer's own tensors, never y. has_bias: per linear
    (for the consumer's backward: a None bias gets no gradient)."""

    @staticmethod
    def forward(ctx, consumer, compute_dtype, has_bias, residual, x, scale, shift, eps, *params):
        y, mean, rstd = adaln_forward(x, scale, shift, eps)
        outs, saved = consumer.forward(y.to(compute_dtype), params)
        del y
        ctx.consumer, ctx.compute_dtype, ctx.has_bias, ctx.eps = consumer, compute_dtype, has_bias, eps
        ctx.x_dtype, ctx.residual = x.dtype, residual
        ctx.shift_shape, ctx.shift_dtype = list(shift.shape), shift.dtype
        ctx.save_for_backward(x, scale, shift, mean, rstd, *saved)
        return (*outs, x) if residual else outs  # x returned as is: autograd hands out an alias of it

    @staticmethod
    def backward(ctx, *douts):
        x, scale, shift, mean, rstd, *saved = ctx.saved_tensors
        dres = douts[-1] if ctx.residual else None
        douts = douts[:-1] if ctx.residual else douts
        y = adaln_forward(x, scale, shift, ctx.eps)[0].to(ctx.compute_dtype)  # the forward's y, bit for bit
        dy, dparams = ctx.consumer.backward(ctx, y, saved, douts, ctx.needs_input_grad[8:])
        del y
        dx, dscale, dshift = adaln_backward(dy.to(x.dtype), x, scale, mean, rstd, ctx.shift_shape, ctx.shift_dtype,
                                            dres=dres)  # the residual's gradient summed in the same pass
        return (None, None, None, None, dx, dscale if ctx.needs_input_grad[5] else None,
                dshift if ctx.needs_input_grad[6] else None, None, *dparams)


def fuses_adaln(x, scale, shift, backend) -> bool:
    """Whether adaln_linear / adaln_gelu_ffn take the recomputing function for these inputs and backend."""
    if backend not in BACKENDS:
        raise ValueError(f"adaln backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return triton_supported(x, scale, shift) and not torch.compiler.is_compiling()
    return backend == "triton" and not torch.compiler.is_compiling()


def _apply(consumer, x, scale, shift, eps, params, has_bias, residual=False):
    try:
        dtype, params = autocast_args(x, *params)
    except ValueError as e:
        raise ValueError(f"adaln_linear: {e}") from None
    with torch.autocast(x.device.type, enabled=False):
        return _AdaLNThen.apply(consumer, dtype, has_bias, residual, x, scale, shift, float(eps), *params)


def adaln_linear(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float,
                 linears: list[tuple[torch.Tensor, torch.Tensor | None]], backend: str = "auto",
                 residual: bool = False) -> tuple:
    """(y · W_iᵀ + b_i for each (W_i, b_i) in linears), y = AdaLN(x; scale, shift); y is not saved for backward.

    residual=True appends x itself (an alias, for the residual around the norm: x + f(AdaLN(x))): its gradient
    reaches this op's backward, which adds it to dx inside the norm's backward kernel — where autograd would sum
    the two gradients of x in a separate pass (3 passes over x's size, at S = 32760 on Wan 1.3B ≈ 0.05 ms)."""
    if not fuses_adaln(x, scale, shift, backend):
        y = adaln_modulate(x, scale, shift, eps, backend="torch" if backend == "auto" else backend)
        return tuple(F.linear(y, w, b) for w, b in linears) + ((x,) if residual else ())
    params = [t for wb in linears for t in wb]
    return _apply(_Linears(), x, scale, shift, eps, params, tuple(b is not None for _, b in linears), residual)


def adaln_gelu_ffn(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float, w1: torch.Tensor,
                   b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None, backend: str = "auto",
                   rows_per_chunk: int | None = None) -> torch.Tensor:
    """ops.gelu_ffn of y = AdaLN(x; scale, shift); y is not saved for backward, only x and the pre-activation."""
    if not fuses_adaln(x, scale, shift, backend):
        y = adaln_modulate(x, scale, shift, eps, backend="torch" if backend == "auto" else backend)
        return gelu_ffn_reference(y, w1, b1, w2, b2)
    return _apply(_GeluFFN(rows_per_chunk), x, scale, shift, eps, [w1, b1, w2, b2],
                  (b1 is not None, b2 is not None))[0]



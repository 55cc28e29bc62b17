"""Fused gated residual of the Wan block, forward and backward in Triton.

    out = (x + y · gate)   summed in fp32, returned in x.dtype

the same function, rounding for rounding, as diffusers' Wan block
`(hidden_states.float() + attn_output * gate_msa).type_as(hidden_states)` and models.layers.gated_residual.
`x` (the residual stream) and `y` (the branch: attention or FFN output) are [B, N, D], each fp32, fp16 or bf16 and
not necessarily the same; `gate` is [B, 1, D] (per sample: Wan 2.1 hands over a `chunk` view of a [B, 6, D] fp32
table, stride 6·D), [B, N, D] (per token: squeezed views, any strides), [1, N, D] or [1, 1, D], fp32 or half. The
kernels read the gate by stride, never copy it.

Backward, one pass over dout and y:
    dx    = dout                                      no kernel: out is in x.dtype, so dout already is
    dy    = dout · gate                                in y.dtype
    dgate = Σ_rows dout · y   per sample ([1, 1, D]: over B too),   dout · y per token   in gate's dtype and shape

Bytes per element, bf16 x and y, per-sample fp32 gate: forward 6 (read x, y; write out), backward 6 (read dout, y;
write dy), saved for backward 0 new (y and the gate view, which the caller holds anyway; x is not saved). The eager
formula moves 38 forward (x.float(), y.float(), the product and the sum are each an fp32 tensor) and about 42
backward, and keeps y.float() (4 bytes per element) for backward.

Per-sample dgate: the programs own a tile of BLOCK_D features of one sample and a contiguous span of its rows, keep
[ROWS, BLOCK_D] fp32 accumulators in registers and write one partial row each; the partials ([B, P, D]) are summed
in a fixed order, so gradients are bit-for-bit deterministic (no float atomics). There is no row reduction here, so
tiling D costs no re-reads (unlike AdaLN's dx, which needs whole rows).

The forward is launched with floating-point contraction off: `x + y·g` as one fused multiply-add would round once
instead of twice and differ from eager PyTorch (and diffusers) in the last bit. With it off the output equals the
eager formula bit for bit in every dtype, as do dx, dy and per-token dgate (one multiply each) — on the GPU; the CPU
interpreter rounds fp32 → bf16 by truncation, so there bf16 results may differ in the last bit.

backend: "torch" (the reference), "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "auto" (Triton on CUDA tensors
it supports, the reference otherwise — other dtypes, devices or broadcast patterns). The Triton path runs through
the custom op `torch.ops.adaptiveload.gated_residual_fwd/gated_residual_bwd` (fake implementations registered)
inside torch.compile graphs, and through an autograd.Function over the same launchers in eager mode.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from ops.triton_setup import (BACKENDS, DTYPES, HAS_TRITON, KernelConfig, cdiv, import_triton, interpreter_config,
                              interpreting, mod_layout, nearest_tuned, next_pow2, on_device, require_triton, rows_last,
                              span, store_cast)

# Imported on first use by _kernels() (ops/triton_setup.py: the tests choose the interpreter before that).
triton = None
tl = None
_cast = None  # jitted by _kernels()


def gated_residual_reference(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return (x.float() + y.float() * gate.float()).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------- kernels
# Plain functions, jitted by _kernels() on first use. Every load is upcast to fp32 at once (the interpreter has no
# bf16 arithmetic, and the math is fp32 by contract). Row offsets are int64: B·N·D passes 2^31 at video sizes.
# Grid: (spans × feature tiles, B), feature tiles fastest so that neighbouring programs read the same rows.

def _fwd_kernel(X, Y, GATE, OUT,
                N, tiles_per_prog, n_dtiles,
                sxb, sxn, syb, syn, sgb, sgn, sgd,
                D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
                GATE_PER_TOKEN: tl.constexpr, NUM_STAGES: tl.constexpr):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pid_d = pid % n_dtiles
    pid_n = pid // n_dtiles
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    rows = tl.arange(0, ROWS)
    if not GATE_PER_TOKEN:  # one vector per sample: loaded once, broadcast over the program's rows
        g = tl.load(GATE + b * sgb + cols * sgd, mask=cmask, other=0.0).to(tl.float32)[None, :]
    t0 = pid_n * tiles_per_prog
    t1 = tl.minimum(t0 + tiles_per_prog, tl.cdiv(N, ROWS))
    for t in tl.range(t0, t1, num_stages=NUM_STAGES):
        n = (t * ROWS + rows).to(tl.int64)
        mask = (n < N)[:, None] & cmask[None, :]
        x = tl.load(X + b * sxb + n[:, None] * sxn + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.load(Y + b * syb + n[:, None] * syn + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if GATE_PER_TOKEN:
            g = tl.load(GATE + b * sgb + n[:, None] * sgn + cols[None, :] * sgd, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + (b * N + n[:, None]) * D + cols[None, :], _cast(x + y * g, OUT.dtype.element_ty),
                 mask=mask)


def _bwd_kernel(DOUT, Y, GATE, DY, DGATE,
                N, tiles_per_prog, n_dtiles, n_spans,
                sob, son, syb, syn, sgb, sgn, sgd, dgb,
                D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, GATE_PER_TOKEN: tl.constexpr,
                NEED_DY: tl.constexpr, NEED_DGATE: tl.constexpr, NUM_STAGES: tl.constexpr):
    # DGATE: per token, [B or 1, N, D] written row by row (batch stride dgb); per sample, the [B, n_spans, D] fp32
    # partial buffer, one row of BLOCK_D per program. Masked lanes load dout = 0: they add nothing to the partials.
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pid_d = pid % n_dtiles
    pid_n = pid // n_dtiles
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    rows = tl.arange(0, ROWS)
    if NEED_DY and not GATE_PER_TOKEN:
        g = tl.load(GATE + b * sgb + cols * sgd, mask=cmask, other=0.0).to(tl.float32)[None, :]
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)  # Σ dout·y, reduced over rows once at the end
    t0 = pid_n * tiles_per_prog
    t1 = tl.minimum(t0 + tiles_per_prog, tl.cdiv(N, ROWS))
    for t in tl.range(t0, t1, num_stages=NUM_STAGES):
        n = (t * ROWS + rows).to(tl.int64)
        mask = (n < N)[:, None] & cmask[None, :]
        do = tl.load(DOUT + b * sob + n[:, None] * son + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if NEED_DY:
            if GATE_PER_TOKEN:
                g = tl.load(GATE + b * sgb + n[:, None] * sgn + cols[None, :] * sgd, mask=mask,
                            other=0.0).to(tl.float32)
            tl.store(DY + (b * N + n[:, None]) * D + cols[None, :], _cast(do * g, DY.dtype.element_ty), mask=mask)
        if NEED_DGATE:
            y = tl.load(Y + b * syb + n[:, None] * syn + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if GATE_PER_TOKEN:
                tl.store(DGATE + b * dgb + n[:, None] * D + cols[None, :], _cast(do * y, DGATE.dtype.element_ty),
                         mask=mask)
            else:
                acc += do * y
    if NEED_DGATE and not GATE_PER_TOKEN:
        tl.store(DGATE + (b * n_spans + pid_n) * D + cols, tl.sum(acc, axis=0), mask=cmask)


def _require_triton() -> None:
    require_triton("gated_residual", HAS_TRITON)


@functools.lru_cache(maxsize=None)
def _kernels(interpret: bool):
    global triton, tl, _cast
    triton, tl = import_triton("gated_residual", interpret, HAS_TRITON)
    _cast = store_cast(interpret)  # round-to-nearest-even bf16 stores under the interpreter too (triton_setup)
    return triton.jit(_fwd_kernel), triton.jit(_bwd_kernel)


# ---------------------------------------------------------------------------------------------------------- launchers
# Launch shapes (ops.triton_setup.KernelConfig; `split` is unused here), keyed by (kernel, per-token gate, D). The
# per-sample forward at D = 1536 is the H200 sweep's best at N = 32760, one 4 × 256 tile per program (the sweep:
# results/step_h200.md).
# The rest are first guesses from the AdaLN sweeps (results/adaln_h200.md) — a persistent grid with a pipelined loop
# over ~2048-element tiles for the per-sample gate, one tile per program for the per-token one, whose rows carry
# more bytes. `python scripts/bench/gated_residual.py --sweep` measures them. Another D takes the nearest entry with
# rows scaled to keep the tile's size. block_d 0: the widest power of two dividing D (no masked lanes), ≤ 1024.
TUNED = {
    ("fwd", False, 1536): KernelConfig(4, 4, 0, block_d=256),
    ("fwd", False, 5120): KernelConfig(2, 4, 8, num_stages=3),
    ("fwd", True, 1536): KernelConfig(4, 4, 0),
    ("fwd", True, 5120): KernelConfig(2, 4, 0),
    ("bwd", False, 1536): KernelConfig(4, 4, 8, num_stages=3),
    ("bwd", False, 5120): KernelConfig(2, 4, 8, num_stages=3),
    ("bwd", True, 1536): KernelConfig(4, 4, 0),
    ("bwd", True, 5120): KernelConfig(2, 4, 0),
}
MAX_BLOCK_D = 1024


def block_d_of(D: int, cfg: KernelConfig) -> int:
    if cfg.block_d:
        return cfg.block_d
    divisor = D & -D  # model widths (1536 = 3·512, 5120 = 5·1024) tile exactly; odd D takes one masked tile
    return min(divisor if divisor >= 128 else next_pow2(D), MAX_BLOCK_D)


def default_config(kind: str, D: int, device: torch.device, per_token: bool = False) -> KernelConfig:
    """Launch shape for a kernel ("fwd", "bwd") at width D."""
    if device.type != "cuda":
        return interpreter_config(block_d=next_pow2(D))
    D0, cfg = nearest_tuned(TUNED, (kind, per_token), D)
    if D0 == D:
        return cfg
    tile = cfg.rows * block_d_of(D0, cfg)
    cfg = dataclasses.replace(cfg, block_d=0)  # this D's own feature tile
    return dataclasses.replace(cfg, rows=max(1, min(64, tile // block_d_of(D, cfg))))


def _unsupported(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> str | None:
    """Why the kernels cannot take these inputs (None: they can)."""
    if x.dim() != 3:
        return f"x must be [B, N, D], got shape {tuple(x.shape)}"
    B, N, D = x.shape
    if y.shape != x.shape:
        return f"y must have x's shape {tuple(x.shape)}, got {tuple(y.shape)}"
    if gate.dim() != 3 or gate.shape[2] != D or gate.shape[0] not in (1, B) or gate.shape[1] not in (1, N):
        return f"gate must be [B, 1, D], [B, N, D] or [1, 1, D] with x [B, N, D] = {tuple(x.shape)}, got " \
               f"{tuple(gate.shape)}"
    for name, t in (("x", x), ("y", y), ("gate", gate)):
        if t.dtype not in DTYPES or t.device != x.device:
            return f"{name} must be fp32/fp16/bf16 on {x.device}, got {t.dtype} on {t.device}"
    return None


def _check(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> None:
    err = _unsupported(x, y, gate)
    if err is not None:
        raise ValueError(f"gated_residual: {err}; backend='torch' takes any broadcastable shapes and dtypes")
    if x.device.type != "cuda" and not interpreting():
        raise RuntimeError("gated_residual: backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before "
                           "first use")


def _grid(N: int, B: int, D: int, cfg: KernelConfig, device: torch.device) -> tuple[int, int, int, int]:
    """(block_d, feature tiles, spans per sample, tiles per span)."""
    block_d = block_d_of(D, cfg)
    n_dtiles = cdiv(D, block_d)
    if B * n_dtiles == 0:
        return block_d, n_dtiles, 0, 1
    P, tiles_per_prog = span(cdiv(N, cfg.rows), B * n_dtiles, cfg, device)
    return block_d, n_dtiles, P, tiles_per_prog


def gated_residual_forward(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor,
                           config: KernelConfig | None = None) -> torch.Tensor:
    """Launch the forward kernel: out [B, N, D] in x.dtype."""
    _check(x, y, gate)
    x, y = rows_last(x), rows_last(y)
    B, N, D = x.shape
    out = torch.empty((B, N, D), dtype=x.dtype, device=x.device)
    per_token, sgb, sgn, sgd = mod_layout(gate, B, N)
    cfg = config or default_config("fwd", D, x.device, per_token)
    block_d, n_dtiles, P, tiles_per_prog = _grid(N, B, D, cfg, x.device)
    if P * B == 0 or D == 0:
        return out
    fwd, _ = _kernels(interpreting())
    with on_device(x.device):
        fwd[(P * n_dtiles, B)](x, y, gate, out, N, tiles_per_prog, n_dtiles,
                               x.stride(0), x.stride(1), y.stride(0), y.stride(1), sgb, sgn, sgd,
                               D=D, BLOCK_D=block_d, ROWS=cfg.rows, GATE_PER_TOKEN=per_token,
                               NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps,
                               enable_fp_fusion=False)  # two roundings, as eager: see the module docstring
    return out


def gated_residual_backward(dout: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, need_dy: bool = True,
                            need_dgate: bool = True, config: KernelConfig | None = None
                            ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Launch the backward kernel: (dy in y's dtype, dgate in gate's dtype and shape), None where not needed.
    dx is dout itself (out is in x.dtype): nothing to launch for it."""
    dout, y = rows_last(dout), rows_last(y)
    B, N, D = y.shape
    dev = y.device
    per_token, sgb, sgn, sgd = mod_layout(gate, B, N)
    cfg = config or default_config("bwd", D, dev, per_token)
    block_d, n_dtiles, P, tiles_per_prog = _grid(N, B, D, cfg, dev)
    dy = torch.empty((B, N, D), dtype=y.dtype, device=dev) if need_dy else None
    dgate_full = per_token and (gate.shape[0] == B or B == 1)  # written in its final dtype and layout
    if not need_dgate:
        dgate = None
    elif per_token:  # shared over B ([1, N, D]): fp32 per sample, summed below
        dgate = torch.empty((B, N, D), dtype=gate.dtype if dgate_full else torch.float32, device=dev)
    else:
        alloc = torch.empty if P * B > 0 else torch.zeros  # nothing to launch: the sums are zero
        dgate = alloc((B, max(P, 1), D), dtype=torch.float32, device=dev)
    if P * B > 0 and D > 0 and (need_dy or need_dgate):
        _, bwd = _kernels(interpreting())
        with on_device(dev):
            bwd[(P * n_dtiles, B)](dout, y, gate, dy, dgate, N, tiles_per_prog, n_dtiles, P,
                                   dout.stride(0), dout.stride(1), y.stride(0), y.stride(1), sgb, sgn, sgd,
                                   N * D if per_token else 0,
                                   D=D, BLOCK_D=block_d, ROWS=cfg.rows, GATE_PER_TOKEN=per_token,
                                   NEED_DY=need_dy, NEED_DGATE=need_dgate, NUM_STAGES=cfg.num_stages,
                                   num_warps=cfg.num_warps)
    if need_dgate and not dgate_full:
        if not per_token:
            # [B, 1, D]: the partials in a fixed order, deterministic ([B, 0, D] for a per-token gate with N = 0)
            dgate = dgate.sum(1, keepdim=True)[:, :gate.shape[1]]
        if gate.shape[0] != B:
            dgate = dgate.sum(0, keepdim=True)
        dgate = dgate.to(gate.dtype)
    return dy, dgate


# ------------------------------------------------------------------------------------------- custom op and autograd
@torch.library.custom_op("adaptiveload::gated_residual_fwd", mutates_args=())
def _gated_residual_fwd_op(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return gated_residual_forward(x, y, gate)


@_gated_residual_fwd_op.register_fake
def _gated_residual_fwd_fake(x, y, gate):
    _check(x, y, gate)  # at trace time, so that a compiled graph reports bad inputs as eager does
    return x.new_empty(x.shape)


@torch.library.custom_op("adaptiveload::gated_residual_bwd", mutates_args=())
def _gated_residual_bwd_op(dout: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, need_dy: bool,
                           need_dgate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    dy, dgate = gated_residual_backward(dout, y, gate, need_dy, need_dgate)
    # a custom op returns tensors: an empty one stands for a gradient not asked for
    return (y.new_empty(0) if dy is None else dy), (gate.new_empty(0) if dgate is None else dgate)


@_gated_residual_bwd_op.register_fake
def _gated_residual_bwd_fake(dout, y, gate, need_dy, need_dgate):
    return y.new_empty(y.shape if need_dy else (0,)), gate.new_empty(gate.shape if need_dgate else (0,))


def _setup_context(ctx, inputs, output):
    x, y, gate = inputs
    ctx.save_for_backward(y, gate)  # the caller's tensors (gate: a view of the table); x is not needed
    ctx.x_dtype = x.dtype


def _grads(ctx, dout, dy_dgate):
    """(dx, dy, dgate) for autograd from dout and the kernel's (dy, dgate)."""
    need_dx, need_dy, need_dgate = ctx.needs_input_grad
    dy, dgate = dy_dgate
    return dout.to(ctx.x_dtype) if need_dx else None, dy if need_dy else None, dgate if need_dgate else None


def _op_backward(ctx, dout):
    y, gate = ctx.saved_tensors
    _, need_dy, need_dgate = ctx.needs_input_grad
    if not (need_dy or need_dgate):
        return _grads(ctx, dout, (None, None))
    return _grads(ctx, dout, torch.ops.adaptiveload.gated_residual_bwd(dout, y, gate, need_dy, need_dgate))


_gated_residual_fwd_op.register_autograd(_op_backward, setup_context=_setup_context)


class _GatedResidualFunction(torch.autograd.Function):
    """The eager path: the same launchers and saved tensors without the custom op's dispatcher round trips (see
    ops/adaln.py: they cost a few times the host time of the launches)."""

    @staticmethod
    def forward(ctx, x, y, gate):
        out = gated_residual_forward(x, y, gate)
        _setup_context(ctx, (x, y, gate), out)
        return out

    @staticmethod
    def backward(ctx, dout):
        y, gate = ctx.saved_tensors
        _, need_dy, need_dgate = ctx.needs_input_grad
        return _grads(ctx, dout, gated_residual_backward(dout, y, gate, need_dy, need_dgate))


# ------------------------------------------------------------------------------------------------------ functional
def triton_supported(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> bool:
    """Whether backend="auto" takes the Triton path for these inputs."""
    return x.is_cuda and HAS_TRITON and _unsupported(x, y, gate) is None and x.shape[-1] > 0


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """(x + y·gate) in fp32, cast to x.dtype: x, y [B, N, D]; gate [B, 1, D], [B, N, D] or [1, 1, D]."""
    if backend not in BACKENDS:
        raise ValueError(f"gated_residual backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if triton_supported(x, y, gate) else "torch"
    if backend == "torch":
        return gated_residual_reference(x, y, gate)
    _require_triton()
    if torch.compiler.is_compiling():  # graphs hold the custom op: its fake impl traces, Inductor leaves it whole
        return torch.ops.adaptiveload.gated_residual_fwd(x, y, gate)
    return _GatedResidualFunction.apply(x, y, gate)

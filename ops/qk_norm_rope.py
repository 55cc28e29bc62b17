"""Fused q/k RMSNorm + 3-D RoPE of Wan's self-attention: one pass over the projection, forward and backward in Triton.

x is the q (or k) projection [B, N, D], D = heads · head_dim, normalised across all heads; cos/sin [N, K] fp32
with K = head_dim/2, as models.layers.RoPE3D returns them. Per row, with i the pair index within a head:

    rstd = 1 / sqrt(mean_D(x²) + eps)                                fp32
    n    = round_x.dtype(x · rstd · w)                               fp32 math, rounded as RMSNorm returns it
    y_2i = n_2i cos_i − n_2i+1 sin_i,   y_2i+1 = n_2i sin_i + n_2i+1 cos_i      fp32 math, returned in x.dtype

This is models.layers.RMSNorm followed by apply_rope, roundings included (the intermediate rounding of n too), so
the output is the model's own to rounding; y [B, N, D] is contiguous, the layout attention views as [B, N, H, Dh].

Backward (autograd passes a cast's gradient straight through, so the rounding of n has none):
    dn_2i = dy_2i cos_i + dy_2i+1 sin_i,   dn_2i+1 = dy_2i+1 cos_i − dy_2i sin_i               (Rᵀ dy)
    x̂ = x · rstd,   g = dn · w
    dx = rstd · (g − x̂ · mean_D(g · x̂))                one pass over x and dy, x̂ and dn recomputed
    dw = Σ_rows dn · x̂                                   fp32 partial sums per program, summed in a fixed order
The eager path rounds dn to x.dtype on its way into RMSNorm's backward; here dn stays fp32 (closer to fp64).

Saved for backward: x (the caller's tensor) and the fp32 rstd [B, N] — 2 bytes per element of bf16 x plus 4 per
row, against 8 bytes per element for the eager path on CPU (x.float() and x.float() · rstd; RMSNorm is composite
there). Bytes moved per element of bf16 x at D = 1536, 12 heads: forward 4.33 (x, y, the token's cos/sin row),
backward 6.33 (x, dy, dx, cos/sin) plus the dw partials; the eager path, counted op by op on CPU, moves 79 and 153
in 15 and 29 ops (scripts/bench/qk_norm_rope.py counts it on the device it runs on).

q and k are two calls (one launch each): the self-attention's k has the same N and cos/sin, but one launch for both
would save a launch, not bytes.

dw: each program owns a contiguous span of rows of one sample, keeps [ROWS, D] fp32 accumulators in registers and
writes one partial row; the partials ([B, P, D]) are summed in a fixed order, so dw is bit-for-bit deterministic
(no float atomics).

backend: "torch" (the reference), "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "auto" (Triton on CUDA tensors
it supports, the reference otherwise). As in ops.adaln, compiled graphs hold the custom op
`torch.ops.adaptiveload.qk_norm_rope_fwd/_bwd` (fake implementations registered) and eager mode runs an
autograd.Function over the same launchers.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ops.triton_setup import (BACKENDS, DTYPES, HAS_TRITON, MAX_D, KernelConfig, cdiv, device_fn, import_triton,
                              interpreter_config, interpreting, nearest_tuned, next_pow2, on_device, require_triton,
                              rows_last, segments, span)

# Imported on first use by _kernels() (ops/triton_setup.py: the tests choose the interpreter before that).
triton = None
tl = None
_rne_bf16 = _load_angles = _rotate = None  # helpers of the kernels, jitted by _kernels()


def qk_norm_rope_reference(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           eps: float = 1e-6) -> torch.Tensor:
    """models.layers RMSNorm then apply_rope on x [B, N, D] (ops cannot import models: tests pin the two equal)."""
    n = F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)
    n1, n2 = n.unflatten(-1, (-1, cos.shape[-1], 2)).unbind(-1)  # (B, N, H, K) each
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack([n1 * c - n2 * s, n1 * s + n2 * c], dim=-1).flatten(-3).type_as(x)


# ----------------------------------------------------------------------------------------------------------- kernels
# Plain functions, jitted by _kernels() on first use; every load is upcast to fp32 at once, row offsets are int64.
#
# Rows are loaded and stored as contiguous [ROWS, 2·PAIRS] tiles (16-byte vectors) and viewed as [ROWS, PAIRS, 2]
# only to rotate: tl.split/tl.join take the two members of each pair (x_2i, x_2i+1) from one thread's registers.
# Loading [ROWS, PAIRS, 2] tiles directly gave 2- and 4-byte accesses instead (PTX for sm_90). The D/2 pairs are held
# in two power-of-two segments (ops.triton_setup.segments), [0, BLOCK_A) and [BLOCK_A, BLOCK_A + BLOCK_B): at
# D = 1536 that is 512 + 256 pairs and no masked lane. Pair p of the row rotates by angle p mod HALF_DH of its token
# (every head reads the same cos/sin row; the repeats hit L1).

def _load_angles_impl(COS, SIN, n, rmask, p, scn, sck, ssn, ssk, D: tl.constexpr, HALF_DH: tl.constexpr):
    # [ROWS, PAIRS] cos and sin of pairs p of rows n: pair p rotates by angle p mod HALF_DH of its token
    k = p % HALF_DH
    mask = rmask[:, None] & (p < D // 2)[None, :]
    cos = tl.load(COS + n[:, None] * scn + k[None, :] * sck, mask=mask, other=0.0)
    sin = tl.load(SIN + n[:, None] * ssn + k[None, :] * ssk, mask=mask, other=0.0)
    return cos, sin


def _rotate_impl(v, cos, sin, ROWS: tl.constexpr, PAIRS: tl.constexpr):
    # v [ROWS, 2·PAIRS] as interleaved pairs (v_2i, v_2i+1) → (v_2i cos − v_2i+1 sin, v_2i sin + v_2i+1 cos); the
    # reshape keeps a pair in one thread's registers, so loads and stores stay 16-byte vectors
    ev, od = tl.split(tl.reshape(v, (ROWS, PAIRS, 2)))
    return tl.reshape(tl.join(ev * cos - od * sin, ev * sin + od * cos), (ROWS, 2 * PAIRS))


def _rne_bf16_impl(v, EMULATE_RNE: tl.constexpr):
    # Triton's interpreter (3.9) casts fp32 → bf16 by truncation, the GPU to nearest even. EMULATE_RNE (bf16 under the
    # interpreter only) rounds v to the nearest-even bf16 by integer arithmetic, so that the cast after it is exact
    # and the CPU tests see the GPU's numbers; on the GPU this is the identity.
    if EMULATE_RNE:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        v = bits.to(tl.float32, bitcast=True)
    return v


def _fwd_kernel(X, W, COS, SIN, Y, RSTD,
                N, tiles_per_prog, eps,
                sxb, sxn, scn, sck, ssn, ssk,
                D: tl.constexpr, HALF_DH: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
                ROWS: tl.constexpr, NUM_STAGES: tl.constexpr, EMULATE_RNE: tl.constexpr):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, ROWS)
    ca = tl.arange(0, 2 * BLOCK_A)  # elements of segment a
    cb = 2 * BLOCK_A + tl.arange(0, 2 * BLOCK_B)
    ma = ca < D
    mb = cb < D
    pa = tl.arange(0, BLOCK_A)  # pairs of segment a
    pb = BLOCK_A + tl.arange(0, BLOCK_B)
    wa = tl.load(W + ca, mask=ma, other=0.0).to(tl.float32)[None, :]
    wb = tl.load(W + cb, mask=mb, other=0.0).to(tl.float32)[None, :]
    t0 = pid * tiles_per_prog
    t1 = tl.minimum(t0 + tiles_per_prog, tl.cdiv(N, ROWS))
    for t in tl.range(t0, t1, num_stages=NUM_STAGES):
        n = (t * ROWS + rows).to(tl.int64)
        rmask = n < N
        mask_a = rmask[:, None] & ma[None, :]
        mask_b = rmask[:, None] & mb[None, :]
        x_row = X + b * sxb + n[:, None] * sxn
        xa = tl.load(x_row + ca[None, :], mask=mask_a, other=0.0).to(tl.float32)
        xb = tl.load(x_row + cb[None, :], mask=mask_b, other=0.0).to(tl.float32)
        rstd = tl.div_rn(1.0, tl.sqrt_rn((tl.sum(xa * xa, axis=1) + tl.sum(xb * xb, axis=1)) / D + eps))
        # RMSNorm's output in x.dtype: (x · rstd) · w in fp32, in that order, then rounded
        na = _rne_bf16(xa * rstd[:, None] * wa, EMULATE_RNE).to(Y.dtype.element_ty).to(tl.float32)
        nb = _rne_bf16(xb * rstd[:, None] * wb, EMULATE_RNE).to(Y.dtype.element_ty).to(tl.float32)
        cos_a, sin_a = _load_angles(COS, SIN, n, rmask, pa, scn, sck, ssn, ssk, D, HALF_DH)
        cos_b, sin_b = _load_angles(COS, SIN, n, rmask, pb, scn, sck, ssn, ssk, D, HALF_DH)
        ya = _rotate(na, cos_a, sin_a, ROWS, BLOCK_A)
        yb = _rotate(nb, cos_b, sin_b, ROWS, BLOCK_B)
        y_row = Y + (b * N + n[:, None]) * D
        tl.store(y_row + ca[None, :], _rne_bf16(ya, EMULATE_RNE).to(Y.dtype.element_ty), mask=mask_a)
        tl.store(y_row + cb[None, :], _rne_bf16(yb, EMULATE_RNE).to(Y.dtype.element_ty), mask=mask_b)
        tl.store(RSTD + b * N + n, rstd, mask=rmask)


def _bwd_kernel(DY, X, W, COS, SIN, RSTD, DX, DW_PART,
                N, tiles_per_prog, n_progs,
                sdyb, sdyn, sxb, sxn, scn, sck, ssn, ssk,
                D: tl.constexpr, HALF_DH: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
                ROWS: tl.constexpr, NUM_STAGES: tl.constexpr, EMULATE_RNE: tl.constexpr):
    # DW_PART: [B, n_progs, D] fp32, one partial row per program
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, ROWS)
    ca = tl.arange(0, 2 * BLOCK_A)
    cb = 2 * BLOCK_A + tl.arange(0, 2 * BLOCK_B)
    ma = ca < D
    mb = cb < D
    pa = tl.arange(0, BLOCK_A)
    pb = BLOCK_A + tl.arange(0, BLOCK_B)
    wa = tl.load(W + ca, mask=ma, other=0.0).to(tl.float32)[None, :]
    wb = tl.load(W + cb, mask=mb, other=0.0).to(tl.float32)[None, :]
    acc_a = tl.zeros([ROWS, 2 * BLOCK_A], dtype=tl.float32)
    acc_b = tl.zeros([ROWS, 2 * BLOCK_B], dtype=tl.float32)
    t0 = pid * tiles_per_prog
    t1 = tl.minimum(t0 + tiles_per_prog, tl.cdiv(N, ROWS))
    for t in tl.range(t0, t1, num_stages=NUM_STAGES):
        n = (t * ROWS + rows).to(tl.int64)
        rmask = n < N
        mask_a = rmask[:, None] & ma[None, :]
        mask_b = rmask[:, None] & mb[None, :]
        x_row = X + b * sxb + n[:, None] * sxn
        dy_row = DY + b * sdyb + n[:, None] * sdyn
        xa = tl.load(x_row + ca[None, :], mask=mask_a, other=0.0).to(tl.float32)
        xb = tl.load(x_row + cb[None, :], mask=mask_b, other=0.0).to(tl.float32)
        dya = tl.load(dy_row + ca[None, :], mask=mask_a, other=0.0).to(tl.float32)
        dyb = tl.load(dy_row + cb[None, :], mask=mask_b, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + b * N + n, mask=rmask, other=0.0)[:, None]
        cos_a, sin_a = _load_angles(COS, SIN, n, rmask, pa, scn, sck, ssn, ssk, D, HALF_DH)
        cos_b, sin_b = _load_angles(COS, SIN, n, rmask, pb, scn, sck, ssn, ssk, D, HALF_DH)
        dna = _rotate(dya, cos_a, -sin_a, ROWS, BLOCK_A)  # Rᵀ dy: the gradient at RMSNorm's output
        dnb = _rotate(dyb, cos_b, -sin_b, ROWS, BLOCK_B)
        xa = xa * rstd  # x̂
        xb = xb * rstd
        ga = dna * wa
        gb = dnb * wb
        c1 = ((tl.sum(ga * xa, axis=1) + tl.sum(gb * xb, axis=1)) / D)[:, None]
        dx_row = DX + (b * N + n[:, None]) * D
        tl.store(dx_row + ca[None, :], _rne_bf16((ga - xa * c1) * rstd, EMULATE_RNE).to(DX.dtype.element_ty),
                 mask=mask_a)
        tl.store(dx_row + cb[None, :], _rne_bf16((gb - xb * c1) * rstd, EMULATE_RNE).to(DX.dtype.element_ty),
                 mask=mask_b)
        acc_a += dna * xa  # rows past N loaded zeros: they add nothing
        acc_b += dnb * xb
    part = DW_PART + (b * n_progs + pid) * D
    tl.store(part + ca, tl.sum(acc_a, axis=0), mask=ma)
    tl.store(part + cb, tl.sum(acc_b, axis=0), mask=mb)


def _require_triton() -> None:
    require_triton("qk_norm_rope", HAS_TRITON)


@functools.lru_cache(maxsize=None)
def _kernels(interpret: bool):
    global triton, tl
    triton, tl = import_triton("qk_norm_rope", interpret, HAS_TRITON)
    global _rne_bf16, _load_angles, _rotate  # the kernels call these module-level names, resolved at compile time
    _rne_bf16, _load_angles, _rotate = (device_fn(triton, f, interpret)
                                        for f in (_rne_bf16_impl, _load_angles_impl, _rotate_impl))
    return triton.jit(_fwd_kernel), triton.jit(_bwd_kernel)


# ---------------------------------------------------------------------------------------------------------- launchers
# Launch shapes on CUDA, keyed by (kernel, D). The D = 1536 forward is the H200 sweep's best at N = 32760 (the sweep:
# results/step_h200.md). The rest are not measured yet: ops.adaln's H200 best at the same D
# (the same row in registers, one reduction per row), both kernels in two segments (D = 1536: 512 + 256 pairs, no
# masked lane, 16-byte loads) and the D = 5120 backward 8 warps (ptxas: 255 registers at 4, no spills at 8).
# `python scripts/bench/qk_norm_rope.py --sweep` on the H200 measures them.
TUNED = {
    ("fwd", 1536): KernelConfig(1, 4, 8, split=False, num_stages=3),
    ("fwd", 5120): KernelConfig(2, 4, 8, num_stages=3),
    ("bwd", 1536): KernelConfig(1, 4, 4, split=True, num_stages=3),
    ("bwd", 5120): KernelConfig(1, 8, 2, split=True, num_stages=3),
}


def default_config(kind: str, D: int, device: torch.device) -> KernelConfig:
    """Launch shape for a kernel ("fwd", "bwd") at width D."""
    if device.type != "cuda":
        return interpreter_config()
    D0, cfg = nearest_tuned(TUNED, (kind,), D)
    if D0 == D:
        return cfg
    rows = max(1, min(64, cfg.rows * next_pow2(D0) // next_pow2(D)))
    return KernelConfig(rows, cfg.num_warps, cfg.programs_per_sm, num_stages=cfg.num_stages)


def _check(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"qk_norm_rope: x must be [B, N, D], got shape {tuple(x.shape)}")
    B, N, D = x.shape
    if weight.shape != (D,):
        raise ValueError(f"qk_norm_rope: weight must be [D] = [{D}], got {tuple(weight.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 2 or t.shape[0] != N or t.shape[1] == 0 or D % (2 * t.shape[1]):
            raise ValueError(f"qk_norm_rope: {name} must be [N, head_dim/2] = [{N}, K] with D = {D} a multiple of "
                             f"2K (as RoPE3D returns it), got {tuple(t.shape)}")
        if t.dtype != torch.float32 or t.device != x.device:
            raise ValueError(f"qk_norm_rope: {name} must be fp32 on {x.device} (RoPE3D's output), got {t.dtype} "
                             f"on {t.device}")
    if cos.shape != sin.shape:
        raise ValueError(f"qk_norm_rope: cos and sin differ in shape: {tuple(cos.shape)} vs {tuple(sin.shape)}")
    if x.dtype not in DTYPES or weight.dtype not in DTYPES or weight.device != x.device:
        raise ValueError(f"qk_norm_rope: the Triton backend takes fp32/fp16/bf16 x and weight on one device, got "
                         f"{x.dtype}, {weight.dtype} on {x.device}, {weight.device}; use backend='torch'")
    if D > MAX_D:
        raise ValueError(f"qk_norm_rope: the Triton backend keeps a row in registers, D ≤ {MAX_D}, got {D}; "
                         "use backend='torch'")
    if x.device.type != "cuda" and not interpreting():
        raise RuntimeError("qk_norm_rope: backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before "
                           "first use")


def _launch_args(x: torch.Tensor, cfg: KernelConfig) -> dict:
    block_a, block_b = segments(x.shape[-1] // 2, cfg, 2 * x.element_size())  # in pairs: a pair is two elements
    return dict(BLOCK_A=block_a, BLOCK_B=block_b, ROWS=cfg.rows, NUM_STAGES=cfg.num_stages,
                EMULATE_RNE=interpreting() and x.dtype == torch.bfloat16, num_warps=cfg.num_warps)


def qk_norm_rope_forward(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         eps: float = 1e-6, config: KernelConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel: (y [B, N, D] contiguous in x.dtype, rstd [B, N] fp32)."""
    _check(x, weight, cos, sin)
    x, weight = rows_last(x), weight.contiguous()
    B, N, D = x.shape
    y = torch.empty((B, N, D), dtype=x.dtype, device=x.device)
    rstd = torch.empty((B, N), dtype=torch.float32, device=x.device)
    cfg = config or default_config("fwd", D, x.device)
    P, tiles_per_prog = span(cdiv(N, cfg.rows), B, cfg, x.device)
    if P * B == 0 or D == 0:
        return y, rstd
    fwd, _ = _kernels(interpreting())
    # enable_fp_fusion=False: no FMA, every product rounded as the eager path's separate kernels round it, so the
    # output differs from the model's only where rstd's last bit (another summation order) flips a rounding
    with on_device(x.device):
        fwd[(P, B)](x, weight, cos, sin, y, rstd, N, tiles_per_prog, eps,
                    x.stride(0), x.stride(1), cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
                    D=D, HALF_DH=cos.shape[1], enable_fp_fusion=False, **_launch_args(x, cfg))
    return y, rstd


def qk_norm_rope_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, rstd: torch.Tensor,
                          config: KernelConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel: (dx [B, N, D] in x.dtype, dw [D] in weight.dtype)."""
    x, dy, weight = rows_last(x), rows_last(dy), weight.contiguous()
    B, N, D = x.shape
    cfg = config or default_config("bwd", D, x.device)
    P, tiles_per_prog = span(cdiv(N, cfg.rows), B, cfg, x.device)
    dx = torch.empty((B, N, D), dtype=x.dtype, device=x.device)
    alloc = torch.empty if P * B > 0 else torch.zeros  # nothing to launch: the sums are zero
    dw_part = alloc((B, max(P, 1), D), dtype=torch.float32, device=x.device)
    if P * B > 0 and D > 0:
        _, bwd = _kernels(interpreting())
        with on_device(x.device):
            bwd[(P, B)](dy, x, weight, cos, sin, rstd, dx, dw_part, N, tiles_per_prog, P,
                        dy.stride(0), dy.stride(1), x.stride(0), x.stride(1),
                        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
                        D=D, HALF_DH=cos.shape[1], **_launch_args(x, cfg))
    return dx, dw_part.flatten(0, 1).sum(0).to(weight.dtype)  # the partials in a fixed order: deterministic


# ------------------------------------------------------------------------------------------- custom op and autograd
@torch.library.custom_op("adaptiveload::qk_norm_rope_fwd", mutates_args=())
def _qk_norm_rope_fwd_op(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return qk_norm_rope_forward(x, weight, cos, sin, eps)


@_qk_norm_rope_fwd_op.register_fake
def _qk_norm_rope_fwd_fake(x, weight, cos, sin, eps):
    _check(x, weight, cos, sin)  # at trace time, so that a compiled graph reports bad inputs as eager does
    B, N, D = x.shape
    return x.new_empty((B, N, D)), x.new_empty((B, N), dtype=torch.float32)


@torch.library.custom_op("adaptiveload::qk_norm_rope_bwd", mutates_args=())
def _qk_norm_rope_bwd_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return qk_norm_rope_backward(dy, x, weight, cos, sin, rstd)


@_qk_norm_rope_bwd_op.register_fake
def _qk_norm_rope_bwd_fake(dy, x, weight, cos, sin, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, weight, cos, sin, _eps = inputs
    ctx.save_for_backward(x, weight, cos, sin, output[1])  # the caller's tensors and the rstd: only rstd is new


def _backward(ctx, dy, _drstd):
    x, weight, cos, sin, rstd = ctx.saved_tensors
    dx, dw = torch.ops.adaptiveload.qk_norm_rope_bwd(dy, x, weight, cos, sin, rstd)
    return dx, dw, None, None, None


_qk_norm_rope_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class _QKNormRoPEFunction(torch.autograd.Function):
    """The eager path: the same launchers and saved tensors without the custom op's dispatcher round trips."""

    @staticmethod
    def forward(ctx, x, weight, cos, sin, eps):
        y, rstd = qk_norm_rope_forward(x, weight, cos, sin, eps)
        _setup_context(ctx, (x, weight, cos, sin, eps), (y, rstd))
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, cos, sin, rstd = ctx.saved_tensors
        dx, dw = qk_norm_rope_backward(dy, x, weight, cos, sin, rstd)
        return dx, dw, None, None, None


# ------------------------------------------------------------------------------------------------------ functional
def triton_supported(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether backend="auto" takes the Triton path for these inputs."""
    return (x.is_cuda and HAS_TRITON and x.dim() == 3 and x.dtype in DTYPES and weight.dtype in DTYPES
            and cos.dtype == sin.dtype == torch.float32 and cos.dim() == 2 and cos.shape == sin.shape
            and cos.shape[0] == x.shape[1] and 0 < x.shape[-1] <= MAX_D and cos.shape[1] > 0
            and x.shape[-1] % (2 * cos.shape[1]) == 0 and not (cos.requires_grad or sin.requires_grad))


def qk_norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float = 1e-6,
                 backend: str = "auto") -> torch.Tensor:
    """RoPE(RMSNorm(x) · w) of a q or k projection x [B, N, D] → [B, N, D] in x.dtype (view it as [B, N, H, Dh]).

    weight [D] (any float dtype, used in fp32), cos/sin [N, head_dim/2] fp32 from models.layers.RoPE3D."""
    if backend not in BACKENDS:
        raise ValueError(f"qk_norm_rope backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if triton_supported(x, weight, cos, sin) else "torch"
    if backend == "torch":
        return qk_norm_rope_reference(x, weight, cos, sin, eps)
    _require_triton()
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("qk_norm_rope: the Triton backend gives no gradient to cos/sin (RoPE3D's are constants); "
                         "detach them or use backend='torch'")
    if torch.compiler.is_compiling():  # graphs hold the custom op: its fake impl traces, Inductor leaves it whole
        return torch.ops.adaptiveload.qk_norm_rope_fwd(x, weight, cos, sin, float(eps))[0]
    return _QKNormRoPEFunction.apply(x, weight, cos, sin, float(eps))

"""Fused AdaLN: LayerNorm (no affine, fp32 statistics) then modulation, forward and backward in Triton.

    x̂ = (x − μ) · rstd,   μ = mean_D(x),   rstd = 1 / sqrt(var_D(x) + eps)      (fp32, two passes over registers)
    y = x̂ · (1 + scale) + shift                                   computed in fp32, returned in x.dtype

This is the same function as diffusers' Wan block `(norm1(x.float()) * (1 + scale) + shift).type_as(x)`.
`x` is [B, N, D]; `scale`/`shift` are [B, 1, D] (per sample), [B, N, D] (per token) or [1, 1, D] (broadcast), any
strides (diffusers hands over `chunk` views of a [B, 6, D] table): the kernels read them by stride, never copy them.

Backward, with g = dy · (1 + scale):
    dx     = rstd · (g − mean_D(g) − x̂ · mean_D(g · x̂))         one pass over x and dy, x̂ recomputed
    dscale = Σ_rows dy · x̂,   dshift = Σ_rows dy                 per sample: fp32 partial sums in the same pass
    dscale = dy · x̂,          dshift = dy                         per token: written in that pass

Saved for backward: x, scale (a view of the modulation table) and the fp32 mean/rstd ([B, N]) — 2 bytes per element
of bf16 x plus 8 bytes per row, against 8 bytes per element for the eager reference.

Per-sample dscale/dshift: each program owns a contiguous span of rows of one sample and keeps [ROWS, D] fp32
accumulators in registers; it writes one partial row, and the partials ([B, P, D]) are summed in a fixed order, so
gradients are bit-for-bit deterministic (no float atomics). The paper's D-tile coalesced reduction (programs own a
tile of features and walk down the sequence, re-reading x and dy: ≈ 10 bytes per element instead of 6) is kept as
`adaln_backward(..., dmod="dtile")` for the benchmark to compare.

backend: "torch" (the reference), "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "auto" (Triton on CUDA tensors
of a supported dtype and D, the reference otherwise). The Triton path runs through the custom op
`torch.ops.adaptiveload.adaln_fwd/adaln_bwd` (fake implementations registered) inside torch.compile graphs, and
through an autograd.Function over the same launchers in eager mode (less host time per call); either recomputes
under activation checkpointing and needs nothing special under FSDP2.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from ops.triton_setup import (BACKENDS, DTYPES, HAS_TRITON, MAX_D, KernelConfig, cdiv, import_triton,
                              interpreter_config, interpreting, mod_layout, nearest_tuned, next_pow2, on_device,
                              require_triton, rows_last, segments, span, store_cast)

# Imported on first use by _kernels() (ops/triton_setup.py: the tests choose the interpreter before that).
triton = None
tl = None
_cast = None  # the store cast of the kernels, jitted by _kernels(): round-to-nearest-even bf16 under the interpreter

DMOD_SCHEMES = ("fused", "dtile")


def adaln_reference(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x_hat = F.layer_norm(x.float(), (x.shape[-1],), eps=eps)
    return (x_hat * (1 + scale.float()) + shift.float()).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------- kernels
# Plain functions, jitted by _kernels() on first use (the annotations stay strings until then). Every load is
# upcast to fp32 at once (the interpreter has no bf16 arithmetic, and the math is fp32 by contract). Row offsets
# are int64: B·N·D passes 2^31 at video sizes.
#
# A row is held as two segments, columns [0, BLOCK_A) and [BLOCK_A, BLOCK_A + BLOCK_B) (ops/triton_setup.py
# segments: D = 1536 = 1024 + 512 and 5120 = 4096 + 1024 need no masked lanes at all). The unsplit layout
# (BLOCK_A = next power of two, masked; BLOCK_B = 1, empty) is kept for the benchmark.

def _fwd_kernel(X, SCALE, SHIFT, Y, MEAN, RSTD,
                N, tiles_per_prog, eps,
                sxb, sxn, ssb, ssn, ssd, shb, shn, shd,
                D: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, ROWS: tl.constexpr,
                SCALE_PER_TOKEN: tl.constexpr, SHIFT_PER_TOKEN: tl.constexpr, NUM_STAGES: tl.constexpr):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, ROWS)
    ca = tl.arange(0, BLOCK_A)
    cb = BLOCK_A + tl.arange(0, BLOCK_B)
    ma = ca < D
    mb = cb < D
    if not SCALE_PER_TOKEN:  # one vector per sample: loaded once, broadcast over the program's rows
        sa = 1.0 + tl.load(SCALE + b * ssb + ca * ssd, mask=ma, other=0.0).to(tl.float32)[None, :]
        sb = 1.0 + tl.load(SCALE + b * ssb + cb * ssd, mask=mb, other=0.0).to(tl.float32)[None, :]
    if not SHIFT_PER_TOKEN:
        ha = tl.load(SHIFT + b * shb + ca * shd, mask=ma, other=0.0).to(tl.float32)[None, :]
        hb = tl.load(SHIFT + b * shb + cb * shd, mask=mb, other=0.0).to(tl.float32)[None, :]
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
        mean = (tl.sum(xa, axis=1) + tl.sum(xb, axis=1)) / D
        xa = tl.where(ma[None, :], xa - mean[:, None], 0.0)
        xb = tl.where(mb[None, :], xb - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt((tl.sum(xa * xa, axis=1) + tl.sum(xb * xb, axis=1)) / D + eps)
        if SCALE_PER_TOKEN:
            s_row = SCALE + b * ssb + n[:, None] * ssn
            sa = 1.0 + tl.load(s_row + ca[None, :] * ssd, mask=mask_a, other=0.0).to(tl.float32)
            sb = 1.0 + tl.load(s_row + cb[None, :] * ssd, mask=mask_b, other=0.0).to(tl.float32)
        if SHIFT_PER_TOKEN:
            h_row = SHIFT + b * shb + n[:, None] * shn
            ha = tl.load(h_row + ca[None, :] * shd, mask=mask_a, other=0.0).to(tl.float32)
            hb = tl.load(h_row + cb[None, :] * shd, mask=mask_b, other=0.0).to(tl.float32)
        y_row = Y + (b * N + n[:, None]) * D
        tl.store(y_row + ca[None, :], _cast(xa * rstd[:, None] * sa + ha, Y.dtype.element_ty), mask=mask_a)
        tl.store(y_row + cb[None, :], _cast(xb * rstd[:, None] * sb + hb, Y.dtype.element_ty), mask=mask_b)
        tl.store(MEAN + b * N + n, mean, mask=rmask)
        tl.store(RSTD + b * N + n, rstd, mask=rmask)


def _bwd_kernel(DY, X, SCALE, MEAN, RSTD, DX, DSCALE, DSHIFT, DRES,
                N, tiles_per_prog, n_progs,
                sdyb, sdyn, sxb, sxn, ssb, ssn, ssd, dsb, dhb,
                D: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, ROWS: tl.constexpr,
                SCALE_PER_TOKEN: tl.constexpr, SHIFT_PER_TOKEN: tl.constexpr, ACC_DMOD: tl.constexpr,
                HAS_RES: tl.constexpr, NUM_STAGES: tl.constexpr):
    # DSCALE/DSHIFT: per token, [B or 1, N, D] written row by row (batch stride dsb/dhb); per sample, the [B, P, D]
    # fp32 partial buffer, one row per program (unless ACC_DMOD is off: the D-tile kernel computes them instead).
    # Masked lanes load dy = 0, so they add nothing to the row sums or the partials. HAS_RES: dx += DRES (a residual's
    # gradient, laid out as DX), summed before the one rounding.
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, ROWS)
    ca = tl.arange(0, BLOCK_A)
    cb = BLOCK_A + tl.arange(0, BLOCK_B)
    ma = ca < D
    mb = cb < D
    if not SCALE_PER_TOKEN:
        sa = 1.0 + tl.load(SCALE + b * ssb + ca * ssd, mask=ma, other=0.0).to(tl.float32)[None, :]
        sb = 1.0 + tl.load(SCALE + b * ssb + cb * ssd, mask=mb, other=0.0).to(tl.float32)[None, :]
    acc_sa = tl.zeros([ROWS, BLOCK_A], dtype=tl.float32)  # Σ dy·x̂ and Σ dy, reduced over rows once at the end
    acc_sb = tl.zeros([ROWS, BLOCK_B], dtype=tl.float32)
    acc_ha = tl.zeros([ROWS, BLOCK_A], dtype=tl.float32)
    acc_hb = tl.zeros([ROWS, BLOCK_B], dtype=tl.float32)
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
        mean = tl.load(MEAN + b * N + n, mask=rmask, other=0.0)[:, None]
        rstd = tl.load(RSTD + b * N + n, mask=rmask, other=0.0)[:, None]
        xa = (xa - mean) * rstd  # x̂
        xb = (xb - mean) * rstd
        if SCALE_PER_TOKEN:
            s_row = SCALE + b * ssb + n[:, None] * ssn
            sa = 1.0 + tl.load(s_row + ca[None, :] * ssd, mask=mask_a, other=0.0).to(tl.float32)
            sb = 1.0 + tl.load(s_row + cb[None, :] * ssd, mask=mask_b, other=0.0).to(tl.float32)
        ga = dya * sa
        gb = dyb * sb
        c1 = ((tl.sum(ga * xa, axis=1) + tl.sum(gb * xb, axis=1)) / D)[:, None]
        c2 = ((tl.sum(ga, axis=1) + tl.sum(gb, axis=1)) / D)[:, None]
        dxa = (ga - (xa * c1 + c2)) * rstd
        dxb = (gb - (xb * c1 + c2)) * rstd
        if HAS_RES:
            r_row = DRES + (b * N + n[:, None]) * D
            dxa += tl.load(r_row + ca[None, :], mask=mask_a, other=0.0).to(tl.float32)
            dxb += tl.load(r_row + cb[None, :], mask=mask_b, other=0.0).to(tl.float32)
        dx_row = DX + (b * N + n[:, None]) * D
        tl.store(dx_row + ca[None, :], _cast(dxa, DX.dtype.element_ty), mask=mask_a)
        tl.store(dx_row + cb[None, :], _cast(dxb, DX.dtype.element_ty), mask=mask_b)
        if SCALE_PER_TOKEN:
            ds_row = DSCALE + b * dsb + n[:, None] * D
            tl.store(ds_row + ca[None, :], _cast(dya * xa, DSCALE.dtype.element_ty), mask=mask_a)
            tl.store(ds_row + cb[None, :], _cast(dyb * xb, DSCALE.dtype.element_ty), mask=mask_b)
        elif ACC_DMOD:
            acc_sa += dya * xa
            acc_sb += dyb * xb
        if SHIFT_PER_TOKEN:
            dh_row = DSHIFT + b * dhb + n[:, None] * D
            tl.store(dh_row + ca[None, :], _cast(dya, DSHIFT.dtype.element_ty), mask=mask_a)
            tl.store(dh_row + cb[None, :], _cast(dyb, DSHIFT.dtype.element_ty), mask=mask_b)
        elif ACC_DMOD:
            acc_ha += dya
            acc_hb += dyb
    if ACC_DMOD:
        part = (b * n_progs + pid) * D
        if not SCALE_PER_TOKEN:
            tl.store(DSCALE + part + ca, tl.sum(acc_sa, axis=0), mask=ma)
            tl.store(DSCALE + part + cb, tl.sum(acc_sb, axis=0), mask=mb)
        if not SHIFT_PER_TOKEN:
            tl.store(DSHIFT + part + ca, tl.sum(acc_ha, axis=0), mask=ma)
            tl.store(DSHIFT + part + cb, tl.sum(acc_hb, axis=0), mask=mb)


def _dmod_dtile_kernel(DY, X, MEAN, RSTD, PART_S, PART_H,
                       N, tiles_per_prog, n_splits, n_dtiles,
                       sdyb, sdyn, sxb, sxn,
                       D: tl.constexpr, ROWS: tl.constexpr, BLOCK_DT: tl.constexpr):
    # The paper's scheme: a program owns BLOCK_DT features of one sample and walks down its span of rows, loads
    # coalesced along D; it re-reads x and dy (the dx kernel already read them once).
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pid_d = pid % n_dtiles  # feature tiles fastest: neighbouring programs read the same rows
    pid_n = pid // n_dtiles
    cols = pid_d * BLOCK_DT + tl.arange(0, BLOCK_DT)
    cmask = cols < D
    rows = tl.arange(0, ROWS)
    acc_s = tl.zeros([ROWS, BLOCK_DT], dtype=tl.float32)
    acc_h = tl.zeros([ROWS, BLOCK_DT], dtype=tl.float32)
    t0 = pid_n * tiles_per_prog
    t1 = tl.minimum(t0 + tiles_per_prog, tl.cdiv(N, ROWS))
    for t in range(t0, t1):
        n = (t * ROWS + rows).to(tl.int64)
        rmask = n < N
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(X + b * sxb + n[:, None] * sxn + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + b * sdyb + n[:, None] * sdyn + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + b * N + n, mask=rmask, other=0.0)
        rstd = tl.load(RSTD + b * N + n, mask=rmask, other=0.0)
        acc_s += dy * ((x - mean[:, None]) * rstd[:, None])
        acc_h += dy
    part = (b * n_splits + pid_n) * D + cols
    tl.store(PART_S + part, tl.sum(acc_s, axis=0), mask=cmask)
    tl.store(PART_H + part, tl.sum(acc_h, axis=0), mask=cmask)


def _require_triton() -> None:
    require_triton("adaln", HAS_TRITON)


@functools.lru_cache(maxsize=None)
def _kernels(interpret: bool):
    global triton, tl, _cast
    triton, tl = import_triton("adaln", interpret, HAS_TRITON)
    _cast = store_cast(interpret)  # resolved by the kernels at compile time
    return triton.jit(_fwd_kernel), triton.jit(_bwd_kernel), triton.jit(_dmod_dtile_kernel)


# ---------------------------------------------------------------------------------------------------------- launchers
# Launch shapes measured best on the H200 (results/adaln_h200.md), keyed by (kernel, per-token modulation, D);
# another D takes the nearest entry with rows scaled to keep the tile's size.
TUNED = {
    ("fwd", False, 1536): KernelConfig(2, 4, 4, num_stages=3),
    ("fwd", False, 5120): KernelConfig(2, 4, 8, num_stages=3),
    ("fwd", True, 1536): KernelConfig(1, 4, 0),
    ("fwd", True, 5120): KernelConfig(1, 4, 0),
    ("bwd", False, 1536): KernelConfig(1, 4, 4, split=False, num_stages=3),
    ("bwd", False, 5120): KernelConfig(1, 4, 2, split=True, num_stages=3),
    ("bwd", True, 1536): KernelConfig(1, 8, 4, split=False, num_stages=2),
    ("bwd", True, 5120): KernelConfig(1, 8, 2, split=True, num_stages=2),
    ("dtile", False, 1536): KernelConfig(64, 4, 4, block_d=64),
    ("dtile", False, 5120): KernelConfig(32, 4, 8, block_d=256),
}


def default_config(kind: str, D: int, device: torch.device, per_token: bool = False) -> KernelConfig:
    """Launch shape for a kernel ("fwd", "bwd", "dtile") at width D."""
    if device.type != "cuda":
        return interpreter_config(block_d=64 if kind == "dtile" else 0)
    D0, cfg = nearest_tuned(TUNED, (kind, per_token and kind != "dtile"), D)
    if kind == "dtile" or D0 == D:
        return cfg
    rows = max(1, min(64, cfg.rows * next_pow2(D0) // next_pow2(D)))
    return dataclasses.replace(cfg, rows=rows, split=None)



def _check(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"adaln: x must be [B, N, D], got shape {tuple(x.shape)}")
    B, N, D = x.shape
    for name, t in (("scale", scale), ("shift", shift)):
        if t.dim() != 3 or t.shape[2] != D or t.shape[0] not in (1, B) or t.shape[1] not in (1, N):
            raise ValueError(f"adaln: {name} must be [B, 1, D], [B, N, D] or [1, 1, D] with x [B, N, D] = "
                             f"{tuple(x.shape)}, got {tuple(t.shape)}")
        if t.dtype not in DTYPES or t.device != x.device:
            raise ValueError(f"adaln: {name} must be fp32/fp16/bf16 on {x.device}, got {t.dtype} on {t.device}")
    if x.dtype not in DTYPES:
        raise ValueError(f"adaln: the Triton backend takes fp32/fp16/bf16 x, got {x.dtype}; use backend='torch'")
    if D > MAX_D:
        raise ValueError(f"adaln: the Triton backend keeps a row in registers, D ≤ {MAX_D}, got {D}; "
                         "use backend='torch'")
    if x.device.type != "cuda" and not interpreting():
        raise RuntimeError("adaln: backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before first use")


def adaln_forward(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6,
                  config: KernelConfig | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward kernel: (y [B, N, D] in x.dtype, mean [B, N] fp32, rstd [B, N] fp32)."""
    _check(x, scale, shift)
    x = rows_last(x)
    B, N, D = x.shape
    y = torch.empty((B, N, D), dtype=x.dtype, device=x.device)
    mean = torch.empty((B, N), dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    s_tok, ssb, ssn, ssd = mod_layout(scale, B, N)
    h_tok, shb, shn, shd = mod_layout(shift, B, N)
    cfg = config or default_config("fwd", D, x.device, s_tok or h_tok)
    P, tiles_per_prog = span(cdiv(N, cfg.rows), B, cfg, x.device)
    if P * B == 0 or D == 0:
        return y, mean, rstd
    fwd, _, _ = _kernels(interpreting())
    with on_device(x.device):
        block_a, block_b = segments(D, cfg, x.element_size())
        fwd[(P, B)](x, scale, shift, y, mean, rstd, N, tiles_per_prog, eps,
                    x.stride(0), x.stride(1), ssb, ssn, ssd, shb, shn, shd,
                    D=D, BLOCK_A=block_a, BLOCK_B=block_b, ROWS=cfg.rows, SCALE_PER_TOKEN=s_tok,
                    SHIFT_PER_TOKEN=h_tok, NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps)
    return y, mean, rstd


def adaln_backward(dy: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                   shift_shape, shift_dtype: torch.dtype, dmod: str = "fused", config: KernelConfig | None = None,
                   dtile_config: KernelConfig | None = None, dres: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward: (dx, dscale, dshift), each in its input's dtype and shape (per-sample dscale and dshift
    may be views of one tensor: their partials are reduced together).

    dmod="fused": per-sample dscale/dshift as partial sums in the dx pass; "dtile": the paper's D-tile kernel.
    dres: a gradient of x's shape added to dx in the same pass (a residual around the norm), one rounding."""
    if dmod not in DMOD_SCHEMES:
        raise ValueError(f"adaln: dmod must be one of {DMOD_SCHEMES}, got {dmod!r}")
    x, dy = rows_last(x), rows_last(dy)
    B, N, D = x.shape
    if dres is not None:
        if tuple(dres.shape) != (B, N, D):
            raise ValueError(f"adaln: dres must have x's shape {(B, N, D)}, got {tuple(dres.shape)}")
        dres = dres.contiguous()
    dev = x.device
    s_tok, ssb, ssn, ssd = mod_layout(scale, B, N)
    h_tok = shift_shape[1] == N and N > 1
    cfg = config or default_config("bwd", D, dev, s_tok or h_tok)
    P, tiles_per_prog = span(cdiv(N, cfg.rows), B, cfg, dev)
    acc = dmod == "fused"

    def grad_buffer(per_token, shape, dtype):  # per token: final layout unless B must still be summed; else partials
        if per_token:
            full = shape[0] == B or B == 1
            return torch.empty((B, N, D), dtype=dtype if full else torch.float32, device=dev), full
        alloc = torch.empty if P * B > 0 else torch.zeros  # nothing to launch: the sums are zero
        return alloc((B, max(P, 1), D), dtype=torch.float32, device=dev), False

    dx = torch.empty((B, N, D), dtype=x.dtype, device=dev)
    joint = acc and not s_tok and not h_tok  # both per sample: one buffer, its partials summed in one launch
    if joint:
        both = (torch.empty if P * B > 0 else torch.zeros)((2, B, max(P, 1), D), dtype=torch.float32, device=dev)
        ds_buf, dh_buf = both.unbind(0)
        ds_final = dh_final = False
    else:
        ds_buf, ds_final = grad_buffer(s_tok, scale.shape, scale.dtype)
        dh_buf, dh_final = grad_buffer(h_tok, shift_shape, shift_dtype)
    if P * B > 0 and D > 0:
        _, bwd, dtile = _kernels(interpreting())
        with on_device(dev):
            block_a, block_b = segments(D, cfg, x.element_size())
            bwd[(P, B)](dy, x, scale, mean, rstd, dx, ds_buf, dh_buf, dres if dres is not None else dx,
                        N, tiles_per_prog, P,
                        dy.stride(0), dy.stride(1), x.stride(0), x.stride(1), ssb, ssn, ssd,
                        N * D if s_tok else 0, N * D if h_tok else 0,
                        D=D, BLOCK_A=block_a, BLOCK_B=block_b, ROWS=cfg.rows, SCALE_PER_TOKEN=s_tok,
                        SHIFT_PER_TOKEN=h_tok, ACC_DMOD=acc, HAS_RES=dres is not None, NUM_STAGES=cfg.num_stages,
                        num_warps=cfg.num_warps)
            if not acc and not (s_tok and h_tok):
                dcfg = dtile_config or default_config("dtile", D, dev)
                block_dt = dcfg.block_d or next_pow2(D)
                n_dtiles = cdiv(D, block_dt)
                S, tiles_per_split = span(cdiv(N, dcfg.rows), B * n_dtiles, dcfg, dev)
                part_s = torch.empty((B, S, D), dtype=torch.float32, device=dev)
                part_h = torch.empty_like(part_s)
                dtile[(S * n_dtiles, B)](dy, x, mean, rstd, part_s, part_h, N, tiles_per_split, S, n_dtiles,
                                         dy.stride(0), dy.stride(1), x.stride(0), x.stride(1),
                                         D=D, ROWS=dcfg.rows, BLOCK_DT=block_dt, num_warps=dcfg.num_warps)
                ds_buf = ds_buf if s_tok else part_s
                dh_buf = dh_buf if h_tok else part_h

    def finish(buf, per_token, final, shape, dtype):
        if per_token:
            return buf if final else buf.sum(0, keepdim=True).to(dtype)
        g = buf.sum(1, keepdim=True)  # [B, 1, D]: the partials in a fixed order, deterministic
        return (g if shape[0] == B else g.sum(0, keepdim=True)).to(dtype)

    if joint:  # [2, B, 1, D]: the partials in a fixed order, deterministic
        ds, dh = both.sum(2, keepdim=True).unbind(0)
        ds = ds if scale.shape[0] == B else ds.sum(0, keepdim=True)
        dh = dh if shift_shape[0] == B else dh.sum(0, keepdim=True)
        return dx, ds.to(scale.dtype), dh.to(shift_dtype)
    return (dx, finish(ds_buf, s_tok, ds_final, scale.shape, scale.dtype),
            finish(dh_buf, h_tok, dh_final, shift_shape, shift_dtype))


# ------------------------------------------------------------------------------------------- custom op and autograd
@torch.library.custom_op("adaptiveload::adaln_fwd", mutates_args=())
def _adaln_fwd_op(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return adaln_forward(x, scale, shift, eps)


@_adaln_fwd_op.register_fake
def _adaln_fwd_fake(x, scale, shift, eps):
    _check(x, scale, shift)  # at trace time, so that a compiled graph reports bad inputs as eager does
    B, N, D = x.shape
    stats = x.new_empty((B, N), dtype=torch.float32)
    return x.new_empty((B, N, D)), stats, torch.empty_like(stats)


@torch.library.custom_op("adaptiveload::adaln_bwd", mutates_args=())
def _adaln_bwd_op(dy: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                  shift_shape: list[int], shift_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dscale, dshift = adaln_backward(dy, x, scale, mean, rstd, shift_shape, shift_dtype)
    if dscale.untyped_storage().data_ptr() == dshift.untyped_storage().data_ptr():
        dshift = dshift.clone()  # views of one sum (the joint partials): a custom op's outputs may not alias
    return dx, dscale, dshift


@_adaln_bwd_op.register_fake
def _adaln_bwd_fake(dy, x, scale, mean, rstd, shift_shape, shift_dtype):
    return (x.new_empty(x.shape), scale.new_empty(scale.shape), scale.new_empty(shift_shape, dtype=shift_dtype))


def _adaln_setup_context(ctx, inputs, output):
    x, scale, shift, _eps = inputs
    _y, mean, rstd = output
    ctx.save_for_backward(x, scale, mean, rstd)  # x and scale are the caller's tensors: only the stats are new
    ctx.shift_shape, ctx.shift_dtype = list(shift.shape), shift.dtype


def _adaln_backward(ctx, dy, _dmean, _drstd):
    x, scale, mean, rstd = ctx.saved_tensors
    dx, dscale, dshift = torch.ops.adaptiveload.adaln_bwd(dy, x, scale, mean, rstd, ctx.shift_shape, ctx.shift_dtype)
    return dx, dscale, dshift, None


_adaln_fwd_op.register_autograd(_adaln_backward, setup_context=_adaln_setup_context)


class _AdaLNFunction(torch.autograd.Function):
    """The eager path: the same launchers and saved tensors without the custom op's dispatcher round trips, which
    cost a few times more host time per call than the launches themselves (what small N is bound by)."""

    @staticmethod
    def forward(ctx, x, scale, shift, eps):
        y, mean, rstd = adaln_forward(x, scale, shift, eps)
        _adaln_setup_context(ctx, (x, scale, shift, eps), (y, mean, rstd))
        return y

    @staticmethod
    def backward(ctx, dy):
        x, scale, mean, rstd = ctx.saved_tensors
        dx, dscale, dshift = adaln_backward(dy, x, scale, mean, rstd, ctx.shift_shape, ctx.shift_dtype)
        return dx, dscale, dshift, None


# ------------------------------------------------------------------------------------------------------ functional
def triton_supported(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> bool:
    """Whether backend="auto" takes the Triton path for these inputs."""
    return (x.is_cuda and HAS_TRITON and x.dim() == 3 and x.dtype in DTYPES
            and scale.dtype in DTYPES and shift.dtype in DTYPES and 0 < x.shape[-1] <= MAX_D)


def adaln_modulate(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6,
                   backend: str = "auto") -> torch.Tensor:
    if backend not in BACKENDS:
        raise ValueError(f"adaln backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if triton_supported(x, scale, shift) else "torch"
    if backend == "torch":
        return adaln_reference(x, scale, shift, eps)
    _require_triton()
    if torch.compiler.is_compiling():  # graphs hold the custom op: its fake impl traces, Inductor leaves it whole
        return torch.ops.adaptiveload.adaln_fwd(x, scale, shift, float(eps))[0]
    return _AdaLNFunction.apply(x, scale, shift, float(eps))

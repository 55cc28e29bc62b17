"""Fused AdaLN: LayerNorm (no affine, fp32 statistics) then modulation.

    y = LN(x) * (1 + scale) + shift        computed in fp32, returned in x.dtype

This is the same function as diffusers' Wan block `(norm1(x.float()) * (1 + scale) + shift).type_as(x)`.
`x` is [B, N, D]; `scale`/`shift` are [B, 1, D] (per sample), [B, N, D] (per token) or [1, 1, D], any strides.
backend: "torch" (this reference), "triton" (fused kernels, issue 3), "auto" (Triton on CUDA, else the reference).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "triton", "torch")


def adaln_reference(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x_hat = F.layer_norm(x.float(), (x.shape[-1],), eps=eps)
    return (x_hat * (1 + scale.float()) + shift.float()).to(x.dtype)


def adaln_modulate(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6,
                   backend: str = "auto") -> torch.Tensor:
    if backend not in BACKENDS:
        raise ValueError(f"adaln backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton":
        raise NotImplementedError("the Triton AdaLN kernels land with issue 3; use backend='torch' or 'auto'")
    return adaln_reference(x, scale, shift, eps)

"""Primitives every model shares: norms, timestep embedding, MLPs, 3-D RoPE, attention, gated residual.

Module and attribute names follow diffusers (`linear_1`, `net.0.proj`, ...) so that the models built from them
keep diffusers' state-dict keys. Formulas:

    FP32LayerNorm(x)  = LN(x.float()) * w + b, cast back to x.dtype           (statistics in fp32)
    RMSNorm(x)        = x / sqrt(mean(x²) + eps) * w, computed in fp32, cast back to x.dtype
    timestep_embedding(t)_j = cos(t·ω_j) for j < d/2, sin(t·ω_{j-d/2}) after,  ω_j = 10000^(-j/(d/2))
    MLP(x)            = linear_2(act(linear_1(x)))                              (time / text embedders)
    FeedForward(x)    = net.2(GELU_tanh(net.0.proj(x)))
    RoPE on a pair    (x_{2i}, x_{2i+1}) → rotation by angle pos·θ^(-2i/d) within each (t, h, w) band
    attention(q,k,v)  = softmax(q kᵀ / sqrt(d_head)) v                          (SDPA, per head)
    gated_residual    = (x.float() + y · gate).type_as(x)                        (fp32 sum, as diffusers' Wan)
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class FP32LayerNorm(nn.LayerNorm):
    """LayerNorm whose statistics and affine are computed in fp32 (bf16 statistics drift over long sequences)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.float() if self.weight is not None else None
        b = self.bias.float() if self.bias is not None else None
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim with a learned scale; fp32 math so that bf16 inputs meet an fp32 weight cleanly."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding [*t.shape, dim] in fp32, cos half first (diffusers' flip_sin_to_cos=True, shift 0)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angle = t[..., None].float() * freqs
    emb = torch.cat([torch.cos(angle), torch.sin(angle)], dim=-1)
    return F.pad(emb, (0, 1)) if dim % 2 else emb


class MLP(nn.Module):
    """Two linears with an activation between; diffusers' TimestepEmbedding / PixArtAlphaTextProjection layout."""

    def __init__(self, in_features: int, hidden_features: int, out_features: int | None = None,
                 act: str = "silu"):
        super().__init__()
        if act not in ("silu", "gelu_tanh"):
            raise ValueError(f"MLP act must be 'silu' or 'gelu_tanh', got {act!r}")
        self.linear_1 = nn.Linear(in_features, hidden_features)
        self.act = nn.SiLU() if act == "silu" else nn.GELU(approximate="tanh")
        self.linear_2 = nn.Linear(hidden_features, out_features or hidden_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class GELUProj(nn.Module):
    """Linear then GELU(tanh): its own module so the key reads `net.0.proj` as in diffusers."""

    def __init__(self, dim_in: int, dim_out: int):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    """Transformer MLP D → ffn_dim → D with GELU(tanh); keys `net.0.proj.*` and `net.2.*` as in diffusers."""

    def __init__(self, dim: int, inner_dim: int, dim_out: int | None = None):
        super().__init__()
        # net.1 is diffusers' Dropout(0); an Identity keeps the output projection at index 2.
        self.net = nn.ModuleList([GELUProj(dim, inner_dim), nn.Identity(), nn.Linear(inner_dim, dim_out or dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.net:
            x = layer(x)
        return x


def rope_angles(dim: int, num_pos: int, theta: float, device: torch.device) -> torch.Tensor:
    """Angles [num_pos, dim/2] = pos · theta^(-2i/dim), computed in fp64 (positions up to ~10³ times small freqs)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))
    pos = torch.arange(num_pos, dtype=torch.float64, device=device)
    return pos[:, None] * inv_freq[None, :]


class RoPE3D(nn.Module):
    """3-D rotary position embedding: head_dim is split into (t, h, w) bands, each rotated by its own coordinate.

    forward(f, h, w, device) returns (cos, sin), each [f·h·w, head_dim/2] fp32, tokens ordered (f, h, w)
    row-major like a flattened [F', H', W'] grid. Nothing is stored, so the module has no state-dict keys and
    is safe to build on the meta device.
    """

    def __init__(self, band_dims: tuple[int, int, int], max_seq_len: int = 1024, theta: float = 10000.0):
        super().__init__()
        if any(d <= 0 or d % 2 for d in band_dims):
            raise ValueError(f"RoPE band dims must be positive and even, got {band_dims}")
        self.band_dims = tuple(band_dims)
        self.max_seq_len = max_seq_len
        self.theta = theta

    def forward(self, f: int, h: int, w: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if max(f, h, w) > self.max_seq_len:
            raise ValueError(f"latent grid (f={f}, h={h}, w={w}) exceeds rope_max_seq_len={self.max_seq_len}; "
                             "raise rope_max_seq_len or use a smaller bucket")
        a_t, a_h, a_w = (rope_angles(d, n, self.theta, device) for d, n in zip(self.band_dims, (f, h, w)))
        angle_FHWK = torch.cat([a_t[:, None, None, :].expand(f, h, w, -1),
                                a_h[None, :, None, :].expand(f, h, w, -1),
                                a_w[None, None, :, :].expand(f, h, w, -1)], dim=-1)
        angle_NK = angle_FHWK.reshape(f * h * w, -1)
        return angle_NK.cos().float(), angle_NK.sin().float()


def apply_rope(x_BNHD: torch.Tensor, cos_NK: torch.Tensor, sin_NK: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x_{2i}, x_{2i+1}) of every head by the token's angle i (K = D/2 pairs)."""
    x1, x2 = x_BNHD.unflatten(-1, (-1, 2)).unbind(-1)  # (B, N, H, K) each
    cos, sin = cos_NK[None, :, None, :], sin_NK[None, :, None, :]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.flatten(-2).type_as(x_BNHD)


def attention(q_BNHD: torch.Tensor, k_BLHD: torch.Tensor, v_BLHD: torch.Tensor) -> torch.Tensor:
    """Non-causal multi-head attention through SDPA (flash / memory-efficient kernels on GPU) → (B, N, H·D)."""
    o_BHND = F.scaled_dot_product_attention(q_BNHD.transpose(1, 2), k_BLHD.transpose(1, 2), v_BLHD.transpose(1, 2))
    return o_BHND.transpose(1, 2).flatten(2).type_as(q_BNHD)


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x + y·gate summed in fp32 (gate is fp32), cast back to the residual stream's dtype."""
    return (x.float() + y.float() * gate).type_as(x)

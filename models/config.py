"""Typed configuration of the model (the `model:` group). Field names follow diffusers' WanTransformer3DModel."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

ADALN_BACKENDS = ("auto", "triton", "torch")
CHECKPOINTING = ("none", "full", "auto")


@dataclass
class ModelConfig:
    name: str = "wan"
    patch_size: tuple = (1, 2, 2)
    num_attention_heads: int = 12
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 8960
    num_layers: int = 30
    cross_attn_norm: bool = True
    qk_norm: Optional[str] = "rms_norm_across_heads"
    eps: float = 1e-6
    rope_max_seq_len: int = 1024
    text_len: int = 512                   # text tokens after zero-padding (diffusers' Wan pipeline: 512)
    precision: str = "bf16"               # matmuls under autocast on GPU; fp32 on CPU; master weights stay fp32
    adaln_backend: str = "auto"
    checkpointing: str = "none"
    compile: bool = False
    pretrained: Optional[str] = None      # a local diffusers-format folder (config.json + safetensors)

    def __post_init__(self):
        if self.name != "wan":
            raise ValueError(f"model.name must be 'wan' (the MMDiT backbone is not built yet), got {self.name!r}")
        if self.adaln_backend not in ADALN_BACKENDS:
            raise ValueError(f"model.adaln_backend must be one of {ADALN_BACKENDS}, got {self.adaln_backend!r}")
        if self.checkpointing not in CHECKPOINTING:
            raise ValueError(f"model.checkpointing must be one of {CHECKPOINTING}, got {self.checkpointing!r}")
        if self.precision not in ("bf16", "fp32"):
            raise ValueError(f"model.precision must be 'bf16' or 'fp32', got {self.precision!r}")
        self.patch_size = tuple(int(p) for p in self.patch_size)
        if len(self.patch_size) != 3:
            raise ValueError(f"model.patch_size must be (t, h, w), got {self.patch_size}")
        for name in ("num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "text_dim",
                     "freq_dim", "ffn_dim", "num_layers", "text_len"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"model.{name} must be ≥ 1, got {getattr(self, name)}")
        if self.freq_dim % 2:
            raise ValueError(f"model.freq_dim must be even (sin/cos halves), got {self.freq_dim}")

    @property
    def dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    def diffusers_kwargs(self) -> dict:
        """The fields diffusers' WanTransformer3DModel takes, as our WanTransformer's constructor does."""
        return dict(patch_size=self.patch_size, num_attention_heads=self.num_attention_heads,
                    attention_head_dim=self.attention_head_dim, in_channels=self.in_channels,
                    out_channels=self.out_channels, text_dim=self.text_dim, freq_dim=self.freq_dim,
                    ffn_dim=self.ffn_dim, num_layers=self.num_layers, cross_attn_norm=self.cross_attn_norm,
                    qk_norm=self.qk_norm, eps=self.eps, rope_max_seq_len=self.rope_max_seq_len)

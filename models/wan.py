"""Wan 2.1 video diffusion transformer, state-dict compatible with diffusers' `WanTransformer3DModel`.

Shapes: latents x [B, C, F, H, W] → patches (p_t, p_h, p_w) → tokens N = F/p_t · H/p_h · W/p_w of width
D = heads · head_dim; text ctx [B, L, text_dim] → [B, L, D]; timestep t [B] (or [B, N] per token, Wan 2.2).

    temb   = MLP_silu(sinusoid(t))                           [B, T, D]    T = 1 (per sample) or N (per token)
    m      = time_proj(silu(temb)) → 6 rows of D, + table    shift/scale/gate for attention and FFN (fp32)
    block:   x += gate_msa · SelfAttn(AdaLN(x; scale_msa, shift_msa), RoPE_3d)
             x += CrossAttn(LN_affine(x), ctx)
             x += gate_ff  · FFN(AdaLN(x; scale_ff, shift_ff))
    head:    out = proj_out(AdaLN(x; scale, shift)),  (shift, scale) = table_out + temb;  unpatchify
    AdaLN(x; scale, shift) = LN(x) · (1 + scale) + shift     (ops.adaln, fp32 math, no affine)
    RoPE_3d: head_dim splits into bands t | h | w with h = w = 2·⌊head_dim/6⌋, t the rest (44|42|42 at 128)

Precision follows diffusers: modulation tables, the time embedder and the norms compute in fp32
(`_keep_in_fp32_modules`); gated residuals sum in fp32 and cast back to the residual stream's dtype.
Differences from diffusers: `forward` returns the tensor (no return_dict); the time embedder runs with autocast
off (diffusers' pipelines never autocast, so this is the precision they get); q/k RMSNorm runs in fp32 and returns
the input dtype (diffusers' torch.nn.RMSNorm falls back to an unfused path on bf16 input with fp32 weight); RoPE
angles are computed per call for the grid in use instead of a [rope_max_seq_len] buffer, which leaves nothing to
materialise after meta-device construction; image conditioning (I2V) and qk_norm other than
"rms_norm_across_heads" are refused rather than silently approximated; latent sizes not divisible by the patch
raise instead of being cropped.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.checkpointing import CheckpointingMixin
from models.layers import (MLP, BackendKnobs, DiffusersFormat, FeedForward, FP32LayerNorm, RMSNorm, RoPE3D, apply_rope,
                           attention, gated_residual, timestep_embedding)
from ops.adaln import adaln_modulate


class WanAttention(nn.Module):
    """Multi-head attention with RMSNorm on q and k across all heads (Wan's qk norm), optional 3-D RoPE."""

    attention_backend = "auto"  # SDPA's kernel: model.attention_backend (layers.apply_attention_backend)

    def __init__(self, dim: int, heads: int, eps: float):
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])  # diffusers' key is `to_out.0`
        self.norm_q = RMSNorm(dim, eps)
        self.norm_k = RMSNorm(dim, eps)

    def forward(self, x_BND: torch.Tensor, ctx_BLD: torch.Tensor | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Self-attention over x (rope: its (cos, sin)), or cross-attention of x to ctx."""
        kv_BLD = x_BND if ctx_BLD is None else ctx_BLD
        # v first: a LoRA-wrapped projection draws its dropout in this order, on every execution path
        v = self.to_v(kv_BLD).unflatten(-1, (self.heads, -1))
        q = self.norm_q(self.to_q(x_BND)).unflatten(-1, (self.heads, -1))  # (B, N, H, Dh)
        k = self.norm_k(self.to_k(kv_BLD)).unflatten(-1, (self.heads, -1))  # (B, L, H, Dh)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return self.to_out[0](attention(q, k, v, self.attention_backend))


class WanBlock(nn.Module):
    """One Wan transformer block: AdaLN self-attention, cross-attention to text, AdaLN feed-forward."""

    def __init__(self, dim: int, ffn_dim: int, heads: int, cross_attn_norm: bool, eps: float):
        super().__init__()
        self.eps = eps
        self.adaln_backend = "auto"  # set through WanTransformer.adaln_backend
        self.attn1 = WanAttention(dim, heads, eps)
        self.attn2 = WanAttention(dim, heads, eps)
        self.norm2 = FP32LayerNorm(dim, eps, elementwise_affine=True) if cross_attn_norm else nn.Identity()
        self.ffn = FeedForward(dim, ffn_dim)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def modulation(self, tmod_BT6D: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(shift_msa, scale_msa, gate_msa, shift_ff, scale_ff, gate_ff): each a strided (B, T, D) fp32 view; T = 1
        broadcasts one row over all tokens."""
        return (self.scale_shift_table[None] + tmod_BT6D.float()).unbind(2)

    def forward(self, x_BND: torch.Tensor, ctx_BLD: torch.Tensor, tmod_BT6D: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, shift_ff, scale_ff, gate_ff = self.modulation(tmod_BT6D)

        # 1. self-attention
        norm_x = adaln_modulate(x_BND, scale_msa, shift_msa, self.eps, backend=self.adaln_backend)
        x_BND = gated_residual(x_BND, self.attn1(norm_x, rope=rope), gate_msa)

        # 2. cross-attention
        x_BND = x_BND + self.attn2(self.norm2(x_BND), ctx_BLD)

        # 3. feed-forward
        norm_x = adaln_modulate(x_BND, scale_ff, shift_ff, self.eps, backend=self.adaln_backend)
        return gated_residual(x_BND, self.ffn(norm_x), gate_ff)


class WanConditionEmbedder(nn.Module):
    """Timestep → (temb [B, T, D], block modulation [B, T, 6, D]); text [B, L, text_dim] → [B, L, D]."""

    def __init__(self, dim: int, freq_dim: int, text_dim: int):
        super().__init__()
        self.freq_dim = freq_dim
        self.time_embedder = MLP(freq_dim, dim, act="silu")
        self.time_proj = nn.Linear(dim, 6 * dim)
        self.text_embedder = MLP(text_dim, dim, act="gelu_tanh")

    def forward(self, t_BT: torch.Tensor, text_BLC: torch.Tensor):
        dtype = self.time_embedder.linear_1.weight.dtype
        # fp32 time embedding even under autocast: 1000·t sinusoids lose their low bits in a bf16 matmul.
        with torch.autocast(device_type=t_BT.device.type, enabled=False):
            temb_BTD = self.time_embedder(timestep_embedding(t_BT, self.freq_dim).to(dtype))
        # As diffusers: temb takes the text's dtype (what a bf16-cast model's time_proj expects).
        temb_BTD = temb_BTD.type_as(text_BLC)
        tmod_BT6D = self.time_proj(F.silu(temb_BTD)).unflatten(-1, (6, -1))
        return temb_BTD, tmod_BT6D, self.text_embedder(text_BLC)


class WanTransformer(DiffusersFormat, BackendKnobs, CheckpointingMixin, nn.Module):
    """Wan 2.1 text-to-video transformer; defaults are Wan2.1-T2V-14B. See the module docstring for the math.

    Executed as written here (the reference); from outside: fused ops (models/fused_wan.py apply_fused_ops, or
    `model.fused_ops`), the AdaLN backend (`model.adaln_backend`), activation checkpointing per micro-batch
    (models/checkpointing.py), compile and FSDP2 (models/parallelize.py) — none of them changes a state-dict key."""

    _keep_in_fp32_modules = ["rope", "time_embedder", "scale_shift_table", "norm1", "norm2", "norm3"]
    _diffusers_class_name = "WanTransformer3DModel"  # from_pretrained / save_pretrained: models.layers.DiffusersFormat

    def __init__(self, patch_size: tuple[int, int, int] = (1, 2, 2), num_attention_heads: int = 40,
                 attention_head_dim: int = 128, in_channels: int = 16, out_channels: int | None = 16,
                 text_dim: int = 4096, freq_dim: int = 256, ffn_dim: int = 13824, num_layers: int = 40,
                 cross_attn_norm: bool = True, qk_norm: str | None = "rms_norm_across_heads", eps: float = 1e-6,
                 image_dim: int | None = None, added_kv_proj_dim: int | None = None, rope_max_seq_len: int = 1024,
                 pos_embed_seq_len: int | None = None, *, adaln_backend: str = "auto"):
        super().__init__()
        if image_dim is not None or added_kv_proj_dim is not None:
            raise NotImplementedError("image conditioning (Wan I2V: image_dim / added_kv_proj_dim) is not "
                                      "implemented; use a T2V config with image_dim=None, added_kv_proj_dim=None")
        if qk_norm != "rms_norm_across_heads":
            raise ValueError(f"qk_norm={qk_norm!r} is not supported: Wan (and diffusers, which ignores the field) "
                             "always applies RMSNorm to q and k across heads; set qk_norm='rms_norm_across_heads'")
        if attention_head_dim < 12:
            raise ValueError(f"attention_head_dim={attention_head_dim} is too small for the (t, h, w) RoPE bands; "
                             "use at least 12")
        patch_size = tuple(int(p) for p in patch_size)
        out_channels = out_channels or in_channels
        self.config = dict(patch_size=patch_size, num_attention_heads=num_attention_heads,
                           attention_head_dim=attention_head_dim, in_channels=in_channels,
                           out_channels=out_channels, text_dim=text_dim, freq_dim=freq_dim, ffn_dim=ffn_dim,
                           num_layers=num_layers, cross_attn_norm=cross_attn_norm, qk_norm=qk_norm, eps=eps,
                           image_dim=image_dim, added_kv_proj_dim=added_kv_proj_dim,
                           rope_max_seq_len=rope_max_seq_len, pos_embed_seq_len=pos_embed_seq_len)
        self.patch_size = patch_size
        self.out_channels = out_channels
        self.eps = eps
        dim = num_attention_heads * attention_head_dim
        self.dim = dim

        hw_band = 2 * (attention_head_dim // 6)  # Wan's split: h and w bands equal, t takes the rest
        self.rope = RoPE3D((attention_head_dim - 2 * hw_band, hw_band, hw_band), rope_max_seq_len)
        self.patch_embedding = nn.Conv3d(in_channels, dim, kernel_size=patch_size, stride=patch_size)
        self.condition_embedder = WanConditionEmbedder(dim, freq_dim, text_dim)
        self.blocks = nn.ModuleList([WanBlock(dim, ffn_dim, num_attention_heads, cross_attn_norm, eps)
                                     for _ in range(num_layers)])
        self.proj_out = nn.Linear(dim, out_channels * math.prod(patch_size))
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)
        self.adaln_backend = adaln_backend

    # ----------------------------------------------------------------------------------------------- forward
    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor,
                encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        """x [B, C, F, H, W], timestep [B] or [B, N] (1000·t), text [B, L, text_dim] → [B, C_out, F, H, W]."""
        B, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.patch_size
        if frames % p_t or height % p_h or width % p_w:
            raise ValueError(f"latent size (F={frames}, H={height}, W={width}) must be divisible by "
                             f"patch_size {self.patch_size}")
        f, h, w = frames // p_t, height // p_h, width // p_w  # token grid
        N = f * h * w
        if timestep.ndim == 1:
            t_BT = timestep[:, None]
        elif timestep.ndim == 2 and timestep.shape[1] == N:
            t_BT = timestep
        else:
            raise ValueError(f"timestep must be [B] or [B, N={N}] (one per token), got {tuple(timestep.shape)}")

        # 1. rotary position embedding, patch embedding, time and text conditioning
        rope = self.rope(f, h, w, hidden_states.device)
        x_BND = self.patch_embedding(hidden_states).flatten(2).transpose(1, 2).contiguous()
        temb_BTD, tmod_BT6D, ctx_BLD = self.condition_embedder(t_BT, encoder_hidden_states)

        # 2. transformer blocks, each plainly or recomputed in backward (models/checkpointing.py)
        store = self.offload_store(x_BND.device)  # where recomputed blocks keep their inputs (None: on the device)
        for i, block in enumerate(self.blocks):
            x_BND = self.run_block(i, block, x_BND, ctx_BLD, tmod_BT6D, rope, store=store)

        # 3. output norm, projection and unpatchify
        shift, scale = (self.scale_shift_table[None] + temb_BTD[:, :, None]).unbind(2)  # (B, T, D) each
        x_BND = adaln_modulate(x_BND, scale, shift, self.eps, backend=self.adaln_backend)
        x_BNP = self.proj_out(x_BND)  # P = p_t·p_h·p_w·C_out, channel fastest
        x = x_BNP.reshape(B, f, h, w, p_t, p_h, p_w, self.out_channels)
        return x.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(B, self.out_channels, frames, height, width)

    # ------------------------------------------------------------------------------------------------ counts
    def num_matmul_params(self) -> int:
        """Weights of the matmuls that run once per latent token (for MFU = 6·P·S + attention terms).

        Counted: patch_embedding, proj_out and, per block, attn1 q/k/v/out, attn2 q/out, ffn in/out (weights
        only; biases, norms and modulation tables are not matmuls). Not counted: attn2 to_k/to_v and the text
        embedder (they run on the L text tokens), the time embedder and time_proj (once per sample).
        """
        per_token = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_out.0",
                     "ffn.net.0.proj", "ffn.net.2")
        n = self.patch_embedding.weight.numel() + self.proj_out.weight.numel()
        for block in self.blocks:
            n += sum(block.get_submodule(name).weight.numel() for name in per_token)
        return n

    def train_flops(self, S: int, L: int) -> float:
        """Forward + backward FLOPs of one sample with S video and L text tokens (no recompute counted):
        6·P·S + 12·D·layers·(S² + S·L), P = num_matmul_params (self-attention S², cross-attention S·L)."""
        return 6.0 * self.num_matmul_params() * S + 12.0 * self.dim * len(self.blocks) * (S * S + S * L)

"""Primitives every model shares: norms, timestep embedding, MLPs, 3-D RoPE, attention, gated residual, and the
mixins for diffusers-format files (DiffusersFormat) and the ops' backends (BackendKnobs).

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

from ops.attention_backend import check_backend, sdpa
from ops.attention_backend import describe as describe_attention  # noqa: F401 - for the trainer's log
from ops.attention_backend import preferred as attention_kernel  # noqa: F401 - for a calibration's record
from models.checkpointing import joint_attention
from models.config import warn_deprecated
from ops.triton_setup import BACKENDS


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


def attention(q_BNHD: torch.Tensor, k_BLHD: torch.Tensor, v_BLHD: torch.Tensor,
              backend: str = "auto") -> torch.Tensor:
    """Non-causal multi-head attention through SDPA under `backend` (ops/attention_backend.py) → (B, N, H·D)."""
    o_BHND = sdpa(q_BNHD.transpose(1, 2), k_BLHD.transpose(1, 2), v_BLHD.transpose(1, 2), backend=backend)
    return o_BHND.transpose(1, 2).flatten(2).type_as(q_BNHD)


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x + y·gate summed in fp32, cast back to the residual stream's dtype (ops/gated_residual.py fuses it into one
    pass: models/fused_wan.py)."""
    return (x.float() + y.float() * gate.float()).type_as(x)


# ------------------------------------------------------------------------------------------------ added for MMDiT
class SiLUProj(nn.Module):
    """Linear then SiLU: diffusers' LinearActivation(activation="silu"), key `proj` (FeedForward "linear-silu")."""

    def __init__(self, dim_in: int, dim_out: int):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.proj(x))


class SiLUFeedForward(FeedForward):
    """FeedForward with SiLU in place of GELU(tanh) (HunyuanVideo's token refiner); keys `net.0.proj`, `net.2`."""

    def __init__(self, dim: int, inner_dim: int, dim_out: int | None = None):
        nn.Module.__init__(self)
        self.net = nn.ModuleList([SiLUProj(dim, inner_dim), nn.Identity(), nn.Linear(inner_dim, dim_out or dim)])


MMDIT_CUDNN = True  # the MMDiT's attention may run cuDNN (ops/attention_backend.py GradLikeOutput: why it once failed)


def cudnn_allowed(model_name: str) -> bool:
    """Whether a model's attention may run cuDNN: the trainer's log and a calibration's record say what it runs."""
    return model_name != "mmdit" or MMDIT_CUDNN


class KeyLengths(tuple):
    """A key-padding mask given as lengths: sample i's queries see its first n_i keys and none after. Attention runs
    one maskless call per run of equal lengths, so cuDNN or flash serves it where a boolean mask would take the
    memory-efficient kernel (2–4× slower at the MMDiT's lengths). Exact: a masked key adds nothing to a softmax."""


def masked_attention(q_BNHD: torch.Tensor, k_BLHD: torch.Tensor, v_BLHD: torch.Tensor,
                     mask: torch.Tensor | KeyLengths | None = None, backend: str = "auto") -> torch.Tensor:
    """attention() with an optional boolean mask broadcastable to (B, heads, N, L) (True = may attend) or KeyLengths:
    the MMDiT's. cuDNN serves it where MMDIT_CUDNN and no boolean mask is given (ops/attention_backend.py)."""
    q, k, v = q_BNHD.transpose(1, 2), k_BLHD.transpose(1, 2), v_BLHD.transpose(1, 2)
    if not isinstance(mask, KeyLengths):
        return sdpa(q, k, v, mask, backend, cudnn=MMDIT_CUDNN).transpose(1, 2).flatten(2).type_as(q_BNHD)
    L, outs, i = k.shape[2], [], 0
    with joint_attention():  # keep_attention keeps these as the same attention under a mask
        while i < len(mask):  # consecutive samples of one length share a call
            j = i + 1
            while j < len(mask) and mask[j] == mask[i]:
                j += 1
            n = min(int(mask[i]), L)
            outs.append(sdpa(q[i:j], k[i:j, :, :n], v[i:j, :, :n], None, backend, cudnn=MMDIT_CUDNN).transpose(1, 2))
            i = j
    o_BNHD = outs[0] if len(outs) == 1 else torch.cat(outs)  # one copy: the pieces' [B, N, H, Dh] views joined
    return o_BNHD.flatten(2).type_as(q_BNHD)


def apply_attention_backend(model: nn.Module, backend: str = "auto") -> nn.Module:
    """Every attention module of `model` (a class with an `attention_backend` attribute) runs the SDPA kernel
    `backend` (ops/attention_backend.py: auto | cudnn | flash | efficient | math), in place, as diffusers'
    `set_attention_backend`. No parameter or state-dict key changes. Returns the model."""
    check_backend(backend)
    for m in model.modules():
        if hasattr(type(m), "attention_backend"):
            m.attention_backend = backend
    model.attention_backend = backend
    return model


DIFFUSERS_WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
DIFFUSERS_WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
DIFFUSERS_CONFIG_NAME = "config.json"


class DiffusersFormat:
    """Mixin: read and write diffusers-format folders (config.json + safetensors, sharded with an index).

    The model sets `_diffusers_class_name` (written as `_class_name`) and `_keep_in_fp32_modules` (name parts whose
    parameters stay fp32 when loading at a lower torch_dtype), keeps `self.config` (its constructor's diffusers
    fields) and takes `adaln_backend` as a keyword. One implementation for every model here.
    """

    _diffusers_class_name: str = ""
    _keep_in_fp32_modules: list[str] = []

    def _cast_params(self, dtype: torch.dtype) -> None:
        """Cast floating parameters to dtype, except those under `_keep_in_fp32_modules`, which become fp32."""
        for name, p in self.named_parameters():
            keep = any(part in self._keep_in_fp32_modules for part in name.split("."))
            target = torch.float32 if keep else dtype
            if p.is_floating_point() and p.dtype != target:
                p.data = p.data.to(target)

    @classmethod
    def _config_fields(cls) -> list[str]:
        import inspect

        params = inspect.signature(cls.__init__).parameters.values()
        return [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD and p.name != "self"]

    @classmethod
    def from_pretrained(cls, local_dir: str, torch_dtype: torch.dtype | None = None, adaln_backend: str = "auto",
                        subfolder: str | None = None):
        """Load a diffusers-format folder (config.json + single or sharded safetensors), strictly.

        torch_dtype=None gives fp32 everywhere; otherwise parameters are cast to it except the
        `_keep_in_fp32_modules`, which stay fp32. Unknown config keys are reported and ignored.
        """
        import json
        import os
        import warnings

        from safetensors.torch import load_file

        folder = os.path.join(local_dir, subfolder) if subfolder else local_dir
        with open(os.path.join(folder, DIFFUSERS_CONFIG_NAME)) as fh:
            raw = json.load(fh)
        known = set(cls._config_fields())
        unknown = sorted(k for k in raw if not k.startswith("_") and k not in known)
        if unknown:
            warnings.warn(f"{folder}/{DIFFUSERS_CONFIG_NAME}: ignoring unknown config keys {unknown}")
        config = {k: v for k, v in raw.items() if k in known}

        if os.path.exists(os.path.join(folder, DIFFUSERS_WEIGHTS_NAME)):
            files = [DIFFUSERS_WEIGHTS_NAME]
        elif os.path.exists(os.path.join(folder, DIFFUSERS_WEIGHTS_INDEX_NAME)):
            with open(os.path.join(folder, DIFFUSERS_WEIGHTS_INDEX_NAME)) as fh:
                files = sorted(set(json.load(fh)["weight_map"].values()))
        else:
            raise FileNotFoundError(f"{folder} holds neither {DIFFUSERS_WEIGHTS_NAME} nor "
                                    f"{DIFFUSERS_WEIGHTS_INDEX_NAME}")
        state = {}
        for name in files:
            state.update(load_file(os.path.join(folder, name)))

        # Meta construction skips a random init that the checkpoint would overwrite (minutes at 10B+).
        with torch.device("meta"):
            model = cls(**config, adaln_backend=adaln_backend)
        model.load_state_dict(state, strict=True, assign=True)
        del state  # the parameters now own the loaded tensors; casting frees each one as it goes
        model._cast_params(torch_dtype or torch.float32)
        return model

    def save_pretrained(self, save_dir: str, max_shard_size: int | str | None = None) -> None:
        """Write config.json + safetensors (sharded with an index when max_shard_size is set) as diffusers does."""
        import json
        import os

        from safetensors.torch import save_file

        os.makedirs(save_dir, exist_ok=True)
        config = {"_class_name": self._diffusers_class_name, "_diffusers_version": diffusers_version(),
                  **{k: list(v) if isinstance(v, tuple) else v for k, v in self.config.items()}}
        with open(os.path.join(save_dir, DIFFUSERS_CONFIG_NAME), "w") as fh:
            json.dump(config, fh, indent=2, sort_keys=True)

        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        limit = parse_size(max_shard_size) if max_shard_size is not None else None
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for key, tensor in state.items():
            nbytes = tensor.numel() * tensor.element_size()
            if limit is not None and shards[-1] and size + nbytes > limit:
                shards.append({})
                size = 0
            shards[-1][key] = tensor
            size += nbytes
        if len(shards) == 1:
            save_file(shards[0], os.path.join(save_dir, DIFFUSERS_WEIGHTS_NAME), metadata={"format": "pt"})
            return
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(save_dir, name), metadata={"format": "pt"})
            weight_map.update({key: name for key in shard})
        total = sum(t.numel() * t.element_size() for t in state.values())
        with open(os.path.join(save_dir, DIFFUSERS_WEIGHTS_INDEX_NAME), "w") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)


def diffusers_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("diffusers")
    except importlib.metadata.PackageNotFoundError:
        return "0.42.1"  # the version the models here were checked against


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like '10KB', '5GB', '2GiB' (decimal units as huggingface_hub)."""
    import re

    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", size, re.IGNORECASE)
    if not match:
        raise ValueError(f"max_shard_size must be an int or like '10GB', got {size!r}")
    units = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    return int(float(match.group(1)) * units[(match.group(2) or "B").lower()])


class BackendKnobs:
    """Mixin: which implementation a model's ops run, turned from outside — `adaln_backend` (ops/adaln.py in every
    AdaLN of every block and the head) and `fused_ops` (the fused blocks of models/fused_wan.py, applied by its
    apply_fused_ops; `glue_backend` is its deprecated name, kept for one release). Each is auto | triton | torch;
    "auto" takes Triton on CUDA and the reference elsewhere. The model provides `blocks`."""

    @property
    def adaln_backend(self) -> str:
        return self._adaln_backend

    @adaln_backend.setter
    def adaln_backend(self, backend: str) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"adaln_backend must be one of {BACKENDS}, got {backend!r}")
        self._adaln_backend = backend
        for block in self.blocks:
            block.adaln_backend = backend

    @property
    def fused_ops(self) -> str:
        """Backend of the fused execution around the matmuls (models/fused_wan.py): "torch" the reference path,
        "triton" the fused ops, "auto" Triton on CUDA (the config default). A bare model starts at "torch"; a model
        without fused blocks (the MMDiT) runs the reference whatever it says."""
        return getattr(self, "_fused_ops", "torch")

    @fused_ops.setter
    def fused_ops(self, backend: str) -> None:
        from models.fused_wan import apply_fused_ops

        apply_fused_ops(self, backend)

    @property
    def glue_backend(self) -> str:
        """Deprecated: the old name of `fused_ops` (one release)."""
        warn_deprecated("the model attribute glue_backend", "fused_ops")
        return self.fused_ops

    @glue_backend.setter
    def glue_backend(self, backend: str) -> None:
        warn_deprecated("the model attribute glue_backend", "fused_ops", stacklevel=4)  # through Module.__setattr__
        self.fused_ops = backend

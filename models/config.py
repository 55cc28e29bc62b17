"""Typed configuration of the model (the `model:` group). Field names follow diffusers' WanTransformer3DModel.

Fine-tuning knobs live here too: `pretrained` (a local diffusers folder), `freeze` (parameters left out of training,
by regex on their names) and `lora` (a peft LoRA adapter; models/lora.py applies it, and with it only the adapter
trains).

Numbers reach these dataclasses already checked finite and of their declared type (training/config.py); the range
of each is checked here.

Deprecated names, accepted for one release with a FutureWarning (once a process) and then removed:
`model.glue_backend` → `model.fused_ops` (a field here, because training/config.py refuses unknown keys: when set, it
is copied to fused_ops, which it overrides, and reset to null), the model attribute `glue_backend` → `fused_ops`
(models/layers.py) and `WanBlock.recompute_glue` → `FusedWanBlock.recompute_norms` (models/fused_wan.py; on
a block, set before or after the fused ops are applied — the class-level spelling `WanBlock.recompute_glue = …` is
gone).
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Optional, Union

ADALN_BACKENDS = ("auto", "triton", "torch")
FUSED_OPS = ADALN_BACKENDS
CHECKPOINTING = ("none", "full", "auto")
# Every Linear inside a Wan block (what musubi-tuner and DiffSynth adapt by default): peft target_modules suffixes.
LORA_BLOCK_LINEARS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]


@dataclass
class LoRAConfig:
    """`model.lora`: rank 0 disables it. W x + (alpha / rank)·B A x on every Linear whose name ends in a target.

    A starts Kaiming-uniform and B at zero (peft's default), so an adapted model starts equal to its base.
    """
    rank: int = field(default=0, metadata={"switch": True})  # 0 ↔ > 0 turns LoRA off / on (a resume refuses it)
    alpha: Optional[float] = None   # null: alpha = rank (scale 1)
    targets: list[str] = field(default_factory=lambda: list(LORA_BLOCK_LINEARS))  # module-name suffixes (peft)
    dropout: float = 0.0

    def __post_init__(self):
        if self.rank < 0:
            raise ValueError(f"model.lora.rank must be ≥ 0 (0 disables LoRA), got {self.rank}")
        if self.alpha is not None and not self.alpha > 0:
            raise ValueError(f"model.lora.alpha must be > 0 or null (= rank), got {self.alpha}")
        self.targets = [str(t) for t in self.targets]
        if self.rank and not self.targets:
            raise ValueError("model.lora.targets is empty: name the Linear modules to adapt, e.g. [to_q, to_k, "
                             "to_v, to_out.0]")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"model.lora.dropout must lie in [0, 1), got {self.dropout}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return (self.alpha or self.rank) / self.rank if self.rank else 0.0


EXECUTION = {"resume": "execution"}  # field metadata: how a model runs, free to change when a run resumes


@dataclass
class RunKnobs:
    """How a model runs and trains, whatever its architecture (the non-architecture half of `model:`)."""
    RESUME_DEFAULT = "trained"  # model.* (model.lora.* too) changes what is trained (training/resume.py)
    text_len: int = 512                   # text tokens after zero-padding (diffusers' Wan pipeline: 512); at most
                                          # data.encoders.max_text_len (training/config.py checks it)
    # How a micro-batch executes, not what is trained: these may change on resume (EXECUTION, training/resume.py)
    precision: str = field(default="bf16", metadata=EXECUTION)  # matmuls under autocast on GPU; fp32 on CPU;
                                                                 # master weights stay fp32
    adaln_backend: str = field(default="auto", metadata=EXECUTION)
    fused_ops: str = field(default="auto", metadata=EXECUTION)  # models/fused_wan.py's blocks: torch | triton |
                                                                # auto (Triton on CUDA)
    attention_backend: str = field(default="auto", metadata=EXECUTION)  # SDPA's kernel: auto (cuDNN on Hopper+,
                                          # else flash) | cudnn | flash | efficient | math (ops/attention_backend.py)
    glue_backend: Optional[str] = field(default=None, metadata=EXECUTION)  # deprecated alias of fused_ops (one
                                          # release): when set, it overrides it
    checkpointing: str = field(default="none", metadata=EXECUTION)
    offload_checkpoints: bool = field(default=False, metadata=EXECUTION)  # recomputed blocks' inputs wait in
                                          # pinned host memory (one process)
    keep_attention: Union[bool, str] = field(default=False, metadata=EXECUTION)  # recomputed blocks keep
                                          # self-attention's output: false | true (every recomputed block) | auto
                                          # (as many as the memory budget allows)
    compile: bool = field(default=False, metadata=EXECUTION)
    pretrained: Optional[str] = None      # a local diffusers-format folder (config.json + safetensors)
    freeze: list[str] = field(default_factory=list)  # regexes (re.search) of parameter names that do not train
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def _check_knobs(self) -> None:
        if self.adaln_backend not in ADALN_BACKENDS:
            raise ValueError(f"model.adaln_backend must be one of {ADALN_BACKENDS}, got {self.adaln_backend!r}")
        if self.glue_backend is not None:  # the deprecated name: checked under it, then moved to fused_ops
            warn_deprecated("model.glue_backend", "model.fused_ops")
            if self.glue_backend not in FUSED_OPS:
                raise ValueError(f"model.glue_backend (deprecated: model.fused_ops) must be one of {FUSED_OPS}, got "
                                 f"{self.glue_backend!r}")
            self.fused_ops, self.glue_backend = self.glue_backend, None
        if self.fused_ops not in FUSED_OPS:
            raise ValueError(f"model.fused_ops must be one of {FUSED_OPS}, got {self.fused_ops!r}")
        from ops.attention_backend import check_backend  # its names live beside the kernels' order

        check_backend(self.attention_backend)
        if self.checkpointing not in CHECKPOINTING:
            raise ValueError(f"model.checkpointing must be one of {CHECKPOINTING}, got {self.checkpointing!r}")
        if not (isinstance(self.keep_attention, bool) or self.keep_attention == "auto"):
            quoted = isinstance(self.keep_attention, str) and self.keep_attention.lower() in ("true", "false")
            raise ValueError(f"model.keep_attention must be true, false or auto, got {self.keep_attention!r}"
                             + (" (a string: write true or false without quotes)" if quoted else ""))
        if self.keep_attention is True and self.checkpointing == "none":
            raise ValueError("model.keep_attention=true keeps the attention outputs of recomputed blocks: set "
                             "model.checkpointing to full or auto (keep_attention=auto: as memory allows)")
        if self.offload_checkpoints and self.checkpointing == "none":
            raise ValueError("model.offload_checkpoints=true moves the inputs of recomputed blocks to host memory: "
                             "set model.checkpointing to full or auto")
        if self.precision not in ("bf16", "fp32"):
            raise ValueError(f"model.precision must be 'bf16' or 'fp32', got {self.precision!r}")
        if self.text_len < 1:
            raise ValueError(f"model.text_len must be ≥ 1, got {self.text_len}")
        if isinstance(self.lora, dict):  # built directly rather than through training/config.py
            self.lora = LoRAConfig(**self.lora)
        self.freeze = [str(p) for p in self.freeze]
        for pattern in self.freeze:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"model.freeze has an invalid regex {pattern!r}: {e}") from None


@dataclass
class ModelConfig(RunKnobs):
    """`model:` for Wan 2.1 (name=wan); architecture fields are diffusers' WanTransformer3DModel config names."""
    name: str = "wan"
    patch_size: tuple[int, int, int] = (1, 2, 2)
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

    def __post_init__(self):
        if self.name != "wan":
            raise ValueError(f"model.name must be one of {sorted(MODEL_CONFIGS)}, got {self.name!r}")
        self._check_knobs()
        self.patch_size = tuple(self.patch_size)
        if len(self.patch_size) != 3 or any(isinstance(p, bool) or not isinstance(p, int) or p < 1
                                            for p in self.patch_size):
            raise ValueError(f"model.patch_size must be three positive integers (t, h, w), got {self.patch_size!r}")
        for name in ("num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "text_dim",
                     "freq_dim", "ffn_dim", "num_layers", "rope_max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be ≥ 1, got {getattr(self, name)}")
        if self.freq_dim % 2:
            raise ValueError(f"model.freq_dim must be even (sin/cos halves), got {self.freq_dim}")
        # Wan's RoPE bands: h = w = 2·⌊d/6⌋ and t the rest, each even and > 0 (models/wan.py).
        if self.attention_head_dim < 12 or self.attention_head_dim % 2:
            raise ValueError(f"model.attention_head_dim must be even and ≥ 12 (Wan's t, h, w RoPE bands), got "
                             f"{self.attention_head_dim}")
        if not self.eps > 0:
            raise ValueError(f"model.eps must be > 0 (the norms' epsilon), got {self.eps}")

    @property
    def patch(self) -> tuple[int, int, int]:
        """(p_t, p_h, p_w): what data/buckets.py divides the latent grid by to count tokens S."""
        return self.patch_size

    @property
    def attention_layers(self) -> int:
        """Blocks whose self-attention spans the video tokens (MFU's attention term)."""
        return self.num_layers

    @property
    def dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def pooled_dim(self) -> None:
        """Wan takes no pooled text embedding."""
        return None

    def diffusers_kwargs(self) -> dict:
        """The fields diffusers' WanTransformer3DModel takes, as our WanTransformer's constructor does."""
        return dict(patch_size=self.patch_size, num_attention_heads=self.num_attention_heads,
                    attention_head_dim=self.attention_head_dim, in_channels=self.in_channels,
                    out_channels=self.out_channels, text_dim=self.text_dim, freq_dim=self.freq_dim,
                    ffn_dim=self.ffn_dim, num_layers=self.num_layers, cross_attn_norm=self.cross_attn_norm,
                    qk_norm=self.qk_norm, eps=self.eps, rope_max_seq_len=self.rope_max_seq_len)


@dataclass
class MMDiTConfig(RunKnobs):
    """`model:` for the HunyuanVideo-style MMDiT (name=mmdit); architecture fields are diffusers'
    HunyuanVideoTransformer3DModel config names (defaults: HunyuanVideo 13B)."""
    name: str = "mmdit"
    in_channels: int = 16
    out_channels: int = 16
    num_attention_heads: int = 24
    attention_head_dim: int = 128
    num_layers: int = 20                  # dual-stream blocks
    num_single_layers: int = 40
    num_refiner_layers: int = 2
    mlp_ratio: float = 4.0
    patch_size: int = 2                   # spatial (h and w)
    patch_size_t: int = 1
    qk_norm: str = "rms_norm"
    guidance_embeds: bool = True
    text_embed_dim: int = 4096
    pooled_projection_dim: int = 768
    rope_theta: float = 256.0
    rope_axes_dim: tuple[int, int, int] = (16, 56, 56)
    image_condition_type: Optional[str] = None
    guidance_scale: float = 1.0           # embedded guidance while training: the model receives 1000·guidance_scale
    text_len: int = 256                   # diffusers' HunyuanVideo pipeline: 256 LLaMA tokens after the template

    def __post_init__(self):
        if self.name != "mmdit":
            raise ValueError(f"model.name must be one of {sorted(MODEL_CONFIGS)}, got {self.name!r}")
        fused_key = "model.fused_ops" if self.glue_backend is None else "model.glue_backend"  # the name the user set
        self._check_knobs()
        if self.fused_ops == "triton" or self.offload_checkpoints:
            raise ValueError(f"{fused_key}=triton and model.offload_checkpoints are Wan's (models/fused_wan.py, "
                             "models/checkpointing.py); the MMDiT blocks run the reference path and keep checkpoints "
                             "on the device: leave them at auto / false")
        for name in ("num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "num_layers",
                     "text_embed_dim", "pooled_projection_dim", "patch_size", "patch_size_t"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be ≥ 1, got {getattr(self, name)}")
        for name in ("num_single_layers", "num_refiner_layers"):
            if getattr(self, name) < 0:
                raise ValueError(f"model.{name} must be ≥ 0, got {getattr(self, name)}")
        for name in ("mlp_ratio", "rope_theta"):
            if not getattr(self, name) > 0:
                raise ValueError(f"model.{name} must be > 0, got {getattr(self, name)}")
        if not self.guidance_scale >= 0:
            raise ValueError(f"model.guidance_scale must be ≥ 0, got {self.guidance_scale}")
        self.rope_axes_dim = tuple(self.rope_axes_dim)
        # Each band rotates pairs of channels, so each is even and > 0 (models/layers.py RoPE3D).
        if (len(self.rope_axes_dim) != 3 or sum(self.rope_axes_dim) != self.attention_head_dim
                or any(isinstance(d, bool) or not isinstance(d, int) or d < 2 or d % 2 for d in self.rope_axes_dim)):
            raise ValueError(f"model.rope_axes_dim={self.rope_axes_dim} must be three positive even (t, h, w) bands "
                             f"summing to model.attention_head_dim={self.attention_head_dim}")

    @property
    def patch(self) -> tuple[int, int, int]:
        """(p_t, p_h, p_w): what data/buckets.py divides the latent grid by to count tokens S."""
        return (self.patch_size_t, self.patch_size, self.patch_size)

    @property
    def dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def text_dim(self) -> int:
        """The text-encoder width, as the data side calls it."""
        return self.text_embed_dim

    @property
    def pooled_dim(self) -> int:
        """The pooled text embedding's width, as the data side calls it."""
        return self.pooled_projection_dim

    @property
    def ffn_dim(self) -> int:
        """The feed-forward width of every block (dim · mlp_ratio, as the blocks build it)."""
        return int(self.dim * self.mlp_ratio)

    @property
    def rope_max_seq_len(self) -> None:
        """The MMDiT's RoPE is computed for any grid: no per-axis position limit (Wan's rope_max_seq_len)."""
        return None

    @property
    def attention_layers(self) -> int:
        """Blocks whose joint attention spans text and video tokens."""
        return self.num_layers + self.num_single_layers

    def diffusers_kwargs(self) -> dict:
        keys = ("in_channels", "out_channels", "num_attention_heads", "attention_head_dim", "num_layers",
                "num_single_layers", "num_refiner_layers", "mlp_ratio", "patch_size", "patch_size_t", "qk_norm",
                "guidance_embeds", "text_embed_dim", "pooled_projection_dim", "rope_theta", "rope_axes_dim",
                "image_condition_type")
        return {k: getattr(self, k) for k in keys}


MODEL_CONFIGS = {"wan": ModelConfig, "mmdit": MMDiTConfig}


_WARNED: set = set()


def warn_deprecated(old: str, new: str, stacklevel: int = 3) -> None:
    """A FutureWarning, once a process, that `old` is a deprecated name of `new` (kept for one release)."""
    if old not in _WARNED:
        _WARNED.add(old)
        warnings.warn(f"{old} is deprecated and will be removed in the next release: use {new} (same values)",
                      FutureWarning, stacklevel=stacklevel)

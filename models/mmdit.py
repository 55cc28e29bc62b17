"""HunyuanVideo-style MMDiT, state-dict compatible with diffusers' `HunyuanVideoTransformer3DModel`.

Shapes: latents x [B, C, F, H, W] → patches (p_t, p, p) → N = F/p_t · H/p · W/p video tokens of width
D = heads · head_dim; text [B, L, text_embed_dim] with mask m [B, L]; pooled text [B, pooled_projection_dim];
timestep t [B] (1000·t); guidance g [B] (1000·scale, guidance-distilled models only).

    temb   = MLP(sinusoid(t)) [+ MLP(sinusoid(g))] + MLP(pooled)                  [B, D], fp32
    refiner (context_embedder): c = proj_in(text);  τ = MLP(sinusoid(t)) + MLP(masked_mean(text, m))
             c += gate_msa(τ) · SelfAttn(LN_affine(c), mask m_i ∧ m_j, key 0 always)
             c += gate_mlp(τ) · FF_silu(LN_affine(c))
    dual-stream block (per stream s ∈ {x, c}: own modulation, projections, q/k RMSNorm, MLP and gates):
             (shift, scale, gate)_{msa, mlp} = Linear_s(silu(temb))                 6 rows of D, fp32
             x, c += gate_msa · JointAttn(AdaLN(x), AdaLN(c))      one softmax over [x; c], RoPE on x only
             x, c += gate_mlp · FF_s(AdaLN(·; scale_mlp, shift_mlp))
    single-stream block on h = [x; c] (shared weights):
             (shift, scale, gate) = Linear(silu(temb));  n = AdaLN(h)
             h += gate · proj_out([Attn(n); GELU_tanh(proj_mlp(n))])
    head:    (scale, shift) = Linear(silu(temb));  out = proj_out(AdaLN(x)) → unpatchify (channel slowest)
    AdaLN(x; scale, shift) = LN(x) · (1 + scale) + shift        (ops.adaln, fp32 math, no affine, eps 1e-6)
    RoPE: head_dim = Σ rope_axes_dim bands (t | h | w), interleaved pairs, theta = rope_theta; text rows get the
          identity rotation, so one table serves the joint sequence.
    Attention masks: a text key is visible when m = 1; video keys always are.

Precision follows the repo's contract (contracts §5): the time/guidance/pooled-text embedders and every modulation
linear run in fp32 with autocast off and are listed in `_keep_in_fp32_modules`; gated residuals sum in fp32 and cast
back to the stream's dtype. Differences from diffusers: the modulated LayerNorms compute in fp32 and return x's
dtype (diffusers: in x's dtype) — equal in fp32, closer to fp32 in bf16; diffusers has no `_keep_in_fp32_modules`,
so `from_pretrained(torch_dtype=bf16)` keeps the modules above in fp32 where diffusers casts them; `forward` returns
the tensor (no return_dict, no attention_kwargs); text positions after the last one any sample attends are dropped
before the refiner (exact: masked keys add nothing and the video never reads them), and a mask that is then all
ones is dropped, so the flash or cuDNN kernel can run; where every row's valid text is a prefix (left-aligned, as
tokenizers pad) the joint attention takes it as key lengths and runs maskless, one call per run of equal lengths
(layers.KeyLengths; a CUDA graph's capture keeps the mask), else the mask itself, where diffusers assumes
left-aligned masks (it counts valid tokens) — equal for the masks tokenizers produce; an all-zero mask gives a
zero pooled text vector instead of diffusers' NaN; image_condition_type="token_replace" (I2V) and qk_norm other
than "rms_norm" are refused; latent sizes not divisible by the patch raise; new models start AdaLN-Zero
(modulation linears zero, every block the identity), where diffusers' random init does not.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.checkpointing import CheckpointingMixin
from models.layers import (MLP, BackendKnobs, DiffusersFormat, FeedForward, FP32LayerNorm, RMSNorm, RoPE3D,
                           KeyLengths, SiLUFeedForward, apply_rope, gated_residual, masked_attention,
                           timestep_embedding)
from ops.adaln import adaln_modulate

EPS = 1e-6           # every norm in HunyuanVideo
FREQ_DIM = 256       # sinusoid width of the time and guidance embedders (fixed in diffusers)
REFINER_MLP_RATIO = 4.0  # diffusers builds the token refiner with its default ratio, whatever mlp_ratio says


def _no_autocast(t: torch.Tensor):
    return torch.autocast(device_type=t.device.type, enabled=False)


class Modulation(nn.Module):
    """silu(temb) → linear → n chunks [B, 1, D] in fp32: diffusers' AdaLayerNormZero / -Single / -Continuous and
    HunyuanVideoAdaNorm keep this linear under `.linear` (the LayerNorm itself is ops.adaln, without parameters)."""

    def __init__(self, dim: int, n: int):
        super().__init__()
        self.n = n
        self.linear = nn.Linear(dim, n * dim)

    def forward(self, temb_BD: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with _no_autocast(temb_BD):
            m_BnD = self.linear(F.silu(temb_BD).to(self.linear.weight.dtype)).float()
        return m_BnD[:, None].chunk(self.n, dim=-1)  # strided (B, 1, D) views; ops.adaln reads them by stride


class TimeTextEmbedding(nn.Module):
    """temb = MLP(sinusoid(t)) [+ MLP(sinusoid(guidance))] + MLP(pooled), in fp32 with autocast off.

    diffusers' HunyuanVideoConditionEmbedding (guidance optional) and CombinedTimestepTextProjEmbeddings (the
    refiner's) share these keys: timestep_embedder, text_embedder, guidance_embedder.
    """

    def __init__(self, dim: int, pooled_dim: int, guidance_embeds: bool = False):
        super().__init__()
        self.timestep_embedder = MLP(FREQ_DIM, dim, act="silu")
        self.text_embedder = MLP(pooled_dim, dim, act="silu")
        self.guidance_embedder = MLP(FREQ_DIM, dim, act="silu") if guidance_embeds else None

    def forward(self, t_B: torch.Tensor, pooled_BC: torch.Tensor,
                guidance_B: torch.Tensor | None = None) -> torch.Tensor:
        dtype = self.timestep_embedder.linear_1.weight.dtype
        # fp32 even under autocast: 1000·t sinusoids lose their low bits in a bf16 matmul.
        with _no_autocast(t_B):
            temb_BD = self.timestep_embedder(timestep_embedding(t_B, FREQ_DIM).to(dtype))
            if self.guidance_embedder is not None:
                temb_BD = temb_BD + self.guidance_embedder(timestep_embedding(guidance_B, FREQ_DIM).to(dtype))
            return temb_BD + self.text_embedder(pooled_BC.to(self.text_embedder.linear_1.weight.dtype))


class Attention(nn.Module):
    """Multi-head attention in the three HunyuanVideo shapes (diffusers' `Attention` keys):

    refiner (qk_norm=False): to_q/k/v, to_out.0;  dual stream (context=True): + add_q/k/v_proj, to_add_out and
    per-head RMSNorm on every q and k;  single stream (out=False): to_q/k/v and q/k norms, no output projection.
    """

    attention_backend = "auto"  # SDPA's kernel: model.attention_backend (layers.apply_attention_backend)

    def __init__(self, dim: int, heads: int, qk_norm: bool = True, context: bool = False, out: bool = True):
        super().__init__()
        self.heads = heads
        head_dim = dim // heads
        self.norm_q = RMSNorm(head_dim, EPS) if qk_norm else None
        self.norm_k = RMSNorm(head_dim, EPS) if qk_norm else None
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        if context:
            self.add_k_proj = nn.Linear(dim, dim)
            self.add_v_proj = nn.Linear(dim, dim)
            self.add_q_proj = nn.Linear(dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)]) if out else None  # diffusers' key is `to_out.0`
        if context:
            self.to_add_out = nn.Linear(dim, dim)
            self.norm_added_q = RMSNorm(head_dim, EPS)
            self.norm_added_k = RMSNorm(head_dim, EPS)

    def _project(self, x_BND: torch.Tensor, q: nn.Linear, k: nn.Linear, v: nn.Linear,
                 norm_q: nn.Module | None, norm_k: nn.Module | None):
        q_BNHD, k_BNHD, v_BNHD = (lin(x_BND).unflatten(-1, (self.heads, -1)) for lin in (q, k, v))
        if norm_q is not None:
            q_BNHD, k_BNHD = norm_q(q_BNHD), norm_k(k_BNHD)
        return q_BNHD, k_BNHD, v_BNHD

    def forward(self, x_BND: torch.Tensor, ctx_BLD: torch.Tensor | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None, mask: torch.Tensor | None = None):
        """Self-attention over x, or joint attention over [x; ctx] returning (out_x, out_ctx) when ctx is given."""
        q, k, v = self._project(x_BND, self.to_q, self.to_k, self.to_v, self.norm_q, self.norm_k)
        if ctx_BLD is not None:
            cq, ck, cv = self._project(ctx_BLD, self.add_q_proj, self.add_k_proj, self.add_v_proj,
                                       self.norm_added_q, self.norm_added_k)
            q, k, v = torch.cat([q, cq], 1), torch.cat([k, ck], 1), torch.cat([v, cv], 1)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        o_BSD = masked_attention(q, k, v, mask, self.attention_backend)
        if ctx_BLD is not None:
            N = x_BND.shape[1]
            return self.to_out[0](o_BSD[:, :N]), self.to_add_out(o_BSD[:, N:])
        return o_BSD if self.to_out is None else self.to_out[0](o_BSD)


class RefinerBlock(nn.Module):
    """diffusers' HunyuanVideoIndividualTokenRefinerBlock: affine-LN self-attention and SiLU MLP, gated by temb."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = FP32LayerNorm(dim, EPS, elementwise_affine=True)
        self.attn = Attention(dim, heads, qk_norm=False)
        self.norm2 = FP32LayerNorm(dim, EPS, elementwise_affine=True)
        self.ff = SiLUFeedForward(dim, int(dim * REFINER_MLP_RATIO))
        self.norm_out = Modulation(dim, 2)

    def forward(self, c_BLD: torch.Tensor, temb_BD: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        gate_msa, gate_mlp = self.norm_out(temb_BD)
        c_BLD = gated_residual(c_BLD, self.attn(self.norm1(c_BLD), mask=mask), gate_msa)
        return gated_residual(c_BLD, self.ff(self.norm2(c_BLD)), gate_mlp)


class TokenRefinerStack(nn.Module):
    """Holds `refiner_blocks` (diffusers' HunyuanVideoIndividualTokenRefiner)."""

    def __init__(self, dim: int, heads: int, num_layers: int):
        super().__init__()
        self.refiner_blocks = nn.ModuleList([RefinerBlock(dim, heads) for _ in range(num_layers)])


class TokenRefiner(nn.Module):
    """Text [B, L, C_text] → refined text tokens [B, L, D] (diffusers' HunyuanVideoTokenRefiner)."""

    def __init__(self, text_dim: int, dim: int, heads: int, num_layers: int):
        super().__init__()
        self.time_text_embed = TimeTextEmbedding(dim, text_dim)
        self.proj_in = nn.Linear(text_dim, dim)
        self.token_refiner = TokenRefinerStack(dim, heads, num_layers)

    def forward(self, text_BLC: torch.Tensor, t_B: torch.Tensor, mask_BL: torch.Tensor | None,
                masked: bool) -> torch.Tensor:
        """mask_BL (bool) pools the text; `masked` says whether attention needs it (not when all ones)."""
        if mask_BL is None:
            pooled_BC = text_BLC.mean(dim=1)
        else:
            m_BL1 = mask_BL.float()[..., None]
            # clamp: an all-zero mask pools to 0 (diffusers divides by zero)
            pooled_BC = ((text_BLC * m_BL1).sum(dim=1) / m_BL1.sum(dim=1).clamp_min(1)).to(text_BLC.dtype)
        temb_BD = self.time_text_embed(t_B, pooled_BC)
        c_BLD = self.proj_in(text_BLC)
        mask = None
        if masked:
            mask = mask_BL[:, None, None, :] & mask_BL[:, None, :, None]  # (B, 1, L, L): m_i ∧ m_j
            mask[..., 0] = True  # as diffusers: every query sees key 0, so no row is empty
        for block in self.token_refiner.refiner_blocks:
            c_BLD = block(c_BLD, temb_BD, mask)
        return c_BLD


class PatchEmbed(nn.Module):
    """[B, C, F, H, W] → [B, N, D] by a strided Conv3d (key `proj`)."""

    def __init__(self, patch_size: tuple[int, int, int], in_channels: int, dim: int):
        super().__init__()
        self.proj = nn.Conv3d(in_channels, dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class DualStreamBlock(nn.Module):
    """diffusers' HunyuanVideoTransformerBlock: per-stream AdaLN-Zero, joint attention, per-stream MLPs."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.adaln_backend = "auto"  # set through MMDiT.adaln_backend
        self.norm1 = Modulation(dim, 6)
        self.norm1_context = Modulation(dim, 6)
        self.attn = Attention(dim, heads, context=True)
        self.ff = FeedForward(dim, int(dim * mlp_ratio))
        self.ff_context = FeedForward(dim, int(dim * mlp_ratio))

    def forward(self, x_BND: torch.Tensor, c_BLD: torch.Tensor, temb_BD: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(temb_BD)
        c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(temb_BD)
        be = self.adaln_backend

        # 1. joint attention over [x; c]
        a_BND, a_BLD = self.attn(adaln_modulate(x_BND, scale_msa, shift_msa, EPS, backend=be),
                                 adaln_modulate(c_BLD, c_scale_msa, c_shift_msa, EPS, backend=be), rope, mask)
        x_BND = gated_residual(x_BND, a_BND, gate_msa)
        c_BLD = gated_residual(c_BLD, a_BLD, c_gate_msa)

        # 2. feed-forward, per stream
        x_BND = gated_residual(x_BND, self.ff(adaln_modulate(x_BND, scale_mlp, shift_mlp, EPS, backend=be)),
                               gate_mlp)
        c_BLD = gated_residual(c_BLD, self.ff_context(adaln_modulate(c_BLD, c_scale_mlp, c_shift_mlp, EPS,
                                                                     backend=be)), c_gate_mlp)
        return x_BND, c_BLD


class SingleStreamBlock(nn.Module):
    """diffusers' HunyuanVideoSingleTransformerBlock on the joint sequence h = [x; c]: attention and MLP in parallel
    from one AdaLN, one output projection of their concatenation, one gate."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.adaln_backend = "auto"
        mlp_dim = int(dim * mlp_ratio)
        self.attn = Attention(dim, heads, out=False)
        self.norm = Modulation(dim, 3)
        self.proj_mlp = nn.Linear(dim, mlp_dim)
        self.proj_out = nn.Linear(dim + mlp_dim, dim)

    def forward(self, h_BSD: torch.Tensor, temb_BD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor | None) -> torch.Tensor:
        shift, scale, gate = self.norm(temb_BD)
        n_BSD = adaln_modulate(h_BSD, scale, shift, EPS, backend=self.adaln_backend)
        mlp_BSM = F.gelu(self.proj_mlp(n_BSD), approximate="tanh")
        a_BSD = self.attn(n_BSD, rope=rope, mask=mask)
        return gated_residual(h_BSD, self.proj_out(torch.cat([a_BSD, mlp_BSM], dim=-1)), gate)


class MMDiT(DiffusersFormat, BackendKnobs, CheckpointingMixin, nn.Module):
    """HunyuanVideo text-to-video MMDiT; defaults are HunyuanVideo's (13B). See the module docstring for the math.

    Executed as written here; from outside: the AdaLN backend (`model.adaln_backend`, ops/adaln.py in every AdaLN),
    activation checkpointing per micro-batch (models/checkpointing.py; no offload), compile and FSDP2
    (models/parallelize.py). It has no fused blocks: `model.fused_ops` leaves it as it is. FSDP2 / compile from outside: `blocks` lists every dual- then single-stream block (they live in the ModuleLists
    `transformer_blocks` and `single_transformer_blocks`, diffusers' names); the rest (embedders, token refiner,
    head) belongs to the root.
    """

    _diffusers_class_name = "HunyuanVideoTransformer3DModel"
    # Not in diffusers (which has none for this model): what docs/contracts.md §5 keeps in fp32 — the embedders, every
    # modulation linear, the refiner's affine norms and the q/k norms.
    _keep_in_fp32_modules = ["time_text_embed", "norm1", "norm1_context", "norm", "norm2", "norm_out", "norm_q",
                             "norm_k", "norm_added_q", "norm_added_k"]

    def __init__(self, in_channels: int = 16, out_channels: int | None = 16, num_attention_heads: int = 24,
                 attention_head_dim: int = 128, num_layers: int = 20, num_single_layers: int = 40,
                 num_refiner_layers: int = 2, mlp_ratio: float = 4.0, patch_size: int = 2, patch_size_t: int = 1,
                 qk_norm: str = "rms_norm", guidance_embeds: bool = True, text_embed_dim: int = 4096,
                 pooled_projection_dim: int = 768, rope_theta: float = 256.0,
                 rope_axes_dim: tuple[int, int, int] = (16, 56, 56), image_condition_type: str | None = None, *,
                 adaln_backend: str = "auto"):
        super().__init__()
        if image_condition_type == "token_replace":
            raise NotImplementedError("image_condition_type='token_replace' (HunyuanVideo I2V) is not implemented; "
                                      "use None (T2V) or 'latent_concat' (image latents in in_channels)")
        if image_condition_type not in (None, "latent_concat"):
            raise ValueError(f"image_condition_type must be None or 'latent_concat', got {image_condition_type!r}")
        if qk_norm != "rms_norm":
            raise ValueError(f"qk_norm={qk_norm!r} is not supported: HunyuanVideo normalises q and k per head with "
                             "RMSNorm; set qk_norm='rms_norm'")
        rope_axes_dim = tuple(int(d) for d in rope_axes_dim)
        if len(rope_axes_dim) != 3 or sum(rope_axes_dim) != attention_head_dim:
            raise ValueError(f"rope_axes_dim={rope_axes_dim} must be three (t, h, w) bands summing to "
                             f"attention_head_dim={attention_head_dim}")
        out_channels = out_channels or in_channels
        self.config = dict(in_channels=in_channels, out_channels=out_channels,
                           num_attention_heads=num_attention_heads, attention_head_dim=attention_head_dim,
                           num_layers=num_layers, num_single_layers=num_single_layers,
                           num_refiner_layers=num_refiner_layers, mlp_ratio=mlp_ratio, patch_size=patch_size,
                           patch_size_t=patch_size_t, qk_norm=qk_norm, guidance_embeds=guidance_embeds,
                           text_embed_dim=text_embed_dim, pooled_projection_dim=pooled_projection_dim,
                           rope_theta=rope_theta, rope_axes_dim=rope_axes_dim,
                           image_condition_type=image_condition_type)
        self.patch = (int(patch_size_t), int(patch_size), int(patch_size))
        self.out_channels = out_channels
        self.guidance_embeds = guidance_embeds
        dim = num_attention_heads * attention_head_dim
        self.dim = dim

        self.x_embedder = PatchEmbed(self.patch, in_channels, dim)
        self.context_embedder = TokenRefiner(text_embed_dim, dim, num_attention_heads, num_refiner_layers)
        self.time_text_embed = TimeTextEmbedding(dim, pooled_projection_dim, guidance_embeds)
        self.rope = RoPE3D(rope_axes_dim, max_seq_len=2**31 - 1, theta=rope_theta)  # no state, no length limit
        self.transformer_blocks = nn.ModuleList([DualStreamBlock(dim, num_attention_heads, mlp_ratio)
                                                 for _ in range(num_layers)])
        self.single_transformer_blocks = nn.ModuleList([SingleStreamBlock(dim, num_attention_heads, mlp_ratio)
                                                        for _ in range(num_single_layers)])
        self.norm_out = Modulation(dim, 2)  # (scale, shift): diffusers' AdaLayerNormContinuous order
        self.proj_out = nn.Linear(dim, math.prod(self.patch) * out_channels)
        self._zero_modulation()
        self.adaln_backend = adaln_backend

    def _zero_modulation(self) -> None:
        """AdaLN-Zero: every gate, scale and shift starts at 0, so each block starts as the identity."""
        for m in self.modules():
            if isinstance(m, Modulation):
                nn.init.zeros_(m.linear.weight)
                nn.init.zeros_(m.linear.bias)

    # ----------------------------------------------------------------------------------------------- blocks
    @property
    def blocks(self) -> tuple[nn.Module, ...]:
        """The repeated blocks, dual- then single-stream, for fully_shard / block.compile() from outside."""
        return tuple(self.transformer_blocks) + tuple(self.single_transformer_blocks)

    # ----------------------------------------------------------------------------------------------- forward
    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_attention_mask: torch.Tensor | None = None, pooled_projections: torch.Tensor | None = None,
                guidance: torch.Tensor | None = None, text_span: tuple | None = None) -> torch.Tensor:
        """x [B, C, F, H, W], timestep [B] (1000·t), text [B, L, text_embed_dim], text mask [B, L] (None: all
        valid), pooled text [B, pooled_projection_dim], guidance [B] (1000·scale; guidance_embeds only)
        → [B, C_out, F, H, W]. text_span: `text_span(mask)` computed by a caller that has the mask on the host."""
        B, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.patch
        if frames % p_t or height % p_h or width % p_w:
            raise ValueError(f"latent size (F={frames}, H={height}, W={width}) must be divisible by the patch "
                             f"(patch_size_t={p_t}, patch_size={p_h})")
        if timestep.shape != (B,):
            raise ValueError(f"timestep must be [B={B}], got {tuple(timestep.shape)}")
        if pooled_projections is None:
            raise ValueError("pooled_projections [B, pooled_projection_dim] is required (HunyuanVideo: the CLIP "
                             "text model's pooled output)")
        if self.guidance_embeds and guidance is None:
            raise ValueError("this model has guidance_embeds=True: pass guidance [B] = 1000·scale (diffusers' "
                             "HunyuanVideo pipeline: 6000 for its default embedded scale 6.0)")
        f, h, w = frames // p_t, height // p_h, width // p_w  # token grid
        N = f * h * w

        text_BLC, mask_BL, masked, rows = _trim_text(encoder_hidden_states, encoder_attention_mask, text_span)
        L = text_BLC.shape[1]
        temb_BD = self.time_text_embed(timestep, pooled_projections, guidance)
        x_BND = self.x_embedder(hidden_states)
        c_BLD = self.context_embedder(text_BLC, timestep, mask_BL, masked)

        cos_NK, sin_NK = self.rope(f, h, w, hidden_states.device)
        K = cos_NK.shape[1]
        rope = (torch.cat([cos_NK, cos_NK.new_ones(L, K)]), torch.cat([sin_NK, sin_NK.new_zeros(L, K)]))
        mask = self._joint_mask(mask_BL, masked, rows, N, hidden_states)

        n_dual = len(self.transformer_blocks)  # self.blocks: dual-stream blocks first, then single-stream
        for i, block in enumerate(self.transformer_blocks):
            x_BND, c_BLD = self.run_block(i, block, x_BND, c_BLD, temb_BD, rope, mask)
        h_BSD = torch.cat([x_BND, c_BLD], dim=1)  # one joint sequence through all single-stream blocks
        for i, block in enumerate(self.single_transformer_blocks):
            h_BSD = self.run_block(n_dual + i, block, h_BSD, temb_BD, rope, mask)

        scale, shift = self.norm_out(temb_BD)
        x_BND = adaln_modulate(h_BSD[:, :N], scale, shift, EPS, backend=self.adaln_backend)
        x_BNP = self.proj_out(x_BND)  # P = C_out·p_t·p·p, channel slowest (diffusers' layout)
        x = x_BNP.reshape(B, f, h, w, self.out_channels, p_t, p_h, p_w)
        return x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(B, self.out_channels, frames, height, width)

    def _blocks_compiled(self) -> bool:
        return any(getattr(b, "_compiled_call_impl", None) is not None for b in self.blocks)

    def _joint_mask(self, mask_BL: torch.Tensor | None, masked: bool, rows, N: int, x: torch.Tensor):
        """The joint attention's mask: None where no row is padded; the rows' lengths (KeyLengths: no mask) where
        every row's valid text is a prefix; else the boolean key mask — also under a CUDA graph's capture (which
        must not bake one batch's lengths in) and with compiled blocks (which would recompile for each pattern of
        lengths)."""
        if not masked:
            return None
        if rows is not None and not _capturing(x) and not self._blocks_compiled():
            return KeyLengths(N + r for r in rows)
        return torch.cat([mask_BL.new_ones(mask_BL.shape[0], N), mask_BL], dim=1)[:, None, None, :]

    # ------------------------------------------------------------------------------------------------ counts
    _VIDEO_DUAL = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2")
    _TEXT_DUAL = ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
                  "ff_context.net.0.proj", "ff_context.net.2")
    _SINGLE = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out")
    _REFINER = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2")

    def num_matmul_params(self) -> int:
        """Weights of the matmuls that run once per latent (video) token, for MFU's 6·P·S term.

        Counted: x_embedder, proj_out, the video stream of every dual-stream block (q/k/v/out, MLP) and every
        single-stream matmul (q/k/v, proj_mlp, proj_out). Not counted: text-stream and refiner weights (they run on
        the L text tokens: num_text_matmul_params), embedders and modulation linears (once per sample), biases.
        """
        n = self.x_embedder.proj.weight.numel() + self.proj_out.weight.numel()
        n += sum(b.get_submodule(k).weight.numel() for b in self.transformer_blocks for k in self._VIDEO_DUAL)
        return n + self._single_params()

    def num_text_matmul_params(self) -> int:
        """Weights of the matmuls that run once per text token (the 6·P_text·L term): context_embedder.proj_in,
        the refiner blocks, the text stream of the dual-stream blocks and the single-stream blocks."""
        n = self.context_embedder.proj_in.weight.numel()
        n += sum(b.get_submodule(k).weight.numel() for b in self.context_embedder.token_refiner.refiner_blocks
                 for k in self._REFINER)
        n += sum(b.get_submodule(k).weight.numel() for b in self.transformer_blocks for k in self._TEXT_DUAL)
        return n + self._single_params()

    def _single_params(self) -> int:
        return sum(b.get_submodule(k).weight.numel() for b in self.single_transformer_blocks for k in self._SINGLE)

    def train_flops(self, S: int, L: int) -> float:
        """Forward + backward FLOPs of one sample with S video and L text tokens (no recompute counted):

            6·(P_video·S + P_text·L + P_once) + 12·D·((num_layers + num_single_layers)·(S + L)² + R·L²)

        Joint attention costs (S + L)² per dual/single block (Wan's cross-attention formula, 12·D·S·L, undercounts
        it); R refiner blocks attend over the text alone. P_once: embedders and modulation linears (once per
        sample). L is the text length the model runs (after trimming: the longest prompt in the micro-batch).
        """
        once = [m for m in self.modules() if isinstance(m, (Modulation, TimeTextEmbedding))]
        p_once = sum(lin.weight.numel() for m in once for lin in m.modules() if isinstance(lin, nn.Linear))
        layers = len(self.transformer_blocks) + len(self.single_transformer_blocks)
        R = len(self.context_embedder.token_refiner.refiner_blocks)
        matmul = 6 * (self.num_matmul_params() * S + self.num_text_matmul_params() * L + p_once)
        return float(matmul + 12 * self.dim * (layers * (S + L) ** 2 + R * L ** 2))


def text_span(mask_BL: torch.Tensor) -> tuple[int, bool, tuple[int, ...] | None]:
    """(keep, masked, rows): the text positions up to the last one any sample attends (at least one: the refiner
    always lets queries see key 0), whether some row is padded within them, and each row's count of valid positions
    where every row's are a prefix (left-aligned, as tokenizers pad), else None: the joint attention then runs
    without a mask (KeyLengths). A host sync when the mask is on a GPU; a caller holding the mask on the host
    computes it there and passes it as `text_span` (CUDA graphs need that)."""
    mask_BL = mask_BL.bool()
    pos_L = torch.arange(1, mask_BL.shape[1] + 1, device=mask_BL.device)
    count_B = mask_BL.sum(1)
    last_B = (mask_BL * pos_L).amax(1)  # 1 + the last valid position of each row (0: none)
    keep, fewest, prefix, *counts = torch.cat([torch.stack([last_B.max(), count_B.min(), (last_B == count_B).all()]),
                                               count_B]).tolist()  # one transfer
    keep = max(1, keep)
    # every row valid over the kept span ⇔ its count equals the span (nothing valid lies beyond it)
    return keep, fewest < keep, tuple(counts) if prefix else None


def _capturing(x: torch.Tensor) -> bool:
    return torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing())


def _trim_text(text_BLC: torch.Tensor, mask_BL: torch.Tensor | None, span: tuple | None = None):
    """(text, bool mask, whether attention needs the mask, rows: text_span's prefix lengths or None) with trailing
    positions no sample attends cut off.

    Exact: a masked key adds nothing to any softmax, and a masked text query only feeds its own token, which no
    video token ever reads. It lets unpadded batches (e.g. B = 1) run SDPA's flash kernel.
    """
    if mask_BL is None:
        return text_BLC, None, False, None
    if mask_BL.shape != text_BLC.shape[:2]:
        raise ValueError(f"encoder_attention_mask must be [B, L] = {tuple(text_BLC.shape[:2])}, "
                         f"got {tuple(mask_BL.shape)}")
    keep, masked, *rows = span if span is not None else text_span(mask_BL)
    return text_BLC[:, :keep], mask_BL.bool()[:, :keep], masked, (rows[0] if rows else None)

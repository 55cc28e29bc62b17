"""Flow-matching Euler sampler with Wan's shifted schedule and classifier-free guidance; VAE decoding of its output.

With x_t = (1 − t)·x0 + t·ε the model predicts v = dx_t/dt = ε − x0, so integrating from pure noise at t = 1 down
to t = 0 with explicit Euler steps gives a sample:

    t_i   = shift·s_i / (1 + (shift − 1)·s_i),   s_i = 1 − i/N,  i = 0 … N        (Wan's get_sampling_sigmas, t_N = 0)
    v̂     = v(x, t_i, ∅) + g · (v(x, t_i, c) − v(x, t_i, ∅))                     (guidance g; g = 1: no ∅ pass)
    x     ← x + (t_{i+1} − t_i) · v̂                                              (the model gets timestep 1000·t_i)

∅ is the empty prompt's text embedding (what caption dropout trained, contracts §2). The noise of clip k is drawn
on the CPU from a generator seeded with its seed, so a clip is the same on every device, rank and run.
Decoding un-normalises the latents with the VAE's own statistics, z = z_norm·std + mean (the inverse of
data/encoders.py's normalisation, as diffusers' Wan pipeline does), then runs the VAE decoder (a VAE that takes
normalised latents itself, such as the demo's PCA VAE, decodes them directly): F' latent frames
become 1 + 4·(F' − 1) frames, 8× the latent height and width, in [−1, 1].
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from models.flow_matching import shift_t


@dataclass
class SampleConfig:
    """`sample:` — what validation sampling and scripts/sample.py generate (`train.sample_every` says when)."""
    RESUME_DEFAULT = "free"
    steps: int = 30
    guidance: float = 5.0               # classifier-free guidance scale g; 1 disables the empty-prompt pass
    shift: float = 3.0                  # Wan's sampling shift (3 at 480p, 5 at 720p in its pipelines)
    bucket: Optional[str] = None        # a data.buckets entry giving frames × height × width; null: smallest video
    prompts: list = field(default_factory=list)  # captions, encoded by data.encoders' text encoder
    val_prompts: int = 2                # without captions: the text of this many held-out (val) samples
    seeds: list[int] = field(default_factory=lambda: [0])  # one clip per (prompt, seed), each in [0, 2^64)
    fps: float = 16.0                   # of the written mp4 (Wan 2.1: 16)

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"sample.steps must be ≥ 1, got {self.steps}")
        if not self.guidance >= 1:
            raise ValueError(f"sample.guidance must be ≥ 1 (1 disables guidance), got {self.guidance}")
        if not self.shift > 0:
            raise ValueError(f"sample.shift must be > 0, got {self.shift}")
        self.prompts = [str(p) for p in self.prompts]
        if self.val_prompts < (0 if self.prompts else 1):
            raise ValueError(f"sample.val_prompts must be ≥ 1 (≥ 0 when sample.prompts is given), got "
                             f"{self.val_prompts}")
        # torch.Generator().manual_seed takes seeds in [0, 2^64) (negative ones wrap around: refused).
        if not self.seeds or any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 2**64
                                 for s in self.seeds):
            raise ValueError(f"sample.seeds must be a non-empty list of integers in [0, 2^64), got {self.seeds!r}")
        if not self.fps > 0:
            raise ValueError(f"sample.fps must be > 0, got {self.fps}")


def sampling_times(steps: int, shift: float) -> torch.Tensor:
    """[steps + 1] times from 1 down to 0 on Wan's shifted schedule (fp64, so t_N is exactly 0)."""
    return shift_t(torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64), shift)


def initial_noise(seed: int, shape: Sequence[int]) -> torch.Tensor:
    """ε [C, F, H, W] for one clip: the same on every device (drawn on the CPU in fp32)."""
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(int(seed)))


@torch.no_grad()
def sample_latents(model: torch.nn.Module, text_BLC: torch.Tensor, empty_LC: torch.Tensor,
                   latent_shape: Sequence[int], seeds: Sequence[int], steps: int = 30, guidance: float = 5.0,
                   shift: float = 3.0, autocast: Callable = contextlib.nullcontext,
                   device: Optional[torch.device] = None) -> torch.Tensor:
    """Normalised latents [B, C, F, H, W] (fp32, on `device`) for B text embeddings and B seeds.

    text_BLC and empty_LC are padded to the model's text length. Clips are generated one at a time (batch 2 with
    guidance: conditional and empty prompt together), which bounds memory at large buckets. Every rank of an
    FSDP2 model must call this with the same arguments (each forward is collective).
    """
    if len(seeds) != text_BLC.shape[0]:
        raise ValueError(f"one seed per text: {len(seeds)} seeds for {text_BLC.shape[0]} texts")
    device = device or text_BLC.device
    was_training = model.training
    model.eval()
    times = sampling_times(steps, shift).tolist()
    out = []
    try:
        for text_LC, seed in zip(text_BLC, seeds):
            x = initial_noise(seed, latent_shape).to(device)[None]  # (1, C, F, H, W) fp32
            ctx = text_LC[None] if guidance == 1 else torch.stack([text_LC, empty_LC.to(text_LC)])
            ctx = ctx.to(device)
            for t, t_next in zip(times[:-1], times[1:]):
                x_in = x if guidance == 1 else x.expand(2, *x.shape[1:])
                timestep = torch.full((x_in.shape[0],), 1000.0 * t, device=device)
                with autocast():
                    v = model(x_in, timestep, ctx).float()
                if guidance != 1:
                    v_cond, v_empty = v.chunk(2)
                    v = v_empty + guidance * (v_cond - v_empty)
                x = x + (t_next - t) * v
            out.append(x)
    finally:
        model.train(was_training)
    return torch.cat(out)


@torch.no_grad()
def decode_latents(vae, z_norm_BCFHW: torch.Tensor) -> torch.Tensor:
    """Normalised latents → pixels [B, 3, 1 + 4·(F − 1), 8·H, 8·W] in [−1, 1], fp32 on the CPU.

    `vae` is a diffusers AutoencoderKLWan (its config holds latents_mean / latents_std of z_dim entries: un-normalised
    here, then decoded), or any VAE whose own `decode` takes normalised latents (data/encoders.py's WanVAE, the PCA
    VAE of data/pca_vae.py) — told apart by the diffusers `config`.
    """
    if not hasattr(vae, "config"):
        return vae.decode(z_norm_BCFHW).float().clamp(-1, 1).cpu()
    param = next(vae.parameters())
    c = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32, device=param.device).view(1, c, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, dtype=torch.float32, device=param.device).view(1, c, 1, 1, 1)
    z = z_norm_BCFHW.to(param.device, torch.float32) * std + mean
    frames = vae.decode(z.to(param.dtype), return_dict=False)[0]
    return frames.float().clamp(-1, 1).cpu()

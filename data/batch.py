"""The Batch: what one micro-batch hands the model (docs/contracts.md §4).

    latents     [B, C, F, H, W]  normalised with the VAE's latents_mean/std
    text        [B, L, C_text]   zero-padded to the model's text_len (512 for Wan, as diffusers' pipeline does)
    text_mask   [B, L]           optional (MMDiT)
    pooled      [B, C_pool]      optional (MMDiT)
    keys, bucket, S, loss_weight [B] (0 for padding samples), data_wait_s
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import torch


@dataclass
class Batch:
    latents: torch.Tensor
    text: torch.Tensor
    keys: list[str]
    bucket: str
    S: int
    loss_weight: torch.Tensor
    text_mask: Optional[torch.Tensor] = None
    pooled: Optional[torch.Tensor] = None
    data_wait_s: float = 0.0
    L_text: list[int] = field(default_factory=list)

    @property
    def B(self) -> int:
        return self.latents.shape[0]

    @property
    def num_real(self) -> int:
        return int((self.loss_weight > 0).sum())

    def to(self, device, non_blocking: bool = True) -> "Batch":
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)
        return replace(self, latents=move(self.latents), text=move(self.text), loss_weight=move(self.loss_weight),
                       text_mask=move(self.text_mask), pooled=move(self.pooled))


def pad_text(text: torch.Tensor, text_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, C] → ([text_len, C] zero-padded, [text_len] mask); longer texts are cut at text_len."""
    L = min(text.shape[0], text_len)
    out = text.new_zeros(text_len, text.shape[1])
    out[:L] = text[:L]
    mask = torch.zeros(text_len, dtype=torch.bool)
    mask[:L] = True
    return out, mask


def collate(latents: Sequence[torch.Tensor], texts: Sequence[torch.Tensor], keys: Sequence[str], bucket: str, S: int,
            loss_weight: Sequence[float], text_len: int) -> Batch:
    shapes = {tuple(x.shape) for x in latents}
    if len(shapes) != 1:
        raise ValueError(f"micro-batch of bucket {bucket} mixes latent shapes {sorted(shapes)}")
    padded = [pad_text(t, text_len) for t in texts]
    return Batch(latents=torch.stack(list(latents)), text=torch.stack([p[0] for p in padded]), keys=list(keys),
                 bucket=bucket, S=S, loss_weight=torch.tensor(list(loss_weight), dtype=torch.float32),
                 text_mask=torch.stack([p[1] for p in padded]), L_text=[min(t.shape[0], text_len) for t in texts])

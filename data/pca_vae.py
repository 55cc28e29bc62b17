"""A deterministic autoencoder with the Wan VAE's strides, fitted by PCA in seconds: what lets a CPU run show
learning without the real VAE's weights (the demo, `conf=demo`).

Wan's causal VAE maps F = 1 + 4k frames to F' = 1 + k latent frames and H×W to H/8 × W/8: the first frame is
encoded alone, then each group of 4 frames. This autoencoder keeps that geometry and replaces the networks by two
linear maps fitted to a corpus' pixels (x ∈ [−1, 1]):

    p0 = the first frame's 3×1×8×8 patch (192 values),  p1 = a 4-frame group's 3×4×8×8 patch (768 values)
    z_c = u_c · (p − μ) / σ                            (encode: the C leading principal axes u_c)
    p̂  = μ + σ Σ_c z_c u_c                             (decode: the projection back, clamped to [−1, 1])

σ² is the mean variance of the basis' C axes, so the latents of the fitted corpus have mean 0 and a mean variance
of 1 over the channels (normalised, contracts §4: latents_mean 0, latents_std 1 as a whole) while each channel keeps
its share of the pixel variance: the flow-matching loss weighs channels as the pixels do, not the faint last axes
as much as the colour of a patch. Each basis has its own axes; the sign of
each axis is fixed (its largest entry positive), so a fit is exactly reproducible. The fitted arrays are saved with
safetensors (`pca_vae.safetensors` in a folder, nothing pickled) and loaded by `data.encoders.vae=<that folder>`.
"""
from __future__ import annotations

import itertools
import json
import os
from typing import Iterable

import numpy as np
import torch

from data.buckets import VAE_STRIDE_S as S_STRIDE, VAE_STRIDE_T as T_STRIDE

FILE = "pca_vae.safetensors"
D0, D1 = 3 * S_STRIDE ** 2, 3 * T_STRIDE * S_STRIDE ** 2  # values in a first-frame patch (192), a group's (768)
KEYS = ("mean0", "axes0", "sigma0", "mean1", "axes1", "sigma1")


def _patches(x_BCFHW: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first-frame patches [B, H', W', 192], group patches [B, k, H', W', 768]) of x [B, 3, 1 + 4k, H, W]."""
    B, C, F, H, W = x_BCFHW.shape
    if (F - 1) % T_STRIDE or H % S_STRIDE or W % S_STRIDE:
        raise ValueError(f"the PCA VAE takes 1 + 4k frames of sides divisible by 8, got {F}×{H}×{W}")
    h, w, k = H // S_STRIDE, W // S_STRIDE, (F - 1) // T_STRIDE
    p0 = x_BCFHW[:, :, 0].reshape(B, C, h, S_STRIDE, w, S_STRIDE).permute(0, 2, 4, 1, 3, 5).reshape(B, h, w, D0)
    p1 = x_BCFHW[:, :, 1:].reshape(B, C, k, T_STRIDE, h, S_STRIDE, w, S_STRIDE)
    p1 = p1.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(B, k, h, w, D1)
    return p0, p1


def _unpatch(p0: torch.Tensor, p1: torch.Tensor) -> torch.Tensor:
    """The inverse of _patches: [B, 3, 1 + 4k, H, W]."""
    B, h, w, _ = p0.shape
    k = p1.shape[1]
    f0 = p0.reshape(B, h, w, 3, S_STRIDE, S_STRIDE).permute(0, 3, 1, 4, 2, 5)
    f0 = f0.reshape(B, 3, 1, h * S_STRIDE, w * S_STRIDE)
    f1 = p1.reshape(B, k, h, w, 3, T_STRIDE, S_STRIDE, S_STRIDE).permute(0, 4, 1, 5, 2, 6, 3, 7)
    return torch.cat([f0, f1.reshape(B, 3, k * T_STRIDE, h * S_STRIDE, w * S_STRIDE)], dim=2)


class PCAVAE:
    """encode: x [B, 3, 1 + 4k, H, W] in [−1, 1] → normalised latents [B, C, 1 + k, H/8, W/8] (fp32);
    decode: the inverse map, pixels in [−1, 1]. The same interface as data/encoders.py's WanVAE."""

    def __init__(self, arrays: dict[str, torch.Tensor], device: torch.device = torch.device("cpu")):
        self.device = device
        self.a = {k: arrays[k].to(device, torch.float32) for k in KEYS}
        self.latent_channels = int(self.a["axes0"].shape[0])

    def encode(self, x_BCFHW: torch.Tensor) -> torch.Tensor:
        p0, p1 = _patches(x_BCFHW.to(self.device, torch.float32))
        a = self.a
        z0 = (p0 - a["mean0"]) @ a["axes0"].T / a["sigma0"]  # [B, h, w, C]
        z1 = (p1 - a["mean1"]) @ a["axes1"].T / a["sigma1"]  # [B, k, h, w, C]
        return torch.cat([z0.permute(0, 3, 1, 2)[:, :, None], z1.permute(0, 4, 1, 2, 3)], dim=2)

    def encode_u8(self, u8_BFHWC) -> torch.Tensor:
        from data.decode import to_model_range

        return self.encode(to_model_range(u8_BFHWC, self.device, torch.float32))

    def decode(self, z_BCFHW: torch.Tensor) -> torch.Tensor:
        z = z_BCFHW.to(self.device, torch.float32)
        a = self.a
        p0 = a["mean0"] + (z[:, :, 0].permute(0, 2, 3, 1) * a["sigma0"]) @ a["axes0"]
        p1 = a["mean1"] + (z[:, :, 1:].permute(0, 2, 3, 4, 1) * a["sigma1"]) @ a["axes1"]
        return _unpatch(p0, p1).clamp(-1, 1).cpu()

    def save(self, folder: str) -> str:
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, FILE)
        save_file({k: v.cpu().contiguous() for k, v in self.a.items()}, path + ".tmp",
                  metadata={"format": "pca_vae/1", "strides": json.dumps([T_STRIDE, S_STRIDE, S_STRIDE])})
        os.replace(path + ".tmp", path)
        return path

    @classmethod
    def load(cls, folder: str, device: torch.device = torch.device("cpu")) -> "PCAVAE":
        from safetensors.torch import load_file

        arrays = load_file(os.path.join(folder, FILE))
        missing = [k for k in KEYS if k not in arrays]
        C = arrays.get("axes0", torch.empty(0, 0)).shape[0]
        shapes = {"mean0": (D0,), "axes0": (C, D0), "sigma0": (C,), "mean1": (D1,), "axes1": (C, D1),
                  "sigma1": (C,)}
        bad = [k for k in KEYS if k in arrays and tuple(arrays[k].shape) != shapes[k]]
        if missing or bad or not all(torch.isfinite(v).all() and (v > 0).all() for k, v in arrays.items()
                                     if k.startswith("sigma")):
            raise ValueError(f"{folder}/{FILE} is not a PCA VAE (missing {missing}, misshapen {bad}, or a σ ≤ 0): "
                             f"write it again with the project's fit_pca_vae (data/pca_vae.py)")
        return cls(arrays, device)


def is_pca_vae(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, FILE))


def _principal_axes(sums: torch.Tensor, outer: torch.Tensor, n: int, channels: int):
    """(mean, axes [C, D], σ [C]) from Σp and Σpp^T of n patches: the covariance's C leading eigenvectors, and σ
    (the same in every entry) the root of their mean eigenvalue."""
    if n < 2:
        raise ValueError("fitting a PCA VAE needs at least 2 patches")
    mean = sums / n
    cov = (outer - n * torch.outer(mean, mean)) / (n - 1)
    if channels > cov.shape[0]:
        raise ValueError(f"a PCA VAE of {channels} channels needs patches of ≥ {channels} values, got {cov.shape[0]}")
    val, vec = torch.linalg.eigh(cov)  # ascending
    val, vec = val.flip(0)[:channels], vec.flip(1)[:, :channels].T
    idx = vec.abs().argmax(dim=1)
    vec = vec * torch.sign(vec[torch.arange(channels), idx])[:, None]  # a fixed sign per axis: reproducible
    sigma = val.clamp_min(1e-8).mean().sqrt().expand(channels).clone()  # one scale per basis (module docstring)
    return mean.float(), vec.float().contiguous(), sigma.float()


def fit_pca_vae(clips_u8: Iterable, channels: int, max_clips: int = 256) -> PCAVAE:
    """Fit to the first `max_clips` clips of uint8 frames [F, H, W, 3] (F = 1 + 4k; images are F = 1): the first
    frames fit the first basis, the 4-frame groups the second. Σp and Σpp^T are taken over each clip's distinct
    patches, weighted by their counts (one matmul): seconds for a few hundred small clips on a CPU."""
    rows: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[], []]
    for u8 in itertools.islice(clips_u8, max_clips):
        x = torch.as_tensor(np.asarray(u8)).permute(3, 0, 1, 2)[None].float() / 127.5 - 1  # [1, 3, F, H, W]
        for j, p in enumerate(_patches(x)):
            if p.numel():  # plain backgrounds: one row, with its count
                rows[j].append(torch.unique(p.reshape(-1, p.shape[-1]), dim=0, return_counts=True))
    s, o, n = [], [], []
    for j in range(2):
        p = torch.cat([r[0] for r in rows[j]]) if rows[j] else torch.zeros(0, (D0, D1)[j])
        count = torch.cat([r[1] for r in rows[j]]).float() if rows[j] else torch.zeros(0)
        s.append((p * count[:, None]).sum(0, dtype=torch.float64))
        o.append(((p * count[:, None]).T @ p).double())
        n.append(int(count.sum()))
    if n[1] == 0:
        raise ValueError("fitting a PCA VAE needs at least one clip of 5 or more frames (1 + 4k)")
    (m0, a0, s0), (m1, a1, s1) = (_principal_axes(s[j], o[j], n[j], channels) for j in range(2))
    return PCAVAE({"mean0": m0, "axes0": a0, "sigma0": s0, "mean1": m1, "axes1": a1, "sigma1": s1})

"""Flow matching as Wan 2.1 trains it (rectified flow, velocity target).

    x_t = (1 − t)·x0 + t·ε,   target v = ε − x0,   loss = mean over elements of (v̂ − v)² per sample
    t ~ U(0, 1) or logit-normal σ(N(μ, s²)), then Wan's shift  t ← shift·t / (1 + (shift − 1)·t)
    the model receives timestep = 1000·t (Wan's and diffusers' convention: FlowMatchEulerDiscreteScheduler's
    timesteps are sigmas·1000)

The caller hands `sample_t` the generator to draw from; training/step.py keys it by (seed, epoch, sample key), so a
resumed run, or the same sample on another rank, draws the same t and noise (docs/contracts.md §5).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

VAL_TIMES = (0.1, 0.3, 0.5, 0.7, 0.9)


@dataclass
class ObjectiveConfig:
    RESUME_DEFAULT = "free"
    t_sampling: str = "logit_normal"  # uniform | logit_normal
    shift: float = 1.0                # Wan's timestep shift (5.0 at 720p, 3.0 at 480p in its pipelines)
    logit_mean: float = 0.0           # any finite value: the mean of the normal before the sigmoid
    logit_std: float = 1.0

    def __post_init__(self):
        if self.t_sampling not in ("uniform", "logit_normal"):
            raise ValueError(f"objective.t_sampling must be 'uniform' or 'logit_normal', got {self.t_sampling!r}")
        if not self.shift > 0:
            raise ValueError(f"objective.shift must be > 0, got {self.shift}")
        if not self.logit_std > 0:
            raise ValueError(f"objective.logit_std must be > 0, got {self.logit_std}")


def shift_t(t: torch.Tensor, shift: float) -> torch.Tensor:
    return shift * t / (1 + (shift - 1) * t)


class FlowMatching:
    def __init__(self, cfg: ObjectiveConfig):
        self.cfg = cfg

    def sample_t(self, generator: torch.Generator) -> torch.Tensor:
        """One t (a 0-d fp32 tensor) from `generator`: U(0, 1) or σ(N(μ, s²)), then the shift. It takes exactly one
        scalar draw from the generator, so whatever the caller draws next (the noise) does not depend on the mode."""
        if self.cfg.t_sampling == "uniform":
            t = torch.rand((), generator=generator)
        else:
            t = torch.sigmoid(self.cfg.logit_mean + self.cfg.logit_std * torch.randn((), generator=generator))
        return shift_t(t, self.cfg.shift)

    @staticmethod
    def per_sample_loss(model, x0: torch.Tensor, text: torch.Tensor, t: torch.Tensor,
                        noise: torch.Tensor, **cond) -> torch.Tensor:
        """[B] mean squared error of the predicted velocity, in fp32. `cond`: the model's extra inputs (MMDiT)."""
        t_ = t.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
        x_t = (1 - t_) * x0 + t_ * noise
        v_pred = model(x_t, 1000.0 * t, text, **cond)
        return (v_pred.float() - (noise - x0).float()).pow(2).flatten(1).mean(1)

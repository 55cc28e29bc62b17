"""Model factory: ModelConfig → a model on one device (parallelism is applied from outside, models/parallelize.py)."""
from __future__ import annotations

import torch

from models.config import ModelConfig


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu") -> torch.nn.Module:
    from models.wan import WanTransformer

    if cfg.pretrained:
        model = WanTransformer.from_pretrained(cfg.pretrained, adaln_backend=cfg.adaln_backend)
        theirs = {k: v for k, v in model.config.items() if k in cfg.diffusers_kwargs()}
        ours = {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.diffusers_kwargs().items()}
        diff = {k: (ours[k], list(v) if isinstance(v, tuple) else v) for k, v in theirs.items()
                if (list(v) if isinstance(v, tuple) else v) != ours[k]}
        if diff:
            raise ValueError(f"model.pretrained={cfg.pretrained} has a config that differs from model.*: "
                             + ", ".join(f"model.{k}={a} but the checkpoint has {b}" for k, (a, b) in diff.items()))
        return model.to(device=device, dtype=torch.float32)
    with torch.device(device):
        return WanTransformer(**cfg.diffusers_kwargs(), adaln_backend=cfg.adaln_backend)


def matmul_params(model: torch.nn.Module) -> int:
    return int(model.num_matmul_params())

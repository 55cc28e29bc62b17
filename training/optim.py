"""Optimizer, learning-rate schedule and EMA.

The optimizer (`optim.name`) and the schedule (`optim.schedule`) are chosen by name from two registries, so a new
one is added in one place: `register_optimizer(name, build)` with build(param_groups, cfg) → a torch optimizer, and
`register_schedule(name, decay)` with decay(frac) → the factor after warm-up at frac ∈ [0, 1] of the decay phase.
Both are checked where the config is (OptimConfig), and resume refuses an optimizer whose stored state is another's
(training/checkpoint.py).

Built in: AdamW over fp32 master weights; LR: linear warm-up over `warmup_steps`, then constant, cosine or linear
decay to `min_lr_ratio`·lr at `train.steps`. EMA: θ_ema ← d·θ_ema + (1 − d)·θ after each update, kept in fp32.

Parameter groups (`optim.groups`, for fine-tuning): each named group takes the trainable parameters whose names
match its regex (`re.search`, first group in name order wins) and trains them at its own `lr` (and optional
`weight_decay`); the schedule's factor scales every group alike. Parameters no group claims use `optim.lr`.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

OPTIMIZERS: dict[str, Callable] = {}   # name → build(param_groups, cfg) → torch.optim.Optimizer
SCHEDULES: dict[str, Callable[[float], float]] = {}  # name → decay(frac) → factor in [0, 1] before min_lr_ratio


def register_optimizer(name: str, build: Callable) -> None:
    """Make `optim.name=<name>` build its optimizer with build(param_groups, cfg) (param_groups as param_groups()
    returns them: each group's lr and weight_decay set)."""
    OPTIMIZERS[name] = build


def register_schedule(name: str, decay: Callable[[float], float]) -> None:
    """Make `optim.schedule=<name>` decay the LR by decay(frac) after the warm-up (frac from 0 to 1 at train.steps)."""
    SCHEDULES[name] = decay


@dataclass
class OptimConfig:
    RESUME_DEFAULT = "free"  # hyper-parameters re-applied over the loaded state (training/resume.py)
    name: str = "adamw"          # the optimizer, from OPTIMIZERS (register_optimizer adds one)
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: str = "constant"   # constant | cosine | linear (after warm-up), from SCHEDULES (register_schedule)
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0       # max global grad norm; 0 disables clipping (the norm is still logged)
    ema_decay: Optional[float] = field(default=None, metadata={"switch": True})  # null: no EMA
    # name → {match: regex, lr: float, weight_decay: float (optional)}. Which parameters a group holds shapes the
    # optimizer state (a resume refuses another `match`); its rates do not.
    groups: dict = field(default_factory=dict,
                         metadata={"resume": "trained", "resume_under": {"*": "free", "*.match": "trained"}})

    def __post_init__(self):
        # Comparisons written so that NaN fails them (training/config.py refuses NaN and ±Inf before this runs).
        if not self.lr > 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if not self.weight_decay >= 0:
            raise ValueError(f"optim.weight_decay must be ≥ 0, got {self.weight_decay}")
        if not self.eps > 0:
            raise ValueError(f"optim.eps must be > 0 (AdamW's denominator term), got {self.eps}")
        self.betas = tuple(self.betas)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim.betas must be two numbers in [0, 1), got {self.betas}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be ≥ 0, got {self.warmup_steps}")
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optim.name must be one of {sorted(OPTIMIZERS)} (training/optim.py register_optimizer "
                             f"adds one), got {self.name!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"optim.schedule must be one of {sorted(SCHEDULES)} (training/optim.py "
                             f"register_schedule adds one), got {self.schedule!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")
        if not self.grad_clip >= 0:
            raise ValueError(f"optim.grad_clip must be ≥ 0 (0 disables), got {self.grad_clip}")
        if self.ema_decay is not None and not 0 < self.ema_decay < 1:
            raise ValueError(f"optim.ema_decay must lie in (0, 1) or be null, got {self.ema_decay}")
        for name, g in self.groups.items():
            where = f"optim.groups.{name}"
            if not isinstance(g, dict) or "match" not in g or "lr" not in g:
                raise ValueError(f"{where} must be a mapping with `match` (a regex on parameter names) and `lr`, "
                                 f"got {g!r}")
            unknown = sorted(set(g) - {"match", "lr", "weight_decay"})
            if unknown:
                raise ValueError(f"{where} has unknown key(s) {unknown}; known: match, lr, weight_decay")
            try:
                re.compile(g["match"])
            except (re.error, TypeError) as e:
                raise ValueError(f"{where}.match is not a valid regex: {g['match']!r} ({e})") from None
            lr, wd = g["lr"], g.get("weight_decay")
            if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr) and lr > 0):
                raise ValueError(f"{where}.lr must be a finite number > 0, got {lr!r}")
            if wd is not None and (isinstance(wd, bool) or not isinstance(wd, (int, float))
                                   or not (math.isfinite(wd) and wd >= 0)):
                raise ValueError(f"{where}.weight_decay must be a finite number ≥ 0, got {wd!r}")


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * SCHEDULES[cfg.schedule](frac)


def param_groups(model: torch.nn.Module, cfg: OptimConfig) -> list[dict]:
    """AdamW groups: optim.lr with and without decay first (train/lr logs group 0), then each named group, split
    the same way; empty groups are dropped (DCP's optimizer state dict allows at most one).
    No weight decay on norms, biases and the modulation tables (1-D parameters and scale_shift_table)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    claimed: dict[str, list] = {name: [] for name in cfg.groups}
    rest = []
    for n, p in named:
        owner = next((g for g, spec in cfg.groups.items() if re.search(spec["match"], n)), None)
        (claimed[owner] if owner is not None else rest).append((n, p))

    def split(pairs, lr, wd, tag):
        decay = [p for n, p in pairs if p.ndim >= 2 and "scale_shift" not in n]
        ids = {id(p) for p in decay}
        return [{"params": decay, "lr": lr, "weight_decay": wd, "name": tag},
                {"params": [p for _, p in pairs if id(p) not in ids], "lr": lr, "weight_decay": 0.0,
                 "name": tag + "/no_decay"}]

    groups = split(rest, cfg.lr, cfg.weight_decay, "default")
    for name, spec in cfg.groups.items():
        if not claimed[name]:
            raise ValueError(f"optim.groups.{name}.match={spec['match']!r} matches no trainable parameter")
        groups += split(claimed[name], float(spec["lr"]), float(spec.get("weight_decay", cfg.weight_decay)), name)
    return [g for g in groups if g["params"]]


def _plain_cuda(tensors) -> bool:
    """Every tensor a plain (not sharded) CUDA tensor: what the fused and foreach single-kernel paths take."""
    from torch.distributed.tensor import DTensor

    tensors = list(tensors)
    return bool(tensors) and all(t.device.type == "cuda" and not isinstance(t, DTensor) for t in tensors)


def _adamw(groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW: fused (a few kernels for every parameter) on one CUDA device, foreach elsewhere."""
    params = [p for g in groups for p in g["params"]]
    kind = {"fused": True} if _plain_cuda(params) else {"foreach": not any(p.device.type == "meta" for p in params)}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, **kind)


register_optimizer("adamw", _adamw)
register_schedule("constant", lambda frac: 1.0)
register_schedule("cosine", lambda frac: 0.5 * (1 + math.cos(math.pi * frac)))
register_schedule("linear", lambda frac: 1 - frac)


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, total_steps: int):
    """The optimizer optim.name names over param_groups(model, cfg), and its LR schedule (lr_factor)."""
    opt = OPTIMIZERS[cfg.name](param_groups(model, cfg), cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg, total_steps))
    return opt, sched


class EMA:
    """fp32 shadow copy of the trainable parameters (sharded like them under FSDP2)."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        self.shadow = {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        pairs = [(self.shadow[n], p.detach().float()) for n, p in model.named_parameters() if n in self.shadow]
        if _plain_cuda(s for s, _ in pairs):  # one launch per few hundred tensors instead of one each
            torch._foreach_lerp_([s for s, _ in pairs], [p for _, p in pairs], 1 - self.decay)
        else:
            for shadow, p in pairs:
                shadow.lerp_(p, 1 - self.decay)

    @torch.no_grad()
    def reset(self, model: torch.nn.Module) -> None:
        """Start again from the model's weights (a resume that turns EMA on: the checkpoint holds none)."""
        for n, p in model.named_parameters():
            if n in self.shadow:
                self.shadow[n].copy_(p.detach().float())

    def state_dict(self) -> dict:
        return self.shadow

    def load_state_dict(self, sd: dict) -> None:
        for n, t in sd.items():
            self.shadow[n].copy_(t)

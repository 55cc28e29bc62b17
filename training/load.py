"""Loading a trained model outside the loop: a checkpoint's stored config and its weights in one process.

A checkpoint folder (`step_N/`) holds `config.yaml` (the resolved run config), the DCP files and `meta.json`; a run
folder holds checkpoints, the newest complete one being what `find_checkpoint` returns. Sampling, export and
evaluation read a model through these functions, so they agree on what a checkpoint means.
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Optional, Sequence

import torch


def checkpoint_config(path: str, overrides: Sequence[str] = ()):
    """The typed config stored with a checkpoint, with dotted KEY=VALUE overrides merged on top."""
    import yaml
    from omegaconf import OmegaConf

    from training.config import load_config

    if any(o.split("=", 1)[0] in ("conf", "+conf") for o in overrides):
        raise ValueError("conf=NAME selects a preset when composing; a checkpoint brings its own config "
                         "(override single keys instead)")
    with open(os.path.join(path, "config.yaml")) as f:
        raw = OmegaConf.create(yaml.safe_load(f))
    if overrides:
        raw = OmegaConf.merge(raw, OmegaConf.from_dotlist([o.lstrip("+") for o in overrides]))
    return load_config(OmegaConf.to_container(raw, resolve=True))


def find_checkpoint(source: str, step: Optional[int] = None) -> Optional[str]:
    """A checkpoint folder for `source` (a step_N folder or a run folder), or None when it is not one."""
    from training.checkpoint import latest_checkpoint, list_checkpoints

    if os.path.exists(os.path.join(source, "meta.json")):
        return source
    if step is not None:
        found = dict(list_checkpoints(source)).get(step)
        if found is None:
            raise FileNotFoundError(f"{source} holds no complete checkpoint step_{step}")
        return found
    return latest_checkpoint(source)


def load_checkpoint_model(path: str, cfg, ema: bool = False) -> torch.nn.Module:
    """The model a checkpoint holds: built from its config (with its LoRA), then every tensor the checkpoint has.

    A checkpoint that lacks the base weights (adapter-only) takes them from `model.pretrained`. `ema` loads the EMA
    weights (of the trainable parameters) instead of the raw ones.
    """
    from models.build import build_model
    from training.checkpoint import read_metadata, safe_load

    stored = set(read_metadata(path).state_dict_metadata)
    has_base = any(k.startswith("model.") and "lora_" not in k for k in stored)  # else adapter-only
    if not has_base and not cfg.model.pretrained:
        raise ValueError(f"{path} holds no base weights and its config names no model.pretrained folder")
    model = build_model(cfg.model if not has_base else replace(cfg.model, pretrained=None))  # with its LoRA
    params = dict(model.named_parameters())
    state = {"model": {n: p.detach() for n, p in params.items() if f"model.{n}" in stored}}  # loads in place
    if ema:  # EMA covers the trainable parameters only (the adapter, under LoRA): overlay it on the raw weights
        state["ema"] = {n: torch.empty_like(p) for n, p in params.items() if f"ema.{n}" in stored}
        if not state["ema"]:
            raise ValueError(f"{path} holds no EMA weights (train with optim.ema_decay set)")
    safe_load(state, path)
    with torch.no_grad():
        for n, t in state.get("ema", {}).items():
            params[n].copy_(t)
    return model

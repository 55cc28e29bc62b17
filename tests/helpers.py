"""Shared test helpers: compose the Hydra config as train.py does, and run training in-process."""
from __future__ import annotations

import os

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONF = os.path.join(ROOT, "conf")
PRESETS = sorted(f[:-5] for f in os.listdir(os.path.join(CONF, "conf")) if f.endswith(".yaml"))


def compose_raw(overrides=()) -> dict:
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return OmegaConf.to_container(compose(config_name="train", overrides=list(overrides)), resolve=True)


def compose_config(overrides=()):
    from training.config import load_config

    return load_config(compose_raw(overrides))


def tiny_overrides(run_dir, cache_dir, *extra) -> list[str]:
    return [f"run_dir={run_dir}", f"data.cache_dir={cache_dir}", "logging.wandb=disabled", "train.progress=false",
            *extra]


def run_training(overrides):
    import train

    raw = compose_raw(overrides)
    cfg = train.load_config(raw)
    return cfg, train.run(cfg, OmegaConf.to_yaml(OmegaConf.create(raw)))

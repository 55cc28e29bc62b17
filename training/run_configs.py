"""What sets runs apart: the resolved config each run writes (run_dir/config.yaml, the same dict wandb gets as its
config), flattened to dotted keys, and the keys whose values differ between runs. Comparisons group and label runs
by these keys (scripts/compare_runs.py's table, scripts/wandb_report.py's default --group-by), so an LR sweep is
told apart by optim.lr and a strategy comparison by scheduling.strategy without being told which.

Keys that name a run rather than describe it (IDENTITY_KEYS: its name and folder, how it was started, where it logs)
differ between any two runs and are left out.
"""
from __future__ import annotations

import glob
import os
from typing import Any, Optional, Sequence

import yaml

CONFIG_FILE = "config.yaml"
IDENTITY_KEYS = ("name", "run_dir", "resume", "resume_force", "overwrite", "logging")  # a key or its subtree


def flatten(cfg: dict, prefix: str = "") -> dict[str, Any]:
    """{"optim": {"lr": 1e-3}} → {"optim.lr": 1e-3}; lists and scalars are leaves (None: {})."""
    out: dict[str, Any] = {}
    for k, v in (cfg or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def differing_keys(configs: Sequence[dict]) -> list[str]:
    """Dotted keys whose value is not the same in every config (a key missing from some counts as differing), in the
    order they first appear; IDENTITY_KEYS and keys starting with `_` left out. [] for fewer than two configs."""
    if len(configs) < 2:
        return []
    flat = [flatten(c) for c in configs]
    keys = list(dict.fromkeys(k for f in flat for k in f))
    missing = object()
    return [k for k in keys if k.split(".")[0] not in IDENTITY_KEYS and not k.startswith("_")  # wandb's own: _wandb
            and len({repr(f.get(k, missing)) for f in flat}) > 1]


def read_run_config(run_dir: str) -> Optional[dict]:
    """The resolved config a run wrote into its folder; None where there is none (a folder of metrics alone)."""
    path = os.path.join(run_dir, CONFIG_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        cfg = yaml.safe_load(f)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} is not a config (a YAML mapping): is {run_dir} a run folder?")
    return cfg


def group_run_dirs(group: str, root: str = "runs") -> list[str]:
    """The run folders under root whose config names wandb group `group` (logging.group: a -m sweep's name), sorted."""
    found = []
    for path in sorted(glob.glob(os.path.join(root, "*", CONFIG_FILE))):
        cfg = read_run_config(os.path.dirname(path))
        if cfg and (cfg.get("logging") or {}).get("group") == group:
            found.append(os.path.dirname(path))
    return found


def columns(configs: Sequence[Optional[dict]]) -> dict[str, list[str]]:
    """{key: [its value in each run, as text]} for every key that differs between the runs that have a config; "—"
    for a run without one or without the key."""
    have = [c for c in configs if c is not None]
    keys = differing_keys(have)
    flat = [flatten(c) if c is not None else {} for c in configs]
    return {k: [str(f[k]) if k in f else "—" for f in flat] for k in keys}

"""One metrics path: log_metrics(step, dict) → console/progress bar, run_dir/metrics.jsonl always, wandb when on.

Keys are namespaced as CONTRACTS §9 (`train/loss`, `perf/tokens_per_s`, `balance/compute_cv_pred`, ...); every
JSONL row carries `step` and `samples_seen`. Lists (per-micro-batch values such as `batch/S`) go to JSONL as they
are and to wandb as their mean.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from typing import Optional

WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class LoggingConfig:
    wandb: str = "offline"
    project: str = "adaptiveload"
    entity: Optional[str] = None

    def __post_init__(self):
        if self.wandb not in WANDB_MODES:
            raise ValueError(f"logging.wandb must be one of {WANDB_MODES}, got {self.wandb!r}")


@dataclass
class MetricsConfig:
    peak_tflops: Optional[float] = None   # the accelerator's dense bf16 peak, for perf/mfu (null on CPU)
    busy_every: int = 0                   # profile a step every N steps for measured busy time (0: never)
    profile_steps: Optional[tuple[int, int]] = None  # [first, last]: write a profiler trace for these steps

    def __post_init__(self):
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ValueError(f"metrics.peak_tflops must be > 0 or null, got {self.peak_tflops}")
        if self.busy_every < 0:
            raise ValueError(f"metrics.busy_every must be ≥ 0, got {self.busy_every}")
        if self.profile_steps is not None:
            self.profile_steps = tuple(self.profile_steps)
            if len(self.profile_steps) != 2 or not 0 <= self.profile_steps[0] <= self.profile_steps[1]:
                raise ValueError(f"metrics.profile_steps must be [first, last] steps with 0 ≤ first ≤ last, or null, "
                                 f"got {list(self.profile_steps)}")


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    return v


class MetricsLogger:
    def __init__(self, run_dir: str, cfg: LoggingConfig, name: str, config: dict, enabled: bool = True):
        self.enabled = enabled  # only rank 0 writes
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._file = open(self.path, "a") if enabled else None
        self._wandb = None
        mode = os.environ.get("WANDB_MODE", cfg.wandb)  # the environment wins, so tests can disable it
        if enabled and mode != "disabled":
            import wandb

            self._wandb = wandb.init(project=cfg.project, entity=cfg.entity, name=name, dir=run_dir, mode=mode,
                                     config=config, id=_run_id(run_dir), resume="allow")

    def log_metrics(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}, "time": time.time()}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: _scalar(v) for k, v in metrics.items() if _scalar(v) is not None}, step=step)

    def log_videos(self, step: int, videos: dict) -> None:
        """{key: mp4 path}: the paths to JSONL, wandb.Video(path) to wandb (it needs no moviepy from a path)."""
        if not self.enabled or not videos:
            return
        self._file.write(json.dumps({"step": step, **videos, "time": time.time()}) + "\n")
        self._file.flush()
        if self._wandb is not None:
            import wandb

            self._wandb.log({k: wandb.Video(p, format="mp4") for k, p in videos.items()}, step=step)

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _scalar(v):
    """wandb gets numbers; a list of numbers (per micro-batch) as its mean; strings and None are left out."""
    if isinstance(v, list):
        nums = [x for x in v if isinstance(x, (int, float)) and not isinstance(x, bool)]
        return sum(nums) / len(nums) if nums and len(nums) == len(v) else None
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _run_id(run_dir: str) -> str:
    """A stable wandb id per run_dir, so a resumed run continues the same wandb run."""
    path = os.path.join(run_dir, "wandb_id.txt")
    if os.path.exists(path):
        return open(path).read().strip()
    import uuid

    rid = uuid.uuid4().hex[:12]
    with open(path, "w") as f:
        f.write(rid)
    return rid


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]

"""Training metrics: the per-step row of docs/contracts.md §9, and the one path that logs it.

StepMetrics makes a step's row from the plan, every rank's timings and (sampled) busy times:
    perf/tokens_per_s, perf/samples_per_s   global real latent tokens / samples per wall second since warm-up
    perf/mfu                                model FLOPs of the step's micro-batches / (step s · world · peak)
    time/<k>, time/<k>_max                  rank 0's value and the max over ranks
    balance/*_pred                          from the cost model's prediction of every (rank, slot)
    balance/busy_cv, balance/idle_fraction  from measured busy time per (rank, slot), on profiled steps
    balance/step_time_cv                    CV over the last 50 steps of (step time ÷ the planner's predicted step
                                            time Σ_k max_r pred_rk): the variation the plan does not explain —
                                            stragglers, data stalls, clocks — not that of different batch tables

MetricsLogger is the one path: log_metrics(step, dict) → console/progress bar, run_dir/metrics.jsonl always, wandb
when on. Keys are namespaced as contracts §9 (`train/loss`, `perf/tokens_per_s`, `balance/compute_cv_pred`, ...);
every JSONL row carries `step` and `samples_seen`. Lists (per-micro-batch values such as `batch/S`) go to JSONL as
they are and to wandb as their mean.

A row is written whole or not at all: one `write` of the whole line (O_APPEND, never through a link); a full disk
cuts the file back to its last whole row and raises "no space left on <path>". A torn last line (a crash or full
disk of an older version mid-row) is cut off when the run resumes, and `read_metrics` skips a line that does not
parse; both with a warning.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from scheduling.efficiency import compute_cv, cv, idle_fraction, model_flops
from scheduling.planner import StepPlan
from scheduling.policy import ModelShape
from training.dist import DistContext
from training.run_folder import no_space, open_fd, open_in, read_text, write_whole
from training.step import StepStats

log = logging.getLogger(__name__)
WANDB_MODES = ("offline", "online", "disabled")
METRICS_FILE = "metrics.jsonl"


@dataclass
class LoggingConfig:
    RESUME_DEFAULT = "free"
    wandb: str = "offline"
    project: str = "adaptiveload"
    entity: Optional[str] = None
    group: Optional[str] = None    # wandb group: the runs of one comparison (a multirun sets the sweep's name)
    tags: list = field(default_factory=list)

    def __post_init__(self):
        if self.wandb not in WANDB_MODES:
            raise ValueError(f"logging.wandb must be one of {WANDB_MODES}, got {self.wandb!r}")
        self.tags = [str(t) for t in self.tags]


@dataclass
class MetricsConfig:
    RESUME_DEFAULT = "free"
    peak_tflops: Optional[float] = None   # the accelerator's dense bf16 peak, for perf/mfu (null on CPU)
    busy_every: Optional[int] = None      # profile a step every N steps for measured busy time (0: never; null:
                                          # BUSY_EVERY_MULTI on several processes, never on one)
    profile_steps: Optional[tuple[int, int]] = None  # [first, last]: write a profiler trace for these steps

    def __post_init__(self):
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ValueError(f"metrics.peak_tflops must be > 0 or null, got {self.peak_tflops}")
        if self.busy_every is not None and self.busy_every < 0:
            raise ValueError(f"metrics.busy_every must be ≥ 0, got {self.busy_every}")
        if self.profile_steps is not None:
            self.profile_steps = tuple(self.profile_steps)
            if len(self.profile_steps) != 2 or not 0 <= self.profile_steps[0] <= self.profile_steps[1]:
                raise ValueError(f"metrics.profile_steps must be [first, last] steps with 0 ≤ first ≤ last, or null, "
                                 f"got {list(self.profile_steps)}")


BUSY_EVERY_MULTI = 50  # the measured balance on several processes, by default: one profiled step in 50 (cheap)


def busy_every(cfg: MetricsConfig, world_size: int) -> int:
    return cfg.busy_every if cfg.busy_every is not None else (BUSY_EVERY_MULTI if world_size > 1 else 0)


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    return v


X_AXES = ("samples_seen", "tokens_seen")  # what runs with different batch tables are compared against
BY_SAMPLES = ("train/*", "val/*", "perf/*", "balance/*", "time/*", "memory/*", "data/*")


class MetricsLogger:
    """log_metrics(step, row): JSONL always, wandb when on. wandb gets the resolved config, the group, tags, and
    samples_seen / tokens_seen as x-axes (every namespaced metric plotted against samples_seen by default)."""

    def __init__(self, run_dir: str, cfg: LoggingConfig, name: str, config: dict, enabled: bool = True,
                 tags: tuple = ()):
        self.enabled = enabled  # only rank 0 writes
        self.path = os.path.join(run_dir, METRICS_FILE)
        self._fd = None
        if enabled:
            repair_torn_tail(run_dir)
            self._fd = open_fd(run_dir, METRICS_FILE, "a")
        self._wandb = None
        # the config's mode, unless WANDB_MODE is set (train.py sets it from a command-line logging choice, which
        # so beats the environment; tests set it to disabled)
        mode = os.environ.get("WANDB_MODE", cfg.wandb)
        if enabled and mode != "disabled":
            import wandb

            self._wandb = wandb.init(project=cfg.project, entity=cfg.entity, name=name, dir=run_dir, mode=mode,
                                     config=config, id=_run_id(run_dir), resume="allow", group=cfg.group,
                                     tags=sorted(set(tags) | set(cfg.tags)))
            for axis in X_AXES:
                self._wandb.define_metric(axis)
            for pattern in BY_SAMPLES:
                self._wandb.define_metric(pattern, step_metric="samples_seen")

    def log_metrics(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        self._append({"step": step, **{k: _clean(v) for k, v in metrics.items()}, "time": time.time()})
        if self._wandb is not None:
            self._wandb.log({k: _scalar(v) for k, v in metrics.items() if _scalar(v) is not None}, step=step)

    def log_videos(self, step: int, videos: dict) -> None:
        """{key: mp4 or png path}: the paths to JSONL; to wandb a wandb.Video(path) (it needs no moviepy from a
        path), or a wandb.Image for a png (the samples' contact sheet)."""
        if not self.enabled or not videos:
            return
        self._append({"step": step, **videos, "time": time.time()})
        if self._wandb is not None:
            import wandb

            self._wandb.log({k: wandb.Image(p) if p.endswith(".png") else wandb.Video(p, format="mp4")
                             for k, p in videos.items()}, step=step)

    def _append(self, row: dict) -> None:
        """One write of the whole line; a short or failed write is cut back so the file ends on a whole row."""
        line = (json.dumps(row) + "\n").encode()
        size = os.fstat(self._fd).st_size
        try:
            n = os.write(self._fd, line)
        except OSError as e:
            os.ftruncate(self._fd, size)
            raise (no_space(e, self.path) or e) from None
        if n != len(line):
            os.ftruncate(self._fd, size)
            raise OSError(f"{self.path}: a row was written in part ({n} of {len(line)} bytes; cut back)")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
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
    if os.path.lexists(os.path.join(run_dir, "wandb_id.txt")):
        return read_text(run_dir, "wandb_id.txt").strip()
    import uuid

    rid = uuid.uuid4().hex[:12]
    write_whole(run_dir, "wandb_id.txt", rid)
    return rid


def repair_torn_tail(run_dir: str) -> None:
    """Cut metrics.jsonl back to its last whole line (one a crash or a full disk tore), with a warning."""
    if not os.path.lexists(os.path.join(run_dir, METRICS_FILE)):
        return
    fd = open_fd(run_dir, METRICS_FILE, "r+")
    try:
        size = os.fstat(fd).st_size
        end, chunk = size, 1 << 16
        while end > 0:  # the last newline, read backwards
            start = max(0, end - chunk)
            at = os.pread(fd, end - start, start).rfind(b"\n")
            if at >= 0:
                end = start + at + 1
                break
            end = start
        if end < size:
            log.warning("%s: its last line was torn (%d bytes without a newline, a crash or a full disk mid-row): "
                        "cut off", os.path.join(run_dir, METRICS_FILE), size - end)
            os.ftruncate(fd, end)
    finally:
        os.close(fd)


def read_metrics(run_dir: str) -> list[dict]:
    """The rows of run_dir/metrics.jsonl in file order; a line that does not parse as a JSON row (torn by a crash
    or a full disk) is skipped with a warning."""
    rows, bad = [], []
    with open_in(run_dir, METRICS_FILE, "rb") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if isinstance(row, dict) and "step" in row:
                rows.append(row)
            else:
                bad.append(i)
    if bad:
        log.warning("%s: %d line(s) that are not whole rows skipped (line %s): torn by a crash or a full disk",
                    os.path.join(run_dir, METRICS_FILE), len(bad), ", ".join(map(str, bad[:5])))
    return rows


TIMINGS = ("step_s", "data_wait_s", "fwd_s", "bwd_s", "optim_s")


def allocator_stats(device: torch.device) -> dict:
    """The CUDA caching allocator's signs of fragmentation, for the step's metrics ({} off CUDA): its peak reserved
    memory, and how many times so far a cudaMalloc failed and it freed its cached blocks to retry — a retry
    synchronises the device, which leaves the GPU idle until the host has launched work again."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {"memory/reserved_peak_gib": torch.cuda.max_memory_reserved(device) / 2**30,
            "memory/alloc_retries": float(stats.get("num_alloc_retries", 0))}


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class StepMetrics:
    def __init__(self, ctx: DistContext, shape: ModelShape, peak_tflops: Optional[float], warmup_steps: int = 3,
                 sample_flops: Optional[Callable[[int], float]] = None):
        """sample_flops(S): one sample's training FLOPs where the model counts them itself (the MMDiT's joint
        attention, which the contract's formula undercounts); default: the formula above."""
        self.ctx, self.shape, self.peak_tflops, self.warmup = ctx, shape, peak_tflops, warmup_steps
        s = shape
        self.sample_flops = functools.lru_cache(maxsize=None)(
            sample_flops or (lambda S: model_flops(1, S, s.text_len, s.p_matmul, s.layers, s.dim)))
        self.step_times: deque = deque(maxlen=50)
        self.step_ratios: deque = deque(maxlen=50)  # measured ÷ predicted step time (balance/step_time_cv)
        self.t0: Optional[float] = None
        self.tokens = self.samples = 0
        self.steps_here = 0  # steps run by this process: a resumed run warms up too

    def row(self, step: int, plan: StepPlan, st: StepStats, step_s: float, busy: Optional[list]) -> dict:
        ctx = self.ctx
        gathered = ctx.all_gather_floats([step_s, st.data_wait_s, st.fwd_s, st.bwd_s, st.optim_s, st.loss_sum])
        self.step_times.append(float(gathered[:, 0].max()))
        now = time.perf_counter()
        self.steps_here += 1
        if self.steps_here == self.warmup:
            self.t0, self.tokens, self.samples = now, 0, 0
        elif self.t0 is not None:
            self.tokens += plan.tokens
            self.samples += plan.num_samples
        elapsed = now - self.t0 if self.t0 is not None else 0.0
        flops = sum(mb.num_real * self.sample_flops(mb.S) for r in plan.ranks for mb in r)
        pred = plan.pred_ms()
        pred_s = float(pred.max(axis=0).sum()) / 1e3 if pred.size else 0.0
        if pred_s > 0:
            self.step_ratios.append(self.step_times[-1] / pred_s)
        m = {"train/loss": float(gathered[:, 5].sum()) / max(1, plan.num_samples),
             "train/grad_norm": st.grad_norm,
             "perf/tokens_per_s": self.tokens / elapsed if self.tokens else None,
             "perf/samples_per_s": self.samples / elapsed if self.samples else None,
             "perf/mfu": (flops / (self.step_times[-1] * ctx.world_size * self.peak_tflops * 1e12)
                          if self.peak_tflops and ctx.device.type == "cuda" else None),
             "balance/compute_cv_pred": compute_cv(pred), "balance/idle_fraction_pred": idle_fraction(pred, plan.real()),
             "balance/step_time_cv": cv(self.step_ratios),
             "batch/S": st.S, "batch/B": st.B, "batch/bucket": st.buckets}
        memory = {"memory/peak_gib": peak_memory_gib(ctx.device), **allocator_stats(ctx.device)}
        m.update(zip(memory, ctx.all_gather_floats(list(memory.values())).max(0).values.tolist()))  # one collective
        for i, k in enumerate(TIMINGS):
            m[f"time/{k}"], m[f"time/{k}_max"] = float(gathered[0, i]), float(gathered[:, i].max())
        if busy is not None:
            busy_RM = ctx.all_gather_floats(busy).numpy()
            m["balance/busy_cv"] = compute_cv(busy_RM)
            m["balance/idle_fraction"] = idle_fraction(busy_RM, plan.real())
            m["time/busy_s"] = float(np.sum(busy_RM[0]))
        return m

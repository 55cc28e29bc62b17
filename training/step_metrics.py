"""The per-step metrics row of CONTRACTS §9, from the plan, every rank's timings and (sampled) busy times.

    perf/tokens_per_s, perf/samples_per_s   global real latent tokens / samples per wall second since warm-up
    perf/mfu                                model FLOPs of the step's micro-batches / (step s · world · peak)
    time/<k>, time/<k>_max                  rank 0's value and the max over ranks
    balance/*_pred                          from the cost model's prediction of every (rank, slot)
    balance/busy_cv, balance/idle_fraction  from measured busy time per (rank, slot), on profiled steps
    balance/step_time_cv                    CV of the step time over the last 50 steps
"""
from __future__ import annotations

import functools
import time
from collections import deque
from typing import Callable, Optional

import numpy as np
import torch

from scheduling.balance import StepPlan
from scheduling.metrics import compute_cv, cv, idle_fraction, model_flops
from scheduling.policy import ModelShape
from training.dist import DistContext
from training.step import StepStats

TIMINGS = ("step_s", "data_wait_s", "fwd_s", "bwd_s", "optim_s")


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
        m = {"train/loss": float(gathered[:, 5].sum()) / max(1, plan.num_samples),
             "train/grad_norm": st.grad_norm,
             "perf/tokens_per_s": self.tokens / elapsed if self.tokens else None,
             "perf/samples_per_s": self.samples / elapsed if self.samples else None,
             "perf/mfu": (flops / (self.step_times[-1] * ctx.world_size * self.peak_tflops * 1e12)
                          if self.peak_tflops and ctx.device.type == "cuda" else None),
             "balance/compute_cv_pred": compute_cv(pred), "balance/idle_fraction_pred": idle_fraction(pred, plan.real()),
             "balance/step_time_cv": cv(self.step_times),
             "batch/S": st.S, "batch/B": st.B, "batch/bucket": st.buckets,
             "memory/peak_gib": ctx.all_reduce_max(peak_memory_gib(ctx.device))}
        for i, k in enumerate(TIMINGS):
            m[f"time/{k}"], m[f"time/{k}_max"] = float(gathered[0, i]), float(gathered[:, i].max())
        if busy is not None:
            busy_RM = ctx.all_gather_floats(busy).numpy()
            m["balance/busy_cv"] = compute_cv(busy_RM)
            m["balance/idle_fraction"] = idle_fraction(busy_RM, plan.real())
            m["time/busy_s"] = float(np.sum(busy_RM[0]))
        return m

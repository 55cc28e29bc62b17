"""One optimizer step over this rank's micro-batches, and the fixed validation loss.

Loss normalisation (CONTRACTS §3): Σ per-sample losses · loss_weight / (real samples in the whole step, all ranks
and slots), multiplied by world_size before backward, so the data-parallel gradient average is the global mean.
A NaN/Inf loss or gradient norm skips the update (every rank agrees: both are global).
"""
from __future__ import annotations

import contextlib
import gc
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from data.batch import Batch
from models.flow_matching import VAL_TIMES, FlowMatching, keyed_generator
from training.dist import DistContext


@dataclass
class StepStats:
    loss_sum: float = 0.0       # Σ per-sample loss · weight on this rank
    grad_norm: float = float("nan")
    skipped: bool = False
    data_wait_s: float = 0.0
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    optim_s: float = 0.0
    S: list = field(default_factory=list)
    B: list = field(default_factory=list)
    buckets: list = field(default_factory=list)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast_for(device: torch.device, precision: str):
    if device.type == "cuda" and precision == "bf16":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


def train_step(model, objective: FlowMatching, batches: Iterable[Batch], num_samples: int, ctx: DistContext,
               optimizer, scheduler, ema, grad_clip: float, seed: int, epoch: int,
               checkpoint_policy: Callable[[int, int], bool], autocast, model_inputs=lambda batch: {}) -> StepStats:
    """model_inputs(batch) → the model's extra keyword inputs (models.build.model_inputs: MMDiT's mask, pooled)."""
    st = StepStats()
    scale = ctx.world_size / max(1, num_samples)
    loss_sum = torch.zeros((), device=ctx.device)
    for k, batch in enumerate(batches):
        with torch.profiler.record_function(f"slot{k}"):  # busy time per slot is read from these ranges
            st.data_wait_s += batch.data_wait_s
            st.S.append(batch.S), st.B.append(batch.B), st.buckets.append(batch.bucket)
            t, noise = objective.draw(batch.keys, batch.latents.shape[1:], seed, epoch)
            batch = batch.to(ctx.device)
            t, noise = t.to(ctx.device), noise.to(ctx.device)
            decision = checkpoint_policy(batch.B, batch.S)  # k, or (k, blocks keeping attention)
            model.set_activation_checkpointing(*(decision if isinstance(decision, tuple) else (decision,)))
            _sync(ctx.device)
            t0 = time.perf_counter()
            with autocast():
                per_sample = objective.per_sample_loss(model, batch.latents, batch.text, t, noise,
                                                       **model_inputs(batch))
            weighted = (per_sample * batch.loss_weight).sum()
            _sync(ctx.device)
            t1 = time.perf_counter()
            (weighted * scale).backward()
            _sync(ctx.device)
            st.fwd_s += t1 - t0
            st.bwd_s += time.perf_counter() - t1
            loss_sum += weighted.detach()
    t0 = time.perf_counter()
    st.loss_sum = float(loss_sum)
    params = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    st.grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total_loss = ctx.all_gather_floats([st.loss_sum]).sum().item()
    if math.isfinite(total_loss) and math.isfinite(st.grad_norm):
        optimizer.step()
        if ema is not None:
            ema.update(model)
    else:
        st.skipped = True
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    _sync(ctx.device)
    st.optim_s = time.perf_counter() - t0
    return st


@torch.no_grad()
def validation_loss(model, objective: FlowMatching, batches: list[Batch], ctx: DistContext, seed: int,
                    autocast, model_inputs=lambda batch: {}) -> float:
    """Flow-matching loss on the fixed held-out batches at fixed t ∈ VAL_TIMES and fixed noise: deterministic."""
    was_training = model.training
    model.eval()
    model.set_activation_checkpointing(False)
    total, count = 0.0, 0
    for batch in batches:
        noise = torch.stack([torch.randn(tuple(batch.latents.shape[1:]), generator=keyed_generator(seed, "val", k))
                             for k in batch.keys]).to(ctx.device)
        b = batch.to(ctx.device)
        for tv in VAL_TIMES:
            t = torch.full((b.B,), tv, device=ctx.device)
            with autocast():
                total += float(objective.per_sample_loss(model, b.latents, b.text, t, noise, **model_inputs(b)).sum())
            count += b.B
    model.train(was_training)
    return total / max(1, count)


FULL_EVERY_TICKS = 10  # every 10th collection also sweeps the oldest generation


@contextlib.contextmanager
def collector_every(every: int):
    """Python's garbage collector paused and run between steps, every `every` steps (generations 0 and 1; every
    FULL_EVERY_TICKS-th time all three, so that cycles which lived long before dying are freed too), instead of
    whenever its allocation counters say: a collection inside a step stalls the GPU's queue (on the H200 a Wan 1.3B
    step at S = 1560 took 671–1261 ms with it, 620–628 ms without; results/step_h200.md), and on many ranks each
    one's at another step. Yields tick(step), called after each step. every = 0: Python's own schedule."""
    if every <= 0:
        yield lambda step: None
        return

    def tick(step: int) -> None:
        if step % every == 0:
            gc.collect() if step % (every * FULL_EVERY_TICKS) == 0 else gc.collect(1)

    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield tick
    finally:
        if was_enabled:
            gc.enable()

"""One optimizer step over this rank's micro-batches, and the fixed validation loss.

Loss normalisation (contracts §3): Σ per-sample losses · loss_weight / loss_norm, multiplied by world_size before
backward, so the data-parallel gradient average is Σ over the step's samples / loss_norm. loss_norm is the plan's
(StepPlan.loss_norm): the real samples in the whole step (all ranks and slots) — the step's per-sample mean — for
a one-step planner (stream, sorted); for planner=windowed the window's real samples ÷ its W steps, the same for
every step of the window, so that a sample weighs 1 / loss_norm whichever step of the window it lands in (a
window's steps hold very different counts, and dividing by each step's own would up-weight the samples of the
small steps).
A NaN/Inf loss or gradient norm skips the update (every rank agrees: both are global).
"""
from __future__ import annotations

import contextlib
import gc
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import torch

from data.batch import Batch
from data.keys import keyed_generator
from models.flow_matching import VAL_TIMES, FlowMatching
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
    mb_s: list = field(default_factory=list)   # forward + backward seconds of each micro-batch, in order
    S: list = field(default_factory=list)
    B: list = field(default_factory=list)
    buckets: list = field(default_factory=list)


@dataclass
class TrainParts:
    """What every step uses, made once by the trainer: the model and its objective, the optimizer with its LR
    schedule and EMA, the process group, the precision, the per-micro-batch recompute decision, the model's extra
    inputs and the micro-batch graphs."""
    model: torch.nn.Module
    objective: FlowMatching
    optimizer: torch.optim.Optimizer
    scheduler: object
    ctx: DistContext
    seed: int
    grad_clip: float = 0.0
    ema: object = None
    checkpoint_policy: Callable[[int, int], object] = lambda B, S: False
    autocast: Callable = contextlib.nullcontext
    model_inputs: Callable[[Batch], dict] = lambda batch: {}
    graphs: object = None   # training.cuda_graphs.MicroBatchGraphs, or None: eager


def autocast_for(device: torch.device, precision: str, cache: bool = True):
    """The autocast context factory of a run. cache=False turns off autocast's weight-cast cache, which CUDA graph
    captures require (the numbers are the same: the cache only saves repeating a cast)."""
    if device.type == "cuda" and precision == "bf16":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=cache)
    return contextlib.nullcontext


class _Clock:
    """Forward and backward seconds of each micro-batch without a host sync inside the step: CUDA events read once
    at its end (graph replays mark the forward's end with an event captured in the graph); perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def now(self, external: bool = False):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True, external=external)
        ev.record()
        return ev

    def add(self, start, mid, end) -> None:
        self.marks.append((start, mid, end))

    def each(self) -> list[float]:
        """Seconds of each micro-batch, forward + backward, in order (after the step's sync on a GPU)."""
        if not self.cuda:
            return [end - start for start, _, end in self.marks]
        return [start.elapsed_time(end) / 1e3 for start, _, end in self.marks]

    def totals(self) -> tuple[float, float]:
        if not self.cuda:
            return (sum(m - s for s, m, _ in self.marks), sum(e - m for _, m, e in self.marks))
        # a graph replayed twice in a step re-records its one mark: the last replay's share of forward serves all
        fwd = bwd = 0.0
        share: dict[int, float] = {}
        for start, mid, end in reversed(self.marks):
            whole = start.elapsed_time(end) / 1e3
            if id(mid) not in share:
                share[id(mid)] = min(1.0, start.elapsed_time(mid) / 1e3 / whole) if whole > 0 else 0.5
            fwd, bwd = fwd + whole * share[id(mid)], bwd + whole * (1 - share[id(mid)])
        return fwd, bwd


def draw_t_noise(objective: FlowMatching, keys: Sequence[str], shape: Sequence[int], seed: int,
                 epoch) -> tuple[torch.Tensor, torch.Tensor]:
    """(t [B], noise [B, *shape]) for these sample keys, on the CPU in fp32: per key, one generator keyed by
    (seed, epoch, key) draws t (the objective's distribution), then the noise (docs/contracts.md §5)."""
    ts, noise = [], []
    for key in keys:
        g = keyed_generator(seed, epoch, key)
        ts.append(objective.sample_t(g))
        noise.append(torch.randn(tuple(shape), generator=g))
    return torch.stack(ts), torch.stack(noise)


def train_step(parts: TrainParts, batches: Iterable[Batch], loss_norm: float, epoch: int) -> StepStats:
    """One optimizer step over this rank's micro-batches; loss_norm: what the loss sum divides by (the plan's
    loss_norm: real samples in the whole step, all ranks, or a window's mean a step; see the module docstring).
    With parts.graphs each (bucket shape, B, recompute decision) is replayed after its first eager run; parameter
    gradients then stay allocated between steps (zeroed in place)."""
    model, objective, optimizer, scheduler, ema, ctx = (parts.model, parts.objective, parts.optimizer,
                                                        parts.scheduler, parts.ema, parts.ctx)
    seed, grad_clip, checkpoint_policy, autocast, model_inputs, graphs = (
        parts.seed, parts.grad_clip, parts.checkpoint_policy, parts.autocast, parts.model_inputs, parts.graphs)
    st = StepStats()
    dev = ctx.device
    loss_sum = torch.zeros((), device=dev) if graphs is None else \
        graphs.buffer("loss_sum", lambda: torch.zeros((), device=dev)).zero_()
    scale = torch.full((), ctx.world_size / max(1, loss_norm))
    clock = _Clock(dev)
    if graphs is not None:  # replays accumulate into these very tensors
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    for k, batch in enumerate(batches):
        with torch.profiler.record_function(f"slot{k}"):  # busy time per slot is read from these ranges
            st.data_wait_s += batch.data_wait_s
            st.S.append(batch.S), st.B.append(batch.B), st.buckets.append(batch.bucket)
            t, noise = draw_t_noise(objective, batch.keys, batch.latents.shape[1:], seed, epoch)
            decision = checkpoint_policy(batch.B, batch.S)  # k, or (k, blocks keeping attention)
            model.set_activation_checkpointing(*(decision if isinstance(decision, tuple) else (decision,)))
            inputs = {"latents": batch.latents, "text": batch.text, "loss_weight": batch.loss_weight, "t": t,
                      "noise": noise, "scale": scale}
            cond = {n: v for n, v in model_inputs(batch).items() if v is not None}
            extra = {f"extra.{n}": v for n, v in cond.items() if isinstance(v, torch.Tensor)}
            fixed = {n: v for n, v in cond.items() if not isinstance(v, torch.Tensor)}  # part of the graph's key
            inputs.update(extra)
            if dev.type == "cuda":  # page-locked: the copies below then return at once instead of waiting
                inputs = {n: v.pin_memory() if v.device.type == "cpu" else v for n, v in inputs.items()}
            key = graph_key(batch, decision, extra, fixed)
            # where the forward's end is marked: a graph's replays re-record the event its capture made there
            mark = graphs.marks.setdefault(key, {}) if graphs is not None else {}

            def micro_batch(x: dict, external: bool = False) -> None:
                kw = {n[len("extra."):]: v for n, v in x.items() if n.startswith("extra.")} | fixed
                with autocast():
                    per_sample = objective.per_sample_loss(model, x["latents"], x["text"], x["t"], x["noise"], **kw)
                weighted = (per_sample * x["loss_weight"]).sum()
                mark["ev"] = clock.now(external)
                (weighted * x["scale"]).backward()
                loss_sum.add_(weighted.detach())

            start = clock.now()
            if graphs is None:
                micro_batch({n: v.to(dev, non_blocking=True) for n, v in inputs.items()})
            else:
                graphs.run(key, batch.B * batch.S, lambda x: micro_batch(x, external=dev.type == "cuda"), inputs)
            clock.add(start, mark.get("ev"), clock.now())
    t0 = time.perf_counter()
    st.fwd_s, st.bwd_s = (0.0, 0.0) if clock.cuda else clock.totals()
    params = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    st.loss_sum, st.grad_norm = torch.stack([loss_sum.float(), norm.float()]).tolist()  # the step's one host sync
    if clock.cuda:
        st.fwd_s, st.bwd_s = clock.totals()
    st.mb_s = clock.each()
    total_loss = ctx.all_gather_floats([st.loss_sum]).sum().item()
    if math.isfinite(total_loss) and math.isfinite(st.grad_norm):
        optimizer.step()
        if ema is not None:
            ema.update(model)
    else:
        st.skipped = True
    scheduler.step()
    optimizer.zero_grad(set_to_none=graphs is None)
    # On a GPU the optimizer's kernels are left running: the host goes on to the next step's data meanwhile.
    # optim_s is then the host's time from the end of the micro-batches to the update being issued.
    st.optim_s = time.perf_counter() - t0
    return st


def graph_key(batch, decision, extra: dict, fixed: dict) -> tuple:
    """The CUDA graph a micro-batch replays: its bucket, shapes, recompute decision, which tensors it feeds and the
    model's non-tensor inputs, but of the MMDiT's text_span only (keep, masked, whether rows are known): a capture
    runs the mask (models/mmdit.py), so the rows' lengths would only split one graph into a graph per pattern."""
    fixed = {n: (tuple(v[:2]) + (v[2] is not None,) if n == "text_span" and v is not None and len(v) > 2 else v)
             for n, v in fixed.items()}
    return (batch.bucket, tuple(batch.latents.shape), tuple(batch.text.shape), str(decision), tuple(sorted(extra)),
            tuple(sorted(fixed.items())))


@torch.no_grad()
def validation_loss(parts: TrainParts, batches: list[Batch]) -> Optional[float]:
    """Flow-matching loss on the fixed held-out batches at fixed t ∈ VAL_TIMES and fixed noise: deterministic.
    None when there is no held-out sample to average (a 0.0 would read as a perfect model)."""
    model, objective, ctx, seed, autocast, model_inputs = (parts.model, parts.objective, parts.ctx, parts.seed,
                                                           parts.autocast, parts.model_inputs)
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
    return total / count if count else None


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

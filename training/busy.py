"""Measured busy time per micro-batch slot, from profiler traces (docs/contracts.md §9: balance/busy_cv, idle_fraction).

Under FSDP2 every rank waits inside every micro-batch (all-gathers before each block, reduce-scatters after), so
wall-clock timings of a slot look the same on every rank. The busy time is what is left when the waits are taken
out:
    GPU: the union of the slot's kernel intervals, NCCL kernels excluded
    CPU: the slot's wall time on the main thread minus the union of its communication ranges
         (FSDP::all_gather / post_backward_reduce, c10d::*, gloo:*, waits)
Each slot of a step runs inside `record_function("slot{k}")` (training/step.py).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

COMM = re.compile(r"^(FSDP::all_gather|FSDP::post_backward_reduce|FSDP::root_post_backward|c10d::|gloo:|nccl|"
                  r"record_param_comms)|wait", re.IGNORECASE)
SLOT = re.compile(r"^slot(\d+)$")


def _union(intervals) -> float:
    total, cur = 0.0, None
    for a, b in sorted(intervals):
        if cur is None or a > cur[1]:
            if cur is not None:
                total += cur[1] - cur[0]
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    return total + (cur[1] - cur[0] if cur is not None else 0.0)


KERNEL_KINDS = (("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
                ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "splitk")),
                ("optimizer", ("adam", "multi_tensor_apply")),
                # our Triton kernels by their exact names (aten's elementwise kernels also end in "_kernel")
                ("ours (triton)", ("_fwd_kernel", "_bwd_kernel", "_dmod_dtile_kernel", "_gelu_act_grad_kernel")))


def kernel_kind(name: str) -> str:
    """attention | gemm | optimizer (AdamW's fused or foreach kernels) | ours (triton) | other (aten's elementwise,
    norms, reductions, copies, memsets)."""
    low = name.lower()
    kind = next((k for k, pats in KERNEL_KINDS[:3] if any(p in low for p in pats)), None)
    return kind or ("ours (triton)" if name in KERNEL_KINDS[3][1] else "other")


def step_split(events) -> dict:
    """Where a traced step's device time went, in ms: each kernel kind's time, the span from the first kernel's
    start to the last one's end, and the GPU's idle time inside it (the span less the union of the kernels: the
    host behind, a sync, the data), with the longest gaps as [ms, kernel before, kernel after]."""
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                     if e.device_type == DeviceType.CUDA and not SLOT.match(e.name)
                     and not getattr(e, "is_user_annotation", False))  # a range's GPU span (AdamW.step's) is no kernel
    if not kernels:
        return {}
    kinds: dict = {}
    for a, b, name in kernels:
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + (b - a) / 1e3
    span = (max(b for _, b, _ in kernels) - kernels[0][0]) / 1e3
    gaps, end = [], kernels[0][1]
    for (a, b, name), prev in zip(kernels[1:], kernels):
        if a > end:
            gaps.append(((a - end) / 1e3, prev[2][:60], name[:60]))
        end = max(end, b)
    busy = _union((a, b) for a, b, _ in kernels) / 1e3
    return {"span_ms": round(span, 2), "busy_ms": round(busy, 2), "idle_ms": round(span - busy, 2),
            **{f"{k}_ms": round(v, 2) for k, v in sorted(kinds.items())},
            "top_gaps": [[round(g, 2), a, b] for g, a, b in sorted(gaps, reverse=True)[:8]]}


def busy_per_slot(events, num_slots: int) -> list[float]:
    """Seconds of compute per slot from a profiler's events (`prof.events()`)."""
    cpu_slots, gpu_slots = {}, {}
    for e in events:
        m = SLOT.match(e.name)
        if m:
            (gpu_slots if e.device_type == DeviceType.CUDA else cpu_slots)[int(m.group(1))] = e
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not SLOT.match(e.name)
               and "nccl" not in e.name.lower()]
    out = []
    for k in range(num_slots):
        if kernels and k in gpu_slots:
            lo, hi = gpu_slots[k].time_range.start, gpu_slots[k].time_range.end
            busy = _union((max(lo, e.time_range.start), min(hi, e.time_range.end)) for e in kernels
                          if e.time_range.end > lo and e.time_range.start < hi)
        elif k in cpu_slots:
            s = cpu_slots[k]
            lo, hi = s.time_range.start, s.time_range.end
            waits = _union((max(lo, e.time_range.start), min(hi, e.time_range.end)) for e in events
                           if e.thread == s.thread and e.device_type == DeviceType.CPU and COMM.search(e.name)
                           and e.time_range.end > lo and e.time_range.start < hi)
            busy = hi - lo - waits
        else:
            busy = 0.0
        out.append(busy / 1e6)  # profiler times are in µs
    return out


class StepProfiler:
    """Profiles the steps that need it: every `busy_every` steps (busy time) and the `profile_steps` range (trace)."""

    def __init__(self, busy_every: int, profile_steps, trace_dir: str, rank: int):
        self.busy_every, self.trace_dir, self.rank = busy_every, trace_dir, rank
        self.trace_range = tuple(profile_steps) if profile_steps else None
        self.prof = None

    def wants(self, step: int) -> bool:
        busy = self.busy_every > 0 and step % self.busy_every == 0
        trace = self.trace_range is not None and self.trace_range[0] <= step <= self.trace_range[-1]
        return busy or trace

    def context(self, step: int):
        if not self.wants(step):
            self.prof = None
            return contextlib.nullcontext()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.prof = profile(activities=acts)
        return self.prof

    def finish(self, step: int, num_slots: int) -> list[float] | None:
        """Busy seconds per slot of the step just profiled (None when it was not), and its trace if asked."""
        if self.prof is None:
            return None
        if self.trace_range is not None and self.trace_range[0] <= step <= self.trace_range[-1]:
            os.makedirs(self.trace_dir, exist_ok=True)
            self.prof.export_chrome_trace(os.path.join(self.trace_dir, f"step{step}_rank{self.rank}.json"))
            with open(os.path.join(self.trace_dir, f"step{step}_rank{self.rank}_split.json"), "w") as f:
                json.dump(step_split(self.prof.events()), f, indent=1)
        busy = busy_per_slot(self.prof.events(), num_slots)
        self.prof = None
        self._stopped_at = time.monotonic()
        return busy

    SETTLE_S = 1.0

    def settle(self) -> None:
        """Call before the process exits: waits until SETTLE_S has passed since the last profile stopped.

        A 2-rank gloo worker (torch 2.13, CPU) that exited right after its profiled step aborted in 1 of 16 and 1 of
        6 runs ("terminate called without an active exception": a profiler thread still joinable at teardown); with
        the same worker waiting 1 s, 0 of 30. A second at the end of a run that profiled its last steps."""
        stopped = getattr(self, "_stopped_at", None)
        if stopped is not None:
            time.sleep(max(0.0, self.SETTLE_S - (time.monotonic() - stopped)))

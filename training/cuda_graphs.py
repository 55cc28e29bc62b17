"""Whole micro-batches as CUDA graphs: forward, loss, activation recompute and backward in one replay.

A small micro-batch (one 480p image on Wan 1.3B) takes tens of milliseconds of kernels but hundreds of
milliseconds of host work: Python, autograd, the checkpoint's recompute, Triton's launcher. Bucket shapes are
static, so each (bucket shape, B, recompute decision) is captured once and replayed: the host then pays one
launch per micro-batch (results/small_step_h200.md has the profile and the times).

    graphs = MicroBatchGraphs(device, max_tokens=...)
    graphs.run(key, tokens, fn, inputs)     # fn(inputs) -> None runs forward + backward on the tensors it is given

How it stays exact:
- `fn` must read only `inputs` (copied into static buffers before each replay) and module state, and must leave
  every result in tensors that outlive it: parameter gradients (allocated before the first capture and zeroed in
  place between steps, so a replay accumulates into them as eager backward does) and accumulators passed in
  `inputs` or closed over (e.g. a running loss sum added to in place). Nothing it returns is used.
- The first `warmup` runs of a key are eager (they are real micro-batches): they compile Triton kernels, pick
  cuBLAS algorithms and create the capture stream's handles, none of which may happen inside a capture.
- Every graph allocates from one shared memory pool. That is safe because no graph leaves a live tensor in the
  pool (the rule above) and replays never overlap: each replay's intermediates are dead when it ends, so the next
  graph may reuse the same memory. Captured largest first, every later graph fits in what the first freed, so the
  pool is the largest graph's activations, not their sum; captured smallest first, each one adds most of its own.
  So a key with more tokens than every captured one drops the graphs (they are recaptured, without warm-up, when
  next used) and is captured first in a fresh pool.
- Autocast's weight-cast cache must be off inside a capture (`autocast(cache_enabled=False)`); the caller's
  autocast factory takes care of it.
- scheduling.planner=reformed makes (bucket, B) vary from step to step (B up to the memory bound, not the batch
  table's): each new key costs one eager run and one capture, and a new largest key a recapture of the others.
- A capture that fails (a host sync inside `fn`, an op that cannot be captured) leaves that key eager for the rest
  of the run, with one log line; so do keys over `max_tokens` tokens, where kernels outlast the host anyway.

`FakeGraphs` replays by calling `fn` on the static buffers again: the CPU tests check the plumbing with it.
"""
from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional

import torch

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    seen: int = 0
    tokens: int = 0
    graph: Any = None
    statics: Optional[dict] = None
    failed: bool = False
    pool_bytes: int = 0          # bytes the capture added to the shared pool


@dataclass
class GraphStats:
    captured: int = 0
    replays: int = 0
    eager: int = 0
    failed: int = 0
    recaptures: int = 0          # times a larger key dropped the graphs to be captured first
    pool_bytes: dict = field(default_factory=dict)   # key → bytes its capture added to the shared pool


class MicroBatchGraphs:
    def __init__(self, device: torch.device, warmup: int = 1, max_tokens: Optional[int] = None):
        self.device, self.warmup, self.max_tokens = device, warmup, max_tokens
        self.entries: dict[Hashable, _Entry] = {}
        self.marks: dict[Hashable, dict] = {}  # per key, what the captured function records (timing events)
        self.stats = GraphStats()
        self.pool_bytes = 0  # the shared pool after the last capture
        self._buffers: dict[str, torch.Tensor] = {}
        self._pool = None
        self._stream = None

    def buffer(self, name: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A tensor that lives as long as the graphs, made once: what a captured function accumulates into (a
        tensor made anew each step would leave the graphs writing to freed memory)."""
        if name not in self._buffers:
            self._buffers[name] = make()
        return self._buffers[name]

    # The hooks a test double overrides.
    def _new_graph(self):
        return torch.cuda.CUDAGraph()

    def _capture(self, graph, fn: Callable, statics: dict) -> None:
        if self._pool is None:
            self._pool, self._stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(self.device)
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
            fn(statics)

    def _replay(self, graph, fn: Callable, statics: dict) -> None:
        graph.replay()

    def _reserved(self) -> int:
        """Bytes the allocator holds for the graphs' pool (its segments in the allocator's snapshot)."""
        if self._pool is None:
            return 0
        segments = torch.cuda.memory._snapshot(self.device)["segments"]
        return sum(seg["total_size"] for seg in segments if tuple(seg.get("segment_pool_id", ())) == tuple(self._pool))

    def _eager(self, fn: Callable, inputs: dict) -> None:
        """Warm-up runs go through the stream the captures use, so its lazily created handles exist first."""
        if self._stream is None:
            self._pool, self._stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            fn(inputs)
        torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def wants_capture(self, key: Hashable, tokens: int) -> bool:
        """Whether `key` would still run eagerly or be captured before its first replay (a caller that times
        micro-batches runs those first, untimed)."""
        e = self.entries.get(key)
        eligible = self.max_tokens is None or tokens <= self.max_tokens
        return eligible and (e is None or (e.graph is None and not e.failed))

    def run(self, key: Hashable, tokens: int, fn: Callable[[dict], None], inputs: dict[str, torch.Tensor]) -> bool:
        """Run fn(inputs) for this micro-batch: replayed when `key` has a graph, else eagerly (capturing it once
        its warm-up is done). Returns True when a graph ran it."""
        e = self.entries.setdefault(key, _Entry())
        within = self.max_tokens is None or tokens <= self.max_tokens  # the cap may have narrowed since a capture
        if e.graph is not None and within:
            for name, t in inputs.items():
                e.statics[name].copy_(t, non_blocking=True)
            self._replay(e.graph, fn, e.statics)
            self.stats.replays += 1
            return True
        eligible = not e.failed and within
        if not eligible or e.seen < self.warmup:
            e.seen += 1
            self.stats.eager += 1
            on_device = {name: t.to(self.device, non_blocking=True) for name, t in inputs.items()}
            (self._eager if eligible else lambda f, x: f(x))(fn, on_device)
            return False
        if self.entries and tokens > max((x.tokens for x in self.entries.values() if x.graph is not None),
                                          default=tokens):
            self._drop_graphs()
        statics = e.statics or {name: torch.empty_like(t, device=self.device) for name, t in inputs.items()}
        for name, t in inputs.items():
            statics[name].copy_(t, non_blocking=True)
        before = self._reserved()
        graph = self._new_graph()
        try:
            self._capture(graph, fn, statics)
        except Exception as err:  # noqa: BLE001 - any capture failure means: this key stays eager
            e.failed = True
            self.stats.failed += 1
            log.warning("CUDA graph capture failed for %s (%s: %s); it runs eagerly from now on", key,
                        type(err).__name__, str(err).splitlines()[0][:200] if str(err) else "")
            graph = None  # the failed capture is dropped
            self.stats.eager += 1
            fn(statics)
            return False
        e.graph, e.statics, e.tokens = graph, statics, tokens
        self.pool_bytes = self._reserved()
        e.pool_bytes = max(0, self.pool_bytes - before)
        self.stats.captured += 1
        self.stats.pool_bytes[key] = e.pool_bytes
        log.info("captured %s (%s tokens): the graphs' pool is %.2f GiB (+%.2f)", key, f"{tokens:,}",
                 self.pool_bytes / 2**30, e.pool_bytes / 2**30)
        self._replay(graph, fn, statics)  # a capture records the work without running it
        self.stats.replays += 1
        return True

    def _drop_graphs(self) -> None:
        """Free every graph and their pool; the keys keep their static buffers and warm-up count."""
        for x in self.entries.values():
            x.graph = None
        self.stats.pool_bytes.clear()
        self.stats.recaptures += 1
        self._new_pool()

    def _new_pool(self) -> None:
        torch.cuda.synchronize(self.device)
        self._pool = torch.cuda.graph_pool_handle()
        torch.cuda.empty_cache()

    def pool_gib(self) -> float:
        """The graphs' shared pool now, GiB (about the largest capture's activations, not their sum)."""
        return self._reserved() / 2**30


class FakeGraphs(MicroBatchGraphs):
    """The same bookkeeping on the CPU (tests): a "graph" keeps the function it captured and calls it again on the
    static buffers, so, as with a real graph, a replay sees only what existed at capture."""

    def _new_graph(self):
        return {}

    def _capture(self, graph, fn, statics) -> None:
        graph["fn"] = fn

    def _replay(self, graph, fn, statics) -> None:
        graph["fn"](statics)

    def _reserved(self) -> int:
        return 0

    def _new_pool(self) -> None:
        pass

    def _eager(self, fn, inputs) -> None:
        fn(inputs)


def graph_blockers(model_cfg) -> list[str]:
    """What in a model's config keeps its micro-batches out of CUDA graphs."""
    why = []
    if model_cfg.offload_checkpoints:
        why.append("model.offload_checkpoints copies to the host inside the step")
    if model_cfg.compile:
        why.append("model.compile=true (compiled blocks are not captured)")
    return why


def graphs_off_because(mode: str, device: torch.device, world_size: int, reasons_off: list[str]) -> list[str]:
    """Why a run's micro-batches would not be captured (empty: they would be), without logging or building."""
    if mode == "off":
        return ["train.cuda_graphs=off"]
    why = list(reasons_off)
    if device.type != "cuda":
        why.append("the device is not a CUDA GPU")
    if world_size > 1:
        why.append("FSDP2 over several processes is not captured yet")
    return why


def clear_cublas_workspaces(device: torch.device) -> bool:
    """Free the cuBLAS and cuBLASLt workspaces torch keeps for each CUDA stream they ran on (torch's stream pool has
    32 a device): a graph captured on a side stream leaves its pair held until the process ends (their size:
    results/attention_h100.md). Call it only where no graph that may still replay is alive: a captured graph writes
    to the workspace its warm-up allocated. The next matmul allocates its stream's pair anew. Returns whether
    anything was cleared (False off CUDA)."""
    clear, device = getattr(torch._C, "_cuda_clearCublasWorkspaces", None), torch.device(device)  # CUDA builds only
    if clear is None or device.type != "cuda" or not torch.cuda.is_available():
        return False
    gc.collect()  # graphs kept alive only by reference cycles go first
    torch.cuda.synchronize(device)
    clear()
    torch.cuda.empty_cache()
    return True


def graphs_for(mode: str, device: torch.device, world_size: int, reasons_off: list[str],
               max_tokens: Optional[int]) -> Optional[MicroBatchGraphs]:
    """The micro-batch graphs a run uses, or None, with one log line saying which and why.

    mode: "auto" (on for one CUDA process where nothing in `reasons_off` forbids it), "on" (the same, but a reason
    that forbids it is an error), "off"."""
    if mode == "off":
        return None
    why = graphs_off_because(mode, device, world_size, reasons_off)
    if why:
        if mode == "on":
            raise ValueError(f"train.cuda_graphs=on but CUDA graphs cannot apply here: {'; '.join(why)}")
        log.info("CUDA graphs off (train.cuda_graphs=auto): %s", "; ".join(why))
        return None
    log.info("CUDA graphs on: micro-batches of up to %s tokens are captured per (bucket, B) after %d eager run",
             "any number of" if max_tokens is None else f"{max_tokens:,}", 1)
    return MicroBatchGraphs(device, warmup=1, max_tokens=max_tokens)


def graphs_for_plan(graphs: Optional[MicroBatchGraphs], limit: Optional[int],
                    is_main: bool = True) -> Optional[MicroBatchGraphs]:
    """The graphs narrowed to the capture limit the schedule reserved memory for (scheduling/policy.py
    Schedule.graph_tokens): the same graphs capturing up to `limit` tokens, or None (eager, gradients freed between
    steps) where no planned micro-batch is within train.graph_max_tokens. One log line where it changes them."""
    if graphs is None or limit == graphs.max_tokens:
        return graphs
    if is_main:
        log.info("CUDA graphs: %s", f"micro-batches of up to {limit:,} tokens are captured, the largest the plan "
                 f"holds within train.graph_max_tokens={graphs.max_tokens:,}" if limit else
                 f"off: every planned micro-batch is over train.graph_max_tokens={graphs.max_tokens:,}")
    if not limit:
        return None
    graphs.max_tokens = limit
    return graphs

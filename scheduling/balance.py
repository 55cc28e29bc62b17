"""The planner: which samples go to which rank and micro-batch, for every strategy (CONTRACTS §3).

    plan, next_pos = plan_step(samples, seed, epoch, pos, world_size, strategy, micro_batches, batch_sizes, cost_fn)

A pure function of sample metadata and the global sample position `pos` within the epoch: every rank computes the
same plan without communication, and a resumed run — on the same or another world size — continues from the
(epoch, pos) stored in its checkpoint.

The epoch's layout (independent of the world size): entries are shuffled by (seed, epoch); each bucket's entries,
in that order, are cut into micro-batches of the bucket's batch size B (only a bucket's last one may be short);
the micro-batch list is shuffled again. A step takes the next R·M micro-batches, so `pos` — the number of samples
in the micro-batches before it — always falls on a micro-batch boundary, whatever R was.

Assignment of a step's micro-batches to (rank, slot):
    equal_token, dual_constraint, cost   in stream order, micro-batch j → rank j mod R, slot ⌊j / R⌋
    balanced                             sorted by predicted ms (largest first) and dealt R at a time to slots, so
                                         that the micro-batches sharing a slot — which FSDP synchronises — cost
                                         alike; within a slot the largest goes to the rank with the least work so far
Every rank runs the same number of slots; an empty (rank, slot) runs one sample of the cheapest bucket with loss
weight 0 (a padding micro-batch). The epoch's last step may have fewer slots, never a hang.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Optional, Sequence

import numpy as np

from scheduling.batching import STRATEGIES

CostFn = Callable[[int, int], float]  # (B, S) -> predicted forward+backward ms


@dataclass(frozen=True, eq=False)
class SampleTable:
    """What the planner sees of an epoch: one row per entry (an id may repeat when a source is cycled)."""
    ids: np.ndarray     # (N,) int64 sample id (row of the sample index)
    bucket: np.ndarray  # (N,) int32 bucket number
    S: np.ndarray       # (N,) int64 tokens

    def __post_init__(self):
        n = len(self.ids)
        if not (len(self.bucket) == len(self.S) == n):
            raise ValueError("SampleTable arrays differ in length")
        if n == 0:
            raise ValueError("the epoch holds no samples: is the corpus (or every source in data.sources) empty?")

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class MicroBatch:
    bucket: int
    ids: tuple[int, ...]
    weights: tuple[float, ...]  # 1.0 real, 0.0 padding
    S: int
    pred_ms: float

    @property
    def B(self) -> int:
        return len(self.ids)

    @property
    def num_real(self) -> int:
        return sum(w > 0 for w in self.weights)


@dataclass(frozen=True)
class StepPlan:
    epoch: int
    pos: int
    next_pos: int
    ranks: tuple[tuple[MicroBatch, ...], ...]  # [rank][slot]

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def num_slots(self) -> int:
        return len(self.ranks[0])

    @property
    def num_samples(self) -> int:
        """Real samples in the whole step (all ranks, all slots): the loss's denominator."""
        return sum(mb.num_real for r in self.ranks for mb in r)

    @property
    def tokens(self) -> int:
        return sum(mb.num_real * mb.S for r in self.ranks for mb in r)

    def pred_ms(self) -> np.ndarray:
        """(R, M) predicted ms per rank and slot."""
        return np.array([[mb.pred_ms for mb in r] for r in self.ranks], dtype=np.float64)


@dataclass(frozen=True)
class _Layout:
    buckets: np.ndarray     # (J,) bucket of each micro-batch
    starts: np.ndarray      # (J + 1,) offsets into `entries`
    entries: np.ndarray     # entry rows, micro-batch after micro-batch

    def position_to_index(self, pos: int) -> int:
        j = int(np.searchsorted(self.starts, pos, side="left"))
        return min(j, len(self.starts) - 1)  # a pos off a boundary (batch sizes changed) moves to the next one


_tables: dict[int, SampleTable] = {}  # keeps cached tables alive so their id() stays theirs


@lru_cache(maxsize=8)
def _layout(table_id: int, seed: int, epoch: int, batch_sizes: tuple[int, ...]) -> _Layout:
    table = _tables[table_id]
    rng = np.random.default_rng([seed, epoch, 0x5EED])
    perm = rng.permutation(len(table))
    bucket_of = table.bucket[perm]
    chunks, chunk_buckets = [], []
    for b in np.unique(bucket_of):
        rows = perm[bucket_of == b]
        size = batch_sizes[b]
        for i in range(0, len(rows), size):
            chunks.append(rows[i:i + size])
            chunk_buckets.append(b)
    order = rng.permutation(len(chunks))
    chunks = [chunks[i] for i in order]
    starts = np.zeros(len(chunks) + 1, dtype=np.int64)
    starts[1:] = np.cumsum([len(c) for c in chunks])
    return _Layout(np.asarray(chunk_buckets, dtype=np.int64)[order], starts, np.concatenate(chunks))


def epoch_length(samples: SampleTable) -> int:
    return len(samples)


def plan_step(samples: SampleTable, seed: int, epoch: int, pos: int, world_size: int, strategy: str,
              micro_batches: int, batch_sizes: Sequence[int], cost_fn: CostFn) -> tuple[StepPlan, int]:
    """The plan of the step that starts at sample position `pos` of `epoch`; returns it and the next position.

    batch_sizes[b] is bucket b's B under the strategy (scheduling/batching.py); cost_fn(B, S) predicts ms.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"scheduling.strategy must be one of {STRATEGIES}, got {strategy!r}")
    if world_size < 1 or micro_batches < 1:
        raise ValueError(f"world_size and train.micro_batches must be ≥ 1, got {world_size}, {micro_batches}")
    n_buckets = int(samples.bucket.max()) + 1
    if len(batch_sizes) < n_buckets or min(batch_sizes[:n_buckets]) < 1:
        raise ValueError(f"batch_sizes must give every bucket a B ≥ 1, got {list(batch_sizes)}")
    if not 0 <= pos < len(samples):
        raise ValueError(f"pos {pos} lies outside the epoch [0, {len(samples)})")
    _tables.setdefault(id(samples), samples)
    lay = _layout(id(samples), seed, epoch, tuple(int(b) for b in batch_sizes[:n_buckets]))
    j0 = lay.position_to_index(pos)
    j1 = min(j0 + world_size * micro_batches, len(lay.buckets))

    mbs = []
    for j in range(j0, j1):
        rows = lay.entries[lay.starts[j]:lay.starts[j + 1]]
        b = int(lay.buckets[j])
        S = int(samples.S[rows[0]])
        mbs.append(MicroBatch(b, tuple(int(i) for i in samples.ids[rows]), (1.0,) * len(rows), S,
                              float(cost_fn(len(rows), S))))
    slots = max(1, math.ceil(len(mbs) / world_size))
    grid: list[list[Optional[MicroBatch]]] = [[None] * slots for _ in range(world_size)]
    if strategy == "balanced":
        mbs.sort(key=lambda mb: -mb.pred_ms)
        load = np.zeros(world_size)
        for k in range(slots):
            group = mbs[k * world_size:(k + 1) * world_size]
            free = list(np.argsort(load, kind="stable"))
            for mb, r in zip(group, free):
                grid[r][k] = mb
                load[r] += mb.pred_ms
    else:
        for j, mb in enumerate(mbs):
            grid[j % world_size][j // world_size] = mb
    pad = _padding(samples, cost_fn)
    ranks = tuple(tuple(mb if mb is not None else pad for mb in row) for row in grid)
    next_pos = int(lay.starts[j1])
    return StepPlan(epoch, int(lay.starts[j0]), next_pos, ranks), next_pos


def _padding(samples: SampleTable, cost_fn: CostFn) -> MicroBatch:
    """One sample of the cheapest bucket, loss weight 0: keeps every rank's collectives in step."""
    row = int(np.argmin(samples.S))
    S = int(samples.S[row])
    return MicroBatch(int(samples.bucket[row]), (int(samples.ids[row]),), (0.0,), S, float(cost_fn(1, S)))


def advance(epoch: int, next_pos: int, samples: SampleTable) -> tuple[int, int]:
    """(epoch, pos) of the next step: the epoch rolls over once its last entry has been planned."""
    return (epoch + 1, 0) if next_pos >= len(samples) else (epoch, next_pos)

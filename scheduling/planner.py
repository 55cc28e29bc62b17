"""The planner: which samples go to which rank and micro-batch, for every batch rule (docs/contracts.md §3).

    plan, next_pos = plan_step(samples, seed, epoch, pos, world_size, strategy, micro_batches, batch_sizes,
                               cost_fn, window=1, planner=None, m_mem=None)

A pure function of sample metadata and the global sample position `pos` within the epoch: every rank computes the
same plan without communication, and a resumed run — on the same or another world size — continues from the
(epoch, pos) stored in its checkpoint.

The epoch's layout (independent of the world size): entries are shuffled by (seed, epoch); each bucket's entries,
in that order, are cut into micro-batches of the bucket's batch size B (only a bucket's last one may be short);
the micro-batch list is shuffled again. A step takes the next R·M micro-batches, so `pos` — the number of samples
in the micro-batches before it — always falls on a micro-batch boundary, whatever R was.

The planner (scheduling.planner) is an axis of its own beside the batch rule (scheduling.strategy): the rule sets
each bucket's B, the planner assigns a step's micro-batches to (rank, slot). Any rule runs with any planner:
    stream     in stream order, micro-batch j → rank j mod R, slot ⌊j / R⌋
    sorted     sorted by predicted ms, largest first, and cut into groups of R: group k is slot k, so the
               micro-batches that FSDP synchronises in a slot cost alike (for a fixed group size, consecutive groups
               of the sorted list minimise Σ_k max_r t_rk); within a slot the largest goes to the rank with the
               least work so far (LPT), which balances each rank's total over the step
    windowed   (scheduling.window = W > 1) the W·R·M micro-batches of a window — windows tile the layout from the
               epoch's start — sorted and cut into groups of R together, which makes the groups tighter than one
               step's R·M allow; the groups are dealt to the window's steps in snake order (each step gets a
               cross-section of costs) and each step assigns its groups as `sorted` does
    reformed   one step, stream's samples (the same R·M micro-batches' samples, the same next_pos), its
               micro-batches RE-FORMED by the cost model: regrouped into one-bucket micro-batches of any
               B ≤ ⌊m_mem / S⌋ and into a number of slots of its own (`reform`); m_mem (tokens a micro-batch, the
               memory bound) is needed. The objective is stream's: every sample weight 1, loss_norm the step's count
Default (planner None, `default_planner`): `balanced` is the cost rule planned `sorted` (`windowed` when window > 1);
the other rules run `stream`, where a window is ignored.

The loss's denominator (`StepPlan.loss_norm`, contracts §3): a windowed step's real samples differ from step to
step, so its loss divides by the window's real samples ÷ its steps (the window's mean a step, which every rank
computes from the plan without communication) instead of the step's own count: every sample of a window then weighs
the same, 1 / loss_norm, whichever of its steps it lands in, and the window's steps together weigh W, as W steps of
the mean size would. For stream, sorted and reformed it is the step's own count (num_samples): the loss of a
one-step plan is unchanged.
Every rank runs the same number of slots; an empty (rank, slot) runs one sample of the cheapest bucket with loss
weight 0 (a padding micro-batch). The epoch's last step may have fewer slots, never a hang.

A step inside a window is found from `pos` = window start + samples of the window's steps before it, so a resume
on the same world size is exact anywhere. A resume on another world size is exact at a window boundary of the old
run (its steps then run unwindowed, sorted, up to the new run's next window boundary); one that lands inside an
old window cannot know the old world size's window and may repeat or skip samples of that window: checkpoint at
multiples of W steps if R may change.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from scheduling.batching import STRATEGIES

CostFn = Callable[[int, int], float]  # (B, S) -> predicted forward+backward ms
PLANNERS = ("stream", "sorted", "windowed", "reformed")


def default_planner(strategy: str, window: int = 1) -> str:
    """The planner a rule runs when scheduling.planner is unset: balanced sorted (windowed when window > 1), every
    other rule in stream order (a window ignored): what each rule did before the planner was its own knob."""
    if strategy != "balanced":
        return "stream"
    return "windowed" if window > 1 else "sorted"


def check_planner(planner: str, window: int) -> None:
    """Refuse a planner that is unknown or does not match the window, naming the field and the fix."""
    if planner not in PLANNERS:
        raise ValueError(f"scheduling.planner must be one of {PLANNERS} (or null: the rule's default), got "
                         f"{planner!r}")
    if planner == "windowed" and window < 2:
        raise ValueError(f"scheduling.planner=windowed plans scheduling.window steps together and needs window ≥ 2, "
                         f"got {window}: set scheduling.window, or planner=sorted for one step")
    if planner != "windowed" and window > 1:
        raise ValueError(f"scheduling.planner={planner} plans one step at a time, but scheduling.window={window}: "
                         "set scheduling.planner=windowed, or scheduling.window=1")


def check_m_mem(planner: str, m_mem: Optional[float]) -> None:
    """reformed re-forms micro-batches up to the memory bound: refused where it is unknown."""
    if planner == "reformed" and m_mem is None:
        raise ValueError("scheduling.planner=reformed re-forms each step's micro-batches up to the memory bound "
                         "m_mem, which this run does not know: set scheduling.m_mem (tokens a micro-batch), or "
                         "scheduling.calibration to a file with a memory model (scheduling.mem_budget_gib "
                         "optional)")


def resolve_planner(strategy: str, window: int, planner: Optional[str] = None) -> str:
    """The planner a step runs: the one given, else the rule's default. Only `windowed` reads the window (the config
    refuses a window beside an explicit stream or sorted: check_planner)."""
    if planner is None:
        return default_planner(strategy, window)
    check_planner(planner, window if planner == "windowed" else 1)
    return planner


@dataclass(frozen=True, eq=False)
class SampleTable:
    """What the planner sees of an epoch: one row per entry (an id may repeat when a source is cycled)."""
    ids: np.ndarray     # (N,) int64 sample id (row of the sample index)
    bucket: np.ndarray  # (N,) int32 bucket number
    S: np.ndarray       # (N,) int64 tokens
    _layouts: dict = field(default_factory=dict, init=False, repr=False)  # (seed, epoch, sizes) → _Layout

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
    window_norm: Optional[float] = None  # windowed: the window's real samples ÷ its steps (loss_norm)

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
    def loss_norm(self) -> float:
        """What the step's weighted loss sum divides by: the window's mean real samples a step for a windowed step,
        else the step's own real samples (num_samples)."""
        return self.num_samples if self.window_norm is None else self.window_norm

    @property
    def tokens(self) -> int:
        return sum(mb.num_real * mb.S for r in self.ranks for mb in r)

    def pred_ms(self) -> np.ndarray:
        """(R, M) predicted ms per rank and slot."""
        return np.array([[mb.pred_ms for mb in r] for r in self.ranks], dtype=np.float64)

    def real(self) -> np.ndarray:
        """(R, M) bool: the slot holds real samples (False: a padding micro-batch, idle work)."""
        return np.array([[mb.num_real > 0 for mb in r] for r in self.ranks], dtype=bool)


@dataclass(frozen=True)
class _Layout:
    buckets: np.ndarray     # (J,) bucket of each micro-batch
    starts: np.ndarray      # (J + 1,) offsets into `entries`
    entries: np.ndarray     # entry rows, micro-batch after micro-batch
    # the last window planned: its W steps each ask for it, and it is the same for all of them
    last_window: dict = field(default_factory=dict, compare=False, repr=False)

    def __len__(self) -> int:
        return len(self.buckets)

    def position_to_index(self, pos: int) -> int:
        j = int(np.searchsorted(self.starts, pos, side="left"))
        return min(j, len(self.starts) - 1)  # a pos off a boundary (batch sizes changed) moves to the next one


def _layout(table: SampleTable, seed: int, epoch: int, batch_sizes: tuple[int, ...]) -> _Layout:
    key = (seed, epoch, batch_sizes)
    cache = table._layouts
    if key in cache:
        return cache[key]
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
    lay = _Layout(np.asarray(chunk_buckets, dtype=np.int64)[order], starts, np.concatenate(chunks))
    if len(cache) >= 4:  # a run uses one or two (this epoch's, the next one's while prefetching)
        cache.pop(next(iter(cache)))
    cache[key] = lay
    return lay


def epoch_length(samples: SampleTable) -> int:
    return len(samples)


def deal_balanced(pred: np.ndarray, world_size: int, slots: int, pad_ms: float = 0.0) -> np.ndarray:
    """(R, slots) indices into pred (−1: padding): sorted groups of R per slot, LPT across ranks within a slot."""
    if len(pred) > world_size * slots:
        raise ValueError(f"{len(pred)} micro-batches do not fit {world_size} ranks × {slots} slots")
    return _lpt(_sorted_groups(pred, world_size, slots), pred, world_size, pad_ms)


def _sorted_groups(pred, R: int, n_groups: int) -> np.ndarray:
    """(n_groups, R) indices into pred, costliest first, padded with −1: the micro-batches sharing a slot."""
    order = np.argsort(-np.asarray(pred, dtype=np.float64), kind="stable")
    groups = np.full(n_groups * R, -1, dtype=np.int64)
    groups[:len(order)] = order
    return groups.reshape(n_groups, R)


def _lpt(groups_KR: np.ndarray, pred: np.ndarray, world_size: int, pad_ms: float) -> np.ndarray:
    """Slot k holds group k (largest first within it); each goes to the ranks with the least work so far."""
    out = np.full((world_size, len(groups_KR)), -1, dtype=np.int64)
    load = np.zeros(world_size)
    pred = np.asarray(pred, dtype=np.float64)
    for k, g in enumerate(groups_KR):
        cost = np.where(g >= 0, pred[np.maximum(g, 0)], pad_ms)
        g, cost = g[np.argsort(-cost, kind="stable")], np.sort(cost)[::-1]
        ranks = np.argsort(load, kind="stable")
        out[ranks, k] = g
        load[ranks] += cost
    return out


def plan_step(samples: SampleTable, seed: int, epoch: int, pos: int, world_size: int, strategy: str,
              micro_batches: int, batch_sizes: Sequence[int], cost_fn: CostFn,
              window: int = 1, planner: Optional[str] = None,
              m_mem: Optional[float] = None) -> tuple[StepPlan, int]:
    """The plan of the step that starts at sample position `pos` of `epoch`; returns it and the next position.

    batch_sizes[b] is bucket b's B under the strategy (scheduling/batching.py); cost_fn(B, S) predicts ms;
    window: steps planned together (planner windowed); planner: stream, sorted, windowed or reformed, None: the
    strategy's default (see the module docstring); m_mem: the memory bound on B·S a re-formed micro-batch keeps
    (planner reformed only).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"scheduling.strategy must be one of {STRATEGIES}, got {strategy!r}")
    if world_size < 1 or micro_batches < 1:
        raise ValueError(f"world_size and train.micro_batches must be ≥ 1, got {world_size}, {micro_batches}")
    if window < 1:
        raise ValueError(f"scheduling.window must be ≥ 1, got {window}")
    planner = resolve_planner(strategy, window, planner)
    check_m_mem(planner, m_mem)
    n_buckets = int(samples.bucket.max()) + 1
    if len(batch_sizes) < n_buckets or min(batch_sizes[:n_buckets]) < 1:
        raise ValueError(f"batch_sizes must give every bucket a B ≥ 1, got {list(batch_sizes)}")
    if not 0 <= pos < len(samples):
        raise ValueError(f"pos {pos} lies outside the epoch [0, {len(samples)})")
    lay = _layout(samples, seed, epoch, tuple(int(b) for b in batch_sizes[:n_buckets]))
    R, M = world_size, micro_batches
    pad = _padding(samples, cost_fn)
    if planner == "windowed":
        found = _window_step(lay, samples, pos, R, M, window, cost_fn, pad)
        if found is not None:
            grid, next_pos, norm = found
            return StepPlan(epoch, pos, next_pos, pad_grid(grid, pad), norm), next_pos
        j0 = lay.position_to_index(pos)  # resumed from another world size: unwindowed up to the next window
        j1 = min(j0 + R * M, (j0 // (window * R * M) + 1) * window * R * M, len(lay))
    else:
        j0 = lay.position_to_index(pos)
        j1 = min(j0 + R * M, len(lay))
    mbs = [_micro_batch(lay, samples, j, cost_fn) for j in range(j0, j1)]
    slots = max(1, math.ceil(len(mbs) / R))
    if planner == "stream":
        grid = [[None] * slots for _ in range(R)]
        for j, mb in enumerate(mbs):
            grid[j % R][j // R] = mb
    elif planner == "reformed":
        grid = reform(mbs, R, cost_fn, m_mem, pad.pred_ms)
    else:
        idx = deal_balanced(np.array([mb.pred_ms for mb in mbs]), R, slots, pad.pred_ms)
        grid = [[mbs[i] if i >= 0 else None for i in row] for row in idx]
    next_pos = int(lay.starts[j1])
    return StepPlan(epoch, int(lay.starts[j0]), next_pos, pad_grid(grid, pad)), next_pos


def _micro_batch(lay: _Layout, samples: SampleTable, j: int, cost_fn: CostFn) -> MicroBatch:
    rows = lay.entries[lay.starts[j]:lay.starts[j + 1]]
    S = int(samples.S[rows[0]])
    return MicroBatch(int(lay.buckets[j]), tuple(samples.ids[rows].tolist()), (1.0,) * len(rows), S,
                      float(cost_fn(len(rows), S)))


def pad_grid(grid, pad: MicroBatch) -> tuple[tuple[MicroBatch, ...], ...]:
    """The grid's empty (rank, slot)s (None) hold the padding micro-batch."""
    return tuple(tuple(mb if mb is not None else pad for mb in row) for row in grid)


def _window_step(lay: _Layout, samples: SampleTable, pos: int, R: int, M: int, W: int, cost_fn: CostFn,
                 pad: MicroBatch):
    """(grid, next_pos, the window's real samples ÷ its steps) of the window step that starts at pos, or None when
    pos is no step start of this R."""
    size = W * R * M
    j_at = int(np.searchsorted(lay.starts, pos, side="right")) - 1  # the micro-batch holding position pos
    J0 = j_at // size * size
    J1 = min(J0 + size, len(lay))
    key = (J0, R, M, W, cost_fn)  # the key holds cost_fn itself: a freed function's id cannot alias it
    if key not in lay.last_window:
        mbs = [_micro_batch(lay, samples, j, cost_fn) for j in range(J0, J1)]
        pred = np.array([mb.pred_ms for mb in mbs])
        n_groups = math.ceil(len(mbs) / R)
        groups = _sorted_groups(pred, R, n_groups)
        n_steps = math.ceil(n_groups / M)
        per_step: list[list[np.ndarray]] = [[] for _ in range(n_steps)]
        for g in range(n_groups):  # snake: 0 1 2 … n−1 n−1 … 1 0 0 1 …
            rnd, i = divmod(g, n_steps)
            per_step[i if rnd % 2 == 0 else n_steps - 1 - i].append(groups[g])
        lay.last_window.clear()
        lay.last_window[key] = (mbs, pred, per_step)
    mbs, pred, per_step = lay.last_window[key]
    base, offset = int(lay.starts[J0]), 0
    norm = (int(lay.starts[J1]) - base) / len(per_step)  # the layout holds real samples only
    for step_groups in per_step:
        count = sum(mbs[i].B for g in step_groups for i in g if i >= 0)
        if base + offset == pos:
            idx = _lpt(np.stack(step_groups), pred, R, pad.pred_ms)
            return [[mbs[i] if i >= 0 else None for i in row] for row in idx], base + offset + count, norm
        offset += count
    return None


# ------------------------------------------------------------------------- re-forming a step's micro-batches
@dataclass(frozen=True)
class PerSample:
    """Each bucket's cheapest per-sample time within the memory bound: e[S] = min_B t(B, S) / B over
    1 ≤ B ≤ B_max[S] = ⌊m_mem / S⌋, t1[S] = t(1, S), w[S] = B_max[S] · e[S] (the most work one micro-batch
    holds)."""
    e: dict
    t1: dict
    w: dict
    B_max: dict

    @classmethod
    def of(cls, t: CostFn, S_list: Sequence[int], m_mem: float) -> "PerSample":
        e, t1, w, bmax = {}, {}, {}, {}
        for S in S_list:
            bmax[S] = max(1, int(m_mem // S))
            e[S] = min(float(t(B, S)) / B for B in range(1, bmax[S] + 1))
            t1[S], w[S] = float(t(1, S)), bmax[S] * e[S]
        return cls(e, t1, w, bmax)


def _greedy_slots(counts: dict, S_of: dict, R: int, t: CostFn, ps: PerSample, slots: int,
                  slack: float) -> list[list[tuple[int, int]]]:
    """Slots of (bucket, B): slot j's cap is the longest single sample left or slack × the work left ÷ (R · slots
    left); each rank takes the one-bucket micro-batch of largest t within the cap (ties: the longer S, coarse
    samples first)."""
    left, out = dict(counts), []
    while any(left.values()):
        live = [b for b, n in left.items() if n]
        work = sum(left[b] * ps.e[S_of[b]] for b in live)
        cap = max(max(t(1, S_of[b]) for b in live), slack * work / (R * max(1, slots - len(out))))
        slot = []
        for _ in range(R):
            best = None
            for b in live:
                S = S_of[b]
                B = min(left[b], ps.B_max[S])
                while B > 1 and t(B, S) > cap:
                    B -= 1
                if left[b] and t(B, S) <= cap and (best is None or (t(B, S), S, b) > best[0]):
                    best = ((t(B, S), S, b), b, B)
            if best is None:
                break
            _, b, B = best
            left[b] -= B
            slot.append((b, B))
        out.append(slot)
    return out


SLACKS = (1.0, 1.03, 1.06, 1.1, 1.2)


def reform(mbs: Sequence[MicroBatch], R: int, cost_fn: CostFn, m_mem: float,
           pad_ms: float) -> list[list[Optional[MicroBatch]]]:
    """(R, K) grid (None: a padding micro-batch of pad_ms) holding the real samples of `mbs`, regrouped by bucket
    into micro-batches of B ≤ max(1, ⌊m_mem / S⌋) and K slots of its own, that minimises the predicted step time
    Σ_k max_r cost_fn(B_rk, S_rk): slot after slot each rank takes the one-bucket micro-batch of largest
    predicted time within the slot's cap, the cap being the longest sample left or the work left spread over the
    slots left (_greedy_slots), tried for a few slot counts and slacks; `sorted`'s placement of `mbs` as they are is a
    candidate too, so a re-formed step is never predicted slower than sorted (nor than stream). Samples keep
    their order within a bucket; the result is a deterministic function of its arguments."""
    by_b: dict = {}
    S_of: dict = {}
    for mb in mbs:
        for i, wt in zip(mb.ids, mb.weights):
            if wt > 0:
                by_b.setdefault(mb.bucket, []).append(i)
                S_of[mb.bucket] = mb.S
    if not by_b:
        return [[None] for _ in range(R)]
    memo: dict = {}

    def t(B, S):
        if (B, S) not in memo:
            memo[(B, S)] = float(cost_fn(B, S))
        return memo[(B, S)]

    def step_ms(grid) -> float:
        return sum(max(mb.pred_ms if mb is not None else pad_ms for mb in col) for col in zip(*grid))

    ps = PerSample.of(t, sorted(set(S_of.values())), m_mem)
    counts = {b: len(ids) for b, ids in by_b.items()}
    low = max(1, math.ceil(sum(n * ps.e[S_of[b]] for b, n in counts.items()) / (R * max(ps.w.values()))))
    real = [mb for mb in mbs if mb.num_real]
    cands = []
    if all(mb.B <= ps.B_max[mb.S] for mb in real):  # the table's micro-batches, sorted
        idx = deal_balanced(np.array([mb.pred_ms for mb in real]), R, max(1, math.ceil(len(real) / R)), pad_ms)
        cands.append([[real[i] if i >= 0 else None for i in row] for row in idx])
    for fill in (_greedy_slots(counts, S_of, R, t, ps, k, s) for k in range(low, low + 4) for s in SLACKS):
        taken = {b: 0 for b in by_b}
        grid: list[list[Optional[MicroBatch]]] = [[None] * len(fill) for _ in range(R)]
        for k, slot in enumerate(fill):
            for r, (b, B) in enumerate(slot):
                ids = by_b[b][taken[b]:taken[b] + B]
                taken[b] += B
                grid[r][k] = MicroBatch(b, tuple(ids), (1.0,) * B, S_of[b], t(B, S_of[b]))
        cands.append(grid)
    return min(cands, key=step_ms)  # the first of equals: the table's micro-batches where re-forming gains nothing


def _padding(samples: SampleTable, cost_fn: CostFn) -> MicroBatch:
    """One sample of the cheapest bucket, loss weight 0: keeps every rank's collectives in step."""
    row = int(np.argmin(samples.S))
    S = int(samples.S[row])
    return MicroBatch(int(samples.bucket[row]), (int(samples.ids[row]),), (0.0,), S, float(cost_fn(1, S)))


def advance(epoch: int, next_pos: int, samples: SampleTable) -> tuple[int, int]:
    """(epoch, pos) of the next step: the epoch rolls over once its last entry has been planned."""
    return (epoch + 1, 0) if next_pos >= len(samples) else (epoch, next_pos)

"""A run's throughput and balance from the time of every (rank, slot) micro-batch of its plans.

The same arithmetic serves every source of times: measured on a GPU (scripts/replay_plans.py runs each planned
micro-batch for real), the planner's own prediction (`MicroBatch.pred_ms`), or a prediction with drawn noise (the
cluster simulator). Evaluating one list of plans under two sources compares them on identical work.

One step: R ranks, M slots, t_rk the ms of rank r's micro-batch in slot k (a padding micro-batch takes its time but
does no work); FSDP synchronises every slot, and the optimizer step is sharded over the R ranks:

    step time     T = Σ_k max_r t_rk + optim_ms / R

A run of K steps (scheduling.efficiency holds the per-step formulas):

    tokens/s      Σ real latent tokens / Σ T          samples/s likewise (real samples: loss weight > 0)
    compute CV    mean over steps of (CV over ranks of Σ_k t_rk)          padding time counted as the rank's
    idle          1 − Σ_steps Σ_real t_rk / (R · Σ_steps Σ_k max_r t_rk)  all steps together; padding slots idle;
                                                                          the optimizer outside
    step-time CV  std / mean of T over the steps (population std)

Execution order on one device: a step's micro-batches in slot-major order, (slot 0: rank 0 … R−1), (slot 1: …);
`execution_order` and `to_grid` convert between that list and the (R, M) grid.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence, Union

import numpy as np

from scheduling.planner import CostFn, MicroBatch, SampleTable, StepPlan, advance, plan_step
from scheduling.efficiency import compute_cv, step_time

TimeSource = Union[None, Callable[[MicroBatch], float], Sequence[np.ndarray]]


@dataclass(frozen=True)
class StepTimes:
    """One step's times and work. t_ms, real, pred_ms: (R, M); optim_ms: the whole optimizer step (before / R)."""
    t_ms: np.ndarray
    real: np.ndarray
    tokens: int
    samples: int
    pred_ms: Optional[np.ndarray] = None
    optim_ms: float = 0.0

    def __post_init__(self):
        t, real = np.asarray(self.t_ms, dtype=np.float64), np.asarray(self.real, dtype=bool)
        if t.ndim != 2 or t.shape != real.shape:
            raise ValueError(f"t_ms and real must be (R, M) arrays of one shape, got {t.shape} and {real.shape}")
        if self.pred_ms is not None and np.shape(self.pred_ms) != t.shape:
            raise ValueError(f"pred_ms must be shaped like t_ms {t.shape}, got {np.shape(self.pred_ms)}")
        object.__setattr__(self, "t_ms", t)
        object.__setattr__(self, "real", real)

    @classmethod
    def of(cls, plan: StepPlan, t_ms, optim_ms: float = 0.0) -> "StepTimes":
        """The plan's work (real flags, tokens, samples, predictions) with the times t_ms (R, M)."""
        return cls(np.asarray(t_ms, dtype=np.float64), plan.real(), plan.tokens, plan.num_samples, plan.pred_ms(),
                   float(optim_ms))

    @property
    def R(self) -> int:
        return self.t_ms.shape[0]

    @property
    def step_ms(self) -> float:
        return step_time(self.t_ms) + self.optim_ms / self.R


@dataclass
class RunSummary:
    steps: int
    R: int
    M: int                      # the most slots of any step
    samples: int
    tokens: int
    time_s: float
    tokens_per_s: float
    samples_per_s: float
    compute_cv: float
    idle_fraction: float
    compute_cv_pred: Optional[float]   # the same CV of the prediction carried with the times (None: none carried)
    step_time_cv: float
    optim_ms: float                    # mean optimizer ms a step, before the division by R
    step_ms: list = field(default_factory=list)

    def row(self) -> dict:
        return asdict(self)


def summarize(steps: Sequence[StepTimes]) -> RunSummary:
    """The run's numbers (module docstring) from its steps."""
    if not steps:
        raise ValueError("summarize needs at least one step")
    total_t, busy, sync, tokens, samples, cvs, cvs_pred, step_ts = 0.0, 0.0, 0.0, 0, 0, [], [], []
    for s in steps:
        slot_max = step_time(s.t_ms)
        step_t = slot_max + s.optim_ms / s.R
        total_t += step_t
        busy += s.t_ms[s.real].sum()
        sync += s.R * slot_max
        tokens += s.tokens
        samples += s.samples
        cvs.append(compute_cv(s.t_ms))
        if s.pred_ms is not None:
            cvs_pred.append(compute_cv(s.pred_ms))
        step_ts.append(step_t)
    if total_t <= 0 or sync <= 0:
        raise ValueError("the steps took no time: every t_ms is 0")
    secs = total_t / 1e3
    step_ts = np.asarray(step_ts)
    return RunSummary(len(steps), max(s.R for s in steps), max(s.t_ms.shape[1] for s in steps), samples, tokens,
                      secs, tokens / secs, samples / secs, float(np.mean(cvs)), float(1 - busy / sync),
                      float(np.mean(cvs_pred)) if len(cvs_pred) == len(steps) else None,
                      float(step_ts.std() / step_ts.mean()), float(np.mean([s.optim_ms for s in steps])),
                      [float(v) for v in step_ts])


def step_times(plans: Sequence[StepPlan], times: TimeSource = None,
               optim_ms: Union[float, Sequence[float]] = 0.0) -> list[StepTimes]:
    """Each plan with its times: `times` None (every micro-batch's pred_ms), a function MicroBatch → ms, or one
    (R, M) array per plan; optim_ms one number for every step or one a step."""
    optim = [float(optim_ms)] * len(plans) if np.ndim(optim_ms) == 0 else [float(v) for v in optim_ms]
    if len(optim) != len(plans):
        raise ValueError(f"optim_ms gives {len(optim)} steps, the plans {len(plans)}")
    if times is not None and not callable(times) and len(times) != len(plans):
        raise ValueError(f"times gives {len(times)} steps, the plans {len(plans)}")
    out = []
    for i, plan in enumerate(plans):
        if times is None:
            t = plan.pred_ms()
        elif callable(times):
            t = np.array([[float(times(mb)) for mb in row] for row in plan.ranks], dtype=np.float64)
        else:
            t = np.asarray(times[i], dtype=np.float64)
            if t.shape != (plan.world_size, plan.num_slots):
                raise ValueError(f"step {i}: times {t.shape}, plan {(plan.world_size, plan.num_slots)}")
        out.append(StepTimes.of(plan, t, optim[i]))
    return out


def evaluate(plans: Sequence[StepPlan], times: TimeSource = None,
             optim_ms: Union[float, Sequence[float]] = 0.0) -> RunSummary:
    """The run's numbers for these plans under `times` (see step_times; None: the planner's prediction)."""
    return summarize(step_times(plans, times, optim_ms))


def plan_steps(table: SampleTable, seed: int, world_size: int, strategy: str, micro_batches: int,
               batch_sizes: Sequence[int], cost_fn: CostFn, steps: int, window: int = 1, epoch: int = 0,
               pos: int = 0, planner: Optional[str] = None, m_mem: Optional[float] = None) -> list[StepPlan]:
    """`steps` consecutive plans from (epoch, pos), as training makes them: the epoch rolls over when its last
    entry has been planned (a caller that wants one epoch checks `plans[-1].epoch`)."""
    if steps < 1:
        raise ValueError(f"steps must be ≥ 1, got {steps}")
    plans = []
    for _ in range(steps):
        plan, next_pos = plan_step(table, seed, epoch, pos, world_size, strategy, micro_batches, batch_sizes,
                                   cost_fn, window=window, planner=planner, m_mem=m_mem)
        plans.append(plan)
        epoch, pos = advance(epoch, next_pos, table)
    return plans


def execution_order(plan: StepPlan) -> list[tuple[int, int]]:
    """(rank, slot) of each micro-batch in the order one device runs the step: slot-major, ranks in order."""
    return [(r, k) for k in range(plan.num_slots) for r in range(plan.world_size)]


def to_grid(plan: StepPlan, values: Sequence[float]) -> np.ndarray:
    """Values listed in execution_order → the (R, M) grid."""
    order = execution_order(plan)
    if len(values) != len(order):
        raise ValueError(f"{len(values)} values for a step of {len(order)} micro-batches")
    out = np.zeros((plan.world_size, plan.num_slots), dtype=np.float64)
    for (r, k), v in zip(order, values):
        out[r, k] = float(v)
    return out

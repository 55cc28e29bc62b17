"""What any one-step planner can reach: lower bounds on a step's time when the step keeps its set of samples, and
a planner that re-forms the step's micro-batches to approach them.

A step's samples are fixed (no window); t(B, S) is a micro-batch's time (the cluster's truth with FSDP's
collectives), R the ranks, m_mem the memory bound (B·S ≤ m_mem). FSDP synchronises every slot (contracts §3), so a
step lasts Σ_k max_r t_rk. Costs c sorted largest first.

Fixed micro-batches (the batch table's), any assignment:
    rank bound       max(c_1, Σ c / R, c_R + c_(R+1))       any assignment to ranks, even without per-slot sync
                     (of the R + 1 costliest, two share a rank)
    slot optimum     Σ_j c_(jR+1)                           the least Σ_k max_r t_rk over every assignment: the
                     j-th largest slot maximum is at least c_(jR+1) (the j·R micro-batches of the j−1 larger
                     slots hold at most (j−1)·R of them), and sorted groups of R reach it — `sorted` is optimal
Re-formed micro-batches (the step's samples, any B ≤ m_mem / S per bucket, one bucket a micro-batch; each sample
at its cheapest per-sample cost e_S = min_B t(B, S) / B; W = Σ e over the step's samples; e sorted largest first):
    rank bound       max(W / R, max t(1, S), e_R + e_(R+1)) a sample is indivisible: the longest runs at least
                                                            t(1, S) on one rank
    slot bound       max(rank bound, W / R + (R − min(n*, R)) · (t(1, S*) − w_o)⁺ / R)
                     S* the step's longest bucket (n* samples), w_o the most work one micro-batch of any other of
                     its buckets holds (B_max · e). The slot holding S* lasts ≥ t(1, S*); of its R ranks at most
                     min(n*, R) run S*, every other one ≤ w_o of work: so that slot's idle is at least
                     (R − min(n*, R)) · (t(1, S*) − w_o), and every further slot holds that slot's missing work.
Throughput bounds: Σ tokens / Σ_steps (bound + optim_ms / R) over the steps of a run.

`reform_step` applies a planner of that second kind to a planned step: scheduling.planner=reformed's `reform`
(scheduling/planner.py: one step, its samples kept, micro-batches re-formed by the cost model; slot after slot,
each rank takes the one-bucket micro-batch of largest predicted time within the slot's cap, tried for a few slot
counts and slacks, the least predicted Σ_k max_r kept, sorted's placement of the table's micro-batches among the
candidates). It changes micro-batch sizes step by step, so its micro-batches run at (S, B) the batch table never
uses (the truth interpolates them).
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from scheduling.planner import MicroBatch, PerSample, StepPlan, pad_grid, reform

TimeFn = Callable[[int, int], float]  # (B, S) → ms


def rank_bound(costs: Sequence[float], R: int) -> float:
    """max(c_1, Σ c / R, c_R + c_(R+1)): no assignment of these micro-batches to R ranks finishes sooner."""
    c = np.sort(np.asarray(costs, dtype=np.float64))[::-1]
    if len(c) == 0:
        return 0.0
    pair = c[R - 1] + c[R] if len(c) > R else 0.0
    return float(max(c[0], c.sum() / R, pair))


def slot_optimum(costs: Sequence[float], R: int) -> float:
    """Σ_j c_(jR+1): the least Σ_k max_r t_rk of any assignment of these micro-batches to R ranks' slots (the
    module docstring's proof); sorted groups of R reach it."""
    c = np.sort(np.asarray(costs, dtype=np.float64))[::-1]
    return float(c[::R].sum())


def reform_bounds(counts: Mapping[int, int], R: int, ps: PerSample) -> tuple[float, float]:
    """(rank bound, slot bound) of a step holding counts[S] samples of length S, micro-batches re-formed freely
    (module docstring)."""
    counts = {S: n for S, n in counts.items() if n > 0}
    if not counts:
        return 0.0, 0.0
    e = sorted((ps.e[S] for S, n in counts.items() for _ in range(n)), reverse=True)
    W = float(sum(e))
    S_star = max(counts, key=lambda S: ps.t1[S])
    rank = max(W / R, ps.t1[S_star], e[R - 1] + e[R] if len(e) > R else 0.0)
    w_o = max((ps.w[S] for S in counts if S != S_star), default=0.0)
    slot = W / R + (R - min(counts[S_star], R)) * max(0.0, ps.t1[S_star] - w_o) / R
    return rank, max(rank, slot)


def step_counts(plan: StepPlan) -> dict:
    """{S: real samples} of a step."""
    out: dict = {}
    for rank in plan.ranks:
        for mb in rank:
            if mb.num_real:
                out[mb.S] = out.get(mb.S, 0) + mb.num_real
    return out


def reform_step(plan: StepPlan, cost_fn: TimeFn, m_mem: float) -> StepPlan:
    """The step's real samples re-formed by the planner's `reform` (scheduling/planner.py: planner=reformed), an
    empty (rank, slot) padded with one sample of the step's shortest bucket, loss weight 0: the same samples, the
    same next_pos."""
    mbs = [mb for rank in plan.ranks for mb in rank if mb.num_real]
    if not mbs:
        return plan
    short = min(mbs, key=lambda mb: mb.S)
    pad = MicroBatch(short.bucket, short.ids[:1], (0.0,), short.S, float(cost_fn(1, short.S)))
    grid = reform(mbs, plan.world_size, cost_fn, m_mem, pad.pred_ms)
    return StepPlan(plan.epoch, plan.pos, plan.next_pos, pad_grid(grid, pad), plan.window_norm)


# ------------------------------------------------------------------------------------- a run's bound table
def mean_time(cluster, R: int) -> TimeFn:
    """t(B, S): the truth's mean ms with FSDP's collectives at R ranks (no noise, no slow rank)."""
    memo: dict = {}

    def t(B: int, S: int) -> float:
        if (B, S) not in memo:
            base = np.array([[cluster.truth.mean(B, S) * cluster.slow_S.get(S, 1.0)]])
            memo[(B, S)] = float(cluster.comm.apply(base, R)[0, 0] if cluster.comm is not None else base[0, 0])
        return memo[(B, S)]

    return t


def run_bounds(plans: Sequence[StepPlan], cluster, optim_ms: float, m_mem: float, cost_fn: TimeFn,
               seed: int = 0) -> dict:
    """One run's steps (a batch table's, as the stream planner cuts them) under every one-step planner's bounds,
    as tokens/s on the truth's mean times t (module docstring); beside them what stream, sorted and reform_step
    give on the same t, and on the truth's drawn times as the simulator runs them (…_drawn; reform's measured
    share). The bounds hold for any planner that keeps each step's samples."""
    from scheduling.replay import StepTimes, summarize

    R = plans[0].world_size
    t = mean_time(cluster, R)
    ps = PerSample.of(t, sorted({mb.S for p in plans for r in p.ranks for mb in r}), m_mem)
    opt = optim_ms / R
    sums = dict(stream=0.0, sorted=0.0, rank_bound=0.0, reform=0.0, reform_rank_bound=0.0, reform_slot_bound=0.0)
    tokens, reformed = 0, []
    for p in plans:
        grid = np.array([[t(mb.B, mb.S) for mb in r] for r in p.ranks])
        real = [t(mb.B, mb.S) for r in p.ranks for mb in r if mb.num_real]
        sums["stream"] += grid.max(axis=0).sum() + opt
        sums["sorted"] += slot_optimum(real, R) + opt
        sums["rank_bound"] += rank_bound(real, R) + opt
        rb, sb = reform_bounds(step_counts(p), R, ps)
        sums["reform_rank_bound"] += rb + opt
        sums["reform_slot_bound"] += sb + opt
        q = reform_step(p, cost_fn, m_mem)
        reformed.append(q)
        sums["reform"] += float(np.array([[t(mb.B, mb.S) for mb in r] for r in q.ranks]).max(axis=0).sum()) + opt
        tokens += p.tokens
    out = {k: tokens / (v / 1e3) for k, v in sums.items()}
    rng = np.random.default_rng([seed, 17])
    run = summarize([StepTimes.of(q, cluster.times(q, rng), optim_ms) for q in reformed])
    out["reform_drawn"], out["reform_idle_drawn"] = run.tokens_per_s, run.idle_fraction
    out["reform_measured_share"] = cluster.measured_share(reformed)
    out["reform_slots"] = float(np.mean([q.num_slots for q in reformed]))
    out["tokens"] = tokens
    return out

"""scheduling/step_bound.py: the bounds on any one-step planner against hand-computed values and brute force, and
never above what a planner reaches on the same steps."""

import itertools

import numpy as np
import pytest

from scheduling.planner import MicroBatch, StepPlan
from scheduling.simulate import DEFAULT_MIX, Mix, plan_run
from scheduling.step_bound import (PerSample, rank_bound, reform_bounds, reform_step, run_bounds, slot_optimum,
                                   step_counts)
from scheduling.truth import Cluster, ModelTruth


def _brute_slot_min(costs, R):
    """The least Σ_k max over every assignment of the micro-batches to ceil(n/R) slots of at most R each."""
    n, K = len(costs), -(-len(costs) // R)
    best = np.inf
    for slots in itertools.product(range(K), repeat=n):
        if max(np.bincount(slots, minlength=K)) <= R:
            best = min(best, sum(max([c for c, s in zip(costs, slots) if s == k], default=0.0) for k in range(K)))
    return best


def test_a_hand_made_two_rank_step():
    costs = [50.0, 30.0, 20.0, 20.0]
    # Σ/R = 60 beats c_1 = 50 and c_2 + c_3 = 50; per slot, {50, 30} {20, 20} is best: 50 + 20
    assert rank_bound(costs, 2) == 60.0
    assert slot_optimum(costs, 2) == 70.0 == _brute_slot_min(costs, 2)


@pytest.mark.parametrize("R", [2, 3])
def test_sorted_groups_are_the_slot_optimum(R):
    rng = np.random.default_rng(R)
    for _ in range(20):
        costs = list(rng.uniform(1, 10, size=int(rng.integers(R + 1, 7))).round(2))
        assert slot_optimum(costs, R) == pytest.approx(_brute_slot_min(costs, R))
        assert rank_bound(costs, R) <= slot_optimum(costs, R) + 1e-9


def _t(B, S):  # 1 ms fixed + 1 ms per 100 tokens
    return 1.0 + B * S / 100


def test_reformed_bounds_on_a_hand_made_step():
    ps = PerSample.of(_t, [100, 1000], m_mem=400)
    # short: B ≤ 4, t(4) = 5 → 1.25 a sample, 5 a micro-batch at most; long: B = 1, 11
    assert (ps.e[100], ps.w[100], ps.e[1000], ps.B_max[1000]) == (1.25, 5.0, 11.0, 1)
    rank, slot = reform_bounds({1000: 1, 100: 8}, 2, ps)
    # W = 11 + 8 · 1.25 = 21; rank: max(21 / 2, t(1, 1000) = 11) = 11; slot: the long sample's slot idles the other
    # rank ≥ 11 − 5, which the later slots must carry: 21 / 2 + (2 − 1) · 6 / 2 = 13.5
    assert (rank, slot) == (11.0, 13.5)


def _plan(counts: dict, R: int) -> StepPlan:
    mbs, i = [], 0
    for S, n in counts.items():
        for _ in range(n):
            mbs.append(MicroBatch(0 if S == 100 else 1, (i,), (1.0,), S, _t(1, S)))
            i += 1
    slots = -(-len(mbs) // R)
    pad = MicroBatch(0, (0,), (0.0,), 100, _t(1, 100))
    grid = [[mbs[k * R + r] if k * R + r < len(mbs) else pad for k in range(slots)] for r in range(R)]
    return StepPlan(0, 0, i, tuple(tuple(row) for row in grid))


def test_reform_step_keeps_the_samples_and_meets_its_bound_on_the_hand_made_step():
    plan = _plan({1000: 1, 100: 8}, 2)
    q = reform_step(plan, _t, m_mem=400)
    ids = sorted(i for r in q.ranks for mb in r for i, w in zip(mb.ids, mb.weights) if w > 0)
    assert ids == list(range(9)) and step_counts(q) == {1000: 1, 100: 8}
    t_RM = np.array([[_t(mb.B, mb.S) for mb in r] for r in q.ranks])
    # {long, 4 short} then {2 short, 2 short}: 11 + 3, against the bound 13.5 and the one-sample plan's 11 + 4·2
    assert t_RM.max(axis=0).sum() == 14.0


def test_no_bound_is_above_what_the_planners_reach_on_a_simulated_run():
    mix = Mix.of(DEFAULT_MIX)
    cost = lambda B, S: 20.0 + B * (S / 40 + S * S / 4e6)  # noqa: E731
    sizes, R, M = [30, 14, 7, 4, 2, 1, 1], 4, 3
    cluster = Cluster(ModelTruth(cost))
    plans = plan_run(cost, mix, "dual_constraint", sizes, R, M, steps=40, seed=3, planner="stream")
    ps = PerSample.of(cost, mix.S, m_mem=80_000)
    for p in plans:
        real = [cost(mb.B, mb.S) for r in p.ranks for mb in r if mb.num_real]
        stream = np.array([[cost(mb.B, mb.S) for mb in r] for r in p.ranks]).max(axis=0).sum()
        q = reform_step(p, cost, 80_000)
        reform = np.array([[cost(mb.B, mb.S) for mb in r] for r in q.ranks]).max(axis=0).sum()
        rank, slot = reform_bounds(step_counts(p), R, ps)
        assert rank_bound(real, R) <= slot_optimum(real, R) + 1e-9 <= stream + 2e-9
        assert rank <= slot + 1e-9 <= reform + 2e-9 and slot <= slot_optimum(real, R) + 1e-9
    out = run_bounds(plans, cluster, optim_ms=40.0, m_mem=80_000, cost_fn=cost)
    assert out["stream"] <= out["sorted"] <= out["rank_bound"] and out["sorted"] <= out["reform_slot_bound"]
    assert out["reform"] <= out["reform_slot_bound"] <= out["reform_rank_bound"]
    assert out["reform"] > out["sorted"]  # on this mix re-forming gains over the table's micro-batches

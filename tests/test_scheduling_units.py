"""Small scheduling rules pinned one at a time (each kills mutants of scheduling/ that its other fast tests let
live; results/mutation.md): a refused value names its field, a memory model without a per-token cost refuses to
bound a batch, idle fraction and CV at their edges, a mix's shares normalised, a sweep setting's factor."""
import math

import numpy as np
import pytest

from scheduling.batching import dual_constraint_batch_size
from scheduling.cost_model import MemoryModel
from scheduling.efficiency import cv, idle_fraction
from scheduling.simulate import Mix, _setting


@pytest.mark.parametrize("field, args", [("scheduling.m_mem", (10, 0, 100.0, 1.0)),
                                         ("scheduling.m_comp", (10, 100, -1.0, 1.0)),
                                         ("scheduling.p", (10, 100, 100.0, math.nan))])
def test_dual_constraint_names_the_field_it_refuses(field, args):
    with pytest.raises(ValueError, match=rf"^{field} must be a positive finite number"):
        dual_constraint_batch_size(*args)


def test_a_memory_model_without_a_per_token_cost_cannot_bound_a_batch():
    with pytest.raises(ValueError, match=r"no per-token cost \(c1 ≤ 0\)"):
        MemoryModel(c0=1.0, c1=0.0).max_batch(16, 1e9)
    assert MemoryModel(c0=0.0, c1=1.0).max_batch(16, 160.0) == 10


def test_idle_fraction_of_times_below_one_ms_and_cv_of_one_value():
    t = np.array([[0.2, 0.1], [0.1, 0.1]])  # the slowest rank's slots sum to 0.3 ms; two ranks
    assert idle_fraction(t) == pytest.approx(1 - 0.5 / 0.6)
    assert idle_fraction(np.zeros((2, 2))) == 0.0
    assert cv([3.0]) == 0.0 and cv([1.0, 3.0]) == pytest.approx(0.5)


def test_a_mix_is_normalised_to_shares_that_sum_to_one():
    mix = Mix.of([("a", 16, 1.0), ("b", 64, 3.0)])
    assert mix.share == (0.25, 0.75) and mix.S == (16, 64)


@pytest.mark.parametrize("strategy, want", [
    ("equal_token", {"m_tokens": 300, "factor": 1.5}),
    ("dual_constraint", {"m_comp": 300.0, "p": 1.2, "m_mem": 1000.0, "factor": 1.5}),
    ("cost", {"target_microbatch_ms": 300.0, "m_mem": 1000.0, "factor": 1.5}),
])
def test_a_sweep_setting_is_the_knobs_value_and_its_factor_of_the_base(strategy, want):
    assert _setting(strategy, 300.0, 200.0, 1.2, 1000.0) == want


def test_a_calibrations_optimizer_step_is_its_modes_optim_ms_or_none():
    from scheduling.calibrate import Calibration

    cal = Calibration({"modes": {"eager": {"optim_ms": 3.5}, "graphs": {"optim_ms": None}, "compiled": {}}})
    assert (cal.optim_ms("eager"), cal.optim_ms("graphs"), cal.optim_ms("compiled")) == (3.5, 0.0, 0.0)


def test_a_measured_point_without_a_feasible_flag_is_measured():
    from scheduling.truth import MeasuredTruth

    truth = MeasuredTruth.from_points([{"S": 16, "B": 1, "ms": 2.0}, {"S": 16, "B": 4, "ms": 99.0, "feasible": False}])
    assert truth.mean(2, 16) == pytest.approx(4.0)  # one point at S = 16: ∝ B through it; the infeasible one is out


def test_settings_at_a_fixed_batch_hold_g_within_the_tolerance_and_equal_token_stays_under_m_mem():
    from scheduling.simulate import TOKENS_TOL, settings_at_tokens

    mix = Mix.of([("a", 16, 1.0), ("b", 64, 1.0)])
    found = settings_at_tokens("equal_token", mix, lambda B, S: float(B * S), None, 512.0, 1000.0, M_max=8)
    assert found and all(1 <= M <= 8 and setting["M"] == M for setting, _, M in found)
    assert all(abs(setting["tokens_per_step"] - 1000.0) <= TOKENS_TOL * 1000.0 for setting, _, _ in found)
    assert all(setting["m_tokens"] <= 512 for setting, _, _ in found)


def test_a_simulated_run_carries_its_strategy():
    from scheduling.simulate import simulate

    mix = Mix.of([("a", 16, 1.0), ("b", 64, 1.0)])
    run = simulate(lambda B, S: float(B * S), mix, "equal_token", [8, 2], 2, M=2, steps=3)
    assert run.strategy == "equal_token" and run.M == 2


def _plan(R, M, S=10):
    from scheduling.planner import MicroBatch, StepPlan

    return StepPlan(0, 0, 1, tuple(tuple(MicroBatch(0, (0,), (1.0,), S, 1.0) for _ in range(M)) for _ in range(R)))


def test_a_measured_s_between_two_others_is_interpolated_from_its_neighbours_in_log_space():
    from scheduling.truth import MeasuredTruth

    truth = MeasuredTruth({(16, 1): [1.0], (64, 1): [2.0], (256, 1): [8.0]})
    assert truth.mean(1, 128) == pytest.approx(4.0)  # halfway from 64 to 256 in log S: √(2 · 8)
    assert truth.mean(1, 32) == pytest.approx(2 ** 0.5)


def test_a_slow_rank_outside_the_cluster_is_ignored_and_a_step_has_no_optimizer_time_by_default():
    from scheduling.replay import step_times
    from scheduling.truth import Cluster, MeasuredTruth

    cluster = Cluster(MeasuredTruth({(10, 1): [1.0]}), slow_ranks={1: 2.0, 2: 5.0})
    assert cluster.times(_plan(2, 3), np.random.default_rng(0)).tolist() == [[1.0] * 3, [2.0] * 3]
    assert step_times([_plan(2, 3)])[0].optim_ms == 0.0


def test_settings_at_a_fixed_batch_spread_per_m_tables_evenly_and_one_takes_the_first():
    """per_M tables per M, evenly over the admissible ones sorted by tokens a micro-batch (--per-m 1 took a
    ZeroDivisionError)."""
    from scheduling.simulate import settings_at_tokens

    mix = Mix.of([("a", 16, 1.0), ("b", 64, 1.0)])
    args = ("equal_token", mix, lambda B, S: float(B * S), None, 4096.0, 1000.0)
    every = settings_at_tokens(*args, M_max=2, per_M=1000)
    for per_M in (1, 2, 3):
        got = settings_at_tokens(*args, M_max=2, per_M=per_M)
        for M in (1, 2):
            ok = [s for s in every if s[2] == M]
            assert len(ok) > 3
            want = {1: [ok[0]], 2: [ok[0], ok[-1]], 3: [ok[0], ok[round((len(ok) - 1) / 2)], ok[-1]]}[per_M]
            assert [s for s in got if s[2] == M] == want


def test_a_fixed_batch_sweep_draws_its_candidates_from_its_seed_and_its_winner_from_the_next():
    import math

    from scheduling.simulate import settings_at_tokens, simulate, sweep_at_tokens

    mix = Mix.of([("a", 1000, 0.6), ("b", 4000, 0.4)])
    cost = lambda B, S: 1.0 + B * S / 1e3  # noqa: E731
    best, runs = sweep_at_tokens(cost, mix, "equal_token", 4, 8000.0, p=None, m_mem=1e5, seed=3, mbs=64,
                                 mbs_final=128, M_max=2, per_M=2, residuals=[-0.2, 0.2])
    for r in runs:
        again = simulate(cost, mix, "equal_token", r.batch_sizes, 4, r.M, max(8, math.ceil(64 / (4 * r.M))), 3,
                         residuals=[-0.2, 0.2], setting=r.setting)
        assert r.tokens_per_s == again.tokens_per_s
    other = sweep_at_tokens(cost, mix, "equal_token", 4, 8000.0, p=None, m_mem=1e5, seed=0, mbs=64, mbs_final=128,
                            M_max=2, per_M=2, residuals=[-0.2, 0.2])[1]
    assert [r.tokens_per_s for r in other] != [r.tokens_per_s for r in runs]  # the seed draws the samples and noise
    assert best.steps == max(8, math.ceil(128 / (4 * best.M)))
    top = max((r for r in runs if r.tokens_step_cv <= 0.1), key=lambda r: r.tokens_per_s)  # on the next seed
    again = simulate(cost, mix, "equal_token", top.batch_sizes, 4, top.M, best.steps, 4, residuals=[-0.2, 0.2],
                     setting=top.setting)
    assert (best.batch_sizes, best.tokens_per_s) == (top.batch_sizes, again.tokens_per_s)
    assert len(runs) == len(settings_at_tokens("equal_token", mix, cost, None, 1e5, 8000.0, 2, 2))  # per_M = 2
    # micro-batches of at most 4500 tokens: no M = 1 holds g = 8000, and the final draw's steps follow M
    best = sweep_at_tokens(cost, mix, "equal_token", 4, 8000.0, p=None, m_mem=4500, mbs=64, M_max=4, per_M=2)[0]
    assert best.M >= 2 and best.steps == max(8, math.ceil(16384 / (4 * best.M)))  # mbs_final's default


def test_dual_constraint_takes_k_at_m_comp_exactly_k_times_s_to_the_p():
    """m_comp = k·S^p is the simulator's knob at S_max (factor · S_max^p); in floating point k·x // x gives k − 1 for
    S = 1560, p = 1.1, k = 9 (and about one k in six), the paper's rule ⌊m_comp / S^p⌋ says k."""
    from scheduling.batching import dual_constraint_batch_size

    assert (9 * 1560 ** 1.1) // 1560 ** 1.1 == 8  # the float trap the rule must not fall into
    for S in (1560, 3600, 7800, 14040, 32760, 75600):
        for p in (1.0, 1.1, 1.3, 1.45):
            for k in range(1, 60):
                assert dual_constraint_batch_size(S, 1e12, k * S ** p, p) == k
                assert dual_constraint_batch_size(S, 1e12, (k + 0.5) * S ** p, p) == k
                assert dual_constraint_batch_size(S, 1e12, (k - 1e-6) * S ** p, p) == max(1, k - 1)

"""The simulator's truth apart from the planner's model, FSDP's collectives, and a fixed global batch."""
import math

import numpy as np
import pytest

from scheduling.planner import plan_step
from scheduling.cost_model import CostModel
from scheduling.simulate import Mix, settings_at_tokens, simulate, sizes_for, sweep_at_tokens, tokens_per_step
from scheduling.truth import Cluster, CommModel, MeasuredTruth, ModelTruth

QUAD = CostModel("quadratic", {"a": 30.0, "b0": 4.0, "b1": 0.02, "b2": 1.5e-6})
MIX = Mix.of([("img", 1560, 0.4), ("v17", 7800, 0.3), ("v33", 14040, 0.2), ("v81", 32760, 0.1)])


def test_measured_truth_draws_repeats_and_interpolates_between_measurements():
    truth = MeasuredTruth({(1000, 1): [10.0, 12.0], (1000, 5): [30.0], (4000, 1): [40.0], (4000, 3): [100.0]})
    rng = np.random.default_rng(0)
    assert {truth.draw(1, 1000, rng) for _ in range(50)} == {10.0, 12.0}  # a measured micro-batch: its own runs
    assert truth.mean(3, 1000) == pytest.approx(11 + (30 - 11) / 4 * 2)  # the line through B = 1 and 5
    assert truth.mean(2, 4000) == pytest.approx(70.0)
    at2000 = math.exp(0.5 * math.log(truth.mean(2, 1000)) + 0.5 * math.log(truth.mean(2, 4000)))
    assert truth.mean(2, 2000) == pytest.approx(at2000)  # log-linear in log S, half way in log S
    assert truth.mean(1, 8000) > truth.mean(1, 4000)  # extrapolated along the last two lengths
    assert truth.noise.mean() == pytest.approx(0.0, abs=1e-12) and np.abs(truth.noise).max() == pytest.approx(1 / 11)


def test_below_the_smallest_measured_b_the_truth_never_falls_under_proportional():
    """Two points whose line is steep (B = 40: 100 ms, B = 48: 180 ms: 10 ms a sample, −300 ms at B = 0) would put
    B = 30 at 0 ms; a micro-batch's fixed part is not negative, so the truth keeps ≥ 100 · 30/40 = 75 ms there
    (at B = 39 the line's 90 ms lies under 97.5: 97.5), and the line wherever it lies above that."""
    t = MeasuredTruth({(1560, 40): [100.0], (1560, 48): [180.0]})
    assert t.mean(30, 1560) == pytest.approx(75.0)
    assert t.mean(39, 1560) == pytest.approx(100.0 * 39 / 40)
    assert t.mean(44, 1560) == pytest.approx(140.0)  # between the points: the line
    assert t.mean(60, 1560) == pytest.approx(300.0)  # above: the line, extrapolated
    flat = MeasuredTruth({(1560, 40): [100.0], (1560, 48): [104.0]})  # a large fixed part: the line is above
    assert flat.mean(20, 1560) == pytest.approx(90.0)


def test_fsdp_comm_hides_behind_compute_but_the_first_gather():
    comm = CommModel(param_bytes=8e9, grad_bytes=8e9, blocks=10, bandwidth=400.0, inter_node_bandwidth=40.0)
    assert comm.ms(8) == pytest.approx(24e9 * 7 / 8 / 400e9 * 1e3)  # 52.5 ms
    assert comm.ms(16) == pytest.approx(24e9 * 15 / 16 / 40e9 * 1e3) and comm.ms(1) == 0
    t = np.array([[10.0, 200.0], [60.0, 30.0]])
    assert np.allclose(comm.apply(t, 8), np.maximum(t, 52.5) + 5.25)


def test_a_planted_slow_length_shows_as_idle_the_planner_cannot_see():
    sizes = sizes_for("balanced", MIX, {"target_microbatch_ms": 3000.0, "m_mem": 2e5}, QUAD.predict)
    run = lambda cluster: simulate(QUAD.predict, MIX, "balanced", sizes, R=8, M=2, steps=200, cluster=cluster)  # noqa
    exact = run(Cluster(ModelTruth(QUAD.predict)))
    slow = run(Cluster(ModelTruth(QUAD.predict), slow_S={7800: 1.6}))
    assert exact.idle_fraction < 0.05 and slow.idle_fraction > exact.idle_fraction + 0.08
    assert slow.compute_cv_pred == pytest.approx(exact.compute_cv_pred)  # the planner predicted the same


def test_a_slow_rank_makes_the_others_wait():
    one = Mix.of([("only", 1000, 1.0)])
    r = simulate(lambda B, S: 100.0, one, "equal_token", [1], R=4, M=1, steps=20,
                 cluster=Cluster(ModelTruth(lambda B, S: 100.0), slow_ranks={2: 1.5}))
    assert r.idle_fraction == pytest.approx(1 - (3 * 100 + 150) / (4 * 150))
    assert r.time_s == pytest.approx(20 * 0.150)


def test_tokens_per_step_matches_the_planner_and_every_candidate_holds_g():
    sizes = [12, 3, 1, 1]
    plans_tokens = []
    table = MIX.table(20000, seed=1)
    pos = 0
    for _ in range(300):
        plan, pos = plan_step(table, 1, 0, pos, 4, "equal_token", 3, sizes, QUAD.predict)
        plans_tokens.append(plan.tokens / 4)
    assert np.mean(plans_tokens) == pytest.approx(tokens_per_step(MIX, sizes, 3), rel=0.03)
    g = 2 * MIX.S_max
    for strategy in ("equal_token", "dual_constraint", "balanced"):
        cands = settings_at_tokens(strategy, MIX, QUAD.predict, 1.5, 2e5, g, M_max=8, per_M=3)
        assert cands and all(abs(M * tokens_per_step(MIX, sz, 1) - g) <= 0.1 * g for _, sz, M in cands)
        assert {M for _, _, M in cands} >= {1, 2}  # several M hold it, each with its own batch table
    best, runs = sweep_at_tokens(QUAD.predict, MIX, "balanced", 8, g, p=1.5, m_mem=2e5, mbs=512, mbs_final=1024,
                                 M_max=4, per_M=2)
    assert best.tokens_per_s == pytest.approx(max(r.tokens_per_s for r in runs), rel=0.05)
    assert abs(best.tokens / best.steps / 8 - g) <= 0.15 * g  # simulated tokens a rank a step: g ± 10 % + draws


@pytest.mark.slow
def test_the_protocol_records_what_training_reads_for_tokens_per_step(tmp_path):
    """run_fixed_batch's best settings go into the calibration; resolve_schedule with tokens_per_step takes the
    nearest simulated g and world size, and its batch table holds g within ±10 % on the corpus' own mix."""
    from scheduling.calibrate import Point, fit_mode, new_calibration
    from scheduling.config import SchedulingConfig
    from scheduling.policy import ModelShape, resolve_schedule
    from scheduling.protocol import inputs_from, record_chosen_at_g, run_fixed_batch

    pts = [Point("b", S, B, True, QUAD.predict(B, S), [QUAD.predict(B, S) * f for f in (0.99, 1.01)], 5.0,
                 1e9 + 1e5 * B * S) for B, S in [(1, 1560), (40, 1560), (1, 7800), (8, 7800), (1, 14040), (4, 14040),
                                                 (1, 32760), (2, 32760)]]
    cal = new_calibration({"full": fit_mode(pts)}, model={"dim": 1536, "num_layers": 30}, source="t", device="t",
                          date="t", command="t", hbm_bytes=64e9)
    path = str(tmp_path / "cal.json")
    cal.save(path)
    inp = inputs_from(cal, "full", MIX)
    res = run_fixed_batch(inp, MIX, ranks=(8,), g_factors=(2.0,), mbs=256, mbs_final=512, per_M=2,
                          model_truth=False, log=lambda s: None)
    record_chosen_at_g(cal, res, MIX, "full", inp.m_mem)
    cal.save(path)
    best = res["steady"][(8, 2.0, "balanced")]
    tokens = dict(zip(MIX.names, MIX.S))
    shares = dict(zip(MIX.names, MIX.share))
    s = resolve_schedule(SchedulingConfig("balanced", calibration=path, tokens_per_step=2 * MIX.S_max,
                                          window=best.window), tokens,  # a window only where the config asks
                         ModelShape(1, 30, 1536, 512), world_size=8, shares=shares)
    assert s.micro_batches == best.M and s.window == best.window
    assert s.values["target_microbatch_ms"] == best.setting["target_microbatch_ms"]
    assert s.sources["micro_batches"].startswith("calibration:chosen")
    assert abs(s.values["tokens_per_step"] - 2 * MIX.S_max) <= 0.1 * 2 * MIX.S_max
    # without a choice for it in the file (equal_token needs no calibration): every setting that holds g
    e = resolve_schedule(SchedulingConfig("equal_token", tokens_per_step=3 * MIX.S_max), tokens,
                         ModelShape(1, 30, 1536, 512), world_size=8, shares=shares)
    assert abs(e.values["tokens_per_step"] - 3 * MIX.S_max) <= 0.1 * 3 * MIX.S_max and e.micro_batches >= 1
    assert e.sources["micro_batches"] == "chosen for tokens_per_step (predicted tokens/s)"


def test_the_simulator_takes_a_measured_point_over_its_interpolation_and_reports_both():
    """A measured (S, B) whose time is far from what the other points interpolate to: the simulator runs it at its
    measured time (every step 100 ms, not the 20 ms the line through B = 1 and 4 gives), the leave-one-out says how
    far interpolation would have been, and the measured share tells a measured cell from an interpolated one."""
    truth = MeasuredTruth({(1000, 1): [10.0], (1000, 4): [40.0], (1000, 2): [100.0, 100.0]})
    one = Mix.of([("only", 1000, 1.0)])
    measured = simulate(QUAD.predict, one, "equal_token", [2], R=1, M=1, steps=10, cluster=Cluster(truth))
    assert measured.time_s == pytest.approx(10 * 0.100) and measured.measured_share == pytest.approx(1.0)
    # B = 3 was not measured: the line through its two nearest measured B (2 and 4), 100 − 60 / 2 = 70 ms a step
    between = simulate(QUAD.predict, one, "equal_token", [3], R=1, M=1, steps=10, cluster=Cluster(truth))
    assert between.time_s == pytest.approx(10 * 0.070) and between.measured_share == 0.0
    loo = {(S, B): e for S, B, _, e in truth.loo_errors()}
    assert loo[(1000, 2)] == pytest.approx(20.0 / 100.0 - 1.0)  # without it, the line through B = 1 and 4
    assert loo[(1000, 1)] == pytest.approx((100 + 30) / 10 - 1)  # the line through B = 2 and 4, back to B = 1
    assert simulate(QUAD.predict, one, "equal_token", [2], R=1, M=1, steps=4).measured_share == 0.0  # model truth


def test_the_policy_truth_blends_the_measured_policies_as_the_planner_blends_their_fits():
    """checkpointing=auto's truth: a micro-batch that runs one policy whole at a point that policy measured draws it;
    k of L blocks recomputed (j keeping attention) blends the policies' times; beyond a policy's measured lengths it
    is full's time × their ratio at the policy's longest length."""
    from scheduling.truth import PolicyTruth

    none = MeasuredTruth({(1000, 1): [10.0], (1000, 3): [30.0], (2000, 1): [25.0], (2000, 2): [50.0]})
    full = MeasuredTruth({(1000, 1): [14.0], (1000, 3): [42.0], (2000, 1): [35.0], (2000, 2): [70.0],
                          (8000, 1): [400.0]})
    keep = MeasuredTruth({(1000, 1): [12.0], (1000, 3): [36.0], (2000, 1): [30.0], (8000, 1): [330.0]})
    decide = lambda B, S: (0, 0) if B * S <= 2000 else (10, 10) if B * S <= 4000 else (10, 4)  # noqa: E731
    t = PolicyTruth({"none": none, "full": full, "keep": keep}, decide, layers=10)
    rng = np.random.default_rng(0)
    assert t.draw(1, 2000, rng) == 25.0 and t.is_measured(1, 2000)  # none, measured
    assert t.draw(2, 2000, rng) == 30.0 * 2 and not t.is_measured(2, 2000)  # keep whole, keep's line at B = 2
    assert t.draw(3, 1000, rng) == 36.0 and t.is_measured(3, 1000)  # keep whole, measured
    # (10, 4) at S = 8000: none beyond its lengths is full × none/full at S = 2000 (25 / 35)
    t_none = 400.0 * 25.0 / 35.0
    assert t.policy_mean("none", 1, 8000) == pytest.approx(t_none)
    # below a policy's shortest length: full's time × their ratio there (S = 1000), not at its longest
    short = PolicyTruth({"none": MeasuredTruth({(1000, 1): [10.0], (2000, 1): [30.0]}),
                         "full": MeasuredTruth({(500, 1): [6.0], (1000, 1): [14.0], (2000, 1): [35.0]})}, decide, 10)
    assert short.policy_mean("none", 1, 500) == pytest.approx(6.0 * 10.0 / 14.0)
    assert t.mean(1, 8000) == pytest.approx(400.0 - 4 / 10 * (400.0 - 330.0))
    assert t.policy(1, 8000) is None and not t.is_measured(1, 8000)
    noise = np.concatenate([x.noise for x in (none, full, keep)])  # a blend draws from every policy's spread
    assert t.draw(1, 8000, np.random.default_rng(5)) == pytest.approx(
        t.mean(1, 8000) * (1 + np.random.default_rng(5).choice(noise)))
    loo = {(pol, S, B): e for pol, S, B, _, e in t.loo_errors()}
    assert loo[("keep", 8000, 1)] == pytest.approx(400.0 * 30.0 / 35.0 / 330.0 - 1)  # by the ratio at S = 2000
    with pytest.raises(ValueError, match="none and full"):
        PolicyTruth({"full": full}, decide, 10)


def test_truth_points_of_another_file_join_the_truth_and_the_planner_keeps_its_own_model(tmp_path):
    """--truth-points: a second calibration of the same model (a slice timed at the simulation's own micro-batches)
    adds its measured (S, B), scaled to the full depth as its own file says (×40/4 here), to the truth; the cost
    model stays the first file's; a file of another model is refused."""
    from scheduling.calibrate import Point, fit_mode, new_calibration
    from scheduling.protocol import extra_truth_points, inputs_from

    quad = lambda B, S: 50 + 15 * B + 0.07 * B * S + 3e-6 * B * S * S  # noqa: E731
    shapes = [(48, 1560), (94, 1560), (1, 7800), (9, 7800), (1, 32760), (2, 32760), (1, 75600)]
    model = {"dim": 5120, "num_layers": 40, "params": 1.4e10}

    def cal_file(name, pts, scale, model=model):
        rec = fit_mode([Point("b", S, B, True, ms, [ms, ms], 1.0) for B, S, ms in pts], scale=scale)
        rec["memory_model"] = {"c0": 1e9, "c1": 2e5, "c2": 0.0}
        c = new_calibration({"full": rec}, model=model, source="measured", device="t", date="t", command="t",
                            hbm_bytes=150e9, extrapolation={"blocks_timed": 40 / scale, "num_layers": 40,
                                                            "scale": scale})
        c.save(str(tmp_path / name))
        return str(tmp_path / name)

    first = new_calibration({"full": fit_mode([Point("b", S, B, True, quad(B, S), [quad(B, S)], 1.0)
                                               for B, S in shapes])}, model=model, source="t", device="t", date="t",
                            command="t", hbm_bytes=150e9)
    first.data["modes"]["full"]["memory_model"] = {"c0": 1e9, "c1": 2e5, "c2": 0.0}
    second = cal_file("points.json", [(98, 1560, 300.0), (1, 75600, 2000.0), (18, 7800, 250.0)], 10.0)
    extra = extra_truth_points(first, "full", [second], None)
    assert extra == {(1560, 98): [3000.0, 3000.0], (75600, 1): [20000.0, 20000.0], (7800, 18): [2500.0, 2500.0]}
    inp = inputs_from(first, "full", Mix.of([("i", 1560, 0.5), ("v", 75600, 0.5)]), measured_extra=extra)
    assert inp.truth.is_measured(98, 1560) and inp.truth.mean(98, 1560) == pytest.approx(3000.0)
    assert inp.truth.mean(48, 1560) == pytest.approx(quad(48, 1560))  # the first file's own points stay
    assert inp.cost.predict(98, 1560) == pytest.approx(first.cost_model("full").predict(98, 1560))
    other = cal_file("other.json", [(98, 1560, 300.0), (1, 75600, 2000.0), (18, 7800, 250.0)], 10.0,
                     model={"dim": 1536, "num_layers": 30, "params": 1.3e9})
    with pytest.raises(ValueError, match=r"--truth-points .*other.json: measured on a model of dim 1536 and 30 "
                                         r"layers, not \(5120, 40\)"):
        extra_truth_points(first, "full", [other], None)


def test_fsdps_collectives_hold_every_slot_to_their_time_and_add_the_first_units_gather():
    """Cluster.times with a CommModel: each (rank, slot) takes max(compute, c) + c / blocks, c the collectives' ms
    at R; without one, the truth's times alone."""
    from types import SimpleNamespace

    from scheduling.truth import Cluster, CommModel, ModelTruth

    comm = CommModel(param_bytes=7e9, grad_bytes=7e9, blocks=4, bandwidth=350.0)
    c = comm.ms(2)
    assert c == pytest.approx(3 * 7e9 / 2 / 350e9 * 1e3)  # 30 ms
    plan = SimpleNamespace(ranks=[[SimpleNamespace(B=1, S=1000), SimpleNamespace(B=5, S=1000)]] * 2)
    truth = ModelTruth(lambda B, S: 10.0 * B)  # 10 and 50 ms
    rng = np.random.default_rng(0)
    with_comm = Cluster(truth, comm).times(plan, rng)
    np.testing.assert_allclose(with_comm, [[c + c / 4, 50.0 + c / 4]] * 2)  # 10 ms waits for the 30
    assert Cluster(truth).times(plan, rng).tolist() == [[10.0, 50.0]] * 2
    assert Cluster(truth, comm, {1: 2.0}).describe(2) == ("truth: model; " + comm.describe(2) + "; slow ranks {1: 2.0}")
    assert Cluster(truth).describe(2) == "truth: model"


def test_a_replays_extra_measurements_join_the_calibrations_points():
    points = [{"S": 1000, "B": 1, "ms": 10.0, "ms_runs": [9.0, 11.0]}, {"S": 1000, "B": 4, "ms": 40.0}]
    truth = MeasuredTruth.from_points(points, {(1000, 2): [22.0, 18.0], (1000.0, 4.0): [44.0]})
    assert truth.is_measured(2, 1000) and truth.mean(2, 1000) == pytest.approx(20.0)
    assert truth.mean(4, 1000) == pytest.approx(42.0) and truth.mean(1, 1000) == pytest.approx(10.0)


def test_outside_the_measured_b_the_truth_follows_the_widest_pair_not_the_nearest():
    """Three clustered measurements at one S (B = 38, 39, 42; t = 10 + 2.5·B, 1 % high at 38): at B = 26 the line
    through the nearest two (38, 39) would give 106.05 − 12·1.45 = 88.65 ms; through the smallest and the largest
    (38, 42) 106.05 − 12·8.95/4 = 79.2 (true: 75); between measured B, the bracketing pair."""
    t = MeasuredTruth({(3600, 38): [105.0 * 1.01], (3600, 39): [107.5], (3600, 42): [115.0]})
    assert t.mean(26, 3600) == pytest.approx(106.05 - 12 * 8.95 / 4)
    assert t.mean(50, 3600) == pytest.approx(106.05 + 12 * 8.95 / 4)
    assert t.mean(40, 3600) == pytest.approx(107.5 + 7.5 / 3)  # between 39 and 42

"""scheduling/replay.py and scripts/replay_plans.py: the run's numbers from per-(rank, slot) times by hand, a
hand-made plan through the replay's and the simulator's paths, the simulator's numbers against its plans priced by a
loop of the test's own, and a tiny replay on the CPU whose rows are exactly the
plans' micro-batches, each timed once."""
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from scheduling.planner import MicroBatch, StepPlan
from scheduling.batching import batch_sizes
from scheduling.calibrate import Calibration
from scheduling.cost_model import CostModel
from scheduling.replay import (StepTimes, evaluate, execution_order, plan_steps, step_times, summarize,
                               to_grid)
from scheduling.simulate import DEFAULT_MIX, Mix, samples_per_step, simulate
from tests.helpers import ROOT

QUAD = CostModel("quadratic", {"a": 15.7, "b1": 0.0238, "b2": 1.44e-6})


def test_one_step_by_hand():
    # rank 0 runs 10 then 30 ms, rank 1 20 then 10: slots wait 20 and 30 ms
    s = summarize([StepTimes(np.array([[10.0, 30.0], [20.0, 10.0]]), np.ones((2, 2), bool), tokens=1000,
                             samples=4, optim_ms=8.0)])
    assert s.time_s == pytest.approx((20 + 30 + 8 / 2) / 1e3)  # the optimizer sharded over R = 2
    assert s.tokens_per_s == pytest.approx(1000 / 0.054)
    assert s.samples_per_s == pytest.approx(4 / 0.054)
    assert s.idle_fraction == pytest.approx(1 - 70 / (2 * 50))  # 0.3
    assert s.compute_cv == pytest.approx(5 / 35)  # rank totals 40 and 30
    assert s.step_time_cv == 0 and s.compute_cv_pred is None
    assert (s.steps, s.R, s.M, s.optim_ms, s.step_ms) == (1, 2, 2, 8.0, [pytest.approx(54.0)])


def test_padding_slots_are_idle_but_take_their_time():
    t = np.array([[10.0, 30.0], [20.0, 10.0]])
    real = np.array([[True, True], [True, False]])  # rank 1's slot 1 is a padding micro-batch
    s = summarize([StepTimes(t, real, tokens=1000, samples=3)])
    assert s.idle_fraction == pytest.approx(1 - 60 / (2 * 50))  # 0.4: its 10 ms are idle
    assert s.compute_cv == pytest.approx(5 / 35)  # its time still counts as the rank's
    assert s.time_s == pytest.approx(0.050)


def test_several_steps_pool_time_and_idle_and_spread_step_times():
    a = StepTimes(np.array([[10.0, 30.0], [20.0, 10.0]]), np.ones((2, 2), bool), 1000, 4, optim_ms=8.0,
                  pred_ms=np.array([[10.0, 10.0], [10.0, 10.0]]))
    b = StepTimes(np.array([[40.0], [40.0]]), np.ones((2, 1), bool), 600, 2, optim_ms=12.0,
                  pred_ms=np.array([[30.0], [10.0]]))
    s = summarize([a, b])
    steps = np.array([54.0, 46.0])  # 20 + 30 + 4 and 40 + 6
    assert s.time_s == pytest.approx(0.100) and s.tokens_per_s == pytest.approx(16_000)
    assert s.idle_fraction == pytest.approx(1 - (70 + 80) / (2 * 50 + 2 * 40))
    assert s.compute_cv == pytest.approx((5 / 35 + 0) / 2)
    assert s.compute_cv_pred == pytest.approx((0 + 0.5) / 2)  # 30 against 10: CV 0.5
    assert s.step_time_cv == pytest.approx(steps.std() / steps.mean())  # 4 / 50
    assert s.M == 2 and s.optim_ms == pytest.approx(10.0)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="at least one step"):
        summarize([])
    with pytest.raises(ValueError, match="one shape"):
        StepTimes(np.zeros((2, 2)), np.ones((2, 3), bool), 1, 1)
    with pytest.raises(ValueError, match="no time"):
        summarize([StepTimes(np.zeros((2, 2)), np.ones((2, 2), bool), 1, 1)])


def _plan(grid_ms, real):
    mk = lambda ms, w: MicroBatch(0, (0,), (1.0 if w else 0.0,), 10, float(ms))  # noqa: E731
    return StepPlan(0, 0, 1, tuple(tuple(mk(ms, w) for ms, w in zip(row, rr)) for row, rr in zip(grid_ms, real)))


def test_execution_order_is_slot_major_and_to_grid_inverts_it():
    plan = _plan([[1, 2, 3], [4, 5, 6]], [[1, 1, 1], [1, 1, 0]])
    order = execution_order(plan)
    assert order == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert to_grid(plan, [10, 40, 20, 50, 30, 60]).tolist() == [[10, 20, 30], [40, 50, 60]]
    # the prediction is the default time source; a function of the micro-batch or one grid per step also serve
    [st] = step_times([plan])
    assert st.t_ms.tolist() == [[1, 2, 3], [4, 5, 6]] and st.real.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert step_times([plan], lambda mb: 2 * mb.pred_ms)[0].t_ms.tolist() == [[2, 4, 6], [8, 10, 12]]
    assert evaluate([plan], [np.full((2, 3), 7.0)], optim_ms=[14.0]).time_s == pytest.approx((21 + 7) / 1e3)
    with pytest.raises(ValueError):
        step_times([plan], [np.zeros((3, 2))])


def test_a_hand_made_plan_takes_the_times_worked_out_by_hand():
    """Two ranks, two slots, the truth B·S/100 ms (the planner's predictions, 0.5 ms each, are not the truth):
    slot 0 waits max(2, 1) = 2 ms, slot 1 max(3, 4) = 4 ms; the optimizer's 8 ms sharded over R = 2 adds 4 ms.
    The replay's path (evaluate with a time per micro-batch) and the simulator's (a cluster's truth) both give it."""
    from scheduling.truth import Cluster, ModelTruth

    truth = lambda B, S: B * S / 100  # noqa: E731
    mb = lambda B, S, pad=0: MicroBatch(0, tuple(range(B)), (1.0,) * (B - pad) + (0.0,) * pad, S, 0.5)  # noqa: E731
    plan = StepPlan(0, 0, 8, ((mb(2, 100), mb(1, 300)),
                              (mb(1, 100), mb(4, 100, pad=1))))  # 3 real samples of 4 in the last micro-batch
    step_ms = 2 + 4 + 8 / 2
    tokens = 200 + 300 + 100 + 300
    busy = 2 + 3 + 1 + 4  # a micro-batch with a padding sample is a real slot: its whole time counts as busy
    for rep in (evaluate([plan], lambda m: truth(m.B, m.S), optim_ms=[8.0]),  # the replay's path
                summarize([StepTimes.of(plan, Cluster(ModelTruth(truth)).times(plan, np.random.default_rng(0)),
                                        8.0)])):  # the simulator's path
        assert rep.time_s == pytest.approx(step_ms / 1e3)
        assert (rep.tokens, rep.samples) == (tokens, 7)
        assert rep.tokens_per_s == pytest.approx(tokens / (step_ms / 1e3))  # 90,000 tokens/s
        # both ranks compute 5 ms, yet each slot waits for its slowest rank (FSDP syncs every micro-batch): 1/6 idle
        assert rep.compute_cv == 0 and rep.idle_fraction == pytest.approx(1 - busy / (2 * 6))
        assert rep.compute_cv_pred == 0  # every prediction 0.5 ms: the plan looked balanced


@pytest.mark.parametrize("strategy,R,window", [("equal_token", 8, 1), ("balanced", 8, 1), ("balanced", 16, 2)])
def test_the_simulators_numbers_are_its_plans_priced_by_an_independent_loop(strategy, R, window):
    """simulate() plans with QUAD and times each micro-batch with a different truth; the same plans priced here by
    a loop of their own — Σ over slots of the slowest rank's truth, plus optim / R — give its tokens/s, samples/s
    and idle."""
    from scheduling.truth import Cluster, ModelTruth

    truth = CostModel("quadratic", {"a": 30.0, "b1": 0.02, "b2": 2.5e-6}).predict  # not the planner's model
    mix, M, steps, seed, optim = Mix.of(DEFAULT_MIX), 4, 12, 3, 35.0
    sizes = (batch_sizes("equal_token", mix.S, m_tokens=mix.S_max) if strategy == "equal_token" else
             batch_sizes(strategy, mix.S, m_mem=4e5, cost_model=QUAD, target_ms=1.5 * QUAD.predict(1, mix.S_max)))
    sim = simulate(QUAD.predict, mix, strategy, sizes, R, M, steps, seed, optim_ms=optim, window=window,
                   cluster=Cluster(ModelTruth(truth)))
    n = int(math.ceil(samples_per_step(mix, sizes, R, M) * steps * 1.1)) + R * M * max(sizes)  # as simulate sizes it
    plans = plan_steps(mix.table(n, seed), seed, R, strategy, M, sizes, QUAD.predict, steps, window=window)
    total_ms = busy_ms = synced_ms = 0.0
    tokens = samples = 0
    for plan in plans:
        assert len(plan.ranks) == R and all(len(rank) == M for rank in plan.ranks)
        for k in range(M):
            slot = [float(truth(rank[k].B, rank[k].S)) for rank in plan.ranks]
            total_ms += max(slot)
            synced_ms += R * max(slot)
            busy_ms += sum(t for t, rank in zip(slot, plan.ranks) if rank[k].num_real > 0)
        total_ms += optim / R
        for rank in plan.ranks:
            tokens += sum(m.S * m.num_real for m in rank)
            samples += sum(m.num_real for m in rank)
    assert (sim.tokens, sim.samples, sim.steps) == (tokens, samples, steps)
    assert sim.time_s == pytest.approx(total_ms / 1e3, rel=1e-12)
    assert sim.tokens_per_s == pytest.approx(tokens / (total_ms / 1e3), rel=1e-12)
    assert sim.samples_per_s == pytest.approx(samples / (total_ms / 1e3), rel=1e-12)
    assert sim.idle_fraction == pytest.approx(1 - busy_ms / synced_ms, rel=1e-12)
    assert sim.idle_fraction > (0.2 if strategy == "equal_token" else 0.0)  # not a trivial agreement
    # the truth, not the planner's prediction: priced with QUAD the same plans take another time
    assert abs(sum(p.pred_ms().max(0).sum() for p in plans) + steps * optim / R - total_ms) > 0.05 * total_ms


@pytest.mark.slow
def test_tiny_replay_times_every_planned_micro_batch_once(tmp_path):
    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps({"settings": [
        {"strategy": "equal_token", "m_tokens": 120},
        {"strategy": "balanced", "label": "bal", "batch_sizes": {"img_64": 4, "img_64x96": 3, "vid_64_9f": 2,
                                                                 "vid_64x96_17f": 1}, "M": 3}]}))
    out = tmp_path / "out"
    # 30 samples: one of the 4 planned steps reaches the epoch's end and pads
    cli = subprocess.run([sys.executable, "scripts/replay_plans.py", "--out", str(out), "--settings", str(settings),
                          "--ranks", "2", "--steps", "3", "--warmup", "1", "--micro-batches", "2", "--samples", "30",
                          "--calibration", "results/calibration_cpu_tiny.json", "train.gc_every=0"], cwd=ROOT,
                         capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr[-3000:]
    doc = json.loads((out / "replay.json").read_text())
    assert (out / "replay.md").exists() and len(doc["settings"]) == 2
    mix = Mix.of([(m["bucket"], m["S"], m["share"]) for m in doc["meta"]["mix"]])
    names = list(mix.names)
    assert names == ["img_64", "img_64x96", "vid_64_9f", "vid_64x96_17f"]  # the config's data.synthetic.mix
    padded = 0
    for s in doc["settings"]:
        assert s["batch_sizes"] == ([7, 5, 2, 1] if s["label"] == "equal_token" else [4, 3, 2, 1])
        cost = Calibration.load("results/calibration_cpu_tiny.json").cost_model("none").predict
        plans = plan_steps(mix.table(s["samples_in_epoch"], doc["meta"]["seed"]), doc["meta"]["seed"], 2,
                           s["strategy"], s["M"], s["batch_sizes"], cost, 4)
        rows = s["rows"]
        assert len(rows) == sum(p.world_size * p.num_slots for p in plans)
        for i, plan in enumerate(plans):
            got = {(r["rank"], r["slot"]): r for r in rows if r["step"] == i - 1}
            assert sorted(got) == sorted(execution_order(plan))  # every (rank, slot) once
            for (rk, k), r in got.items():
                mb = plan.ranks[rk][k]
                assert (r["bucket"], r["S"], r["B"], r["real"], r["warmup"]) == \
                    (names[mb.bucket], mb.S, mb.B, mb.num_real > 0, i == 0)
                assert r["pred_ms"] == pytest.approx(mb.pred_ms) and r["measured_ms"] > 0
                assert r["scaled_ms"] == r["measured_ms"]  # the whole model ran
        # the epoch's end (then the next epoch starts): 15 micro-batches in 4s leave 3, one padding micro-batch in
        # its 2 slots; 16 in 6s leave 4, whole slots
        [end] = [p for p in plans if p.next_pos == 30]
        pads = sum(int((~p.real()).sum()) for p in plans)
        assert (pads, end.num_slots) == ((1, 2) if s["label"] == "equal_token" else (0, 2))
        padded += pads
        # the summary is the rows' arithmetic: idle from the timed rows' grid
        timed = plans[1:]
        grids = [np.array([[next(r["scaled_ms"] for r in rows if r["step"] == i and r["rank"] == rk and r["slot"] == k)
                            for k in range(p.num_slots)] for rk in range(2)]) for i, p in enumerate(timed)]
        busy = sum(g[p.real()].sum() for g, p in zip(grids, timed))
        assert s["measured"]["idle_fraction"] == pytest.approx(1 - busy / sum(2 * g.max(0).sum() for g in grids))
        assert s["measured"]["tokens"] == sum(p.tokens for p in timed)
        assert s["predicted"]["tokens_per_s"] == pytest.approx(evaluate(timed, None, doc["meta"]["optim_ms_predicted"])
                                                               .tokens_per_s)
    assert padded == 1
    # the timed runs of each (S, B), as a calibration's points
    n_timed = sum(1 for s in doc["settings"] for r in s["rows"] if not r["warmup"])
    assert sum(len(p["ms_runs"]) for p in doc["points"]) == n_timed and all(p["ms"] > 0 for p in doc["points"])


def test_padding_micro_batches_carry_loss_weight_zero():
    from types import SimpleNamespace

    from training.replay import SyntheticInputs

    inputs = SyntheticInputs(SimpleNamespace(text_len=4, text_dim=3), pin=False)
    real = inputs.batch(MicroBatch(0, (5, 6), (1.0, 1.0), 16, 1.0), "img_64", (4, 1, 8, 8))
    pad = inputs.batch(MicroBatch(0, (5,), (0.0,), 16, 1.0), "img_64", (4, 1, 8, 8))
    assert real.loss_weight.tolist() == [1.0, 1.0] and pad.loss_weight.tolist() == [0.0]
    assert tuple(real.latents.shape) == (2, 4, 1, 8, 8) and tuple(pad.text.shape) == (1, 4, 3)
    assert real.keys == ["5", "6"] and pad.num_real == 0 and real.num_real == 2


def test_a_dry_run_prices_each_planner_by_the_simulators_truth_as_a_loop_of_the_tests_own(tmp_path):
    """--planner per entry (stream and sorted of one table) and --truth: each entry's `truth` is its plans priced by
    the calibration's measured points (MeasuredTruth, interpolated as the simulator's truth) plus its optimizer
    step ÷ R, here recomputed by a loop over the same plans; sorting changes the plans, so the two differ."""
    from scheduling.truth import MeasuredTruth
    from training.replay import ReplayOptions, replay

    cal_path = "results/calibration_cpu_tiny.json"
    settings = tmp_path / "settings.json"
    table = {"img_64": 6, "img_64x96": 4, "vid_64_9f": 2, "vid_64x96_17f": 1}
    settings.write_text(json.dumps({"settings": [
        {"strategy": "dual_constraint", "label": "paper", "batch_sizes": table, "planner": "stream"},
        {"strategy": "dual_constraint", "label": "sorted", "batch_sizes": table, "planner": "sorted"}]}))
    doc = replay(ReplayOptions(overrides=[f"scheduling.calibration={ROOT}/{cal_path}"], out=str(tmp_path / "o"),
                               settings=str(settings), ranks=4, steps=6, warmup=1, micro_batches=2,
                               truth=f"{ROOT}/{cal_path}", dry_run=True), "test")
    cal = Calibration.load(f"{ROOT}/{cal_path}")
    mode = cal.mode_name("none")
    truth = MeasuredTruth.from_points(cal.measured_points(mode))
    cost = cal.cost_model(mode).predict
    mix = Mix.of([(m["bucket"], m["S"], m["share"]) for m in doc["meta"]["mix"]])
    seed, got = doc["meta"]["seed"], {}
    for s in doc["settings"]:
        assert s["planner"] == s["setting"]["planner"] and set(s["truth"]) == {"full"}
        plans = plan_steps(mix.table(s["samples_in_epoch"], seed), seed, 4, "dual_constraint", s["M"],
                           s["batch_sizes"], cost, 7, planner=s["planner"])[1:]
        total_ms, tokens = 0.0, 0
        for plan in plans:
            total_ms += sum(max(truth.mean(rank[k].B, rank[k].S) for rank in plan.ranks)
                            for k in range(plan.num_slots)) + cal.optim_ms(mode) / 4
            tokens += sum(m.S * m.num_real for rank in plan.ranks for m in rank)
        assert s["truth"]["full"]["tokens_per_s"] == pytest.approx(tokens / (total_ms / 1e3), rel=1e-12)
        got[s["label"]] = s["truth"]["full"]["tokens_per_s"]
    assert got["sorted"] != pytest.approx(got["paper"], rel=1e-6)
    with pytest.raises(ValueError, match=r"--truth .*calibration_h200_14b.json: measured on a model of dim 5120"):
        replay(ReplayOptions(overrides=[f"scheduling.calibration={ROOT}/{cal_path}"], out=str(tmp_path / "o2"),
                             settings=str(settings), ranks=4, steps=6, warmup=1, micro_batches=2,
                             truth=f"{ROOT}/results/calibration_h200_14b.json", dry_run=True), "test")


def test_plan_steps_plans_one_step_at_a_time_unless_given_a_window():
    mix = Mix.of(DEFAULT_MIX)
    sizes = batch_sizes("balanced", mix.S, m_mem=4e5, cost_model=QUAD, target_ms=1.5 * QUAD.predict(1, mix.S_max))
    table = mix.table(2000, 0)
    plans = plan_steps(table, 0, 4, "balanced", 4, sizes, QUAD.predict, 4)
    assert [p.ranks for p in plans] == [p.ranks for p in plan_steps(table, 0, 4, "balanced", 4, sizes, QUAD.predict, 4,
                                                                    window=1)]
    assert all(p.window_norm is None for p in plans)  # sorted, one step: no window's loss norm
    windowed = plan_steps(table, 0, 4, "balanced", 4, sizes, QUAD.predict, 4, window=2)
    assert all(p.window_norm is not None for p in windowed)


def test_two_truth_files_price_as_their_points_merged_at_both_depths():
    """--truth given twice (the 14B headline's points and the re-formed cell's): "full" holds every (S, B) either
    file measured, with the repeats of both where both timed it (the 720p clip), and "as_run" the points timed at the
    replay's depth (2 of 40 blocks) in either file, unscaled — read here from the files' JSON, not through
    Calibration."""
    from training.replay import truth_sources

    files = [f"{ROOT}/results/simulation_h200/truth_h200_14b_points.json",
             f"{ROOT}/results/simulation_h200/truth_h200_14b_reformed_points.json"]
    got = truth_sources(files, "full", 2, 40, 5120)
    alone = [truth_sources([f], "full", 2, 40, 5120) for f in files]
    full_keys = set(alone[0]["full"][0].runs) | set(alone[1]["full"][0].runs)
    assert set(got["full"][0].runs) == full_keys and len(full_keys) > max(len(a["full"][0].runs) for a in alone)
    clip = (75600, 1)
    assert got["full"][0].runs[clip] == alone[0]["full"][0].runs[clip] + alone[1]["full"][0].runs[clip]
    assert got["full"][1] == alone[0]["full"][1] != alone[1]["full"][1]  # the optimizer step: the first file's,
    assert got["as_run"][1] == alone[0]["as_run"][1] != alone[1]["as_run"][1]  # at either depth
    at_two = {}
    for f in files:
        rec = json.load(open(f))["modes"]["full"]
        for p in rec["slice_memory"]["points"]["2"]:
            if p.get("feasible", True) and p.get("ms"):
                at_two.setdefault((p["S"], p["B"]), []).extend(p["ms_runs"])
    assert got["as_run"][0].runs == at_two and clip in at_two and clip not in alone[0]["as_run"][0].runs
    assert got["as_run"][0].mean(1, 75600) == pytest.approx(float(np.median(at_two[clip])))
    twice = truth_sources(files + files[:1], "full", 2, 40, 5120)  # a file named twice counts once
    assert twice["full"][0].runs == got["full"][0].runs and twice["as_run"][0].runs == got["as_run"][0].runs

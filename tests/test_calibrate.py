"""scheduling/calibrate.py's scan (B upward, out-of-memory, memory-fit stop, cap, agreement) and the CPU tiny run."""
import json
import os
import re
import time

import numpy as np
import pytest

from scheduling.calibrate import Calibration, Infeasible, Point, StepResult, fit_mode, scan
from scheduling.cost_model import CostModel, fit_cost_model
from scheduling.config import SchedulingConfig
from scheduling.policy import ModelShape, resolve_schedule

C0, C1 = 10 * 2**30, 200 * 2**10  # the fake device: 10 GiB + 200 KiB per token
TOKENS = {"img": 1000, "short": 4000, "long": 16000}


def fake_step(oom_tokens=None, calls=None, tokens=TOKENS):
    def step_fn(bucket, B):
        S = tokens[bucket]
        if calls is not None:
            calls.append((bucket, B))
        if oom_tokens is not None and B * S >= oom_tokens:
            raise Infeasible("CUDA out of memory (fake)")
        return StepResult(2.0 + 1e-3 * B * S + 1e-7 * B * S * S, 1.0, C0 + C1 * B * S)
    return step_fn


def test_b_rises_per_bucket_and_out_of_memory_stops_the_bucket_and_longer_ones():
    calls = []
    pts = scan(fake_step(oom_tokens=40_000, calls=calls), TOKENS, max_points=9, top_tokens=64_000, warmup=1,
               repeats=2)
    for name in TOKENS:
        Bs = [p.B for p in pts if p.bucket == name]
        assert Bs == sorted(Bs)  # B upward
    assert all(p.B * p.S < 40_000 for p in pts if p.feasible)
    bad = [p for p in pts if not p.feasible]
    assert bad[0].why.startswith("out of memory") and bad[0].B * bad[0].S >= 40_000
    assert all(B * TOKENS[b] < 40_000 or (b, B) == (bad[0].bucket, bad[0].B) for b, B in calls)  # never retried
    assert len(calls) == 3 * sum(p.feasible for p in pts) + 1  # warmup + 2 repeats each; the OOM once
    assert any("already infeasible" in p.why for p in bad[1:])


def test_fixed_points_time_exactly_the_given_micro_batches_and_an_oom_skips_that_point_alone():
    """calibrate.points: a simulation's (bucket, B) in the given order, each warm-up + repeats times, no ladder and no
    probe; one out of memory costs that point, not the ones after it (unlike the ladder, where it ends the bucket)."""
    calls = []
    want = [("long", 1), ("img", 98), ("short", 12), ("img", 45), ("short", 2)]
    pts = scan(fake_step(oom_tokens=60_000, calls=calls), TOKENS, max_points=2, warmup=1, repeats=3,
               mem_budget_bytes=C0 + C1 * 200_000, fixed_points=want)
    assert [(p.bucket, p.B) for p in pts] == want
    assert [p.feasible for p in pts] == [True, False, True, True, True]  # 98 × 1000 ≥ 60,000 ran out
    assert all(len(p.ms_runs) == 3 for p in pts if p.feasible) and len(calls) == 4 * 4 + 1
    with pytest.raises(ValueError, match="outside"):
        scan(fake_step(), TOKENS, fixed_points=[("huge", 1)])
    late = scan(fake_step(), TOKENS, fixed_points=want, time_budget_s=0.0)  # the budget still stops new points
    assert not any(p.feasible for p in late[1:]) and "time budget" in late[-1].why


def test_the_memory_fit_stops_a_bucket_before_it_runs_out():
    calls = []
    budget = C0 + C1 * 30_000
    pts = scan(fake_step(calls=calls), TOKENS, max_points=9, top_tokens=64_000, mem_budget_bytes=budget,
               probe_cap=False)
    assert all(B * TOKENS[b] <= 30_000 for b, B in calls)  # no point the fit predicts infeasible ran
    assert any(p.why.startswith("memory model predicts") for p in pts)


def test_the_last_point_probes_the_memory_bound_of_the_shortest_bucket():
    """With a memory budget, the scan's last point is the shortest bucket at the largest B that the fit allows —
    far above the ladder — and an out-of-memory there retries smaller. The fake device has a floor (the optimizer
    step) and a per-sample term, as the H200 has."""
    floor, c2 = C0 * 1.2, 5 * 2**20  # the longest bucket at B = 1 peaks above the floor, as on the H200

    def peak(B, S):
        return max(floor, C0 + C1 * B * S + c2 * B)

    def step(oom_at=None, calls=None):
        def step_fn(bucket, B):
            S = TOKENS[bucket]
            if calls is not None:
                calls.append((bucket, B))
            if peak(B, S) > (oom_at or float("inf")):
                raise Infeasible("CUDA out of memory (fake)")
            return StepResult(2.0 + 1e-3 * B * S, 1.0, peak(B, S))
        return step_fn

    budget = C0 + C1 * 200_000
    calls = []
    pts = scan(step(calls=calls), TOKENS, max_points=7, top_tokens=32_000, mem_budget_bytes=budget, warmup=0,
               repeats=1)
    timed = [p for p in pts if p.feasible]
    assert len(timed) == 7 and timed[-1].bucket == "img" and calls[-1] == ("img", timed[-1].B)
    assert timed[-1].B * 1000 > 5 * 32_000  # far above the ladder's top
    assert peak(timed[-1].B, 1000) <= budget < peak(timed[-1].B + 1, 1000)  # at the bound, the fit exact
    assert [p.B for p in timed if p.bucket == "img"] == [1, 32, timed[-1].B]  # its ladder of 3 gave up a point
    assert len(scan(step(), TOKENS, max_points=7, top_tokens=32_000, warmup=0, repeats=1)) == 7  # no budget
    B1 = int(timed[-1].B * 0.85)
    oom_at = (peak(B1, 1000) + peak(int(B1 * 0.85), 1000)) / 2  # the device holds less than the model says
    pts = scan(step(oom_at=oom_at), TOKENS, max_points=7, top_tokens=32_000, mem_budget_bytes=budget,
               warmup=0, repeats=1)
    probes = [p for p in pts if p.bucket == "img" and p.B > 32]
    assert [p.feasible for p in probes] == [False, False, True]
    assert probes[1].B == int(probes[0].B * 0.85) and probes[2].B == int(probes[1].B * 0.85)
    assert fit_mode(pts)["memory_model"]["c1"] == pytest.approx(C1, rel=1e-6)


def test_memory_held_beside_the_step_comes_off_every_check_of_the_scan():
    """held_bytes (the CUDA graphs' pool, which the step's peaks do not count) is read before each memory check:
    here a pool that grows by one fixed amount with every point run. Where the device holds budget in all, the
    probe without it asks for a B that runs out of memory beside the pool; with it, the probe's B fits beside the
    pool as it was when the probe ran, first time, and the log says how much was held."""
    pool_step = C1 * 20_000  # each point run adds this much to the pool
    budget = C0 + C1 * 200_000
    for aware in (False, True):
        ran, logged = [], []

        def step_fn(bucket, B):
            S = TOKENS[bucket]
            peak = C0 + C1 * B * S
            if peak + pool_step * len(ran) > budget:  # the device: the step beside the pool so far
                raise Infeasible("CUDA out of memory (fake)")
            ran.append((bucket, B))
            return StepResult(2.0 + 1e-3 * B * S, 1.0, peak)

        held = (lambda: pool_step * len(ran)) if aware else None
        pts = scan(step_fn, TOKENS, max_points=7, top_tokens=32_000, mem_budget_bytes=budget, warmup=0, repeats=1,
                   held_bytes=held, log=logged.append)
        probes = [p for p in pts if p.bucket == "img" and p.B > 32]
        if not aware:
            assert not probes[0].feasible  # the model's B ignores the pool: out of memory
            continue
        assert probes[0].feasible and len(probes) == 1
        room = budget - pool_step * (len(ran) - 1)  # the pool when the probe was asked, before it ran
        assert C0 + C1 * probes[0].B * 1000 <= room < C0 + C1 * (probes[0].B + 1) * 1000
        assert any("GiB held beside the step" in line for line in logged if line.startswith("cap probe"))


def test_the_probe_is_skipped_cleanly_and_never_retries_a_size_that_ran_out():
    """All points at the optimizer floor (no per-token cost to fit): the probe is skipped, the scan's points kept.
    A B·S already out of memory on the ladder caps the probe below it."""
    floor = StepResult(10.0, 1.0, 30 * 2**30)
    pts = scan(lambda b, B: floor, TOKENS, max_points=7, top_tokens=32_000, mem_budget_bytes=100 * 2**30,
               warmup=0, repeats=1)
    assert sum(p.feasible for p in pts) == 6 and pts[-1].why.startswith("cap probe: no memory model")
    calls = []  # the device runs out at 30,000 tokens; the ladder finds it at img B = 64 (64,000 tokens)
    pts = scan(fake_step(oom_tokens=30_000, calls=calls), TOKENS, max_points=7, top_tokens=64_000,
               mem_budget_bytes=C0 + C1 * 200_000, warmup=0, repeats=1)
    assert sum(B * TOKENS[b] >= 64_000 for b, B in calls) == 1  # the model says 200,000 fit: the probe stays under
    probes = [p for p in pts if p.bucket == "img" and 1 < p.B < 64]
    assert [p.B for p in probes] == [63, int(63 * 0.85), int(int(63 * 0.85) * 0.85)]
    assert not any(p.feasible for p in probes) and calls[-1] == ("img", probes[-1].B)  # three tries, then done


def test_the_probe_agrees_across_two_ranks_whose_fits_differ():
    """Each rank fits its own peaks (here 3 % apart): the ranks run the probe at the smaller B and make the same
    agree() / agree_min() calls, so neither waits on a collective the other skips (two threads, all-reduce MIN)."""
    import threading

    barrier, slots = threading.Barrier(2, timeout=20), [None, None]

    def all_reduce_min(rank, v):
        slots[rank] = v
        barrier.wait()
        out = min(slots)
        barrier.wait()
        return out

    results = [None, None]

    def rank_main(rank):
        bump = 1.0 + 0.03 * rank

        def step_fn(bucket, B):
            S = TOKENS[bucket]
            return StepResult(1.0 + 1e-3 * B * S, 1.0, bump * (C0 + C1 * B * S))
        results[rank] = scan(step_fn, TOKENS, max_points=7, top_tokens=32_000, mem_budget_bytes=C0 + C1 * 200_000,
                             warmup=0, repeats=1, agree=lambda ok: all_reduce_min(rank, int(ok)) > 0,
                             agree_min=lambda v: all_reduce_min(rank, v))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(r is not None for r in results)  # neither rank hung
    probes = [r[-1] for r in results]
    assert probes[0].B == probes[1].B and probes[0].feasible and probes[0].bucket == "img"
    from scheduling.cost_model import MemoryModel
    stricter = MemoryModel(1.03 * C0, 1.03 * C1).max_batch(1000, C0 + C1 * 200_000)
    assert abs(probes[0].B - stricter) <= 1 < MemoryModel(C0, C1).max_batch(1000, C0 + C1 * 200_000) - stricter


def test_refit_keeps_an_estimated_memory_model_and_drops_stale_choices(tmp_path):
    from scheduling.calibrate import refit
    from scheduling.simulate import four_block_h200_calibration

    cal = four_block_h200_calibration()
    est = cal.data["modes"]["full"]["memory_model"]
    cal.data["chosen"] = {"by": "scripts/simulate_cluster.py", "m_mem": 1, "by_world_size": {"8": {}}}
    cal = refit(cal, None)
    assert cal.data["modes"]["full"]["memory_model"] == est and "chosen" not in cal.data
    assert "dropped on refit" in cal.data["notes"][-1]
    cal.data["chosen"] = {"m_mem": 960, "why": "CPU"}  # a CPU file's stated bound is not a simulator choice
    assert refit(cal, None).data["chosen"] == {"m_mem": 960, "why": "CPU"}


def test_check_runs_given_micro_batches_against_a_calibration(tmp_path):
    from training.shape_benchmark import _parse_checks, calibrate_config
    from tests.helpers import compose_config

    cal = str(tmp_path / "cal.json")
    cfg = compose_config([f"scheduling.calibration={cal}"])
    calibrate_config(cfg, {"max_points": 6, "repeats": 1, "out": cal}, command="test", log=lambda s: None)
    out = str(tmp_path / "check.json")
    rows = calibrate_config(cfg, {"check": ["img_64:3", "vid_64_9f:2"], "repeats": 1, "out": out}, log=lambda s: None)
    assert [(r["bucket"], r["B"], r["fits"]) for r in rows] == [("img_64", 3, True), ("vid_64_9f", 2, True)]
    assert all(r["ms"] > 0 and r["predicted_ms"] > 0 and len(r["ms_runs"]) == 1 for r in rows)
    assert json.load(open(out))["rows"] == rows
    from training.shape_benchmark import DEFAULTS
    assert DEFAULTS["fit_min_tokens"] is None and DEFAULTS["probe_cap"] is True
    table = cfg.data.buckets
    for bad in ("img_64", "nope:2", "img_64:0", "img_64:x"):
        with pytest.raises(ValueError, match="bucket:B"):
            _parse_checks([bad], table)
    with pytest.raises(ValueError, match="whole model"):
        calibrate_config(cfg, {"check": ["img_64:1"], "blocks": 1}, log=lambda s: None)


def test_the_launch_floor_prices_every_point_of_the_h200_eager_scan(monkeypatch):
    """On the H200 scan of eager steps i480 and v480_17f at B = 1 took 464 and 491 ms where their kernels take ~80
    and ~300 (the GPU waited on the host): the cost model's floor prices them, and every point — those two
    included — is within 3 %, where the form without a floor misses them by 27 % and 9 %. The four-block H200 points
    (H200_FOUR_BLOCK_POINTS, all compute-bound) get no floor."""
    from scheduling.simulate import H200_FOUR_BLOCK_POINTS
    from tests.helpers import ROOT

    monkeypatch.chdir(ROOT)
    pts = [Point(**p) for p in Calibration.load("results/calibration_h200.json").data["modes"]["full"]["points"]]
    rec = fit_mode(pts, L=512)
    cost = CostModel.from_dict(rec["cost_model"])
    assert rec["fit_points"] == len(pts) == 12 and cost.form == "quadratic" and 440 < cost.params["floor"] < 500
    assert max(abs(e) for e in rec["rel_err_every_point"]["quadratic"]) < 0.03
    assert cost.predict(1, 1560) == cost.params["floor"] and cost.predict(1, 32760) > 2000
    plain = fit_cost_model([p.B for p in pts], [p.S for p in pts], [p.ms for p in pts], form="quadratic")
    assert max(abs(r) for r in plain.residuals) > 0.2
    four_block = [Point("b", S, B, True, ms, [ms], 0.0) for B, S, ms in H200_FOUR_BLOCK_POINTS]
    assert "floor" not in fit_mode(four_block)["cost_model"]["params"]


def test_launch_floor_on_a_synthetic_scan():
    """Run 3's cost (5.2 ms a sample) under a 450 ms floor comes back: the floor within 1 %, the work terms within
    2 %; one point 20 % slow is noise, not a floor; a joint (MMDiT) scan works alike."""
    work = lambda B, S: 44.7 + 5.16 * B + 0.01817 * B * S + 1.53e-6 * B * S * S
    shape = [(1, 1560), (1, 7800), (2, 7800), (1, 14040), (19, 7800), (10, 14040), (1, 32760), (4, 32760),
             (1, 75600), (2, 75600), (459, 1560)]
    B, S = (np.array(x, dtype=float) for x in zip(*shape))
    m = fit_cost_model(B, S, np.maximum(450, work(B, S)), form="quadratic", floor=True)
    assert m.params["floor"] == pytest.approx(450, rel=0.01) and m.max_rel_err < 0.01
    assert m.predict(3, 75600) == pytest.approx(work(3, 75600), rel=0.02)
    slow = work(B, S) * np.where((B == 1) & (S == 1560), 1.2, 1.0)
    assert "floor" not in fit_cost_model(B, S, slow, form="quadratic", floor=True).params
    L = 512
    joint = lambda B, S: 30 + 0.02 * B * (S + L) + 2e-6 * B * (S + L) ** 2
    mj = fit_cost_model(B, S, np.maximum(400, joint(B, S)), form="quadratic", L=np.full(len(B), L), joint=True,
                        floor=True)
    assert mj.params["floor"] == pytest.approx(400, rel=0.01) and mj.max_rel_err < 0.01


def test_buckets_of_one_length_are_scanned_once_and_each_gets_two_points():
    from scheduling.calibrate import _quotas

    wan = {"i480": 1560, "i480_p": 1560, "i720": 3600, "v480_17f": 7800, "v480_17f_p": 7800, "v480_33f": 14040,
           "v720_17f": 18000, "v480_49f": 20280, "v720_33f": 32400, "v480_81f": 32760, "v720_49f": 46800,
           "v720_81f": 75600, "v720_81f_p": 75600}
    q = _quotas(wan, 12)
    assert list(q) == ["i480", "i720", "v480_17f", "v720_17f", "v480_81f", "v720_81f"]  # 6 of 10 S, even in log S
    assert set(q.values()) == {2}
    assert _quotas({"a": 100, "a_p": 100, "b": 200}, 12) == {"a": 6, "b": 6}


def test_the_point_cap_and_agreement_across_ranks():
    many = {f"b{i}": 1000 * (i + 1) for i in range(20)}
    pts = scan(fake_step(tokens=many), many, max_points=12, repeats=1, warmup=0)
    assert sum(p.feasible for p in pts) == 12  # 20 buckets, 12 points: a spread of them by S
    assert {"b0", "b19"} <= {p.bucket for p in pts}
    votes = iter([True, True, False] + [True] * 100)  # the other rank says no to the second point
    pts = scan(fake_step(), TOKENS, max_points=6, repeats=1, warmup=0, agree=lambda ok: ok and next(votes))
    assert not pts[1].feasible and "another rank" in pts[1].why and pts[2].bucket == "short"


def test_k_block_scan_extrapolates_the_cost_and_drops_the_memory_model():
    pts = [Point("b", S, B, True, 1 + 1e-3 * B * S + 1e-7 * B * S * S, [], 1.0, C0 + C1 * B * S)
           for B, S in [(1, 1000), (4, 1000), (1, 4000), (2, 4000), (1, 16000), (2, 16000)]]
    rec = fit_mode(pts, scale=7.5, memory_valid=False)
    from scheduling.cost_model import CostModel
    assert CostModel.from_dict(rec["cost_model"]).predict(3, 5000) == pytest.approx(
        7.5 * (1 + 1e-3 * 15000 + 1e-7 * 3 * 5000 ** 2), rel=1e-3)
    assert rec["memory_model"] is None and rec["memory_model_k_blocks"]["c1"] == pytest.approx(C1)
    assert rec["optim_ms"] == 7.5


@pytest.mark.serial  # asserts the scan's wall time
def test_cpu_tiny_model_calibration_end_to_end(tmp_path):
    from training.shape_benchmark import calibrate_config
    from tests.helpers import compose_config

    out = str(tmp_path / "cal.json")
    cfg = compose_config([f"scheduling.calibration={out}"])
    t0 = time.perf_counter()
    calibrate_config(cfg, {"max_points": 8, "repeats": 2, "out": out}, command="test", log=lambda s: None)
    assert time.perf_counter() - t0 < 30
    d = json.load(open(out))
    rec = d["modes"]["none"]  # the tiny config's checkpointing mode
    timed = [p for p in rec["points"] if p["feasible"]]
    assert len(timed) == 8 and all(p["ms"] > 0 and p["optim_ms"] > 0 for p in timed)
    assert {p["bucket"] for p in timed} == set(cfg.data.buckets)
    assert set(rec["fit_errors"]) == {"power", "quadratic"} and rec["cost_model"]["form"] in ("power", "quadratic")
    assert all(np.isfinite(e["rel_rmse"]) for e in rec["fit_errors"].values())
    assert d["model"]["dim"] == cfg.model.dim and d["device"].startswith("CPU") and d["chosen"]["m_mem"] == 960
    sched = resolve_schedule(SchedulingConfig("balanced", calibration=out),
                             {"img_64": 16, "vid_64x96_17f": 120},
                             ModelShape(1, cfg.model.num_layers, cfg.model.dim, cfg.model.text_len))
    assert sched.sources["cost"].startswith("calibration:none") and sched.values["m_mem"] == 960
    assert Calibration.load(out).mode_name("none") == "none"


def test_launch_bound_points_stay_in_the_file_but_out_of_the_fit(tmp_path):
    from scheduling.calibrate import new_calibration, refit

    quad = lambda B, S: 30 + 0.03 * B * S + 1.5e-6 * B * S * S
    pts = [Point("b", S, B, True, quad(B, S), [], 1.0, C0 + C1 * B * S)
           for B, S in [(4, 4000), (1, 16000), (2, 16000), (1, 32000), (3, 32000), (1, 75000)]]
    pts += [Point("img", 1500, B, True, 400.0, [], 1.0, C0) for B in (1, 2)]  # the GPU waits on kernel launches
    rec = fit_mode(pts, min_tokens=10_000)
    assert rec["fit_points"] == 6 and rec["fit_errors"]["quadratic"]["rel_rmse"] < 1e-6
    assert len(rec["rel_err_every_point"]["quadratic"]) == 8
    assert rec["rel_err_every_point"]["quadratic"][-2] == pytest.approx((quad(1, 1500) - 400) / 400, rel=1e-6)
    with_floor = fit_mode(pts)  # every point in the fit: the floor prices the launch-bound ones
    assert with_floor["fit_points"] == 8 and with_floor["cost_model"]["params"]["floor"] == pytest.approx(400)
    assert max(abs(e) for e in with_floor["rel_err_every_point"]["quadratic"]) < 1e-6
    cal = new_calibration({"full": fit_mode(pts)}, model={}, source="t", device="t", date="t", command="t")
    assert refit(cal, 10_000).data["modes"]["full"]["fit_points"] == 6

    # an MMDiT scan (joint attention over S + L) refits as joint: planted parameters come back exactly
    L = 256
    joint = lambda B, S: 20 + 0.02 * B * (S + L) + 2e-6 * B * (S + L) ** 2
    pts = [Point("b", S, B, True, joint(B, S), [], 1.0, C0 + C1 * B * S)
           for B, S in [(4, 4000), (1, 16000), (2, 16000), (1, 32000), (3, 32000), (1, 75000)]]
    cal = new_calibration({"full": fit_mode(pts, L=L, joint=True)}, model={}, source="t", device="t", date="t",
                          command="t")
    cm = refit(cal, None).data["modes"]["full"]["cost_model"]
    assert cm["form"] == "quadratic" and cm["joint"] and cm["L"] == L
    assert CostModel.from_dict(cm).predict(2, 20000) == pytest.approx(joint(2, 20000), rel=1e-6)


def test_the_committed_h200_calibration(monkeypatch):
    """The eager H200 scan prices every point, B = 1 included, within 5 % (3 % left out); a run holding a fixed
    global batch takes the simulator's choice from it, inside the memory budget."""
    from tests.helpers import ROOT

    monkeypatch.chdir(ROOT)
    cal = Calibration.load("results/calibration_h200.json")
    rec = cal.data["modes"]["full"]
    assert cal.data["source"] == "measured" and cal.data["device"] == "NVIDIA H200"
    cost = rec["cost_model"]
    assert cost["form"] == "quadratic" and cost["params"]["floor"] > 400 and rec["fit_points"] == 12
    assert max(abs(e) for e in rec["rel_err_every_point"]["quadratic"]) < 0.05 and cost["loo_rel_rmse"] < 0.03
    assert rec["fit_errors"]["power"]["rel_rmse"] > 0.10 and sum(p["feasible"] for p in rec["points"]) <= 12
    from scheduling.simulate import DEFAULT_MIX

    wan = {n: S for n, S, _ in DEFAULT_MIX}  # the mix the simulator chose for
    shares = {n: share for n, _, share in DEFAULT_MIX}
    window = cal.data["chosen"]["by_tokens_per_step"]["8"][str(2 * 75600)]["balanced"]["window"]
    s = resolve_schedule(SchedulingConfig("balanced", calibration="results/calibration_h200.json",
                                          tokens_per_step=2 * 75600, window=window),  # the window it was tuned for
                         wan, ModelShape(1, 30, 1536, 512), checkpointing="full", world_size=8, shares=shares)
    assert s.sources["target_microbatch_ms"].startswith("calibration:chosen") and s.micro_batches >= 1
    assert abs(s.values["tokens_per_step"] - 2 * 75600) <= 0.1 * 2 * 75600
    other = resolve_schedule(SchedulingConfig("balanced", calibration="results/calibration_h200.json",
                                              tokens_per_step=2 * 75600), wan, ModelShape(1, 30, 1536, 512),
                             checkpointing="full", world_size=8, shares={**shares, "i480": 5.0})
    assert abs(other.values["tokens_per_step"] - 2 * 75600) <= 0.1 * 2 * 75600  # another mix: chosen again
    mem = cal.memory_model("full")
    assert s.values["m_mem"] == mem.m_mem(0.9 * cal.hbm_bytes, S_min=1560)
    for name, S in wan.items():  # every planned micro-batch within the memory budget, per the measured model
        assert mem.predict(s.batch_sizes[name], S) <= 0.9 * cal.hbm_bytes




def test_calibrate_options_are_typed_and_ranged_like_the_run_config():
    from training.shape_benchmark import CalibrateOptions

    opts = CalibrateOptions.of({"max_points": 6, "repeats": 1, "buckets": ["img_64"], "top_tokens": 480})
    assert (opts.max_points, opts.repeats, opts.warmup, opts.buckets, opts.top_tokens) == (6, 1, 1, ["img_64"], 480.0)
    assert CalibrateOptions.of(opts) is opts and CalibrateOptions.of(None) == CalibrateOptions()
    for bad, message in (({"max_points": 0}, "calibrate.max_points must be ≥ 1, got 0"),
                         ({"repeats": 0}, "calibrate.repeats must be ≥ 1, got 0"),
                         ({"warmup": -1}, "calibrate.warmup must be ≥ 0, got -1"),
                         ({"time_budget_s": -5.0}, "calibrate.time_budget_s must be ≥ 0"),
                         ({"warmup": 1.5}, "calibrate.warmup must be an integer"),
                         ({"probe_cap": "yes"}, "calibrate.probe_cap must be true or false"),
                         ({"bogus": 1}, "unknown config key(s) calibrate.bogus")):
        with pytest.raises(ValueError, match=re.escape(message)):
            CalibrateOptions.of(bad)


def test_a_launch_point_alone_carries_the_floor_and_is_never_left_out():
    """An FSDP slice's scan starts at large micro-batches; its plain step at B = 1, timed outside the scan, is the
    only launch-bound point. As a launch point it carries the floor alone; as an ordinary point one slow point is
    noise, no floor is fitted, and the line bends to it, mispricing the scan. Leave-one-out keeps it in every
    refit."""
    quad = lambda B, S: 50 + 15 * B + 0.07 * B * S + 3e-6 * B * S * S
    pts = [Point("b", S, B, True, quad(B, S), [quad(B, S)], 1.0)
           for B, S in [(48, 1560), (94, 1560), (1, 7800), (9, 7800), (1, 32760), (2, 32760), (1, 75600)]]
    launch = Point("i480", 1560, 1, True, 3 * quad(1, 1560), [3 * quad(1, 1560)], 1.0)
    rec = fit_mode(pts, scale=2.0, launch=launch)
    cost = rec["cost_model"]
    assert cost["params"]["floor"] == pytest.approx(2 * 3 * quad(1, 1560), rel=1e-9)  # × the slice's scale
    assert rec["launch_rel_err"]["quadratic"] == pytest.approx(0, abs=1e-9)
    assert max(abs(e) for e in rec["rel_err_every_point"]["quadratic"]) < 1e-6
    assert cost["loo_rel_rmse"] < 1e-3 and rec["fit_points"] == 7 and rec["launch_point"]["B"] == 1
    ordinary = fit_mode(pts + [launch], scale=2.0)
    assert "floor" not in ordinary["cost_model"]["params"]
    assert max(abs(e) for e in ordinary["rel_err_every_point"]["quadratic"]) > 0.05


def test_a_shallow_slice_timed_at_two_depths_is_fitted_at_the_full_depth_and_refits_the_same():
    """A 4-block slice of 40 blocks whose part outside the blocks is large (as the 14B's is beside a launch-bound
    plain step, results/attention_h100.md): × 10 counts that part 10 times, so the k-block fit × 10 over-prices the
    small micro-batches against the simulator's truth, t_fixed + 40·t_block from the two depths. Fitted at the full
    depth (depth_factors), every point and the plain step lie on the truth; points timed at one depth keep × 10;
    refit gives the same model again."""
    from dataclasses import asdict

    from scheduling.calibrate import launch_point, new_calibration, refit
    from scheduling.fsdp_memory import depth_check

    block = lambda B, S: 1.0 + 0.004 * B * S + 2.5e-8 * B * S * S  # ms a block
    t = lambda k, B, S: 20.0 + k * block(B, S)  # the step at k blocks: 20 ms outside them
    shapes = [(1, 3600), (1, 7800), (1, 18000), (1, 32760), (4, 32760), (1, 75600), (2, 75600)]
    pts = {k: [Point(f"s{S}", S, B, True, t(k, B, S), [t(k, B, S)], 1.0) for B, S in shapes] for k in (4, 2)}
    pts[2] = pts[2][:5]  # the second depth's budget ran out before the two largest
    plain = {k: {"bucket": "i480", "S": 1560, "B": 1, "ms": t(k, 1, 1560), "optim_ms": 1.0} for k in (4, 2)}
    dc = depth_check({k: [asdict(p) for p in v] for k, v in pts.items()}, 40, 4, launch=plain)
    launch = launch_point(plain[4])
    flat = fit_mode(pts[4], scale=10.0, launch=launch)
    rec = {**flat, "depth_check": dc, "slice_memory": {"plain_step": {str(k): v for k, v in plain.items()}}}
    cal = new_calibration({"full": rec}, model={"params": 1e9, "num_layers": 40}, source="measured", device="t",
                          date="t", command="t", extrapolation={"blocks_timed": 4, "num_layers": 40, "scale": 10.0})
    truth = {(p["S"], p["B"]): p["ms"] for p in cal.measured_points("full")}
    assert truth[(1560, 1)] == pytest.approx(t(40, 1, 1560)) and truth[(3600, 1)] == pytest.approx(t(40, 1, 3600))
    assert truth[(75600, 2)] == pytest.approx(10 * t(4, 2, 75600))  # one depth: × L/k
    old = CostModel.from_dict(flat["cost_model"])
    assert old.predict(1, 1560) / truth[(1560, 1)] - 1 > 0.5  # the flat × 10 misses the plain step by > 50 %
    rec["fit_depth"] = "affine"
    new = refit(cal, None).data["modes"]["full"]
    cost = CostModel.from_dict(new["cost_model"])
    assert new["fit_depth"] == "affine" and new["points"] == flat["points"]  # the points stay as timed
    for (S, B), ms in truth.items():
        assert cost.predict(B, S) == pytest.approx(ms, rel=0.03), (B, S)
    assert abs(new["launch_rel_err"][new["cost_model"]["form"]]) < 0.03
    assert max(abs(e) for e in new["rel_err_every_point"][new["cost_model"]["form"]]) < 0.03
    again = refit(Calibration(json.loads(json.dumps(cal.data))), None).data["modes"]["full"]
    assert again["cost_model"]["params"] == pytest.approx(new["cost_model"]["params"], rel=1e-9)


def test_a_slice_is_measured_at_the_whole_models_depth_and_older_files_refit_with_their_plain_step():
    """The simulator's truth of a k-block slice is its times × the scale, as its cost model is (a truth at the
    slice's depth would make every micro-batch 40/k times cheaper than the planner thinks); a slice file written
    before launch points takes its plain step at the scan's depth as the launch point on refit."""
    from scheduling.calibrate import new_calibration, refit
    from scheduling.protocol import inputs_from
    from scheduling.simulate import Mix

    quad = lambda B, S: 50 + 15 * B + 0.07 * B * S + 3e-6 * B * S * S
    pts = [Point("b", S, B, True, quad(B, S), [quad(B, S)], 1.0)
           for B, S in [(48, 1560), (94, 1560), (1, 7800), (9, 7800), (1, 32760), (2, 32760), (1, 75600)]]
    rec = fit_mode(pts, scale=40 / 18, memory_valid=False)
    plain = {"bucket": "i480", "S": 1560, "B": 1, "ms": 3 * quad(1, 1560), "optim_ms": 9.0, "peak_bytes": C0}
    rec["slice_memory"] = {"plain_step": {"18": plain, "9": {**plain, "ms": 1.0}}}
    rec["memory_model"] = {"c0": C0, "c1": C1, "c2": 0.0}
    cal = new_calibration({"full": rec}, model={"params": 1e9, "num_layers": 40}, source="measured", device="t",
                          date="t", command="t", hbm_bytes=150e9,
                          extrapolation={"blocks_timed": 18, "num_layers": 40, "scale": 40 / 18})
    cal = refit(cal, None)
    new = cal.data["modes"]["full"]
    assert new["launch_point"]["ms"] == pytest.approx(plain["ms"]) and "slice_memory" in new
    assert new["launch_point"]["optim_ms"] == 9.0  # the plain step's own optimizer time
    assert new["cost_model"]["params"]["floor"] == pytest.approx(40 / 18 * plain["ms"])
    measured = {(p["S"], p["B"]): p["ms"] for p in cal.measured_points("full")}
    assert measured[(32760, 2)] == pytest.approx(40 / 18 * quad(2, 32760)) and len(measured) == 8
    runs = {(p["S"], p["B"]): p["ms_runs"] for p in cal.measured_points("full")}
    assert runs[(32760, 2)] == pytest.approx([40 / 18 * quad(2, 32760)])  # each repeat, scaled as the median is
    inp = inputs_from(cal, "full", Mix.of([("i480", 1560, 0.5), ("v720_81f", 75600, 0.5)]))
    cut = refit(cal, 10_000).data["modes"]["full"]  # min_tokens leaves the launch point out with the small points
    assert "launch_point" not in cut and "floor" not in cut["cost_model"]["params"]
    kept = refit(cal, 1000).data["modes"]["full"]  # ... but not under its own B·S = 1560
    assert kept["launch_point"]["feasible"] and kept["cost_model"]["params"]["floor"] > 0
    assert inp.truth.mean(1, 1560) == pytest.approx(40 / 18 * plain["ms"])
    assert inp.truth.mean(2, 32760) == pytest.approx(inp.cost.predict(2, 32760), rel=1e-6)


def test_the_committed_14b_calibration_prices_every_point_and_the_8gpu_preset_finds_it(monkeypatch, tmp_path):
    """Wan 14B measured as an 18-block slice on one H200: every scan point and the launch point within 5 % of the
    cost model at 40 blocks, 3 % left out; FSDP's memory model over 8 ranks; `conf=wan21_8gpu` on 8 H200s finds it
    with scheduling.calibration=auto, and the 1.3B presets pass it over."""
    from tests.helpers import ROOT, compose_config
    from training.shape_benchmark import find_calibration

    monkeypatch.chdir(ROOT)
    cal = Calibration.load("results/calibration_h200_14b.json")
    rec = cal.data["modes"]["full"]
    assert (cal.data["model"]["dim"], cal.data["model"]["num_layers"]) == (5120, 40)
    assert cal.data["extrapolation"]["scale"] == pytest.approx(40 / 18)
    assert max(abs(e) for e in rec["rel_err_every_point"]["quadratic"]) < 0.05
    assert abs(rec["launch_rel_err"]["quadratic"]) < 0.05 and rec["cost_model"]["loo_rel_rmse"] < 0.03
    cost = CostModel.from_dict(rec["cost_model"])
    for p in cal.measured_points("full"):  # at 40 blocks, as the planner prices them
        assert cost.predict(p["B"], p["S"]) == pytest.approx(p["ms"], rel=0.05)
    mem = cal.memory_model("full", 8)
    assert rec["memory_model"]["kind"] == "fsdp" and 100_000 < mem.m_mem(0.9 * cal.hbm_bytes, 1560) < 250_000
    # a refit of its points gives the same model and held-out error (the floor kept in every leave-one-out refit)
    from scheduling.calibrate import refit

    again = refit(Calibration.load("results/calibration_h200_14b.json"), None).data["modes"]["full"]["cost_model"]
    assert again["params"] == pytest.approx(rec["cost_model"]["params"], rel=1e-6)
    assert again["loo_rel_rmse"] == pytest.approx(rec["cost_model"]["loo_rel_rmse"], rel=1e-6)
    cfg = compose_config(["conf=wan21_8gpu", f"run_dir={tmp_path}"])
    eager = {"attention": "cudnn", "fused_ops": "auto", "cuda_graphs": False, "precision": "bf16", "compile": False}
    path, how = find_calibration(cfg, "NVIDIA H200", 8, want=eager)  # what train.py's execution() gives there
    assert path.endswith("calibration_h200_14b.json") and how.startswith("measured on this model")
    path, why = find_calibration(cfg, "NVIDIA H200", 8, want=dict(eager, attention="flash"))
    assert path is None and any("_14b.json: another execution (attention cudnn there, flash here)" in w for w in why)
    path, _ = find_calibration(compose_config(["conf=wan21_1p3b", f"run_dir={tmp_path}"]), "NVIDIA H200", 1)
    assert not path.endswith("_14b.json")


def test_the_1p3b_preset_finds_the_calibration_of_its_policies_and_execution(monkeypatch, tmp_path):
    """conf=wan21_1p3b (checkpointing=auto, keep_attention=auto, CUDA graphs on one GPU) on an H200 takes the file
    that measured none, full and keep under cuDNN with graphs; the eager scan of full alone is passed over, and an
    eager run (graphs off) finds none of them."""
    from tests.helpers import ROOT, compose_config
    from training.shape_benchmark import find_calibration

    monkeypatch.chdir(ROOT)
    cfg = compose_config(["conf=wan21_1p3b", f"run_dir={tmp_path}"])
    assert (cfg.model.checkpointing, cfg.model.keep_attention) == ("auto", "auto")
    graphs = {"attention": "cudnn", "fused_ops": "auto", "cuda_graphs": True, "precision": "bf16", "compile": False}
    path, how = find_calibration(cfg, "NVIDIA H200", 1, want=graphs)
    assert path.endswith("calibration_h200_policies.json") and how.startswith("measured on this model")
    assert set(Calibration.load(path).modes) == {"none", "full", "keep"}
    path, why = find_calibration(cfg, "NVIDIA H200", 1, want=dict(graphs, cuda_graphs=False))
    assert path is None
    assert any("calibration_h200.json: policies ['full'] measured, not ['none', 'keep']" in w for w in why), why


def test_the_1p3b_preset_on_an_h100_finds_the_h100_calibration_whose_points_fit_its_models(monkeypatch, tmp_path):
    """results/calibration_h100_policies.json (measured on an H100 on 2026-12-07, results/attention_h100.md):
    conf=wan21_1p3b on that GPU finds it, the H200's files are passed over as another GPU's, every timed point of
    every policy lies within 5 % of its cost model, and its partial checks fitted within their budget."""
    from tests.helpers import ROOT, compose_config
    from training.shape_benchmark import find_calibration

    monkeypatch.chdir(ROOT)
    cfg = compose_config(["conf=wan21_1p3b", f"run_dir={tmp_path}"])
    graphs = {"attention": "cudnn", "fused_ops": "auto", "cuda_graphs": True, "precision": "bf16", "compile": False}
    h100 = "NVIDIA H100 80GB HBM3"
    path, how = find_calibration(cfg, h100, 1, want=graphs)
    assert path.endswith("calibration_h100_policies.json") and how == f"measured on this model and {h100}"
    path, _ = find_calibration(cfg, "NVIDIA H200", 1, want=graphs)
    assert path.endswith("calibration_h200_policies.json")
    cal = Calibration.load("results/calibration_h100_policies.json")
    assert set(cal.modes) == {"none", "full", "keep"}
    for mode in cal.modes:
        cost = CostModel.from_dict(cal.data["modes"][mode]["cost_model"])
        points = cal.measured_points(mode)
        assert len(points) >= 3
        for p in points:
            assert cost.predict(p["B"], p["S"]) == pytest.approx(p["ms"], rel=0.05), (mode, p)
    checks = cal.data["partial_checks"]
    assert {c["S"] for c in checks} == {75600, 46800}
    assert all(c["fits"] and c["peak_bytes"] <= c["budget_bytes"] for c in checks)


def test_the_14b_on_h100s_under_the_policies_finds_the_h100_slice_and_needs_16_ranks_for_the_long_clip(
        monkeypatch, tmp_path):
    """results/calibration_h100_14b_policies.json (a 4-block slice of the 14B on an H100, 2026-12-07,
    results/attention_h100.md): every timed point and the launch point of none, full and keep within 5 % of its
    cost model at 40 blocks, each with FSDP's memory model; conf=wan21_8gpu under the policies finds it on an H100
    and not on an H200. Over 8 ranks the 81-frame 720p clip does not fit an 80 GB GPU even recomputing every block,
    and the schedule says so and what to change; over 16 the plan holds, one image runs without recompute, and
    the clip recomputes every block."""
    import dataclasses

    from data.buckets import bucket_table
    from scheduling.policy import schedule_for
    from scheduling.simulate import DEFAULT_MIX
    from tests.helpers import ROOT, compose_config
    from training.shape_benchmark import find_calibration

    monkeypatch.chdir(ROOT)
    cal = Calibration.load("results/calibration_h100_14b_policies.json")
    assert set(cal.modes) == {"none", "full", "keep"} and cal.data["extrapolation"]["blocks_timed"] == 4
    for mode in cal.modes:
        rec = cal.data["modes"][mode]
        assert rec["memory_model"]["kind"] == "fsdp", mode
        assert abs(rec["launch_rel_err"]["quadratic"]) < 0.05, mode
        cost = CostModel.from_dict(rec["cost_model"])
        points = cal.measured_points(mode)
        assert len(points) >= 6 and max(abs(e) for e in rec["rel_err_every_point"]["quadratic"]) < 0.05, mode
        for p in points:  # at 40 blocks, as the planner prices them
            assert cost.predict(p["B"], p["S"]) == pytest.approx(p["ms"], rel=0.05), (mode, p)
    cfg = compose_config(["conf=wan21_8gpu", f"run_dir={tmp_path}", "model.checkpointing=auto",
                          "model.keep_attention=auto"])
    eager = {"attention": "cudnn", "fused_ops": "auto", "cuda_graphs": False, "precision": "bf16", "compile": False}
    h100 = "NVIDIA H100 80GB HBM3"
    path, how = find_calibration(cfg, h100, 8, want=eager)
    assert path.endswith("calibration_h100_14b_policies.json") and how == f"measured on this model and {h100}"
    _, why = find_calibration(cfg, "NVIDIA H200", 8, want=eager)
    assert any(f"calibration_h100_14b_policies.json: measured on {h100}" in w for w in why)

    cfg = dataclasses.replace(cfg, scheduling=dataclasses.replace(cfg.scheduling, calibration=path))
    tokens = {n: b.tokens for n, b in bucket_table(cfg.data.buckets, patch=cfg.model.patch).items()}
    shares = {n: share for n, _, share in DEFAULT_MIX}
    shape = ModelShape(1, 40, 5120, 512)
    with pytest.raises(ValueError, match=r"FSDP over 8 ranks\)\)=5\d{4} tokens is below a bucket's S=75600: .*"
                                         r"shard over more ranks \(16 hold it; FSDP over 8 keeps 33\.3 GiB of sharded "
                                         r"states") as e:
        schedule_for(cfg, tokens, shape, 8, shares)
    assert "turn on model.checkpointing" not in str(e.value) and "a larger budget will not do" in str(e.value)
    # the preset as shipped (full recompute, no kept attention) finds the same file and stops the same way
    full = compose_config(["conf=wan21_8gpu", f"run_dir={tmp_path}"])
    assert find_calibration(full, h100, 8, want=eager)[0] == path
    with pytest.raises(ValueError, match=r"\)=5\d{4} tokens is below a bucket's S=75600"):
        schedule_for(dataclasses.replace(full, scheduling=cfg.scheduling), tokens, shape, 8, shares)
    # every block keeping its attention holds less: over 16 ranks the advice is to keep it only where it fits
    keep = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, checkpointing="full", keep_attention=True))
    with pytest.raises(ValueError, match=r"set model\.keep_attention=auto or false"):
        schedule_for(keep, tokens, shape, 16, shares)
    none = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, checkpointing="none", keep_attention=False))
    with pytest.raises(ValueError, match=r"=774 tokens is below .*; turn on model\.checkpointing \(full, or auto\)"):
        schedule_for(none, tokens, shape, 8, shares)
    s = schedule_for(cfg, tokens, shape, 16, shares)
    assert abs(s.values["tokens_per_step"] - cfg.scheduling.tokens_per_step) <= 0.1 * cfg.scheduling.tokens_per_step
    assert s.recompute_blocks(1, 1560) == (0, 0) and s.recompute_blocks(1, 75600)[0] == 40
    assert all(b * tokens[n] <= s.values["m_mem"] or b == 1 for n, b in s.batch_sizes.items())
    assert 75600 <= s.values["m_mem"]


def test_the_8gpu_preset_holds_two_long_clips_a_step_with_the_simulators_choice(monkeypatch, tmp_path):
    """`python train.py conf=wan21_8gpu` on 8 H200s, as train.py resolves it: calibration=auto finds the 14B file, and
    the preset's tokens_per_step (2·S_max a GPU a step) with scheduling.planner=windowed and the window the
    simulator chose takes balanced's M and target from the simulator's choice in it, inside g ± 10 % and the memory
    bound. The preset as shipped plans one step at a time, re-formed (no window by default:
    results/convergence_cpu.md), so that choice, tuned for a window, is set aside and M and the target are chosen
    again; the equal-token baseline keeps its m_tokens and gets its M."""
    import dataclasses

    from scheduling.policy import schedule_for
    from tests.helpers import ROOT, compose_config
    from training.shape_benchmark import find_calibration

    monkeypatch.chdir(ROOT)
    cfg = compose_config(["conf=wan21_8gpu", f"run_dir={tmp_path}"])
    path, _ = find_calibration(cfg, "NVIDIA H200", 8)
    cfg = dataclasses.replace(cfg, scheduling=dataclasses.replace(cfg.scheduling, calibration=path))
    from data.buckets import bucket_table
    from scheduling.simulate import DEFAULT_MIX

    tokens = {n: b.tokens for n, b in bucket_table(cfg.data.buckets, patch=cfg.model.patch).items()}
    shares = {n: share for n, _, share in DEFAULT_MIX}
    shape = ModelShape(1, 40, 5120, 512)
    g = cfg.scheduling.tokens_per_step
    assert g == 2 * max(tokens.values())
    best = Calibration.load(path).data["chosen"]["by_tokens_per_step"]["8"][str(int(g))]["balanced"]
    assert best["window"] > 1
    plain = schedule_for(cfg, tokens, shape, 8, shares)
    assert (plain.planner, plain.window) == ("reformed", 1) and abs(plain.values["tokens_per_step"] - g) <= 0.1 * g
    # the table the simulator's cost × reformed cell runs (results/simulation_h200.md), here chosen on one step
    assert [plain.batch_sizes[n] for n in ("i480", "i720", "v480_17f", "v480_33f", "v480_49f", "v480_81f",
                                           "v720_81f")] == [98, 42, 18, 8, 5, 2, 1] and plain.micro_batches == 2
    assert not plain.sources["micro_batches"].startswith("calibration:chosen")
    assert any("tuned for window" in n for n in plain.notes)
    cfg = dataclasses.replace(cfg, scheduling=dataclasses.replace(cfg.scheduling, planner="windowed",
                                                                  window=best["window"]))
    s = schedule_for(cfg, tokens, shape, 8, shares)
    assert s.sources["target_microbatch_ms"].startswith("calibration:chosen")
    assert s.values["target_microbatch_ms"] == pytest.approx(best["target_microbatch_ms"])
    assert s.micro_batches == best["micro_batches"] != cfg.train.micro_batches and s.window == best["window"]
    assert abs(s.values["tokens_per_step"] - g) <= 0.1 * g and s.values["m_mem"] <= 152_901
    base = schedule_for(dataclasses.replace(cfg, scheduling=dataclasses.replace(cfg.scheduling, strategy="equal_token")),
                        tokens, shape, 8, shares)
    assert base.values["m_tokens"] == 75600 and abs(base.values["tokens_per_step"] - g) <= 0.1 * g


def test_the_bucket_report_of_the_8gpu_preset_shows_the_batch_it_holds(monkeypatch, capsys, tmp_path):
    """`scripts/show_buckets.py conf=wan21_8gpu` takes the synthetic mix's shares for tokens_per_step: on an H200 the
    14B calibration's balanced table at M = 2 (planned one step at a time: the simulator's choice, tuned for a
    window, is chosen again), on a CPU (no calibration) the equal-token table at M = 2; a real corpus' shares are
    only known to the run, which the report says."""
    import training.shape_benchmark as sb
    from tests.helpers import ROOT, compose_config
    from training.bucket_report import print_buckets

    monkeypatch.chdir(ROOT)
    cfg = compose_config(["conf=wan21_8gpu", f"run_dir={tmp_path}"])
    monkeypatch.setattr(sb, "device_name", lambda device: "CPU (x86_64, 2 threads)")  # also on a GPU machine
    print_buckets(cfg)
    out = capsys.readouterr().out
    assert "strategy equal_token" in out and "'micro_batches': 2" in out and "expected for g=151200" in out
    monkeypatch.setattr(sb, "device_name", lambda device: "NVIDIA H200")
    print_buckets(cfg)
    out = capsys.readouterr().out
    assert "calibration_h200_14b.json" in out and "strategy balanced" in out and "'micro_batches': 2" in out
    print_buckets(compose_config(["conf=wan21_8gpu", f"run_dir={tmp_path}", f"data.index={tmp_path}"]))
    assert "held with the corpus' own bucket shares" in capsys.readouterr().out


def test_the_1p3b_preset_holds_its_fixed_batch_with_the_best_cell_for_one_gpu(monkeypatch, tmp_path):
    """`python train.py conf=wan21_1p3b` on one H200, as train.py resolves it (calibration=auto finds the policies'
    file; the CUDA graphs' cap shrinks the budget of larger micro-batches): 75,600 tokens a step (1·S_max) held by
    the matrix's best cell for one GPU, equal_token in stream order at m_tokens = S_max, one micro-batch a step, its
    expected tokens within ±10 % and under the memory bound less the graphs' pool; balanced, asked for, holds the
    same batch in its own table."""
    import dataclasses

    from data.buckets import bucket_table
    from scheduling.policy import schedule_for
    from scheduling.simulate import DEFAULT_MIX
    from tests.helpers import ROOT, compose_config
    from training.shape_benchmark import find_calibration

    monkeypatch.chdir(ROOT)
    cfg = compose_config(["conf=wan21_1p3b", f"run_dir={tmp_path}"])
    graphs = {"attention": "cudnn", "fused_ops": "auto", "cuda_graphs": True, "precision": "bf16", "compile": False}
    path, _ = find_calibration(cfg, "NVIDIA H200", 1, want=graphs)
    assert path.endswith("calibration_h200_policies.json")
    cfg = dataclasses.replace(cfg, scheduling=dataclasses.replace(cfg.scheduling, calibration=path))
    tokens = {n: b.tokens for n, b in bucket_table(cfg.data.buckets, patch=cfg.model.patch).items()}
    shares = {n: share for n, _, share in DEFAULT_MIX}
    shape = ModelShape(1, 30, 1536, 512)
    g = cfg.scheduling.tokens_per_step
    assert g == max(tokens.values()) == 75600 and cfg.launch.num_processes == 1
    s = schedule_for(cfg, tokens, shape, 1, shares, graph_tokens=cfg.train.graph_max_tokens)
    assert (s.strategy, s.planner, s.window, s.micro_batches) == ("equal_token", "stream", 1, 1)
    assert s.values["m_tokens"] == 75600 and s.sources["m_tokens"] == "config"
    assert [s.batch_sizes[n] for n, _, _ in DEFAULT_MIX] == [48, 21, 9, 5, 3, 2, 1]
    assert abs(s.values["tokens_per_step"] - g) <= 0.1 * g
    # every micro-batch of the preset's table holds more than train.graph_max_tokens: none is captured, no pool kept
    assert s.graph_tokens == 0 and "graph_pool_gib" not in s.values and 600_000 < s.values["m_mem"]
    k, j = s.recompute_blocks(1, 75600)  # the preset's keep_attention=auto reaches the policy: the clip keeps
    assert 0 < j == k < 30 and "memory left keeping attention" in s.sources["cost"]
    bal = schedule_for(dataclasses.replace(cfg, scheduling=dataclasses.replace(cfg.scheduling, strategy="balanced")),
                       tokens, shape, 1, shares, graph_tokens=cfg.train.graph_max_tokens)
    assert bal.planner == "sorted" and abs(bal.values["tokens_per_step"] - g) <= 0.1 * g


def test_a_fresh_calibration_holds_the_batch_and_says_the_simulator_would_tune_it(monkeypatch, tmp_path):
    """A calibration measured on first use has no simulated choice: balanced still holds tokens_per_step (M and the
    target by predicted tokens/s) and its note says how to record the simulator's."""
    from tests.helpers import ROOT
    from scheduling.simulate import DEFAULT_MIX

    monkeypatch.chdir(ROOT)
    cal = Calibration.load("results/calibration_h200_14b.json")
    del cal.data["chosen"]
    fresh = cal.save(str(tmp_path / "calibration.json"))
    s = resolve_schedule(SchedulingConfig("balanced", calibration=fresh, tokens_per_step=151200),
                         {n: S for n, S, _ in DEFAULT_MIX}, ModelShape(1, 40, 5120, 512), checkpointing="full",
                         world_size=8, shares={n: share for n, _, share in DEFAULT_MIX})
    assert s.sources["micro_batches"] == "chosen for tokens_per_step (predicted tokens/s)"
    assert abs(s.values["tokens_per_step"] - 151200) <= 0.1 * 151200
    assert any("records no simulated choice" in n and "--write-chosen" in n for n in s.notes)


def test_refit_takes_the_points_memory_model_and_optimizer_time_unless_the_file_keeps_its_own():
    """A measured memory model is fitted again from the points' peaks (a stale one is replaced), but kept where the
    points hold no peaks; the optimizer's ms is the points' median, except where the file had none."""
    from scheduling.calibrate import new_calibration, refit

    quad = lambda B, S: 2.0 + 1e-3 * B * S + 1e-7 * B * S * S  # noqa: E731
    shapes = [(1, 1000), (8, 1000), (32, 1000), (1, 4000), (4, 4000), (1, 16000)]

    def cal_of(peaks: bool, **rec_kw):
        pts = [Point("b", S, B, True, quad(B, S), [quad(B, S)], 5.0, C0 + C1 * B * S if peaks else None)
               for B, S in shapes]
        rec = fit_mode(pts) | rec_kw
        return new_calibration({"full": rec}, model={}, source="t", device="t", date="t", command="t")

    fitted = cal_of(True).data["modes"]["full"]["memory_model"]
    assert fitted["c0"] == pytest.approx(C0, rel=1e-6) and fitted["c1"] == pytest.approx(C1, rel=1e-6)
    stale = {**fitted, "c0": 2 * C0, "measured": True}
    again = refit(cal_of(True, memory_model=stale), None).data["modes"]["full"]
    assert again["memory_model"]["c0"] == pytest.approx(C0, rel=1e-6)  # the points' peaks say otherwise
    kept = refit(cal_of(False, memory_model=stale), None).data["modes"]["full"]
    assert kept["memory_model"] == stale  # no peaks to fit: the file's model stays
    assert again["optim_ms"] == 5.0
    assert refit(cal_of(True, optim_ms=99.0), None).data["modes"]["full"]["optim_ms"] == 5.0
    assert refit(cal_of(True, optim_ms=None), None).data["modes"]["full"]["optim_ms"] is None


def test_the_cap_probe_is_skipped_only_where_its_own_bucket_already_ran_that_b():
    """The probe's B is compared with the shortest bucket's own largest timed B, not with a longer bucket's."""
    import math

    from scheduling.calibrate import _probe_cap

    def pt(name, S, B):
        return Point(name, S, B, True, 1.0 + B * S / 1e3, [1.0], 1.0, C0 + C1 * B * S)

    tokens = {"img": 1000, "clip": 16000}  # the shortest bucket is not the first by name
    budget = C0 + C1 * 10 * 1000  # room for B = 10 of img
    for done, want_why in ((2, ""), (10, "cap probe: B=10 is not above the B=10 already timed")):
        calls = []
        points = [pt("img", 1000, 1), pt("img", 1000, done), pt("clip", 16000, 1), pt("clip", 16000, 50)]
        _probe_cap(points, tokens, lambda: budget, 12, math.inf, lambda: False,
                   lambda name, S, B, why: calls.append((name, S, B, why)) or pt(name, S, B), lambda v: v,
                   lambda s: None, budget)
        assert calls == [("img", 1000, 10, want_why)]


def test_the_choice_for_a_fixed_batch_comes_from_the_nearest_world_size_and_g_and_is_empty_for_a_missing_rule():
    from scheduling.calibrate import new_calibration

    cal = new_calibration({}, model={}, source="t", device="t", date="t", command="t")
    assert cal.chosen_at_tokens("cost", 8, 3000.0) == {}
    cal.data["chosen"] = {"by_tokens_per_step": {"8": {"2000": {"cost": {"target_microbatch_ms": 50.0}},
                                                       "8000": {"cost": {"target_microbatch_ms": 90.0}}},
                                                 "64": {"2000": {"cost": {"target_microbatch_ms": 70.0}}}}}
    assert cal.chosen_at_tokens("cost", 16, 3000.0) == {"target_microbatch_ms": 50.0, "simulated_world_size": 8,
                                                        "simulated_g": 2000.0}
    assert cal.chosen_at_tokens("cost", 16, 5000.0)["target_microbatch_ms"] == 90.0  # log-nearer 8000 than 2000
    assert cal.chosen_at_tokens("cost", 48, 3000.0)["simulated_world_size"] == 64
    assert cal.chosen_at_tokens("equal_token", 8, 3000.0) == {"simulated_world_size": 8, "simulated_g": 2000.0}


def test_a_bucket_left_one_ladder_point_by_the_probe_takes_its_ladders_top():
    """Six points over three buckets give two each; the probe takes one of the shortest bucket's, whose remaining
    point is its ladder's top (its B = 1 would be launch-bound), not B = 1."""
    pts = scan(fake_step(), TOKENS, max_points=6, top_tokens=64_000, mem_budget_bytes=C0 + C1 * 200_000, warmup=0,
               repeats=1)
    img = [p.B for p in pts if p.bucket == "img" and p.feasible]
    assert img[0] == 64 and len(img) == 2 and img[1] > 64  # 64,000 // 1000, then the probe
    assert [p.B for p in pts if p.bucket == "short"][0] == 1


def test_a_slice_timed_at_two_depths_prices_those_points_at_t_fixed_plus_l_t_block(monkeypatch):
    from tests.helpers import ROOT

    monkeypatch.chdir(ROOT)
    cal = Calibration.load("results/calibration_h200_14b.json")
    dc = cal.data["modes"]["full"]["depth_check"]
    main = str(dc["depths"][0])
    rows = [r for r in dc["points"] if r["block_ms"] > 0 and r["full_affine_ms"] > 0]
    affine = cal.affine_scales("full")
    assert len(rows) >= 3 and {(r["bucket"], int(r["B"])) for r in rows} <= set(affine)
    truth = {(p["bucket"], p["B"]): p["ms"] for p in cal.measured_points("full")}
    flat = cal.data["extrapolation"]["scale"]
    assert any(r["fixed_ms"] < 0 for r in rows) and any(r["fixed_ms"] >= 0 for r in rows)  # both kinds in the file
    for r in rows:
        key = (r["bucket"], int(r["B"]))
        if r["fixed_ms"] >= 0:
            assert affine[key] == pytest.approx(r["full_affine_ms"] / r["ms"][main])
            assert truth[key] == pytest.approx(r["full_affine_ms"], rel=1e-6)
        else:  # a negative fixed part is noise: the flat scale
            assert affine[key] == pytest.approx(flat) and truth[key] == pytest.approx(r["ms"][main] * flat, rel=1e-6)


def test_the_two_depth_truth_takes_the_fixed_part_once_and_never_a_negative_one():
    """At 18 and 9 of 40 blocks: t(18) = 20 + 18·10 = 200, t(9) = 110 → 20 + 40·10 = 420 ms at the full depth, not the
    flat 200·40/18 = 444; a pair whose fixed part comes out negative (t(9) = 92: 2 − ... = −16) keeps the flat scale."""
    from scheduling.calibrate import new_calibration
    from scheduling.fsdp_memory import depth_check

    pts = [Point("a", 1000, 1, True, 200.0, [200.0], 1.0), Point("b", 4000, 1, True, 200.0, [200.0], 1.0),
           Point("c", 8000, 1, True, 300.0, [300.0], 1.0)]
    rec = fit_mode(pts, scale=40 / 18)
    second = [{"bucket": "a", "S": 1000, "B": 1, "feasible": True, "ms": 110.0},
              {"bucket": "b", "S": 4000, "B": 1, "feasible": True, "ms": 92.0}]
    rec["depth_check"] = depth_check({18: [dict(p.__dict__) for p in pts], 9: second}, 40, 18)
    cal = new_calibration({"full": rec}, model={"num_layers": 40}, source="t", device="t", date="t", command="t",
                          extrapolation={"blocks_timed": 18, "num_layers": 40, "scale": 40 / 18})
    got = {p["bucket"]: p["ms"] for p in cal.measured_points("full")}
    assert got["a"] == pytest.approx(420.0)
    assert got["b"] == pytest.approx(200.0 * 40 / 18)  # fixed 200 − 18·(108/9) = −16 ms: flat
    assert got["c"] == pytest.approx(300.0 * 40 / 18)  # one depth only: flat


def test_the_scan_measures_the_longest_clips_under_the_policys_own_choice_and_the_planner_reads_it(tmp_path):
    """After the policies' fits, the scan runs the longest buckets whose one sample fits only with some blocks
    recomputed, at the (k, j) checkpointing=auto chooses at the budget less the graphs' pool it holds, and records
    their peaks beside the prediction (partial_checks). One that runs out of memory is tried again at a budget 10 %
    smaller, so that what is recorded is a peak; where every try fails the row says so and the planner passes it
    over. The planner then raises none's activations beyond its longest measured S by what the checks found. A fake
    step here (a peak 6 % above the prediction, or out of memory); the 1.3B's three-policy file gives the models."""
    import dataclasses
    import math
    import os

    from scheduling.policy import _partial_recompute, partial_check_scale
    from tests.helpers import ROOT
    from training.shape_benchmark import partial_checks

    path = os.path.join(ROOT, "results", "calibration_h200_policies.json")
    data = json.loads(open(path).read())
    del data["partial_checks"]  # as the scan has it before its checks
    fresh = tmp_path / "fresh.json"
    fresh.write_text(json.dumps(data))
    cal = Calibration.load(str(fresh))
    pr = _partial_recompute(SchedulingConfig("equal_token", calibration=str(fresh), m_tokens=32760), cal,
                            ModelShape(1, 30, 1536, 512), "auto", "auto", 1, cal.memory_model("full", 1),
                            cal.cost_model("full"), 1560)
    tokens = {"i480": 1560, "v480_81f": 32760, "v720_49f": 46800, "v720_81f": 75600}
    ran, said, fail_below = [], [], {"v720_49f": 31, "v720_81f": 0}  # OOM while k < this

    def step_for(kj):
        def step(name, B):
            ran.append((name, B, kj))
            if kj[0] < fail_below[name]:
                raise Infeasible("CUDA out of memory")
            return StepResult(1000.0 + len(ran), 5.0, 1.06 * pr.peak(B, tokens[name], *kj))
        return step

    held = 4 * 2**30
    rows = partial_checks(step_for, pr, tokens, warmup=1, repeats=2, log=said.append, held_bytes=held)
    at = dataclasses.replace(pr, budget=pr.budget - held)
    k, j = at.decide(1, 75600)
    assert 0 < k < 30 and (k, j) != pr.decide(1, 75600) and pr.decide(1, 46800) == (0, 0)  # 46,800 fits whole
    assert [r["bucket"] for r in rows] == ["v720_81f"] and ran == [("v720_81f", 1, (k, j))] * 3
    assert rows[0]["peak_bytes"] == pytest.approx(1.06 * at.peak(1, 75600, k, j))
    assert rows[0]["ms_runs"] == [1002.0, 1003.0] and rows[0]["held_bytes"] == held
    assert rows[0]["predicted_peak_bytes"] == at.peak(1, 75600, k, j) and "partial check v720_81f" in said[0]
    data["partial_checks"] = rows
    fresh.write_text(json.dumps(data))
    scale, beyond = partial_check_scale(Calibration.load(str(fresh)), pr)
    assert beyond == 14040 and scale > 1.06  # the excess lies on none's activations alone
    # a smaller budget: 46,800 needs recompute too; out of memory at every k < 31 it is tried at budgets 10 % apart
    # and recorded as out of memory, which the planner passes over; the clip, out of memory below k = 12, is
    # measured at the first smaller budget whose choice fits
    small = dataclasses.replace(pr, budget=60 * 2**30)
    fail_below["v720_81f"] = small.decide(1, 75600)[0] + 1
    ran.clear()
    rows = partial_checks(step_for, small, tokens, warmup=0, repeats=1, log=said.append, limit=2)
    assert [r["bucket"] for r in rows] == ["v720_81f", "v720_49f"]
    clip, mid = rows
    assert clip["fits"] and clip["k"] >= fail_below["v720_81f"] and clip["out_of_memory_at"]
    assert clip["budget_bytes"] == pytest.approx(60 * 2**30 * 0.9 ** len(clip["out_of_memory_at"]))
    assert mid["fits"] is False and len(mid["out_of_memory_at"]) == 4 and "peak_bytes" not in mid
    assert "out of memory first at" in said[-1]
    data["partial_checks"] = [mid]
    fresh.write_text(json.dumps(data))
    assert partial_check_scale(Calibration.load(str(fresh)), small) == (1.0, math.inf)


def test_the_scans_partial_checks_reach_the_file_and_a_failing_one_never_costs_the_scan(tmp_path):
    """scan_partial_checks, as calibrate_config calls it after the scan is saved: the step maker gets the policy's
    (k, j) as the tuple make_step_fn and set_activation_checkpointing take; the rows land in the file's
    partial_checks; an error other than running out of memory is logged and noted, and the file keeps its scan."""
    import os
    from types import SimpleNamespace

    from tests.helpers import ROOT, compose_config
    from training.shape_benchmark import scan_partial_checks

    path = os.path.join(ROOT, "results", "calibration_h200_policies.json")
    data = json.loads(open(path).read())
    del data["partial_checks"]
    cal = Calibration(data)
    cfg = compose_config(["conf=wan21_1p3b"])
    model = SimpleNamespace(num_matmul_params=lambda: 1_250_623_488)
    opts = SimpleNamespace(warmup=1, repeats=1)
    tokens = {"i480": 1560, "v480_81f": 32760, "v720_81f": 75600}
    got, said = [], []

    def step_for(kj):
        assert isinstance(kj, tuple) and len(kj) == 2 and 0 < kj[1] <= kj[0] < 30
        got.append(kj)
        return lambda name, B: StepResult(8000.0, 20.0, 130 * 2**30)

    budget = 0.9 * cal.hbm_bytes
    assert scan_partial_checks(cal, cfg, model, budget, tokens, step_for, opts, said.append)
    rows = cal.data["partial_checks"]
    assert [r["bucket"] for r in rows] == ["v720_81f"] and (rows[0]["k"], rows[0]["j"]) == got[0]
    assert rows[0]["peak_bytes"] == 130 * 2**30 and rows[0]["budget_bytes"] == budget

    def broken(kj):
        raise RuntimeError("cuDNN: no plan")

    cal.data.pop("partial_checks")
    assert scan_partial_checks(cal, cfg, model, budget, tokens, broken, opts, said.append)
    assert "partial_checks" not in cal.data and "partial checks failed: RuntimeError: cuDNN: no plan" in \
        cal.data["notes"][-1] and "the scan is kept" in said[-1]
    assert cal.data["modes"]["none"]["points"]  # the scan itself untouched


def test_the_simulators_m_mem_bounds_only_the_mode_it_was_chosen_for(tmp_path):
    """A `chosen` block records the checkpointing mode the simulator ran (scripts/simulate_cluster.py --mode); its
    m_mem is that policy's memory bound. A run under another policy plans from its own record's memory model and is
    told why the simulator's settings were passed over (before, full's 680,028 tokens bounded a run without
    recompute, whose own bound is ten times smaller)."""
    from scheduling.simulate import DEFAULT_MIX
    from tests.helpers import ROOT

    wan = {n: S for n, S, _ in DEFAULT_MIX}
    d = json.load(open(os.path.join(ROOT, "results", "calibration_h200_policies.json")))
    d["chosen"] = {"mode": "full", "m_mem": 680028, "m_mem_S_min": 1560}
    path = str(tmp_path / "cal.json")
    json.dump(d, open(path, "w"))
    cal = Calibration.load(path)
    shape = ModelShape(1, 30, 1536, 512)
    del wan["v720_81f"]  # none's bound cannot hold the 720p clip on one GPU
    none = resolve_schedule(SchedulingConfig("dual_constraint", calibration=path), wan, shape, checkpointing="none")
    own = cal.memory_model("none").m_mem(0.9 * cal.hbm_bytes, 1560)
    assert none.values["m_mem"] == own < 680028 / 5 and not none.sources["m_mem"].startswith("calibration:chosen")
    assert any("chosen for checkpointing=full, not this run's none" in n for n in none.notes)
    full = resolve_schedule(SchedulingConfig("dual_constraint", calibration=path), wan, shape, checkpointing="full")
    assert full.values["m_mem"] == 680028 and full.sources["m_mem"] == "calibration:chosen"
    assert cal.chosen("cost", mode="none") == {} and cal.chosen("cost", mode="full")["m_mem"] == 680028


def test_keeping_every_blocks_attention_needs_a_calibration_that_measured_it():
    """keep_attention=true keeps every recomputed block's attention; with a file that measured full recompute alone,
    full's memory model would bound micro-batches the kept outputs push past the GPU (146 GiB predicted for the
    480p image bucket on a 139.8 GiB H200). Refused at start, with the ways on; keep_attention=auto prices the kept
    bytes instead, and a file with the keep policy bounds it by keep's own model."""
    from scheduling.simulate import DEFAULT_MIX

    wan = {n: S for n, S, _ in DEFAULT_MIX}
    shape = ModelShape(1, 30, 1536, 512)
    for ckpt in ("full", "auto"):
        with pytest.raises(ValueError, match="measured no keep policy.*keep_attention=auto"):
            resolve_schedule(SchedulingConfig("dual_constraint", calibration="results/calibration_h200.json"), wan,
                             shape, checkpointing=ckpt, keep_attention=True)
    auto = resolve_schedule(SchedulingConfig("dual_constraint", calibration="results/calibration_h200.json"), wan,
                            shape, checkpointing="full", keep_attention="auto")
    assert auto.recompute_blocks is not None
    keep = resolve_schedule(SchedulingConfig("dual_constraint", calibration="results/calibration_h200_policies.json"),
                            wan, shape, checkpointing="full", keep_attention=True)
    cal = Calibration.load("results/calibration_h200_policies.json")
    assert keep.sources["cost"].startswith("calibration:keep")
    assert keep.values["m_mem"] == cal.memory_model("keep").m_mem(0.9 * cal.hbm_bytes, 1560)


def _broken(tmp_path, edit, base="results/calibration_cpu_tiny.json") -> str:
    d = json.load(open(base))
    edit(d)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(d))
    return str(path)


@pytest.mark.parametrize("edit, says", [
    (lambda d: d["modes"]["none"].pop("cost_model"), r"modes\.none lacks 'cost_model'"),
    (lambda d: d["modes"]["none"]["cost_model"]["params"].clear(), r"modes\.none\.cost_model .*lacks the parameter"),
    (lambda d: d["modes"]["none"]["cost_model"].update(foo=1), r"modes\.none: .*unexpected keyword argument 'foo'"),
    (lambda d: d["modes"]["none"]["cost_model"]["params"].update(a=float("nan")), r"must be finite numbers"),
    (lambda d: d["modes"]["none"]["cost_model"]["params"].update(b2=float("inf")), r"must be finite numbers"),
    (lambda d: d["modes"]["none"]["cost_model"]["params"].update(a=-1e6), r"predicts -\d.* ms at B=1"),
    (lambda d: d["modes"]["none"]["fits"]["power"]["params"].pop("p"), r"fits\.power \(power\) lacks the parameter "
                                                                        r"'p'"),
    (lambda d: d["chosen"].update(m_mem="960"), r"chosen\.m_mem '960' is not a positive number"),
    (lambda d: d["chosen"].update(by_world_size={"0": {}}), r"'0' is not a number of ranks"),
    (lambda d: d.update(chosen=[1]), r"`chosen` .* is not an object"),
    (lambda d: d.update(hbm_bytes="80GB"), r"hbm_bytes '80GB' is not a positive number"),
    (lambda d: d.update(hbm_bytes=float("inf")), r"hbm_bytes inf is not a positive number"),
    (lambda d: d.pop("model"), r"`model` must give the measured model's dim and num_layers"),
    (lambda d: d.update(model=[64]), r"`model` must give"),
    (lambda d: d.update(modes={}), r"`modes` must map"),
])
def test_a_calibration_that_cannot_price_a_micro_batch_is_refused_when_it_loads(tmp_path, edit, says):
    """Each of these ended mid-start in a KeyError, TypeError or OverflowError after the corpus was opened and the
    model built (or planned on NaN and negative times, which read as perfect balance); now Calibration.load refuses
    the file, naming it and the key, and calibration=auto passes it over for the next file."""
    path = _broken(tmp_path, edit)
    with pytest.raises(ValueError, match=r"scheduling\.calibration=.*cal\.json: .*" + says):
        Calibration.load(path)


def test_files_that_are_not_calibrations_are_refused_by_name(tmp_path):
    for content, says in (("", "does not read as JSON"), ("[1, 2]", "format 'list'"), ("{\"a\": 1", "does not read")):
        (tmp_path / "c.json").write_text(content)
        with pytest.raises(ValueError, match=f"c\\.json: {says}"):
            Calibration.load(str(tmp_path / "c.json"))
    (tmp_path / "d.json").mkdir()
    with pytest.raises(ValueError, match=r"d\.json: does not read as JSON \(IsADirectoryError"):
        Calibration.load(str(tmp_path / "d.json"))
    nan_memory = _broken(tmp_path, lambda d: d["modes"]["full"]["memory_model"].update(c1=float("nan")),
                         "results/calibration_h200_policies.json")
    with pytest.raises(ValueError, match=r"modes\.full\.memory_model predicts nan bytes"):
        Calibration.load(nan_memory)
    fits = _broken(tmp_path, lambda d: d["modes"]["none"].update(fits=[1]))
    with pytest.raises(ValueError) as e:
        Calibration.load(fits)
    assert str(e.value) == (f"scheduling.calibration={fits}: modes.none.fits is not an object; re-measure it "
                            "(scripts/calibrate.py) or restore the file")  # said once, not wrapped in itself


def test_calibration_auto_passes_over_a_matching_file_that_lacks_a_record_part(tmp_path):
    """Before, a copy of the tiny CPU file without its fits matched this run first and the run died of KeyError: 'fits'
    although the good file sat beside it."""
    from tests.helpers import compose_config
    from training.shape_benchmark import find_calibration

    search = tmp_path / "results"
    search.mkdir()
    broken = json.load(open("results/calibration_cpu_tiny.json"))
    del broken["modes"]["none"]["fits"]["power"]["params"]["p"]
    (search / "calibration_a_nofits.json").write_text(json.dumps(broken))
    (search / "calibration_b_good.json").write_text(open("results/calibration_cpu_tiny.json").read())
    cfg = compose_config([f"run_dir={tmp_path / 'run'}"])
    path, how = find_calibration(cfg, "CPU", 1, search=str(search))
    assert path.endswith("calibration_b_good.json")


def test_a_cost_model_negative_at_a_bucket_and_a_budget_past_the_gpu_are_refused_at_start(tmp_path):
    from scheduling.simulate import DEFAULT_MIX

    wan = {n: S for n, S, _ in DEFAULT_MIX}
    shape = ModelShape(1, 30, 1536, 512)
    # positive over the measured lengths, negative at one far beyond them
    path = _broken(tmp_path, lambda d: d["modes"]["full"]["cost_model"]["params"].update(b2=-2.3e-7),
                   "results/calibration_h200_policies.json")
    cal = Calibration.load(path)
    far = {**wan, "v_far": 200_000}
    with pytest.raises(ValueError, match=r"predicts -[\d.e+]+ ms for one sample of bucket v_far \(S=200000\)"):
        resolve_schedule(SchedulingConfig("dual_constraint", calibration=path), far, shape, checkpointing="full")
    assert cal.cost_model("full").predict(1, 75600) > 0
    with pytest.raises(ValueError, match=r"mem_budget_gib=500 is more than the GPU has \(139\.8 GiB"):
        resolve_schedule(SchedulingConfig("dual_constraint", calibration="results/calibration_h200.json",
                                          mem_budget_gib=500), wan, shape, checkpointing="full")


def test_the_longest_buckets_advice_names_what_would_hold_it(tmp_path):
    """The ranks that would hold the bucket (none where no number would), the budget that would, a larger budget
    where the file does not know the GPU's memory, and where one sample alone fits, why the bound is lower."""
    from scheduling.simulate import DEFAULT_MIX

    wan = {n: S for n, S, _ in DEFAULT_MIX}
    shape14 = ModelShape(1, 40, 5120, 512)
    with pytest.raises(ValueError, match=r"more ranks will not do \(FSDP over 8 keeps [\d.]+ GiB of sharded states "
                                         r"a rank; over 8,192 the bound is still below S=75,600\)") as e:
        resolve_schedule(SchedulingConfig("dual_constraint", calibration="results/calibration_h200_14b.json",
                                          mem_budget_gib=48), wan, shape14, checkpointing="full", world_size=8)
    assert "shard over more ranks" not in str(e.value)
    # one H200's 1.3B without recompute: the clip needs more than 90 % of the GPU, less than all of it
    cal = Calibration.load("results/calibration_h200_policies.json")
    none = cal.memory_model("none")
    shape = ModelShape(1, 30, 1536, 512)
    with pytest.raises(ValueError, match=r"raise scheduling\.mem_budget_gib to ([\d.]+) or more") as e:
        resolve_schedule(SchedulingConfig("dual_constraint", calibration="results/calibration_h200_policies.json",
                                          mem_budget_gib=100), wan, shape, checkpointing="none")
    need = float(re.search(r"mem_budget_gib to ([\d.]+)", str(e.value)).group(1))
    assert none.m_mem((need + 0.05) * 2**30, 1560) >= 75600 > none.m_mem((need - 0.1) * 2**30, 1560)
    # one sample of the clip alone fits 130 GiB, the bound set by the shortest bucket does not
    assert none.predict(1, 75600) <= 130 * 2**30 and none.m_mem(130 * 2**30, 1560) < 75600
    with pytest.raises(ValueError, match=r"one sample of S=75,600 alone would peak at 127\.6 GiB, within the "
                                         r"130\.0 GiB budget"):
        resolve_schedule(SchedulingConfig("dual_constraint", calibration="results/calibration_h200_policies.json",
                                          mem_budget_gib=130), wan, shape, checkpointing="none")
    # a file without the GPU's memory: the budget the user set is the way, and a none-only file needs calibrating
    d = json.load(open("results/calibration_h200_policies.json"))
    d.pop("hbm_bytes")
    d["modes"] = {"none": d["modes"]["none"]}
    path = tmp_path / "none_only.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"turn on model\.checkpointing \(full, or auto\), calibrated with it first"
                                         r".*raise scheduling\.mem_budget_gib \(now 20\) if the GPU has more"):
        resolve_schedule(SchedulingConfig("dual_constraint", calibration=str(path), mem_budget_gib=20), wan, shape,
                         checkpointing="none")

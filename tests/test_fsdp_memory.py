"""scheduling/fsdp_memory.py: the per-rank FSDP memory model, its split from a slice at two depths, the file and
the policy; training/shape_benchmark.py's slice mode on the CPU."""
import json
import math
from dataclasses import replace

import pytest

from scheduling.calibrate import Calibration, Point, fit_mode, new_calibration, refit
from scheduling.config import SchedulingConfig
from scheduling.cost_model import MemoryModel
from scheduling.fsdp_memory import FSDPMemoryModel, fit_slice_line, memory_model_from_dict, slice_record
from scheduling.policy import ModelShape, resolve_schedule

MB = 1e6


def hand_model(**kw) -> FSDPMemoryModel:
    """R = 4 ranks, L = 10 blocks of 1 M parameters, 2 M outside: round numbers to check by hand."""
    base = dict(ranks=4, layers=10, params_block=1 * MB, params_fixed=2 * MB, act_block=100.0, act_fixed=1000.0,
                work=1 * MB, act_block_fwd=100.0, act_fixed_fwd=200.0, work_fwd=2 * MB, floor_work=1 * MB,
                sample_block=10.0, sample_fixed=500.0, cache_block=2 * MB, cache_fixed=0.5 * MB)
    return FSDPMemoryModel(**{**base, **kw})


def test_the_arithmetic_by_hand():
    m = hand_model()
    # P = 12 M; sharded 16·12 M / 4 = 48 M; gathered 4·(2·1 M + 2 M) = 16 M; backward's grads 4·2·1 M = 8 M
    assert (m.params, m.sharded, m.gathered, m.unsharded_grads) == (12 * MB, 48 * MB, 16 * MB, 8 * MB)
    assert m.floor == 20 * 12 * MB / 4 + 1 * MB == 61 * MB  # (16 + τ = 4)·P/R + W_o
    lines = m.lines()
    assert lines["backward"] == (48 * MB + 16 * MB + 8 * MB + 1 * MB, 10 * 100 + 1000, 10 * 10 + 500)
    # forward's end: no grads; the cast cache of 10 blocks and the root, 10·2 M + 0.5 M, unsharded
    assert lines["forward"] == (48 * MB + 16 * MB + 2 * MB + 20.5 * MB, 10 * 100 + 200, 0.0)
    assert float(m.predict(1, 1000)) == 86.5 * MB + 1200 * 1000      # the forward's end: 87.7 MB
    assert float(m.predict(10, 10_000)) == 73 * MB + 2000 * 100_000 + 600 * 10  # the backward: 273.006 MB
    assert float(m.predict(1, 1)) == 86.5 * MB + 1200 and hand_model(cache_block=0.0).predict(1, 1) == 73 * MB + 2600
    assert float(hand_model(work_fwd=-50 * MB, work=-50 * MB).predict(1, 1)) == 61 * MB  # the optimizer step
    # m_mem at 200 MB for S ≥ 1000: backward ⌊127 M / 2000.6⌋ = 63,480 < forward ⌊113.5 M / 1200⌋ = 94,583
    assert m.m_mem(200 * MB, S_min=1000) == 63_480 and m.max_batch(1000, 200 * MB) == 63
    assert m.m_mem(60 * MB, S_min=1000) == 0 and m.max_batch(1000, 60 * MB) == 0  # under the floor
    with pytest.raises(ValueError, match="S_min"):
        m.m_mem(200 * MB)
    with pytest.raises(ValueError, match="ranks"):
        hand_model(ranks=0)


def test_states_shrink_as_one_over_R_and_activations_do_not():
    m4 = hand_model()
    m8, m1 = m4.for_ranks(8), m4.for_ranks(1)
    assert m8.ranks == 8 and m4.ranks == 4  # a copy
    assert float(m4.predict(10, 10_000) - m8.predict(10, 10_000)) == 48 * MB - 24 * MB
    assert m8.lines()["backward"][1:] == m4.lines()["backward"][1:]  # per token and per sample: per rank
    assert m8.floor == 20 * 12 * MB / 8 + 1 * MB
    # one process: no FSDP, nothing gathered; every state on the one device
    assert (m1.gathered, m1.unsharded_grads, m1.sharded) == (0.0, 0.0, 192 * MB)
    assert m1.lines()["backward"][0] == 192 * MB + 1 * MB
    assert replace(m4, state_bytes=20.0).sharded == 60 * MB  # EMA: +4 B/param, sharded


@pytest.mark.parametrize("R", [1, 4, 16])
def test_m_mem_and_max_batch_agree_with_predict(R):
    m = hand_model(ranks=R, params_block=0.1 * MB)
    budget = 400 * MB
    S_min = 1000
    M = m.m_mem(budget, S_min)
    assert M > 0
    for S in (1000, 1500, 7800, 75_600):
        B = m.max_batch(S, budget)
        assert B >= 1 and float(m.predict(B, S)) <= budget < float(m.predict(B + 1, S))
        assert M // S <= B  # the token bound is safe in every bucket from S_min up
    # it binds at S_min: M tokens there fit, one more does not (B·S_min = M, B fractional)
    assert float(m.predict(M / S_min, S_min)) <= budget < float(m.predict((M + 1) / S_min, S_min))


def planted(k, B, S, Q=30 * MB, q=12.1 * MB, r=900.0, a=80.0, s0=400.0, s=5.0):
    return Q + q * k + (r + a * k) * B * S + (s0 + s * k) * B


SHAPES = [(1, 1560), (48, 1560), (1, 7800), (9, 7800), (1, 32760), (2, 32760), (1, 75600), (92, 1560)]


def test_two_depths_separate_the_per_block_and_fixed_parts():
    rows = [(k, B, S, planted(k, B, S)) for k in (18, 9) for B, S in SHAPES]
    f = fit_slice_line(rows)
    want = dict(c0_fixed=30 * MB, c0_block=12.1 * MB, c1_fixed=900.0, c1_block=80.0, c2_fixed=400.0, c2_block=5.0)
    for key, v in want.items():
        assert f[key] == pytest.approx(v, rel=1e-6), key
    assert f["rel_rmse"] < 1e-9 and f["depths"] == [9, 18] and f["n_points"] == 16
    noisy = [(k, B, S, y * (1 + 0.002 * math.sin(7 * i))) for i, (k, B, S, y) in enumerate(rows)]
    g = fit_slice_line(noisy)  # 0.2 % noise on the peaks: the per-block parts stay close
    assert g["c1_block"] == pytest.approx(80.0, rel=0.05) and g["c0_block"] == pytest.approx(12.1 * MB, rel=0.05)
    flat = [(k, B, S, planted(k, B, S, s0=0.0, s=0.0) * (1 + 0.002 * math.sin(5 * i)))
            for i, (k, B, S, _) in enumerate(rows)]
    h = fit_slice_line(flat)  # no per-sample bytes, noisy peaks: no term comes out negative (each is a size)
    assert min(h[t] for t in ("c0_fixed", "c0_block", "c1_fixed", "c1_block", "c2_fixed", "c2_block")) >= 0
    with pytest.raises(ValueError, match="two or more depths"):
        fit_slice_line([r for r in rows if r[0] == 18])
    few = fit_slice_line([r for r in rows if r[1] == 1][:6])  # B = 1 only: no per-sample term to tell apart
    assert few["c2_fixed"] == few["c2_block"] == 0.0


def test_from_slice_gives_the_fsdp_terms_and_reproduces_the_slice():
    Pb, P0 = 351_394_304.0, 232_719_424.0  # Wan 14B: a block, and the rest
    cache_b, cache_0 = 2.0 * 200e6, 50e6

    def bwd(k, B, S):  # 12 B/param + 0.1 MB a block, 1 GB workspace, 10 KB a token a block + 199 KB
        return 12 * (P0 + k * Pb) + k * 0.1 * MB + 1e9 + (199e3 + 10_240 * k) * B * S + (2e7 + 1e5 * k) * B

    def fwd(k, B, S):
        return 12 * (P0 + k * Pb) + k * cache_b + cache_0 + 0.5e9 + (60e3 + 10_240 * k) * B * S + 2e7 * B

    lines = {name: fit_slice_line([(k, B, S, f(k, B, S)) for k in (18, 9) for B, S in SHAPES])
             for name, f in (("backward", bwd), ("forward", fwd))}
    floor = {18: 20.1 * (P0 + 18 * Pb) + 0.4e9, 9: 20.1 * (P0 + 9 * Pb) + 0.4e9}
    m = FSDPMemoryModel.from_slice(lines["backward"], lines["forward"], floor, {18: 18 * cache_b + cache_0,
                                   9: 9 * cache_b + cache_0}, layers=40, params_block=Pb, params_fixed=P0,
                                   ranks=8, ema=True)
    assert m.act_block == pytest.approx(10_240, rel=1e-6) and m.act_fixed == pytest.approx(199e3, rel=1e-6)
    assert m.work == pytest.approx(1e9, rel=1e-6) and m.extra_block == pytest.approx(0.1 * MB, rel=1e-4)
    assert m.cache_block == pytest.approx(cache_b) and m.work_fwd == pytest.approx(0.5e9, rel=1e-6)
    assert m.optim_bytes == pytest.approx(4.1, rel=1e-9) and m.floor_work == pytest.approx(0.4e9, rel=1e-6)
    assert m.state_bytes == 20.0  # 16 + EMA
    c = m.checks()
    assert c["backward_bytes_per_param"] == pytest.approx(12 + 0.1 * MB / Pb, rel=1e-6)
    assert c["forward_bytes_per_param"] == pytest.approx(12, abs=1e-6)  # nothing planted beyond the cache here
    one = FSDPMemoryModel.from_slice(lines["backward"], lines["forward"], floor, {18: 18 * cache_b + cache_0},
                                     layers=40, params_block=Pb, params_fixed=P0, ranks=8, ema=False)
    assert (one.cache_block, one.cache_fixed) == (0.0, 18 * cache_b + cache_0)  # one depth's cache: all fixed
    assert one.state_bytes == 16.0  # weights, gradients, two moments; no EMA
    planted = replace(m, extra_block_fwd=0.2 * MB).checks()
    assert planted["forward_bytes_per_param"] == pytest.approx(12 + 0.2 * MB / Pb)
    assert c["optimizer_step_bytes_per_param"] == pytest.approx(20.1) and c["cache_bytes_per_param"] == \
        pytest.approx(cache_b / Pb)
    # the model at the slice's own depth, on one process, holding no gradients (12 B/param): the measurements back
    for k in (18, 9):
        own = replace(m, ranks=1, layers=k, state_bytes=12.0).lines()
        for B, S in SHAPES:
            (b0, b1, b2), (f0, f1, f2) = own["backward"], own["forward"]
            assert b0 + b1 * B * S + b2 * B == pytest.approx(bwd(k, B, S), rel=1e-9)
            assert f0 + f1 * B * S + f2 * B == pytest.approx(fwd(k, B, S), rel=1e-9)
    # 40 blocks over 8 ranks: 20 B/param ÷ 8 of 14.29 B parameters, 4 blocks and the root gathered at fp32
    P = P0 + 40 * Pb
    assert m.lines()["backward"][0] == pytest.approx(20 * P / 8 + 4 * (4 * Pb + P0) + 40 * 0.1 * MB + 1e9)
    assert m.lines()["backward"][1] == pytest.approx(40 * 10_240 + 199e3)


def test_slice_record_writes_the_model_the_checks_and_how_many_blocks_fit():
    Pb, P0 = 1e8, 5e7
    bwd = lambda k, B, S: 12 * (P0 + k * Pb) + 2e8 + (50e3 + 4000 * k) * B * S  # noqa: E731
    fwd = lambda k, B, S: 12 * (P0 + k * Pb) + 1e8 + (10e3 + 4000 * k) * B * S  # noqa: E731
    shapes = [(1, 1000), (8, 1000), (1, 4000), (3, 4000), (1, 16000)]
    points = {k: [dict(bucket=f"b{S}", S=S, B=B, feasible=True, ms=(5 + k) * B * S / 1e3) for B, S in shapes]
              for k in (6, 3)}
    peaks = {k: [dict(bucket=f"b{S}", S=S, B=B, backward=bwd(k, B, S), forward=fwd(k, B, S), cache=0.0)
                 for B, S in shapes] for k in (6, 3)}
    plain = {k: dict(bucket="b1000", S=1000, B=1, ms=2.0 * k + 1, optim_ms=1.0, peak_bytes=20 * (P0 + k * Pb))
             for k in (6, 3)}
    budget = 40e9
    rec = slice_record(main=6, second=3, points=points, peaks=peaks, plain=plain, layers=24, params_block=Pb,
                       params_fixed=P0, ranks=4, ema=False, budget=budget, largest=(4, 4000))
    m = FSDPMemoryModel.from_dict(rec["memory_model"])
    assert m.ranks == 4 and m.act_block == pytest.approx(4000) and m.optim_bytes == pytest.approx(4.0)
    assert rec["slice_memory"]["plain_step"] == {"6": plain[6], "3": plain[3]}  # refit's launch point, by depth
    assert rec["slice_memory"]["peaks"] == {"6": peaks[6], "3": peaks[3]}
    dc = rec["depth_check"]
    for row in dc["points"]:  # t(k) = t_fixed + k·t_block at both depths; the ×L/k scaling against it
        assert row["fixed_ms"] + 6 * row["block_ms"] == pytest.approx(row["ms"]["6"])
        assert row["fixed_ms"] + 3 * row["block_ms"] == pytest.approx(row["ms"]["3"])
        assert row["full_scaled_ms"] == pytest.approx(row["ms"]["6"] * 4)
    r0 = dc["points"][0]  # 1000 tokens: 11 and 8 ms → 1 ms a block, 5 outside; ×4 = 44 against 5 + 24 = 29
    assert (r0["block_ms"], r0["fixed_ms"], r0["full_scaled_ms"]) == pytest.approx((1.0, 5.0, 44.0))
    assert dc["launch"]["block_ms"] == pytest.approx(2.0) and dc["launch"]["fixed_ms"] == pytest.approx(1.0)
    # blocks that fit 40 GB holding gradients, at 16,000 tokens: 16·P(k) + 2e8 + (50e3 + 4000·k)·16000, and the
    # update 20·P(k) (the floor): 20·(5e7 + k·1e8) ≤ 40e9 → k ≤ 19; the backward: 1.664e9·k + 1.8e9 ≤ 40e9 → k ≤ 22
    kmax = max(k for k in range(1, 25) if 20 * (P0 + k * Pb) <= budget
               and 16 * (P0 + k * Pb) + 2e8 + (50e3 + 4000 * k) * 16000 <= budget)
    assert kmax == 19 and any(n.endswith(f"budget: {kmax}") for n in rec["notes"])
    assert any("12.00 B held at the backward's start" in n for n in rec["notes"])
    cpu = slice_record(main=6, second=3, points=points, peaks={6: [], 3: []}, plain=plain, layers=24,
                       params_block=Pb, params_fixed=P0, ranks=4, ema=False, budget=None)
    assert cpu["memory_model"] is None and "no peaks" in cpu["notes"][-1]


def _cost_record(scale=40 / 18) -> dict:
    quad = lambda B, S: 300 + 2 * B + 0.08 * B * S + 3e-6 * B * S * S  # noqa: E731
    pts = [Point("b", S, B, True, quad(B, S), [], 1.0, 1e9) for B, S in SHAPES]
    return fit_mode(pts, scale=scale, memory_valid=False)


def test_round_trip_through_the_calibration_file_and_the_policy(tmp_path):
    m = replace(hand_model(), params_block=351_394_304.0, params_fixed=232_719_424.0, layers=40, ranks=8,
                act_block=10_240.0, act_fixed=199e3, work=1e9, work_fwd=0.5e9, floor_work=0.4e9,
                cache_block=0.7e9, cache_fixed=0.05e9, state_bytes=20.0, act_block_fwd=10_240.0, act_fixed_fwd=60e3)
    rec = _cost_record()
    rec.update(memory_model=m.to_dict(), optim_ms=1234.0, slice_memory={"depths": [18, 9]}, depth_check={"x": 1})
    path = str(tmp_path / "cal.json")
    cal = new_calibration({"full": rec}, model={"name": "wan", "dim": 5120, "num_layers": 40, "text_len": 512},
                          source="measured", device="NVIDIA H200", date="d", command="c", hbm_bytes=150_109_880_320.0,
                          extrapolation={"blocks_timed": 18, "num_layers": 40, "scale": 40 / 18, "fsdp_ranks": 8})
    cal.save(path)
    back = Calibration.load(path)
    assert back.memory_model("full") == m and back.memory_model("full", world_size=16) == m.for_ranks(16)
    assert isinstance(memory_model_from_dict(MemoryModel(1.0, 2.0).to_dict()), MemoryModel)
    budget = 0.9 * 150_109_880_320.0
    assert back.default_m_mem("full", 1560, 8) == m.m_mem(budget, 1560) > 100_000
    assert back.default_m_mem("full", 1560, 16) == m.for_ranks(16).m_mem(budget, 1560) > m.m_mem(budget, 1560)
    again = refit(Calibration.load(path), None).data["modes"]["full"]  # the slice's model survives a refit
    assert again["memory_model"] == m.to_dict() and again["optim_ms"] == 1234.0
    assert again["slice_memory"] == {"depths": [18, 9]} and again["depth_check"] == {"x": 1}

    wan = {"i480": 1560, "v480_17f": 7800, "v480_81f": 32760, "v720_81f": 75600}
    shape = ModelShape(1, 40, 5120, 512)
    for R in (8, 16):
        s = resolve_schedule(SchedulingConfig("balanced", calibration=path), wan, shape, checkpointing="full",
                             world_size=R)
        mem = m.for_ranks(R)
        assert s.values["m_mem"] == mem.m_mem(budget, 1560) and f"FSDP over {R} ranks" in s.sources["m_mem"]
        assert ("rescaled from 8" in s.sources["m_mem"]) == (R == 16)
        assert all(float(mem.predict(s.batch_sizes[n], S)) <= budget for n, S in wan.items())
    one = resolve_schedule(SchedulingConfig("cost", calibration=path, m_mem=80_000), wan, shape,
                           checkpointing="full", world_size=1)
    assert one.values["m_mem"] == 80_000  # the config wins; on one process the model says 14B does not fit
    assert m.for_ranks(1).m_mem(budget, 1560) == 0


def test_a_missing_calibration_is_refused_only_where_a_knob_needs_it(tmp_path):
    missing = str(tmp_path / "not_yet.json")
    wan = {"i480": 1560, "v720_81f": 75600}
    shape = ModelShape(1, 40, 5120, 512)
    s = resolve_schedule(SchedulingConfig("equal_token", m_tokens=75600, calibration=missing), wan, shape)
    assert s.batch_sizes == {"i480": 48, "v720_81f": 1} and any("does not exist yet" in n for n in s.notes)
    for cfg in (SchedulingConfig("balanced", calibration=missing), SchedulingConfig("equal_token", calibration=missing),
                SchedulingConfig("dual_constraint", m_mem=200_000, calibration=missing)):
        with pytest.raises(ValueError, match=r"scheduling\.calibration=.*no such file"):
            resolve_schedule(cfg, wan, shape)


def test_gradients_are_dropped_as_accumulated_and_the_peak_rows_skip_the_warmup():
    import torch

    from training.shape_benchmark import _dropping_grads, _peak_rows

    lin = torch.nn.Linear(4, 3)
    with _dropping_grads(lin):
        lin(torch.ones(2, 4)).sum().backward()
    assert lin.weight.grad is None and lin.bias.grad is None
    lin(torch.ones(2, 4)).sum().backward()  # the hooks are gone
    assert torch.equal(lin.bias.grad, torch.full((3,), 2.0))
    pts = [Point("a", 10, 2, True, 1.0), Point("b", 20, 1, False)]
    recs = {("a", 2): [dict(forward=9.0, backward=9.0, cache=9.0), dict(forward=1.0, backward=2.0, cache=0.5)]}
    assert _peak_rows(pts, recs, repeats=1) == [dict(bucket="a", S=10, B=2, forward=1.0, backward=2.0, cache=0.5)]


@pytest.mark.slow
def test_cpu_slice_calibration_states_the_slice_and_its_scaling(tmp_path):
    from training.shape_benchmark import calibrate_config
    from tests.helpers import compose_config

    out = str(tmp_path / "cal.json")
    cfg = compose_config([f"scheduling.calibration={out}"])
    opts = {"blocks": 1, "fsdp_ranks": 8, "max_points": 6, "repeats": 1, "warmup": 0, "out": out}
    calibrate_config(cfg, opts, command="test", log=lambda s: None)
    d = json.load(open(out))
    assert d["extrapolation"] == {"blocks_timed": 1, "num_layers": 2, "scale": 2.0, "fsdp_ranks": 8,
                                  "memory_blocks": [1, 2]}
    rec = d["modes"]["none"]
    assert "timed 1 of 2 blocks" in d["notes"][1] and "FSDP over 8 ranks from depths 1 and 2" in d["notes"][1]
    assert rec["memory_model"] is None and any("no FSDP memory model" in n for n in d["notes"])
    plain = rec["slice_memory"]["plain_step"]
    second = rec["slice_memory"]["points"]["2"]  # the scan's points again at 2 blocks, each timed
    assert {(p["bucket"], p["B"]) for p in second} == {(p["bucket"], p["B"]) for p in rec["points"] if p["feasible"]}
    assert all(p["feasible"] and p["ms"] > 0 for p in second)
    assert rec["optim_ms"] == pytest.approx(2 * plain["1"]["optim_ms"])  # the update's ms ×2/1
    dc = rec["depth_check"]
    assert dc["depths"] == [1, 2] and len(dc["points"]) == sum(p["feasible"] for p in rec["points"]) == 6
    for row in dc["points"]:
        assert row["full_affine_ms"] == pytest.approx(row["ms"]["2"])  # L = 2: the second depth is the model
        assert row["full_scaled_ms"] == pytest.approx(2 * row["ms"]["1"])
    # the cost model fitted where the truth is: at the full depth, from both depths (fit_mode's depth_factors)
    assert rec["fit_depth"] == "affine" and any("fitted at the full depth" in n for n in d["notes"])
    for bad, field in (({"memory_blocks": 1}, "memory_blocks"), ({"fsdp_ranks": 0}, "fsdp_ranks")):
        with pytest.raises(ValueError, match=field):
            calibrate_config(cfg, {**opts, **bad}, log=lambda s: None)


def test_a_slice_scanned_at_given_points_and_two_depths_gives_the_truth_at_the_full_depth(tmp_path):
    """calibrate.points on an FSDP slice: exactly the given micro-batches at both depths, each timed `repeats`
    times; the simulator's truth at those points is t_fixed + L·t_block from the two depths, not the flat ×L/k
    (here L = 2 = the second depth, so the truth is the second depth's own measured time)."""
    from scheduling.calibrate import Calibration
    from training.shape_benchmark import calibrate_config
    from tests.helpers import compose_config

    out = str(tmp_path / "cal.json")
    cfg = compose_config([f"scheduling.calibration={out}"])
    names = list(cfg.data.buckets)[:2]
    want = [f"{names[1]}:1", f"{names[0]}:3", f"{names[0]}:1"]
    opts = {"blocks": 1, "fsdp_ranks": 8, "repeats": 3, "warmup": 0, "out": out, "points": want}
    calibrate_config(cfg, opts, command="test", log=lambda s: None)
    cal = Calibration.load(out)
    rec = cal.data["modes"]["none"]
    assert [f"{p['bucket']}:{p['B']}" for p in rec["points"]] == want
    assert all(p["feasible"] and len(p["ms_runs"]) == 3 for p in rec["points"])
    second = {(p["bucket"], p["B"]): p for p in rec["slice_memory"]["points"]["2"]}
    assert set(second) == {(p["bucket"], p["B"]) for p in rec["points"]}
    truth = {(p["bucket"], p["B"]): p["ms"] for p in cal.measured_points("none")[:len(want)]}  # then the launch point
    main = {(p["bucket"], p["B"]): p["ms"] for p in rec["points"]}
    affine = cal.affine_scales("none")
    assert affine and all(f > 0 for f in affine.values())
    for key in second:  # where a per-block time came out positive, the second depth's, never above the flat ×2/1
        # (timing noise can make the part outside the blocks negative: affine_scales then keeps the flat scale)
        want = min(second[key]["ms"], 2 * main[key]) if key in affine else 2 * main[key]
        assert truth[key] == pytest.approx(want, rel=1e-9)
    with pytest.raises(ValueError, match="calibrate.points"):
        calibrate_config(cfg, {**opts, "points": ["nope:1"]}, log=lambda s: None)


def test_a_k_block_scan_scales_its_launch_floor_per_block_too():
    """Host work is per block: the floor of 18 blocks' eager launches becomes 40/18 of it, as every other term."""
    work = lambda B, S: 18 * (1.9 * B + 4.6e-3 * B * S + 1.7e-7 * B * S * S)  # noqa: E731  (ms, 18 14B blocks)
    shapes = [(1, 1560), (2, 1560), (4, 1560), (48, 1560), (1, 7800), (9, 7800), (1, 32760), (2, 32760),
              (1, 75600)]
    pts = [Point("b", S, B, True, max(400.0, work(B, S)), [], 1.0, 1e9) for B, S in shapes]  # 2 under the floor
    q = fit_mode(pts, scale=40 / 18, memory_valid=False)["fits"]["quadratic"]["params"]
    assert q["floor"] == pytest.approx(400.0 * 40 / 18, rel=0.01) and q["b2"] == pytest.approx(40 * 1.7e-7, rel=0.02)


def test_every_policy_gets_its_own_second_depth_budget(tmp_path, monkeypatch):
    """calibrate.memory_time_budget_s is each policy's, as time_budget_s is in the main scan: with three policies
    (checkpointing=auto, keep_attention=auto) every one gets the scan's cheapest points again at the second depth,
    which its FSDP memory model is fitted from (a budget shared by the three leaves the last policy without one). A
    clock that jumps 10 s at each timed step of shape_benchmark's (the plain steps too; a policy's budget starts
    after its plain step) makes the budget exact: 0, 10 and 20 s are in."""
    import time as real_time

    import training.shape_benchmark as sb
    from training.shape_benchmark import calibrate_config
    from tests.helpers import compose_config

    class Clock:
        offset = 0.0
        strftime = staticmethod(real_time.strftime)

        def perf_counter(self):
            return real_time.perf_counter() + self.offset

    clock, run_point = Clock(), sb.run_point

    def ten_seconds_each(*a, **k):
        out = run_point(*a, **k)
        clock.offset += 10.0
        return out

    monkeypatch.setattr(sb, "time", clock)
    monkeypatch.setattr(sb, "run_point", ten_seconds_each)
    out = str(tmp_path / "cal.json")
    cfg = compose_config([f"scheduling.calibration={out}", "model.checkpointing=auto", "model.keep_attention=auto"])
    opts = {"blocks": 1, "fsdp_ranks": 8, "max_points": 5, "repeats": 1, "warmup": 0, "out": out,
            "memory_time_budget_s": 25}
    calibrate_config(cfg, opts, command="test", log=lambda s: None)
    d = json.load(open(out))
    assert set(d["modes"]) == {"none", "full", "keep"}
    for mode, rec in d["modes"].items():
        second = rec["slice_memory"]["points"]["2"]
        timed = [p for p in second if p["feasible"]]
        # 0, 10 and 20 s are inside 25 s; the rest are refused, cheapest first
        assert len(timed) == 3 and len(second) == sum(p["feasible"] for p in rec["points"]), (mode, second)
        assert all("time budget of 25 s spent" in p["why"] for p in second if not p["feasible"]), mode
        cheapest = sorted((p for p in rec["points"] if p["feasible"]), key=lambda p: p["ms"])[:3]
        assert {(p["bucket"], p["B"]) for p in timed} == {(p["bucket"], p["B"]) for p in cheapest}, mode

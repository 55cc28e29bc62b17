"""scheduling/simulate.py + scripts/simulate_cluster.py: exact numbers on a hand case, equal-token's imbalance on a
quadratic cost, the protocol writes its table and the chosen settings that training then reads."""
import os

import numpy as np
import pytest

from scheduling.batching import batch_sizes
from scheduling.config import SchedulingConfig
from scheduling.cost_model import CostModel
from scheduling.policy import ModelShape, resolve_schedule
from scheduling.simulate import DEFAULT_MIX, Mix, issue4_h200_calibration, simulate

QUAD = CostModel("quadratic", {"a": 15.7, "b1": 0.0238, "b2": 1.44e-6})
MIX = Mix.of(DEFAULT_MIX)


def test_mix_table_holds_the_shares_exactly():
    t = MIX.table(10_000)
    counts = np.bincount(t.bucket, minlength=len(MIX.S))
    assert counts.tolist() == [round(10_000 * s) for s in MIX.share] and counts.sum() == 10_000


def test_hand_case_numbers():
    one = Mix.of([("only", 1000, 1.0)])
    r = simulate(lambda B, S: 50.0, one, "equal_token", [4], R=8, M=3, steps=10, optim_ms=80.0)
    # every slot 50 ms on every rank; the sharded optimizer adds 80/8 ms per step
    assert r.compute_cv == 0 and r.idle_fraction == 0 and r.step_time_cv == 0
    assert r.time_s == pytest.approx(10 * (3 * 50 + 10) / 1e3)
    assert r.tokens_per_s == pytest.approx(8 * 3 * 4 * 1000 / 0.160)
    noisy = simulate(lambda B, S: 50.0, one, "equal_token", [4], R=8, M=3, steps=10, residuals=[-0.1, 0.1])
    # ±10 % noise: a slot waits for the slowest of 8 ranks, 55 ms unless all 8 drew 45 ms
    assert noisy.idle_fraction == pytest.approx(1 - 50 / (55 - 10 / 2**8), abs=0.02)
    assert noisy.compute_cv > 0


@pytest.mark.parametrize("R", [8, 64])
def test_equal_token_is_badly_imbalanced_on_a_quadratic_cost_and_balanced_is_not(R):
    eq = simulate(QUAD.predict, MIX, "equal_token", batch_sizes("equal_token", MIX.S, m_tokens=MIX.S_max), R,
                  steps=max(16, 2048 // (4 * R)))
    sizes = batch_sizes("balanced", MIX.S, m_mem=4e5, cost_model=QUAD, target_ms=QUAD.predict(1, MIX.S_max))
    bal = simulate(QUAD.predict, MIX, "balanced", sizes, R, steps=max(16, 2048 // (4 * R)))
    assert eq.compute_cv > 0.15 and eq.idle_fraction > 0.3, (eq.compute_cv, eq.idle_fraction)
    assert bal.compute_cv < 0.02 and bal.idle_fraction < 0.03, (bal.compute_cv, bal.idle_fraction)
    # the mix is fixed, so throughput follows the busy share: tokens/s ratio = (1 − idle_bal) / (1 − idle_eq)
    assert bal.tokens_per_s / eq.tokens_per_s == pytest.approx((1 - bal.idle_fraction) / (1 - eq.idle_fraction),
                                                               rel=0.03)
    assert bal.tokens_per_s > 1.5 * eq.tokens_per_s


def test_protocol_writes_table_plots_and_the_chosen_settings_training_reads(tmp_path):
    from scripts.simulate_cluster import record_chosen, run_protocol, write_outputs

    cal = issue4_h200_calibration()
    path = cal.save(str(tmp_path / "cal.json"))
    res = run_protocol(cal, "full", MIX, ranks=[8, 16], sweep_ranks=[8], mbs=256, log=lambda s: None)
    files = write_outputs(res, cal, path, str(tmp_path / "sim"))
    assert all(os.path.getsize(f) > 0 for f in files) and sum(f.endswith(".png") for f in files) == 4
    md = open(str(tmp_path / "sim.md")).read()
    for R in (8, 16):
        for s in ("equal_token@S_max", "equal_token", "dual_constraint", "cost", "balanced"):
            assert f"| {R} | {s} |" in md
    best = res["best"]
    assert best[(16, "balanced")].setting == best[(8, "balanced")].setting  # R=16 reuses R=8's sweep
    assert best[(8, "balanced")].tokens_per_s >= best[(8, "cost")].tokens_per_s * 0.99
    record_chosen(cal, res, "full")
    cal.save(path)
    sched = resolve_schedule(SchedulingConfig("balanced", calibration=path), {n: S for n, S, _ in DEFAULT_MIX},
                             ModelShape(1, 30, 1536, 512), world_size=8)
    assert sched.values["target_microbatch_ms"] == best[(8, "balanced")].setting["target_microbatch_ms"]
    assert sched.sources["target_microbatch_ms"] == "calibration:chosen" and sched.values["m_mem"] == res["m_mem"]

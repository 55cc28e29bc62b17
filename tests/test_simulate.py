"""scheduling/simulate.py + scripts/simulate_cluster.py: exact numbers on a hand case, equal-token's imbalance on a
quadratic cost, the protocol writes its table and the chosen settings that training then reads."""

import numpy as np
import pytest

from scheduling.batching import batch_sizes
from scheduling.config import SchedulingConfig
from scheduling.cost_model import CostModel
from scheduling.policy import ModelShape, resolve_schedule
from scheduling.simulate import DEFAULT_MIX, Mix, four_block_h200_calibration, simulate

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


@pytest.mark.slow
def test_unconstrained_protocol_records_the_chosen_settings_training_reads(tmp_path):
    """The earlier protocol (M = 4, no batch bound): R = 16 reuses R = 8's sweep, balanced is no worse than cost,
    and what record_chosen writes is what a run without tokens_per_step reads."""
    from scheduling.protocol import record_chosen, run_unconstrained

    cal = four_block_h200_calibration()
    path = cal.save(str(tmp_path / "cal.json"))
    res = run_unconstrained(cal, "full", MIX, ranks=[8, 16], sweep_ranks=[8], mbs=256, log=lambda s: None)
    best = res["best"]
    assert best[(16, "balanced")].setting == best[(8, "balanced")].setting  # R=16 reuses R=8's sweep
    assert best[(8, "balanced")].tokens_per_s >= best[(8, "cost")].tokens_per_s * 0.99
    record_chosen(cal, res, "full")
    cal.save(path)
    sched = resolve_schedule(SchedulingConfig("balanced", calibration=path), {n: S for n, S, _ in DEFAULT_MIX},
                             ModelShape(1, 30, 1536, 512), world_size=8)
    assert sched.values["target_microbatch_ms"] == best[(8, "balanced")].setting["target_microbatch_ms"]
    assert sched.sources["target_microbatch_ms"] == "calibration:chosen" and sched.values["m_mem"] == res["m_mem"]


@pytest.mark.slow
def test_simulate_cluster_writes_its_report_into_the_folder_it_is_given(tmp_path):
    """The script, as a user runs it: a report, CSV and plot in --out, the calibration file untouched."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    cal = four_block_h200_calibration()
    path = cal.save(str(tmp_path / "cal.json"))
    before = open(path).read()
    out = tmp_path / "sim"
    subprocess.run([sys.executable, "scripts/simulate_cluster.py", f"--calibration={path}", f"--out={out}",
                    "--ranks=8", "--g=2", "--mbs=256", "--no-model-truth", "--no-matrix"], cwd=ROOT, check=True,
                   capture_output=True, timeout=600)
    md = (out / "simulation.md").read_text()
    for s in ("equal_token", "dual_constraint", "cost", "balanced"):
        assert f"| 2·S_max | {s} |" in md
    assert (out / "simulation.csv").stat().st_size > 0 and (out / "simulation_ratio.png").stat().st_size > 0
    assert open(path).read() == before  # nothing written into the calibration unless --write-chosen


@pytest.mark.parametrize("strategy", ["equal_token", "dual_constraint", "cost"])
def test_breakpoints_are_every_change_of_a_batch_size(strategy):
    """Between two breakpoints no bucket's B changes: the refined sweep sees every distinct setting of its interval.
    (A breakpoint where a cap holds B — m_mem, or B ≥ 1 — changes nothing; equal_token's here all change one.)"""
    from scheduling.simulate import _knob_base, _setting, breakpoints, sizes_for

    mix, p, m_mem = Mix.of([("a", 1000, 0.5), ("b", 2600, 0.3), ("c", 7000, 0.2)]), 1.3, 1e5
    base = _knob_base(strategy, mix, QUAD.predict, p)
    lo, hi = 0.9 * base, 3.1 * base
    pts = breakpoints(strategy, mix, QUAD.predict, p, m_mem, lo, hi)
    assert pts == sorted(pts) and len(pts) > 5 and lo < pts[0] and pts[-1] <= hi * (1 + 1e-8)
    sizes = lambda v: sizes_for(strategy, mix, _setting(strategy, v, base, p, m_mem), QUAD.predict)  # noqa: E731
    edges = [lo * (1 + 1e-9), *pts, hi]
    for a, b in zip(edges, edges[1:]):
        probes = np.linspace(a, b, 7)[:-1]  # inside [a, b): one B vector
        assert all(sizes(v) == sizes(a) for v in probes), (strategy, a, b)
    changed = [sizes(v / (1 + 1e-6)) != sizes(v) for v in pts]  # just below a breakpoint, some B is smaller
    assert all(changed) if strategy == "equal_token" else sum(changed) > len(pts) / 2


@pytest.mark.slow
def test_refined_sweep_finds_the_best_distinct_setting():
    """The refined best of equal_token on the quadratic cost is the best of an exhaustive scan of its interval; it
    is reported on a fresh draw, its knob moved inside the range that gives its batch sizes."""
    from scheduling.simulate import SWEEP, _setting, breakpoints, sizes_for, sweep

    R, steps, m_mem = 8, 16, 4e5
    best, runs = sweep(QUAD.predict, MIX, "equal_token", R, p=None, m_mem=m_mem, steps=steps)
    grid = [f * MIX.S_max for f in SWEEP["equal_token"] if f * MIX.S_max <= m_mem]
    on_grid = [r for r in runs if r.setting["m_tokens"] in {int(v) for v in grid}]
    top = max(runs, key=lambda r: r.tokens_per_s)
    g = max(on_grid, key=lambda r: r.tokens_per_s)
    assert top.tokens_per_s >= g.tokens_per_s
    assert best.batch_sizes == top.batch_sizes  # the winner, redrawn
    assert sizes_for("equal_token", MIX, best.setting, QUAD.predict) == top.batch_sizes
    above = [v for v in breakpoints("equal_token", MIX, QUAD.predict, None, m_mem, top.setting["m_tokens"],
                                    4 * top.setting["m_tokens"])
             if sizes_for("equal_token", MIX, _setting("equal_token", v, MIX.S_max, None, m_mem),
                          QUAD.predict) != top.batch_sizes]
    assert top.setting["m_tokens"] < best.setting["m_tokens"] < above[0]  # inside, off the edge
    i = grid.index(g.setting["m_tokens"])
    for v in breakpoints("equal_token", MIX, QUAD.predict, None, m_mem, grid[i - 1], grid[i + 1]):
        sizes = sizes_for("equal_token", MIX, _setting("equal_token", v, MIX.S_max, None, m_mem), QUAD.predict)
        assert any(r.batch_sizes == sizes for r in runs), v  # every distinct setting around the grid's best ran


def test_analytic_idle_against_enumeration_and_the_simulator():
    """The closed form of E[max] over R independent one-bucket micro-batches: against brute-force enumeration on a
    hand case, and against the simulator (noise off), which draws samples rather than micro-batches."""
    import itertools

    from scheduling.simulate import analytic_idle

    mix = Mix.of([("a", 1000, 0.5), ("b", 3000, 0.3), ("c", 9000, 0.2)])
    sizes, cost = [6, 2, 1], (lambda B, S: 1.0 + B * S / 1000 + B * (S / 1000) ** 2)
    q = np.array([0.5 / 6, 0.3 / 2, 0.2 / 1])
    q /= q.sum()
    c = [cost(B, S) for B, S in zip(sizes, mix.S)]
    for R in (1, 2, 3):
        e_max = sum(np.prod([q[i] for i in combo]) * max(c[i] for i in combo)
                    for combo in itertools.product(range(3), repeat=R))
        assert analytic_idle(cost, mix, sizes, R) == pytest.approx(1 - float(np.dot(q, c)) / e_max, rel=1e-12)
    assert analytic_idle(cost, mix, sizes, None) == pytest.approx(1 - float(np.dot(q, c)) / max(c))
    eq_sizes = batch_sizes("equal_token", MIX.S, m_tokens=MIX.S_max)
    for R in (8, 64):
        sim = simulate(QUAD.predict, MIX, "equal_token", eq_sizes, R, steps=max(16, 4096 // (4 * R)))
        assert sim.idle_fraction == pytest.approx(analytic_idle(QUAD.predict, MIX, eq_sizes, R), abs=0.01)


def test_residual_noise_is_centred_model_error_not_a_slowdown():
    """ε is bootstrapped from the calibration's residuals minus their mean: the fit's mean residual is not a
    slowdown of every micro-batch. One rank, one slot, a 50 ms micro-batch: residuals all at +40 % add nothing;
    0.3 and 0.5 (mean 0.4) make each step 45 or 55 ms, never 65 or 75."""
    one = Mix.of([("only", 1000, 1.0)])
    run = lambda res, steps: simulate(lambda B, S: 50.0, one, "equal_token", [4], R=1, M=1, steps=steps,  # noqa
                                      residuals=res)
    assert run([0.4, 0.4, 0.4], 40).time_s == pytest.approx(40 * 50 / 1e3, rel=1e-12)
    assert run(None, 40).time_s == pytest.approx(40 * 50 / 1e3, rel=1e-12)
    noisy = run([0.3, 0.5], 400)
    n_slow = (noisy.time_s * 1e3 - 400 * 45.0) / 10.0  # steps that drew +0.1: every step is 45 or 55 ms
    assert n_slow == pytest.approx(round(n_slow), abs=1e-6) and 140 < n_slow < 260  # p = 1/2 draws, 400 of them
    p = n_slow / 400
    assert noisy.step_time_cv == pytest.approx(10 * np.sqrt(p * (1 - p)) / (45 + 10 * p), rel=1e-9)


def test_equal_token_sweep_keeps_a_setting_exactly_at_the_memory_bound():
    """settings_for drops equal_token settings over m_mem; one exactly at it fits (B·S ≤ m_mem)."""
    from scheduling.simulate import settings_for

    m_mem = 2.0 * MIX.S_max
    factors = [s["factor"] for s in settings_for("equal_token", MIX, QUAD.predict, None, m_mem)]
    assert 2.0 in factors and 2.5 not in factors and max(factors) == 2.0


def test_default_calibration_memory_estimate():
    """The estimated memory model of four_block_h200_calibration(): c0 = 16 bytes a parameter (fp32 weights, gradients, two
    AdamW moments) + 2 GiB, c1 = layers·D·4 + (14·D + 3·ffn)·2 bytes a token, as its docstring and notes state."""
    from scheduling.cost_model import MemoryModel

    cal = four_block_h200_calibration()
    mem = MemoryModel.from_dict(cal.data["modes"]["full"]["memory_model"])
    assert mem.c0 == 16.0 * 1_418_996_800 + 2 * 2**30 and mem.c1 == 30 * 1536 * 4 + (14 * 1536 + 3 * 8960) * 2
    assert not mem.measured and 23 < mem.c0 / 2**30 < 24


def test_the_memory_bound_is_the_one_of_each_simulated_world_size(tmp_path, monkeypatch):
    """FSDP's states shrink as 1/R, so the 14B's m_mem at R = 64 is the 64-rank one (205,477 tokens), not the
    8-rank one (152,901) the file was measured over: in the protocol's rows, in what it records for training, and
    in what training then resolves at each world size."""
    import json

    from scheduling.calibrate import Calibration
    from scheduling.protocol import best_at_g, inputs_from, record_chosen_at_g
    from tests.helpers import ROOT

    monkeypatch.chdir(ROOT)
    cal = Calibration.load("results/calibration_h200_14b.json")
    hbm = 0.9 * cal.hbm_bytes
    want = {R: cal.memory_model("full", R).m_mem(hbm, min(MIX.S)) for R in (8, 64)}
    assert want == {8: 152_901, 64: 205_477}
    inp = inputs_from(cal, "full", MIX)
    rows = {R: best_at_g(inp, MIX, "dual_constraint", R, 2 * MIX.S_max, mbs=64, mbs_final=64, per_M=2)
            for R in (8, 64)}
    assert {R: r.setting["m_mem"] for R, r in rows.items()} == want  # the bound each row ran under
    # the dual-constraint table is pinned at the memory bound for images: B·S of i480 follows m_mem
    assert [r.batch_sizes[0] for r in rows.values()] == [want[8] // 1560, want[64] // 1560]

    # recorded for training: no single m_mem (it would hold at one R only), the bound per simulated R beside it
    res = {"steady": {(R, 2.0, "dual_constraint"): r for R, r in rows.items()}}
    record_chosen_at_g(cal, res, MIX, "full", inp.m_mem, inp.m_mem_by_ranks)
    assert cal.data["chosen"]["m_mem"] is None
    assert cal.data["chosen"]["m_mem_by_world_size"] == {"8": want[8], "64": want[64]}
    path = cal.save(str(tmp_path / "cal.json"))
    wan = {n: S for n, S, _ in DEFAULT_MIX}
    shape = ModelShape(1, 40, 5120, 512)
    for R in (8, 64):
        s = resolve_schedule(SchedulingConfig("dual_constraint", calibration=path), wan, shape,
                             checkpointing="full", world_size=R)
        assert s.values["m_mem"] == want[R], (R, s.sources["m_mem"])
    # ... and so does the committed file, which the simulator's run wrote the same way
    with open("results/calibration_h200_14b.json") as f:
        assert json.load(f)["chosen"]["m_mem_by_world_size"] == {"8": want[8], "64": want[64]}
    s = resolve_schedule(SchedulingConfig("balanced", calibration="results/calibration_h200_14b.json"), wan, shape,
                         checkpointing="full", world_size=64)
    assert s.values["m_mem"] == want[64] and "FSDP over 64 ranks" in s.sources["m_mem"]


def test_auto_mode_prices_and_times_each_micro_batch_at_the_policy_training_picks(monkeypatch):
    """--mode auto on the 1.3B's three-policy file: the planner's cost and bound are resolve_schedule's for
    checkpointing=auto (one GPU: the CUDA graphs' pool out of every larger micro-batch's budget; several: none), and
    the truth runs a micro-batch that fits without recompute at none's measured time, one that must recompute at a
    blend of the policies."""
    from scheduling.calibrate import Calibration
    from scheduling.config import SchedulingConfig
    from scheduling.policy import ModelShape, resolve_schedule
    from scheduling.protocol import inputs_from
    from scheduling.simulate import DEFAULT_MIX, Mix
    from scheduling.truth import PolicyTruth
    from tests.helpers import ROOT

    monkeypatch.chdir(ROOT)
    cal = Calibration.load("results/calibration_h200_policies.json")
    mix = Mix.of(DEFAULT_MIX)
    inp = inputs_from(cal, "auto", mix)
    one, many = inp.at(1), inp.at(64)
    tokens = dict(zip(mix.names, mix.S))
    s = resolve_schedule(SchedulingConfig(strategy="balanced", calibration=cal.path), tokens,
                         ModelShape(1, 30, 1536, 512), checkpointing="auto", world_size=1, keep_attention="auto",
                         graph_tokens=16384, narrow_graphs=False)  # the sweep's micro-batches may be captured
    assert one.m_mem == s.values["m_mem"] < many.m_mem == cal.default_m_mem("full", 1560)
    assert inp.m_mem_at(1) == one.m_mem and inp.m_mem_at(8) == many.m_mem
    for B, S in ((25, 1560), (60, 1560), (2, 32760), (1, 75600)):
        assert one.cost.predict(B, S) == pytest.approx(s.cost_fn(B, S))
    assert isinstance(one.truth, PolicyTruth)
    rng = np.random.default_rng(0)

    def runs(mode, S, B):  # the file's timed repeats of one point
        return next(p["ms_runs"] for p in cal.data["modes"][mode]["points"] if (p["S"], p["B"]) == (S, B))

    # v480_17f at B = 5 runs without recompute: one of none's own repeats there, drawn as measured
    assert one.truth.draw(5, 7800, rng) in runs("none", 7800, 5) and one.truth.is_measured(5, 7800)
    assert min(runs("full", 7800, 5)) > max(runs("none", 7800, 5))  # so a full or keep draw would show
    # 720p 81 frames cannot run without recompute: between keep's and none's times, not measured as such
    k, j = one.truth._kj(1, 75600)
    assert 0 < k < 30 and not one.truth.is_measured(1, 75600)
    mean = lambda runs: sum(runs) / len(runs)  # noqa: E731
    t_full, t_keep = mean(runs("full", 75600, 1)), mean(runs("keep", 75600, 1))  # measured at (75600, 1); none
    t_none = t_full * mean(runs("none", 14040, 1)) / mean(runs("full", 14040, 1))  # only up to S = 14040: their ratio
    assert one.truth.mean(1, 75600) == pytest.approx(t_none + k / 30 * (t_full - t_none) - j / 30 * (t_full - t_keep),
                                                     rel=1e-5)


# -- the cluster protocols on a small cluster (the slow tests above run them at full size) ----------------------------

SMALL = Mix.of([("a", 1560, 0.5), ("b", 7800, 0.3), ("c", 14040, 0.2)])


def test_a_sweep_refines_between_the_best_grid_points_neighbours_and_redraws_its_winner():
    from scheduling.simulate import KNOB, _knob_base, _setting, breakpoints, settings_for, sizes_for, sweep

    mix, p, m_mem, steps = Mix.of([("a", 1000, 0.5), ("b", 2600, 0.3), ("c", 7000, 0.2)]), 1.3, 1e5, 8
    for strategy in ("equal_token", "cost"):
        knob, base = KNOB[strategy], _knob_base(strategy, mix, QUAD.predict, p)
        best, runs = sweep(QUAD.predict, mix, strategy, 4, p=p, m_mem=m_mem, steps=steps)
        grid = []  # the grid's distinct batch tables, in knob order, as sweep runs them first
        for st in settings_for(strategy, mix, QUAD.predict, p, m_mem, None):
            if sizes_for(strategy, mix, st, QUAD.predict) not in [r.batch_sizes for r in grid]:
                grid.append(simulate(QUAD.predict, mix, strategy, sizes_for(strategy, mix, st, QUAD.predict), 4, 4,
                                     steps, 0, setting=st))
        assert [r.batch_sizes for r in runs[:len(grid)]] == [r.batch_sizes for r in grid]
        i = max(range(len(grid)), key=lambda j: grid[j].tokens_per_s)
        lo = grid[i - 1].setting[knob] if i > 0 else grid[0].setting[knob] / 2
        hi = grid[i + 1].setting[knob] if i + 1 < len(grid) else grid[-1].setting[knob] * 1.5
        refined = runs[len(grid):]
        assert refined and all(lo <= r.setting[knob] <= hi * (1 + 1e-9) for r in refined)
        between = {tuple(sizes_for(strategy, mix, _setting(strategy, v, base, p, m_mem), QUAD.predict))
                   for v in breakpoints(strategy, mix, QUAD.predict, p, m_mem, lo, hi)}
        assert between <= {tuple(r.batch_sizes) for r in runs}  # every distinct setting of the interval ran
        assert len({tuple(r.batch_sizes) for r in runs}) == len(runs)  # each once
        top = max(runs, key=lambda r: r.tokens_per_s)
        assert best.batch_sizes == top.batch_sizes and best.strategy == strategy and best.steps == steps
        again = simulate(QUAD.predict, mix, strategy, top.batch_sizes, 4, 4, steps, 1, setting=best.setting)
        assert best.tokens_per_s == again.tokens_per_s  # the winner on a fresh draw (seed + 1)
        above = [u for u in breakpoints(strategy, mix, QUAD.predict, p, m_mem, top.setting[knob],
                                        4 * top.setting[knob])
                 if sizes_for(strategy, mix, _setting(strategy, u, base, p, m_mem), QUAD.predict) != top.batch_sizes]
        assert top.setting[knob] < best.setting[knob] < above[0]  # its knob moved inside its batch table's range
        assert sizes_for(strategy, mix, best.setting, QUAD.predict) == top.batch_sizes
        assert all(r.setting["factor"] == round(r.setting[knob] / base, 4) for r in refined)
    # the best grid point last: refined up to 1.5 × its knob, and each distinct table once
    best, runs = sweep(QUAD.predict, mix, "equal_token", 4, p=None, m_mem=1e5, steps=steps, factors=(0.5, 1.0))
    assert len(runs) > 2 and max(r.setting["m_tokens"] for r in runs) <= 1.5 * 7000
    assert len({tuple(r.batch_sizes) for r in runs}) == len(runs)
    assert [r.setting["m_tokens"] for r in runs[:2]] == [3500, 7000] and runs[1].tokens_per_s > runs[0].tokens_per_s
    assert max(r.setting["m_tokens"] for r in runs) > 1.4 * 7000  # refined above the last grid point
    # one grid point under the bound: nothing to refine between
    best, runs = sweep(QUAD.predict, mix, "equal_token", 4, p=None, m_mem=7000, steps=steps, factors=(1.0, 2.0))
    assert len(runs) == 1 and best.batch_sizes == [7, 2, 1]


def test_steps_for_and_a_settings_description():
    from scheduling.protocol import describe_setting, planner_label, steps_for

    assert steps_for(8, 4, 64) == 16 and steps_for(1, 1, 100) == 100 and steps_for(2, 3, 100) == 17
    assert planner_label("windowed", 4) == "W=4" and planner_label("sorted") == "sorted"
    r = simulate(QUAD.predict, SMALL, "equal_token", [9, 1, 1], 4, 2, 4, setting={"m_tokens": 14040})
    assert describe_setting(r) == "m_tokens=1.404e+04, M=2"
    r = simulate(QUAD.predict, SMALL, "balanced", [9, 1, 1], 4, 2, 4, window=4,
                 setting={"target_microbatch_ms": 90.0})
    assert describe_setting(r) == "target_microbatch_ms=90, M=2, W=4"


def test_the_unconstrained_protocol_on_a_small_cluster_and_what_it_records():
    from scheduling.protocol import STRATEGIES, inputs_from, record_chosen, run_unconstrained, steps_for
    from scheduling.simulate import sizes_for, sweep

    cal = four_block_h200_calibration()
    inp = inputs_from(cal, "full", SMALL)
    res = run_unconstrained(cal, "full", SMALL, ranks=[2, 4], sweep_ranks=[2], M=2, mbs=32, log=lambda s: None)
    assert (res["ranks"], res["sweep_ranks"], res["M"], res["mbs"]) == ([2, 4], [2], 2, 32)
    assert res["mix"] is SMALL and res["m_mem"] == inp.m_mem and res["m_mem_by_world_size"] is None
    assert res["p"] == inp.p and res["optim_ms"] == inp.optim_ms and res["memory"] is not None
    K = steps_for(2, 2, 32)
    kw = dict(residuals=inp.cost.residuals, optim_ms=inp.optim_ms)
    b, runs = sweep(inp.cost.predict, SMALL, "equal_token", 2, p=inp.p, m_mem=inp.m_mem, M=2, steps=K, seed=0, **kw)
    got = res["best"][(2, "equal_token")]
    assert (got.batch_sizes, got.tokens_per_s) == (b.batch_sizes, b.tokens_per_s)
    assert [r for lab, r in res["sweeps"][:len(runs)]] == runs
    for s in STRATEGIES:
        b = res["best"][(2, s)]
        assert b.strategy == s and b.steps == K and b.R == 2
        at4 = res["best"][(4, s)]  # R = 4 is not swept: R = 2's knob, simulated at 4 on the reporting draw
        assert at4.strategy == s and at4.setting == b.setting and at4.R == 4
        want = simulate(inp.cost.predict, SMALL, s, sizes_for(s, SMALL, b.setting, inp.cost.predict), 4, 2,
                        steps_for(4, 2, 32), seed=1, setting=b.setting, **kw)
        assert at4.tokens_per_s == want.tokens_per_s
    for R in (2, 4):
        base = res["best"][(R, "equal_token@S_max")]
        assert base.strategy == "equal_token" and base.setting == {"m_tokens": 14040, "factor": 1.0}
        assert base.batch_sizes == [9, 1, 1]
    assert len(res["rows"]) == 10 and all(r is not None for r in res["rows"])
    assert len(res["sweeps"]) > 4 * len(runs) / 2 and {lab for lab, _ in res["sweeps"]} == {"sweep"}
    record_chosen(cal, res, "full")
    chosen = cal.data["chosen"]
    assert (chosen["mode"], chosen["micro_batches"], chosen["m_mem"], chosen["m_mem_S_min"]) == ("full", 2,
                                                                                                 inp.m_mem, 1560)
    assert chosen["mix"] == [{"bucket": "a", "S": 1560, "share": 0.5}, {"bucket": "b", "S": 7800, "share": 0.3},
                             {"bucket": "c", "S": 14040, "share": 0.2}]
    by = chosen["by_world_size"]
    assert set(by) == {"2", "4"}
    assert by["4"]["equal_token"] == {"m_tokens": res["best"][(4, "equal_token")].setting["m_tokens"]}
    assert by["4"]["dual_constraint"] == {k: res["best"][(4, "dual_constraint")].setting[k] for k in ("m_comp", "p")}
    for s in ("cost", "balanced"):
        assert by["2"][s] == {"target_microbatch_ms": res["best"][(2, s)].setting["target_microbatch_ms"]}


def test_the_fixed_batch_protocol_asks_each_reading_and_the_model_truth_for_every_strategy(monkeypatch):
    import scheduling.protocol as protocol
    from scheduling.truth import ModelTruth

    calls = []

    def best_at_g(inp, mix, s, R, g, truth=None, reading="steady", **kw):
        calls.append((mix, s, R, g, type(truth).__name__, reading, tuple(sorted(kw.items()))))
        return simulate(QUAD.predict, SMALL, s, [9, 1, 1], R, 2, 4)

    monkeypatch.setattr(protocol, "best_at_g", best_at_g)
    inp = protocol.Inputs(cost=QUAD, m_mem=4e5, p=1.3, optim_ms=0.0, truth=None)
    out = protocol.run_fixed_batch(inp, SMALL, ranks=(4,), g_factors=(2.0,), log=lambda s: None)
    kw = (("mbs", 4096), ("mbs_final", 16384), ("per_M", 6), ("seed", 0), ("slow_ranks", None))
    want = []
    for s in protocol.STRATEGIES:
        want += [(SMALL, s, 4, 2 * 14040, "NoneType", r, (("cache", None),) + kw) for r in ("steady", "expected")]
        want.append((SMALL, s, 4, 2 * 14040, "ModelTruth", "steady", kw))
    assert calls == want
    assert set(out) == {"steady", "expected", "model"} and all(len(v) == 4 for v in out.values())
    assert isinstance(ModelTruth(QUAD.predict), ModelTruth)


def test_the_fixed_batch_protocol_and_the_matrix_on_a_small_cluster_and_what_they_record():
    from scheduling.protocol import (MATRIX_RULES, STRATEGIES, best_at_g, inputs_from, record_chosen_at_g,
                                     run_fixed_batch, run_matrix)

    cal = four_block_h200_calibration()
    inp = inputs_from(cal, "full", SMALL)
    kw = dict(mbs=64, mbs_final=64, per_M=2)
    res = run_fixed_batch(inp, SMALL, ranks=(4,), g_factors=(2.0,), log=lambda s: None, **kw)
    g = 2 * SMALL.S_max
    for reading in ("steady", "expected"):
        want = best_at_g(inp, SMALL, "dual_constraint", 4, g, reading=reading, **kw)
        got = res[reading][(4, 2.0, "dual_constraint")]
        assert (got.M, got.window, got.tokens_per_s) == (want.M, want.window, want.tokens_per_s)
    for s in STRATEGIES:
        assert res["steady"][(4, 2.0, s)].strategy == res["model"][(4, 2.0, s)].strategy == s
    cal.data["chosen"] = {"m_mem": 123, "by_tokens_per_step": {"16": {"28080": {"cost": {}}}}}
    record_chosen_at_g(cal, res, SMALL, "full", inp.m_mem, m_mem_at=lambda R: 1000 * R)
    chosen = cal.data["chosen"]
    assert chosen["mode"] == "full" and chosen["by"] == "scripts/simulate_cluster.py"
    assert chosen["m_mem"] is None and chosen["m_mem_by_world_size"] == {"4": 4000, "16": 16000}
    assert list(chosen["by_tokens_per_step"]) == ["4", "16"]  # world sizes in numeric order; 16 kept
    assert chosen["mix"] == [{"bucket": n, "S": S, "share": sh} for n, S, sh in (("a", 1560, 0.5), ("b", 7800, 0.3),
                                                                                   ("c", 14040, 0.2))]
    at = chosen["by_tokens_per_step"]["4"][str(g)]
    for s in STRATEGIES:
        r = res["steady"][(4, 2.0, s)]
        keep = {"equal_token": ("m_tokens",), "dual_constraint": ("m_comp", "p")}.get(s, ("target_microbatch_ms",))
        assert at[s] == {**{k: r.setting[k] for k in keep}, "micro_batches": r.M, "window": r.window,
                         "tokens_per_step": r.setting["tokens_per_step"]}
    # the matrix: every rule under every planner, the best window, cells shared through the cache
    cache = {}
    m = run_matrix(inp, SMALL, ranks=(4,), g_factors=(2.0,), planners=(("stream", 1), ("reformed", 1),
                                                                        ("windowed", 2), ("windowed", 4)),
                   cache=cache, log=lambda s: None, **kw)
    assert set(m) == {(4, 2.0, rule, col) for rule in MATRIX_RULES
                      for col in ("stream", "reformed", "W=2", "W=4", "best W")}
    assert len(cache) == 12
    for rule in MATRIX_RULES:
        assert m[(4, 2.0, rule, "stream")].planner == "stream" and m[(4, 2.0, rule, "stream")].window == 1
        assert m[(4, 2.0, rule, "reformed")].planner == "reformed" and m[(4, 2.0, rule, "reformed")].window == 1
        assert m[(4, 2.0, rule, "reformed")].tokens_per_s > m[(4, 2.0, rule, "stream")].tokens_per_s
        assert m[(4, 2.0, rule, "W=2")].planner == "windowed" and m[(4, 2.0, rule, "W=2")].window == 2
        assert m[(4, 2.0, rule, "W=4")].window == 4
        assert m[(4, 2.0, rule, "best W")] is max((m[(4, 2.0, rule, c)] for c in ("W=2", "W=4")),
                                                  key=lambda r: r.tokens_per_s)


def test_matrix_shares_split_the_best_cells_gain_into_the_planners_part_and_the_rules():
    from types import SimpleNamespace

    from scheduling.protocol import matrix_shares

    tps = {("equal_token", "stream"): 90, ("equal_token", "sorted"): 95, ("dual_constraint", "stream"): 80,
           ("dual_constraint", "sorted"): 100, ("cost", "stream"): 85, ("cost", "sorted"): 120}
    m = {(8, 2.0, rule, col): SimpleNamespace(tokens_per_s=v) for (rule, col), v in tps.items()}
    m |= {(64, 2.0, rule, col): SimpleNamespace(tokens_per_s=1000 - v) for (rule, col), v in tps.items()}  # not read
    m |= {(8, 3.0, rule, col): SimpleNamespace(tokens_per_s=1.0) for (rule, col) in tps}
    assert matrix_shares(m, 8, 2.0) == {"total": 120 / 80, "best": ("cost", "sorted"), "rule_in_stream": 90 / 80,
                                        "best_stream_rule": "equal_token", "planner_on_paper_rule": 100 / 80,
                                        "paper_rule_best_planner": "sorted", "planner_on_best_rule": 120 / 85,
                                        "rule_under_best_planner": 120 / 100}


def test_fsdps_collectives_and_a_chosen_m_mem_enter_the_protocols_inputs():
    """--comm-bandwidth: FSDP's collectives from the file's parameter count and layers (refused without the count);
    a calibration without a memory model (a CPU file) gives its chosen m_mem."""
    from scheduling.protocol import inputs_from
    from scheduling.truth import CommModel

    cal = four_block_h200_calibration()
    assert inputs_from(cal, "full", SMALL).comm is None
    with pytest.raises(ValueError, match="needs the parameter count"):
        inputs_from(cal, "full", SMALL, comm_bandwidth=350.0)
    cal.data["model"]["params"] = 1.3e9
    inp = inputs_from(cal, "full", SMALL, comm_bandwidth=350.0, inter_node_bandwidth=40.0)
    assert inp.comm == CommModel(param_bytes=5.2e9, grad_bytes=5.2e9, blocks=30, bandwidth=350.0,
                                 inter_node_bandwidth=40.0)
    cal.data["hbm_bytes"] = None  # no device memory: no m_mem from the memory model
    cal.data["chosen"] = {"m_mem": 50_000}
    inp = inputs_from(cal, "full", SMALL)
    assert inp.m_mem == 50_000 and inp.m_mem_at(64) == 50_000
    assert inp.notes == ["no memory model: m_mem=50000 from the calibration's chosen settings"]


def test_auto_mode_takes_fsdps_collectives_at_every_world_size(monkeypatch):
    from scheduling.calibrate import Calibration
    from scheduling.protocol import inputs_from
    from tests.helpers import ROOT

    monkeypatch.chdir(ROOT)
    cal = Calibration.load("results/calibration_h200_policies.json")
    cal.data["model"]["params"] = 1.3e9
    inp = inputs_from(cal, "auto", Mix.of(DEFAULT_MIX), comm_bandwidth=350.0)
    for R in (1, 8):
        assert inp.at(R).comm.param_bytes == 5.2e9 and inp.at(R).comm.bandwidth == 350.0
    assert inputs_from(cal, "auto", Mix.of(DEFAULT_MIX)).comm is None


def test_a_cached_cell_is_relabelled_for_the_rule_asked_and_carries_the_optimizers_time():
    import dataclasses

    from scheduling.protocol import best_cell, inputs_from

    inp = dataclasses.replace(inputs_from(four_block_h200_calibration(), "full", SMALL), optim_ms=80.0)
    kw = dict(mbs=64, mbs_final=64, per_M=2)
    cache = {}
    cost = best_cell(inp, SMALL, "cost", 4, 2 * 14040, "sorted", cache=cache, **kw)
    assert cost.optim_ms == 80.0 and len(cache) == 1
    bal = best_cell(inp, SMALL, "balanced", 4, 2 * 14040, "sorted", cache=cache, **kw)  # cost's rule, sorted: shared
    assert bal.strategy == "balanced" and bal.tokens_per_s == cost.tokens_per_s and len(cache) == 1
    assert best_cell(inp, SMALL, "cost", 4, 2 * 14040, "sorted", cache=cache, **kw).strategy == "cost"


def test_grid_points_that_repeat_a_batch_table_are_not_neighbours_of_the_best():
    """equal_token at 2.0, 2.05 and 2.1 × S_max gives one batch table: run once, and the best grid point's upper
    neighbour is the next distinct table (none here: up to 1.5 × its knob), not a repeat of itself."""
    from scheduling.simulate import sweep

    mix = Mix.of([("a", 1000, 0.5), ("b", 2600, 0.3), ("c", 7000, 0.2)])
    best, runs = sweep(QUAD.predict, mix, "equal_token", 4, p=None, m_mem=1e5, steps=8, factors=(1.0, 2.0, 2.05, 2.1))
    assert [r.setting["m_tokens"] for r in runs[:2]] == [7000, 14000] and runs[1].tokens_per_s > runs[0].tokens_per_s
    assert max(r.setting["m_tokens"] for r in runs) > 14700  # refined above the repeats, towards 21,000


def test_an_unswept_world_size_takes_the_nearest_swept_knob_below_under_its_own_memory_bound():
    """run_unconstrained at R = 64 with sweeps at 8 and 16 only: R = 16's knob (the nearest below, not the smallest),
    simulated under R = 64's own m_mem — the 14B's FSDP memory model shards the states over R, so the bound grows
    with it (mutation testing found both rules untested: results/mutation.md)."""
    import os

    from scheduling.calibrate import Calibration
    from scheduling.protocol import STRATEGIES, inputs_from, run_unconstrained
    from tests.helpers import ROOT

    cal = Calibration.load(os.path.join(ROOT, "results", "calibration_h200_14b.json"))
    inp = inputs_from(cal, "full", SMALL)
    assert inp.m_mem_at(8) < inp.m_mem_at(16) < inp.m_mem_at(64)  # FSDP: the states shard over R
    res = run_unconstrained(cal, "full", SMALL, ranks=[8, 16, 64], sweep_ranks=[8, 16], M=2, mbs=32,
                            log=lambda s: None)
    best = res["best"]
    differs = 0
    for s in STRATEGIES:
        at16, at64 = best[(16, s)].setting, best[(64, s)].setting
        assert {k: v for k, v in at64.items() if k != "m_mem"} == {k: v for k, v in at16.items() if k != "m_mem"}
        if "m_mem" in at16:
            assert at64["m_mem"] == inp.m_mem_at(64) != at16["m_mem"]
        differs += best[(8, s)].setting != at16
    assert differs >= 2  # the smallest swept R's knob would be another one

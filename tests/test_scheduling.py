"""scheduling/: batch-size rules, the balanced planner and its window, the policy (sources, refusals), conf groups."""
import json
import math

import numpy as np
import pytest

from scheduling.planner import SampleTable, advance, deal_balanced, plan_step
from scheduling.batching import (batch_sizes, cost_batch_size, dual_constraint_batch_size,
                                 equal_token_batch_size)
from scheduling.calibrate import Calibration
from scheduling.config import SchedulingConfig
from scheduling.cost_model import CostModel, MemoryModel
from scheduling.efficiency import compute_cv, cv, idle_fraction, model_flops, step_time
from scheduling.policy import ModelShape, resolve_schedule
from scheduling.simulate import DEFAULT_MIX, Mix, four_block_h200_calibration

QUAD = CostModel("quadratic", {"a": 15.7, "b1": 0.0238, "b2": 1.44e-6})  # ≈ the H200 fit, full depth
WAN13 = ModelShape(p_matmul=1_250_623_488, layers=30, dim=1536, text_len=512)


# ------------------------------------------------------------------------------------------------ batching
def test_rules_match_their_formulas_on_random_inputs():
    rng = np.random.default_rng(0)
    for _ in range(300):
        S = int(rng.integers(1, 80_000))
        m_tokens = int(rng.integers(1, 400_000))
        assert equal_token_batch_size(S, m_tokens) == max(1, m_tokens // S)
        m_mem = float(rng.integers(S, 500_000))
        m_comp, p = float(rng.uniform(1e3, 1e8)), float(rng.uniform(0.5, 2.5))
        want = max(1, min(math.floor(m_mem / S), math.floor(m_comp / S ** p)))
        assert dual_constraint_batch_size(S, m_mem, m_comp, p) == want
        target = float(rng.uniform(10, 20_000))
        brute = [B for B in range(1, int(m_mem // S) + 1) if QUAD.predict(B, S) <= target]
        assert cost_batch_size(S, QUAD, target, m_mem) == (max(brute) if brute else 1)


@pytest.mark.parametrize("call, field", [
    (lambda: dual_constraint_batch_size(75600, 50_000, 1e7, 1.3), "scheduling.m_mem"),  # S > m_mem
    (lambda: dual_constraint_batch_size(1000, 50_000, 1e7, 0.0), "scheduling.p"),
    (lambda: dual_constraint_batch_size(1000, 50_000, -1.0, 1.0), "scheduling.m_comp"),
    (lambda: equal_token_batch_size(1000, -5), "scheduling.m_tokens"),
    (lambda: cost_batch_size(1000, QUAD, 0.0, 1e6), "scheduling.target_microbatch_ms"),
    (lambda: cost_batch_size(80_000, QUAD, 1e4, 75_600), "scheduling.m_mem"),
    (lambda: batch_sizes("cost", [1000], m_mem=1e6, cost_model=QUAD), "scheduling.target_microbatch_ms"),
    (lambda: batch_sizes("dual_constraint", [1000], m_mem=1e6, p=1.2), "scheduling.m_comp"),
    (lambda: batch_sizes("fast", [1000]), "scheduling.strategy"),
])
def test_impossible_settings_are_refused_naming_the_field(call, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        call()


@pytest.mark.parametrize("kw, field", [({"m_tokens": 0}, "m_tokens"), ({"m_mem": 0.0}, "m_mem"),
                                       ({"target_microbatch_ms": 0}, "target_microbatch_ms"), ({"window": 0}, "window")])
def test_scheduling_config_refuses_zero(kw, field):
    """Every knob must be > 0 (window ≥ 1): zero is refused, naming the field."""
    with pytest.raises(ValueError, match=rf"scheduling\.{field}"):
        SchedulingConfig("balanced", **kw)
    SchedulingConfig("balanced", **{k: 1 for k in kw})  # the smallest allowed value passes


def test_metrics_on_hand_cases():
    """scheduling/efficiency.py on R = 2 ranks × M = 3 slots (R ≠ M, so rows and columns cannot be confused), with
    degenerate inputs giving 0 rather than NaN, and the FLOP formula of contracts §9 with every term distinct."""
    t = np.array([[4.0, 1.0, 3.0], [2.0, 1.0, 1.0]])
    # idle = 1 − Σ t / (R · Σ_k max_r t_rk) = 1 − 12 / (2 · 8)
    assert idle_fraction(t) == pytest.approx(1 - 12 / 16)
    assert idle_fraction(t, np.array([[True, True, True], [True, False, True]])) == pytest.approx(1 - 11 / 16)
    assert compute_cv(t) == pytest.approx(np.std([8.0, 4.0]) / 6.0)
    assert step_time(t) == 8.0
    assert compute_cv(np.zeros((2, 3))) == 0.0 and idle_fraction(np.zeros((2, 3))) == 0.0
    assert cv([3.0, 5.0]) == pytest.approx(0.25) and cv([0.0, 0.0]) == 0.0 and cv([7.0]) == 0.0
    B, S, L, P, layers, D = 3, 100, 7, 1000, 5, 8
    assert model_flops(B, S, L, P, layers, D) == B * (6 * P * S + 12 * layers * D * S * S + 12 * layers * D * S * L)
    assert model_flops(1, 10, 0, 0, 2, 1) == 12 * 2 * 100  # attention alone: 12·layers·D·S²


def test_cost_rule_edges():
    assert cost_batch_size(75600, QUAD, 1.0, 1e6) == 1          # even B=1 is over the target: one sample
    assert cost_batch_size(1560, QUAD, 1e9, 10 * 1560) == 10    # the memory bound caps B
    # predicted exactly at the target is within it ("≤ target_ms"): B = 5 at 10 ms a sample, not 4
    assert [cost_batch_size(1000, lambda B, S: 10.0 * B, t, 1e9) for t in (49.9, 50.0, 50.1)] == [4, 5, 5]
    t = QUAD.predict(1, 75600)
    assert batch_sizes("cost", [1560, 75600], m_mem=4e5, cost_model=QUAD, target_ms=t)[1] == 1


# ------------------------------------------------------------------------------------------------- planner
def mix_table(n=6000, seed=0):
    return Mix.of(DEFAULT_MIX).table(n, seed)


def run_epoch(samples, world, M, sizes, strategy="balanced", window=1, start=0, epoch=0, stop_after=None):
    pos, plans = start, []
    while True:
        plan, nxt = plan_step(samples, 3, epoch, pos, world, strategy, M, sizes, QUAD.predict, window=window)
        plans.append(plan)
        e, pos = advance(epoch, nxt, samples)
        if e != epoch or (stop_after and len(plans) == stop_after):
            return plans, pos


def real_ids(plans):
    return [i for p in plans for r in p.ranks for mb in r for i, w in zip(mb.ids, mb.weights) if w > 0]


SIZES = batch_sizes("cost", Mix.of(DEFAULT_MIX).S, m_mem=4e5, cost_model=QUAD, target_ms=QUAD.predict(1, 75600))


@pytest.mark.parametrize("world, M, window", [(8, 4, 1), (3, 2, 1), (8, 4, 3), (5, 3, 2)])
def test_balanced_plans_cover_every_entry_once_with_equal_slots(world, M, window):
    samples = mix_table(3000)
    plans, _ = run_epoch(samples, world, M, SIZES, window=window)
    for plan in plans:
        assert len({len(r) for r in plan.ranks}) == 1 and plan.num_slots <= M
        for r in plan.ranks:
            for mb in r:
                assert mb.B <= SIZES[mb.bucket] and len({int(samples.bucket[i]) for i in mb.ids}) == 1
    assert all(p.num_slots == M for p in plans[:-window])  # only the epoch's end may be short
    assert sorted(real_ids(plans)) == sorted(samples.ids.tolist())


@pytest.mark.parametrize("window", [1, 3])
def test_plans_are_identical_on_every_rank(window):
    a = run_epoch(mix_table(), 8, 4, SIZES, window=window, stop_after=5)[0]
    b = run_epoch(mix_table(), 8, 4, SIZES, window=window, stop_after=5)[0]  # another process's own table
    assert a == b


def test_resume_on_another_world_size_neither_repeats_nor_skips():
    samples = mix_table(3000)
    first, pos = run_epoch(samples, 8, 4, SIZES, stop_after=3)
    rest, _ = run_epoch(samples, 5, 2, SIZES, start=pos)  # resumed on 5 ranks, M = 2
    assert sorted(real_ids(first + rest)) == sorted(samples.ids.tolist())


def test_windowed_resume_same_world_size_anywhere_and_another_at_a_window_boundary():
    samples = mix_table(3000)
    straight, _ = run_epoch(samples, 4, 4, SIZES, window=3)
    first, pos = run_epoch(samples, 4, 4, SIZES, window=3, stop_after=4)  # mid-window (4 = 3 + 1)
    rest, _ = run_epoch(samples, 4, 4, SIZES, window=3, start=pos)
    assert first + rest == straight
    first, pos = run_epoch(samples, 4, 4, SIZES, window=3, stop_after=6)  # a window boundary
    rest, _ = run_epoch(samples, 5, 2, SIZES, window=2, start=pos)  # another R and window: 96 micro-batches done,
    # not a multiple of the new window (20), so the new run first plans unwindowed up to its next window boundary
    assert sorted(real_ids(first + rest)) == sorted(samples.ids.tolist())


def test_balanced_compute_cv_pred_within_2_percent_on_a_mix():
    samples = mix_table(20_000)
    plans, _ = run_epoch(samples, 8, 4, SIZES, stop_after=60)
    cv = np.mean([compute_cv(p.pred_ms()) for p in plans])
    idle = np.mean([idle_fraction(p.pred_ms(), p.real()) for p in plans])
    stream, _ = run_epoch(samples, 8, 4, SIZES, strategy="cost", stop_after=60)  # same B, stream order
    cv_cost = np.mean([compute_cv(p.pred_ms()) for p in stream])
    idle_cost = np.mean([idle_fraction(p.pred_ms(), p.real()) for p in stream])
    assert cv <= 0.02 and idle <= 0.03, (cv, idle)
    assert cv < cv_cost and idle < idle_cost  # dealing beats the same micro-batches in stream order
    eq = batch_sizes("equal_token", Mix.of(DEFAULT_MIX).S, m_tokens=75600)
    eq_plans, _ = run_epoch(samples, 8, 4, eq, strategy="equal_token", stop_after=60)
    assert np.mean([compute_cv(p.pred_ms()) for p in eq_plans]) > 0.15  # the metric can fail


@pytest.mark.parametrize("R, M, window, want", [
    (2, 2, 2, [[9.0, 9.0], [9.0, 9.0]]),   # groups (8,7) (6,5) (4,3) (2,1) → steps {(8,7),(2,1)}, {(6,5),(4,3)}
    (1, 2, 3, [[7.0], [7.0], [7.0]]),      # 6 5 4 3 2 1 → steps {6,1}, {5,2}, {4,3}
])
def test_window_deals_its_groups_to_steps_in_snake_order(R, M, window, want):
    """A window's micro-batches, sorted and cut into groups of R, go to its steps in snake order (0 1 … n−1 n−1 … 0),
    so every step gets a cross-section of costs; dealt round-robin (0 1 0 1 …) the first step would get the
    costliest of every round: (8,7)+(4,3) against (6,5)+(2,1), 11 ms a rank against 7. One sample per micro-batch,
    its cost its bucket's number + 1 ms."""
    n = R * M * window
    samples = SampleTable(np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int32),
                          np.arange(1, n + 1, dtype=np.int64) * 100)
    pos, totals, slots = 0, [], []
    for _ in range(window):
        plan, pos = plan_step(samples, 0, 0, pos, R, "balanced", M, [1] * n, lambda B, S: S / 100, window=window)
        totals.append(plan.pred_ms().sum(axis=1).tolist())
        slots.append([sorted(mb.pred_ms for mb in slot) for slot in zip(*plan.ranks)])
    assert pos == n and totals == want
    if R == 2:
        assert slots == [[[7.0, 8.0], [1.0, 2.0]], [[5.0, 6.0], [3.0, 4.0]]]  # each slot's pair costs alike


@pytest.mark.parametrize("strategy", ["equal_token", "cost"])
def test_window_is_ignored_by_the_stream_order_strategies(strategy):
    """scheduling.window plans steps together for balanced only: the other strategies' plans with window = 3 are
    their plans with window = 1 (stream order), and the policy says so in its notes."""
    samples = mix_table(600)
    for_w = lambda w: run_epoch(samples, 4, 2, SIZES, strategy=strategy, window=w, stop_after=6)[0]  # noqa: E731
    assert for_w(3) == for_w(1)
    tokens = {n: S for n, S, _ in DEFAULT_MIX}
    sched = resolve_schedule(SchedulingConfig("equal_token", m_tokens=75600, window=3), tokens, WAN13)
    assert any("window=3" in n for n in sched.notes)
    assert not any("window" in n for n in resolve_schedule(SchedulingConfig("equal_token", m_tokens=75600),
                                                           tokens, WAN13).notes)


def test_flops_proxy_prices_a_micro_batch_at_100_tflops():
    """Without a calibration the cost model is the FLOP count at 100 TFLOP/s: ms = FLOPs / 1e11."""
    from scheduling.policy import flops_cost_fn

    cost = flops_cost_fn(WAN13)
    flops = model_flops(2, 1560, 512, WAN13.p_matmul, 30, 1536)
    assert cost(2, 1560) == pytest.approx(flops / 1e11, rel=1e-12) and 200 < cost(2, 1560) < 400
    assert flops_cost_fn(WAN13, proxy_tflops=400.0)(2, 1560) == pytest.approx(flops / 4e11, rel=1e-12)


def test_deal_balanced_is_sorted_groups_then_lpt():
    pred = np.array([1.0, 9.0, 5.0, 8.0, 2.0, 4.0, 7.0])
    idx = deal_balanced(pred, 3, 3, pad_ms=0.5)
    slots = [sorted(pred[i] for i in idx[:, k] if i >= 0) for k in range(3)]
    assert slots == [[7.0, 8.0, 9.0], [2.0, 4.0, 5.0], [1.0]]
    totals = [sum(pred[i] if i >= 0 else 0.5 for i in row) for row in idx]
    assert idx[np.argmax(pred[idx[:, 0]]), 1] == 4  # the rank that took 9 gets the 2 in the next slot (LPT)
    assert max(totals) - min(totals) <= 2.0 + 1e-9


def test_padding_counts_as_idle():
    t = np.array([[4.0, 1.0], [4.0, 1.0]])
    assert idle_fraction(t) == 0.0
    assert idle_fraction(t, np.array([[True, True], [True, False]])) == pytest.approx(1 / 10)


# --------------------------------------------------------------------------------------------------- policy
@pytest.fixture()
def h200(tmp_path):
    cal = four_block_h200_calibration()
    cal.data["chosen"] = {"m_mem": 300_000, "reference_world_size": 8, "by_world_size": {
        "8": {"equal_token": {"m_tokens": 113_400}, "cost": {"target_microbatch_ms": 12_000.0},
              "balanced": {"target_microbatch_ms": 10_500.0}, "dual_constraint": {"m_comp": 4e6, "p": 1.3}},
        "64": {"balanced": {"target_microbatch_ms": 11_000.0}}}}
    return cal.save(str(tmp_path / "cal.json"))


WAN_TOKENS = {n: S for n, S, _ in DEFAULT_MIX}


def test_explicit_config_beats_the_calibration_and_sources_say_so(h200):
    s = resolve_schedule(SchedulingConfig("balanced", calibration=h200), WAN_TOKENS, WAN13)
    assert s.values["target_microbatch_ms"] == 10_500.0 and s.sources["target_microbatch_ms"] == "calibration:chosen"
    assert s.values["m_mem"] == 300_000 and s.sources["m_mem"] == "calibration:chosen"
    assert s.sources["cost"] == "calibration:full:quadratic"
    assert s.batch_sizes == dict(zip(WAN_TOKENS, batch_sizes("balanced", list(WAN_TOKENS.values()), m_mem=300_000,
                                                             cost_model=s.cost_fn, target_ms=10_500.0)))
    s64 = resolve_schedule(SchedulingConfig("balanced", calibration=h200), WAN_TOKENS, WAN13, world_size=48)
    assert s64.values["target_microbatch_ms"] == 11_000.0  # the simulator's choice nearest 48 ranks
    s = resolve_schedule(SchedulingConfig("balanced", calibration=h200, target_microbatch_ms=9000.0, m_mem=200_000),
                         WAN_TOKENS, WAN13)
    assert (s.values["target_microbatch_ms"], s.sources["target_microbatch_ms"]) == (9000.0, "config")
    assert (s.values["m_mem"], s.sources["m_mem"]) == (200_000, "config")
    s = resolve_schedule(SchedulingConfig("cost", calibration=h200, mem_budget_gib=80.0), WAN_TOKENS, WAN13)
    mem = Calibration.load(h200).memory_model("full")
    assert s.values["m_mem"] == mem.m_mem(80 * 2**30) and "mem_budget_gib" in s.sources["m_mem"]
    s = resolve_schedule(SchedulingConfig("dual_constraint", calibration=h200), WAN_TOKENS, WAN13)
    assert s.values["m_comp"] == 4e6 and s.values["p"] == 1.3 and s.sources["p"] == "calibration:chosen"


def test_m_mem_is_taken_at_the_shortest_bucket_on_every_path(tmp_path):
    """A memory model with a per-sample term bounds B·S at the run's shortest S (mem_budget_gib, the 90 % default,
    PartialRecompute); the simulator's chosen m_mem is used only where it was taken at an S no longer than it."""
    cal = four_block_h200_calibration()
    mem = MemoryModel(20 * 2**30, 150 * 2**10, c2=20 * 2**20, floor=26 * 2**30)
    cal.data["modes"]["full"]["memory_model"] = mem.to_dict()
    path = cal.save(str(tmp_path / "c.json"))
    short = dict(WAN_TOKENS, tiny=256)  # a bucket shorter than the mix's 1560
    for tokens in (WAN_TOKENS, short):
        S_min = min(tokens.values())
        s = resolve_schedule(SchedulingConfig("cost", calibration=path, mem_budget_gib=80.0), tokens, WAN13)
        assert s.values["m_mem"] == mem.m_mem(80 * 2**30, S_min) < mem.m_mem(80 * 2**30, 75600)
        s = resolve_schedule(SchedulingConfig("cost", calibration=path), tokens, WAN13)
        assert s.values["m_mem"] == mem.m_mem(0.9 * cal.hbm_bytes, S_min) and "90%" in s.sources["m_mem"]
        assert all(mem.predict(B, tokens[n]) <= 0.9 * cal.hbm_bytes for n, B in s.batch_sizes.items())
    cal.data["chosen"] = {"m_mem": 600_000, "m_mem_S_min": 1560}
    path = cal.save(str(tmp_path / "c.json"))
    assert resolve_schedule(SchedulingConfig("cost", calibration=path), WAN_TOKENS, WAN13).values["m_mem"] == 600_000
    s = resolve_schedule(SchedulingConfig("cost", calibration=path), short, WAN13)
    assert s.values["m_mem"] == mem.m_mem(0.9 * cal.hbm_bytes, 256) and "90%" in s.sources["m_mem"]


def test_defaults_without_simulator_choices(tmp_path):
    path = four_block_h200_calibration().save(str(tmp_path / "c.json"))
    s = resolve_schedule(SchedulingConfig("dual_constraint", calibration=path), WAN_TOKENS, WAN13)
    p = Calibration.load(path).cost_model("full", "power").params["p"]
    assert s.values["p"] == pytest.approx(p) and s.sources["p"] == "calibration:power fit"
    assert s.batch_sizes["v720_81f"] == 1 and "90%" in s.sources["m_mem"]
    s = resolve_schedule(SchedulingConfig("cost", calibration=path), WAN_TOKENS, WAN13)
    assert s.values["target_microbatch_ms"] == pytest.approx(s.cost_fn(1, 75600)) and s.batch_sizes["v720_81f"] == 1


@pytest.mark.parametrize("cfg, field", [
    (dict(strategy="balanced", mem_budget_gib=20.0), "scheduling.mem_budget_gib"),  # below weights + optimizer
    (dict(strategy="equal_token", m_tokens=500_000, m_mem=400_000), "scheduling.m_tokens"),
    (dict(strategy="cost", m_mem=50_000), "scheduling.m_mem"),                       # the 75600-token bucket
    (dict(strategy="balanced", calibration="/no/such/file.json"), "scheduling.calibration"),
])
def test_policy_refuses_impossible_settings(h200, cfg, field):
    cfg.setdefault("calibration", h200)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        resolve_schedule(SchedulingConfig(**cfg), WAN_TOKENS, WAN13)


def test_policy_refuses_a_calibration_of_another_model_or_mode(h200):
    tiny = ModelShape(p_matmul=10_000, layers=2, dim=64, text_len=32)
    with pytest.raises(ValueError, match="another model"):
        resolve_schedule(SchedulingConfig("balanced", calibration=h200), WAN_TOKENS, tiny)
    with pytest.raises(ValueError, match="model.checkpointing=none"):
        resolve_schedule(SchedulingConfig("balanced", calibration=h200), WAN_TOKENS, WAN13, checkpointing="none")
    with pytest.raises(ValueError, match="scheduling.calibration"):
        resolve_schedule(SchedulingConfig("cost"), WAN_TOKENS, WAN13)


def test_auto_checkpointing_recomputes_the_fewest_blocks_that_fit(tmp_path):
    cal = four_block_h200_calibration()
    none = json.loads(json.dumps(cal.data["modes"]["full"]))
    none["cost_model"]["params"] = {k: v * 0.75 for k, v in none["cost_model"]["params"].items()}
    none["memory_model"]["c1"] *= 4  # no recompute: more activation memory per token
    cal.data["modes"]["none"] = none
    path = cal.save(str(tmp_path / "auto.json"))
    budget_gib = 60.0
    s = resolve_schedule(SchedulingConfig("cost", calibration=path, mem_budget_gib=budget_gib), WAN_TOKENS, WAN13,
                         checkpointing="auto")
    full, fast = cal.cost_model("full"), CostModel.from_dict(none["cost_model"])
    none_mem, full_mem = MemoryModel.from_dict(none["memory_model"]), cal.memory_model("full")
    L, budget = WAN13.layers, budget_gib * 2**30
    T0 = none_mem.m_mem(budget)  # the largest B·S without recompute
    assert s.recompute_blocks(1, T0) == 0 and s.cost_fn(1, T0) == pytest.approx(fast.predict(1, T0))
    assert s.recompute_blocks(1, T0 + 1) >= 1
    T_full = full_mem.m_mem(budget)
    assert s.recompute_blocks(1, T_full) == L and s.cost_fn(1, T_full) == pytest.approx(full.predict(1, T_full))
    for T in np.linspace(T0 + 1, T_full, 7).astype(int):
        k = s.recompute_blocks(1, T)
        assert 0 < k <= L
        peak = lambda k: none_mem.predict(1, T) - k / L * (none_mem.predict(1, T) - full_mem.predict(1, T))
        assert peak(k) <= budget * (1 + 1e-9) and (k == 1 or peak(k - 1) > budget)  # the fewest that fit
        f = k / L
        assert s.cost_fn(1, T) == pytest.approx((1 - f) * fast.predict(1, T) + f * full.predict(1, T))


def test_keep_attention_spends_memory_on_attention_outputs_first(tmp_path):
    """model.keep_attention with checkpointing=auto: the recomputed blocks keep their attention outputs wherever
    that fits (j = k), the predicted peak stays within the budget, and the fewest blocks recompute for that."""
    from models.parallelize import checkpoint_policy
    from scheduling.policy import PartialRecompute, kept_bytes_per_token

    cal = four_block_h200_calibration()
    full_mem, full_cost = cal.memory_model("full"), cal.cost_model("full")
    none_mem = MemoryModel(full_mem.c0, full_mem.c1 * 12)
    L, budget, a = WAN13.layers, 40 * 2**30, 2.0 * WAN13.dim * (1 + 1 / 64)
    pr = PartialRecompute(L, budget, none_mem, full_mem, full_cost, full_cost, attention_bytes=a)

    def peak(T, k, j):
        none, full = none_mem.predict(1, T), full_mem.predict(1, T)
        return none - k / L * (none - full) + j * a * T

    assert pr.decide(1, 1000) == (0, 0)  # fits without recompute
    seen_partial = seen_full = False
    for T in np.linspace(none_mem.m_mem(budget) + 1, full_mem.m_mem(budget), 25).astype(int):
        k, j = pr.decide(1, int(T))
        assert 0 < k <= L and 0 <= j <= k and peak(T, k, j) <= budget * (1 + 1e-9)
        if k < L:
            assert j == k and peak(T, k - 1, k - 1) > budget  # all kept, and one recompute fewer would not fit
            seen_partial = True
        else:
            assert j == L or peak(T, L, j + 1) > budget
            seen_full = True
    assert seen_partial and seen_full
    # a larger charge per kept block (e.g. a wider model's outputs) keeps fewer where all blocks recompute
    a_big = 2 * a
    assert a == kept_bytes_per_token(WAN13.dim)
    pr_big = PartialRecompute(L, budget, none_mem, full_mem, full_cost, full_cost, attention_bytes=a_big)
    T = int(full_mem.m_mem(budget) * 0.9)
    (k, j), (k_big, j_big) = pr.decide(1, T), pr_big.decide(1, T)
    assert k == k_big == L and j_big < j and full_mem.predict(1, T) + j_big * a_big * T <= budget
    assert checkpoint_policy("full", None, keep_attention=True, layers=L)(1, 5) == (L, L)
    assert checkpoint_policy("full", None)(1, 5) is True


def test_conf_groups_compose_and_resolve_on_the_tiny_model(monkeypatch):
    from tests.helpers import ROOT, compose_config

    monkeypatch.chdir(ROOT)  # the groups name results/calibration_cpu_tiny.json relative to the repository

    for group in ("equal_token", "dual_constraint", "cost", "balanced"):
        cfg = compose_config([f"scheduling={group}", "scheduling.window=2"])
        tokens = {"img_64": 16, "img_64x96": 24, "vid_64_9f": 48, "vid_64x96_17f": 120}
        s = resolve_schedule(cfg.scheduling, tokens, ModelShape(10_000, cfg.model.num_layers, cfg.model.dim,
                                                                cfg.model.text_len), checkpointing="none")
        assert s.strategy == group and min(s.batch_sizes.values()) >= 1 and s.window == 2
        if group != "equal_token":
            assert s.sources["cost"].startswith("calibration:none")


def test_measured_keep_policy_prices_and_bounds_every_micro_batch(tmp_path):
    """With the keep policy measured, auto chooses (k, j) from the three measured policies: the predicted peak stays
    within the budget, one more kept block would not fit (where not all keep), and the cost is the interpolation
    t_none + k/L·(t_full − t_none) − j/L·(t_full − t_keep); checkpointing=full with keep_attention=auto holds k = L."""
    cal = four_block_h200_calibration()
    full_rec = cal.data["modes"]["full"]
    none, keep = json.loads(json.dumps(full_rec)), json.loads(json.dumps(full_rec))
    none["cost_model"]["params"] = {k: v * 0.75 for k, v in none["cost_model"]["params"].items()}
    none["memory_model"]["c1"] *= 4
    keep["cost_model"]["params"] = {k: v * 0.85 for k, v in keep["cost_model"]["params"].items()}
    keep["memory_model"]["c1"] *= 1.5
    cal.data["modes"].update(none=none, keep=keep)
    path = cal.save(str(tmp_path / "three.json"))
    L, budget = WAN13.layers, 60 * 2**30
    mem = {m: MemoryModel.from_dict(cal.data["modes"][m]["memory_model"]) for m in ("none", "full", "keep")}
    cost = {m: CostModel.from_dict(cal.data["modes"][m]["cost_model"]) for m in ("none", "full", "keep")}

    def peak(T, k, j):
        n, f, kp = (float(mem[m].predict(1, T)) for m in ("none", "full", "keep"))
        return n - k / L * (n - f) + j / L * (kp - f)

    s = resolve_schedule(SchedulingConfig("cost", calibration=path, mem_budget_gib=60.0), WAN_TOKENS, WAN13,
                         checkpointing="auto", keep_attention="auto")
    assert "kept attention's memory and time measured" in s.sources["cost"]
    seen = set()
    T0 = mem["none"].m_mem(budget)
    assert s.recompute_blocks(1, T0) == (0, 0) and s.cost_fn(1, T0) == pytest.approx(cost["none"].predict(1, T0))
    for T in np.linspace(T0 + 1, mem["full"].m_mem(budget), 15).astype(int):
        k, j = s.recompute_blocks(1, int(T))
        assert 0 < k <= L and 0 <= j <= k and peak(T, k, j) <= budget * (1 + 1e-9)
        assert j == k or peak(T, k, j + 1) > budget
        if j == k:  # all kept: the fewest recomputed blocks that fit so
            assert peak(T, k - 1, k - 1) > budget
        if k < L:
            seen.add("partial")
        t = (cost["none"].predict(1, T) + k / L * (cost["full"].predict(1, T) - cost["none"].predict(1, T))
             - j / L * (cost["full"].predict(1, T) - cost["keep"].predict(1, T)))
        assert s.cost_fn(1, int(T)) == pytest.approx(float(t), rel=1e-9)
        seen.add("all kept" if j == k else "some kept")
    assert seen == {"all kept", "some kept", "partial"}
    full = resolve_schedule(SchedulingConfig("cost", calibration=path, mem_budget_gib=60.0), WAN_TOKENS, WAN13,
                            checkpointing="full", keep_attention="auto")
    T = int(mem["full"].m_mem(budget) * 0.8)
    k, j = full.recompute_blocks(1, T)
    assert k == L and 0 < j < L and peak(T, L, j) <= budget < peak(T, L, j + 1)
    # keep_attention=true with full: every block keeps, so the keep record bounds and prices every micro-batch
    every = resolve_schedule(SchedulingConfig("cost", calibration=path, mem_budget_gib=60.0), WAN_TOKENS, WAN13,
                             checkpointing="full", keep_attention=True)
    assert every.values["m_mem"] == mem["keep"].m_mem(budget, min(WAN_TOKENS.values()))
    assert every.cost_fn(1, 32760) == pytest.approx(cost["keep"].predict(1, 32760))


def test_keeping_never_pushes_more_blocks_into_recompute_than_it_saves():
    """Where a kept block costs more memory than recomputing one frees, the fewest blocks recompute (as without
    keep) and keep what the memory left holds: not every block recomputed to make room for kept attention."""
    from scheduling.policy import PartialRecompute

    class Flat:  # a memory model of constant bytes
        def __init__(self, v):
            self.v = v

        def predict(self, B, S):
            return self.v

    L = 10
    pr = PartialRecompute(L, 80.0, Flat(100.0), Flat(50.0), Flat(20.0), Flat(30.0), attention_bytes=1.0,
                          keep_mem=Flat(110.0))  # a kept block holds 6 units, recomputing one frees 5
    k, j = pr.decide(1, 1)
    assert (k, j) == (4, 0)  # 100 − 4·5 = 80 fits; nothing left for a kept block


def test_micro_batches_beside_the_cuda_graphs_pool_leave_room_for_it():
    """train.graph_max_tokens: micro-batches up to it replay as CUDA graphs, whose shared pool (the largest
    capture's activations) stays allocated while a larger, eager micro-batch runs. That one's budget is the pool
    smaller; the captured ones keep the whole budget; without graphs, or with no cap (nothing runs beside the pool),
    nothing is reserved. The pool is reserved only for micro-batches the plan holds: the capture limit narrows to
    the largest planned micro-batch within graph_max_tokens, to 0 (no graphs, no pool) where every one is over it.
    The 1.3B's measured three-policy calibration, at its 90 %-of-HBM budget."""
    import os

    from scheduling.policy import PartialRecompute, graph_pool_bytes, resolve_schedule
    from tests.helpers import ROOT

    path, tokens = os.path.join(ROOT, "results", "calibration_h200_policies.json"), dict(WAN_TOKENS)
    kw = dict(checkpointing="auto", keep_attention="auto", world_size=1)
    cfg = SchedulingConfig("equal_token", calibration=path, m_tokens=16000)  # images and short clips under 16,384
    plain = resolve_schedule(cfg, tokens, WAN13, **kw)
    graphs = resolve_schedule(cfg, tokens, WAN13, **kw, graph_tokens=16384)
    planned = {n: graphs.batch_sizes[n] * S for n, S in tokens.items()}
    assert graphs.graph_tokens == max(t for t in planned.values() if t <= 16384) == 15600 < 16384
    assert graphs.values["graph_tokens"] == 15600 and "largest planned" in graphs.sources["graph_tokens"]
    cal = Calibration.load(path)
    none = cal.memory_model("none", 1)
    # the largest capture: no recompute fits, so the pool is none's activations at the largest B·S ≤ the limit
    want = max(float(none.predict(15600 // S, S) - none.predict(0, S)) for S in tokens.values() if S <= 15600)
    assert graphs.values["graph_pool_gib"] * 2**30 == pytest.approx(want, rel=1e-9)
    assert "graph_pool_gib" not in plain.values and 15 < graphs.values["graph_pool_gib"] < 30
    assert graphs.values["m_mem"] < plain.values["m_mem"] and "less the graphs' pool" in graphs.sources["m_mem"]
    bounding = cal.memory_model(cal.mode_name("auto"), 1)  # the mode whose model bounds B·S
    assert graphs.values["m_mem"] == bounding.m_mem(0.9 * cal.hbm_bytes - want, min(tokens.values()))
    # every planned micro-batch over 16,384 tokens (balanced's are): none is captured, nothing is reserved, the
    # schedule is the one without graphs
    bal = SchedulingConfig("balanced", calibration=path)
    off, bal_plain = (resolve_schedule(bal, tokens, WAN13, **kw, graph_tokens=g) for g in (16384, 0))
    assert min(off.batch_sizes[n] * S for n, S in tokens.items()) > 16384
    assert off.graph_tokens == 0 and "graph_pool_gib" not in off.values and "none captured" in off.sources["graph_tokens"]
    assert off.values["m_mem"] == bal_plain.values["m_mem"] and off.batch_sizes == bal_plain.batch_sizes
    assert off.recompute_blocks(1, 75600) == bal_plain.recompute_blocks(1, 75600)
    # a smaller budget, of which the pool takes much: the bound shrinks by it, and every eager micro-batch fits
    # beside the pool even recomputing nothing less than every block
    small = resolve_schedule(SchedulingConfig("equal_token", calibration=path, m_tokens=16000, mem_budget_gib=60.0),
                             tokens, WAN13, **kw, graph_tokens=16384)
    pool = small.values["graph_pool_gib"] * 2**30
    assert small.values["m_mem"] == bounding.m_mem(60 * 2**30 - pool, min(tokens.values()))
    for name, S in tokens.items():
        B = small.batch_sizes[name]
        if B * S > small.graph_tokens:
            assert float(cal.memory_model("full", 1).predict(B, S)) + pool <= 60 * 2**30, name
    # where the pool leaves no room for the longest bucket's one sample: refused, the knob named
    with pytest.raises(ValueError, match="lower train.graph_max_tokens"):
        resolve_schedule(SchedulingConfig("equal_token", calibration=path, m_tokens=16000, mem_budget_gib=40.0),
                         tokens, WAN13, **kw, graph_tokens=16384)
    # balanced at 45 GiB: the pool at the whole limit would leave the longest clip no room, yet no planned
    # micro-batch lies under the limit: planned without graphs; kept at the limit (the simulator's), refused
    bal45 = SchedulingConfig("balanced", calibration=path, mem_budget_gib=45.0)
    fit = resolve_schedule(bal45, tokens, WAN13, **kw, graph_tokens=16384)
    assert fit.graph_tokens == 0 and "graph_pool_gib" not in fit.values and "none captured" in fit.sources["graph_tokens"]
    with pytest.raises(ValueError, match="lower train.graph_max_tokens"):
        resolve_schedule(bal45, tokens, WAN13, **kw, graph_tokens=16384, narrow_graphs=False)
    # a long micro-batch recomputes more beside the pool, a captured one is decided as before
    assert graphs.recompute_blocks(2, 32760)[0] > plain.recompute_blocks(2, 32760)[0]
    assert graphs.recompute_blocks(10, 1560) == plain.recompute_blocks(10, 1560) == (0, 0)
    assert graph_pool_bytes(tokens, 0, none) == 0.0 and graph_pool_bytes(tokens, None, none) == 0.0
    uncapped = resolve_schedule(cfg, tokens, WAN13, **kw, graph_tokens=None)
    assert uncapped.values["m_mem"] == plain.values["m_mem"] and uncapped.graph_tokens is None

    class Line:  # peak = 10 + 2·B·S
        def predict(self, B, S):
            return 10.0 + 2.0 * B * S

    pr = PartialRecompute(4, 100.0, Line(), Line(), None, None, graph_tokens=20, graph_reserve=30.0)
    assert pr.budget_at(4, 5) == 100.0 and pr.budget_at(3, 7) == 70.0
    assert pr.peak(3, 7, 0, 0) == 52.0 and graph_pool_bytes({"a": 5, "b": 7}, 20, Line()) == 40.0  # 2·(4·5)


def test_partial_checks_raise_nones_memory_beyond_where_it_was_measured(tmp_path):
    """A 720p 81-frame clip does not fit without recompute, so none's memory model is extrapolated there; the
    calibration's partial checks (that clip under the recompute the policy chose) measure it. none's peak solved
    from each check by the linear rule gives its activations (above B = 0) over the model's; the largest ratio
    scales none's activations at every S longer than none's longest measured S; never below 1; nothing without
    usable checks. The 1.3B's file holds two checks of 2026-12-02 (train.py's peaks at k = j = 1 and 9), whose
    solved none peaks agree within 1 %."""
    import dataclasses
    import json
    import math
    import os

    from scheduling.policy import _partial_recompute, none_measured_S, partial_check_scale
    from tests.helpers import ROOT

    path = os.path.join(ROOT, "results", "calibration_h200_policies.json")
    cal = Calibration.load(path)
    args = (SchedulingConfig("equal_token", calibration=path, m_tokens=32760), cal, WAN13, "auto", "auto", 1,
            cal.memory_model("full", 1), cal.cost_model("full"), 1560)
    pr = _partial_recompute(*args)
    assert none_measured_S(cal) == 14040 == pr.none_beyond  # v480_33f: the longest S none's peak was measured at
    solved, fixed = [], float(pr.none_mem.predict(0, 75600))
    for c in cal.data["partial_checks"]:
        full, kept = float(pr.full_mem.predict(1, 75600)), pr.kept_bytes(1, 75600)
        solved.append((c["peak_bytes"] - c["k"] / 30 * full - c["j"] * kept) / (1 - c["k"] / 30))
    assert abs(solved[0] - solved[1]) < 0.01 * solved[0]  # the linear rule holds across k
    model = float(pr.none_mem.predict(1, 75600))
    assert pr.none_scale == pytest.approx((max(solved) - fixed) / (model - fixed), rel=1e-12)
    assert 1.05 < pr.none_scale < 1.09
    # each check's own peak, predicted now within 1 % (the model under-predicted both by 3-6 % before)
    for c in cal.data["partial_checks"]:
        assert pr.peak(1, 75600, c["k"], c["j"]) == pytest.approx(c["peak_bytes"], rel=0.01)
    # at a measured S nothing changes, however many samples; a longer S is raised, however few tokens
    assert pr.none_peak(40, 1560) == float(pr.none_mem.predict(40, 1560))
    assert pr.none_peak(1, 46800) > float(pr.none_mem.predict(1, 46800)) * 1.04
    k, j = pr.decide(1, 75600)
    assert pr.peak(1, 75600, k, j) <= pr.budget < pr.peak(1, 75600, k - 1, k - 1)
    plain = dataclasses.replace(pr, none_scale=1.0, none_beyond=math.inf)
    assert k > plain.decide(1, 75600)[0] and pr.none_tokens <= plain.none_tokens
    for c in cal.data["partial_checks"]:  # the model without its checks: 3-6 % under what was measured
        assert 0.94 < plain.peak(1, 75600, c["k"], c["j"]) / c["peak_bytes"] < 0.97
    assert "none's activations × 1.0" in resolve_schedule(args[0], dict(WAN_TOKENS), WAN13, checkpointing="auto",
                                                          keep_attention="auto", world_size=1).sources["cost"]
    # a check below the model never lowers it; rows that cannot be solved are passed over: out of memory, j > k,
    # every block recomputed (k = L), at a measured S; a file without checks: (1, ∞)
    data = json.loads(open(path).read())
    good = data["partial_checks"][0]
    bad = [dict(good, peak_bytes=0.8 * good["peak_bytes"]), {**good, "fits": False, "peak_bytes": None},
           dict(good, j=good["k"] + 1), dict(good, k=30, j=0), dict(good, S=7800, bucket="v480_17f")]
    for rows in ([bad[0]], bad[1:], []):
        data["partial_checks"] = rows
        (tmp_path / "c.json").write_text(json.dumps(data))
        assert partial_check_scale(Calibration.load(str(tmp_path / "c.json")), pr) == (1.0, math.inf), rows


def test_a_fixed_batch_for_dual_constraint_tunes_m_comp_with_the_power_fits_p_or_keeps_a_configured_one(tmp_path):
    """scheduling.tokens_per_step with dual_constraint: its knob is m_comp (under the calibration's p and m_mem), M is
    chosen so that the expected tokens a step hold g, and each value says where it came from."""
    from scheduling.batching import batch_sizes as rule_sizes
    from scheduling.simulate import tokens_per_step

    path = four_block_h200_calibration().save(str(tmp_path / "cal.json"))
    mix = Mix.of(DEFAULT_MIX)
    tokens, shares, g = dict(zip(mix.names, mix.S)), dict(zip(mix.names, mix.share)), 2 * mix.S_max
    for m_comp in (None, 2e6):
        s = resolve_schedule(SchedulingConfig("dual_constraint", calibration=path, tokens_per_step=g, m_comp=m_comp),
                             tokens, ModelShape(1, 30, 1536, 512), world_size=8, shares=shares)
        v = s.values
        assert v["p"] == Calibration.load(path).cost_model("full", "power").params["p"]
        sizes = rule_sizes("dual_constraint", mix.S, m_mem=v["m_mem"], m_comp=v["m_comp"], p=v["p"])
        assert [s.batch_sizes[n] for n in mix.names] == sizes
        assert v["tokens_per_step"] == round(tokens_per_step(mix, sizes, s.micro_batches), 1)
        assert abs(v["tokens_per_step"] - g) <= 0.1 * g and s.micro_batches == v["micro_batches"] == 2
        assert s.sources["tokens_per_step"] == f"expected for g={g:g}"
        if m_comp is None:
            chosen = "chosen for tokens_per_step (predicted tokens/s)"
            assert s.sources["m_comp"] == s.sources["micro_batches"] == chosen
        else:
            assert v["m_comp"] == 2e6 and s.sources["m_comp"] == "config"
            assert s.sources["micro_batches"] == "M for the configured m_comp"


def test_partial_recompute_peak_counts_kept_attention_and_decide_keeps_what_the_budget_leaves():
    from scheduling.policy import PartialRecompute

    none, full = MemoryModel(0.0, 100.0), MemoryModel(0.0, 90.0)  # bytes a token: 100 without recompute, 90 with
    pr = PartialRecompute(10, 95_000.0, none, full, None, None, attention_bytes=0.9995)
    assert pr.peak(1, 1000, 10, 4) == pytest.approx(90_000 + 4 * 999.5)  # kept attention on 4 of the 10 blocks
    assert pr.peak(1, 1000, 5, 0) == pytest.approx(95_000)
    # recomputing a block frees 1000 bytes, keeping its attention costs 999.5: a net 0.5 a block cannot reach the
    # budget before L, so every block recomputes and keeps what the 5000 bytes left hold
    assert pr.decide(1, 1000) == (10, 5)
    assert PartialRecompute(10, 95_000.0, none, full, None, None).decide(1, 1000) == (5, 0)  # no keeping: 5 blocks
    # all blocks recompute (checkpointing=full): keeping costs nothing where keep's memory is full's, so all keep
    free = PartialRecompute(10, 95_000.0, none, full, None, None, attention_bytes=1.0, keep_mem=full, all_blocks=True)
    assert free.kept_bytes(1, 1000) == 0.0 and free.decide(1, 1000) == (10, 10)


def test_a_fixed_batch_needs_a_cost_and_a_memory_model_and_takes_a_choice_tuned_without_a_window(tmp_path):
    from scheduling.policy import fixed_batch

    mix = Mix.of(DEFAULT_MIX)
    tokens, shares, g = dict(zip(mix.names, mix.S)), dict(zip(mix.names, mix.share)), 2 * mix.S_max
    cfg = SchedulingConfig("cost", tokens_per_step=g)
    with pytest.raises(ValueError, match="needs scheduling.calibration"):
        fixed_batch(cfg, tokens, shares, CostModel("quadratic", {"a": 15.7, "b1": 0.0238, "b2": 1.44e-6}).predict,
                    None, None, 8, None, {}, {}, [])
    cal = four_block_h200_calibration()
    path = cal.save(str(tmp_path / "cal.json"))
    shape = ModelShape(1, 30, 1536, 512)
    first = resolve_schedule(SchedulingConfig("cost", calibration=path, tokens_per_step=g), tokens, shape,
                             world_size=8, shares=shares)
    assert first.sources["micro_batches"] == "chosen for tokens_per_step (predicted tokens/s)"
    target = first.values["target_microbatch_ms"] * 1.001  # the same batch table, but the file's own value
    cal.data["chosen"] = {"by_tokens_per_step": {"8": {str(g): {"cost": {
        "target_microbatch_ms": target, "micro_batches": first.micro_batches, "window": 1}}}}}
    path = cal.save(str(tmp_path / "chosen.json"))
    s = resolve_schedule(SchedulingConfig("cost", calibration=path, tokens_per_step=g), tokens, shape, world_size=8,
                         shares=shares)
    assert s.sources["micro_batches"] == f"calibration:chosen (simulated at R=8, g={g:,.0f})"
    assert s.values["target_microbatch_ms"] == target and s.micro_batches == first.micro_batches

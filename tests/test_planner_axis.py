"""The planner as an axis of its own (scheduling.planner = stream | sorted | windowed | reformed) under every batch
rule."""
import numpy as np
import pytest

from scheduling.batching import STRATEGIES, batch_sizes
from scheduling.config import SchedulingConfig
from scheduling.cost_model import CostModel
from scheduling.planner import _layout, advance, default_planner, plan_step
from scheduling.policy import ModelShape, resolve_schedule
from scheduling.simulate import DEFAULT_MIX, Mix

QUAD = CostModel("quadratic", {"a": 15.7, "b1": 0.0238, "b2": 1.44e-6})
MIX = Mix.of(DEFAULT_MIX)
TOKENS = {n: S for n, S, _ in DEFAULT_MIX}
WAN13 = ModelShape(p_matmul=1_250_623_488, layers=30, dim=1536, text_len=512)
# each rule's own batch table on the default mix (cost and balanced share the cost rule)
SIZES = {"equal_token": batch_sizes("equal_token", MIX.S, m_tokens=MIX.S_max),
         "dual_constraint": batch_sizes("dual_constraint", MIX.S, m_mem=4e5, m_comp=MIX.S_max ** 1.3, p=1.3),
         "cost": batch_sizes("cost", MIX.S, m_mem=4e5, cost_model=QUAD, target_ms=QUAD.predict(1, MIX.S_max))}
SIZES["balanced"] = SIZES["cost"]
PLANNERS = [("stream", 1), ("sorted", 1), ("windowed", 3)]
M_MEM = 4e5  # the memory bound the tables above keep, which planner=reformed re-forms within


def epoch(samples, rule, planner, window, R=4, M=2, start=0, stop_after=None, m_mem=None):
    pos, plans = start, []
    while True:
        plan, nxt = plan_step(samples, 5, 0, pos, R, rule, M, SIZES[rule], QUAD.predict, window=window,
                              planner=planner, m_mem=m_mem)
        plans.append(plan)
        e, pos = advance(0, nxt, samples)
        if e != 0 or (stop_after and len(plans) == stop_after):
            return plans


def real_ids(plans):
    return [i for p in plans for r in p.ranks for mb in r for i, w in zip(mb.ids, mb.weights) if w > 0]


@pytest.mark.parametrize("rule", STRATEGIES)
@pytest.mark.parametrize("planner, window", PLANNERS)
def test_every_rule_under_every_planner_covers_each_entry_once_with_equal_slots(rule, planner, window):
    samples = MIX.table(900, 1)
    plans = epoch(samples, rule, planner, window, R=5, M=3)
    assert sorted(real_ids(plans)) == sorted(samples.ids.tolist())  # every entry once, none twice
    for p in plans:
        assert len({len(r) for r in p.ranks}) == 1  # every rank the same slot count: no hang
        assert all(mb.B <= SIZES[rule][mb.bucket] for r in p.ranks for mb in r)  # the rule's table, untouched
    assert all(p.num_slots == 3 for p in plans[:-window])  # only the epoch's end may be short


@pytest.mark.parametrize("rule", STRATEGIES)
def test_stream_is_micro_batch_j_to_rank_j_mod_R_in_layout_order(rule):
    """stream: the step's micro-batches, in the epoch layout's order, go to rank j mod R, slot ⌊j / R⌋; and it is
    what equal_token, dual_constraint and cost ran before the planner was a knob (their default)."""
    samples, R, M = MIX.table(700, 2), 3, 2
    plans = epoch(samples, rule, "stream", 1, R=R, M=M)
    lay = _layout(samples, 5, 0, tuple(SIZES[rule]))
    j = 0
    for p in plans:
        for k in range(p.num_slots):
            for r in range(R):
                mb = p.ranks[r][k]
                if j < len(lay) and lay.starts[j] < p.next_pos:
                    want = samples.ids[lay.entries[lay.starts[j]:lay.starts[j + 1]]].tolist()
                    assert list(mb.ids) == want and mb.num_real == mb.B
                    j += 1
                else:
                    assert mb.num_real == 0  # the epoch's last step: padding after the last micro-batch
    assert j == len(lay)
    if rule != "balanced":
        assert epoch(samples, rule, None, 1, R=R, M=M) == plans
        assert epoch(samples, rule, None, 3, R=R, M=M) == plans  # a window is ignored by the default planner


@pytest.mark.parametrize("rule", STRATEGIES)
def test_sorted_cuts_each_step_into_descending_groups_of_R(rule):
    """sorted: slot k holds the k-th R costliest micro-batches of the step, so every real micro-batch of slot k
    costs at least as much as every one of slot k + 1."""
    samples, R, M = MIX.table(2000, 3), 4, 4
    checked = 0
    for p in epoch(samples, rule, "sorted", 1, R=R, M=M, stop_after=8):
        pred, real = p.pred_ms(), p.real()
        for k in range(p.num_slots - 1):
            here, nxt = pred[real[:, k], k], pred[real[:, k + 1], k + 1]
            if len(here) and len(nxt):
                assert here.min() >= nxt.max()
                checked += 1
    assert checked >= 20


def test_default_planner_is_what_each_rule_ran_before():
    assert [default_planner(s) for s in STRATEGIES] == ["stream", "stream", "stream", "sorted"]
    assert default_planner("balanced", 4) == "windowed" and default_planner("cost", 4) == "stream"
    samples = MIX.table(600, 4)
    assert epoch(samples, "balanced", None, 1, stop_after=4) == epoch(samples, "balanced", "sorted", 1, stop_after=4)
    assert epoch(samples, "balanced", None, 3, stop_after=4) == epoch(samples, "balanced", "windowed", 3,
                                                                      stop_after=4)
    # a planner is only a planner: cost and balanced share a rule, so their plans under one planner are one plan
    assert epoch(samples, "cost", "windowed", 3, stop_after=6) == epoch(samples, "balanced", None, 3, stop_after=6)


@pytest.mark.parametrize("kw, words", [
    ({"planner": "windowed"}, "scheduling.planner=windowed .* needs window ≥ 2"),
    ({"planner": "sorted", "window": 4}, "scheduling.planner=sorted plans one step .* scheduling.window=4"),
    ({"planner": "stream", "window": 2}, "scheduling.planner=stream"),
    ({"planner": "lpt"}, "scheduling.planner must be one of"),
])
def test_config_refuses_a_planner_that_does_not_match_its_window(kw, words):
    with pytest.raises(ValueError, match=words):
        SchedulingConfig("dual_constraint", **kw)


def test_plan_step_refuses_an_unknown_planner_or_a_window_of_one_step():
    for planner, window in (("lpt", 1), ("windowed", 1)):
        with pytest.raises(ValueError, match="scheduling.planner"):
            plan_step(MIX.table(100), 0, 0, 0, 2, "cost", 1, SIZES["cost"], QUAD.predict, window=window,
                      planner=planner)


def test_policy_resolves_the_planner_and_says_where_it_came_from():
    def sched(strategy, **kw):
        return resolve_schedule(SchedulingConfig(strategy, m_tokens=75600, m_mem=4e5, m_comp=75600 ** 1.3, p=1.3,
                                                 **kw), TOKENS, WAN13)

    assert (sched("equal_token").planner, sched("dual_constraint").planner) == ("stream", "stream")
    s = sched("dual_constraint", planner="windowed", window=4)
    assert (s.planner, s.window, s.sources["planner"]) == ("windowed", 4, "config") and not s.notes
    s = sched("equal_token", planner="sorted")
    assert (s.planner, s.window) == ("sorted", 1)
    s = sched("equal_token", window=3)  # the default planner ignores a window, and the notes say how to use it
    assert s.planner == "stream" and s.sources["planner"] == "default for equal_token"
    assert any("scheduling.planner=windowed" in n for n in s.notes)


def test_resume_treats_the_planner_like_the_window():
    """A changed planner changes the plan at the stored position: refused on resume like scheduling.window; a
    checkpoint written before the knob existed compares equal at its default (null)."""
    from training.resume import changes_plan, config_changes, typed_plain

    assert changes_plan("scheduling.planner") and changes_plan("scheduling.window")
    plan, other = config_changes({"scheduling": {"planner": None, "window": 1}},
                                 {"scheduling": {"planner": "windowed", "window": 4}})
    assert set(plan) == {"scheduling.planner", "scheduling.window"} and not other
    from tests.helpers import compose_raw

    raw = compose_raw([])
    old = {**raw, "scheduling": {k: v for k, v in raw["scheduling"].items() if k != "planner"}}
    assert config_changes(typed_plain(old), typed_plain(raw)) == ({}, {})


@pytest.mark.parametrize("group", STRATEGIES)
def test_every_conf_group_composes_with_every_planner(group, monkeypatch):
    from tests.helpers import ROOT, compose_config

    monkeypatch.chdir(ROOT)
    tokens = {"img_64": 16, "img_64x96": 24, "vid_64_9f": 48, "vid_64x96_17f": 120}
    for planner, window in PLANNERS:
        cfg = compose_config([f"scheduling={group}", f"scheduling.planner={planner}", f"scheduling.window={window}"])
        s = resolve_schedule(cfg.scheduling, tokens, ModelShape(10_000, cfg.model.num_layers, cfg.model.dim,
                                                                cfg.model.text_len), checkpointing="none")
        assert (s.strategy, s.planner, s.window) == (group, planner, window)
    assert compose_config([f"scheduling={group}"]).scheduling.planner is None  # the rule's default


# ------------------------------------------------------------------------------- the loss's denominator
@pytest.mark.parametrize("rule", ["dual_constraint", "cost"])
@pytest.mark.parametrize("W", [2, 4])
def test_every_sample_of_a_window_weighs_the_same_whichever_step_it_lands_in(rule, W):
    """A sample's gradient weight is world_size / loss_norm on its rank, averaged over R ranks: 1 / loss_norm.
    Windowed: loss_norm is the window's real samples ÷ W in every step of it, though the steps' own counts differ
    (so dividing by each step's own count would weigh the samples of small steps more), and the window's samples
    together weigh W, as W steps of the mean count would."""
    samples, R, M = MIX.table(3000, 6), 4, 2
    plans = epoch(samples, rule, "windowed", W, R=R, M=M)
    full = [plans[i:i + W] for i in range(0, len(plans) - W + 1, W)]  # windows tile the epoch from its start
    assert sum(len(w) for w in full) >= len(plans) - W
    uneven = 0
    for win in full:
        counts = [p.num_samples for p in win]
        weights = {1.0 / p.loss_norm for p in win}
        assert len(weights) == 1 and weights.pop() == pytest.approx(W / sum(counts))
        assert sum(p.num_samples / p.loss_norm for p in win) == pytest.approx(W)
        uneven += len(set(counts)) > 1
    assert uneven >= len(full) // 2  # the steps of a window do hold different counts: the rule has work to do


@pytest.mark.parametrize("planner", ["stream", "sorted"])
def test_a_one_step_planner_divides_by_its_own_count_as_before(planner):
    samples = MIX.table(1500, 7)
    for rule in STRATEGIES:
        for p in epoch(samples, rule, planner, 1, R=3, M=2):
            assert p.window_norm is None and p.loss_norm == p.num_samples and type(p.loss_norm) is int


def test_the_matrix_splits_the_gain_between_planner_and_rule_on_hand_numbers():
    """matrix_shares on a hand-made matrix (tokens/s): the paper's system is dual_constraint × stream (100); the
    best cell cost × W=8 (150) is 1.5× it; the rule alone in stream order (cost, 110) 1.1×; the planner alone on the
    paper's rule (W=8, 140) 1.4×; on the best rule the planner gives 150/110, under the best planner the rule 150/140."""
    from types import SimpleNamespace

    from scheduling.protocol import matrix_shares

    tps = {("equal_token", "stream"): 90, ("equal_token", "sorted"): 120, ("equal_token", "W=8"): 130,
           ("dual_constraint", "stream"): 100, ("dual_constraint", "sorted"): 125, ("dual_constraint", "W=8"): 140,
           ("cost", "stream"): 110, ("cost", "sorted"): 130, ("cost", "W=8"): 150}
    m = {(8, 2.0, rule, col): SimpleNamespace(tokens_per_s=float(v)) for (rule, col), v in tps.items()}
    m[(64, 2.0, "cost", "stream")] = SimpleNamespace(tokens_per_s=1e9)  # another R: not read
    sh = matrix_shares(m, 8, 2.0)
    assert sh["best"] == ("cost", "W=8") and sh["total"] == pytest.approx(1.5)
    assert sh["best_stream_rule"] == "cost" and sh["rule_in_stream"] == pytest.approx(1.1)
    assert sh["paper_rule_best_planner"] == "W=8" and sh["planner_on_paper_rule"] == pytest.approx(1.4)
    assert sh["planner_on_best_rule"] == pytest.approx(150 / 110)
    assert sh["rule_under_best_planner"] == pytest.approx(150 / 140)


# ------------------------------------------------------------------------------- reformed: stream's samples, re-formed
def step_ms(plan) -> float:
    """Predicted step time: Σ over slots of the slowest rank (padding included)."""
    return float(plan.pred_ms().max(axis=0).sum())


@pytest.mark.parametrize("rule", STRATEGIES)
def test_reformed_plans_streams_samples_in_one_bucket_micro_batches_within_m_mem(rule):
    """Step by step over an epoch, reformed holds exactly stream's multiset of sample ids at the same (pos,
    next_pos), so it trains stream's objective (weights 1, loss_norm the step's count); every micro-batch holds one
    bucket with B·S ≤ m_mem and every rank the same number of slots; it is never predicted slower than stream or
    sorted, and over the epoch re-forming beats sorted by more than 1 % (by 11 % on equal_token's table, 1.7 % on
    cost's, whose micro-batches already cost alike), with B outside the batch table."""
    samples, R, M, m_mem = MIX.table(1500, 8), 4, 3, M_MEM  # the bound the tables keep
    bucket_of = dict(zip(samples.ids.tolist(), samples.bucket.tolist()))
    S_of = dict(zip(samples.ids.tolist(), samples.S.tolist()))
    stream = epoch(samples, rule, "stream", 1, R=R, M=M)
    reformed = epoch(samples, rule, "reformed", 1, R=R, M=M, m_mem=m_mem)
    assert len(reformed) == len(stream) > 10
    total, off_table = {"sorted": 0.0, "reformed": 0.0}, 0
    for a, b in zip(stream, reformed):
        assert (b.epoch, b.pos, b.next_pos) == (a.epoch, a.pos, a.next_pos)
        assert sorted(real_ids([b])) == sorted(real_ids([a]))
        assert b.num_samples == a.num_samples and b.loss_norm == a.loss_norm and b.window_norm is None
        assert len({len(r) for r in b.ranks}) == 1
        for mb in (mb for r in b.ranks for mb in r):
            assert {bucket_of[i] for i in mb.ids} == {mb.bucket} and {S_of[i] for i in mb.ids} == {mb.S}
            assert mb.B * mb.S <= m_mem and mb.pred_ms == QUAD.predict(mb.B, mb.S)
            assert set(mb.weights) == ({1.0} if mb.num_real else {0.0})
            off_table += mb.num_real > 0 and mb.B != SIZES[rule][mb.bucket]
        sorted_ms = step_ms(plan_step(samples, 5, 0, a.pos, R, rule, M, SIZES[rule], QUAD.predict,
                                      planner="sorted")[0])
        assert step_ms(b) <= sorted_ms + 1e-9 <= step_ms(a) + 2e-9
        total["sorted"] += sorted_ms
        total["reformed"] += step_ms(b)
    assert total["reformed"] < 0.99 * total["sorted"] and off_table > 0


def test_reformed_beats_sorted_where_sorted_is_optimal_for_the_tables_micro_batches():
    """One step of one long sample (S = 1000) and eight short ones (S = 100) on 2 ranks, t = 1 + B·S / 100 ms, the
    table at B = 1. For the table's nine micro-batches sorted is the least Σ_k max_r of any placement (the slot
    optimum Σ_j c_(jR+1) = 11 + 2 + 2 + 2 + 2 = 19 ms, one padding of 2 ms beside the last). Re-formed within
    m_mem = 400 (short B ≤ 4): {long, 4 short} then {2 short, 2 short}: 11 + 3 = 14 ms, the same nine samples."""
    from scheduling.planner import SampleTable

    table = SampleTable(np.arange(9, dtype=np.int64), np.array([1] + [0] * 8, dtype=np.int32),
                        np.array([1000] + [100] * 8, dtype=np.int64))
    t = lambda B, S: 1.0 + B * S / 100  # noqa: E731
    kw = dict(window=1, m_mem=400)
    so, nxt_s = plan_step(table, 0, 0, 0, 2, "equal_token", 5, [1, 1], t, planner="sorted", **kw)
    re, nxt_r = plan_step(table, 0, 0, 0, 2, "equal_token", 5, [1, 1], t, planner="reformed", **kw)
    assert nxt_s == nxt_r == 9 and sorted(real_ids([re])) == list(range(9))
    assert step_ms(so) == 19.0 and step_ms(re) == 14.0 and re.num_slots == 2
    assert sorted(mb.B for r in re.ranks for mb in r) == [1, 2, 2, 4]


def test_reformed_needs_the_memory_bound_and_one_step():
    with pytest.raises(ValueError, match="scheduling.m_mem"):
        plan_step(MIX.table(100), 0, 0, 0, 2, "cost", 1, SIZES["cost"], QUAD.predict, planner="reformed")
    with pytest.raises(ValueError, match="scheduling.m_mem"):  # equal_token without a calibration knows no m_mem
        resolve_schedule(SchedulingConfig("equal_token", m_tokens=75600, planner="reformed"), TOKENS, WAN13)
    s = resolve_schedule(SchedulingConfig("equal_token", m_tokens=75600, m_mem=2e5, planner="reformed"), TOKENS,
                         WAN13)
    assert (s.planner, s.m_mem, s.sources["planner"]) == ("reformed", 2e5, "config")
    with pytest.raises(ValueError, match="scheduling.planner=reformed plans one step"):
        SchedulingConfig("dual_constraint", planner="reformed", window=2)


@pytest.mark.parametrize("rule", STRATEGIES)
def test_the_simulator_runs_reformed_under_every_rule_on_streams_tokens(rule):
    """simulate(planner=reformed) under the model truth without noise (each micro-batch takes its prediction):
    the same tokens a step as stream, and tokens/s at least sorted's, which is at least stream's."""
    from scheduling.simulate import simulate

    runs = {p: simulate(QUAD.predict, MIX, rule, SIZES[rule], 4, 3, steps=12, seed=2, planner=p, m_mem=M_MEM)
            for p in ("stream", "sorted", "reformed")}
    assert runs["reformed"].planner == "reformed" and runs["reformed"].window == 1
    assert runs["reformed"].tokens_step_cv == pytest.approx(runs["stream"].tokens_step_cv)
    tps = {p: r.tokens_per_s for p, r in runs.items()}
    assert tps["stream"] <= tps["sorted"] * (1 + 1e-12) and tps["sorted"] < tps["reformed"]

"""The planner's contract (docs/contracts.md §3) for the strategies the spine uses."""
import numpy as np
import pytest

from scheduling.planner import SampleTable, advance, plan_step

S_OF = np.array([16, 24, 48, 120])


def table(n=203, seed=0):
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 4, n).astype(np.int32)
    return SampleTable(np.arange(n, dtype=np.int64) * 10, b, S_OF[b])


def epoch_plans(samples, world, M, sizes, strategy="equal_token", epoch=0, start=0):
    pos, plans = start, []
    while True:
        plan, nxt = plan_step(samples, 7, epoch, pos, world, strategy, M, sizes, lambda B, S: B * S * S)
        plans.append(plan)
        e, pos = advance(epoch, nxt, samples)
        if e != epoch:
            return plans


@pytest.mark.parametrize("world, M", [(1, 1), (2, 3), (3, 2), (8, 4)])
def test_every_entry_once_per_epoch_and_equal_slots(world, M):
    samples = table()
    sizes = [15, 10, 5, 2]
    seen = []
    for plan in epoch_plans(samples, world, M, sizes):
        assert len({len(r) for r in plan.ranks}) == 1 and plan.num_slots <= M  # same slot count on every rank
        for rank in plan.ranks:
            for mb in rank:
                assert mb.B <= sizes[mb.bucket] and mb.S == S_OF[mb.bucket]
                assert all(samples.bucket[i // 10] == mb.bucket for i in mb.ids)  # one bucket per micro-batch
                seen += [i for i, w in zip(mb.ids, mb.weights) if w > 0]
        assert plan.num_samples == sum(mb.num_real for r in plan.ranks for mb in r)
    assert sorted(seen) == sorted(samples.ids.tolist())


def test_plans_are_a_pure_function_of_position():
    samples = table()
    a, _ = plan_step(samples, 7, 3, 0, 4, "equal_token", 2, [15, 10, 5, 2], lambda B, S: B * S)
    b, _ = plan_step(table(), 7, 3, 0, 4, "equal_token", 2, [15, 10, 5, 2], lambda B, S: B * S)
    assert a == b  # a fresh table (another rank's process) gives the same plan
    c, _ = plan_step(samples, 7, 4, 0, 4, "equal_token", 2, [15, 10, 5, 2], lambda B, S: B * S)
    assert a != c  # the epoch reshuffles


def test_resume_on_another_world_size_neither_repeats_nor_skips():
    samples = table()
    sizes = [15, 10, 5, 2]
    first = epoch_plans(samples, 4, 2, sizes)[:3]
    pos = first[-1].next_pos
    rest = epoch_plans(samples, 3, 2, sizes, start=pos)  # resumed on 3 ranks
    ids = [i for p in first + rest for r in p.ranks for mb in r for i, w in zip(mb.ids, mb.weights) if w > 0]
    assert sorted(ids) == sorted(samples.ids.tolist())


def test_padding_slots_have_zero_weight_and_the_cheapest_bucket():
    samples = table(n=30)
    plans = epoch_plans(samples, 8, 4, [15, 10, 5, 2])
    pads = [mb for p in plans for r in p.ranks for mb in r if mb.num_real == 0]
    assert pads and all(mb.weights == (0.0,) and mb.S == 16 for mb in pads)
    for plan in plans:  # real(): the (rank, slot) holds real samples; padding is idle work
        assert plan.real().tolist() == [[mb.weights != (0.0,) for mb in r] for r in plan.ranks]
    assert sum((~p.real()).sum() for p in plans) == len(pads)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="scheduling.strategy"):
        plan_step(table(), 0, 0, 0, 1, "fast", 1, [1, 1, 1, 1], lambda B, S: 1.0)
    with pytest.raises(ValueError, match="outside the epoch"):
        plan_step(table(), 0, 0, 10**6, 1, "equal_token", 1, [1, 1, 1, 1], lambda B, S: 1.0)


def test_every_strategy_refuses_a_calibrated_memory_bound_below_the_longest_bucket(tmp_path):
    """Refused before any batch size is chosen, with what frees room for this run: here the calibration's full
    record sets the bound (one process: no ranks to add), so no advice to turn on recompute; a bound the config
    sets is to be raised there."""
    import json

    from scheduling.config import SchedulingConfig
    from scheduling.policy import ModelShape, resolve_schedule

    with open("results/calibration_h200.json") as f:
        cal = json.load(f)
    cal["chosen"]["m_mem"] = 40000  # the simulator's bound, below a 720p 81-frame clip (S 75600)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(cal))
    tokens = {"i480": 1560, "v480_81f": 32760, "v720_81f": 75600}
    for strategy, checkpointing in (("equal_token", "full"), ("balanced", "full"), ("dual_constraint", None)):
        with pytest.raises(ValueError, match=r"scheduling\.m_mem \(calibration:chosen\)=40000 tokens is below a "
                                             r"bucket's S=75600") as e:
            resolve_schedule(SchedulingConfig(strategy, m_tokens=32760, calibration=str(path)), tokens,
                             ModelShape(1, 30, 1536, 512), checkpointing=checkpointing)
        assert "turn on model.checkpointing" not in str(e.value) and "shard over more ranks" not in str(e.value)
        assert "drop the bucket" in str(e.value)
    with pytest.raises(ValueError, match=r"scheduling\.m_mem \(config\)=40000 .*; raise scheduling\.m_mem if"):
        resolve_schedule(SchedulingConfig("balanced", m_mem=40000, calibration=str(path)), tokens,
                         ModelShape(1, 30, 1536, 512), checkpointing="full")


def test_micro_batches_of_equal_predicted_cost_share_slots_in_id_order():
    """The sorted planner's groups are costliest first and, among equal costs, in entry order (a stable sort), so a
    plan does not depend on the sort's tie-breaking."""
    from scheduling.planner import _sorted_groups

    pred = [1.0, 2.0] * 8
    groups = _sorted_groups(pred, 4, 4)
    assert groups.tolist() == [[1, 3, 5, 7], [9, 11, 13, 15], [0, 2, 4, 6], [8, 10, 12, 14]]
    assert _sorted_groups([3.0, 1.0, 2.0], 2, 2).tolist() == [[0, 2], [1, -1]]  # padded with −1

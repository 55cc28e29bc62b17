"""scheduling/protocol.py's list of a cell's micro-batches and the choice of what to measure next, on a hand case:
the shares of micro-batch time (measured and interpolated means), the fewest unmeasured points that reach a target
(the largest share first, which an order by count or by time per micro-batch would not give), and the device time
of timing them."""
from types import SimpleNamespace

import pytest

from scheduling.planner import MicroBatch
from scheduling.protocol import SCAN_POINT_OVERHEAD_S, cell_points, points_to_measure, scan_time_s, share_measured
from scheduling.truth import Cluster, MeasuredTruth

NAMES = ("a", "b")
S_OF = (100, 400)
# measured: a at B = 1 and 4 (10 and 40 ms: the line 10·B between them), b at B = 1 (50 ms: ∝ B beyond it)
TRUTH = MeasuredTruth({(100, 1): [10.0], (100, 4): [40.0], (400, 1): [50.0]})


def _mb(bucket: int, B: int) -> MicroBatch:
    return MicroBatch(bucket, tuple(range(B)), (1.0,) * B, S_OF[bucket], 0.0)


def _plans():
    """Two steps of 2 ranks × 2 slots and one of 1 × 1. Per (bucket, B): count × truth ms = time —
    a1 2 × 10 = 20, a2 3 × 20 = 60 (interpolated), a3 1 × 30 = 30 (interpolated), a4 1 × 40 = 40,
    b1 1 × 50 = 50, b2 1 × 100 = 100 (interpolated); 300 ms in all, 110 of them measured."""
    return [SimpleNamespace(ranks=((_mb(0, 1), _mb(0, 2)), (_mb(0, 2), _mb(1, 2)))),
            SimpleNamespace(ranks=((_mb(0, 1), _mb(0, 3)), (_mb(0, 2), _mb(1, 1)))),
            SimpleNamespace(ranks=((_mb(0, 4),),))]


def test_cell_points_counts_prices_and_shares_every_distinct_micro_batch():
    plans = _plans()
    pts = cell_points(plans, TRUTH, NAMES)
    got = [(p.name, p.count, round(p.ms, 6), round(p.share, 6), p.measured) for p in pts]
    assert got == [("b:2", 1, 100.0, round(100 / 300, 6), False), ("a:2", 3, 20.0, round(60 / 300, 6), False),
                   ("b:1", 1, 50.0, round(50 / 300, 6), True), ("a:4", 1, 40.0, round(40 / 300, 6), True),
                   ("a:3", 1, 30.0, round(30 / 300, 6), False), ("a:1", 2, 10.0, round(20 / 300, 6), True)]
    assert share_measured(pts) == pytest.approx(110 / 300)
    assert share_measured(pts) == pytest.approx(Cluster(TRUTH).measured_share(plans))  # the simulator's count
    assert share_measured(pts, [pts[0]]) == pytest.approx(210 / 300)


def test_the_fewest_points_to_measure_take_the_largest_shares_first():
    pts = cell_points(_plans(), TRUTH, NAMES)
    # 36.7 % measured. To 85 %: b2 (33.3 %) and a2 (20 %) give 90 %; by count (a2, then a3) or by ms a micro-batch
    # (b2, then a3) the first two reach only 66.7 % or 80 %, and a third point is needed
    assert [p.name for p in points_to_measure(pts, 0.85)] == ["b:2", "a:2"]
    assert [p.name for p in points_to_measure(pts, 0.90)] == ["b:2", "a:2"]  # exactly at the target is enough
    assert [p.name for p in points_to_measure(pts, 0.91)] == ["b:2", "a:2", "a:3"]
    assert points_to_measure(pts, 0.30) == []  # already above it
    with pytest.raises(ValueError, match="target"):
        points_to_measure(pts, 1.5)


def test_scan_time_is_the_runs_at_the_slice_depth_plus_the_benchmarks_own_work_a_point():
    pts = cell_points(_plans(), TRUTH, NAMES)
    chosen = [p for p in pts if p.name in ("b:2", "a:2")]
    cost = lambda B, S: 10.0 * B * S  # noqa: E731  full-depth ms: b2 8,000, a2 2,000
    # 4 runs × (8 + 2) s × 4 / 40 blocks = 4 s, plus the overhead of two points
    assert scan_time_s(chosen, cost, 4, 40, runs=4) == pytest.approx(4.0 + 2 * SCAN_POINT_OVERHEAD_S)
    assert scan_time_s(chosen, cost, 2, 40, runs=4) == pytest.approx(2.0 + 2 * SCAN_POINT_OVERHEAD_S)

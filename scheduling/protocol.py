"""The strategy comparisons scripts/simulate_cluster.py runs, and the settings they record for training.

Fixed global batch (the protocol practitioners run): the optimizer's settings are tuned for a global batch, so
every strategy is held to the same real tokens per rank per optimizer step, g = G_FACTORS · S_max, and
best-tuned inside it over its knob and M (balanced also over scheduling.window), under the memory bound of the R
simulated (m_mem from the memory model at 90 % of HBM; an FSDP model's sharded states ÷ R). Two readings of "held":
    steady     every step a batch of about g: expected tokens within ±10 % and their CV over steps ≤ 10 %
    expected   the expectation alone (±10 %), balanced without a window (a window deals sorted groups to steps:
               with few slots a step it trades the batch's steadiness for balance, which this reading cannot see)
The planner predicts with the calibration's cost model; each micro-batch takes what the cluster's truth says
(scheduling/truth.py: measured times, FSDP's collectives, optionally a slow rank). Reported: tokens/s, idle, CV,
and balanced ÷ dual_constraint (the paper), ÷ cost (the same batch table without sorting: what sorting gains),
÷ equal_token — beside the same selection under the old model truth, for comparison.

The matrix (`run_matrix`): batch rule and planner as separate axes. Each batch rule (rows; balanced's rule is
cost's) under each planner (columns: stream, sorted, windowed W ∈ {2, 4, 8}), every cell best-tuned over the rule's
knob and M inside the same g (steady reading) and memory bound. The paper's system is dual_constraint in stream
order; `matrix_shares` splits the best cell's gain over it into the planner's part and the batch rule's.

Which (S, B) a cell runs (`cell_points`, on `cell_plans`: the plans of a cell's final run): every distinct
micro-batch with its share of the cell's micro-batch time and whether the truth measured it; `points_to_measure`
picks the fewest unmeasured ones that bring the measured share to a target, `scan_time_s` what timing them costs.

Unconstrained (the earlier protocol, kept for comparison): M = 4 and each knob swept without a batch constraint
(`run_unconstrained`); every cost-aware strategy then grows its micro-batches to the memory bound and they
equalise (results/simulation_notes.md).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

from scheduling.calibrate import HBM_FRACTION, Calibration
from scheduling.fsdp_memory import FSDPMemoryModel
from scheduling.planner import resolve_planner
from scheduling.simulate import (G_FACTORS, KNOB, TOKENS_CV, Mix, SimResult, plan_run, run_steps, simulate, sizes_for,
                                 sweep, sweep_at_tokens)
from scheduling.step_bound import run_bounds
from scheduling.truth import Cluster, CommModel, MeasuredTruth, ModelTruth, PolicyTruth

STRATEGIES = ("equal_token", "dual_constraint", "cost", "balanced")
WINDOWS = (1, 2, 4, 8)  # balanced's scheduling.window, tuned with its knob and M


@dataclass
class Inputs:
    """What a comparison stands on: the planner's cost model, the memory bound, the power fit's p, the optimizer's
    ms, and the truth a simulated micro-batch takes. m_mem is the bound at the calibration's own world size;
    m_mem_at(R) the one every comparison at R uses (an FSDP memory model's states shrink as 1/R)."""
    cost: object
    m_mem: float
    p: float
    optim_ms: float
    truth: object
    comm: Optional[CommModel] = None
    notes: list = field(default_factory=list)
    m_mem_by_ranks: Optional[Callable[[int], float]] = None  # R → m_mem; None: m_mem whatever R
    by_ranks: Optional[Callable[[int], "Inputs"]] = None  # R → the inputs at R where more than m_mem depends on R

    def m_mem_at(self, R: int) -> float:
        return self.m_mem if self.m_mem_by_ranks is None else self.m_mem_by_ranks(R)

    def at(self, R: int) -> "Inputs":
        """The inputs a comparison at R runs on (checkpointing=auto: one GPU replays CUDA graphs, whose pool
        shrinks the budget of larger micro-batches, and so their cost; several GPUs do not)."""
        return self if self.by_ranks is None else self.by_ranks(R)

    def m_mem_by_world_size(self, ranks: Sequence[int]) -> Optional[dict]:
        """{R: m_mem_at(R)} where the bound depends on R, else None (one m_mem for all)."""
        return None if self.m_mem_by_ranks is None else {int(R): self.m_mem_at(R) for R in ranks}


def m_mem_for(cal: Calibration, mode: str, mix: Mix, world_size: Optional[int] = None) -> Optional[int]:
    """m_mem from the calibration's memory model at 90 % of HBM over world_size ranks (an FSDP model rescaled to
    them; the file's own ranks when None), at the mix's shortest S; None without a memory model or the HBM size.
    Raises where the longest bucket does not fit."""
    memory = cal.memory_model(mode, world_size)
    if memory is None or not cal.hbm_bytes:
        return None
    m_mem = memory.m_mem(HBM_FRACTION * cal.hbm_bytes, min(mix.S))
    if m_mem < mix.S_max:
        on = f" over {world_size} ranks" if world_size else ""
        raise ValueError(f"m_mem={m_mem}{on} at {HBM_FRACTION:.0%} of HBM is below the longest bucket's "
                         f"S={mix.S_max}")
    return m_mem


def inputs_from(cal: Calibration, mode: str, mix: Mix, comm_bandwidth: Optional[float] = None,
                inter_node_bandwidth: float = 50.0, measured_extra: Optional[dict] = None,
                graph_tokens: int = 16384) -> Inputs:
    """The calibration's cost model (the planner's), m_mem from its memory model at 90 % of HBM at each simulated
    world size (or its chosen m_mem on a CPU calibration), and the measured truth of its points (plus a replay's
    micro-batches). mode "auto": model.checkpointing=auto as training runs it (auto_inputs; graph_tokens: the
    CUDA graphs' train.graph_max_tokens on one GPU)."""
    if mode == "auto":
        return auto_inputs(cal, mix, comm_bandwidth, inter_node_bandwidth, graph_tokens)
    cost = cal.cost_model(mode)
    notes = []
    m_mem = m_mem_for(cal, mode, mix)
    by_ranks = None
    if m_mem is not None:
        if isinstance(cal.memory_model(mode), FSDPMemoryModel):
            by_ranks = lambda R: m_mem_for(cal, mode, mix, R)  # noqa: E731
    elif (cal.data.get("chosen") or {}).get("m_mem"):
        m_mem = cal.data["chosen"]["m_mem"]
        notes.append(f"no memory model: m_mem={m_mem} from the calibration's chosen settings")
        if m_mem < mix.S_max:
            raise ValueError(f"the calibration's chosen m_mem={m_mem} is below the longest bucket's S={mix.S_max}")
    else:
        raise ValueError(f"{cal.path}: the protocol needs a memory model and the device memory (m_mem at "
                         f"{HBM_FRACTION:.0%} of HBM), or a chosen m_mem")
    truth = MeasuredTruth.from_points(cal.measured_points(mode), measured_extra)
    return Inputs(cost, m_mem, cal.cost_model(mode, "power").params["p"], cal.optim_ms(mode), truth,
                  _comm(cal, comm_bandwidth, inter_node_bandwidth), notes, by_ranks)


def replay_points(path: str) -> dict:
    with open(path) as f:
        data = json.load(f)
    return {(int(p["S"]), int(p["B"])): list(p["ms_runs"]) for p in data.get("points", [])}


def extra_truth_points(cal: Calibration, mode: str, truth_files, replay) -> dict | None:
    """{(S, B): [ms, ...]} that join the truth: each --truth-points file's measured points (at the full depth, as
    the simulator reads --calibration's; same model required) and a replay's micro-batches."""
    out: dict = {}
    for path in truth_files:
        other = Calibration.load(path)
        model = cal.data.get("model") or {}
        other.check_model(model.get("dim"), model.get("num_layers"), "--truth-points")
        for p in other.measured_points(other.mode_name(mode)):
            out.setdefault((int(p["S"]), int(p["B"])), []).extend(p.get("ms_runs") or [p["ms"]])
    for k, ts in (replay_points(replay) if replay else {}).items():
        out.setdefault(k, []).extend(ts)
    return out or None


def _comm(cal: Calibration, bandwidth: Optional[float], inter_node_bandwidth: float) -> Optional[CommModel]:
    if not bandwidth:
        return None
    params = (cal.data.get("model") or {}).get("params")
    layers = (cal.data.get("model") or {}).get("num_layers") or 1
    if not params:
        raise ValueError(f"{cal.path}: the FSDP model needs the parameter count (model.params in the file)")
    return CommModel(param_bytes=4.0 * params, grad_bytes=4.0 * params, blocks=int(layers), bandwidth=bandwidth,
                     inter_node_bandwidth=inter_node_bandwidth)


class _Priced:
    """A cost function as the protocol's cost model: .predict, .residuals (none: the policy's blend has no fit of
    its own) and .describe()."""

    def __init__(self, predict: Callable[[int, int], float], text: str):
        self.predict, self.residuals, self._text = predict, None, text

    def describe(self) -> str:
        return self._text


def auto_inputs(cal: Calibration, mix: Mix, comm_bandwidth: Optional[float] = None,
                inter_node_bandwidth: float = 50.0, graph_tokens: int = 16384) -> Inputs:
    """model.checkpointing=auto (with keep_attention=auto) as training resolves it (scheduling/policy.py
    resolve_schedule, on the mix's buckets): the planner's cost is PartialRecompute's blend of the measured
    policies, the memory bound full recompute's less the CUDA graphs' pool, and the truth PolicyTruth over the
    policies' measured points with the same per-micro-batch choice. CUDA graphs run on one GPU only
    (training/cuda_graphs.py graphs_for): at R = 1 micro-batches up to graph_tokens are captured and every larger
    one's budget is the pool smaller; at R > 1 none is. The memory model is the calibration's (one GPU's: FSDP's
    sharding over R is not modelled for it)."""
    from scheduling.config import SchedulingConfig
    from scheduling.policy import ModelShape, resolve_schedule

    if not {"none", "full"} <= set(cal.modes):
        raise ValueError(f"{cal.path}: --mode auto needs the policies none and full measured (it holds "
                         f"{cal.modes}): calibrate with model.checkpointing=auto")
    m = cal.data.get("model") or {}
    shape = ModelShape(1, int(m["num_layers"]), int(m["dim"]), int(m["text_len"]))
    tokens = dict(zip(mix.names, mix.S))
    truths = {pol: MeasuredTruth.from_points(cal.measured_points(pol)) for pol in cal.modes}
    comm = _comm(cal, comm_bandwidth, inter_node_bandwidth)
    p = cal.cost_model("full", "power").params["p"]
    memo: dict = {}

    def at(R: int) -> Inputs:
        graphs = graph_tokens if R == 1 else 0
        if graphs not in memo:
            s = resolve_schedule(SchedulingConfig(strategy="balanced", calibration=cal.path), tokens, shape,
                                 checkpointing="auto", world_size=1, keep_attention="auto", graph_tokens=graphs,
                                 narrow_graphs=False)  # the sweep's batch sizes are not balanced's: any capture
            note = (f"R {'= 1' if graphs else '> 1'}: {s.sources['cost']}; m_mem = {s.values['m_mem']:,} "
                    f"({s.sources['m_mem']})")
            memo[graphs] = Inputs(_Priced(s.cost_fn, "checkpointing=auto's blend of the measured policies' "
                                          "quadratic fits (PartialRecompute)"),
                                  float(s.values["m_mem"]), p, cal.optim_ms("full"),
                                  PolicyTruth(truths, s.recompute_blocks, shape.layers), comm, [note])
        return memo[graphs]

    base = at(8)
    return dataclasses.replace(base, notes=at(1).notes + base.notes, m_mem_by_ranks=lambda R: at(R).m_mem,
                               by_ranks=at)


READINGS = {"steady": (TOKENS_CV, WINDOWS), "expected": (None, (1,))}  # tokens CV cap, balanced's windows


def best_cell(inp: Inputs, mix: Mix, rule: str, R: int, g: float, planner: Optional[str] = None, window: int = 1,
              truth=None, seed: int = 0, mbs: int = 4096, mbs_final: int = 16384, per_M: int = 6,
              slow_ranks: Optional[dict] = None, tokens_cv: Optional[float] = TOKENS_CV,
              cache: Optional[dict] = None) -> SimResult:
    """One batch rule under one planner (None: the rule's default), best-tuned over its knob and M inside g tokens
    per rank per step, under the memory bound of R. cache: a dict that keeps cells under the measured truth, so that
    the matrix and the strategy comparison simulate a shared cell once (balanced under a planner is cost's rule
    under it: one cell, relabelled)."""
    planner = resolve_planner(rule, window, planner)
    window = window if planner == "windowed" else 1
    key = ("cost" if rule == "balanced" else rule, R, g, planner, window, seed, mbs, mbs_final, per_M,
           tuple(sorted((slow_ranks or {}).items())), tokens_cv)
    if cache is not None and truth is None and key in cache:
        return dataclasses.replace(cache[key], strategy=rule)
    inp = inp.at(R)
    cluster = Cluster(truth or inp.truth, inp.comm, dict(slow_ranks or {}))
    out = sweep_at_tokens(inp.cost.predict, mix, rule, R, g, p=inp.p, m_mem=inp.m_mem_at(R), cluster=cluster,
                          optim_ms=inp.optim_ms, seed=seed, mbs=mbs, mbs_final=mbs_final, per_M=per_M,
                          window=window, tokens_cv=tokens_cv, planner=planner)[0]
    if cache is not None and truth is None:
        cache[key] = out
    return out


def _best_steady(runs: Sequence[SimResult], tokens_cv: Optional[float]) -> SimResult:
    """The fastest run whose steps' tokens vary within tokens_cv (None: any); where none do, the steadiest."""
    steady = [r for r in runs if tokens_cv is None or r.tokens_step_cv <= tokens_cv]
    return max(steady, key=lambda r: r.tokens_per_s) if steady else min(runs, key=lambda r: r.tokens_step_cv)


def best_at_g(inp: Inputs, mix: Mix, strategy: str, R: int, g: float, truth=None, seed: int = 0,
              mbs: int = 4096, mbs_final: int = 16384, per_M: int = 6, slow_ranks: Optional[dict] = None,
              reading: str = "steady", cache: Optional[dict] = None) -> SimResult:
    """The strategy (its rule under its default planner) best-tuned inside g tokens per rank per step, under one
    reading of the batch (READINGS); balanced's window is tuned too."""
    tokens_cv, windows = READINGS[reading]
    kw = dict(truth=truth, seed=seed, mbs=mbs, mbs_final=mbs_final, per_M=per_M, slow_ranks=slow_ranks,
              tokens_cv=tokens_cv, cache=cache)
    return _best_steady([best_cell(inp, mix, strategy, R, g, window=w, **kw)
                         for w in (windows if strategy == "balanced" else (1,))], tokens_cv)


# ------------------------------------------------------------------------- the matrix: batch rule × planner
# Rows: the batch rules. balanced's rule is cost's (balanced = the cost rule planned sorted or windowed), so its
# row is cost's. Columns: the planners; "best W" is the best of the windowed columns.
MATRIX_RULES = ("equal_token", "dual_constraint", "cost")
MATRIX_PLANNERS = (("stream", 1), ("sorted", 1), ("reformed", 1), ("windowed", 2), ("windowed", 4), ("windowed", 8))
PAPER = ("dual_constraint", "stream")  # the paper's system: the dual-constraint rule in stream order


def planner_label(planner: str, window: int = 1) -> str:
    return f"W={window}" if planner == "windowed" else planner


def run_matrix(inp: Inputs, mix: Mix, ranks: Sequence[int] = (8, 64), g_factors: Sequence[float] = (2.0, 3.66),
               seed: int = 0, mbs: int = 4096, mbs_final: int = 16384, per_M: int = 6,
               planners: Sequence[tuple[str, int]] = MATRIX_PLANNERS, rules: Sequence[str] = MATRIX_RULES,
               slow_ranks: Optional[dict] = None, cache: Optional[dict] = None, log=print) -> dict:
    """{(R, g_factor, rule, column): SimResult}: every batch rule under every planner, each cell best-tuned over
    the rule's knob and M inside the same g tokens per rank per step (the steady reading: expected ±10 %, CV over
    steps ≤ 10 %) and the same memory bound, under the measured truth. Columns are planner_label()s, plus "best W"
    where windows were run."""
    out: dict = {}
    kw = dict(seed=seed, mbs=mbs, mbs_final=mbs_final, per_M=per_M, slow_ranks=slow_ranks, tokens_cv=TOKENS_CV,
              cache=cache)
    for R in ranks:
        for gf in g_factors:
            for rule in rules:
                t0 = time.perf_counter()
                for planner, w in planners:
                    out[(R, gf, rule, planner_label(planner, w))] = b = best_cell(inp, mix, rule, R, gf * mix.S_max,
                                                                                  planner, w, **kw)
                    log(f"matrix   R={R:<4} g={gf:g}·S_max {rule:<16} {planner_label(planner, w):<8} "
                        f"{b.tokens_per_s:>12,.0f} tok/s  idle {100 * b.idle_fraction:5.1f} %  tokens CV "
                        f"{100 * b.tokens_step_cv:4.1f} %  M={b.M}")
                windowed = [out[(R, gf, rule, planner_label(p, w))] for p, w in planners if p == "windowed"]
                if windowed:  # each cell already the best steady candidate of its window
                    out[(R, gf, rule, "best W")] = max(windowed, key=lambda r: r.tokens_per_s)
                log(f"matrix   R={R:<4} g={gf:g}·S_max {rule:<16} ({time.perf_counter() - t0:.1f} s)")
    return out


def matrix_shares(m: dict, R: int, gf: float) -> dict:
    """What the matrix credits to each part at (R, g), as tokens/s ratios: `planner` = the best planner ÷ stream
    on the paper's rule and on the best rule, `rule` = the best rule ÷ the paper's rule in stream order and under
    the best planner, `total` = the best cell ÷ the paper's system (dual_constraint in stream order)."""
    cells = {(rule, col): r for (R_, g_, rule, col), r in m.items() if R_ == R and g_ == gf}
    paper = cells[PAPER].tokens_per_s
    best_rule, best_col = max(cells, key=lambda k: cells[k].tokens_per_s)
    rules = sorted({rule for rule, _ in cells})
    best_stream_rule = max(rules, key=lambda rl: cells[(rl, "stream")].tokens_per_s)

    def best_planner(rule):
        return max((c for rl, c in cells if rl == rule), key=lambda c: cells[(rule, c)].tokens_per_s)

    return {"total": cells[(best_rule, best_col)].tokens_per_s / paper, "best": (best_rule, best_col),
            "rule_in_stream": cells[(best_stream_rule, "stream")].tokens_per_s / paper,
            "best_stream_rule": best_stream_rule,
            "planner_on_paper_rule": cells[(PAPER[0], best_planner(PAPER[0]))].tokens_per_s / paper,
            "paper_rule_best_planner": best_planner(PAPER[0]),
            "planner_on_best_rule": cells[(best_rule, best_col)].tokens_per_s / cells[(best_rule, "stream")].tokens_per_s,
            "rule_under_best_planner": cells[(best_rule, best_col)].tokens_per_s
            / cells[(PAPER[0], best_planner(PAPER[0]))].tokens_per_s}


def run_w1_bounds(inp: Inputs, mix: Mix, ranks: Sequence[int] = (8,), g_factors: Sequence[float] = (2.0,),
                  seed: int = 0, mbs: int = 4096, mbs_final: int = 16384, per_M: int = 6,
                  cache: Optional[dict] = None, log=print) -> dict:
    """{(R, g_factor, rule): row} — what any one-step planner (each step's samples kept, no window) can reach on
    each batch rule's best sorted table (its best W = 1 cell), on the very steps that cell's final run simulates
    (seed + 1, mbs_final micro-batches): scheduling.step_bound.run_bounds's tokens/s, each also ÷ the paper's system
    on its own final steps under the same mean times (row "paper": dual_constraint in stream order)."""
    out: dict = {}
    kw = dict(seed=seed, mbs=mbs, mbs_final=mbs_final, per_M=per_M, tokens_cv=TOKENS_CV, cache=cache)
    for R in ranks:
        at = inp.at(R)
        cluster = Cluster(at.truth, at.comm)
        for gf in g_factors:
            cells = {"paper": best_cell(inp, mix, PAPER[0], R, gf * mix.S_max, PAPER[1], **kw)}
            cells |= {rule: best_cell(inp, mix, rule, R, gf * mix.S_max, "sorted", **kw) for rule in MATRIX_RULES}
            for name, cell in cells.items():
                t0 = time.perf_counter()
                plans = final_plans(inp, mix, cell, R, seed, mbs_final, planner="stream")
                row = run_bounds(plans, cluster, at.optim_ms, at.m_mem_at(R), at.cost.predict, seed + 1)
                out[(R, gf, name)] = dict(row, M=cell.M, batch_sizes=list(cell.batch_sizes),
                                          sorted_drawn=None if name == "paper" else cell.tokens_per_s,
                                          stream_drawn=cell.tokens_per_s if name == "paper" else None)
                log(f"w1 bound R={R:<4} g={gf:g}·S_max {name:<16} sorted {row['sorted']:>9,.0f}  reform "
                    f"{row['reform']:>9,.0f}  bounds {row['rank_bound']:>9,.0f} {row['reform_slot_bound']:>9,.0f} "
                    f"tok/s  ({time.perf_counter() - t0:.1f} s)")
    return out


# ------------------------------------------------------------- which (S, B) a cell runs, and which to measure
@dataclass(frozen=True)
class CellPoint:
    """One distinct micro-batch of a cell's plans: how often it runs, the truth's mean ms at the full depth, its
    share of the plans' micro-batch time (count · ms ÷ Σ count · ms, as Cluster.measured_share counts) and whether
    the truth measured it (else it interpolates it)."""
    bucket: str
    S: int
    B: int
    count: int
    ms: float
    share: float
    measured: bool

    @property
    def name(self) -> str:
        return f"{self.bucket}:{self.B}"  # as calibrate.points names a micro-batch


def cell_points(plans, truth, names: Sequence[str]) -> list[CellPoint]:
    """Every distinct (bucket, B) of `plans` (padding micro-batches included, as the simulator times them), the
    largest share of micro-batch time first; names: the bucket names by the plans' bucket index."""
    count: dict = {}
    for plan in plans:
        for rank in plan.ranks:
            for mb in rank:
                count[(mb.bucket, mb.S, mb.B)] = count.get((mb.bucket, mb.S, mb.B), 0) + 1
    ms = {k: float(truth.mean(k[2], k[1])) for k in count}
    total = sum(n * ms[k] for k, n in count.items())
    out = [CellPoint(names[b], int(S), int(B), n, ms[(b, S, B)], n * ms[(b, S, B)] / total,
                     bool(truth.is_measured(B, S))) for (b, S, B), n in count.items()]
    return sorted(out, key=lambda p: (-p.share, p.S, p.B))


def share_measured(points: Sequence[CellPoint], also: Sequence[CellPoint] = ()) -> float:
    """The share of micro-batch time at measured (S, B) once `also` is measured too (shares as priced now)."""
    extra = {(p.S, p.B) for p in also}
    return sum(p.share for p in points if p.measured or (p.S, p.B) in extra)


def points_to_measure(points: Sequence[CellPoint], target: float = 0.95) -> list[CellPoint]:
    """The fewest unmeasured points whose measurement brings the measured share to ≥ target: the unmeasured ones
    in falling share until it is reached (no k points add more share than the k largest, so the first prefix that
    reaches the target is a fewest set). Empty where the share already reaches it."""
    if not 0.0 < target <= 1.0:
        raise ValueError(f"the measured-share target must lie in (0, 1], got {target}")
    have, chosen = share_measured(points), []
    for p in sorted((p for p in points if not p.measured), key=lambda p: -p.share):
        if have >= target - 1e-12:
            break
        chosen.append(p)
        have += p.share
    return chosen


# Seconds scripts/calibrate.py adds to each point's runs (inputs, syncs, the peak's reset): the 14B truth scan on
# the H200 (results/simulation_h200/truth_h200_14b_points.log) took 134 s for 11 points whose 44 runs took 126 s.
SCAN_POINT_OVERHEAD_S = 0.7


def scan_time_s(points: Sequence[CellPoint], cost_fn: Callable[[int, int], float], blocks: int, layers: int,
                runs: int = 4) -> float:
    """Device seconds scripts/calibrate.py +calibrate.points takes to time `points` on a k-block slice, each `runs`
    times (warm-up + repeats): Σ runs · cost_fn(B, S) · k / layers + SCAN_POINT_OVERHEAD_S a point, with cost_fn
    the full depth's ms (a calibration's cost model). The part outside the blocks (5–30 ms a micro-batch on the
    14B) is left out; builds and plain steps are the caller's."""
    return sum(runs * float(cost_fn(p.B, p.S)) * blocks / layers / 1e3 + SCAN_POINT_OVERHEAD_S for p in points)


def cell_plans(inp: Inputs, mix: Mix, rule: str, planner: str, R: int, g: float, seed: int = 0, mbs: int = 4096,
               mbs_final: int = 16384, per_M: int = 6, cache: Optional[dict] = None) -> tuple[SimResult, list]:
    """A matrix cell (best_cell: the rule under the planner, best-tuned inside g at R) and the very plans its final
    run simulates (seed + 1, mbs_final micro-batches: plan_run is deterministic)."""
    cell = best_cell(inp, mix, rule, R, g, planner, seed=seed, mbs=mbs, mbs_final=mbs_final, per_M=per_M,
                     tokens_cv=TOKENS_CV, cache=cache)
    return cell, final_plans(inp, mix, cell, R, seed, mbs_final, cell.planner)


def final_plans(inp: Inputs, mix: Mix, cell: SimResult, R: int, seed: int, mbs_final: int, planner: str) -> list:
    """The plans a cell's final run makes (sweep_at_tokens: seed + 1, run_steps(mbs_final)), under `planner` —
    the cell's own, or another on the same steps' samples (plan_run is deterministic)."""
    at = inp.at(R)
    return plan_run(at.cost.predict, mix, cell.strategy, cell.batch_sizes, R, cell.M,
                    run_steps(mbs_final, R, cell.M), seed + 1, planner=planner, m_mem=at.m_mem_at(R))


def run_fixed_batch(inp: Inputs, mix: Mix, ranks: Sequence[int] = (8, 64), g_factors: Sequence[float] = G_FACTORS,
                    seed: int = 0, mbs: int = 4096, mbs_final: int = 16384, per_M: int = 6,
                    model_truth: bool = True, slow_ranks: Optional[dict] = None,
                    readings: Sequence[str] = ("steady", "expected"), cache: Optional[dict] = None,
                    log=print) -> dict:
    """{reading: {(R, g_factor, strategy): SimResult}} under the measured truth; "model": the steady reading under
    the old model truth."""
    out: dict = {r: {} for r in readings}
    out["model"] = {}
    old = ModelTruth(inp.cost.predict, inp.cost.residuals)
    kw = dict(seed=seed, mbs=mbs, mbs_final=mbs_final, per_M=per_M, slow_ranks=slow_ranks)
    for R in ranks:
        for gf in g_factors:
            g = gf * mix.S_max
            for s in STRATEGIES:
                t0 = time.perf_counter()
                for reading in readings:
                    out[reading][(R, gf, s)] = b = best_at_g(inp, mix, s, R, g, reading=reading, cache=cache,
                                                             **kw)
                    log(f"{reading:<8} R={R:<4} g={gf:g}·S_max {s:<16} {b.tokens_per_s:>12,.0f} tok/s  idle "
                        f"{100 * b.idle_fraction:5.1f} %  tokens CV {100 * b.tokens_step_cv:4.1f} %  M={b.M} "
                        f"W={b.window}  ({time.perf_counter() - t0:.1f} s)")
                if model_truth:
                    out["model"][(R, gf, s)] = best_at_g(inp, mix, s, R, g, truth=old, reading=readings[0], **kw)
    return out


def _m_mem_record(m_mem: float, by_world_size: Optional[Mapping[int, float]], S_min: float) -> dict:
    """The chosen m_mem keys. One m_mem where the bound is the same at every world size; where it depends on R
    (FSDP's states ÷ R) none (None: training takes the memory model at its own world size, which gives these
    values), and the simulated ones beside it for the record."""
    out = {"m_mem_why": f"memory model at {HBM_FRACTION:.0%} of HBM", "m_mem_S_min": int(S_min)}
    if by_world_size:
        return out | {"m_mem": None, "m_mem_by_world_size": {str(R): int(v) for R, v in sorted(by_world_size.items())},
                      "m_mem_why": f"memory model at {HBM_FRACTION:.0%} of HBM over each world size's ranks"}
    return out | {"m_mem": int(m_mem), "m_mem_by_world_size": None}


def record_chosen_at_g(cal: Calibration, res: dict, mix: Mix, mode: str, m_mem: float,
                       m_mem_at: Optional[Callable[[int], float]] = None) -> None:
    """The fixed-batch protocol's best settings (the steady reading) into the calibration's "chosen"
    by_tokens_per_step[R][g]: what training reads for scheduling.tokens_per_step (nearest g and world size). The
    world sizes simulated replace their own entries; others stay. m_mem_at: R → the bound R runs under, where it
    depends on R (Inputs.m_mem_by_ranks)."""
    chosen = cal.data.setdefault("chosen", {})
    by = dict(chosen.get("by_tokens_per_step") or {})
    for R in {R for R, _, _ in res["steady"]}:
        by[str(R)] = {}
    for (R, gf, s), r in res["steady"].items():
        g = round(gf * mix.S_max)
        keep = {"equal_token": ("m_tokens",), "dual_constraint": ("m_comp", "p"),
                "cost": ("target_microbatch_ms",), "balanced": ("target_microbatch_ms",)}[s]
        by[str(R)].setdefault(str(g), {})[s] = (
            {k: r.setting[k] for k in keep} | {"micro_batches": r.M, "window": r.window,
                                               "tokens_per_step": r.setting.get("tokens_per_step")})
    chosen.update({"by": "scripts/simulate_cluster.py", "date": datetime.date.today().isoformat(), "mode": mode,
                   **_m_mem_record(m_mem, {int(R): m_mem_at(int(R)) for R in by} if m_mem_at else None, min(mix.S)),
                   "by_tokens_per_step": dict(sorted(by.items(), key=lambda kv: int(kv[0]))),
                   "mix": [{"bucket": n, "S": S, "share": sh} for n, S, sh in zip(mix.names, mix.S, mix.share)]})


# ---------------------------------------------------------------------------------- the unconstrained protocol
def steps_for(R: int, M: int, mbs: int) -> int:
    return max(16, math.ceil(mbs / (R * M)))


def run_unconstrained(cal: Calibration, mode: str, mix: Mix, ranks, sweep_ranks, M: int = 4, mbs: int = 8192,
                      seed: int = 0, log=print) -> dict:
    """M fixed, each knob swept without a batch constraint, under the model truth (the earlier protocol)."""
    inp = inputs_from(cal, mode, mix)
    cost, p, optim_ms = inp.cost, inp.p, inp.optim_ms
    kw = dict(residuals=cost.residuals, optim_ms=optim_ms, seed=seed)  # the sweeps choose on this draw
    ev = dict(kw, seed=seed + 1)  # every reported row on this one, as sweep() re-draws its best
    best: dict = {}
    rows: list[SimResult] = []
    sweeps: list[tuple[str, SimResult]] = []
    for R in ranks:
        K = steps_for(R, M, mbs)
        m_mem = inp.m_mem_at(R)
        src = R if R in sweep_ranks else max(r for r in sweep_ranks if r <= R) if any(r <= R for r in sweep_ranks) \
            else min(sweep_ranks)
        for s in STRATEGIES:
            t0 = time.perf_counter()
            if R in sweep_ranks:
                b, runs = sweep(cost.predict, mix, s, R, p=p, m_mem=m_mem, M=M, steps=K, **kw)
                sweeps += [("sweep", r) for r in runs]
            else:
                st = best[(src, s)].setting  # the knob from src, under the memory bound of R
                st = dict(st, m_mem=m_mem) if "m_mem" in st else st
                b = simulate(cost.predict, mix, s, sizes_for(s, mix, st, cost.predict), R, M, K, setting=st, **ev)
            best[(R, s)] = b
            rows.append(b)
            log(f"R={R:<5} {s:<16} {b.tokens_per_s:>12.0f} tok/s  CV {100 * b.compute_cv:5.2f} %  "
                f"idle {100 * b.idle_fraction:5.2f} %  ({time.perf_counter() - t0:.1f} s)")
        st = {"m_tokens": mix.S_max, "factor": 1.0}
        base = simulate(cost.predict, mix, "equal_token", sizes_for("equal_token", mix, st, cost.predict), R, M, K,
                        setting=st, **ev)
        best[(R, "equal_token@S_max")] = base
        rows.append(base)
    return dict(best=best, rows=rows, sweeps=sweeps, m_mem=inp.m_mem, m_mem_by_world_size=inp.m_mem_by_world_size(ranks),
                p=p, optim_ms=optim_ms, ranks=list(ranks), sweep_ranks=list(sweep_ranks), M=M, mbs=mbs, mix=mix, cost=cost, memory=cal.memory_model(mode))


def record_chosen(cal: Calibration, res: dict, mode: str) -> None:
    """The unconstrained protocol's best settings per world size into the calibration's "chosen" by_world_size
    (training reads them when no tokens_per_step is set; config beats them)."""
    by_r = {}
    for R in res["ranks"]:
        by_r[str(R)] = {}
        for s in STRATEGIES:
            st = res["best"][(R, s)].setting
            keep = {"equal_token": ("m_tokens",), "dual_constraint": ("m_comp", "p"),
                    "cost": ("target_microbatch_ms",), "balanced": ("target_microbatch_ms",)}[s]
            by_r[str(R)][s] = {k: st[k] for k in keep}
    mix = res["mix"]
    chosen = cal.data.setdefault("chosen", {})
    chosen.update({
        "by": "scripts/simulate_cluster.py", "date": datetime.date.today().isoformat(), "mode": mode,
        **_m_mem_record(res["m_mem"], res["m_mem_by_world_size"], min(mix.S)),  # m_mem_S_min: safe for buckets
        "micro_batches": res["M"], "reference_world_size": 8,
        "mix": [{"bucket": n, "S": S, "share": s} for n, S, s in zip(mix.names, mix.S, mix.share)],
        "criterion": "highest simulated tokens/s (≡ samples/s: the mix is fixed)", "by_world_size": by_r})


def describe_setting(r: SimResult) -> str:
    knob = KNOB[r.strategy]
    v = r.setting[knob]
    extra = f", M={r.M}" + (f", W={r.window}" if r.window > 1 else "")
    return f"{knob}={v:.4g}{extra}"

"""Shape benchmarking: time real training steps over (bucket, B), fit the cost and memory models, write the file.

    step_fn(bucket, B) -> StepResult(ms, optim_ms, peak_bytes)      built by the caller (scripts/calibrate.py)

`ms` times forward + backward (what the cost model predicts), `optim_ms` the optimizer step apart, `peak_bytes`
the step's peak device memory (optimizer state included); step_fn raises `Infeasible` on out-of-memory, after
freeing what it allocated (docs/contracts.md §6).

The scan: buckets in ascending S; in each, B rises geometrically from 1 towards `top_tokens`/S, so that points
span both S and B·S. A bucket stops at its first infeasible B, at a B·S at or above one already found
infeasible, or where the memory model fitted to the points so far predicts more than `mem_budget_bytes`. With a
memory budget, the last point probes the shortest bucket at the largest B the memory model allows: the planners
fill short buckets up to that bound, several times the ladder's top, and a model fitted below it is checked there.
At most `max_points` points are timed (the H200's budget: 12), spread over the buckets: one bucket per length, and
with more lengths than max_points / 2 a spread of them in log S, two points each (_quotas). On several ranks every
decision to run a point, and its outcome, is agreed through `agree(ok) -> all ranks ok` (an all-reduce), so that no
rank enters a step the others skip.

The calibration file (JSON) holds, per checkpointing mode, the points, both cost fits with their errors, the
chosen (auto) cost model, the memory model and the optimizer ms; plus what was measured where and how, a k-block
extrapolation when the scan timed k of the model's blocks (cost × layers/k: per-block cost is identical), and —
written later by scripts/simulate_cluster.py — the settings the simulator chose ("chosen"). A slice calibrated for
FSDP over R ranks (scripts/calibrate.py calibrate.fsdp_ranks) holds an FSDPMemoryModel (scheduling/fsdp_memory.py)
as its memory model, with the slice's measurements beside it ("slice_memory"); memory_model(mode, world_size) gives
it for the run's number of ranks.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from scheduling.cost_model import CostModel, MemoryModel, best_fit, fit_both, fit_memory_model
from scheduling.fsdp_memory import FSDPMemoryModel, memory_model_from_dict

FORMAT = "adaptiveload-calibration/1"
HBM_FRACTION = 0.9  # the memory budget when none is given: 90 % of the device's memory


class Infeasible(Exception):
    """The step does not fit (out of memory); raised by step_fn after freeing what it allocated."""


@dataclass
class StepResult:
    ms: float                          # forward + backward
    optim_ms: float = 0.0              # optimizer step (and zero_grad)
    peak_bytes: Optional[float] = None  # peak device memory of the whole step; None where unknown (CPU)


@dataclass
class Point:
    bucket: str
    S: int
    B: int
    feasible: bool
    ms: Optional[float] = None               # median of the timed runs
    ms_runs: list = field(default_factory=list)
    optim_ms: Optional[float] = None
    peak_bytes: Optional[float] = None
    why: str = ""                             # why a point was not timed


def _ladder(S: int, quota: int, top_tokens: float) -> list[int]:
    """Up to `quota` batch sizes from 1 rising geometrically to ⌊top_tokens / S⌋."""
    top = max(1, int(top_tokens // S))
    if quota <= 1 or top == 1:
        return [1]
    Bs = sorted({max(1, int(round(top ** (i / (quota - 1))))) for i in range(quota)})
    return Bs


def _quotas(tokens: Mapping[str, int], max_points: int) -> dict[str, int]:
    """Points per bucket: one bucket per distinct S (a portrait twin costs what its landscape one does); with more
    distinct S than max_points / 2, max_points // 2 of them spread evenly in log S (each the nearest to its target;
    the shortest and the longest always in), so that each bucket gets two points (B = 1 and a large B), not one."""
    names, seen = [], set()
    for n in sorted(tokens, key=lambda n: (tokens[n], n)):
        if tokens[n] not in seen:
            seen.add(tokens[n])
            names.append(n)
    keep = max(1, max_points // 2)
    if len(names) > keep:
        logS = np.log([tokens[n] for n in names])
        pick: list[int] = []
        for target in np.linspace(logS[0], logS[-1], keep):
            free = [i for i in range(len(names)) if i not in pick]
            pick.append(min(free, key=lambda i: (abs(logS[i] - target), i)))
        names = [names[i] for i in sorted(pick)]
    q = {n: max_points // len(names) for n in names}
    for n in names[:max_points % len(names)]:  # spare points to the cheap, short buckets
        q[n] += 1
    return q


def scan(step_fn: Callable[[str, int], StepResult], tokens: Mapping[str, int], *, max_points: int = 12,
         top_tokens: Optional[float] = None, mem_budget_bytes: Optional[float] = None, warmup: int = 1,
         repeats: int = 2, agree: Optional[Callable[[bool], bool]] = None, time_budget_s: Optional[float] = None,
         probe_cap: bool = True, agree_min: Optional[Callable[[int], int]] = None,
         fixed_points: Optional[Sequence[tuple[str, int]]] = None,
         held_bytes: Optional[Callable[[], float]] = None,
         log: Callable[[str], None] = lambda s: None) -> list[Point]:
    """Time step_fn over buckets (name → S) and B upward; returns every point tried, timed or not.

    fixed_points: exactly these (bucket, B) micro-batches, in this order, instead of the ladder (calibrate.points: the
    shapes a simulation's cells run, each timed `repeats` times); no cap of points and no memory probe, the time
    budget still stops new ones, and one out of memory skips that point alone.

    probe_cap (with mem_budget_bytes and max_points ≥ 3): the last timed point is the shortest bucket at the largest
    B that the memory model fitted to the other points allows in the budget — where the planners' memory bound
    binds, far above the ladder's top. It checks the model's extrapolation (the final fit includes it); on
    out-of-memory it is retried at PROBE_SHRINK of that B, up to PROBE_TRIES times. Each rank fits its own peaks, so
    the ranks take the smallest of their B (`agree_min(B) -> min over ranks`, an all-reduce); every rank calls agree()
    and agree_min() the same number of times whatever its own fit says.

    held_bytes: memory held beside the step that its peaks do not count (the CUDA graphs' shared pool of the
    micro-batches captured so far, training/cuda_graphs.py), read before each check: every memory check of the
    ladder and the probe leaves that much of mem_budget_bytes aside, as training's bound does (graph_pool_bytes)."""
    if max_points < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"max_points and repeats must be ≥ 1 and warmup ≥ 0, got {max_points}, {repeats}, {warmup}")
    agree = agree or (lambda ok: ok)
    agree_min = agree_min or (lambda v: v)
    top_tokens = top_tokens or 2 * max(tokens.values())

    def budget() -> Optional[float]:  # what the step may peak at now
        return None if mem_budget_bytes is None else mem_budget_bytes - (held_bytes() if held_bytes else 0.0)

    probe = probe_cap and mem_budget_bytes is not None and max_points >= 3
    quotas = _quotas(tokens, max_points)
    high = set()  # buckets whose single point is their ladder's top, not B = 1
    if probe:  # the probe's point comes out of the shortest bucket with two or more
        short = next((n for n in quotas if quotas[n] >= 2), None)
        if short is None:
            quotas = _quotas(tokens, max_points - 1)
        else:
            quotas[short] -= 1
            if quotas[short] == 1:  # its B = 1 would be launch-bound on a GPU; the probe covers the bucket's top end
                high.add(short)
    t_start = time.perf_counter()
    points: list[Point] = []
    infeasible_tokens = math.inf

    def over_budget() -> bool:
        return time_budget_s is not None and time.perf_counter() - t_start > time_budget_s

    def attempt(name: str, S: int, B: int, why: str) -> Optional[Point]:
        """Run (name, B) unless `why` or another rank says no; the point, or None where it was not run."""
        if not agree(not why):
            points.append(Point(name, S, B, False, why=why or "another rank predicts it infeasible"))
            log(f"skip {name} S={S} B={B}: {points[-1].why}")
            return None
        runs, err = run_point(step_fn, name, B, warmup, repeats)
        if not agree(not err):
            points.append(Point(name, S, B, False, why=f"out of memory{': ' + err[:200] if err else ''}"))
            log(f"infeasible {name} S={S} B={B}")
            return points[-1]
        points.append(timed_point(name, S, B, runs, log))
        return points[-1]

    if fixed_points is not None:
        for name, B in fixed_points:
            if name not in tokens:
                raise ValueError(f"scan point {name}:{B} names a bucket outside {list(tokens)}")
            attempt(name, int(tokens[name]), int(B), f"time budget of {time_budget_s:g} s spent" if over_budget()
                    else "")
        return points
    for name in quotas:
        S = int(tokens[name])
        ladder = [max(1, int(top_tokens // S))] if name in high else _ladder(S, quotas[name], top_tokens)
        for B in ladder:
            timed = [p for p in points if p.feasible]
            why = ""
            if len(timed) >= max_points:
                why = f"cap of {max_points} timed points reached"
            elif over_budget():
                why = f"time budget of {time_budget_s:g} s spent"
            elif B * S >= infeasible_tokens:
                why = f"B·S = {B * S} ≥ {infeasible_tokens:g}, already infeasible"
            elif mem_budget_bytes is not None:
                mem, room = _memory_fit(timed), budget()
                if mem is not None and mem.predict(B, S) > room:
                    why = (f"memory model predicts {mem.predict(B, S) / 2**30:.1f} GiB > budget "
                           f"{room / 2**30:.1f} GiB" + _held(mem_budget_bytes, room))
            p = attempt(name, S, B, why)
            if p is None or not p.feasible:
                if p is not None:
                    infeasible_tokens = min(infeasible_tokens, B * S)
                break
    if probe:
        _probe_cap(points, tokens, budget, max_points, infeasible_tokens, over_budget, attempt, agree_min, log,
                   mem_budget_bytes)
    return points


def _held(full: float, room: float) -> str:
    return f" ({(full - room) / 2**30:.1f} GiB held beside the step)" if full - room > 0 else ""


def run_point(step_fn: Callable[[str, int], StepResult], name: str, B: int, warmup: int,
              repeats: int) -> tuple[list[StepResult], str]:
    """warmup + repeats steps of (name, B): (the timed repeats, ""), or ([], why) where one ran out of memory."""
    try:
        for _ in range(warmup):
            step_fn(name, B)
        return [step_fn(name, B) for _ in range(repeats)], ""
    except Infeasible as e:
        return [], str(e) or "out of memory"


def timed_point(name: str, S: int, B: int, runs: list[StepResult], log: Callable[[str], None] = lambda s: None
                ) -> Point:
    """The Point of a feasible (name, B) from its timed repeats: median ms and optim_ms, the largest peak."""
    peaks = [r.peak_bytes for r in runs if r.peak_bytes is not None]
    p = Point(name, S, B, True, float(np.median([r.ms for r in runs])), [float(r.ms) for r in runs],
              float(np.median([r.optim_ms for r in runs])), float(max(peaks)) if peaks else None)
    log(f"{name:<14} S={S:>6} B={B:>4}  {p.ms:9.2f} ms  optim {p.optim_ms:7.2f} ms"
        + (f"  peak {p.peak_bytes / 2**30:6.2f} GiB" if p.peak_bytes else ""))
    return p


PROBE_SHRINK = 0.85  # the cap probe's next B after an out-of-memory
PROBE_TRIES = 3


def _probe_cap(points, tokens, budget_now, max_points, infeasible_tokens, over_budget, attempt, agree_min, log,
               full_budget) -> None:
    name = min(tokens, key=lambda n: (tokens[n], n))
    S = int(tokens[name])
    done = max([p.B for p in points if p.feasible and p.bucket == name], default=0)  # the same on every rank
    mem = _memory_fit([p for p in points if p.feasible])
    why = ("no memory model with a per-token cost fits the points" if mem is None or mem.c1 <= 0
           else f"cap of {max_points} timed points reached" if sum(p.feasible for p in points) >= max_points
           else "time budget spent" if over_budget() else "")
    budget = budget_now()
    B = 0 if why else mem.max_batch(S, budget)
    if math.isfinite(infeasible_tokens):  # never at or above a B·S that already ran out of memory
        B = min(B, int((infeasible_tokens - 1) // S))
    for i in range(PROBE_TRIES):
        B = agree_min(B)
        if not why and B <= done:
            why = f"B={B} is not above the B={done} already timed"
        if not why:
            log(f"cap probe: {name} S={S} B={B}, memory model (so far) predicts {mem.predict(B, S) / 2**30:.1f} GiB "
                f"of the {budget / 2**30:.1f} GiB budget" + _held(full_budget, budget))
        p = attempt(name, S, B, "cap probe: " + why if why else "")
        if p is None or p.feasible:
            return
        B = int(B * PROBE_SHRINK)
        why = "time budget spent" if over_budget() else ""


def _memory_fit(points: list[Point]) -> Optional[MemoryModel]:
    pts = [p for p in points if p.feasible and p.peak_bytes]
    if len({p.B * p.S for p in pts}) < 2:
        return None
    return fit_memory_model([p.B for p in pts], [p.S for p in pts], [p.peak_bytes for p in pts])


def fit_mode(points: list[Point], scale: float = 1.0, L: Optional[float] = None,
             memory_valid: bool = True, min_tokens: Optional[float] = None, joint: bool = False,
             launch: Optional[Point] = None, depth_factors: Optional[Mapping] = None) -> dict:
    """One checkpointing mode's record: points, both fits (× scale for a k-block scan), memory model, optim ms.

    Every timed point is fitted: where small micro-batches are launch-bound (eager on a GPU, the GPU waits on the
    host's launches) the cost model's floor prices them (cost_model.py: t = max(floor, f)). min_tokens: points
    with B·S below it are kept in the file but left out of the cost fit (by hand only; "auto" is the same as
    none: the floor finds the launch-bound end). The file reports the fitted model's error on every timed point.
    joint: the model attends over S + L tokens (MMDiT); the quadratic form then fits in (S + L) with the scan's
    text length L. launch: a plain training step at B = 1 of the shortest bucket, timed outside the scan (an FSDP
    slice's, whose scan starts at larger micro-batches): fitted with the points, a floor may rest on it alone, its
    error is reported as launch_rel_err and the simulator's truth includes it (Calibration.measured_points).
    depth_factors: a slice timed at two depths (Calibration.affine_scales: (bucket, B) and "launch" → the factor
    to the full depth's t_fixed + L·t_block): each point is fitted at the full depth, its own factor (`scale` where
    it has none), instead of the k-block fit × scale, which counts the part outside the blocks L/k times and so
    over-prices the launch-bound micro-batches of a shallow slice. The errors are then the full depth's; the points
    stay as timed. The record says so (fit_depth: "affine"), and refit does the same again.
    """
    timed = [p for p in points if p.feasible]
    rec: dict = {"points": [asdict(p) for p in points]}
    if depth_factors is not None:  # each point at the full depth; the model is fitted there (scale 1)
        def full(p: Point, key) -> Point:
            f = float(depth_factors.get(key, scale))
            return Point(p.bucket, p.S, p.B, p.feasible, None if p.ms is None else p.ms * f,
                         [t * f for t in p.ms_runs], p.optim_ms, p.peak_bytes, p.why)

        inner = fit_mode([full(p, (p.bucket, int(p.B))) for p in points], 1.0, L, memory_valid, min_tokens, joint,
                         None if launch is None else full(launch, "launch"))
        inner["points"] = rec["points"]
        if launch is not None:
            inner["launch_point"] = asdict(launch)
        inner["optim_ms"] = float(np.median([p.optim_ms for p in timed])) * scale
        inner["fit_depth"] = "affine"
        return inner
    if min_tokens == "auto":
        min_tokens = None
    fitted = [p for p in timed if min_tokens is None or p.B * p.S >= min_tokens]
    if len(fitted) < 3:
        raise ValueError(f"only {len(fitted)} points were timed (and fitted): a cost model needs at least 3 "
                         "(raise the point cap, the memory budget, or add buckets)")
    if launch is not None and min_tokens is not None and launch.B * launch.S < min_tokens:
        launch = None  # left out with the scan's points under min_tokens
    with_launch = fitted + ([launch] if launch is not None else [])
    B, S, t = (np.array([getattr(p, k) for p in with_launch], dtype=np.float64) for k in ("B", "S", "ms"))
    L_arr = np.full(len(t), float(L)) if joint and L is not None else None
    fits = fit_both(B, S, t, L=L_arr, joint=L_arr is not None, floor=True,
                    launch=None if launch is None else [False] * len(fitted) + [True])
    best = best_fit(fits)  # form="auto"'s choice, without fitting both forms again
    for m in fits.values():
        m.L = L
    rec["fits"] = {f: m.scaled(scale).to_dict() for f, m in fits.items()}
    rec["cost_model"] = best.scaled(scale).to_dict()
    rec["fit_errors"] = {f: {"rel_rmse": m.rel_rmse, "loo_rel_rmse": m.loo_rel_rmse, "max_rel_err": m.max_rel_err}
                         for f, m in fits.items()}
    rec["fit_min_tokens"] = min_tokens
    rec["fit_points"] = len(fitted)
    Ba, Sa, ta = (np.array([getattr(p, k) for p in timed], dtype=np.float64) for k in ("B", "S", "ms"))
    rec["rel_err_every_point"] = {f: [float(e) for e in (m.predict(Ba, Sa) - ta) / ta] for f, m in fits.items()}
    if launch is not None:
        rec["launch_point"] = asdict(launch)
        rec["launch_rel_err"] = {f: float(m.predict(launch.B, launch.S) / launch.ms - 1.0) for f, m in fits.items()}
    mem = _memory_fit(timed)
    rec["memory_model"] = mem.to_dict() if mem is not None and memory_valid else None
    if mem is not None and not memory_valid:
        rec["memory_model_k_blocks"] = mem.to_dict()  # peak of the k-block model: not the full model's
    rec["optim_ms"] = float(np.median([p.optim_ms for p in timed])) * scale
    return rec


# ------------------------------------------------------------------------------------------------- the file
@dataclass
class Calibration:
    data: dict
    path: Optional[str] = None

    @classmethod
    def load(cls, path: str) -> "Calibration":
        """The file at `path`, checked whole (check_calibration): a file that does not read, or whose records
        cannot price a micro-batch, is refused here with what is wrong, never later in the run."""
        if not os.path.exists(path):
            raise ValueError(f"scheduling.calibration={path}: no such file (scripts/calibrate.py writes one; or set "
                             "scheduling.calibration=null)")
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, UnicodeDecodeError, ValueError) as e:  # a folder, unreadable bytes, not JSON
            raise ValueError(f"scheduling.calibration={path}: does not read as JSON ({type(e).__name__}: "
                             f"{str(e)[:200]})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"scheduling.calibration={path}: format {got!r}, expected {FORMAT!r}")
        check_calibration(data, path)
        return cls(data, path)

    def save(self, path: Optional[str] = None) -> str:
        path = path or self.path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, path)
        self.path = path
        return path

    @property
    def modes(self) -> list[str]:
        return list(self.data["modes"])

    def mode_name(self, checkpointing: Optional[str]) -> str:
        """The record for model.checkpointing (auto → full when only full was measured; None → the only one)."""
        modes = self.modes
        if checkpointing in modes:
            return checkpointing
        if checkpointing is None and len(modes) == 1:
            return modes[0]
        if checkpointing in (None, "auto") and "full" in modes:
            return "full"
        raise ValueError(f"scheduling.calibration={self.path} holds checkpointing modes {modes}, not "
                         f"model.checkpointing={checkpointing}: calibrate with that mode")

    def cost_model(self, mode: str, form: Optional[str] = None) -> CostModel:
        rec = self.data["modes"][mode]
        return CostModel.from_dict(rec["fits"][form] if form else rec["cost_model"])

    def memory_model(self, mode: str, world_size: Optional[int] = None
                     ) -> Optional[MemoryModel | FSDPMemoryModel]:
        """The record's MemoryModel, or its FSDPMemoryModel — over world_size ranks when given (the states rescale
        as 1/R; the file's own R otherwise); None where the file has none."""
        d = self.data["modes"][mode].get("memory_model")
        mem = memory_model_from_dict(d) if d else None
        if isinstance(mem, FSDPMemoryModel) and world_size:
            mem = mem.for_ranks(world_size)
        return mem

    def measured_points(self, mode: str) -> list[dict]:
        """The mode's timed points (and its launch point) at the whole model's depth: a k-block slice's times ×
        its extrapolation scale, as its cost model is, except where the point was timed at a second depth too:
        there t_fixed + L·t_block (affine_scales). (bucket, S, B, ms, ms_runs: peaks and optimizer times stay in
        the records.) The simulator's truth (scheduling/protocol.py)."""
        rec = self.data["modes"][mode]
        scale = float((self.data.get("extrapolation") or {}).get("scale", 1.0))
        affine = self.affine_scales(mode)
        pts = [(p, affine.get((p["bucket"], int(p["B"])), scale)) for p in rec["points"] if p.get("feasible", True)]
        if rec.get("launch_point"):  # the plain step: its own two depths' row where there is one
            pts.append((rec["launch_point"], affine.get("launch", scale)))
        return [{"bucket": p["bucket"], "S": p["S"], "B": p["B"], "feasible": True, "ms": p["ms"] * f,
                 "ms_runs": [t * f for t in p.get("ms_runs") or []]} for p, f in pts if p.get("ms")]

    def check_model(self, dim, num_layers, what: str) -> None:
        """Refuse this file (`what` names its use) unless it measured a model of this width and depth."""
        model = self.data.get("model") or {}
        if (model.get("dim"), model.get("num_layers")) != (dim, num_layers):
            raise ValueError(f"{what} {self.path}: measured on a model of dim {model.get('dim')} and "
                             f"{model.get('num_layers')} layers, not ({dim}, {num_layers})")

    def affine_scales(self, mode: str) -> dict[tuple[str, int], float]:
        """A slice timed at two depths (calibrate.fsdp_ranks with memory_blocks): (bucket, B) → the factor from the
        main depth's time to the full depth's t_fixed + L·t_block (fsdp_memory.depth_check), which counts the part
        outside the blocks once where the flat ×L/k counts it L/k times; "launch" → the same for the plain step.
        Never above the flat scale (that would take a negative t_fixed, which is timing noise). Empty without a
        second depth; a point whose two depths give no positive per-block time keeps the flat scale."""
        dc = self.data["modes"][mode].get("depth_check") or {}
        main = str((dc.get("depths") or [None])[0])
        flat = float((self.data.get("extrapolation") or {}).get("scale", 1.0))
        out = {}
        rows = [((r["bucket"], int(r["B"])), r) for r in dc.get("points") or []] + [("launch", dc.get("launch"))]
        for key, r in rows:
            t_main = ((r or {}).get("ms") or {}).get(main)
            if t_main and r.get("block_ms", 0) > 0 and r.get("full_affine_ms", 0) > 0:
                # a negative t_fixed (timing noise: the part outside the blocks costs ≥ 0) would put the full depth
                # above the flat ×L/k; there the flat scale is the better estimate
                out[key] = min(float(r["full_affine_ms"]) / float(t_main), flat)
        return out

    def optim_ms(self, mode: str) -> float:
        return float(self.data["modes"][mode].get("optim_ms") or 0.0)

    @property
    def hbm_bytes(self) -> Optional[float]:
        return self.data.get("hbm_bytes")

    def default_m_mem(self, mode: str, S_min: float, world_size: Optional[int] = None) -> Optional[int]:
        """m_mem from the memory model at 90 % of the device's memory, when both are known (S_min: the shortest
        bucket's S, where the model's per-sample term weighs most; world_size: an FSDP model's ranks)."""
        mem = self.memory_model(mode, world_size)
        if mem is None or not self.hbm_bytes:
            return None
        return mem.m_mem(HBM_FRACTION * self.hbm_bytes, S_min)

    def chosen_at_tokens(self, strategy: str, world_size: Optional[int], tokens_per_step: float,
                         mode: Optional[str] = None) -> dict:
        """The fixed-batch protocol's best setting for `strategy` (knob, micro_batches, window, tokens_per_step) at
        the nearest simulated world size and the nearest simulated g ({} if none, or where it was chosen under
        another checkpointing mode than `mode`)."""
        by_r = (self.data.get("chosen") or {}).get("by_tokens_per_step") or {}
        if not by_r or (mode is not None and self.chosen_for() not in (None, mode)):
            return {}
        ref = world_size or 8
        R = min(by_r, key=lambda r: (abs(math.log(int(r) / ref)), int(r)))
        g = min(by_r[R], key=lambda v: (abs(math.log(float(v) / tokens_per_step)), float(v)))
        return dict(by_r[R][g].get(strategy, {}), simulated_world_size=int(R), simulated_g=float(g))

    def chosen_for(self) -> Optional[str]:
        """The checkpointing mode the simulator's settings were chosen under (a record's name, or "auto"); None
        where the file does not say (the shape benchmark's CPU bound, which holds for every mode)."""
        return (self.data.get("chosen") or {}).get("mode")

    def chosen(self, strategy: str, world_size: Optional[int] = None, mode: Optional[str] = None) -> dict:
        """The simulator's best settings for `strategy` at the nearest simulated world size ({} if none). mode: the
        run's checkpointing mode (a record's name, or "auto"); settings chosen under another mode are not this
        run's ({}): their m_mem bounds another policy's memory."""
        chosen = self.data.get("chosen") or {}
        if mode is not None and self.chosen_for() not in (None, mode):
            return {}
        by_r = chosen.get("by_world_size") or {}
        out = {}
        if by_r:
            ref = world_size or chosen.get("reference_world_size") or int(min(by_r, key=int))
            R = min(by_r, key=lambda r: (abs(math.log(int(r) / ref)), int(r)))
            out = dict(by_r[R].get(strategy, {}))
        for k in ("m_mem", "m_mem_S_min"):
            if chosen.get(k) is not None:
                out.setdefault(k, chosen[k])
        return out


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_calibration(data: dict, path: str) -> None:
    """Refuse (ValueError naming the file and the key) a calibration whose parts the schedule reads are missing,
    of the wrong type, or not finite: the model it measured (dim, num_layers), each record's cost model and fits
    (each predicting a finite, positive time at every measured shape and at B = 1 from the shortest to the longest
    measured S), its memory model where it has one (a finite, positive peak there), hbm_bytes, the extrapolation's
    scale and the simulator's `chosen` settings. What scripts/calibrate.py writes always passes."""
    def bad(what: str):
        raise ValueError(f"scheduling.calibration={path}: {what}; re-measure it (scripts/calibrate.py) or restore "
                         "the file")

    model = data.get("model")
    if not isinstance(model, dict) or not all(isinstance(model.get(k), int) and not isinstance(model.get(k), bool)
                                              and model[k] > 0 for k in ("dim", "num_layers")):
        bad("`model` must give the measured model's dim and num_layers as positive integers")
    hbm = data.get("hbm_bytes")
    if hbm is not None and not (_number(hbm) and hbm > 0):
        bad(f"hbm_bytes {hbm!r} is not a positive number of bytes")
    ext = data.get("extrapolation")
    if ext is not None and not (isinstance(ext, dict) and _number(ext.get("scale", 1.0)) and ext.get("scale", 1.0) > 0):
        bad(f"extrapolation {ext!r} needs a positive scale")
    modes = data.get("modes")
    if not isinstance(modes, dict) or not modes or not all(isinstance(r, dict) for r in modes.values()):
        bad("`modes` must map each checkpointing mode to its record")
    shapes = set()
    for rec in modes.values():
        for p in rec.get("points") or []:
            if isinstance(p, dict) and _number(p.get("B")) and _number(p.get("S")) and p["B"] >= 1 and p["S"] >= 1:
                shapes.add((float(p["B"]), float(p["S"])))
    S_all = [S for _, S in shapes] or [1560.0, 75600.0]
    shapes |= {(1.0, min(S_all)), (1.0, max(S_all))}
    for mode, rec in modes.items():
        fits = rec.get("fits")
        if fits is not None and not isinstance(fits, dict):
            bad(f"modes.{mode}.fits is not an object")
        try:
            models = [("cost_model", CostModel.from_dict(rec["cost_model"]))]
            models += [(f"fits.{f}", CostModel.from_dict(v)) for f, v in (fits or {}).items()]
            mem = memory_model_from_dict(rec["memory_model"]) if rec.get("memory_model") else None
        except KeyError as e:
            bad(f"modes.{mode} lacks {e}")
        except (TypeError, ValueError, AttributeError) as e:
            bad(f"modes.{mode}: {str(e)[:200]}")
        for name, cost in models:
            if not isinstance(cost.params, dict) or not all(_number(v) for v in cost.params.values()):
                bad(f"modes.{mode}.{name}: its params {cost.params!r} must be finite numbers")
            for B, S in sorted(shapes):
                try:
                    t = cost.predict(B, S)
                except KeyError as e:
                    bad(f"modes.{mode}.{name} ({cost.form}) lacks the parameter {e}")
                if not (math.isfinite(t) and t > 0):
                    bad(f"modes.{mode}.{name} predicts {t:.4g} ms at B={B:g}, S={S:g}: a time must be positive")
        if mem is not None:
            for B, S in sorted(shapes):
                try:
                    peak = float(mem.predict(B, S))
                except (TypeError, ValueError, ArithmeticError) as e:
                    bad(f"modes.{mode}.memory_model: {str(e)[:200]}")
                if not (math.isfinite(peak) and peak > 0):
                    bad(f"modes.{mode}.memory_model predicts {peak:.4g} bytes at B={B:g}, S={S:g}")
    chosen = data.get("chosen")
    if chosen is None:
        return
    if not isinstance(chosen, dict):
        bad("`chosen` (the simulator's settings) is not an object")
    for key in ("m_mem", "m_mem_S_min"):
        if chosen.get(key) is not None and not (_number(chosen[key]) and chosen[key] > 0):
            bad(f"chosen.{key} {chosen[key]!r} is not a positive number")
    for key in ("by_world_size", "by_tokens_per_step"):
        table = chosen.get(key)
        if table is None:
            continue
        if not isinstance(table, dict):
            bad(f"chosen.{key} is not an object")
        for R, row in table.items():
            if not (str(R).isdigit() and int(R) >= 1 and isinstance(row, dict)):
                bad(f"chosen.{key}: {R!r} is not a number of ranks ≥ 1 with its settings")
            if key == "by_tokens_per_step":
                for g, per in row.items():
                    try:
                        ok = float(g) > 0 and math.isfinite(float(g)) and isinstance(per, dict)
                    except ValueError:
                        ok = False
                    if not ok:
                        bad(f"chosen.{key}.{R}: {g!r} is not a number of tokens a step with its settings")


SLICE_KEYS = ("slice_memory", "depth_check")  # an FSDP slice's measurements beyond its points, kept on refit


def launch_point(plain: dict) -> Point:
    """A slice's plain step at B = 1 (training/shape_benchmark.py's _plain_step record) as a fit's launch point."""
    return Point(plain["bucket"], int(plain["S"]), int(plain["B"]), True, ms=float(plain["ms"]),
                 ms_runs=[float(plain["ms"])], optim_ms=plain.get("optim_ms"), why="launch: a plain step, outside the scan")


def _stored_launch_point(rec: dict, ext: Optional[dict]) -> Optional[Point]:
    """The record's launch point; for a slice written before launch points, its plain step at the scan's depth."""
    if rec.get("launch_point"):
        return Point(**rec["launch_point"])
    plain = ((rec.get("slice_memory") or {}).get("plain_step") or {}).get(str((ext or {}).get("blocks_timed")))
    return launch_point(plain) if plain else None


def refit(cal: Calibration, min_tokens: Optional[float]) -> Calibration:
    """The same measured points fitted again (e.g. with another min_tokens, or a newer form of the cost or memory
    model); no device needed. The simulator's "chosen" settings are dropped: they were chosen on the old fits."""
    ext = cal.data.get("extrapolation") or {}
    scale = float(ext.get("scale", 1.0))
    for mode, rec in list(cal.data["modes"].items()):
        points = [Point(**p) for p in rec["points"]]
        cost = rec.get("cost_model") or {}  # an MMDiT scan fitted joint attention over S + L: so does the refit
        old_mem = rec.get("memory_model")
        sliced = "slice_memory" in rec  # an FSDP slice: its memory model and optim_ms come from beyond the points
        new = fit_mode(points, scale=scale, L=cost.get("L"), joint=bool(cost.get("joint")),
                       memory_valid=old_mem is not None and not sliced, min_tokens=min_tokens,
                       launch=_stored_launch_point(rec, cal.data.get("extrapolation")),
                       depth_factors=cal.affine_scales(mode) if rec.get("fit_depth") == "affine" else None)
        if old_mem is not None and (sliced or new.get("memory_model") is None or not old_mem.get("measured", True)):
            new["memory_model"] = old_mem  # an estimate (no peaks among the points) or a slice's FSDP model stays
        if rec.get("optim_ms") is None or sliced:
            new["optim_ms"] = rec.get("optim_ms")
        new.update({k: rec[k] for k in SLICE_KEYS if k in rec})
        cal.data["modes"][mode] = new
    chosen = cal.data.get("chosen") or {}
    if "by_world_size" in chosen or "by_tokens_per_step" in chosen:  # chosen on the old fits, m_mem too
        del cal.data["chosen"]
        cal.data["notes"].append("the simulator's chosen settings were dropped on refit: run "
                                 "scripts/simulate_cluster.py again to choose them on the new fits")
    return cal


def new_calibration(modes: dict, *, model: dict, source: str, device: str, date: str, command: str,
                    hbm_bytes: Optional[float] = None, extrapolation: Optional[dict] = None,
                    notes: Optional[list] = None, world_size: int = 1) -> Calibration:
    return Calibration({"format": FORMAT, "source": source, "device": device, "date": date, "command": command,
                        "world_size": world_size, "model": model, "hbm_bytes": hbm_bytes,
                        "extrapolation": extrapolation, "notes": notes or [], "modes": modes})

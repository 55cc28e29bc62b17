"""What a simulated micro-batch really takes: the simulator's truth, apart from the cost model the planner uses.

A planner predicts each micro-batch with a cost model fitted to a calibration scan; a simulator that also times
micro-batches with that model (× its own residuals) can only confirm the planner. The truths here come from
measurement instead:

    MeasuredTruth   the measured repeats of each (S, B) the scan timed, drawn at random; any other (S, B) from
                    those measurements by local interpolation — per measured S a line in B through its points
                    (t = α_S + β_S·B: between measured B the two that bracket it, outside them the smallest and
                    the largest; below the smallest never under t ∝ B through it, since the fixed part α is not
                    negative), between measured S log-linear in log S at the same B (the nearest two,
                    extrapolated outside), never the planner's global fit — times a relative noise drawn from the
                    repeats' spread. A replay's measured micro-batches (scripts/replay_plans.py) add to the table.
                    Its interpolation error is reported as leave-one-out: each measured (S, B) interpolated from
                    the others against its measured time (loo_errors).
    PolicyTruth     model.checkpointing=auto: each micro-batch runs the policy PartialRecompute.decide picks (k of L
                    blocks recomputed, j of them keeping their attention), its time blended from the measured truths
                    of the policies none, full and keep as the planner blends their cost models; where the choice is
                    one measured policy whole and that policy measured this (S, B), its own repeats. Beyond the
                    lengths a policy measured (none cannot run the longest clips) it is full's time × the two
                    policies' measured ratio at the nearest length both measured, not an extrapolation in S.
    ModelTruth      the old mode, for comparison: the planner's prediction × (1 + ε), ε from the fit's residuals.

and what an FSDP step adds on every rank:

    CommModel       per micro-batch FSDP2 all-gathers the parameters in forward and again in backward (reshard
                    after forward) and reduce-scatters the gradients: bytes = 2·param_bytes + grad_bytes, each rank
                    moving (R − 1)/R of them at `bandwidth` GB/s (bus bandwidth within a node of `ranks_per_node`,
                    `inter_node_bandwidth` beyond). Prefetch hides the gathers behind compute, so a micro-batch takes
                    max(compute, comm) + comm / blocks (the first block's gather is not hidden).
    slow ranks      {rank: factor}: a rank that is persistently slower (a throttled GPU, a busy host).
    slow buckets    {S: factor}: a length that runs slower than measured (a planted fault for tests).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

import numpy as np


class MeasuredTruth:
    """Micro-batch times from measurement: {(S, B): [ms of each repeat]} (see the module docstring)."""

    def __init__(self, measured: Mapping[tuple[int, int], Sequence[float]], name: str = "measured"):
        self.runs = {(int(S), int(B)): [float(t) for t in ts] for (S, B), ts in measured.items() if len(ts)}
        if not self.runs:
            raise ValueError("a measured truth needs at least one measured (S, B)")
        self.median = {k: float(np.median(v)) for k, v in self.runs.items()}
        by_S: dict[int, list[tuple[int, float]]] = {}
        for (S, B), t in sorted(self.median.items()):
            by_S.setdefault(S, []).append((B, t))
        self.by_S = by_S
        self.S_list = sorted(by_S)
        dev = [t / self.median[k] - 1.0 for k, ts in self.runs.items() if len(ts) > 1 for t in ts]
        self.noise = np.asarray(dev if dev else [0.0], dtype=np.float64)
        self.name = name

    @classmethod
    def from_points(cls, points: Sequence[Mapping], extra: Optional[Mapping] = None) -> "MeasuredTruth":
        """From a calibration's points (dicts with S, B, ms_runs or ms, feasible) and optional extra measurements
        {(S, B): [ms, ...]} (a replay's)."""
        table: dict[tuple[int, int], list[float]] = {}
        for p in points:
            if p.get("feasible", True) and (p.get("ms_runs") or p.get("ms")):
                table.setdefault((int(p["S"]), int(p["B"])), []).extend(p.get("ms_runs") or [p["ms"]])
        for k, ts in (extra or {}).items():
            table.setdefault((int(k[0]), int(k[1])), []).extend(ts)
        return cls(table)

    def _at_S(self, S: int, B: float) -> float:
        """ms at a measured S: the line through its two nearest B (one point: ∝ B through it)."""
        pts = self.by_S[S]
        if len(pts) == 1:
            B0, t0 = pts[0]
            return t0 * B / B0
        if pts[0][0] <= B <= pts[-1][0]:  # between measured B: the two that bracket it
            hi = next(i for i, (b, _) in enumerate(pts) if b >= B)
            (B1, t1), (B2, t2) = pts[max(hi - 1, 0)], pts[max(hi, 1)]
        else:  # outside them: the line through the smallest and the largest measured B, whose slope a little
            # noise on two close points (B = 38 and 39, say) cannot tilt
            (B1, t1), (B2, t2) = pts[0], pts[-1]
        if B2 == B1:
            return t1
        beta = (t2 - t1) / (B2 - B1)
        t = t1 + beta * (B - B1)
        if B < B1:  # below the smallest measured B a steep line runs towards 0: a micro-batch's time has a
            # non-negative fixed part (t = α + β·B, α ≥ 0), so t(B) ≥ t(B1)·B/B1 — never less than proportional
            t = max(t, t1 * B / B1)
        return max(t, 1e-3)

    def mean(self, B: int, S: int) -> float:
        """The measured (median) ms of (S, B), or its interpolation from the measurements."""
        if (S, B) in self.median:
            return self.median[(S, B)]
        if S in self.by_S:
            return self._at_S(S, B)
        Ss = self.S_list
        if len(Ss) == 1:
            return self._at_S(Ss[0], B) * S / Ss[0]
        i = int(np.searchsorted(Ss, S))
        lo, hi = (Ss[0], Ss[1]) if i == 0 else (Ss[-2], Ss[-1]) if i >= len(Ss) else (Ss[i - 1], Ss[i])
        t_lo, t_hi = self._at_S(lo, B), self._at_S(hi, B)
        w = (math.log(S) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return math.exp((1 - w) * math.log(t_lo) + w * math.log(t_hi))

    def draw(self, B: int, S: int, rng: np.random.Generator) -> float:
        if (S, B) in self.runs:  # a measured micro-batch: one of its own repeats
            return float(rng.choice(self.runs[(S, B)]))
        return self.mean(B, S) * (1.0 + float(rng.choice(self.noise)))

    def is_measured(self, B: int, S: int) -> bool:
        """Whether (S, B) takes measured repeats (True) or an interpolation (False)."""
        return (S, B) in self.runs

    def loo_errors(self) -> list[tuple[int, int, float, float]]:
        """(S, B, measured median ms, relative error of its interpolation from the other points) for every measured
        (S, B): what interpolation gets wrong where nothing was measured. A lone S left out is interpolated (or
        extrapolated) across the other lengths; with one point in all there is nothing to leave out."""
        out = []
        for (S, B), t in sorted(self.median.items()):
            rest = {k: v for k, v in self.runs.items() if k != (S, B)}
            if rest:
                out.append((S, B, t, MeasuredTruth(rest).mean(B, S) / t - 1.0))
        return out

    def describe(self) -> str:
        return (f"the measured times of {len(self.runs)} (S, B) micro-batches, {sum(map(len, self.runs.values()))} "
                f"repeats (each drawn as measured; other (S, B) interpolated between them; noise from the repeats' "
                f"spread, ±{100 * abs(self.noise).max():.1f} % at most)")


class PolicyTruth:
    """model.checkpointing=auto's truth (module docstring). decide(B, S) → (k, j) or k (no kept attention); truths:
    {policy: MeasuredTruth} with "none" and "full", "keep" where measured (without it a kept block earns no time,
    as in PartialRecompute.predict)."""

    def __init__(self, truths: Mapping[str, MeasuredTruth], decide: Callable, layers: int,
                 name: str = "measured per policy, each micro-batch at checkpointing=auto's choice"):
        missing = {"none", "full"} - set(truths)
        if missing:
            raise ValueError(f"checkpointing=auto's truth needs the policies none and full measured; {sorted(missing)} "
                             "missing: calibrate with model.checkpointing=auto")
        self.truths, self.decide, self.layers, self.name = dict(truths), decide, int(layers), name

    def policy_mean(self, pol: str, B: int, S: int) -> float:
        """One policy's ms at (S, B): its own measurements within the lengths it measured; beyond them full's ×
        their ratio at its nearest measured length (module docstring)."""
        own, full = self.truths[pol], self.truths["full"]
        if pol == "full" or own.S_list[0] <= S <= own.S_list[-1]:
            return own.mean(B, S)
        edge = own.S_list[-1] if S > own.S_list[-1] else own.S_list[0]
        return full.mean(B, S) * own.mean(B, edge) / full.mean(B, edge)

    def _kj(self, B: int, S: int) -> tuple[int, int]:
        d = self.decide(B, S)
        return (int(d), 0) if isinstance(d, (int, np.integer)) else (int(d[0]), int(d[1]))

    def policy(self, B: int, S: int) -> Optional[str]:
        """The one measured policy the micro-batch runs whole (none, full or keep), or None where it blends them."""
        k, j = self._kj(B, S)
        if k == 0:
            return "none"
        if k == self.layers and j == 0:
            return "full"
        if k == self.layers and j == self.layers and "keep" in self.truths:
            return "keep"
        return None

    def mean(self, B: int, S: int) -> float:
        k, j = self._kj(B, S)
        L = self.layers
        t_full = self.truths["full"].mean(B, S)
        t_none = self.policy_mean("none", B, S) if k < L else t_full
        t_keep = self.policy_mean("keep", B, S) if "keep" in self.truths and j else t_full
        return t_none + k / L * (t_full - t_none) - j / L * (t_full - t_keep)

    def is_measured(self, B: int, S: int) -> bool:
        pol = self.policy(B, S)
        return pol is not None and self.truths[pol].is_measured(B, S)

    def draw(self, B: int, S: int, rng: np.random.Generator) -> float:
        pol = self.policy(B, S)
        if pol is not None:
            return self.truths[pol].draw(B, S, rng)
        noise = np.concatenate([t.noise for t in self.truths.values()])
        return self.mean(B, S) * (1.0 + float(rng.choice(noise)))

    def loo_errors(self) -> list[tuple[str, int, int, float, float]]:
        """(policy, S, B, ms, relative error) for every measured point of every policy: its time from the rest by
        the rule the truth uses (policy_mean: within the policy, or full's × the ratio where the point was the
        policy's longest or shortest length), against its measured median."""
        out = []
        for pol, t in self.truths.items():
            for (S, B), ms in sorted(t.median.items()):
                rest = {k: v for k, v in t.runs.items() if k != (S, B)}
                if rest:
                    other = PolicyTruth({**self.truths, pol: MeasuredTruth(rest)}, self.decide, self.layers)
                    out.append((pol, S, B, ms, other.policy_mean(pol, B, S) / ms - 1.0))
        return out

    def describe(self) -> str:
        n = {pol: len(t.runs) for pol, t in self.truths.items()}
        return (f"{self.name}: the policies' measured (S, B) ({', '.join(f'{k} {v}' for k, v in n.items())}), "
                f"{sum(sum(map(len, t.runs.values())) for t in self.truths.values())} repeats; a micro-batch that "
                "runs one policy whole at a measured (S, B) draws its repeats, any other is interpolated within each "
                "policy and blended by the blocks recomputed and kept (as the planner's PartialRecompute.predict)")


class ModelTruth:
    """The old mode: the planner's own prediction × (1 + ε), ε bootstrapped from the (centred) fit residuals."""

    def __init__(self, cost_fn: Callable[[int, int], float], residuals: Optional[Sequence[float]] = None):
        self.cost_fn = cost_fn
        res = np.asarray(residuals if residuals is not None and len(residuals) else [0.0], dtype=np.float64)
        self.noise = res - res.mean()  # model error, not bias: the fit's mean residual is not a slowdown
        self.name = "model"

    def mean(self, B: int, S: int) -> float:
        return float(self.cost_fn(B, S))

    def draw(self, B: int, S: int, rng: np.random.Generator) -> float:
        return self.mean(B, S) * (1.0 + float(rng.choice(self.noise)))

    def is_measured(self, B: int, S: int) -> bool:
        return False  # every micro-batch is the model's

    def describe(self) -> str:
        return "the planner's model × its residuals (the old mode)"


@dataclass
class CommModel:
    """FSDP2's collectives per micro-batch on each rank (module docstring); None bandwidth: no communication."""
    param_bytes: float                 # one full copy of the parameters as FSDP gathers them (fp32: 4·P)
    grad_bytes: float                  # what each micro-batch reduce-scatters (fp32 gradients: 4·P)
    blocks: int                        # FSDP units: the first one's gather is not hidden
    bandwidth: float = 350.0           # GB/s per rank within a node (NVLink, NCCL bus bandwidth)
    inter_node_bandwidth: float = 50.0  # GB/s per rank across nodes (one 400 Gb/s NIC a GPU)
    ranks_per_node: int = 8

    def ms(self, R: int) -> float:
        if R <= 1:
            return 0.0
        bw = self.bandwidth if R <= self.ranks_per_node else self.inter_node_bandwidth
        return (2 * self.param_bytes + self.grad_bytes) * (R - 1) / R / (bw * 1e9) * 1e3

    def apply(self, t_RM: np.ndarray, R: int) -> np.ndarray:
        c = self.ms(R)
        return np.maximum(t_RM, c) + c / max(1, self.blocks) if c > 0 else t_RM

    def describe(self, R: int) -> str:
        bw = self.bandwidth if R <= self.ranks_per_node else self.inter_node_bandwidth
        return (f"FSDP: 2 × {self.param_bytes / 1e9:.1f} GB gathered + {self.grad_bytes / 1e9:.1f} GB reduced per "
                f"micro-batch at {bw:g} GB/s → {self.ms(R):.0f} ms at R = {R}, hidden behind compute but the first "
                f"of {self.blocks} units")


@dataclass
class Cluster:
    """The truth of a simulated cluster: per-micro-batch times, FSDP's collectives, persistently slow ranks and
    planted slow lengths."""
    truth: object                                   # MeasuredTruth | ModelTruth: .draw(B, S, rng), .mean(B, S)
    comm: Optional[CommModel] = None
    slow_ranks: dict = field(default_factory=dict)  # rank → factor
    slow_S: dict = field(default_factory=dict)      # S → factor

    def times(self, plan, rng: np.random.Generator) -> np.ndarray:
        """(R, M) ms of every (rank, slot) of a StepPlan."""
        t = np.array([[self.truth.draw(mb.B, mb.S, rng) * self.slow_S.get(mb.S, 1.0) for mb in rank]
                      for rank in plan.ranks], dtype=np.float64)
        for r, f in self.slow_ranks.items():
            if r < t.shape[0]:
                t[r] *= f
        return self.comm.apply(t, t.shape[0]) if self.comm is not None else t

    def measured_share(self, plans) -> Optional[float]:
        """The share of the plans' micro-batch time (the truth's mean ms) that measured (S, B) give, the rest being
        interpolated; None for a truth that cannot say."""
        is_measured = getattr(self.truth, "is_measured", None)
        if is_measured is None:
            return None
        seen: dict = {}
        total = measured = 0.0
        for plan in plans:
            for rank in plan.ranks:
                for mb in rank:
                    key = (mb.B, mb.S)
                    if key not in seen:
                        seen[key] = (self.truth.mean(mb.B, mb.S), is_measured(mb.B, mb.S))
                    t, m = seen[key]
                    total += t
                    measured += t if m else 0.0
        return measured / total if total > 0 else None

    def describe(self, R: int) -> str:
        parts = [f"truth: {self.truth.name}"]
        if self.comm is not None:
            parts.append(self.comm.describe(R))
        if self.slow_ranks:
            parts.append(f"slow ranks {self.slow_ranks}")
        if self.slow_S:
            parts.append(f"slow lengths {self.slow_S}")
        return "; ".join(parts)

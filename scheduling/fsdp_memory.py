"""Peak memory per rank of a training step under FSDP2 over R ranks, from a one-device slice of the model's blocks.

The slice: k of the model's L blocks at full width, on one device, measured at two depths k1 ≠ k2 with each gradient
discarded as soon as it is accumulated (FSDP's reduce-scatter frees a block's unsharded gradients the same way), so
that a peak holds what a rank holds, less what FSDP shards or gathers. P(k) = P0 + k·P_b parameters (P0: embedders,
head and tables outside the blocks; P_b: one block's). Three peaks of a step, each measured:
    forward's end    peak_f(k) = 12·P(k) + k·x_f + W_f + cache(k) + (k·a_f + r_f)·B·S + (k·s_f + s0_f)·B
    backward's start peak_b(k) = 12·P(k) + k·x_b + W_b + (k·a + r)·B·S + (k·s + s0)·B
    optimizer step   floor(k)  = (16 + τ)·P(k) + W_o            (gradients kept: the update's peak)
12 B/param: fp32 weights and AdamW's two moments; 16: with fp32 gradients; τ: the update's temporaries a parameter.
a: bytes a token a block (its checkpointed input); r: bytes a token whatever the depth (one block's recompute, the
head); s, s0: bytes a sample (its text tokens); x: a block's bytes beyond its weights and moments (≈ 0 if the
decomposition holds — the check of this split); W: workspace; cache(k) = k·cache_b + cache_0: autocast's bf16 weight
casts, held until autocast exits after the forward (measured directly as the bytes freed there). fit_slice_line fits
each line over both depths' points at once (one least squares in the six unknowns), which separates every per-block
term from its fixed part.

Per rank at the full depth L over R ranks, FSDP2 as models/parallelize.py applies it (fully_shard per block and at the
root, fp32 parameters all-gathered as they are — no MixedPrecisionPolicy —, resharded after forward):
    sharded    σ·P(L)/R                   σ = 16 B/param (fp32 weights, gradients, m, v) + 4 with EMA (sharded too)
    gathered   u·(n_g·P_b + P0)           u = 4 (fp32): the running and the prefetched block (n_g = 2), and the
                                          root's parameters, unsharded through the forward and through the backward
    grads      u·n_r·P_b                  backward: the block's unsharded gradients and the previous block's
                                          reduce-scatter input (n_r = 2)
    forward    sharded + gathered + L·x_f + W_f + L·cache_b + cache_0 + (L·a_f + r_f)·B·S + (L·s_f + s0_f)·B
    backward   sharded + gathered + grads + L·x_b + W_b + (L·a + r)·B·S + (L·s + s0)·B
    floor      (σ + τ)·P(L)/R + W_o
    peak(B, S) = max(floor, forward, backward)
R = 1 is one process without FSDP: nothing gathered. Activations are per rank (each rank runs its own micro-batch),
so they do not shrink with R; nor does autocast's cache, which holds a bf16 copy of each unsharded weight it casts.
    max_batch(S) = min over the two lines of ⌊(budget − c0)/(c1·S + c2)⌋, 0 where floor > budget
    m_mem(S_min) = min over the two lines of ⌊(budget − c0)/(c1 + c2/S_min)⌋
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Mapping, Optional, Sequence

import numpy as np

from scheduling.cost_model import MemoryModel, _full_rank, _weighted_nnls

KIND = "fsdp"
WEIGHTS_AND_MOMENTS = 12.0  # B/param: fp32 weights, AdamW m and v (the slice discards its gradients)
WITH_GRADS = 16.0           # B/param: and fp32 gradients
EMA_BYTES = 4.0             # B/param: the fp32 EMA copy (training/optim.py EMA), sharded like the weights
DEFAULT_OPTIM_BYTES = 4.0   # τ where no floor was measured at two depths (Wan 1.3B's update: 20.1 B/param,
                            # results/calibration_h200.json)
PER_SAMPLE_MIN_POINTS = 7  # the per-sample terms are fitted from this many points (one more than the six unknowns)
LINE_TERMS = ("c0_fixed", "c0_block", "c1_fixed", "c1_block", "c2_fixed", "c2_block")


def fit_slice_line(rows: Sequence[tuple]) -> dict:
    """peak ≈ (c0_fixed + k·c0_block) + (c1_fixed + k·c1_block)·B·S + (c2_fixed + k·c2_block)·B over rows of
    (k, B, S, peak_bytes) at two or more depths k; least squares on relative residuals, every term ≥ 0 (each is a
    size). The per-sample terms are fitted only where B varies apart from B·S within the points (else 0)."""
    k, B, S, y = (np.asarray(c, dtype=np.float64) for c in zip(*rows)) if rows else (np.zeros(0),) * 4
    if len(np.unique(k)) < 2:
        raise ValueError(f"a slice line needs points at two or more depths, got depths {sorted(set(k.tolist()))}")
    T = B * S
    cols = [np.ones_like(k), k, T, k * T]
    X = np.stack(cols + [B, k * B], axis=1)
    per_sample = len(y) >= PER_SAMPLE_MIN_POINTS and _full_rank(X)
    if not per_sample:
        X = np.stack(cols, axis=1)
        if not _full_rank(X):
            raise ValueError("a slice line needs, at each of two depths, points at two or more token counts B·S")
    c, _ = _weighted_nnls(X, y)
    c = np.concatenate([c, np.zeros(6 - len(c))])
    rel = (X @ c[:X.shape[1]] - y) / y
    out = dict(zip(LINE_TERMS, (float(v) for v in c)))
    out.update(rel_rmse=float(np.sqrt(np.mean(rel ** 2))), max_rel_err=float(np.max(np.abs(rel))),
               n_points=int(len(y)), depths=sorted(int(d) for d in set(k.tolist())))
    return out


def _per_block(by_depth: Mapping[int, float]) -> tuple[float, float]:
    """(per block, fixed) of a quantity measured at two depths: v(k) = fixed + k·per_block."""
    (k1, v1), (k2, v2) = sorted((int(k), float(v)) for k, v in by_depth.items())[-2:]
    per = (v2 - v1) / (k2 - k1)
    return per, v2 - k2 * per


@dataclass
class FSDPMemoryModel:
    """Per-rank peak bytes of a training step under FSDP2 over `ranks` ranks (module docstring); the planners use it
    as they use MemoryModel: predict, max_batch, m_mem, describe, to_dict / from_dict."""
    ranks: int                  # R
    layers: int                 # L, the full model's blocks
    params_block: float         # P_b
    params_fixed: float         # P0
    act_block: float            # a: bytes a token a block at the backward's start
    act_fixed: float            # r: bytes a token whatever the depth
    work: float                 # W_b
    act_block_fwd: float        # a_f, r_f, W_f: the same at the forward's end
    act_fixed_fwd: float
    work_fwd: float
    floor_work: float           # W_o
    sample_block: float = 0.0   # s, s0: bytes a sample (backward); s_f, s0_f at the forward's end
    sample_fixed: float = 0.0
    sample_block_fwd: float = 0.0
    sample_fixed_fwd: float = 0.0
    extra_block: float = 0.0    # x_b, x_f: a block's bytes beyond weights and moments (unsharded)
    extra_block_fwd: float = 0.0
    cache_block: float = 0.0    # autocast's cast cache a block, and outside the blocks
    cache_fixed: float = 0.0
    state_bytes: float = WITH_GRADS           # σ
    optim_bytes: float = DEFAULT_OPTIM_BYTES  # τ
    gather_bytes: float = 4.0                 # u
    gathered_blocks: float = 2.0              # n_g
    grad_blocks: float = 2.0                  # n_r
    measured: bool = True

    def __post_init__(self):
        if int(self.ranks) != self.ranks or self.ranks < 1 or self.layers < 1:
            raise ValueError(f"an FSDP memory model needs ranks ≥ 1 and layers ≥ 1, got {self.ranks}, {self.layers}")
        self.ranks = int(self.ranks)

    # ------------------------------------------------------------------------------------------ the terms
    @property
    def params(self) -> float:
        return self.params_fixed + self.layers * self.params_block

    @property
    def sharded(self) -> float:
        return self.state_bytes * self.params / self.ranks

    @property
    def gathered(self) -> float:
        return 0.0 if self.ranks == 1 else self.gather_bytes * (self.gathered_blocks * self.params_block
                                                                + self.params_fixed)

    @property
    def unsharded_grads(self) -> float:
        return 0.0 if self.ranks == 1 else self.gather_bytes * self.grad_blocks * self.params_block

    @property
    def floor(self) -> float:
        return (self.state_bytes + self.optim_bytes) * self.params / self.ranks + self.floor_work

    def lines(self) -> dict[str, tuple[float, float, float]]:
        """(c0, c1, c2) of the forward's end and the backward's start: peak = c0 + c1·B·S + c2·B."""
        L = self.layers
        fwd = (self.sharded + self.gathered + L * self.extra_block_fwd + self.work_fwd
               + L * self.cache_block + self.cache_fixed,
               L * self.act_block_fwd + self.act_fixed_fwd, L * self.sample_block_fwd + self.sample_fixed_fwd)
        bwd = (self.sharded + self.gathered + self.unsharded_grads + L * self.extra_block + self.work,
               L * self.act_block + self.act_fixed, L * self.sample_block + self.sample_fixed)
        return {"forward": fwd, "backward": bwd}

    @property
    def c1(self) -> float:
        """Bytes a token of the line that grows fastest with B·S (MemoryModel's c1, for callers that check it)."""
        return max(c1 for _, c1, _ in self.lines().values())

    # ------------------------------------------------------------------------------------------ planners' API
    def _bounding_lines(self):
        lines = list(self.lines().values())
        if any(c1 <= 0 for _, c1, _ in lines):
            raise ValueError("the FSDP memory model has a line without a per-token cost (c1 ≤ 0): it cannot bound B·S")
        return lines

    def predict(self, B, S):
        B, S = np.asarray(B, dtype=np.float64), np.asarray(S, dtype=np.float64)
        peak = np.full(np.broadcast(B, S).shape, self.floor)
        for c0, c1, c2 in self.lines().values():
            peak = np.maximum(peak, c0 + c1 * B * S + c2 * B)
        return peak

    def max_batch(self, S: float, budget_bytes: float) -> int:
        """Largest B whose predicted peak at sequence length S stays within budget_bytes (0 when none does)."""
        if self.floor > budget_bytes:
            return 0
        return max(0, min(math.floor((budget_bytes - c0) / (c1 * S + c2) * (1 + 1e-12))
                          for c0, c1, c2 in self._bounding_lines()))

    def m_mem(self, budget_bytes: float, S_min: Optional[float] = None) -> int:
        """Largest B·S whose predicted peak stays within budget_bytes for every bucket with S ≥ S_min (0 when none
        does); S_min is needed where a line has a per-sample term."""
        lines = self._bounding_lines()
        if any(c2 > 0 for _, _, c2 in lines) and not S_min:
            raise ValueError("this memory model has a per-sample term: m_mem needs the shortest bucket's S (S_min)")
        if self.floor > budget_bytes:
            return 0
        return max(0, min(math.floor((budget_bytes - c0) / (c1 + (c2 / S_min if c2 > 0 else 0.0)) * (1 + 1e-12))
                          for c0, c1, c2 in lines))

    def for_ranks(self, ranks: int) -> "FSDPMemoryModel":
        """The same model over another number of ranks (states ÷ R; everything else per rank as it was)."""
        return replace(self, ranks=int(ranks))

    def describe(self) -> str:
        g = lambda v: f"{v / 2**30:.1f} GiB"
        (f0, f1, _), (b0, b1, b2) = self.lines()["forward"], self.lines()["backward"]
        s = (f"FSDP over {self.ranks} rank(s), {self.layers} blocks: sharded states {g(self.sharded)} "
             f"({self.state_bytes:g} B/param ÷ {self.ranks}), gathered {g(self.gathered + self.unsharded_grads)}; "
             f"backward {g(b0)} + {b1 / 2**10:.0f} KiB per token")
        if b2:
            s += f" + {b2 / 2**20:.1f} MiB per sample"
        s += f"; forward's end {g(f0)} + {f1 / 2**10:.0f} KiB per token; at least {g(self.floor)} (the optimizer step)"
        return s

    def to_dict(self) -> dict:
        return {"kind": KIND, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "FSDPMemoryModel":
        if d.get("kind") != KIND:
            raise ValueError(f"not an FSDP memory model (kind {d.get('kind')!r})")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    # ------------------------------------------------------------------------------------------ from a slice
    @classmethod
    def from_slice(cls, backward: dict, forward: dict, floor: Mapping[int, float], cache: Mapping[int, float], *,
                   layers: int, params_block: float, params_fixed: float, ranks: int, ema: bool = False,
                   **knobs) -> "FSDPMemoryModel":
        """From the slice's measured lines (fit_slice_line of the backward's and the forward's peaks), its optimizer
        step's peak and autocast's cache at two depths (depth → bytes; a floor missing at a depth gives τ =
        DEFAULT_OPTIM_BYTES and W_o = W_b); knobs: gather_bytes, gathered_blocks, grad_blocks."""
        Pb, P0 = float(params_block), float(params_fixed)
        cache_block, cache_fixed = (_per_block(cache) if len(cache) >= 2
                                    else (0.0, float(max(cache.values(), default=0.0))))
        work = backward["c0_fixed"] - WEIGHTS_AND_MOMENTS * P0
        extra = backward["c0_block"] - WEIGHTS_AND_MOMENTS * Pb
        work_fwd = forward["c0_fixed"] - WEIGHTS_AND_MOMENTS * P0 - cache_fixed
        extra_fwd = forward["c0_block"] - WEIGHTS_AND_MOMENTS * Pb - cache_block
        floors = {k: v for k, v in floor.items() if v is not None}
        if len(floors) >= 2:
            per_block, fixed = _per_block(floors)
            tau = per_block / Pb - WITH_GRADS
            floor_work = fixed - (WITH_GRADS + tau) * P0
        else:
            tau, floor_work = DEFAULT_OPTIM_BYTES, work
        return cls(ranks=ranks, layers=layers, params_block=Pb, params_fixed=P0,
                   act_block=backward["c1_block"], act_fixed=backward["c1_fixed"], work=work,
                   act_block_fwd=forward["c1_block"], act_fixed_fwd=forward["c1_fixed"], work_fwd=work_fwd,
                   floor_work=floor_work, sample_block=backward["c2_block"], sample_fixed=backward["c2_fixed"],
                   sample_block_fwd=forward["c2_block"], sample_fixed_fwd=forward["c2_fixed"],
                   extra_block=extra, extra_block_fwd=extra_fwd, cache_block=cache_block, cache_fixed=cache_fixed,
                   state_bytes=WITH_GRADS + (EMA_BYTES if ema else 0.0), optim_bytes=tau, **knobs)

    def checks(self) -> dict:
        """The split's checks, per parameter of a block: what the slice held at the backward's start and at the
        forward's end beyond the cache (expected 12: weights and moments) and at the optimizer step (16 + τ)."""
        Pb = self.params_block
        return {"backward_bytes_per_param": WEIGHTS_AND_MOMENTS + self.extra_block / Pb,
                "forward_bytes_per_param": WEIGHTS_AND_MOMENTS + self.extra_block_fwd / Pb,
                "optimizer_step_bytes_per_param": WITH_GRADS + self.optim_bytes,
                "cache_bytes_per_param": self.cache_block / Pb}


def memory_model_from_dict(d: dict):
    """A calibration record's memory model: FSDPMemoryModel where it says kind "fsdp", else MemoryModel."""
    return FSDPMemoryModel.from_dict(d) if d.get("kind") == KIND else MemoryModel.from_dict(d)


# ------------------------------------------------------------------------------------------------- the file's record
def depth_check(points: Mapping[int, Sequence[dict]], layers: int, main: int,
                launch: Optional[Mapping[int, Optional[dict]]] = None) -> dict:
    """The cost extrapolation against the two depths: at each (bucket, B) timed at both, t(k) = t_fixed + k·t_block;
    the full depth's time as the cost model extrapolates it, t(main)·L/main, against t_fixed + L·t_block (the
    scaling counts the part outside the blocks L/main times). launch: depth → a launch-bound plain step's
    {bucket, S, B, ms}, whose host-bound time is checked the same way (a launch floor scales per block too)."""
    other = [k for k in points if k != main]
    if not other:
        return {}
    second = other[0]

    def row(bucket, S, B, t1, t2):
        per = (t1 - t2) / (main - second)
        fixed = t1 - main * per
        affine, scaled = fixed + layers * per, t1 * layers / main
        return {"bucket": bucket, "S": S, "B": B, "ms": {str(main): t1, str(second): t2}, "block_ms": per,
                "fixed_ms": fixed, "full_affine_ms": affine, "full_scaled_ms": scaled,
                "scaled_over_affine": scaled / affine - 1 if affine > 0 else None}

    timed = {k: {(p["bucket"], p["B"]): p for p in pts if p.get("feasible") and p.get("ms")}
             for k, pts in points.items()}
    rows = [row(b, p["S"], B, p["ms"], timed[second][(b, B)]["ms"])
            for (b, B), p in timed[main].items() if (b, B) in timed[second]]
    out = {"depths": [main, second], "points": rows,
           "max_abs_scaled_over_affine": max((abs(r["scaled_over_affine"]) for r in rows
                                              if r["scaled_over_affine"] is not None), default=None)}
    if launch and launch.get(main) and launch.get(second):
        a, b = launch[main], launch[second]
        out["launch"] = row(a["bucket"], a["S"], a["B"], a["ms"], b["ms"])
    return out


def slice_record(*, main: int, second: int, points: Mapping[int, Sequence[dict]],
                 peaks: Mapping[int, Sequence[dict]], plain: Mapping[int, Optional[dict]], layers: int,
                 params_block: float, params_fixed: float, ranks: int, ema: bool, budget: Optional[float],
                 largest: Optional[tuple] = None) -> dict:
    """What a slice calibrated at depths main and second adds to a checkpointing mode's record: the FSDP memory
    model over `ranks` (None where the device gave no peaks), the slice's measurements ("slice_memory"), the
    cost extrapolation's check ("depth_check") and notes for the file. The main depth's points are the record's own;
    the other depth's are kept in slice_memory.

    points: depth → the timed points (bucket, S, B, feasible, ms); peaks: depth → one row per timed point (bucket, S,
    B, forward, backward, cache: bytes, of the timed repeats); plain: depth → the plain step (gradients kept) at the
    shortest bucket, B = 1 (bucket, S, B, ms, optim_ms, peak_bytes: the optimizer step's); largest: (B, S) of the
    scan's largest ladder micro-batch, where the note checks how many blocks fit."""
    P = lambda k: params_fixed + k * params_block
    g = lambda v: f"{v / 1e9:.1f} GB"
    floors = {k: (p or {}).get("peak_bytes") for k, p in plain.items()}
    caches = {k: max((r["cache"] for r in rows), default=0.0) for k, rows in peaks.items() if rows}
    out: dict = {"memory_model": None, "notes": [],
                 "slice_memory": {"depths": [main, second], "ranks": ranks, "params_block": params_block,
                                  "params_fixed": params_fixed, "peaks": {str(k): list(v) for k, v in peaks.items()},
                                  "points": {str(k): list(v) for k, v in points.items() if k != main},
                                  "plain_step": {str(k): v for k, v in plain.items()},
                                  "cache": {str(k): v for k, v in caches.items()}},
                 "depth_check": depth_check(points, layers, main, plain)}
    notes = out["notes"]
    dc = out["depth_check"]
    if dc.get("points"):
        notes.append(f"cost extrapolated ×{layers}/{main} from the {main}-block scan; at the {len(dc['points'])} "
                     f"points timed at {main} and {second} blocks it differs from t_fixed + {layers}·t_block by at "
                     f"most {100 * dc['max_abs_scaled_over_affine']:.1f} % (the part outside the blocks counted "
                     f"{layers / main:.2g} times: depth_check)")
    if dc.get("launch"):
        la = dc["launch"]
        notes.append(f"plain step at the shortest bucket ({la['bucket']}, B = {la['B']}; launch-bound on a GPU): "
                     f"{la['ms'][str(main)]:.0f} ms at "
                     f"{main} blocks, {la['ms'][str(second)]:.0f} ms at {second}: {la['block_ms']:.1f} ms a block, "
                     f"{la['fixed_ms']:.0f} ms outside; ×{layers}/{main} gives {la['full_scaled_ms']:.0f} ms at "
                     f"{layers} blocks, the two depths {la['full_affine_ms']:.0f} ms")
    if not any(peaks.values()):
        notes.append("no FSDP memory model: no peaks were measured (a CPU has no device memory counters)")
        return out
    rows = {line: [(k, r["B"], r["S"], r[line]) for k, rs in peaks.items() for r in rs] for line in
            ("backward", "forward")}
    try:
        fits = {line: fit_slice_line(r) for line, r in rows.items()}
    except ValueError as e:
        notes.append(f"no FSDP memory model: {e}")
        return out
    out["slice_memory"].update(fits)
    model = FSDPMemoryModel.from_slice(fits["backward"], fits["forward"], floors, caches, layers=layers,
                                       params_block=params_block, params_fixed=params_fixed, ranks=ranks, ema=ema)
    out["memory_model"] = model.to_dict()
    c = model.checks()
    out["slice_memory"]["checks"] = c
    notes.append(f"memory: {model.describe()}. From peaks at {main} and {second} blocks with each gradient dropped "
                 f"as it was accumulated (as FSDP's reduce-scatter frees them); per block and fixed parts fitted "
                 f"over both depths (backward {100 * fits['backward']['rel_rmse']:.2f} % RMS over "
                 f"{fits['backward']['n_points']} peaks, forward {100 * fits['forward']['rel_rmse']:.2f} % over "
                 f"{fits['forward']['n_points']}); states {model.state_bytes:g} B/param ÷ R"
                 + (" (EMA included)" if ema else "") + "; FSDP's gathered blocks and root counted at fp32")
    notes.append(f"the split's check, per parameter of a block: {c['backward_bytes_per_param']:.2f} B held at the "
                 f"backward's start and {c['forward_bytes_per_param']:.2f} B at the forward's end beyond autocast's "
                 f"cache (12: fp32 weights and AdamW moments), {c['optimizer_step_bytes_per_param']:.2f} B at the "
                 f"optimizer step (16 + its temporaries), autocast's cast cache {c['cache_bytes_per_param']:.2f} B "
                 f"(held unsharded through the forward: {g(layers * model.cache_block + model.cache_fixed)} per rank "
                 f"at {layers} blocks)")
    if budget:
        S_min = min(r["S"] for rs in peaks.values() for r in rs)
        notes.append(f"m_mem over {ranks} ranks at the {g(budget)} budget: {model.m_mem(budget, S_min):,} tokens "
                     f"(S_min = {S_min}); the slice's largest measured micro-batch: "
                     f"{max(r['B'] * r['S'] for r in peaks[main]):,} tokens")
        if largest is not None:
            Bt, St = largest
            fits_k = [kk for kk in range(1, layers + 1)
                      if float(replace(model, ranks=1, layers=kk, state_bytes=WITH_GRADS).predict(Bt, St)) <= budget]
            kmax = max(fits_k, default=0)
            floor_main = floors.get(main)
            notes.append(
                f"slice size: {params_block / 1e6:.2f} M parameters a block, {params_fixed / 1e6:.2f} M outside; at "
                f"16 B/param (fp32 weights, gradients, AdamW m and v) {main} blocks hold {g(16 * P(main))}, "
                f"{main + 1} would hold {g(16 * P(main + 1))}"
                + (f"; the optimizer step peaked at {g(floor_main)} ({floor_main / P(main):.1f} B/param)"
                   if floor_main else "")
                + f". By the measured lines, with gradients held and the ladder's largest micro-batch "
                  f"({Bt * St:,.0f} tokens), the most blocks within the {g(budget)} budget: {kmax}")
    return out

"""From the scheduling config to what the planner needs: a batch size per bucket and a cost function.

Every knob is resolved in this order, and `Schedule.sources` records which source won it (the run logs it):
    1. the config (an explicit value: command line, preset or group file)
    2. the calibration file (scheduling.calibration): its memory model at scheduling.mem_budget_gib gives m_mem
       (an FSDP memory model over the run's world size: scheduling/fsdp_memory.py, its states rescaled as 1/R);
       the settings the cluster simulator chose ("chosen", at the nearest simulated world size); the power fit's p
    3. a default that always works: m_mem from the memory model at 90 % of the device's memory; m_tokens = the
       longest bucket's S, m_comp = S_max^p, target_microbatch_ms = the predicted ms of the longest bucket at B = 1
       (each: the longest bucket runs one sample per micro-batch)
The cost function is the calibration's cost model for model.checkpointing (for `auto`, with both `none` and `full`
measured: each micro-batch recomputes the fewest blocks that fit the budget, and its cost lies between the two
modes' in proportion: PartialRecompute). Without a calibration it is
the model's FLOPs (scheduling/efficiency.py) at `proxy_tflops`: enough for relative balance metrics, not for absolute
times. Settings that cannot work are refused with a ValueError naming the field. A calibration file that does not
exist is refused too, unless the strategy's knobs are all set in the config (equal_token's m_tokens; dual_constraint's
m_mem, m_comp and p): the run then goes on without it and says so in its notes.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

from scheduling.batching import _check_fits, batch_sizes
from scheduling.calibrate import HBM_FRACTION, Calibration
from scheduling.config import SchedulingConfig
from scheduling.fsdp_memory import FSDPMemoryModel
from scheduling.planner import check_m_mem, resolve_planner
from scheduling.efficiency import model_flops

# the knobs that, all set in the config, let a strategy run without its calibration file
SELF_SUFFICIENT = {"equal_token": ("m_tokens",), "dual_constraint": ("m_mem", "m_comp", "p")}


@dataclass
class ModelShape:
    """What the FLOP proxy needs to know of the model (plain numbers: scheduling never imports models)."""
    p_matmul: int
    layers: int
    dim: int
    text_len: int

    @classmethod
    def of(cls, model_cfg, p_matmul: int) -> "ModelShape":
        """From a model config (attention_layers, dim, text_len) and the built model's matmul parameter count."""
        return cls(p_matmul, model_cfg.attention_layers, model_cfg.dim, model_cfg.text_len)


class PoolLeavesNoRoom(ValueError):
    """The CUDA graphs' pool leaves the longest bucket no room beside it (resolve_schedule tries without graphs)."""


@dataclass
class Schedule:
    strategy: str
    batch_sizes: dict  # bucket name → B
    cost_fn: Callable[[int, int], float]
    sources: dict = field(default_factory=dict)  # knob → where its value came from
    values: dict = field(default_factory=dict)   # knob → the value used (m_mem, m_tokens, m_comp, p, target ms)
    window: int = 1
    planner: str = "stream"              # stream | sorted | windowed | reformed (scheduling/planner.py)
    micro_batches: Optional[int] = None  # M chosen for scheduling.tokens_per_step (None: train.micro_batches)
    # model.checkpointing=auto: (B, S) → blocks to recompute, or (blocks, of them keeping attention) with
    # model.keep_attention
    recompute_blocks: Optional[Callable[[int, int], object]] = None
    notes: list = field(default_factory=list)    # warnings for the log (e.g. a bucket over the target ms)
    # the largest micro-batch (tokens) the run captures as a CUDA graph: the graph_tokens asked for, or less where
    # no planned micro-batch reaches it (resolve_schedule); the trainer captures none above it
    graph_tokens: Optional[int] = None

    @property
    def m_mem(self) -> Optional[float]:
        """The memory bound on B·S (tokens a micro-batch), None where the run does not know it."""
        return self.values.get("m_mem")

    def table(self, tokens: Mapping[str, int]) -> str:
        rows = [f"{'bucket':<16}{'S':>8}{'B':>6}{'B·S':>10}{'pred ms':>10}"]
        for name, S in tokens.items():
            B = self.batch_sizes[name]
            rows.append(f"{name:<16}{S:>8}{B:>6}{B * S:>10}{self.cost_fn(B, S):>10.3g}")
        return "\n".join(rows)


@dataclass
class PartialRecompute:
    """model.checkpointing=auto: recompute the fewest leading blocks whose saved activations must go for a
    micro-batch to fit the memory budget (models/checkpointing.py CheckpointingMixin.set_activation_checkpointing(k));
    with model.keep_attention, the fewest that fit with each of them keeping its self-attention output (a block or
    two more than without: keeping skips each recompute's costliest op), else every block with as many keeping as
    the memory leaves (decide).

    The calibration measures three policies at every point it can: none (no block recomputed), full (every block)
    and keep (every block recomputed around its kept attention). Each block saves and costs alike, so with k of L
    blocks recomputed, j of them keeping their attention, T = B·S:
        peak(k, j) = none(T) − k/L·(none(T) − full(T)) + j/L·(keep(T) − full(T))
        t(k, j)    = t_none + k/L·(t_full − t_none) − j/L·(t_full − t_keep)
    keep(T) − full(T) is a·T·L where keep was not measured (a: kept_bytes_per_token), and t_keep = t_full then (no
    credit). k = ⌈L·(none(T) − budget) / (none(T) − full(T))⌉ clipped to [0, L] (L when even full recompute does
    not fit: the batch-size rules keep B·S within full's m_mem); all_blocks (checkpointing=full with
    keep_attention=auto) holds k = L. Wan's blocks are alike; MMDiT's dual-stream blocks (first) and single-stream
    blocks differ somewhat, which the linear rule averages over."""
    layers: int
    budget: float
    none_mem: object
    full_mem: object
    none_cost: object
    full_cost: object
    attention_bytes: float = 0.0  # > 0: model.keep_attention is on; bytes a token per block where keep was not measured
    S_min: Optional[float] = None  # the shortest bucket's S (a memory model's per-sample term weighs most there)
    keep_mem: object = None       # the keep policy's memory and cost models, where the calibration measured them
    keep_cost: object = None
    all_blocks: bool = False      # checkpointing=full: every block recomputes, only j is chosen
    graph_tokens: int = 0         # micro-batches of more tokens run eager beside the CUDA graphs' pool, which holds
    graph_reserve: float = 0.0    # this many bytes (graph_pool_bytes): their budget is that much smaller
    # none's activations (its memory model above B = 0) at a sequence length beyond the longest it was measured at
    # (none_beyond) times none_scale ≥ 1: what the partial checks measured there (partial_check_scale)
    none_scale: float = 1.0
    none_beyond: float = math.inf

    def budget_at(self, B: int, S: int) -> float:
        return self.budget - self.graph_reserve if B * S > self.graph_tokens else self.budget

    def none_peak(self, B: int, S: int) -> float:
        """none's predicted peak bytes at (B, S); beyond the longest S it was measured at, its activations (the
        part above B = 0) times none_scale."""
        none = float(self.none_mem.predict(B, S))
        if S <= self.none_beyond:
            return none
        fixed = float(self.none_mem.predict(0, S))
        return fixed + (none - fixed) * self.none_scale

    def peak(self, B: int, S: int, k: int, j: int) -> float:
        """Predicted peak bytes of (B, S) with k blocks recomputed, j of them keeping their attention."""
        none, full = self.none_peak(B, S), float(self.full_mem.predict(B, S))
        return none - k / self.layers * (none - full) + j * (self.kept_bytes(B, S) if self.keep else 0.0)

    @property
    def keep(self) -> bool:
        """model.keep_attention (true or auto): the memory left goes to kept attention."""
        return self.attention_bytes > 0

    @property
    def none_tokens(self) -> int:
        """The largest B·S that runs without any recompute (in every bucket)."""
        def fits(budget: float) -> int:  # beyond none_beyond, a longer S fits its activations / none_scale
            t = self.none_mem.m_mem(budget, self.S_min)
            if self.none_scale == 1.0:
                return t
            fixed = float(self.none_mem.predict(0, self.S_min or 1))
            return min(t, max(int(self.none_beyond), self.none_mem.m_mem(fixed + (budget - fixed) / self.none_scale,
                                                                         self.S_min)))

        t = fits(self.budget)
        return t if t <= self.graph_tokens else max(self.graph_tokens, fits(self.budget - self.graph_reserve))

    def blocks(self, B: int, S: int) -> int:
        return self.decide(B, S)[0]

    def kept_bytes(self, B: int, S: int) -> float:
        """Bytes one recomputed block holds more when it keeps its attention, at this micro-batch."""
        if self.keep_mem is not None:
            return max(0.0, (float(self.keep_mem.predict(B, S)) - float(self.full_mem.predict(B, S))) / self.layers)
        return self.attention_bytes * B * S

    def decide(self, B: int, S: int) -> tuple[int, int]:
        """(k blocks recomputed, j of them keeping their attention outputs). Keeping attention costs kept_bytes a
        block for its costliest op — far more time per byte than leaving a whole block un-recomputed — so j = k
        wherever that fits: k = ⌈(none(T) − budget) / ((none(T) − full(T))/L − kept)⌉; beyond, k = L and j as
        many as the budget leaves. Where keeping costs more than recomputing frees, k is the fewest without keeping
        and j what the memory left holds."""
        none, full = self.none_peak(B, S), float(self.full_mem.predict(B, S))
        L, budget = self.layers, self.budget_at(B, S)
        kept = self.kept_bytes(B, S) if self.keep else 0.0
        if self.all_blocks:
            if not self.keep:
                return L, 0
            return L, L if kept <= 0 else max(0, min(L, math.floor((budget - full) / kept)))
        if none <= budget or none <= full:  # fits, or recompute saves nothing in this calibration
            return 0, 0
        k = min(L, math.ceil(L * (none - budget) / (none - full) - 1e-9))
        if not self.keep:
            return k, 0
        if kept <= 0:
            return k, k
        net = (none - full) / L - kept
        if net <= 0:  # keeping costs more memory than recomputing frees: the fewest recomputed, keeping what fits
            left = budget - (none - k / L * (none - full))  # bytes left with k blocks recomputed
            return k, max(0, min(k, math.floor(left / kept + 1e-9)))
        k_kept = math.ceil((none - budget) / net - 1e-9)
        if k_kept <= L:
            return k_kept, k_kept
        return L, max(0, min(L, math.floor((budget - full) / kept)))

    def predict(self, B, S) -> float:
        """Predicted ms of the policy decide() runs, interpolated between the measured policies."""
        k, j = self.decide(B, S)
        t_full = float(self.full_cost.predict(B, S))
        t_none = float(self.none_cost.predict(B, S)) if k < self.layers else t_full
        t_keep = float(self.keep_cost.predict(B, S)) if self.keep_cost is not None and j else t_full
        return t_none + k / self.layers * (t_full - t_none) - j / self.layers * (t_full - t_keep)


def memory_budget(mem_budget_gib: Optional[float], cal: Optional[Calibration]) -> Optional[float]:
    """The bytes a micro-batch may peak at: scheduling.mem_budget_gib, else HBM_FRACTION of the device memory the
    calibration measured; None where neither is known."""
    if mem_budget_gib is not None:
        return mem_budget_gib * 2**30
    return HBM_FRACTION * cal.hbm_bytes if cal is not None and cal.hbm_bytes else None


def _partial_recompute(cfg: SchedulingConfig, cal: Calibration, shape: ModelShape, checkpointing, keep_attention,
                       world_size, full_mem, full_cost, S_min) -> Optional[PartialRecompute]:
    """The per-micro-batch policy where the config asks for one (checkpointing=auto, or full with
    keep_attention=auto) and the calibration holds what it needs (auto: none's and full's memory models; keep's
    models where measured, else the kept bytes computed); None otherwise (checkpoint_policy then runs full)."""
    modes = set(cal.modes)
    auto = checkpointing == "auto" and {"none", "full"} <= modes and cal.memory_model("none") is not None
    keep_only = checkpointing == "full" and keep_attention == "auto"
    budget = memory_budget(cfg.mem_budget_gib, cal)
    if not (auto or keep_only) or full_mem is None or budget is None:
        return None
    measured_keep = "keep" in modes and cal.memory_model("keep") is not None
    partial = PartialRecompute(
        shape.layers, budget, cal.memory_model("none", world_size) if auto else full_mem, full_mem,
        cal.cost_model("none") if auto else full_cost, full_cost, S_min=S_min,
        attention_bytes=kept_bytes_per_token(shape.dim) if keep_attention in (True, "auto") else 0.0,
        keep_mem=cal.memory_model("keep", world_size) if measured_keep else None,
        keep_cost=cal.cost_model("keep") if "keep" in modes else None,
        all_blocks=keep_only)
    if auto and not isinstance(partial.none_mem, FSDPMemoryModel):
        scale, beyond = partial_check_scale(cal, partial)
        partial = dataclasses.replace(partial, none_scale=scale, none_beyond=beyond)
    return partial


def none_measured_S(cal: Calibration) -> float:
    """The longest S at which the calibration measured the none policy's peak (its memory model's reach in S)."""
    return max((float(p["S"]) for p in cal.data["modes"]["none"]["points"] if p.get("peak_bytes")), default=0.0)


def partial_check_scale(cal: Calibration, partial: PartialRecompute) -> tuple[float, float]:
    """(none_scale, none_beyond): where the calibration measured micro-batches longer than none's longest measured
    S under the policy checkpointing=auto chose for them (its `partial_checks`: k of L blocks recomputed, j ≤ k of
    them keeping attention, the peak), none's peak at each such (B, S) solved from the linear rule of
    PartialRecompute's docstring,
        none = (peak − k/L·full(T) − j·kept(T)) / (1 − k/L),
    and its activations (none − none at B = 0) over the model's; the largest ratio (at least 1: a check below the
    model never lowers it) scales none's activations at every S beyond none_beyond, none's longest measured S.
    Where none was measured, in S, its model is fitted; beyond, a clip that does not fit whole can be measured only
    this way (the 1.3B's case: results/attention_h200.md, "Why train.py's peaks passed their budgets"). A check
    that ran out of memory, or with j > 0 and no kept bytes to solve with, is passed over. (1, ∞) without usable
    checks."""
    L = partial.layers
    checks = [c for c in cal.data.get("partial_checks") or []
              if c.get("peak_bytes") and 0 <= int(c["j"]) <= int(c["k"]) < L]
    beyond = none_measured_S(cal)
    scale = 1.0
    for c in checks:
        B, S, k, j = int(c["B"]), int(c["S"]), int(c["k"]), int(c["j"])
        kept = partial.kept_bytes(B, S) if j else 0.0
        if S <= beyond or (j and kept <= 0):
            continue
        full, fixed = float(partial.full_mem.predict(B, S)), float(partial.none_mem.predict(0, S))
        none = (float(c["peak_bytes"]) - k / L * full - j * kept) / (1 - k / L)
        scale = max(scale, (none - fixed) / (float(partial.none_mem.predict(B, S)) - fixed))
    return (scale, beyond) if scale > 1.0 else (1.0, math.inf)


def _keep_source(partial: PartialRecompute) -> str:
    if not partial.keep:
        return ""
    return ("; kept attention's memory and time measured (keep)" if partial.keep_mem is not None
            else "; kept attention's bytes computed, its time not credited (no keep policy measured)")


def _check_source(partial: PartialRecompute) -> str:
    if partial.none_scale == 1.0:
        return ""
    return (f"; none's activations × {partial.none_scale:.3f} beyond S = {partial.none_beyond:,.0f}, the longest it "
            "was measured at (the calibration's partial checks)")


def graph_pool_bytes(tokens: Mapping[str, int], graph_tokens: Optional[int], memory=None,
                     partial: Optional[PartialRecompute] = None) -> float:
    """Bytes the CUDA graphs' shared pool holds while a larger, eager micro-batch runs (training/cuda_graphs.py:
    micro-batches of up to graph_tokens tokens are captured, and the pool is the largest capture's activations).
    The largest (B, S) the bucket table can capture — B = ⌊graph_tokens / S⌋ for each S — at the policy it runs
    under the whole budget (PartialRecompute's choice, else the mode's memory model): its peak above the same
    policy's peak at B = 0. 0 without graphs (graph_tokens 0) or a memory model; with no cap (None) every
    micro-batch is captured, none runs beside the pool, and nothing is reserved. An upper bound: the schedule's own
    batch sizes may capture less (a bucket whose full micro-batch is over graph_tokens is captured only in its
    short last one), but they depend on the budget this sets."""
    if not graph_tokens or (memory is None and partial is None):
        return 0.0
    worst = 0.0
    for S in set(tokens.values()):
        B = graph_tokens // S
        if B < 1:
            continue
        if partial is not None:
            k, j = partial.decide(B, S)
            act = partial.peak(B, S, k, j) - partial.peak(0, S, k, j)
        else:
            act = float(memory.predict(B, S)) - float(memory.predict(0, S))
        worst = max(worst, act)
    return worst


def schedule_for(cfg, tokens: Mapping[str, int], shape: ModelShape, world_size: int,
                 shares: Optional[Mapping[str, float]] = None, graph_tokens: Optional[int] = 0) -> Schedule:
    """The run's schedule from a training config, as train.py and scripts/show_buckets.py both need it: tokens
    (bucket → S), the model's shape and checkpointing knobs, the scheduling group; shares (bucket → share of the
    corpus' samples) for scheduling.tokens_per_step; graph_tokens: the CUDA graphs' train.graph_max_tokens where the
    run captures micro-batches (0 where it does not: graph_pool_bytes)."""
    m = cfg.model
    return resolve_schedule(cfg.scheduling, tokens, shape,
                            proxy_tflops=cfg.metrics.peak_tflops or 100.0, checkpointing=m.checkpointing,
                            world_size=world_size, keep_attention=m.keep_attention, shares=shares,
                            graph_tokens=graph_tokens)


def kept_bytes_per_token(dim: int) -> float:
    """Bytes a token that a recomputed block keeping its self-attention holds beyond a plain recomputed one: SDPA's
    bf16 output (2·dim) and fp32 log-sum-exp (4 bytes a head, heads = dim/128 → 2·dim/64). With offload on, its input
    goes to host memory like every recomputed block's (models/offload.py)."""
    return 2.0 * dim * (1 + 1 / 64)


def flops_cost_fn(shape: ModelShape, proxy_tflops: float = 100.0) -> Callable[[int, int], float]:
    return lambda B, S: model_flops(B, S, shape.text_len, shape.p_matmul, shape.layers, shape.dim) / (proxy_tflops * 1e9)


def _check_model(cal: Calibration, shape: ModelShape) -> None:
    m = cal.data.get("model", {})
    theirs = {"dim": m.get("dim"), "layers": m.get("num_layers"), "text_len": m.get("text_len")}
    ours = {"dim": shape.dim, "layers": shape.layers, "text_len": shape.text_len}
    diff = {k: (ours[k], v) for k, v in theirs.items() if v is not None and v != ours[k]}
    if diff:
        raise ValueError(f"scheduling.calibration={cal.path} was measured on another model ("
                         + ", ".join(f"{k} {b} there, {a} here" for k, (a, b) in diff.items())
                         + "): run scripts/calibrate.py with this model's config")


def _load_calibration(cfg: SchedulingConfig, notes: list) -> Optional[Calibration]:
    """scheduling.calibration, loaded; None when unset, or when the file does not exist and the strategy's knobs
    are all set in the config (SELF_SUFFICIENT). Otherwise a missing file is refused (Calibration.load)."""
    if not cfg.calibration:
        return None
    if cfg.calibration == "auto":
        raise ValueError("scheduling.calibration=auto is resolved by the trainer (training/shape_benchmark.py "
                         "calibration_for_run) before the schedule: pass the file it chose")
    knobs = SELF_SUFFICIENT.get(cfg.strategy)
    if not os.path.exists(cfg.calibration) and knobs and all(getattr(cfg, k) is not None for k in knobs):
        notes.append(f"scheduling.calibration={cfg.calibration} does not exist yet: {cfg.strategy} runs on the "
                     f"configured {', '.join(knobs)} alone, without the calibration's memory bound")
        return None
    return Calibration.load(cfg.calibration)


def _fsdp_source(memory, cal: Calibration, mode: str) -> str:
    """For the run's log: an FSDP memory model's ranks, and the file's where they differ ("" for another model)."""
    if not isinstance(memory, FSDPMemoryModel):
        return ""
    R0 = cal.memory_model(mode).ranks
    return f" (FSDP over {memory.ranks} ranks" + (f", rescaled from {R0})" if memory.ranks != R0 else ")")


def _budget_needed(memory, S_max: int, S_min: int, hi: float) -> float:
    """The smallest budget (bytes, at most hi) whose m_mem holds S_max (m_mem grows with the budget)."""
    lo = 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if memory.m_mem(mid, S_min) >= S_max else (mid, hi)
    return hi


def _room_remedy(source: str, mode: Optional[str], memory, cal: Optional[Calibration], S_max: int, S_min: int,
                 budget_gib: Optional[float] = None) -> str:
    """What frees room for the longest bucket, for the error that says it does not fit. source: where m_mem came
    from; mode: the calibration record that priced it (None without one); budget_gib: scheduling.mem_budget_gib.
    Recompute where that record runs none (calibrated first where the file lacks it), full recompute where it keeps
    attention, as many ranks as would hold the bucket where FSDP's sharded states weigh (none where no number
    would), the budget that would hold it where the whole GPU would, a larger one where the file does not know the
    GPU's memory, else fewer buckets; and where one sample of the bucket alone would fit, why the bound is lower."""
    if source == "config":
        return "raise scheduling.m_mem if the GPU holds the longest bucket, or drop the bucket from data.buckets"
    ways = []
    modes = set(cal.modes) if cal is not None else set()
    if mode == "none":
        ways.append("turn on model.checkpointing (full, or auto)" + (
            "" if "full" in modes else ", calibrated with it first (scripts/calibrate.py conf=... "
                                      "model.checkpointing=auto: this file measured no recompute)"))
    elif mode == "keep":
        ways.append("set model.keep_attention=auto or false (this bound keeps every recomputed block's attention)")
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
    hbm = cal.hbm_bytes if cal is not None else None
    budget = memory_budget(budget_gib, cal)
    if isinstance(memory, FSDPMemoryModel):
        if budget is None:
            ways.append(f"shard over more ranks (FSDP over {memory.ranks}: {gib(memory.sharded)} of sharded states "
                        "a rank, which halve with twice the ranks)")
        else:
            R = next((r for r in (memory.ranks * 2 ** i for i in range(1, 11))
                      if memory.for_ranks(r).m_mem(budget, S_min) >= S_max), None)
            ways.append(f"shard over more ranks ({R} hold it; FSDP over {memory.ranks} keeps {gib(memory.sharded)} "
                        "of sharded states a rank, which halve with twice the ranks)" if R else
                        f"more ranks will not do (FSDP over {memory.ranks} keeps {gib(memory.sharded)} of sharded "
                        f"states a rank; over {memory.ranks * 2 ** 10:,} the bound is still below S={S_max:,})")
    if memory is not None and hbm:
        whole = memory.m_mem(hbm, S_min)
        if whole >= S_max:
            need = _budget_needed(memory, S_max, S_min, hbm)
            ways.append(f"raise scheduling.mem_budget_gib to {need / 2**30:.1f} or more ({need / hbm:.0%} of the "
                        f"GPU's {gib(hbm)}" + (f"; above the default {HBM_FRACTION:.0%} the allocator's cache may not "
                                               "find it" if need > HBM_FRACTION * hbm else "") + ")")
        else:
            ways.append(f"a larger budget will not do (the whole GPU, {gib(hbm)}, would hold {whole:,} tokens)")
    elif memory is not None and budget_gib is not None:
        ways.append(f"raise scheduling.mem_budget_gib (now {budget_gib:g}) if the GPU has more")
    ways.append("drop the bucket from data.buckets")
    alone = float(memory.predict(1, S_max)) if memory is not None and budget is not None else None
    why = (f"; one sample of S={S_max:,} alone would peak at {gib(alone)}, within the {gib(budget)} budget, but m_mem "
           f"bounds every bucket's B·S at the memory a sample of the shortest bucket (S={S_min:,}) adds, so dropping "
           "the shortest buckets raises it too" if alone is not None and alone <= budget else "")
    return "; ".join(ways) + why + (f" (the memory model: {memory.describe()})" if memory is not None else "")


def resolve_schedule(cfg: SchedulingConfig, tokens: Mapping[str, int], shape: ModelShape,
                     proxy_tflops: float = 100.0, checkpointing: Optional[str] = None,
                     world_size: Optional[int] = None, keep_attention: bool | str = False,
                     shares: Optional[Mapping[str, float]] = None, graph_tokens: Optional[int] = 0,
                     narrow_graphs: bool = True) -> Schedule:
    """tokens: bucket name → S, in bucket order; checkpointing: model.checkpointing (picks the calibration's
    record); world_size: picks the simulator's choice made for the nearest cluster size; keep_attention: the
    model's knob of that name (checkpointing=auto then spends memory on kept self-attention outputs first);
    shares: bucket → share of the corpus' samples (scheduling.tokens_per_step needs them: fixed_batch);
    graph_tokens: micro-batches up to this many tokens replay as CUDA graphs (0: none), whose pool the memory
    budget of every larger micro-batch leaves room for (graph_pool_bytes).

    The pool is reserved only for micro-batches the plan holds: where every bucket's micro-batch is over
    graph_tokens, none is captured and nothing is reserved (a bucket's short last micro-batch stays eager too);
    else the limit is the largest planned micro-batch within it (of every bucket in the table, those the corpus
    leaves empty included: an upper bound). Schedule.graph_tokens is that limit, which the
    trainer captures up to. The schedule is resolved again at each narrower limit (the budget the reserve leaves
    sets the batch sizes, which set the limit), until it holds. narrow_graphs=False keeps graph_tokens as the limit
    (the simulator, whose swept batch sizes are not these: the reserve then bounds any capture up to it)."""
    args = (cfg, tokens, shape, proxy_tflops, checkpointing, world_size, keep_attention, shares)
    limit = graph_tokens
    try:
        schedule = _resolve_schedule(*args, graph_tokens=graph_tokens)
    except PoolLeavesNoRoom:
        # the pool at the whole limit leaves no room; without graphs, does the plan hold any micro-batch to capture?
        schedule = _resolve_schedule(*args, graph_tokens=0) if narrow_graphs else None
        if schedule is None or any(schedule.batch_sizes[n] * S <= graph_tokens for n, S in tokens.items()):
            raise
        limit = 0
    while narrow_graphs and limit and schedule.values.get("graph_pool_gib"):
        narrowed = max((b * S for n, S in tokens.items() if (b := schedule.batch_sizes[n]) * S <= limit), default=0)
        if narrowed >= limit:
            break
        limit = narrowed
        schedule = _resolve_schedule(*args, graph_tokens=limit)
    if limit != graph_tokens:
        schedule.values["graph_tokens"] = limit
        schedule.sources["graph_tokens"] = (
            f"no planned micro-batch within train.graph_max_tokens={graph_tokens:,}: none captured, no pool kept"
            if not limit else f"the largest planned micro-batch within train.graph_max_tokens={graph_tokens:,}")
    schedule.graph_tokens = limit
    return schedule


def _resolve_schedule(cfg: SchedulingConfig, tokens: Mapping[str, int], shape: ModelShape, proxy_tflops: float,
                      checkpointing: Optional[str], world_size: Optional[int], keep_attention: bool | str,
                      shares: Optional[Mapping[str, float]], graph_tokens: Optional[int]) -> Schedule:
    """resolve_schedule at one capture limit."""
    S_max, S_min = max(tokens.values()), min(tokens.values())
    src: dict = {}
    val: dict = {}
    notes: list = []
    recompute, reserve = None, 0.0
    cal = _load_calibration(cfg, notes)
    chosen: dict = {}
    if cal is None:
        cost_fn = flops_cost_fn(shape, proxy_tflops)
        src["cost"] = f"flops@{proxy_tflops:g}TFLOP/s"
        cost_model = power = memory = None
    else:
        _check_model(cal, shape)
        if cfg.mem_budget_gib is not None and cal.hbm_bytes and cfg.mem_budget_gib * 2**30 > cal.hbm_bytes:
            raise ValueError(f"scheduling.mem_budget_gib={cfg.mem_budget_gib:g} is more than the GPU has "
                             f"({cal.hbm_bytes / 2**30:.1f} GiB, the device {cal.path} measured): set at most that "
                             f"(the default is {HBM_FRACTION:.0%} of it, leaving room for the allocator)")
        mode = cal.mode_name(checkpointing)
        if checkpointing == "full" and keep_attention is True and "keep" in cal.modes:
            mode = "keep"  # every block recomputed around its kept attention: the keep policy's own record
        cost_model, memory = cal.cost_model(mode), cal.memory_model(mode, world_size)
        power = cal.cost_model(mode, "power")
        cost_fn = cost_model.predict
        src["cost"] = f"calibration:{mode}:{cost_model.form}"
        partial = _partial_recompute(cfg, cal, shape, checkpointing, keep_attention, world_size, memory, cost_model,
                                     S_min)
        # the mode the simulator's choices must have been made under: auto's per-micro-batch policy, else the record
        run_mode = "auto" if partial is not None and not partial.all_blocks else mode
        chosen = cal.chosen(cfg.strategy, world_size, mode=run_mode)
        if cal.chosen_for() not in (None, run_mode):
            notes.append(f"the simulator's settings in {cal.path} were chosen for checkpointing={cal.chosen_for()}, "
                         f"not this run's {run_mode}: not used (their m_mem bounds another policy's memory)")
        if keep_attention is True and partial is None and mode != "keep" and memory is not None and cfg.m_mem is None:
            raise ValueError(
                f"model.keep_attention=true keeps every recomputed block's attention, but scheduling.calibration="
                f"{cal.path} measured no keep policy: its {mode} memory model would bound the plan without the kept "
                "attention and run out of memory. Calibrate with keep (python scripts/calibrate.py conf=... "
                "model.checkpointing=auto model.keep_attention=auto), or set model.keep_attention=auto (memory "
                "allowing, priced from the kept bytes) or false")
        reserve = graph_pool_bytes(tokens, graph_tokens, memory, partial)
        if reserve > 0:
            src["graph_pool"] = (f"{reserve / 2**30:.2f} GiB kept free beside micro-batches over {graph_tokens:,} "
                                 "tokens for the CUDA graphs' pool (memory model)")
            val["graph_pool_gib"] = reserve / 2**30
            if partial is not None:
                partial = dataclasses.replace(partial, graph_tokens=int(graph_tokens), graph_reserve=reserve)
        if partial is not None:
            recompute, cost_fn = (partial.decide if partial.keep else partial.blocks), partial.predict
            if partial.all_blocks:
                src["cost"] = (f"calibration:full, every block recomputed, as many keeping their attention as "
                               f"{partial.budget / 2**30:.1f} GiB allows" + _keep_source(partial))
            else:
                src["cost"] = (f"calibration:auto(no recompute up to {partial.none_tokens} tokens, then as few "
                               f"of {shape.layers} blocks as {partial.budget / 2**30:.1f} GiB allows"
                               + ("" if not partial.keep else ", memory left keeping attention"
                                  + _keep_source(partial)) + _check_source(partial) + ")")

    if cal is not None:  # a cost model fitted on other lengths may turn negative at this run's buckets
        for name, S in tokens.items():
            t = float(cost_fn(1, S))
            if not (math.isfinite(t) and t > 0):
                raise ValueError(f"scheduling.calibration={cal.path}: its cost model ({src['cost']}) predicts "
                                 f"{t:.4g} ms for one sample of bucket {name} (S={S}); a time must be positive: "
                                 "re-measure with that bucket in the scan (scripts/calibrate.py) or drop it")
    # m_mem: config > mem_budget_gib × memory model > chosen > memory model at 90 % of HBM
    if cfg.m_mem is not None:
        val["m_mem"], src["m_mem"] = cfg.m_mem, "config"
    elif cfg.mem_budget_gib is not None:
        if memory is None:
            raise ValueError("scheduling.mem_budget_gib needs a measured memory model: set scheduling.calibration "
                             "to a file with one (scripts/calibrate.py on the GPU) or set scheduling.m_mem")
        val["m_mem"] = memory.m_mem(cfg.mem_budget_gib * 2**30, S_min)
        src["m_mem"] = (f"mem_budget_gib={cfg.mem_budget_gib:g}(config) × memory model(calibration)"
                        + _fsdp_source(memory, cal, mode))
    elif chosen.get("m_mem") is not None and S_min >= chosen.get("m_mem_S_min", 0):
        val["m_mem"], src["m_mem"] = chosen["m_mem"], "calibration:chosen"
    elif cal is not None and (default := cal.default_m_mem(mode, S_min, world_size)) is not None:
        val["m_mem"] = default
        src["m_mem"] = f"calibration:memory model at {HBM_FRACTION:.0%} of HBM" + _fsdp_source(memory, cal, mode)
    if cfg.m_mem is None and val.get("m_mem") and cal is not None and reserve > 0 and memory is not None:
        # the bound's micro-batches run eager beside the graphs' pool: their budget is the pool smaller
        budget = memory_budget(cfg.mem_budget_gib, cal)
        # micro-batches up to graph_tokens are captured (the pool is their own memory), so the bound never drops
        # below it; above it the pool is held beside them
        bound = max(int(graph_tokens), memory.m_mem(budget - reserve, S_min)) if budget else val["m_mem"]
        if bound < val["m_mem"]:
            val["m_mem"], src["m_mem"] = bound, src["m_mem"] + ", less the graphs' pool"
        if bound < S_max:
            raise PoolLeavesNoRoom(f"the CUDA graphs' pool ({reserve / 2**30:.1f} GiB: micro-batches up to "
                                   f"train.graph_max_tokens={graph_tokens} tokens are captured) leaves room for "
                                   f"{bound} tokens beside it, below the longest bucket's S={S_max}: lower "
                                   "train.graph_max_tokens, raise the memory budget, or set train.cuda_graphs=off")
    m_mem = val.get("m_mem")
    if m_mem is not None:  # B = 1 for a bucket longer than m_mem would run out of memory, not degrade
        _check_fits(S_max, m_mem, f"scheduling.m_mem ({src['m_mem']})",
                    _room_remedy(src["m_mem"], mode if cal is not None else None, memory, cal, S_max, S_min,
                                 cfg.mem_budget_gib))

    def pick(name: str, default, default_why: str):
        v = getattr(cfg, name)
        if v is not None:
            val[name], src[name] = v, "config"
        elif name in held:
            val[name], src[name] = held[name]
        elif chosen.get(name) is not None:
            val[name], src[name] = chosen[name], "calibration:chosen"
        elif default is not None:
            val[name], src[name] = default, default_why
        return val.get(name)

    s = cfg.strategy
    micro_batches, window = None, cfg.window
    held: dict = {}  # the knob scheduling.tokens_per_step chose: {name: (value, source)}
    if cfg.tokens_per_step is not None:
        if not shares:
            raise ValueError("scheduling.tokens_per_step needs the corpus' bucket shares (the trainer passes them)")
        p_fit = cfg.p or (power.params["p"] if power is not None else None)
        fixed = fixed_batch(cfg, tokens, shares, cost_fn if cal is not None else None, m_mem, p_fit, world_size or 1,
                            cal, src, val, notes, mode=run_mode if cal is not None else None)
        micro_batches, window = fixed["micro_batches"], fixed.get("window", cfg.window)
        held.update({k: (v, src[k]) for k, v in fixed.items() if k in ("m_tokens", "m_comp", "target_microbatch_ms")})
    if s == "equal_token":
        m_tokens = pick("m_tokens", S_max if cal is not None else None, "default: longest bucket's S")
        if m_mem is not None and m_tokens is not None and m_tokens > m_mem:
            raise ValueError(f"scheduling.m_tokens={m_tokens:g} exceeds the memory bound m_mem={m_mem:g} "
                             f"({src['m_mem']}): lower it")
        sizes = batch_sizes(s, list(tokens.values()), m_tokens=m_tokens)
    elif s == "dual_constraint":
        p = pick("p", power.params["p"] if power is not None else None, "calibration:power fit")
        m_comp = pick("m_comp", S_max ** p if p is not None and cal is not None else None,
                      "default: longest bucket's S^p")
        sizes = batch_sizes(s, list(tokens.values()), m_mem=m_mem, m_comp=m_comp, p=p)
    else:
        if cost_model is None:
            raise ValueError(f"scheduling.strategy={s} predicts step times from a cost model: set "
                             "scheduling.calibration (scripts/calibrate.py writes one)")
        target = pick("target_microbatch_ms", cost_fn(1, S_max), "default: longest bucket at B=1")
        sizes = batch_sizes(s, list(tokens.values()), m_mem=m_mem, cost_model=cost_fn, target_ms=target)
        over = [n for n, S in tokens.items() if cost_fn(1, S) > target]
        if over:
            notes.append(f"scheduling.target_microbatch_ms={target:g}: buckets {over} exceed it at B=1 and run "
                         "one sample per micro-batch")
    planner = resolve_planner(s, window, cfg.planner)
    src["planner"] = "config" if cfg.planner is not None else f"default for {s}"
    check_m_mem(planner, m_mem)
    if window > 1:
        src.setdefault("window", "config")
        if planner != "windowed":
            notes.append(f"scheduling.window={window} only affects scheduling.planner=windowed; {s} runs "
                         f"{planner} by default: set scheduling.planner=windowed to plan {window} steps together")
    return Schedule(s, dict(zip(tokens, sizes)), cost_fn, src, val, window, planner, micro_batches, recompute,
                    notes)


def fixed_batch(cfg: SchedulingConfig, tokens: Mapping[str, int], shares: Mapping[str, float], cost_fn,
                m_mem: Optional[float], p: Optional[float], world_size: int, cal: Optional[Calibration], src: dict,
                val: dict, notes: list, mode: Optional[str] = None) -> dict:
    """The knob, M (and window) that hold scheduling.tokens_per_step = g: the simulator's choice for the nearest
    world size and g where the calibration holds one whose expected tokens here are within ±10 % of g and that was
    tuned for what this run plans — a window or none (the window is always the config's: a window runs only where
    the config asks for one, by results/convergence_cpu.md's rule); else,
    among every setting that holds g (scheduling.simulate.settings_at_tokens), the one with the most predicted
    tokens/s in stream order (analytic_idle: a lower bound for balanced). A knob set in the config is kept, and M
    chosen for it. Fills val/src with tokens_per_step, micro_batches and the knob."""
    from scheduling.simulate import TOKENS_TOL, Mix, analytic_idle, settings_at_tokens, sizes_for, tokens_per_step

    g, s = float(cfg.tokens_per_step), cfg.strategy
    mix = Mix.of([(n, S, float(shares.get(n, 0.0))) for n, S in tokens.items()])
    knob = {"equal_token": "m_tokens", "dual_constraint": "m_comp"}.get(s, "target_microbatch_ms")
    if s != "equal_token" and (cost_fn is None or m_mem is None):
        raise ValueError(f"scheduling.tokens_per_step with {s} needs scheduling.calibration (its cost and memory "
                         "models)")
    fixed_knob = getattr(cfg, knob)
    base = {"m_mem": m_mem, "p": p}

    def expected(setting: dict, M: int) -> float:
        sizes = sizes_for(s, mix, {**base, **setting}, cost_fn)
        return tokens_per_step(mix, sizes, M)

    out = None
    chosen = cal.chosen_at_tokens(s, world_size, g, mode=mode) if cal is not None and fixed_knob is None else {}
    chosen_w = int(chosen.get("window") or 1)
    windowed = resolve_planner(s, cfg.window, cfg.planner) == "windowed"
    if chosen and windowed != (chosen_w > 1):  # a window only where the config asks for one (convergence_cpu.md)
        notes.append(f"the calibration's choice for g={chosen.get('simulated_g', g):,.0f} was tuned for window "
                     f"{chosen_w}; this run plans " + (f"{cfg.window} steps together" if windowed else
                                                       "one step at a time (a window only where the config asks "
                                                       f"for one: scheduling.planner=windowed scheduling.window="
                                                       f"{chosen_w} runs the choice)")
                     + ": M and the knob are chosen again here")
        chosen = {}
    if chosen.get(knob) is not None and chosen.get("micro_batches"):
        got = expected({knob: chosen[knob]}, int(chosen["micro_batches"]))
        if abs(got - g) <= TOKENS_TOL * g:
            out = {knob: chosen[knob], "micro_batches": int(chosen["micro_batches"]), "window": cfg.window}
            why = (f"calibration:chosen (simulated at R={chosen['simulated_world_size']}, "
                   f"g={chosen['simulated_g']:,.0f})")
        else:
            notes.append(f"the calibration's choice for g={chosen['simulated_g']:,.0f} gives {got:,.0f} tokens a step "
                         f"with this corpus' mix: chosen again here")
    if out is None:
        if fixed_knob is not None:
            M = max(1, round(g / expected({knob: fixed_knob}, 1)))
            out, why = {knob: fixed_knob, "micro_batches": M}, f"M for the configured {knob}"
        else:
            cands = settings_at_tokens(s, mix, cost_fn or (lambda B, S: float(B * S)), p, m_mem or math.inf, g)
            if not cands:
                raise ValueError(f"no {s} setting holds scheduling.tokens_per_step={g:,.0f} (±10 %) with up to 16 "
                                 "micro-batches: raise or lower it")
            predict = cost_fn or (lambda B, S: float(B * S))

            def rate(c) -> float:  # predicted tokens/s: a slot lasts E[cost] / (1 − idle) in stream order
                setting, sizes, M = c
                q = [sh / B for sh, B in zip(mix.share, sizes)]
                e_cost = sum(qi * predict(B, S) for qi, B, S in zip(q, sizes, mix.S)) / sum(q)
                return tokens_per_step(mix, sizes, 1) * (1 - analytic_idle(predict, mix, sizes, world_size)) / e_cost

            setting, sizes, M = max(cands, key=rate)
            out, why = {knob: setting[knob], "micro_batches": M}, "chosen for tokens_per_step (predicted tokens/s)"
            if s == "balanced":
                notes.append(f"scheduling.tokens_per_step={g:g}: the calibration records no simulated choice for this run, so M "
                             f"and the target are the best predicted on one step, at window {cfg.window}; "
                             "`python scripts/simulate_cluster.py --calibration <it> --write-chosen` records the "
                             "simulator's M, target and window, tuned over whole simulated steps")
    if s == "dual_constraint" and p is not None:
        out["p"] = p
    M = out["micro_batches"]
    val["tokens_per_step"], src["tokens_per_step"] = round(expected({knob: out[knob]}, M), 1), f"expected for g={g:g}"
    val["micro_batches"], src["micro_batches"] = M, why
    src[knob] = why if fixed_knob is None else "config"
    if out.get("window", cfg.window) != cfg.window:
        src["window"] = why
    if abs(val["tokens_per_step"] - g) > TOKENS_TOL * g:
        notes.append(f"scheduling.tokens_per_step={g:g}: the configured {knob} holds {val['tokens_per_step']:,.0f} "
                     f"tokens a step with M={M}, outside ±10 %")
    return out

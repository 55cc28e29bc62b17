"""The shape benchmark: real training steps of a config's model timed over (bucket, B), fitted, written as a
calibration file (scheduling/calibrate.py reads it); the trainer runs it on first use (scheduling.calibration=auto:
`calibration_for_run`), scripts/calibrate.py on request.

The step: the config's model (models.build.build_model), precision (autocast), checkpointing mode (model.checkpointing;
`auto` scans both `none` and `full`), compile and FSDP; flow matching on synthetic inputs of each bucket's latent
shape; forward + backward timed as `ms`, the AdamW step apart as `optim_ms`; the peak of the whole step; an
out-of-memory frees what the step held and reports the point infeasible (scheduling/calibrate.py runs the scan).
Over several processes (torchrun, or the trainer's own) the model is FSDP-sharded as the run shards it, each point's
feasibility is agreed by all-reduce, and rank 0 writes the file.

Options (`calibrate.KEY` of scripts/calibrate.py, CalibrateOptions): max_points, blocks (time k of the model's blocks and
extrapolate × layers/k; the file says so), warmup, repeats, top_tokens (largest B·S aimed at; default 2·S_max),
time_budget_s, buckets (names; default all), out, fit_min_tokens (points with B·S below it stay in the file but out
of the cost fit; default null: every point is fitted, the cost model's launch floor pricing the small ones),
probe_cap (the last point is the shortest bucket at the memory model's largest B), check (bucket:B micro-batches run
against an existing calibration: `check_points`), points (bucket:B micro-batches scanned instead of the ladder, e.g.
every distinct micro-batch of a simulation's cells, each `repeats` times; with fsdp_ranks timed again at the second
depth, so the part outside the blocks separates), fsdp_ranks (R: a one-device slice of k = blocks blocks measured at
two depths, its memory model FSDP over R ranks: scheduling/fsdp_memory.py), memory_blocks (the second depth; default
k/2, or 2 for k = 1), memory_time_budget_s (the second depth's time budget for each policy, as time_budget_s is
the main scan's for each).

A slice for FSDP (fsdp_ranks): at each depth, two plain steps at the shortest bucket, B = 1 (the first creates
AdamW's state; the second's peak is the optimizer step's, its optim_ms the update's), then steps with each gradient
dropped as it is accumulated (as FSDP's reduce-scatter frees a block's), whose peaks at the forward's end and in the
backward and autocast's cast cache are recorded apart. The main depth runs the scan, memory probe included; the second
depth runs the scan's timed points again, the cheapest first, within its time budget.
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import glob
import json
import os
import platform
import time
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch

from data.buckets import bucket_table
from models.build import build_model
from models.flow_matching import FlowMatching
from models.layers import attention_kernel, cudnn_allowed
from models.parallelize import parallelize
from scheduling.calibrate import (HBM_FRACTION, Calibration, Infeasible, Point, StepResult, fit_mode, launch_point,
                                  new_calibration, refit, run_point, scan, timed_point)
from scheduling.fsdp_memory import slice_record
from training.cuda_graphs import clear_cublas_workspaces, graph_blockers, graphs_for, graphs_off_because
from training.dist import init_distributed
from training.inputs import model_inputs
from training.optim import build_optimizer
from training.step import autocast_for



@dataclasses.dataclass
class CalibrateOptions:
    """What a shape benchmark scans (`+calibrate.NAME=…` on scripts/calibrate.py's command line); checked as the run
    config is (training/config.py: types, finiteness, unknown names), ranges here."""
    max_points: int = 12                  # timed (bucket, B) points at most
    blocks: Optional[int] = None          # time a k-block slice of Wan and scale it to the full depth (null: all)
    warmup: int = 1                       # untimed steps before each point
    repeats: int = 2                      # timed steps per point (all kept in the file)
    top_tokens: Optional[float] = None    # the largest B·S aimed at (null: 2·S_max)
    time_budget_s: Optional[float] = None  # stop starting new points after this long
    buckets: Optional[list[str]] = None   # the buckets to scan (null: every one of data.buckets)
    out: Optional[str] = None             # a file or folder (default runs/calibrate/<name>/calibration.json)
    fit_min_tokens: Optional[float] = None  # fit only points with B·S at or above this
    refit: Optional[str] = None           # refit this calibration file's points instead of scanning
    probe_cap: bool = True                # probe the memory bound of the largest bucket
    check: Optional[list[str]] = None     # BUCKET:B micro-batches to time against the file's model instead
    points: Optional[list[str]] = None    # BUCKET:B micro-batches to scan instead of the ladder (e.g. a simulation's)
    fsdp_ranks: Optional[int] = None      # a slice for FSDP over this many ranks (module docstring)
    memory_blocks: Optional[int] = None   # the second depth the memory model is measured at
    memory_time_budget_s: Optional[float] = None  # the second depth's time budget, each policy's own

    def __post_init__(self):
        for name, low in (("max_points", 1), ("warmup", 0), ("repeats", 1), ("top_tokens", 1),
                          ("time_budget_s", 0), ("memory_time_budget_s", 0), ("fit_min_tokens", 0)):
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"calibrate.{name} must be ≥ {low}, got {value}")

    @classmethod
    def of(cls, opts: "CalibrateOptions | dict | None") -> "CalibrateOptions":
        """Options from a plain dict (Hydra's `calibrate` group, a test's); unknown or ill-typed ones are refused."""
        from training.config import from_dict

        return opts if isinstance(opts, cls) else from_dict(cls, dict(opts or {}), "calibrate.")


DEFAULTS = dataclasses.asdict(CalibrateOptions())
FIT_WARN = 0.15  # a chosen cost model missing its own points by more than this (relative RMS) is warned about
CPU_M_MEM_FACTOR = 8  # CPU: no device memory to bound; m_mem = 8·S_max so every rule has a bound


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_step_fn(model, objective, optimizer, buckets, model_cfg, device, autocast, checkpointing,
                 graphs=None, peaks: dict | None = None):
    """step_fn(bucket, B) → StepResult: one real training step on synthetic inputs (docs/contracts.md §6), under
    `checkpointing` (what set_activation_checkpointing takes: a bool, or (k, j) blocks recomputed, keeping). With `graphs`
    (training/cuda_graphs.py, as the trainer runs) each (bucket, B) is captured before it is timed: the capture
    and its eager warm-up run untimed, and the peak is the capture's (a replay allocates nothing). With `peaks` (a
    dict), each eager step on a CUDA device appends to peaks[(bucket, B)] its peak up to the forward's end, its peak
    from there on (the backward, the optimizer step) and the bytes autocast's weight-cast cache freed on exit."""
    cuda = device.type == "cuda"
    loss_sum = torch.zeros((), device=device)
    capture_peak: dict = {}  # key → the peak while it was captured (a replay allocates nothing of its own)
    track = peaks is not None and cuda and graphs is None

    def micro_batch(x: dict, record: dict | None = None) -> None:
        cond = model_inputs(model_cfg, SimpleNamespace(latents=x["x0"], text=x["text"], text_mask=x["mask"],
                                                       pooled=None, B=x["x0"].shape[0]))
        with autocast():
            loss = objective.per_sample_loss(model, x["x0"], x["text"], x["t"], x["noise"], **cond).mean()
            held = torch.cuda.memory_allocated(device) if record is not None else 0
        if record is not None:  # host-side allocator counters: no sync
            record["forward"] = float(torch.cuda.max_memory_allocated(device))
            record["cache"] = float(held - torch.cuda.memory_allocated(device))
            torch.cuda.reset_peak_memory_stats(device)
        loss.backward()
        loss_sum.add_(loss.detach())

    def step_fn(name: str, B: int) -> StepResult:
        shape = buckets[name].latent_shape(model_cfg.in_channels)
        oom = None
        x = None
        try:
            x0 = torch.randn(B, *shape, device=device)
            x = {"x0": x0, "text": torch.randn(B, model_cfg.text_len, model_cfg.text_dim, device=device),
                 "t": torch.rand(B, device=device), "noise": torch.randn_like(x0),
                 "mask": torch.ones(B, model_cfg.text_len, dtype=torch.bool, device=device)}
            model.set_activation_checkpointing(*(checkpointing if isinstance(checkpointing, tuple) else
                                                 (checkpointing,)))
            key, tokens = (name, B, checkpointing), B * buckets[name].tokens
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            if graphs is not None:
                if graphs.wants_capture(key, tokens):
                    for p in model.parameters():
                        if p.requires_grad and p.grad is None:
                            p.grad = torch.zeros_like(p)
                    while graphs.wants_capture(key, tokens):  # eager warm-up, then the capture (untimed)
                        graphs.run(key, tokens, micro_batch, x)
                    optimizer.zero_grad(set_to_none=False)
                    capture_peak[key] = float(torch.cuda.max_memory_allocated(device)) if cuda else None
                _sync(device)
                t0 = time.perf_counter()
                graphs.run(key, tokens, micro_batch, x)
            else:
                record = {} if track else None
                _sync(device)
                t0 = time.perf_counter()
                micro_batch(x, record)
            _sync(device)
            t1 = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=graphs is None)
            _sync(device)
            t2 = time.perf_counter()
            if track:
                record["backward"] = float(torch.cuda.max_memory_allocated(device))
                peaks.setdefault((name, B), []).append(record)
        except torch.OutOfMemoryError as e:
            oom = str(e).splitlines()[0]
        if oom is not None:  # outside the except block, so the traceback no longer pins the step's tensors
            x = None
            optimizer.zero_grad(set_to_none=graphs is None)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            raise Infeasible(oom)
        peak = float(torch.cuda.max_memory_allocated(device)) if cuda else None
        if peak is not None and capture_peak.get(key) is not None:
            peak = max(peak, capture_peak[key])
        if track:
            peak = max(peak, peaks[(name, B)][-1]["forward"])
        return StepResult((t1 - t0) * 1e3, (t2 - t1) * 1e3, peak)

    return step_fn


def full_depth_params(model_cfg) -> int:
    """Parameters of the whole model (all its blocks, whatever a k-block scan built), counted on the meta device:
    what FSDP gathers and reduces, for the simulator's communication model."""
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(dataclasses.replace(model_cfg, pretrained=None), "meta").parameters())


def _agree(ctx):
    """(agree(ok) → all ranks ok, agree_min(v) → the smallest v of all ranks); (None, None) on one process."""
    if not ctx.distributed:
        return None, None
    import torch.distributed as dist

    def agree_min(v: int) -> int:
        t = torch.tensor([int(v)], dtype=torch.int64, device=ctx.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    return (lambda ok: agree_min(1 if ok else 0) > 0), agree_min


def device_name(device: torch.device) -> str:
    """The device a calibration was measured on, as its file records it (a GPU's name; CPU with its threads)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"


def out_path(out, name: str) -> str:
    """Where calibrate_config writes: calibrate.out as a .json file, or a folder (FOLDER/calibration.json);
    default runs/calibrate/<name>/calibration.json — never a committed file unless asked for by name."""
    out = out or os.path.join("runs", "calibrate", name)
    return out if str(out).endswith(".json") else os.path.join(out, "calibration.json")


def fit_warnings(cal: Calibration, threshold: float = FIT_WARN) -> list[str]:
    """One message per checkpointing mode whose chosen cost model misses its own points by more than `threshold`
    (relative RMS): its predictions would mislead the planner, and what to do about it."""
    out = []
    for mode, rec in cal.data["modes"].items():
        form = rec["cost_model"]["form"]
        err = (rec.get("fit_errors") or {}).get(form, {}).get("rel_rmse")
        if err is not None and err > threshold:
            out.append(f"checkpointing={mode}: the {form} cost model misses the measured times by {100 * err:.0f} % "
                       f"(relative RMS; above {100 * threshold:.0f} %), so its predictions would mislead the "
                       "planner. The timings are noisy or launch-bound: calibrate on an idle machine, raise "
                       "calibrate.repeats, scan larger micro-batches (calibrate.top_tokens) or, on a CPU, set "
                       "launch.cpu_threads=1")
    return out


@dataclasses.dataclass
class _Setup:
    """What every scan of one calibrate_config call shares: the config and options, the process group, the buckets
    scanned ({name: tokens}) out of the bucket table, the autocast context, the objective and the memory budget."""
    cfg: object
    opts: CalibrateOptions
    ctx: object
    table: dict
    tokens: dict
    autocast: object
    objective: FlowMatching
    budget: Optional[float]


def calibrate_config(cfg, opts: CalibrateOptions | dict | None = None, command: str = "", log=print, ctx=None,
                     warn=None):
    """Scan, fit and write the calibration of `cfg` (a TrainConfig); returns it (rank 0 writes the file). With
    calibrate.check: runs the given micro-batches instead and returns their rows (check_points). With
    calibrate.fsdp_ranks: a slice for FSDP over that many ranks (module docstring). ctx: the caller's process group
    (training/dist.py; default: this process's); warn: where fit_warnings go (default: log)."""
    opts = CalibrateOptions.of(opts)
    ctx = ctx or init_distributed()
    warn = warn or log
    torch.manual_seed(cfg.train.seed)
    table = bucket_table(cfg.data.buckets, patch=cfg.model.patch)
    names = list(opts.buckets or table)
    missing = [n for n in names if n not in table]
    if missing:
        raise ValueError(f"calibrate.buckets names {missing}, not in data.buckets ({list(table)})")
    tokens = {n: table[n].tokens for n in names}
    fixed = _parse_checks(opts.points, table, "calibrate.points") if opts.points else None
    if fixed and opts.buckets:
        names_ = {n for n, _ in fixed} - set(names)
        if names_:
            raise ValueError(f"calibrate.points names buckets {sorted(names_)} outside calibrate.buckets {names}")
    if fixed and not opts.buckets:  # the points' buckets are the scan's
        tokens = {n: table[n].tokens for n in dict.fromkeys(n for n, _ in fixed)}
    layers = cfg.model.num_layers
    k = opts.blocks or layers
    if k != layers and cfg.model.name != "wan":
        raise ValueError("calibrate.blocks (timing k blocks) is only for Wan's uniform blocks; leave it null")
    if not 1 <= k <= layers:
        raise ValueError(f"calibrate.blocks must lie in [1, model.num_layers={layers}], got {k}")
    R, k2 = _fsdp_options(cfg, opts, ctx, k, layers)
    model, optimizer = _build(cfg, k, ctx)
    graphs = None if R else graphs_for(cfg.train.cuda_graphs, ctx.device, ctx.world_size, graph_blockers(cfg.model),
                                       cfg.train.graph_max_tokens)  # as the trainer runs each micro-batch
    autocast = autocast_for(ctx.device, cfg.model.precision, cache=graphs is None)
    objective = FlowMatching(cfg.objective)
    cuda = ctx.device.type == "cuda"
    # ranks sharing one GPU (launch.debug_share_gpu) each budget their share of it
    hbm = float(torch.cuda.get_device_properties(ctx.device).total_memory) / ctx.ranks_per_device if cuda else None
    budget = (cfg.scheduling.mem_budget_gib * 2**30 if cfg.scheduling.mem_budget_gib
              else HBM_FRACTION * hbm if hbm else None)
    modes = policies_to_measure(cfg.model)
    setup = _Setup(cfg, opts, ctx, table, tokens, autocast, objective, budget)
    if opts.check:
        if k != layers or ctx.world_size > 1 or R:
            raise ValueError("calibrate.check runs the whole model (leave calibrate.blocks and calibrate.fsdp_ranks "
                             "unset) on one process")
        return check_points(setup, modes, model, optimizer, log)
    say = log if ctx.is_main else (lambda s: None)
    t_start = time.perf_counter()
    records, sliced = {}, {}  # sliced: mode → the slice's measurements at each depth
    for mode in modes:
        step, plain, peaks = _step_fns(model, objective, optimizer, table, cfg.model, ctx.device, autocast, mode,
                                       graphs, sliced=R is not None)
        shortest = min(tokens, key=lambda n: (tokens[n], n))
        first = _plain_step(plain, shortest, table, "calibrate.blocks", k) if R else None
        say(f"checkpointing={mode}: " + (f"timing the {len(fixed)} given points (calibrate.points)" if fixed else
                                          f"scanning {len(tokens)} buckets, at most {opts.max_points} timed points"))
        agree, agree_min = _agree(ctx)
        with _dropping_grads(model) if R else nullcontext():
            points = scan(step, tokens, max_points=opts.max_points, top_tokens=opts.top_tokens,
                          mem_budget_bytes=budget, warmup=opts.warmup, repeats=opts.repeats,
                          agree=agree, agree_min=agree_min, time_budget_s=opts.time_budget_s,
                          # a k-block model's bound is not the model's, unless it is an FSDP slice's (docstring)
                          probe_cap=opts.probe_cap and (k == layers or R is not None), fixed_points=fixed,
                          held_bytes=(lambda: graphs.pool_bytes) if graphs is not None else None, log=say)
        records[mode] = fit_mode(points, scale=layers / k, memory_valid=(k == layers and not R),
                                 min_tokens=opts.fit_min_tokens, L=cfg.model.text_len,
                                 joint=cfg.model.name == "mmdit",  # MMDiT's joint attention: (S + L)²
                                 launch=launch_point(first) if first else None)
        if R:
            records[mode]["optim_ms"] = first["optim_ms"] * layers / k
            sliced[mode] = {"points": {k: [dataclasses.asdict(p) for p in points]},
                            "peaks": {k: _peak_rows(points, peaks, opts.repeats)}, "plain": {k: first}}
    elapsed = time.perf_counter() - t_start
    device = device_name(ctx.device)
    m = cfg.model
    notes = [f"scan took {elapsed:.0f} s on {ctx.world_size} rank(s)"]
    if k < layers:
        notes.append(f"timed {k} of {layers} blocks; cost models and optim_ms extrapolated ×{layers / k:g} "
                     "(per-block cost is identical; the non-block part is over-counted by the same factor); "
                     + (f"memory model: FSDP over {R} ranks from depths {k} and {k2} (the notes below; none where "
                        "the second depth did not finish)" if R else
                        "memory model of the k-block model only (memory_model_k_blocks), not used"))
    ext = {"blocks_timed": k, "num_layers": layers, "scale": layers / k} if k < layers else None
    if R:
        ext = {**(ext or {}), "fsdp_ranks": R, "memory_blocks": [k, k2]}
    cal = new_calibration(
        records, model={"name": m.name, "dim": m.dim, "num_layers": m.attention_layers,
                        "num_attention_heads": m.num_attention_heads, "ffn_dim": m.ffn_dim,
                        "text_len": m.text_len, "precision": m.precision,
                        "compile": m.compile, "adaln_backend": m.adaln_backend, "lora_rank": m.lora.rank,
                        "params": full_depth_params(cfg.model)},
        source="measured", device=device, date=datetime.date.today().isoformat(), command=command,
        hbm_bytes=hbm, extrapolation=ext, notes=notes, world_size=ctx.world_size)
    cal.data["execution"] = {**execution(cfg, ctx.device, ctx.world_size), "cuda_graphs": graphs is not None}
    if not cuda:
        cal.data["chosen"] = {"m_mem": CPU_M_MEM_FACTOR * max(tokens.values()),
                              "why": f"CPU: no device memory to bound; m_mem = {CPU_M_MEM_FACTOR}·S_max"}
    out = out_path(opts.out, cfg.name)
    if ctx.is_main:
        cal.save(out)
        for mode, rec in records.items():
            errs = ", ".join(f"{f} {100 * e['rel_rmse']:.2f} % (leave-one-out {100 * e['loo_rel_rmse']:.2f} %)"
                             for f, e in rec["fit_errors"].items())
            log(f"{mode}: relative RMS error {errs}; chosen {rec['cost_model']['form']}")
        for w in fit_warnings(cal):
            warn(w)
        log(f"wrote {out} ({elapsed:.0f} s)")
    if cuda and not R and k == layers and ctx.world_size == 1 and {"none", "full"} <= set(modes) and budget:
        # after the scan is saved: a check that fails costs the checks only
        step_for = (lambda kj: make_step_fn(model, objective, optimizer, table, cfg.model, ctx.device, autocast, kj,
                                            graphs))  # as the trainer runs each micro-batch
        if scan_partial_checks(cal, cfg, model, budget, tokens, step_for, opts, say,
                               held_bytes=float(graphs.pool_bytes) if graphs is not None else 0.0):
            cal.save(out)
            log(f"wrote {out} again: " + ("with its partial checks" if "partial_checks" in cal.data
                                           else "with the note of the partial checks' failure"))
    if R:
        del model, optimizer, step, plain
        _second_depth(setup, cal, sliced, k, k2, R, say)
        _fit_at_full_depth(cal, opts.fit_min_tokens, say)
        if ctx.is_main:
            cal.save(out)
            log(f"wrote {out} with the FSDP memory model ({time.perf_counter() - t_start:.0f} s)")
    ctx.barrier()
    return cal


def scan_partial_checks(cal: Calibration, cfg, model, budget: float, tokens: dict, step_for, opts, log,
                        held_bytes: float = 0.0) -> bool:
    """The scan's partial checks (partial_checks) into cal.data["partial_checks"]: True where `cal` changed (rows
    from checks that ran, or the note of their failure). One that fails otherwise than out of memory is logged and
    noted in the file, never lost with the scan it follows."""
    from scheduling.policy import ModelShape, _partial_recompute

    m = cfg.model  # checkpointing=auto's policy over this scan's fitted models, at the scan's budget
    pr = _partial_recompute(dataclasses.replace(cfg.scheduling, mem_budget_gib=budget / 2**30), cal,
                            ModelShape.of(m, model.num_matmul_params()), "auto", m.keep_attention, 1,
                            cal.memory_model("full"), cal.cost_model("full"), min(tokens.values()))
    if pr is None:
        return False
    try:
        rows = partial_checks(step_for, pr, tokens, opts.warmup, opts.repeats, log, held_bytes=held_bytes)
    except Exception as e:  # noqa: BLE001 — the scan is saved; the checks only are lost
        why = f"{type(e).__name__}: {str(e)[:300]}"
        log(f"partial checks failed ({why}); the scan is kept without them")
        cal.data["notes"].append(f"partial checks failed: {why}")
        return True
    cal.data["partial_checks"] = rows
    return bool(rows)


def partial_checks(step_for, policy, tokens: dict, warmup: int, repeats: int, log, limit: int = 2,
                   held_bytes: float = 0.0, retries: int = 3) -> list[dict]:
    """The longest buckets (at most `limit`) whose one sample fits only with some blocks recomputed, each run once
    warm and `repeats` times under the policy's own choice (k blocks recomputed, j keeping attention): their peaks
    beside the prediction. none's memory model is extrapolated there, since a clip that does not fit whole cannot be
    measured whole; scheduling/policy.py partial_check_scale corrects it from these. step_for((k, j)) → step_fn.
    held_bytes: what the CUDA graphs' pool of the scan holds beside the checks (their choice is made at the budget
    less it). One that runs out of memory is tried again at a budget 10 % smaller, up to `retries` times, so that
    what is recorded is a peak, never a guess; the row says each budget tried."""
    rows = []
    for name in sorted(tokens, key=lambda n: -tokens[n]):
        S = tokens[name]
        if not 0 < policy.decide(1, S)[0] < policy.layers:
            continue
        tried = []
        for attempt in range(retries + 1):
            pr = dataclasses.replace(policy, budget=(policy.budget - held_bytes) * 0.9 ** attempt)
            k, j = pr.decide(1, S)
            row = {"bucket": name, "S": S, "B": 1, "k": k, "j": j, "predicted_peak_bytes": pr.peak(1, S, k, j),
                   "budget_bytes": pr.budget, "held_bytes": held_bytes}
            step = step_for((k, j))
            try:
                for _ in range(warmup):
                    step(name, 1)
                runs = [step(name, 1) for _ in range(repeats)]
            except Infeasible as e:
                row.update(fits=False, why=str(e)[:300])
                tried.append([k, j])
                if k >= policy.layers:
                    break
                continue
            peaks = [r.peak_bytes for r in runs if r.peak_bytes is not None]
            row.update(fits=True, ms=float(np.median([r.ms for r in runs])), ms_runs=[r.ms for r in runs],
                       peak_bytes=max(peaks) if peaks else None)
            break
        row["out_of_memory_at"] = list(tried)  # the (k, j) of every try that ran out of memory
        rows.append(row)
        gib = (lambda v: f"{v / 2**30:.1f} GiB" if v else "—")
        log(f"partial check {name} S={S} B=1, {row['k']} blocks recomputed ({row['j']} keeping attention): "
            + (f"peak {gib(row['peak_bytes'])}, {row['ms']:.0f} ms" if row["fits"] else "out of memory")
            + f" (predicted {gib(row['predicted_peak_bytes'])}"
            + (f"; out of memory first at (k, j) = {', '.join(map(str, map(tuple, tried)))}" if tried else "") + ")")
        if len(rows) == limit:
            break
    return rows


def _fsdp_options(cfg, opts, ctx, k: int, layers: int) -> tuple[int | None, int | None]:
    """(R, the second depth) of calibrate.fsdp_ranks / memory_blocks, checked; (None, None) without fsdp_ranks."""
    R = opts.fsdp_ranks
    if R is None:
        return None, None
    if isinstance(R, bool) or not isinstance(R, int) or R < 1:
        raise ValueError(f"calibrate.fsdp_ranks must be an integer ≥ 1 (the run's number of ranks), got {R!r}")
    if cfg.model.name != "wan":
        raise ValueError("calibrate.fsdp_ranks measures a slice of Wan's uniform blocks; model.name must be wan")
    if ctx.world_size > 1:
        raise ValueError("calibrate.fsdp_ranks measures a one-device slice for R ranks: run it in one process "
                         "(launch.num_processes=1, no torchrun)")
    if cfg.train.cuda_graphs == "on":
        raise ValueError("calibrate.fsdp_ranks times eager micro-batches, as FSDP runs them: set "
                         "train.cuda_graphs=off (or auto)")
    k2 = opts.memory_blocks
    k2 = (k // 2 if k >= 2 else 2) if k2 is None else k2
    if isinstance(k2, bool) or not isinstance(k2, int) or not 1 <= k2 <= layers or k2 == k:
        raise ValueError(f"calibrate.memory_blocks (the slice's second depth) must be an integer in [1, "
                         f"model.num_layers={layers}] other than calibrate.blocks={k}, got {k2!r}")
    return R, k2


def _build(cfg, k: int, ctx):
    model = build_model(dataclasses.replace(cfg.model, num_layers=k), ctx.device)
    parallelize(model, compile=cfg.model.compile, world_size=ctx.world_size)
    optimizer, _ = build_optimizer(model, cfg.optim, 1000)
    return model, optimizer


def _step_fns(model, objective, optimizer, table, model_cfg, device, autocast, mode, graphs, sliced: bool):
    """(the scan's step_fn, a plain one, the peaks dict the first records into): for a slice the scan's step
    records its peaks; without one, all three are the plain step_fn and None."""
    policy = {"none": False, "full": True, "keep": (len(model.blocks), len(model.blocks))}[mode]
    plain = make_step_fn(model, objective, optimizer, table, model_cfg, device, autocast, policy, graphs)
    if not sliced:
        return plain, plain, None
    peaks: dict = {}
    return make_step_fn(model, objective, optimizer, table, model_cfg, device, autocast, policy, graphs,
                        peaks=peaks), plain, peaks


def policies_to_measure(model_cfg) -> list[str]:
    """The checkpointing policies a calibration of this config measures, each a record of its own: the configured
    mode (none or full), or for auto both; and keep (every block recomputed around its kept attention) where
    model.keep_attention is true or auto, so that scheduling/policy.py prices and bounds the policy each micro-batch
    runs."""
    modes = ["none", "full"] if model_cfg.checkpointing == "auto" else [model_cfg.checkpointing]
    if model_cfg.keep_attention in (True, "auto") and model_cfg.checkpointing != "none":
        modes.append("keep")
    return modes


def execution(cfg, device: torch.device, world_size: int) -> dict:
    """How a micro-batch runs, as a calibration must have measured it to price this run: the attention kernel
    model.attention_backend resolves to here, the fused ops, CUDA graphs (as the trainer would run them: off over
    several processes), precision and compile, and launch.debug_share_gpu (a rehearsal's times and memory are no
    whole GPU's; a file without the key was measured on whole GPUs)."""
    m = cfg.model
    off = graphs_off_because(cfg.train.cuda_graphs, device, world_size, graph_blockers(m))
    return {"attention": attention_kernel(m.attention_backend, device, cudnn=cudnn_allowed(m.name)),
            "fused_ops": m.fused_ops, "cuda_graphs": not off, "precision": m.precision, "compile": m.compile,
            "shared_gpu": cfg.launch.debug_share_gpu}  # ranks sharing a GPU: contended, half the memory


def _plain_step(plain, name: str, table, field: str, blocks: int) -> dict:
    """Two plain steps at (name, B = 1), gradients kept: the first creates AdamW's state (which the steps that drop
    their gradients then hold); the second's peak is the optimizer step's and its optim_ms the update's."""
    runs, err = run_point(plain, name, 1, 1, 1)
    if err:
        raise ValueError(f"{field}={blocks}: a plain training step of {blocks} blocks (fp32 weights, gradients, "
                         f"AdamW state) runs out of memory at {name}, B = 1: lower {field}")
    r = runs[0]
    return {"bucket": name, "S": table[name].tokens, "B": 1, "ms": r.ms, "optim_ms": r.optim_ms,
            "peak_bytes": r.peak_bytes}


@contextmanager
def _dropping_grads(model):
    """Each parameter's gradient dropped as soon as it is accumulated — as FSDP's reduce-scatter frees a block's
    unsharded gradients — so that no peak holds the gradients of blocks already done."""
    def drop(p):
        p.grad = None

    hooks = [p.register_post_accumulate_grad_hook(drop) for p in model.parameters() if p.requires_grad]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def _peak_rows(points, peaks: dict | None, repeats: int) -> list[dict]:
    """One row per timed point of the peaks its timed repeats recorded (the warm-up's left out: it may autotune)."""
    rows = []
    for p in points:
        recs = (peaks or {}).get((p.bucket, p.B), [])[-repeats:]
        if p.feasible and recs:
            rows.append({"bucket": p.bucket, "S": p.S, "B": p.B, **{k: max(r[k] for r in recs)
                                                                     for k in ("forward", "backward", "cache")}})
    return rows


def _second_depth(setup: _Setup, cal, sliced, k: int, k2: int, R: int, say) -> None:
    """The slice at k2 blocks: the plain steps, then the main scan's timed points again; then each mode's FSDP
    memory model, its measurements and notes into `cal`."""
    cfg, opts, ctx, table, tokens = setup.cfg, setup.opts, setup.ctx, setup.table, setup.tokens
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    model, optimizer = _build(cfg, k2, ctx)
    budget_s, warmup, repeats = opts.memory_time_budget_s, opts.warmup, opts.repeats
    t_all = time.perf_counter()
    for mode, sl in sliced.items():
        step, plain, peaks = _step_fns(model, setup.objective, optimizer, table, cfg.model, ctx.device,
                                       setup.autocast, mode, None, sliced=True)
        shortest = min(tokens, key=lambda n: (tokens[n], n))
        sl["plain"][k2] = _plain_step(plain, shortest, table, "calibrate.memory_blocks", k2)
        say(f"checkpointing={mode}: the scan's points again at {k2} blocks")
        points, t0 = [], time.perf_counter()  # each policy its own budget, as the main scan gives each its own
        with _dropping_grads(model):
            # cheapest first: as many points as the time budget allows (each adds to the fits)
            for p in sorted((Point(**d) for d in sl["points"][k] if d["feasible"]), key=lambda p: p.ms):
                if budget_s is not None and time.perf_counter() - t0 > budget_s:
                    points.append(Point(p.bucket, p.S, p.B, False, why=f"time budget of {budget_s:g} s spent"))
                    continue
                runs, err = run_point(step, p.bucket, p.B, warmup, repeats)
                points.append(timed_point(p.bucket, p.S, p.B, runs, say) if not err else
                              Point(p.bucket, p.S, p.B, False, why=f"out of memory: {err[:200]}"))
        sl["points"][k2] = [dataclasses.asdict(p) for p in points]
        sl["peaks"][k2] = _peak_rows(points, peaks, repeats)
        m = cfg.model
        largest = max(((d["B"], d["S"]) for d in sl["points"][k] if d["feasible"] and d["B"] * d["S"]
                       <= (opts.top_tokens or 2 * max(tokens.values()))), key=lambda bs: bs[0] * bs[1],
                      default=None)  # the ladder's largest micro-batch (the memory probe lies beyond the ladder)
        blocks = model.blocks
        params_block = float(sum(p.numel() for p in blocks[0].parameters()))
        params_fixed = float(sum(p.numel() for p in model.parameters())) - k2 * params_block
        rec = slice_record(main=k, second=k2, points=sl["points"], peaks=sl["peaks"], plain=sl["plain"],
                           layers=m.num_layers, params_block=params_block, params_fixed=params_fixed, ranks=R,
                           ema=cfg.optim.ema_decay is not None, budget=setup.budget, largest=largest)
        mrec = cal.data["modes"][mode]
        mrec["memory_model"] = rec["memory_model"]
        mrec["slice_memory"], mrec["depth_check"] = rec["slice_memory"], rec["depth_check"]
        cal.data["notes"] += [f"{mode}: {n}" if len(sliced) > 1 else n for n in rec["notes"]]
    cal.data["notes"].append(f"second depth ({k2} blocks) took {time.perf_counter() - t_all:.0f} s")


def _fit_at_full_depth(cal, min_tokens, say) -> None:
    """A slice timed at two depths: each policy's cost model fitted again on its points at the full depth (t_fixed +
    L·t_block where a point has both depths, × L/k where it has one: scheduling/calibrate.py fit_mode's
    depth_factors), where the simulator's truth puts them (Calibration.measured_points)."""
    refitted = [mode for mode in cal.modes if cal.affine_scales(mode)]
    if not refitted:
        return
    for mode in refitted:
        cal.data["modes"][mode]["fit_depth"] = "affine"
    refit(cal, min_tokens)
    cal.data["notes"].append(f"cost models of {', '.join(refitted)} fitted at the full depth: each point's t_fixed + "
                             "L·t_block from its two depths where it was timed at both (depth_check), × L/k elsewhere")
    for mode in refitted:
        rec = cal.data["modes"][mode]
        errs = ", ".join(f"{f} {100 * e['rel_rmse']:.2f} % (leave-one-out {100 * e['loo_rel_rmse']:.2f} %)"
                         for f, e in rec["fit_errors"].items())
        launch = rec.get("launch_rel_err") or {}
        say(f"{mode} at the full depth: relative RMS error {errs}; chosen {rec['cost_model']['form']}"
            + (f"; the plain step {100 * launch[rec['cost_model']['form']]:+.1f} %" if launch else ""))


def _parse_checks(items, table, key: str = "calibrate.check") -> list[tuple[str, int]]:
    out = []
    for item in items:
        name, _, B = str(item).partition(":")
        if name not in table or not B.isdigit() or int(B) < 1:
            raise ValueError(f"{key}={item!r}: expected bucket:B with a bucket of data.buckets "
                             f"({list(table)}) and B ≥ 1")
        out.append((name, int(B)))
    return out


def check_points(setup: _Setup, modes, model, optimizer, log) -> list[dict]:
    """calibrate.check: one step at each bucket:B, its peak and ms beside the calibration's predictions."""
    cfg, opts, ctx, table, budget = setup.cfg, setup.opts, setup.ctx, setup.table, setup.budget
    checks = _parse_checks(opts.check, table)
    if len(modes) != 1:
        raise ValueError("calibrate.check runs one checkpointing mode: set model.checkpointing to none or full")
    cal = Calibration.load(cfg.scheduling.calibration) if cfg.scheduling.calibration else None
    mode = cal.mode_name(modes[0]) if cal else None
    mem, cost = (cal.memory_model(mode), cal.cost_model(mode)) if cal else (None, None)
    step_fn = make_step_fn(model, setup.objective, optimizer, table, cfg.model, ctx.device, setup.autocast,
                           modes[0] == "full")
    step_fn(checks[0][0], 1)  # the optimizer's state exists from the first step on: every peak below includes it
    rows = []
    for name, B in checks:
        S = table[name].tokens
        row = {"bucket": name, "S": S, "B": B, "calibration": cal.path if cal else None,
               "predicted_peak_bytes": float(mem.predict(B, S)) if mem else None,
               "predicted_ms": float(cost.predict(B, S)) if cost else None, "budget_bytes": budget}
        try:
            for _ in range(opts.warmup):
                step_fn(name, B)
            runs = [step_fn(name, B) for _ in range(opts.repeats)]
            peaks = [r.peak_bytes for r in runs if r.peak_bytes is not None]
            row.update(fits=True, ms=float(np.median([r.ms for r in runs])), ms_runs=[r.ms for r in runs],
                       optim_ms=runs[0].optim_ms, peak_bytes=max(peaks) if peaks else None)
        except Infeasible as e:
            row.update(fits=False, why=str(e)[:300])
        rows.append(row)
        gib = (lambda v: f"{v / 2**30:.1f} GiB" if v else "—")
        log(f"check {name} S={S} B={B}: " + (f"peak {gib(row['peak_bytes'])}, {row['ms']:.0f} ms" if row["fits"]
                                              else "out of memory")
            + f" (predicted {gib(row['predicted_peak_bytes'])}"
            + (f", {row['predicted_ms']:.0f} ms" if row["predicted_ms"] else "") + ")")
    if opts.out and ctx.is_main:
        os.makedirs(os.path.dirname(os.path.abspath(opts.out)), exist_ok=True)
        with open(opts.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "CPU",
                       "date": datetime.date.today().isoformat(), "checkpointing": modes[0], "rows": rows}, f,
                      indent=1)
    return rows


def refit_file(path: str, min_tokens, command: str, out=None, log=print) -> Calibration:
    """Fit a calibration's measured points again (no device): `+calibrate.refit=FILE +calibrate.fit_min_tokens=N`;
    written to out (a file or folder, as calibrate_config's) or over FILE."""
    cal = refit(Calibration.load(path), min_tokens)
    cal.data["notes"].append(f"refitted with fit_min_tokens={min_tokens} by: {command}")
    cal.save(out_path(out, "") if out else path)
    for w in fit_warnings(cal):
        log(f"warning: {w}")
    for mode, rec in cal.data["modes"].items():
        errs = ", ".join(f"{f} {100 * e['rel_rmse']:.2f} % (leave-one-out {100 * e['loo_rel_rmse']:.2f} %)"
                         for f, e in rec["fit_errors"].items())
        launch = " and the launch point" if rec.get("launch_point") else ""
        log(f"{mode}: {rec['fit_points']} points{launch} fitted; relative RMS error {errs}; "
            f"chosen {rec['cost_model']['form']}")
    return cal


CACHE = "calibration.json"  # in the run folder: what scheduling.calibration=auto measured, reused on resume
RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")


def mismatch(cal: Calibration, model_cfg, device: str, world_size: int, want: dict | None = None) -> str | None:
    """Why `cal` cannot price this run's micro-batches (None when it can): another model (name, width, depth, text
    length, precision, LoRA rank: an adapter's backward and optimizer are not the full model's), another device (GPU
    name; any CPU for a CPU), a checkpointing policy the run may choose that it did not measure
    (policies_to_measure), memory measured on another number of processes without an FSDP model to rescale, or
    another execution (`want`, this run's `execution`: attention kernel, fused ops, CUDA graphs,
    precision, compile; a file that does not record one was measured before they were recorded)."""
    m = cal.data.get("model") or {}
    ours = {"name": model_cfg.name, "dim": model_cfg.dim, "num_layers": model_cfg.attention_layers,
            "text_len": model_cfg.text_len, "precision": model_cfg.precision}
    diff = [f"{k} {m[k]}" for k, v in ours.items() if m.get(k) is not None and m[k] != v]
    if int(m.get("lora_rank") or 0) != model_cfg.lora.rank:  # a file without the key was measured without LoRA
        diff.append(f"LoRA rank {int(m.get('lora_rank') or 0)} there, {model_cfg.lora.rank} here")
    if diff:
        return "another model (" + ", ".join(diff) + ")"
    theirs = str(cal.data.get("device") or "")
    if theirs.split(" (")[0] != device.split(" (")[0]:
        return f"measured on {theirs or 'an unnamed device'}"
    try:
        mode = cal.mode_name(model_cfg.checkpointing)
    except ValueError:
        return f"checkpointing modes {cal.modes}, not {model_cfg.checkpointing}"
    missing = [p for p in policies_to_measure(model_cfg) if p not in cal.modes]
    if missing:
        return (f"policies {cal.modes} measured, not {missing} (model.checkpointing={model_cfg.checkpointing}, "
                f"keep_attention={model_cfg.keep_attention})")
    mem = cal.data["modes"][mode].get("memory_model")
    ranks = int(cal.data.get("world_size") or 1)
    if mem and ranks != world_size and mem.get("kind") != "fsdp":
        return f"its memory was measured on {ranks} process(es) without an FSDP model to rescale to {world_size}"
    if want is not None:
        ran = cal.data.get("execution")
        if ran is None:
            return "it does not record how its micro-batches ran (attention kernel, CUDA graphs, fused ops)"
        diff = [f"{k} {ran.get(k)} there, {v} here" for k, v in want.items() if ran.get(k) != v]
        if diff:
            return "another execution (" + ", ".join(diff) + ")"
    return None


def find_calibration(cfg, device: str, world_size: int, search: str | None = RESULTS, want: dict | None = None
                     ) -> tuple[str | None, str | list[str]]:
    """(path, how) of the first file that fits this run (`mismatch`; want: the run's `execution`): the run folder's
    cached one, else one in `search`; (None, [why each file was passed over]) when none does. Unreadable files are
    passed over, never fatal."""
    cached = os.path.join(cfg.run_dir, CACHE)
    rejected = []
    files = [cached] + (sorted(glob.glob(os.path.join(search, "calibration_*.json"))) if search else [])
    for path in files:
        if not os.path.exists(path):
            continue
        try:
            why = mismatch(Calibration.load(path), cfg.model, device, world_size, want)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            why = f"unreadable ({str(e).splitlines()[0][:120] if str(e) else type(e).__name__})"
        if why is None:
            return path, "cached in the run folder" if path == cached else f"measured on this model and {device}"
        rejected.append(f"{os.path.relpath(path)}: {why}")
    return None, rejected


def check_named_calibration(cfg, ctx) -> str | None:
    """A file the config names (scheduling.calibration=PATH) is the user's choice and is used; where
    calibration=auto would have passed it over (`mismatch`: another precision, LoRA rank, device, policy set or
    execution), this says why, for one warning line. None where it fits, or where no file is named."""
    path = cfg.scheduling.calibration
    if not path or path == "auto" or not os.path.exists(path):
        return None
    why = mismatch(Calibration.load(path), cfg.model, device_name(ctx.device), ctx.world_size,
                   execution(cfg, ctx.device, ctx.world_size))
    return None if why is None else (f"scheduling.calibration={path}: {why}, so its times and memory may not be "
                                     "this run's (scheduling.calibration=auto would pass it over)")


def calibration_for_run(cfg, ctx, log, search: str | None = RESULTS) -> tuple[str, str]:
    """scheduling.calibration=auto: (the file to use, how it was found). find_calibration's file, else the shape
    benchmark now, in the live set-up (every rank, the model sharded as the run shards it; at most
    scheduling.benchmark_points points within benchmark_time_s), written to <run_dir>/calibration.json (a stale one
    there is moved aside first). Rank 0 decides; every rank gets its answer."""
    cached = os.path.join(cfg.run_dir, CACHE)
    dev = device_name(ctx.device)
    found = None
    if ctx.is_main:
        path, how = find_calibration(cfg, dev, ctx.world_size, search, execution(cfg, ctx.device, ctx.world_size))
        if path is not None:
            found = (path, how)
        else:
            if how:
                log("scheduling.calibration=auto: no file fits this run (" + "; ".join(how) + ")")
            if os.path.exists(cached):
                aside = cached[:-len(".json")] + time.strftime("-replaced-%Y%m%d-%H%M%S.json")
                os.replace(cached, aside)
                log(f"scheduling.calibration=auto: the run folder's calibration moved to {aside}")
    found = ctx.gather_objects(found)[0]
    if found is not None:
        return found
    sc = cfg.scheduling
    if ctx.is_main:
        log(f"scheduling.calibration=auto: running the shape benchmark on {dev} over {ctx.world_size} process(es) "
            f"(at most {sc.benchmark_points} points, {sc.benchmark_time_s:g} s); it is cached in {cached}")
    t0 = time.perf_counter()
    calibrate_config(cfg, {"max_points": sc.benchmark_points, "time_budget_s": sc.benchmark_time_s, "out": cached},
                     command="train.py scheduling.calibration=auto", ctx=ctx,
                     log=lambda s: None, warn=log if ctx.is_main else (lambda s: None))
    # the benchmark's graphs captured on a stream of their own, whose cuBLAS workspaces the run would hold beside
    # its own graphs' stream: every graph of the benchmark is gone with calibrate_config's frame
    clear_cublas_workspaces(ctx.device)
    return cached, f"measured now ({time.perf_counter() - t0:.0f} s shape benchmark), cached in the run folder"

"""Calibrate the scheduler for a training config: time real training steps over (bucket, B), fit, write the file.

    python scripts/calibrate.py conf=wan21_1p3b                      writes scheduling.calibration (or
                                                                     results/calibration_<name>.json)
    python scripts/calibrate.py conf=wan21_1p3b +calibrate.blocks=4 +calibrate.max_points=12 +calibrate.time_budget_s=420
    torchrun --nproc_per_node 8 scripts/calibrate.py conf=wan21_8gpu  the live FSDP set-up; feasibility agreed by
                                                                     all-reduce, rank 0 writes the file

Options (`+calibrate.KEY=VALUE`): max_points (12), blocks (time k of the model's blocks and extrapolate ×
layers/k; the file says so), warmup (1), repeats (2), top_tokens (largest B·S aimed at; default 2·S_max),
time_budget_s, buckets (a list of names; default all), out (the file; default scheduling.calibration),
fit_min_tokens (points with B·S below it stay in the file but out of the cost fit; default null: every point is
fitted, the cost model's launch floor pricing the small ones that wait on the host),
refit (a calibration file: fit its measured points again with fit_min_tokens, no device; writes out or itself),
probe_cap (true: the last point is the shortest bucket at the memory model's largest B; scheduling/calibrate.py),
check (a list of bucket:B, e.g. [i480:461,i480:328]: no scan; warmup + repeats steps each, after one step that
creates the optimizer's state; peak and ms against scheduling.calibration's memory and cost models — does this
micro-batch fit, and how long does it take? — written to out as JSON if given).

The step: the config's model (models.build.build_model), precision (autocast), checkpointing mode (model.checkpointing;
`auto` scans both `none` and `full`), compile and FSDP; flow matching on synthetic inputs of each bucket's latent
shape; forward + backward timed as `ms`, the AdamW step apart as `optim_ms`; the peak of the whole step; an
out-of-memory frees what the step held and reports the point infeasible (scheduling/calibrate.py runs the scan).
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import os
import platform
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from data.buckets import bucket_table  # noqa: E402
from models.build import build_model, model_inputs  # noqa: E402
from models.flow_matching import FlowMatching  # noqa: E402
from models.parallelize import parallelize  # noqa: E402
from scheduling.calibrate import (HBM_FRACTION, Calibration, Infeasible, StepResult, fit_mode,  # noqa: E402
                                  new_calibration, refit, scan)
from training.dist import init_distributed  # noqa: E402
from training.optim import build_optimizer  # noqa: E402
from training.cuda_graphs import graph_blockers, graphs_for  # noqa: E402
from training.step import autocast_for  # noqa: E402

DEFAULTS = dict(max_points=12, blocks=None, warmup=1, repeats=2, top_tokens=None, time_budget_s=None,
                buckets=None, out=None, fit_min_tokens=None, refit=None, probe_cap=True, check=None)
CPU_M_MEM_FACTOR = 8  # CPU: no device memory to bound; m_mem = 8·S_max so every rule has a bound


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_step_fn(model, objective, optimizer, buckets, model_cfg, device, autocast, checkpointing: bool,
                 graphs=None):
    """step_fn(bucket, B) → StepResult: one real training step on synthetic inputs (CONTRACTS §6). With `graphs`
    (training/cuda_graphs.py, as the trainer runs) each (bucket, B) is captured before it is timed: the capture
    and its eager warm-up run untimed, and the peak is the capture's (a replay allocates nothing)."""
    cuda = device.type == "cuda"
    loss_sum = torch.zeros((), device=device)
    capture_peak: dict = {}  # key → the peak while it was captured (a replay allocates nothing of its own)

    def micro_batch(x: dict) -> None:
        cond = model_inputs(model_cfg, SimpleNamespace(latents=x["x0"], text=x["text"], text_mask=x["mask"],
                                                       pooled=None, B=x["x0"].shape[0]))
        with autocast():
            loss = objective.per_sample_loss(model, x["x0"], x["text"], x["t"], x["noise"], **cond).mean()
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
            model.set_activation_checkpointing(checkpointing)
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
                _sync(device)
                t0 = time.perf_counter()
                micro_batch(x)
            _sync(device)
            t1 = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=graphs is None)
            _sync(device)
            t2 = time.perf_counter()
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
        return StepResult((t1 - t0) * 1e3, (t2 - t1) * 1e3, peak)

    return step_fn


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


def calibrate_config(cfg, opts: dict | None = None, command: str = "", log=print):
    """Scan, fit and write the calibration of `cfg` (a TrainConfig); returns it (rank 0 writes the file). With
    calibrate.check: runs the given micro-batches instead and returns their rows (check_points)."""
    opts = {**DEFAULTS, **(opts or {})}
    unknown = set(opts) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown calibrate option(s) {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    ctx = init_distributed()
    torch.manual_seed(cfg.train.seed)
    table = bucket_table(cfg.data.buckets, patch=cfg.model.patch)
    names = list(opts["buckets"] or table)
    missing = [n for n in names if n not in table]
    if missing:
        raise ValueError(f"calibrate.buckets names {missing}, not in data.buckets ({list(table)})")
    tokens = {n: table[n].tokens for n in names}
    layers = cfg.model.num_layers
    k = int(opts["blocks"] or layers)
    if k != layers and cfg.model.name != "wan":
        raise ValueError("calibrate.blocks (timing k blocks) is only for Wan's uniform blocks; leave it null")
    if not 1 <= k <= layers:
        raise ValueError(f"calibrate.blocks must lie in [1, model.num_layers={layers}], got {k}")
    model = build_model(dataclasses.replace(cfg.model, num_layers=k), ctx.device)
    parallelize(model, compile=cfg.model.compile, world_size=ctx.world_size)
    optimizer, _ = build_optimizer(model, cfg.optim, 1000)
    graphs = graphs_for(cfg.train.cuda_graphs, ctx.device, ctx.world_size, graph_blockers(cfg.model),
                        cfg.train.graph_max_tokens)  # as the trainer runs each micro-batch
    autocast = autocast_for(ctx.device, cfg.model.precision, cache=graphs is None)
    objective = FlowMatching(cfg.objective)
    cuda = ctx.device.type == "cuda"
    hbm = float(torch.cuda.get_device_properties(ctx.device).total_memory) if cuda else None
    budget = (cfg.scheduling.mem_budget_gib * 2**30 if cfg.scheduling.mem_budget_gib
              else HBM_FRACTION * hbm if hbm else None)
    modes = ["none", "full"] if cfg.model.checkpointing == "auto" else [cfg.model.checkpointing]
    if opts["check"]:
        if k != layers or ctx.world_size > 1:
            raise ValueError("calibrate.check runs the whole model (leave calibrate.blocks unset) on one process")
        return check_points(cfg, opts, table, modes, model, objective, optimizer, ctx, autocast, budget, log)
    t_start = time.perf_counter()
    records = {}
    for mode in modes:
        step_fn = make_step_fn(model, objective, optimizer, table, cfg.model, ctx.device, autocast, mode == "full",
                               graphs)
        say = log if ctx.is_main else (lambda s: None)
        say(f"checkpointing={mode}: scanning {len(tokens)} buckets, at most {opts['max_points']} timed points")
        agree, agree_min = _agree(ctx)
        points = scan(step_fn, tokens, max_points=int(opts["max_points"]), top_tokens=opts["top_tokens"],
                      mem_budget_bytes=budget, warmup=int(opts["warmup"]), repeats=int(opts["repeats"]),
                      agree=agree, agree_min=agree_min, time_budget_s=opts["time_budget_s"],
                      probe_cap=bool(opts["probe_cap"]) and k == layers,  # a k-block model's bound is not the model's
                      log=say)
        records[mode] = fit_mode(points, scale=layers / k, memory_valid=(k == layers),
                                 min_tokens=opts["fit_min_tokens"], L=cfg.model.text_len,
                                 joint=cfg.model.name == "mmdit")  # MMDiT's joint attention: (S + L)²
    elapsed = time.perf_counter() - t_start
    device = (torch.cuda.get_device_name(ctx.device) if cuda
              else f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)")
    m = cfg.model
    notes = [f"scan took {elapsed:.0f} s on {ctx.world_size} rank(s)"]
    if k < layers:
        notes.append(f"timed {k} of {layers} blocks; cost models and optim_ms extrapolated ×{layers / k:g} "
                     "(per-block cost is identical; the non-block part is over-counted by the same factor); "
                     "memory model of the k-block model only (memory_model_k_blocks), not used")
    cal = new_calibration(
        records, model={"name": m.name, "dim": m.dim, "num_layers": m.attention_layers,
                        "num_attention_heads": m.num_attention_heads, "ffn_dim": getattr(m, "ffn_dim", None),
                        "text_len": m.text_len, "precision": m.precision,
                        "compile": m.compile, "adaln_backend": m.adaln_backend},
        source="measured", device=device, date=datetime.date.today().isoformat(), command=command,
        hbm_bytes=hbm, extrapolation={"blocks_timed": k, "num_layers": layers, "scale": layers / k} if k < layers else None,
        notes=notes, world_size=ctx.world_size)
    if not cuda:
        cal.data["chosen"] = {"m_mem": CPU_M_MEM_FACTOR * max(tokens.values()),
                              "why": f"CPU: no device memory to bound; m_mem = {CPU_M_MEM_FACTOR}·S_max"}
    out = opts["out"] or cfg.scheduling.calibration or os.path.join("results", f"calibration_{cfg.name}.json")
    if ctx.is_main:
        cal.save(out)
        for mode, rec in records.items():
            errs = ", ".join(f"{f} {100 * e['rel_rmse']:.2f} % (leave-one-out {100 * e['loo_rel_rmse']:.2f} %)"
                             for f, e in rec["fit_errors"].items())
            log(f"{mode}: relative RMS error {errs}; chosen {rec['cost_model']['form']}")
        log(f"wrote {out} ({elapsed:.0f} s)")
    ctx.barrier()
    return cal


def _parse_checks(items, table) -> list[tuple[str, int]]:
    out = []
    for item in items:
        name, _, B = str(item).partition(":")
        if name not in table or not B.isdigit() or int(B) < 1:
            raise ValueError(f"calibrate.check={item!r}: expected bucket:B with a bucket of data.buckets "
                             f"({list(table)}) and B ≥ 1")
        out.append((name, int(B)))
    return out


def check_points(cfg, opts, table, modes, model, objective, optimizer, ctx, autocast, budget, log) -> list[dict]:
    """calibrate.check: one step at each bucket:B, its peak and ms beside the calibration's predictions."""
    checks = _parse_checks(opts["check"], table)
    if len(modes) != 1:
        raise ValueError("calibrate.check runs one checkpointing mode: set model.checkpointing to none or full")
    cal = Calibration.load(cfg.scheduling.calibration) if cfg.scheduling.calibration else None
    mode = cal.mode_name(modes[0]) if cal else None
    mem, cost = (cal.memory_model(mode), cal.cost_model(mode)) if cal else (None, None)
    step_fn = make_step_fn(model, objective, optimizer, table, cfg.model, ctx.device, autocast, modes[0] == "full")
    step_fn(checks[0][0], 1)  # the optimizer's state exists from the first step on: every peak below includes it
    rows = []
    for name, B in checks:
        S = table[name].tokens
        row = {"bucket": name, "S": S, "B": B, "calibration": cal.path if cal else None,
               "predicted_peak_bytes": float(mem.predict(B, S)) if mem else None,
               "predicted_ms": float(cost.predict(B, S)) if cost else None, "budget_bytes": budget}
        try:
            for _ in range(int(opts["warmup"])):
                step_fn(name, B)
            runs = [step_fn(name, B) for _ in range(int(opts["repeats"]))]
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
    if opts["out"] and ctx.is_main:
        os.makedirs(os.path.dirname(os.path.abspath(opts["out"])), exist_ok=True)
        with open(opts["out"], "w") as f:
            json.dump({"device": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "CPU",
                       "date": datetime.date.today().isoformat(), "checkpointing": modes[0], "rows": rows}, f,
                      indent=1)
    return rows


def refit_file(path: str, min_tokens, command: str, out=None, log=print) -> Calibration:
    """Fit a calibration's measured points again (no device): `+calibrate.refit=FILE +calibrate.fit_min_tokens=N`."""
    cal = refit(Calibration.load(path), min_tokens)
    cal.data["notes"].append(f"refitted with fit_min_tokens={min_tokens} by: {command}")
    cal.save(out or path)
    for mode, rec in cal.data["modes"].items():
        errs = ", ".join(f"{f} {100 * e['rel_rmse']:.2f} % (leave-one-out {100 * e['loo_rel_rmse']:.2f} %)"
                         for f, e in rec["fit_errors"].items())
        log(f"{mode}: {rec['fit_points']} points fitted; relative RMS error {errs}; chosen {rec['cost_model']['form']}")
    return cal


if __name__ == "__main__":
    import hydra
    from omegaconf import OmegaConf

    from training.config import load_config

    @hydra.main(config_path="../conf", config_name="train", version_base=None)
    def _main(dcfg) -> None:
        raw = OmegaConf.to_container(dcfg, resolve=True)
        raw.pop("hydra", None)
        opts = raw.pop("calibrate", None) or {}
        command = "python " + " ".join(sys.argv[:1] + [a for a in sys.argv[1:] if not a.startswith("hydra")])
        if opts.get("refit"):
            refit_file(opts["refit"], opts.get("fit_min_tokens"), command, opts.get("out"))
            return
        calibrate_config(load_config(raw), opts, command=command)

    sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=disabled"]
    _main()

"""AdaptiveLoad training entry point (Hydra): cfg → typed config → build → resume → loop.

    python train.py                              the embedded default: tiny Wan 2.1, synthetic corpus, CPU
    python train.py conf=wan21_8gpu              a preset (conf/conf/*.yaml); starts its own processes
    python train.py train.steps=20 resume=auto   any key from the command line
    python train.py +show_buckets=true           print the bucket table (S and B per bucket) and exit
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import signal
import sys
import time

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from data.buckets import bucket_table
from data.loader import Loader, corpus_changed, merge_bad_states, open_corpus
from models.build import build_parallel_model
from models.flow_matching import FlowMatching
from models.layers import cudnn_allowed, describe_attention
from models.lora import has_lora, save_lora
from models.parallelize import FSDPOptions, checkpoint_policy
from scheduling.planner import advance, plan_step
from scheduling.policy import ModelShape, schedule_for
from training.busy import StepProfiler
from training.checkpoint import CheckpointError, LoopState, load_checkpoint, save_checkpoint
from training.cli import user_errors
from training.config import TrainConfig, config_warnings, load_config, unknown_override_keys
from training.cuda_graphs import graph_blockers, graphs_for, graphs_for_plan
from training.dist import (check_devices, cpu_threads, fsdp_options_from_env, init_distributed, launcher,
                           maybe_launch, shutdown)
from training.host_memory import check_host_memory
from training.inputs import model_inputs
from training.metrics import MetricsLogger, StepMetrics, busy_every
from training.optim import EMA, build_optimizer
from training.resume import (apply_optim_config, check_config, keep_run_values, nothing_to_do,
                             optim_hyperparameters, plan_changed, plan_record, resume, saved_run_config)
from training.run_folder import RunFolder, multirun_job, write_whole
from training.sampling import ValidationSampler, log_encoders
from training.shape_benchmark import calibration_for_run, check_named_calibration
from training.step import TrainParts, autocast_for, collector_every, train_step, validation_loss

log = logging.getLogger("train")
WARMUP_STEPS = 3  # steps left out of throughput (compilation, allocator warm-up)


@dataclasses.dataclass
class StopRequest:
    """SIGTERM/SIGINT received: the loop finishes its step, checkpoints (every rank agrees) and exits."""
    received: int | None = None

    def handler(self, signum, _frame) -> None:
        self.received = signum


def run(cfg: TrainConfig, config_yaml: str, preset: str = "default", kept_values=()) -> dict:
    """Train as configured; returns the last logged metrics (for tests and scripts). preset: the conf=NAME chosen
    (a wandb tag); kept_values: [(key, the config's value, the run's)] that a resume keeps (training/resume.py
    keep_run_values), logged once the run folder holds the log."""
    # 1. process group and run folder: locked for this run's life before anything is written, refused when another
    # run holds it or (a fresh run) holds another run's files (training/run_folder.py)
    check_devices(cfg.launch.num_processes, cfg.launch.device, cfg.launch.debug_share_gpu)
    ctx = init_distributed(cfg.launch.debug_share_gpu)
    if ctx.device.type == "cpu":  # a GPU preset forced onto CPUs: its estimated memory first, refused above RAM
        check_host_memory(cfg, ctx.world_size, ctx.is_main)
    folder = RunFolder(cfg.run_dir, cfg.resume, cfg.overwrite, ctx)
    try:
        with collector_every(cfg.train.gc_every) as gc_tick:  # Python's collector between steps, not inside them
            return _run(cfg, ctx, config_yaml, gc_tick, preset, kept_values)
    finally:
        folder.close()


def _run(cfg: TrainConfig, ctx, config_yaml: str, gc_tick, preset: str, kept_values=()) -> dict:
    threads = cpu_threads(cfg.launch.cpu_threads) if ctx.device.type == "cpu" else None
    if ctx.is_main:
        backend = torch.distributed.get_backend() if ctx.distributed else "none"
        log.info("%d process(es) (started by %s), device %s, backend %s%s", ctx.world_size, launcher(), ctx.device,
                 backend, f", {threads} CPU thread(s) each (launch.cpu_threads)" if threads else "")
        if launcher() == "accelerate launch" and ctx.world_size == 1 and ctx.device.type == "cpu":
            log.warning("accelerate launch started one process: on CPUs it starts one whatever --num_processes "
                        "says; use torchrun --nproc_per_node N (or launch.num_processes=N) for several")
        for warning in config_warnings(cfg):
            log.warning("%s", warning)
        for key, default, was in kept_values:
            log.info("resume: %s %r kept, the run's value (this command line does not set it; the config alone "
                     "gives %r)", key, was, default)
    torch.manual_seed(cfg.train.seed)

    # 2. the corpus, first: what it can check without the model (patterns, index, empty prompt) fails before the build
    buckets = bucket_table(cfg.data.buckets, patch=cfg.model.patch)
    corpus = open_corpus(cfg.data, buckets, cfg.model.in_channels, cfg.model.text_dim, cfg.train.seed,
                         ctx.is_main, ctx.barrier, pooled_dim=cfg.model.pooled_dim)

    # 3. the calibration: scheduling.calibration=auto finds one for this model and device, or measures it now
    calibration, found = cfg.scheduling.calibration, "config"
    if calibration == "auto":
        calibration, found = calibration_for_run(cfg, ctx, log.info)
        torch.manual_seed(cfg.train.seed)  # the model starts alike whether the benchmark ran or not
    elif ctx.is_main and (why := check_named_calibration(cfg, ctx)):
        log.warning("%s", why)
    scfg = dataclasses.replace(cfg, scheduling=dataclasses.replace(cfg.scheduling, calibration=calibration))

    # 4. the model, sharded with FSDP2 over several processes (models/parallelize.py)
    model = build_parallel_model(cfg.model, ctx.rank, ctx.world_size, ctx.device, FSDPOptions(**fsdp_options_from_env()))
    if ctx.is_main:
        log.info(describe_attention(cfg.model.attention_backend, ctx.device, cudnn=cudnn_allowed(cfg.model.name)))

    # 5. the schedule: batch size per bucket, cost model, M (scheduling.tokens_per_step), recompute per micro-batch;
    # micro-batches replayed as CUDA graphs keep a pool that larger ones' memory budget leaves room for
    graphs = graphs_for(cfg.train.cuda_graphs, ctx.device, ctx.world_size, graph_blockers(cfg.model),
                        cfg.train.graph_max_tokens)
    shape = ModelShape.of(cfg.model, model.num_matmul_params())
    shares = dict(zip(corpus.bucket_names, np.bincount(corpus.table.bucket, minlength=len(corpus.bucket_names))))
    schedule = schedule_for(scfg, {n: b.tokens for n, b in buckets.items()}, shape, ctx.world_size, shares,
                            graph_tokens=graphs.max_tokens if graphs is not None else 0)
    graphs = graphs_for_plan(graphs, schedule.graph_tokens, ctx.is_main)  # captures what the plan reserved for
    micro_batches = schedule.micro_batches or cfg.train.micro_batches
    batch_sizes = [schedule.batch_sizes[n] for n in corpus.bucket_names]
    planned = plan_record(dict(zip(corpus.bucket_names, batch_sizes)), calibration, ctx.world_size)  # in meta.json

    # 6. optimizer, LR schedule, EMA, objective, precision: the parts every step uses
    optimizer, scheduler = build_optimizer(model, cfg.optim, cfg.train.steps)
    parts = TrainParts(
        model, FlowMatching(cfg.objective), optimizer, scheduler, ctx, cfg.train.seed, cfg.optim.grad_clip,
        ema=EMA(model, cfg.optim.ema_decay) if cfg.optim.ema_decay else None,
        checkpoint_policy=checkpoint_policy(cfg.model.checkpointing, schedule.recompute_blocks,
                                            cfg.model.keep_attention, len(model.blocks)),
        # no weight-cast cache under CUDA graphs (captures forbid it) nor FSDP (it would hold a bf16 copy of every
        # gathered weight until the forward ends); the numbers are the same either way
        autocast=autocast_for(ctx.device, cfg.model.precision, cache=graphs is None and ctx.world_size == 1),
        model_inputs=functools.partial(model_inputs, cfg.model), graphs=graphs)

    # 7. resume: the newest good checkpoint (resume=auto) with this run's hyper-parameters (training/resume.py)
    state = LoopState()
    adapter_only = has_lora(model) and cfg.model.pretrained is not None  # the base is re-read from pretrained
    fresh_hparams = optim_hyperparameters(optimizer)

    def load(path: str) -> dict:
        check_config(path, cfg, cfg.resume_force, ctx.is_main)
        meta = load_checkpoint(path, model, optimizer, parts.ema, ctx, trainable_only=adapter_only,
                               force=cfg.resume_force)
        try:
            scheduler.load_state_dict(meta["lr_scheduler"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{path}/meta.json: lr_scheduler does not load ({type(e).__name__}: {e})") from None
        apply_optim_config(optimizer, scheduler, fresh_hparams)  # this run's lr, betas, ... at the restored step
        # another index or another batch table: refused here (before an explicit resume moves newer checkpoints
        # aside as abandoned), or forced from a new epoch
        meta["new_epoch"] = (corpus_changed(corpus, meta.get("data", {}), cfg.resume_force)
                             | plan_changed(meta.get("plan"), planned, cfg.resume_force))
        return meta

    ckpt, meta = resume(cfg.resume, cfg.run_dir, ctx, load)
    lineage = (meta or {}).get("lineage") or {}  # the rollback point keep_last keeps (training/resume.py)
    if ckpt:
        state = LoopState.from_meta(meta)
        bad = meta.get("data", {})  # placeholders were summed over ranks: one rank carries the sum on
        if meta.pop("new_epoch"):  # another index or batch table, forced (load)
            state.epoch, state.pos = state.epoch + 1, 0
        corpus.restore_bad(bad if ctx.is_main else {"bad": bad.get("bad", [])})
        if state.step >= cfg.train.steps:  # nothing to train: said, and nothing written
            if ctx.is_main:
                log.warning(nothing_to_do(ckpt, state.step, cfg.train.steps))
            shutdown()
            return {}

    def checkpoint(diverged: bool = False) -> str:
        bad = merge_bad_states(ctx.gather_objects(corpus.bad_state()))  # every rank's, so a resume knows them all
        meta = state.meta() | {"lr_scheduler": scheduler.state_dict(), "data": bad, "lineage": lineage, "plan": planned}
        earlier = diverged and os.path.lexists(os.path.join(cfg.run_dir, f"diverged_step_{state.step}"))
        path = save_checkpoint(cfg.run_dir, state.step, model, optimizer, parts.ema, meta, config_yaml, ctx,
                               cfg.checkpoint.keep_last, trainable_only=adapter_only, diverged=diverged)
        if has_lora(model) and not earlier:  # step_N/lora/: what WanPipeline.load_lora_weights reads (every rank
            # gathers); a diverged_step_N written before is kept as it was
            save_lora(model, os.path.join(path, "lora"), ctx.is_main)
        return path

    # 8. logging, data, validation, signals
    if ctx.is_main:  # after resume: a refused resume leaves the run's config as it was
        write_whole(cfg.run_dir, "config.yaml", config_yaml)
    tags = (f"preset:{preset}", f"strategy:{schedule.strategy}", f"model:{cfg.model.name}-{cfg.model.dim}x"
            f"{cfg.model.attention_layers}", f"world:{ctx.world_size}")
    logger = MetricsLogger(cfg.run_dir, cfg.logging, cfg.name, OmegaConf.to_container(OmegaConf.create(config_yaml)),
                           enabled=ctx.is_main, tags=tags)
    if ctx.is_main:
        log.info("scheduling: strategy %s, planner %s%s, calibration %s (%s), %d micro-batch(es) a step; values %s, "
                 "from %s", schedule.strategy, schedule.planner,
                 f" (window {schedule.window})" if schedule.planner == "windowed" else "", calibration or "none",
                 found, micro_batches, schedule.values, schedule.sources)
        log.info("%s from %s, writing %s (train.log, metrics.jsonl, checkpoints)\n%s",
                 f"resumed at step {state.step}" if ckpt else "starting", ckpt or "scratch", cfg.run_dir,
                 schedule.table({n: buckets[n].tokens for n in corpus.bucket_names}))
        for note in schedule.notes:
            log.warning("scheduling: %s", note)
        log_encoders(cfg, corpus, model.num_matmul_params(), log)  # which VAE and text encoder; random ones warn
    loader = Loader(corpus, cfg.model.text_len, cfg.data.caption_dropout, cfg.train.seed, ctx.rank,
                    cfg.data.num_workers)
    val_batches = loader.val_batches()
    sampler = ValidationSampler(cfg, ctx, val_batches, corpus.empty_text) if cfg.train.sample_every else None
    metrics = StepMetrics(ctx, shape, cfg.metrics.peak_tflops, WARMUP_STEPS,
                          sample_flops=lambda S: model.train_flops(S, cfg.model.text_len))
    profiler = StepProfiler(busy_every(cfg.metrics, ctx.world_size), cfg.metrics.profile_steps,
                            os.path.join(cfg.run_dir, "traces"), ctx.rank)
    stop = StopRequest()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop.handler)

    def plan_at(epoch: int, pos: int):
        return plan_step(corpus.table, cfg.train.seed, epoch, pos, ctx.world_size, schedule.strategy,
                         micro_batches, batch_sizes, schedule.cost_fn, window=schedule.window, planner=schedule.planner,
                         m_mem=schedule.m_mem)

    # 9. the loop
    bar = None
    if ctx.is_main and cfg.train.progress:
        from tqdm import tqdm
        bar = tqdm(total=cfg.train.steps, initial=state.step, desc=cfg.name, dynamic_ncols=True)
    last: dict = {}
    due = False  # a checkpoint fell due and waits for the end of a streak of bad steps
    model.train()
    if state.step == 0:  # the starting point of the val/loss curve, and each bucket's batch size and tokens
        table = {f"schedule/{k}/{n}": v for n in corpus.bucket_names
                 for k, v in (("B", schedule.batch_sizes[n]), ("tokens", schedule.batch_sizes[n] * buckets[n].tokens))}
        val = validation_loss(parts, val_batches)  # None: no readable held-out sample (Loader.val_batches warns)
        logger.log_metrics(0, {"samples_seen": 0, "tokens_seen": 0, **({"val/loss": val} if val is not None else {}),
                               **table})
        if sampler is not None:  # the start of the samples' contact sheet
            logger.log_videos(0, sampler(model, 0, parts.autocast))
    while state.step < cfg.train.steps:
        t_step = time.perf_counter()
        epoch = state.epoch
        plan, next_pos = plan_at(epoch, state.pos)
        nxt_epoch, nxt_pos = advance(epoch, next_pos, corpus.table)
        if cfg.data.num_workers and state.step + 1 < cfg.train.steps:
            loader.prefetch(plan_at(nxt_epoch, nxt_pos)[0])  # workers decode the next step while this one runs
        lr = scheduler.get_last_lr()[0]  # the rate this step's update uses
        with profiler.context(state.step + 1):
            st = train_step(parts, loader.step(plan), plan.loss_norm, epoch)
        step_s = time.perf_counter() - t_step
        state.step, state.epoch, state.pos = state.step + 1, nxt_epoch, nxt_pos
        state.samples_seen += plan.num_samples
        state.tokens_seen += plan.tokens
        state.bad_in_a_row = state.bad_in_a_row + 1 if st.skipped else 0
        state.skipped_steps += int(st.skipped)
        gc_tick(state.step)

        m = {"samples_seen": state.samples_seen, "tokens_seen": state.tokens_seen, "epoch": epoch, "train/lr": lr,
             "train/skipped_steps": state.skipped_steps,
             **metrics.row(state.step, plan, st, step_s, profiler.finish(state.step, plan.num_slots))}
        m.update({f"data/skipped_{r}": n for r, n in corpus.skipped.items()})
        if graphs is not None:
            m.update({"memory/graph_pool_gib": graphs.pool_bytes / 2**30, "perf/graph_replays": graphs.stats.replays})
        if state.step % cfg.train.val_every == 0 or state.step == cfg.train.steps:
            if (val := validation_loss(parts, val_batches)) is not None:
                m["val/loss"] = val
        if state.step % cfg.train.log_every == 0 or "val/loss" in m:
            logger.log_metrics(state.step, m)
        if sampler is not None and (state.step % cfg.train.sample_every == 0 or state.step == cfg.train.steps):
            logger.log_videos(state.step, sampler(model, state.step, parts.autocast))
        last = m
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{m['train/loss']:.4f}", **({"val": f"{m['val/loss']:.4f}"} if "val/loss" in m else {}))

        if state.bad_in_a_row >= cfg.train.max_bad_steps:
            kept = checkpoint(diverged=True)  # for inspection: never resumed by auto, never evicts a good one
            raise RuntimeError(
                f"{state.bad_in_a_row} steps in a row had a NaN/Inf loss or gradient (train.max_bad_steps="
                f"{cfg.train.max_bad_steps}); the diverged state is in {kept}. `resume=auto` restarts from the last "
                f"good checkpoint; add a lower rate to continue past this point, e.g. optim.lr={cfg.optim.lr / 2:g}")
        # while a streak of bad steps is open the weights may be diverging: no regular checkpoint holds them (a
        # due one waits for a good step; a signal stops without one, resume=auto takes the last good)
        streak = state.bad_in_a_row > 0
        if ctx.all_reduce_max(float(stop.received is not None)):
            if streak:
                log.warning("signal received during %d bad step(s) in a row: stopping without a checkpoint at step "
                            "%d; resume=auto restarts from the last good one", state.bad_in_a_row, state.step)
            else:
                log.warning("signal received: checkpointing at step %d and stopping", state.step)
                last["checkpoint"] = checkpoint()
            break
        due = due or bool(cfg.checkpoint.every and state.step % cfg.checkpoint.every == 0)
        if due and not streak:
            checkpoint()
            due = False
    else:
        if cfg.checkpoint.at_end and not os.path.exists(os.path.join(cfg.run_dir, f"step_{state.step}")):
            if state.bad_in_a_row:
                log.warning("the run ends inside %d bad step(s) in a row: no checkpoint at step %d",
                            state.bad_in_a_row, state.step)
            else:
                checkpoint()

    # 10. close
    if bar is not None:
        bar.close()
    loader.close()
    logger.close()
    profiler.settle()
    shutdown()
    return last


@hydra.main(config_path="conf", config_name="train", version_base=None)
def main(dcfg: DictConfig) -> None:
    """A mistake the user can fix (a bad value, a folder that holds another run, a missing file) prints its message
    alone and exits with status 2; HYDRA_FULL_ERROR=1 shows the whole trace."""
    with user_errors():  # training/cli.py: the message alone and exit status 2
        _main(dcfg)


def swept_values(task: list[str], argv: list[str]) -> list[tuple[str, str]]:
    """(key, value) of this multirun job's task overrides whose key the command line sweeps (a,b / range / choice),
    in the job's order; [] where the command line does not parse (the job number then names the job)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        given = OverridesParser.create().parse_overrides([a for a in argv if "=" in a and not a.startswith("-")])
    except Exception:  # noqa: BLE001 — a launcher that rewrote argv: the label falls back to the job number
        return []
    swept = {o.key_or_group for o in given if o.is_sweep_override()}
    return [(k.lstrip("+~"), v) for k, _, v in (t.partition("=") for t in task) if k.lstrip("+~") in swept]


def _main(dcfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    raw = OmegaConf.to_container(dcfg, resolve=True)
    raw.pop("hydra", None)
    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:  # -m: each job its own run folder and wandb run, one wandb group
        raw = multirun_job(raw, hc.job.num, swept_values(hc.overrides.task, sys.argv[1:]))
    if any(o.split("=", 1)[0].lstrip("+~") in ("logging", "logging.wandb") for o in hc.overrides.task):
        os.environ["WANDB_MODE"] = raw["logging"]["wandb"]  # the command line beats the environment
    kept = []  # resuming: the run's values where the command line names none, not the defaults (said in run())
    if raw.get("resume") and (saved := saved_run_config(raw["resume"], raw["run_dir"])) is not None:
        kept = keep_run_values(raw, saved, {o.split("=", 1)[0].lstrip("+~") for o in hc.overrides.task})
    cfg = load_config(raw)  # every bad value is refused here, before any compute
    if cfg.show_buckets:
        from training.bucket_report import print_buckets

        print_buckets(cfg)
        return
    maybe_launch(cfg.launch.num_processes, cfg.launch.device, cfg.launch.debug_share_gpu)
    run(cfg, OmegaConf.to_yaml(OmegaConf.create(raw)), preset=hc.runtime.choices.get("conf") or "default",
        kept_values=kept)


def check_command_line(argv: list[str]) -> None:
    """Typos in a key (`train.step=20`) stop here with the nearest known key and status 2, before Hydra, whose own
    message suggests appending the key with `+`, which the config then refuses."""
    conf = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf")
    wrong = unknown_override_keys(argv, {d for d in os.listdir(conf) if os.path.isdir(os.path.join(conf, d))})
    if wrong:
        print("train.py: error: unknown config key(s): " + "; ".join(wrong), file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    check_command_line(sys.argv[1:])
    main()

"""Replaying the planner's plans for R ranks on one device: every planned micro-batch run for real through the
trainer's step, balance measured (the command line, its options and its output files: scripts/replay_plans.py).

This module holds the settings' resolution (a strategy's knob → batch sizes, as training resolves them), the
synthetic host inputs, the runner (one model, its optimizer, EMA and the trainer's step) and the report; the
arithmetic of a replay (execution order, step times, summaries) is scheduling/replay.py's.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import time
from typing import Optional, Union

import numpy as np

from training.config import compose_config

KNOBS = ("m_tokens", "m_mem", "mem_budget_gib", "m_comp", "p", "target_microbatch_ms")
ENTRY_KEYS = {"strategy", "label", "batch_sizes", "factor", "M", "window", "planner", *KNOBS}
INFO_KEYS = {"setting", "tokens_per_step", "note"}  # carried into the output, not read


@dataclasses.dataclass
class ReplayOptions:
    """scripts/replay_plans.py's options (its --help says what each does); None: the settings file's value, else the
    config's. `overrides`: Hydra overrides of the training config."""
    overrides: list = dataclasses.field(default_factory=list)
    out: str = os.path.join("runs", "replay")
    name: str = "replay"
    settings: Optional[str] = None
    strategies: Optional[str] = None
    ranks: Optional[int] = None
    steps: int = 12
    warmup: int = 2
    micro_batches: Optional[int] = None
    batch_sizes: Optional[str] = None
    m_tokens: Optional[float] = None
    m_mem: Optional[float] = None
    mem_budget_gib: Optional[float] = None
    m_comp: Optional[float] = None
    p: Optional[float] = None
    target_ms: Optional[float] = None
    factor: Optional[float] = None
    window: Optional[int] = None
    planner: Optional[str] = None
    calibration: Optional[str] = None
    truth: Optional[Union[str, list]] = None  # one calibration file or several (their points merged)
    mix: Optional[str] = None
    samples: Optional[int] = None
    seed: Optional[int] = None
    blocks: Optional[int] = None
    cuda_graphs: str = "off"
    peak_tflops: Optional[float] = None
    dry_run: bool = False

    def __post_init__(self):
        if self.steps < 1 or self.warmup < 0 or (self.ranks is not None and self.ranks < 1):
            raise ValueError(f"--ranks and --steps must be ≥ 1, --warmup ≥ 0 (got {self.ranks}, {self.steps}, "
                             f"{self.warmup})")
        if self.cuda_graphs not in ("off", "auto"):
            raise ValueError(f"--cuda-graphs must be off or auto, got {self.cuda_graphs!r}")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise ValueError(f"--micro-batches must be ≥ 1, got {self.micro_batches}")


# ------------------------------------------------------------------------------------------------ the settings
def parse_mix(text: Optional[str], cfg, buckets):
    from scheduling.simulate import DEFAULT_MIX, Mix

    if text:
        rows = []
        for item in text.split(","):
            name, sep, share = item.strip().partition(":")
            if not sep or name not in buckets:
                raise ValueError(f"--mix {item!r}: expected name:share with a bucket of data.buckets ({list(buckets)})")
            rows.append((name, buckets[name].tokens, float(share)))
    else:
        rows = [(n, buckets[n].tokens, s) for n, _, s in DEFAULT_MIX if n in buckets]
        if not rows:
            rows = [(n, buckets[n].tokens, float(s)) for n, s in (cfg.data.synthetic.mix or {}).items()
                    if n in buckets]
    rows = [r for r in rows if r[2] > 0]
    if not rows:
        raise ValueError("the mix holds no bucket of data.buckets: give --mix name:share,...")
    return Mix.of(rows)


def parse_sizes(value, names) -> list[int]:
    if isinstance(value, str):
        value = {k.strip(): int(v) for k, _, v in (i.partition("=") for i in value.split(","))}
    if isinstance(value, dict):
        missing = [n for n in names if n not in value]
        if missing:
            raise ValueError(f"batch_sizes lacks buckets {missing} of the mix")
        value = [value[n] for n in names]
    sizes = [int(b) for b in value]
    if len(sizes) != len(names) or min(sizes) < 1:
        raise ValueError(f"batch_sizes must give every bucket of the mix {list(names)} a B ≥ 1, got {value}")
    return sizes


def load_settings(args: ReplayOptions, cfg) -> tuple[list[dict], dict]:
    """(entries, file-level defaults) from --settings or the command line."""
    defaults: dict = {}
    if args.settings:
        with open(args.settings) as f:
            data = json.load(f)
        if isinstance(data, dict):
            defaults = {k: v for k, v in data.items() if k != "settings"}
            data = data.get("settings")
        if not isinstance(data, list) or not data:
            raise ValueError(f"--settings {args.settings}: expected a non-empty list of entries")
        entries = []
        for i, e in enumerate(data):
            if not isinstance(e, dict) or "strategy" not in e or set(e) - ENTRY_KEYS - INFO_KEYS:
                raise ValueError(f"--settings entry {i} must be an object with a strategy and only the keys "
                                 f"{sorted(ENTRY_KEYS | INFO_KEYS)}, got {e}")
            entries.append(dict(e))
        if args.strategies:
            want = [s.strip() for s in args.strategies.split(",")]
            entries = [e for e in entries if e.get("label", e["strategy"]) in want or e["strategy"] in want]
            if not entries:
                raise ValueError(f"--strategies {args.strategies} matches no entry of {args.settings}")
    else:
        names = [s.strip() for s in (args.strategies or cfg.scheduling.strategy).split(",")]
        entries = [{"strategy": s} for s in names]
    cli = {"m_tokens": args.m_tokens, "m_mem": args.m_mem, "mem_budget_gib": args.mem_budget_gib,
           "m_comp": args.m_comp, "p": args.p, "target_microbatch_ms": args.target_ms, "factor": args.factor,
           "window": args.window, "planner": args.planner, "batch_sizes": args.batch_sizes}
    for e in entries:
        for k, v in cli.items():
            if v is not None and e.get(k) is None:
                e[k] = v
        e.setdefault("label", e["strategy"])
    labels = [e["label"] for e in entries]
    if len(set(labels)) != len(labels):
        raise ValueError(f"settings labels must differ, got {labels}")
    return entries, defaults


def truth_sources(paths: list, checkpointing: str, k: int, layers: int, model_dim: int) -> dict:
    """The simulator's truth from calibration files (--truth, one or several; their measured points merged as
    simulate_cluster.py --truth-points merges them): "full" (their points at the whole model's depth, as the
    simulator reads them: Calibration.measured_points) and, where a file timed the replay's own depth k < layers
    (a slice's main or second depth), "as_run" — those files' points at k blocks, unscaled, so that a slice's replay
    is checked against measurement at the same depth without any extrapolation. Each: (truth, optimizer ms), the
    optimizer's from the first file that has it. The simulator's truth is its --calibration's points plus its
    --truth-points files': name the same files here, the calibration first (its optimizer step), to price the same."""
    from scheduling.calibrate import Calibration
    from scheduling.truth import MeasuredTruth

    full, run, optim_full, optim_run = [], [], None, None
    for path in dict.fromkeys(paths):  # a file named twice counts once
        cal = Calibration.load(path)
        cal.check_model(model_dim, layers, "--truth")
        mode = cal.mode_name(checkpointing)
        full += cal.measured_points(mode)
        optim_full = cal.optim_ms(mode) if optim_full is None else optim_full
        if k < layers:
            rec = cal.data["modes"][mode]
            ext = cal.data.get("extrapolation") or {}
            sl = rec.get("slice_memory") or {}
            depth_points = {int(d): pts for d, pts in (sl.get("points") or {}).items()}
            main = int(ext.get("blocks_timed") or layers)
            depth_points[main] = rec["points"]
            optim = {int(d): (v or {}).get("optim_ms") for d, v in (sl.get("plain_step") or {}).items()}
            optim.setdefault(main, cal.optim_ms(mode) * main / layers)
            if k in depth_points and any(p.get("feasible", True) and p.get("ms") for p in depth_points[k]):
                run += depth_points[k]
                optim_run = optim_run if optim_run is not None else optim.get(k)
    out = {"full": (MeasuredTruth.from_points(full), optim_full)}
    if run:
        out["as_run"] = (MeasuredTruth.from_points(run), float(optim_run or 0.0))
    return out


def resolve_entry(e: dict, cfg, tokens: dict, shape, R: int, calibration: Optional[str], proxy_tflops: float,
                  graph_tokens: int = 0):
    """(batch sizes in mix order, Schedule) of one settings entry, resolved as training resolves it for R ranks.
    graph_tokens: the capture limit where the replay runs CUDA graphs (graph_tokens_for), else 0; the schedule
    reserves their pool and narrows the limit to its own micro-batches as train.py's does (Schedule.graph_tokens).
    Given batch sizes keep the whole limit, whose pool reserve bounds any capture up to it."""
    from scheduling.config import SchedulingConfig
    from scheduling.planner import resolve_planner
    from scheduling.policy import resolve_schedule

    strategy = e["strategy"]
    knobs = {k: e.get(k) for k in KNOBS}
    if knobs["m_tokens"] is not None:
        knobs["m_tokens"] = int(knobs["m_tokens"])
    S_max = max(tokens.values())

    def resolve(strategy_, narrow_graphs=True, **kw):
        sc = SchedulingConfig(strategy=strategy_, window=int(e.get("window") or 1), calibration=calibration,
                              planner=e.get("planner"), **{**knobs, **kw})
        return resolve_schedule(sc, tokens, shape, proxy_tflops=proxy_tflops, checkpointing=cfg.model.checkpointing,
                                world_size=R, keep_attention=cfg.model.keep_attention, graph_tokens=graph_tokens,
                                narrow_graphs=narrow_graphs)

    if e.get("batch_sizes") is not None:  # the cost model and recompute rule only
        sched = resolve("equal_token", narrow_graphs=False, m_tokens=S_max)
        sched.strategy, sched.window = strategy, int(e.get("window") or 1)
        sched.planner = resolve_planner(strategy, sched.window, e.get("planner"))
        sizes = parse_sizes(e["batch_sizes"], list(tokens))
        sched.batch_sizes = dict(zip(tokens, sizes))
        sched.values = {"batch_sizes": "given", **{k: v for k, v in sched.values.items() if k != "m_tokens"}}
        return sizes, sched
    f, by_factor = e.get("factor"), None
    if f is not None:  # the simulator's sweep factor × its base (scheduling/simulate.py SWEEP)
        if strategy == "equal_token" and knobs["m_tokens"] is None:
            knobs["m_tokens"], by_factor = int(f * S_max), ("m_tokens", "S_max")
        elif strategy == "dual_constraint" and knobs["m_comp"] is None:
            p = knobs["p"] if knobs["p"] is not None else resolve(strategy).values["p"]
            knobs["p"], knobs["m_comp"], by_factor = p, f * S_max ** p, ("m_comp", "S_max^p")
        elif strategy in ("cost", "balanced") and knobs["target_microbatch_ms"] is None:
            knobs["target_microbatch_ms"] = f * float(resolve("equal_token", m_tokens=S_max).cost_fn(1, S_max))
            by_factor = ("target_microbatch_ms", "predicted ms of S_max at B = 1")
    sched = resolve(strategy)
    if by_factor:
        sched.sources[by_factor[0]] = f"factor {f:g} × {by_factor[1]}"
    return [int(sched.batch_sizes[n]) for n in tokens], sched


def graph_tokens_for(cfg, cuda_graphs: str, device_type: Optional[str] = None) -> int:
    """train.graph_max_tokens where the replay's one process captures CUDA graphs (--cuda-graphs auto on a CUDA
    device, nothing in the model's config forbidding them: training/cuda_graphs.py graphs_for), else 0."""
    import torch

    from training.cuda_graphs import graph_blockers, graphs_off_because

    device = torch.device(device_type or ("cuda" if torch.cuda.is_available() else "cpu"))
    off = graphs_off_because(cuda_graphs, device, 1, graph_blockers(cfg.model))
    return 0 if off else int(cfg.train.graph_max_tokens)


def expected_tokens_per_gpu(mix, sizes, R: int, M: int) -> float:
    """g: expected latent tokens per rank per step (a bucket's share of micro-batches ∝ share / B)."""
    from scheduling.simulate import samples_per_step

    return samples_per_step(mix, sizes, R, M) / R * mix.mean_tokens


# ------------------------------------------------------------------------------------------------ running
class SyntheticInputs:
    """Host inputs of each latent shape, made once and sliced to B (pinned on a GPU machine, so the trainer's
    pin_memory returns them as they are): random latents and text; every text token valid."""

    def __init__(self, model_cfg, pin: bool, seed: int = 0):
        import torch

        self.cfg, self.pin = model_cfg, pin
        self.gen = torch.Generator().manual_seed(seed)
        self.pools: dict = {}

    def _pool(self, key, B: int, make):
        t = self.pools.get(key)
        if t is None or t.shape[0] < B:
            t = make(max(B, 2 * t.shape[0] if t is not None else B))
            if self.pin:
                t = t.pin_memory()
            self.pools[key] = t
        return t[:B]

    def batch(self, mb, name: str, shape: tuple):
        import torch

        from data.batch import Batch

        B, L, C = mb.B, self.cfg.text_len, self.cfg.text_dim
        latents = self._pool(("latents", shape), B, lambda n: torch.randn(n, *shape, generator=self.gen))
        text = self._pool(("text", L, C), B, lambda n: torch.randn(n, L, C, generator=self.gen))
        mask = self._pool(("mask", L), B, lambda n: torch.ones(n, L, dtype=torch.bool))
        return Batch(latents=latents, text=text, keys=[str(i) for i in mb.ids], bucket=name, S=mb.S,
                     loss_weight=torch.tensor(mb.weights, dtype=torch.float32), text_mask=mask,
                     L_text=[L] * B)

    def clear(self) -> None:
        self.pools.clear()


class Runner:
    """One model, its optimizer and the trainer's step, on this process's device."""

    def __init__(self, cfg, blocks: int, cuda_graphs: str):
        import functools

        import torch

        from models.build import build_model
        from training.inputs import model_inputs
        from models.flow_matching import FlowMatching
        from models.parallelize import parallelize
        from training.cuda_graphs import graph_blockers, graphs_for
        from training.dist import init_distributed
        from training.optim import EMA, build_optimizer
        from training.step import autocast_for

        self.cfg, self.blocks = cfg, blocks
        self.ctx = init_distributed()
        torch.manual_seed(cfg.train.seed)
        t0 = time.perf_counter()
        self.model = parallelize(build_model(dataclasses.replace(cfg.model, num_layers=blocks), self.ctx.device),
                                 compile=cfg.model.compile)
        self.model.train()
        self.optimizer, self.scheduler = build_optimizer(self.model, cfg.optim, 10**6)
        self.ema = EMA(self.model, cfg.optim.ema_decay) if cfg.optim.ema_decay else None
        self.objective = FlowMatching(cfg.objective)
        self.graphs = graphs_for(cuda_graphs, self.ctx.device, 1, graph_blockers(cfg.model),
                                 cfg.train.graph_max_tokens)
        self.all_graphs = self.graphs  # every setting's captures, each setting running up to its own limit
        self.autocast = autocast_for(self.ctx.device, cfg.model.precision, cache=self.graphs is None)
        self.model_inputs = functools.partial(model_inputs, cfg.model)
        self.cuda = self.ctx.device.type == "cuda"
        self.inputs = SyntheticInputs(cfg.model, pin=self.cuda, seed=cfg.train.seed)
        self.build_s = time.perf_counter() - t0
        self.steps_done = 0

    def capture_up_to(self, limit: int) -> str:
        """Run the next setting's micro-batches of up to `limit` tokens as CUDA graphs (its Schedule.graph_tokens,
        which its memory budget reserved the pool for), none where 0, as train.py narrows its graphs to its plan.
        Returns what runs, for the log."""
        from training.step import autocast_for

        if self.all_graphs is None:
            return "eager"
        if limit != 0:
            self.all_graphs.max_tokens = limit  # None: no cap (train.graph_max_tokens=null)
        self.graphs = self.all_graphs if limit != 0 else None
        self.autocast = autocast_for(self.ctx.device, self.cfg.model.precision, cache=self.graphs is None)
        return ("eager: no planned micro-batch within train.graph_max_tokens" if limit == 0 else
                "CUDA graphs up to " + ("any number of" if limit is None else f"{limit:,}") + " tokens")

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.ctx.device)

    def step(self, batches, num_samples: int, policy, epoch: int):
        """(micro-batch ms in list order, wall ms of the step between two syncs, StepStats)."""
        from training.step import TrainParts, train_step

        self.sync()
        t0 = time.perf_counter()
        parts = TrainParts(self.model, self.objective, self.optimizer, self.scheduler, self.ctx, self.cfg.train.seed,
                           self.cfg.optim.grad_clip, self.ema, policy, self.autocast, self.model_inputs, self.graphs)
        st = train_step(parts, batches, num_samples, epoch)
        self.sync()
        wall_ms = (time.perf_counter() - t0) * 1e3
        if len(st.mb_s) != len(batches):
            raise RuntimeError(f"train_step timed {len(st.mb_s)} micro-batches of {len(batches)}")
        return [s * 1e3 for s in st.mb_s], wall_ms, st

    def reset_peak(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.ctx.device)

    def peak_gib(self) -> Optional[float]:
        if not self.cuda:
            return None
        import torch

        return float(torch.cuda.max_memory_allocated(self.ctx.device)) / 2**30


def run_setting(runner: Runner, plans, warmup: int, names, shapes, policy, scale: float, log, gc_tick) -> dict:
    """Every micro-batch of the plans run and timed; returns rows, per-step grids and optimizer times."""
    from scheduling.replay import execution_order, to_grid

    runner.reset_peak()
    seen = {}  # each distinct (bucket, B) once before any timed step: kernels compiled, allocator grown
    for plan in plans:
        for row in plan.ranks:
            for mb in row:
                seen.setdefault((mb.bucket, mb.B), mb)
    t0 = time.perf_counter()
    for mb in seen.values():
        for _ in range(2 if runner.graphs is not None else 1):  # graphs: the eager run, then the capture
            runner.step([runner.inputs.batch(mb, names[mb.bucket], shapes[mb.bucket])], max(1, mb.num_real), policy,
                        plans[0].epoch)
    log(f"  {len(seen)} distinct micro-batches run once ({time.perf_counter() - t0:.1f} s)")
    rows, grids, optim, walls, skipped = [], [], [], [], 0
    for i, plan in enumerate(plans):
        order = execution_order(plan)
        mbs = [plan.ranks[r][k] for r, k in order]
        batches = [runner.inputs.batch(mb, names[mb.bucket], shapes[mb.bucket]) for mb in mbs]
        ms, wall, st = runner.step(batches, plan.num_samples, policy, plan.epoch)
        runner.steps_done += 1
        gc_tick(runner.steps_done)  # Python's collector between steps, as train.py runs it
        skipped += int(st.skipped)
        grids.append(to_grid(plan, ms))
        optim.append(max(0.0, wall - sum(ms)))
        walls.append(wall)
        for (r, k), mb, t in zip(order, mbs, ms):
            rows.append({"step": i - warmup, "warmup": i < warmup, "rank": r, "slot": k, "bucket": names[mb.bucket],
                         "S": mb.S, "B": mb.B, "real": mb.num_real > 0, "pred_ms": mb.pred_ms, "measured_ms": t,
                         "scaled_ms": t * scale})
        log(f"  step {i - warmup:>3}{' (warm-up)' if i < warmup else ''}: {len(mbs)} micro-batches, "
            f"Σ {sum(ms) * scale / 1e3:.2f} s, slowest-rank step {grids[-1].max(axis=0).sum() * scale / 1e3:.2f} s "
            f"(predicted {plan.pred_ms().max(axis=0).sum() / 1e3:.2f} s), wall {wall / 1e3:.2f} s")
    return {"rows": rows, "grids": grids, "optim_ms": optim, "wall_ms": walls, "skipped_steps": skipped,
            "peak_gib": runner.peak_gib()}


# ------------------------------------------------------------------------------------------------ reporting
def pct(v) -> str:
    return "—" if v is None else f"{100 * v:.1f} %"


def table(results: list[dict]) -> str:
    head = ("| setting | B per bucket | M | g tokens/GPU/step | tokens/s measured | predicted | Δ | samples/s | "
            "busy CV measured | predicted | idle measured | predicted | step-time CV | optim ms | peak GiB |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['label']} | {' '.join(map(str, r['batch_sizes']))} | {r['M']} | "
                         f"{r['g_expected']:,.0f} | failed: {r['error'][:80]} |" + " |" * 10)
            continue
        m, p = r["measured"], r["predicted"]
        peak = "—" if r.get("peak_gib") is None else f"{r['peak_gib']:.1f}"
        lines.append(f"| {r['label']} | {' '.join(map(str, r['batch_sizes']))} | {r['M']} | "
                     f"{r['g_expected']:,.0f} | {m['tokens_per_s']:,.0f} | {p['tokens_per_s']:,.0f} | "
                     f"{100 * (m['tokens_per_s'] / p['tokens_per_s'] - 1):+.1f} % | {m['samples_per_s']:.2f} | "
                     f"{pct(m['compute_cv'])} | {pct(p['compute_cv'])} | {pct(m['idle_fraction'])} | "
                     f"{pct(p['idle_fraction'])} | {pct(m['step_time_cv'])} | {m['optim_ms']:.0f} | {peak} |")
    return "\n".join(lines)


def truth_table(results: list[dict]) -> list[str]:
    """With --truth: each setting's measured tokens/s beside the simulator's truth of the same plans — at the depth
    that ran (as_run: no extrapolation on either side) and at the full depth — and every setting ÷ the first, the
    ratio a comparison claims, measured and by the truth."""
    ok = [r for r in results if "measured" in r and r.get("truth")]
    if not ok:
        return []
    lines = ["| setting | tokens/s measured (as run) | truth (as run) | Δ | measured ×L/k | truth (full depth) | Δ |",
             "|---|---|---|---|---|---|---|"]
    for r in ok:
        m, ma, tr = r["measured"]["tokens_per_s"], r["measured_as_run"]["tokens_per_s"], r["truth"]
        ta, tf = (tr.get("as_run") or {}).get("tokens_per_s"), tr["full"]["tokens_per_s"]
        lines.append(f"| {r['label']} | {ma:,.0f} | " + (f"{ta:,.0f} | {100 * (ma / ta - 1):+.1f} %" if ta else "— | —")
                     + f" | {m:,.0f} | {tf:,.0f} | {100 * (m / tf - 1):+.1f} % |")
    base = ok[0]
    for r in ok[1:]:
        as_run = r["measured_as_run"]["tokens_per_s"] / base["measured_as_run"]["tokens_per_s"]
        parts = [f"measured (as run) {as_run:.3f}"]
        for depth in ("as_run", "full"):
            a, b = (r["truth"].get(depth) or {}), (base["truth"].get(depth) or {})
            if a and b:
                parts.append(f"truth ({depth}) {a['tokens_per_s'] / b['tokens_per_s']:.3f}")
        parts.append(f"predicted {r['predicted']['tokens_per_s'] / base['predicted']['tokens_per_s']:.3f}")
        lines.append(f"- {r['label']} ÷ {base['label']}: " + ", ".join(parts))
    return ["", "The simulator's truth of the same plans (--truth; measured ×L/k counts the part outside the blocks "
            "L/k times, the truth at the full depth once where its file timed two depths):", ""] + lines


def comparisons(results: list[dict]) -> list[dict]:
    """balanced ÷ dual_constraint (and each cost-aware setting ÷ equal_token), measured and predicted."""
    ok = [r for r in results if "measured" in r]
    out = []
    for num, den in (("balanced", "dual_constraint"), ("balanced", "equal_token"), ("dual_constraint", "equal_token"),
                     ("cost", "dual_constraint")):
        a = next((r for r in ok if r["strategy"] == num), None)
        b = next((r for r in ok if r["strategy"] == den), None)
        if a is None or b is None:
            continue
        meas = a["measured"]["tokens_per_s"] / b["measured"]["tokens_per_s"]
        pred = a["predicted"]["tokens_per_s"] / b["predicted"]["tokens_per_s"]
        out.append({"ratio": f"{a['label']} ÷ {b['label']}", "measured": meas, "predicted": pred,
                    "points": 100 * (meas - pred)})
    return out


def points(results: list[dict]) -> list[dict]:
    """Every (bucket, S, B) the timed steps ran, with its times scaled to the full depth, in a calibration's point
    form ({S, B, ms_runs}: what scheduling/truth.py MeasuredTruth.from_points reads)."""
    runs: dict = {}
    for r in results:
        for row in r.get("rows", ()):
            if not row["warmup"]:
                runs.setdefault((row["bucket"], row["S"], row["B"]), []).append(row["scaled_ms"])
    return [{"bucket": b, "S": S, "B": B, "ms": float(np.median(ts)), "ms_runs": ts}
            for (b, S, B), ts in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][2]))]


def replay(args: ReplayOptions, command: str) -> dict:
    """The replay as scripts/replay_plans.py describes it; `args` holds its options, `command` the command line
    recorded in the outputs. Returns {"meta", "settings", "comparisons", "points"}."""
    log = lambda s: print(s, flush=True)  # noqa: E731

    from data.buckets import bucket_table
    from models.build import build_model
    from models.parallelize import checkpoint_policy
    from scheduling.calibrate import Calibration
    from scheduling.efficiency import model_flops
    from scheduling.policy import ModelShape
    from scheduling.replay import evaluate, plan_steps, step_times, summarize
    from scheduling.simulate import samples_per_step

    cfg = compose_config(args.overrides)
    buckets = bucket_table(cfg.data.buckets, patch=cfg.model.patch)
    entries, defaults = load_settings(args, cfg)
    mix_text = args.mix
    if mix_text is None and defaults.get("mix"):
        rows = defaults["mix"]
        rows = rows.items() if isinstance(rows, dict) else [(r["bucket"], r["share"]) for r in rows]
        mix_text = ",".join(f"{k}:{v}" for k, v in rows)
    mix = parse_mix(mix_text, cfg, buckets)
    names, tokens = list(mix.names), {n: int(s) for n, s in zip(mix.names, mix.S)}
    shapes = [buckets[n].latent_shape(cfg.model.in_channels) for n in names]
    R = int(args.ranks or defaults.get("ranks") or 8)
    M_default = int(args.micro_batches or defaults.get("micro_batches") or cfg.train.micro_batches)
    if cfg.scheduling.tokens_per_step is not None and not (args.micro_batches or defaults.get("micro_batches")):
        log(f"note: scheduling.tokens_per_step={cfg.scheduling.tokens_per_step:g} is not replayed: M = {M_default} "
            "(train.micro_batches) unless an entry gives M; give --micro-batches and the knob (or a settings file) "
            "for the batch a run holds")
    calibration = args.calibration or defaults.get("calibration") or cfg.scheduling.calibration
    seed = cfg.train.seed if args.seed is None else args.seed
    layers = cfg.model.num_layers
    k = int(args.blocks or layers)
    if not 1 <= k <= layers:
        raise ValueError(f"--blocks must lie in [1, model.num_layers={layers}], got {k}")
    if k < layers and cfg.model.name != "wan":
        raise ValueError("--blocks (k of the blocks) is only for Wan's uniform blocks")
    if k < layers and cfg.model.checkpointing == "auto":
        raise ValueError("--blocks with model.checkpointing=auto: the recompute rule counts the full depth; set "
                         "model.checkpointing to none or full")
    if R < 1:
        raise ValueError(f"ranks must be ≥ 1, got {R} (the settings file's)")
    scale = layers / k
    p_matmul = build_model(dataclasses.replace(cfg.model, pretrained=None), "meta").num_matmul_params()
    shape = ModelShape.of(cfg.model, p_matmul)
    peak_tflops = args.peak_tflops if args.peak_tflops is not None else cfg.metrics.peak_tflops
    cal = Calibration.load(calibration) if calibration else None
    optim_pred = cal.optim_ms(cal.mode_name(cfg.model.checkpointing)) if cal else 0.0

    graph_tokens = graph_tokens_for(cfg, args.cuda_graphs)
    # plans and predictions of every setting first: a setting that cannot work stops the run before the model
    todo = []
    for e in entries:
        sizes, sched = resolve_entry(e, cfg, tokens, shape, R, calibration, peak_tflops or 100.0, graph_tokens)
        M = int(e.get("M") or M_default)
        n = args.samples or int(math.ceil(samples_per_step(mix, sizes, R, M) * (args.warmup + args.steps) * 1.1)) \
            + R * M * max(sizes)
        table_ = mix.table(n, seed)
        plans = plan_steps(table_, seed, R, sched.strategy, M, sizes, sched.cost_fn, args.warmup + args.steps,
                           window=sched.window, planner=sched.planner, m_mem=sched.m_mem)
        predicted = evaluate(plans[args.warmup:], None, optim_pred)
        device_s = sum(p.pred_ms().sum() for p in plans) / 1e3 / scale
        todo.append(dict(e=e, sizes=sizes, sched=sched, M=M, n=n, plans=plans, predicted=predicted,
                         device_s=device_s))
        log(f"{e['label']}: B {dict(zip(names, sizes))}, M = {M}, planner {sched.planner}, window {sched.window}; "
            f"predicted {predicted.tokens_per_s:,.0f} tokens/s, idle {pct(predicted.idle_fraction)}; the planned "
            f"micro-batches take ≈ {device_s:.0f} s on this device by the cost model"
            + (f" (×{k}/{layers} blocks)" if k < layers else ""))
        for note in sched.notes:
            log(f"  note: {note}")

    truth_files = [args.truth] if isinstance(args.truth, str) else list(args.truth or [])
    truth_at = truth_sources(truth_files, cfg.model.checkpointing, k, layers, cfg.model.dim) if truth_files else {}
    for t in todo:
        t["truth"] = {depth: evaluate(t["plans"][args.warmup:], lambda mb, tr=tr: tr.mean(mb.B, mb.S), om).row()
                      for depth, (tr, om) in truth_at.items()}
        for depth, row in t["truth"].items():
            log(f"  {t['e']['label']}: the simulator's truth ({depth}) {row['tokens_per_s']:,.0f} tokens/s, idle "
                f"{pct(row['idle_fraction'])}")

    cuda_note = ("eager (--cuda-graphs off): every micro-batch runs as in a multi-process FSDP run" if
                 args.cuda_graphs == "off" else "--cuda-graphs auto: small micro-batches replayed as CUDA graphs, as "
                 "one process of train.py runs them (not what a multi-process FSDP run does)")
    meta = {"command": command, "date": datetime.date.today().isoformat(), "ranks": R, "steps": args.steps,
            "warmup": args.warmup, "seed": seed, "calibration": calibration, "optim_ms_predicted": optim_pred,
            "mix": [{"bucket": n, "S": int(s), "share": float(sh)} for n, s, sh in zip(mix.names, mix.S, mix.share)],
            "model": {"name": cfg.model.name, "dim": cfg.model.dim, "num_layers": layers, "blocks_run": k,
                      "scale": scale, "precision": cfg.model.precision, "checkpointing": cfg.model.checkpointing,
                      "text_len": cfg.model.text_len, "p_matmul": p_matmul},
            "execution": cuda_note, "peak_tflops": peak_tflops,
            "scaling": (f"{k} of {layers} blocks run; every time is also given ×{scale:g} (scaled_ms, measured): "
                        "per-block cost is identical, the non-block part is over-counted by the same factor; "
                        "measured_as_run holds the unscaled numbers") if k < layers else "the full model ran",
            "formulas": "step = Σ_k max_r t_rk + optim_ms / R; idle = 1 − Σ real t / (R · Σ slot maxima); busy CV = "
                        "mean over steps of CV over ranks of Σ_k t_rk (scheduling/replay.py)",
            "predicted_by": "the planner's pred_ms of the same plans and the calibration's optim_ms (the simulator "
                            "without noise)",
            "truth": ({"files": truth_files,
                       "depths": sorted(truth_at), "by": "each planned micro-batch at the calibrations' measured "
                       "median time of its (S, B) (their points merged), interpolated between measured points as "
                       "the simulator's truth is (scheduling/truth.py MeasuredTruth), and the first calibration's "
                       "optimizer step at that depth ÷ R"}
                      if truth_files else None)}
    os.makedirs(args.out, exist_ok=True)
    json_path, md_path = os.path.join(args.out, f"{args.name}.json"), os.path.join(args.out, f"{args.name}.md")
    results: list[dict] = []

    def entry_result(t) -> dict:
        e, sched = t["e"], t["sched"]
        return {"label": e["label"], "strategy": sched.strategy, "setting": {k_: v for k_, v in e.items()
                                                                             if k_ not in ("label", "strategy")},
                "values": sched.values, "sources": sched.sources, "batch_sizes": t["sizes"],
                "batch_sizes_by_bucket": dict(zip(names, t["sizes"])), "M": t["M"], "window": sched.window,
                "planner": sched.planner,
                "samples_in_epoch": t["n"], "g_expected": expected_tokens_per_gpu(mix, t["sizes"], R, t["M"]),
                "predicted": t["predicted"].row(), "predicted_device_s": t["device_s"],
                **({"truth": t["truth"]} if t.get("truth") else {})}

    def write() -> None:
        doc = {"meta": meta, "comparisons": comparisons(results), "points": points(results), "settings": results}
        with open(json_path + ".tmp", "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(json_path + ".tmp", json_path)

    if args.dry_run:
        results = [entry_result(t) for t in todo]
        meta["device"] = "none (--dry-run)"
        write()
        return {"meta": meta, "settings": results, "comparisons": [], "points": []}

    import torch

    from training.step import collector_every

    runner = Runner(cfg, k, args.cuda_graphs)
    meta["device"] = (torch.cuda.get_device_name(runner.ctx.device) if runner.cuda
                      else f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)")
    meta["torch"] = torch.__version__
    meta["model_build_s"] = runner.build_s
    log(f"device {meta['device']}; model built in {runner.build_s:.1f} s ({k} of {layers} blocks); {cuda_note}")
    with collector_every(cfg.train.gc_every) as gc_tick:
        for t in todo:
            res = entry_result(t)
            log(f"{res['label']}: {len(t['plans'])} steps of {R} ranks × {t['M']} micro-batches")
            policy = checkpoint_policy(cfg.model.checkpointing, t["sched"].recompute_blocks,
                                       cfg.model.keep_attention, k)
            res["execution"] = runner.capture_up_to(t["sched"].graph_tokens)
            log(f"  {res['execution']}")
            t0 = time.perf_counter()
            try:
                run = run_setting(runner, t["plans"], args.warmup, names, shapes, policy, scale, log, gc_tick)
            except torch.OutOfMemoryError as exc:
                res["error"] = "out of memory: " + str(exc).splitlines()[0]
                log(f"  {res['error']}")
                results.append(res)
                runner.inputs.clear()
                runner.reset_peak()
                write()
                continue
            timed = t["plans"][args.warmup:]
            grids, optim = run["grids"][args.warmup:], run["optim_ms"][args.warmup:]
            measured = summarize(step_times(timed, [g * scale for g in grids], [o * scale for o in optim]))
            as_run = summarize(step_times(timed, grids, optim))
            mfu = None
            if peak_tflops and runner.cuda:
                flops = sum(model_flops(mb.num_real, mb.S, cfg.model.text_len, p_matmul, shape.layers, shape.dim)
                            for p in timed for row in p.ranks for mb in row)
                mfu = flops / (measured.time_s * R * peak_tflops * 1e12)
            res.update(measured=measured.row(), measured_as_run=as_run.row(), mfu=mfu, peak_gib=run["peak_gib"],
                       skipped_steps=run["skipped_steps"], wall_s=time.perf_counter() - t0,
                       step_wall_ms=run["wall_ms"], g_measured=measured.tokens / (R * measured.steps),
                       rows=run["rows"])
            results.append(res)
            write()
            runner.inputs.clear()
            log(f"  measured {measured.tokens_per_s:,.0f} tokens/s (predicted {t['predicted'].tokens_per_s:,.0f}), "
                f"busy CV {pct(measured.compute_cv)}, idle {pct(measured.idle_fraction)} "
                f"({res['wall_s']:.0f} s)")
    title = (f"Replay of the planner's plans on {meta['device']}, {meta['date']}: {cfg.model.name} dim "
             f"{cfg.model.dim}, {k} of {layers} blocks run" + (f" (times ×{scale:g})" if k < layers else "")
             + f"; R = {R}, K = {args.steps} timed steps after {args.warmup} warm-up; {cuda_note}")
    lines = [f"# {title}", "", f"`{command}`", "", f"Buckets (B per bucket in this order): {' '.join(names)}.", "",
             table(results), ""]
    for c in comparisons(results):
        lines.append(f"- {c['ratio']}: measured {c['measured']:.3f}, predicted {c['predicted']:.3f} "
                     f"({c['points']:+.1f} points)")
    lines += truth_table(results)
    lines += ["", "Predicted: the planner's pred_ms of the same plans + the calibration's optim_ms / R (the "
              "simulator without noise). Measured: " + meta["formulas"] + "."]
    report = "\n".join(lines) + "\n"
    with open(md_path, "w") as f:
        f.write(report)
    write()
    print(report, flush=True)
    return {"meta": meta, "settings": results, "comparisons": comparisons(results), "points": points(results)}

"""Wan 2.1 training step, ours against diffusers' WanTransformer3DModel, at 480p/720p shapes (a script, not a test).

    python scripts/bench/step.py --out DIR                    (one H200: 1.3B config, ~6 min; default runs/bench/step)
    python scripts/bench/step.py --tiny --out /tmp/step_cpu   (a tiny config on the CPU: checks the script)
    python scripts/bench/step.py --model 14b --blocks 10 ...  (a full-width slice of Wan 14B; MFU counts its blocks)

Side by side in one run, forward + backward, no optimizer, random weights (the same in both models):
  diffusers@default   diffusers' model, bf16 parameters and gradients, gradient checkpointing, its default attention
  diffusers@fast      the same at the fastest attention backend found (`set_attention_backend`)
  diffusers@compile   diffusers@fast with each block compiled (block.compile(); compile time untimed)
  diffusers@graph     diffusers@compile (blocks compiled on a GPU; uncompiled where that capture fails) with the whole
                      micro-batch captured as one CUDA graph and replayed (training/cuda_graphs.py, as ours@graph):
                      diffusers with no host overhead either
  ours@fast           our model, bf16 parameters and gradients (the fp32 modules of diffusers' list kept fp32), full
                      checkpointing, the same attention kernel (model.attention_backend of the same name)
  ours@glue           the same with model.fused_ops=triton (fused gated residual, q/k RMSNorm-RoPE)
  ours@saved          ours@glue saving AdaLN's outputs and the rotated q/k for backward (FusedWanBlock.recompute_norms off)
  ours@notail         ours@glue with the MLP and its gated residual as two ops (ops/gated_ffn.py off): the recompute
                      runs the down projection again
  ours@compile        ours@fast with block.compile() (inductor fuses the torch glue instead of our kernels)
  ours@offload        ours@glue with the recomputed blocks' inputs in pinned host memory (models/offload.py)
  ours@policy         (b): the fewest leading blocks recompute that keep the step under diffusers@fast's peak memory
                      at that shape (none where it fits), with the fused ops (and offload when ours@offload runs);
                      --peak-limit lowest: under compiled diffusers' peak too, where diffusers@compile runs
  ours@keep           (b) too: every block recomputed, the most blocks that fit diffusers' peak keeping their
                      attention outputs (the last ones: models/checkpointing.py keeps_attention; the recompute skips
                      attention there), fused ops and offload as ours@policy
  ours@keep+unchunked ours@keep with the MLP's temporaries whole (as ours@unchunked)
  ours@graph          the micro-batch captured whole as one CUDA graph and replayed, as train.py runs micro-batches
                      up to train.graph_max_tokens (train.cuda_graphs=auto): the fewest leading blocks recomputed
                      whose graph, its memory pool counted as train.py plans it, fits ours@policy's limit (no
                      offload), so the small micro-batches compare with what the trainer runs
  ours@unchunked      ours@offload with the MLP's ffn-sized temporaries whole (ops/gelu_ffn.py's row chunks off)
  ours@chunkN         ours@offload with those temporaries in chunks of N MiB of rows (the default is 128)
  diffusers@again     diffusers measured again after our columns at each shape (drift between columns shows)
  ours@trainer        our trainer's precision: fp32 master weights under bf16 autocast (not held to memory targets)
  ours@none           ours@glue with no block recomputed (model.checkpointing=none; no memory target: out of memory
                      is recorded in meta.oom, not fatal)
The graph columns warm up eagerly once and capture once before their timed replays; on a CPU they replay by calling
the step again (FakeGraphs), which checks the plumbing only. Reported per shape: ms (median), tokens/s,
model-FLOPs utilisation (contracts §9), peak GiB; each row is appended to OUT/bench_step.jsonl as it is measured.
Then the longest sequence: B = 1 at 480p (latent 60×104), latent frames raised until the --longest column's peak
exceeds diffusers@fast's peak at S = 32760. Before timing, the two models' outputs are compared on one small input
(bf16 tolerance).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
import time
from unittest.mock import patch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

import torch  # noqa: E402

import harness  # noqa: E402

import ops.gelu_ffn as gelu_ffn  # noqa: E402 - CHUNK_BYTES is a column's knob
import ops.gated_ffn as gated_ffn  # noqa: E402 - GATED_TAIL_MIN_TOKENS is a column's knob
from scheduling.efficiency import model_flops  # noqa: E402
from training.busy import kernel_kind  # noqa: E402
from training.cuda_graphs import FakeGraphs, MicroBatchGraphs, clear_cublas_workspaces  # noqa: E402

WAN_1P3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
WAN_14B = dict(WAN_1P3B, num_attention_heads=40, ffn_dim=13824, num_layers=40)
TINY = dict(WAN_1P3B, num_attention_heads=2, attention_head_dim=16, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2)
# (B, latent frames, latent H, latent W): S = F·H/2·W/2 → 1560, 7800, 14040, 32760, 75600
SHAPES = ((16, 1, 60, 104), (4, 5, 60, 104), (2, 9, 60, 104), (1, 21, 60, 104), (1, 21, 90, 160),
          (1, 1, 60, 104), (4, 1, 60, 104), (1, 5, 60, 104))  # + the small micro-batches: 1×1560, 4×1560, 1×7800
TINY_SHAPES = ((4, 1, 8, 8), (2, 3, 8, 8), (1, 5, 8, 12), (1, 1, 8, 8))  # the last: a small micro-batch, S as the first
SDPA = {"native": None, "_native_flash": "FLASH_ATTENTION", "_native_efficient": "EFFICIENT_ATTENTION",
        "_native_cudnn": "CUDNN_ATTENTION", "_native_math": "MATH"}
TEXT_LEN = 512
# The columns that are one setting of our model, timed as they come: ours_run's options ("fused": the fused ops on
# the GPU) and the module knobs patched around the measurement. The first four run before ours@compile, the rest
# after the profile (the order of a run is the order here).
OURS_COLUMNS = {
    "ours@fast": ({}, {}),
    "ours@saved": ({"fused": True, "recompute_norms": False}, {}),  # AdaLN's outputs and the rotated q/k saved
    "ours@glue": ({"fused": True}, {}),  # + fused gated residual, q/k RMSNorm-RoPE
    "ours@notail": ({"fused": True}, {"GATED_TAIL_MIN_TOKENS": 1 << 62}),  # the block's tail as two ops
}
OURS_COLUMNS_LATE = {
    "ours@offload": ({"fused": True, "offload": True}, {}),  # + the recomputed blocks' inputs in pinned host memory
}
KNOB_MODULES = {"GATED_TAIL_MIN_TOKENS": gated_ffn, "CHUNK_BYTES": gelu_ffn}
# the table's column order
TABLE_COLUMNS = ("diffusers@default", "diffusers@fast", "diffusers@compile", "diffusers@graph", "ours@fast", "ours@saved",
                 "ours@notail", "ours@glue",
                 "ours@compile", "ours@offload", "ours@unchunked", "ours@policy", "ours@keep", "ours@keep+unchunked",
                 "ours@graph", "ours@trainer", "ours@none", "diffusers@again")


OURS_BACKEND = {"native": "flash", "_native_flash": "flash", "_native_efficient": "efficient",
                "_native_cudnn": "cudnn", "_native_math": "math"}  # diffusers' backend → model.attention_backend


@contextlib.contextmanager
def sdpa_context(model, backend: str):
    """Our model runs the kernel diffusers' backend of the same name runs (torch's default, native, is flash on
    CUDA): model.attention_backend (ops/attention_backend.py) for the columns inside, auto after."""
    from models.layers import apply_attention_backend

    apply_attention_backend(model, OURS_BACKEND[backend])
    try:
        yield
    finally:
        apply_attention_backend(model, "auto")


LAST_TIMES: list = []  # every rep of the last time_step, in ms (recorded with each row: outliers show)
LAST_ACTIVE: list = []  # the last time_step's peak of active bytes, GiB: allocated + freed blocks that still wait on
# another stream's events (not reusable yet, not counted by max_memory_allocated)


GC_OFF = False  # --gc-off: Python's collector paused inside each timed step (collected before it, untimed)


def time_step(run, dev, warmup: int, reps: int) -> tuple[float, float]:
    """(median ms, peak GiB) of run() = one forward + backward."""
    times, peak = harness.time_reps(run, dev, warmup, reps, gc_off=GC_OFF)
    LAST_TIMES[:] = [round(t, 1) for t in times]
    LAST_ACTIVE[:] = [round(torch.cuda.memory_stats(dev)["active_bytes.all.peak"] / 2**30, 2)] if dev.type == "cuda" \
        else []
    return harness.median(times), peak


def inputs(cfg, shape, dev, dtype, seed=0):
    return harness.wan_inputs(cfg, shape, dev, dtype, TEXT_LEN, seed)


def build(cfg, dev):
    from diffusers import WanTransformer3DModel
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()  # set_attention_backend warns on every call that it is experimental

    from models.wan import WanTransformer

    torch.manual_seed(0)
    theirs = WanTransformer3DModel(**cfg)
    ours = WanTransformer(**cfg, adaln_backend="auto")
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return theirs.to(dev), ours.to(dev)


def forward(model, x, t, ctx, diffusers: bool):
    """The model's output on one micro-batch, diffusers' keyword interface or ours."""
    if diffusers:
        return model(hidden_states=x, timestep=t, encoder_hidden_states=ctx, return_dict=False)[0]
    return model(x, t, ctx)


def drop_grads(model) -> None:
    for p in model.parameters():
        p.grad = None


def step_fn(model, x, t, ctx, diffusers: bool, autocast: bool, dev):
    def run():
        drop_grads(model)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            out = forward(model, x, t, ctx, diffusers)
        out.float().pow(2).mean().backward()
    return run


def graph_step(model, x, t, ctx, diffusers: bool, dev):
    """(run, graphs): run() is one forward + backward of `model` through MicroBatchGraphs (an eager warm-up, then
    one capture, then replays; FakeGraphs on a CPU). Gradients exist before the capture and accumulate in place
    (training/cuda_graphs.py's rule); the inputs are the graph's static buffers, copied in before each replay."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    graphs = (MicroBatchGraphs if dev.type == "cuda" else FakeGraphs)(dev)

    def fn(inp):
        forward(model, inp["x"], inp["t"], inp["ctx"], diffusers).float().pow(2).mean().backward()

    tokens = x.shape[0] * x.shape[2] * x.shape[3] * x.shape[4] // 4
    return (lambda: graphs.run("step", tokens, fn, {"x": x, "t": t, "ctx": ctx})), graphs


def allocated_gib(dev):
    """GiB allocated on `dev` now, after a collection (None on a CPU: the allocator's statistics are CUDA's)."""
    if dev.type != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize(dev)
    return torch.cuda.memory_allocated(dev) / 2**30


def release(model, graphs) -> None:
    """Free a graph column's graphs, their pool, the model's gradients and cuBLAS's workspaces (the next column
    starts clean). torch keeps a cuBLAS and a cuBLASLt workspace for each stream they ran on, and each graph object
    here captures on a new side stream from torch's pool of 32: uncleared, every capture on a new stream would hold
    its pair until the process ends and raise every later column's peak (results/attention_h100.md). A captured
    graph writes to the workspace its warm-up allocated, so the clearing comes only after every graph is dropped;
    train.py's training loop captures on one stream and keeps its workspaces (never clear them where a graph may
    still replay)."""
    graphs._drop_graphs()
    drop_grads(model)
    clear_cublas_workspaces(graphs.device)


class Probe:
    """measure(setting) → (ms, peak GiB), each setting measured once; out of memory reads as an infinite peak.
    fits(setting): the peak stays within limit (a NaN peak — the CPU measures none — fits)."""

    def __init__(self, measure, limit: float):
        self.measure, self.limit, self.tried = measure, limit, {}

    def __call__(self, setting):
        if setting not in self.tried:
            try:
                self.tried[setting] = self.measure(setting)
            except torch.OutOfMemoryError:
                self.tried[setting] = (math.inf, math.inf)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return self.tried[setting]

    def fits(self, setting) -> bool:
        return not self(setting)[1] > self.limit


def peak_search(measure, layers: int, limit: float):
    """The fewest leading blocks k to recompute so that measure(k) → peak GiB stays ≤ limit: k = 0 when it fits,
    else interpolate between the measured peaks of k = L and k = L/2 (the peak falls linearly in k) and step up
    until it fits. Returns (k, ms, peak) of the chosen setting."""
    at = Probe(measure, limit)
    if at.fits(0):
        return (0, *at(0))
    full, half = at(layers)[1], at(layers // 2)[1]
    if at.fits(layers // 2):
        k = layers // 2
        if full < half < math.inf:  # per-block activation bytes from the two peaks; the fewest k that fit
            k = max(1, math.ceil(layers - (limit - full) / ((half - full) / (layers - layers // 2))))
    else:
        k = layers // 2 + 1
    while k < layers and not at.fits(k):
        k += 1
    return (k, *at(k))


def profile(run) -> dict:
    """Device time of one step by kernel kind (attention, GEMM, our Triton kernels, other = aten elementwise /
    norm / reduction / copy kernels), in ms, each kind's ten largest kernels as [ms, launches], and the GPU's idle
    time inside the step with its longest gaps ([ms, kernel before, kernel after])."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = torch.cuda.is_available()
    run()
    with torch_profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    kinds, named = {}, {}
    for e in prof.key_averages():
        us = (getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)) if cuda else \
            e.self_cpu_time_total  # a CPU check of the script: its operators' own times
        if not us or e.key.startswith(("ProfilerStep", "cudaDeviceSynchronize")):
            continue
        kind = kernel_kind(e.key)  # other: aten elementwise, norms, reductions, copies
        kinds[kind] = kinds.get(kind, 0.0) + us / 1e3
        named.setdefault(kind, {})[e.key[:90]] = [round(us / 1e3, 2), e.count]  # [ms, launches]
    total = sum(kinds.values())
    out = {"total_ms": round(total, 1), **{k: {"ms": round(v, 1), "share": round(v / total, 3)}
                                           for k, v in sorted(kinds.items())},
           **{f"top_{k.split()[0]}": dict(sorted(v.items(), key=lambda kv: -kv[1][0])[:10])
              for k, v in named.items()}}
    try:  # where the GPU waits between kernels (the host behind, or a sync): the step's span minus its kernels
        from torch.autograd import DeviceType

        spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                       if e.device_type == DeviceType.CUDA)
        gaps = sorted(((b[0] - a[1], a[2][:60], b[2][:60]) for a, b in zip(spans, spans[1:]) if b[0] > a[1]),
                      reverse=True)
        out.update(span_ms=round((max(e for _, e, _ in spans) - spans[0][0]) / 1e3, 1),
                   idle_ms=round(sum(g for g, _, _ in gaps) / 1e3, 1),
                   top_gaps=[[round(g / 1e3, 2), a, b] for g, a, b in gaps[:8]])
    except Exception as e:  # noqa: BLE001 - a diagnostic: never the run's end
        out["idle_error"] = f"{type(e).__name__}: {e}"
    print(f"profile: {json.dumps(out)}", flush=True)
    return out


def memory_at_peak(run, top: int = 14) -> dict:
    """What is alive at the peak of one step (torch's allocator trace): the GiB held before the step (parameters,
    inputs) and the step's own allocations alive at the peak, grouped by the first frame in models/, ops/ or
    diffusers (allocations from autograd's engine carry no Python frame: '<backward>') and by size. A block is alive
    until its free completes, so freed blocks still waiting on another stream's events count — as in the active
    bytes, not the allocated bytes (max_memory_allocated) of the rows."""
    try:
        return _memory_at_peak(run, top)
    except Exception as e:  # noqa: BLE001 - a diagnostic: its failure is reported, the benchmark goes on
        print(f"memory at peak: {type(e).__name__}: {e}", flush=True)
        return {"error": f"{type(e).__name__}: {e}"}


def _memory_at_peak(run, top):
    run()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        run()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = next(t for t in snap["device_traces"] if t)

    def where(ev):
        for f in ev.get("frames") or ():
            name = f.get("filename", "")
            if any(k in name for k in ("/models/", "/ops/", "/diffusers/", "/training/")):
                return f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}"
        return "<backward>" if not ev.get("frames") else "<other>"

    live, now, peak, peak_at = {}, 0, 0, -1
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            now += ev["size"]
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            now -= live.pop(ev["addr"])["size"]
        if now > peak:
            peak, peak_at = now, i
    live = {}
    for ev in trace[:peak_at + 1]:  # replay to the peak, then group what is alive there
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
        elif ev["action"] == "free_completed":
            live.pop(ev["addr"], None)
    groups = {}
    for ev in live.values():
        key = f"{where(ev)} [{ev['size'] / 2**20:.1f} MiB]"
        n, b = groups.get(key, (0, 0))
        groups[key] = (n + 1, b + ev["size"])
    if len(trace) >= 2_000_000:
        print("memory at peak: the allocator trace filled its 2,000,000 entries — early allocations are missing",
              flush=True)
    out = {"before_step_gib": round(base / 2**30, 3), "step_peak_gib": round(peak / 2**30, 3),
           "peak_event": f"{peak_at}/{len(trace)}", "frame_at_peak": where(trace[peak_at]) if peak_at >= 0 else None,
           "alive_at_peak": {k: f"{n}× = {b / 2**30:.3f} GiB"
                             for k, (n, b) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]}}
    print(f"memory at peak: {json.dumps(out, indent=1)}", flush=True)
    return out


def keep_search(measure, layers: int, limit: float):
    """The most blocks j (of all L recomputed) that keep their attention outputs with measure(j) → peak ≤ limit.
    The peak does not fall as j grows (flat while the kept outputs die before the end-of-backward peak, then up),
    so a bisection between 0 and L finds it in about log2(L) probes."""
    at = Probe(measure, limit)
    if at.fits(layers):
        return layers
    lo, hi = 0, layers  # lo fits (or is 0), hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if at.fits(mid) else (lo, mid)
    return lo


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_out(ap, "step")
    ap.add_argument("--tiny", action="store_true", help="tiny config and shapes (checks the script on a CPU)")
    ap.add_argument("--model", choices=("1.3b", "14b"), default="1.3b", help="Wan 2.1's config (default 1.3B)")
    ap.add_argument("--blocks", type=int, default=None, help="a slice: this many of the model's blocks (full width)")
    ap.add_argument("--shapes", default=None, help="comma-separated indices into the shape list (default: all)")
    ap.add_argument("--impls", default="diffusers@default,diffusers@fast,ours@fast,ours@glue,ours@compile,"
                    "ours@offload,ours@policy,ours@keep,ours@trainer", help="which columns to run")
    ap.add_argument("--backends", default="_native_flash,_native_cudnn,_native_efficient",
                    help="candidates for the fastest attention backend (the middle shape decides)")
    ap.add_argument("--fast-backend", default=None, help="skip the search and use this backend")
    ap.add_argument("--peak-limit", default="fast", choices=("fast", "lowest"),
                    help="the peak memory ours@policy, ours@keep and ours@graph must stay within: diffusers@fast's, "
                    "or the lower of diffusers@fast's and diffusers@compile's where the latter runs")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--long-tokens", type=int, default=50_000, help="shapes with B·S above this time warm-up 1, reps 1")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--profile", action="store_true",
                    help="device-time breakdown (attention / GEMM / fused Triton / other kernels) at the first shape")
    ap.add_argument("--profile-every", action="store_true", help="the breakdown of ours@glue (and ours@none where "
                    "it runs) at every shape, into meta.profiles[BxS] (the ceiling table's measured split)")
    ap.add_argument("--memtrace", action="store_true",
                    help="what is alive at the peak of one ours@offload step at the first shape")
    ap.add_argument("--longest", default="ours@offload", help="the column whose longest sequence is searched ('' skips)")
    ap.add_argument("--gc-off", action="store_true", help="pause Python's garbage collector inside timed steps "
                    "(collected between them, untimed)")
    ap.add_argument("--act-grad-config", default=None, help="rows,features,iters,warps: the MLP backward's "
                    "elementwise kernel's CUDA launch shape for every column (ops.gelu_ffn.GELU_GRAD_CONFIG)")
    args = ap.parse_args(argv)
    if args.act_grad_config:
        gelu_ffn.GELU_GRAD_CONFIG["cuda"] = tuple(int(v) for v in args.act_grad_config.split(","))
    global GC_OFF
    GC_OFF = args.gc_off
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg, shapes = (TINY, TINY_SHAPES) if args.tiny else (WAN_14B if args.model == "14b" else WAN_1P3B, SHAPES)
    if args.blocks:
        cfg = dict(cfg, num_layers=args.blocks)
    ref_shape = shapes[3] if not args.tiny else shapes[2]  # the longest-sequence reference (S = 32760)
    if args.shapes:
        shapes = tuple(shapes[int(i)] for i in args.shapes.split(","))
    impls = [i for i in args.impls.split(",") if i]
    if dev.type == "cpu":
        torch.set_num_threads(max(1, os.cpu_count() // 2))
    os.makedirs(args.out, exist_ok=True)
    stream = open(os.path.join(args.out, "bench_step.jsonl"), "a")  # every row as it comes (a killed run keeps them)
    theirs, ours = build(cfg, dev)
    p_matmul, layers, dim = ours.num_matmul_params(), cfg["num_layers"], cfg["num_attention_heads"] * cfg["attention_head_dim"]
    rows, meta = [], {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                      "act_grad_config": list(gelu_ffn.GELU_GRAD_CONFIG["cuda"]),
                      "torch": torch.__version__, "config": {k: list(v) if isinstance(v, tuple) else v
                                                             for k, v in cfg.items()},
                      "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}

    def record(impl, shape, ms, peak, **extra):
        B, F, H, W = shape
        S = F * (H // 2) * (W // 2)
        flops = model_flops(B, S, TEXT_LEN, p_matmul, layers, dim)
        row = dict(impl=impl, B=B, S=S, ms=round(ms, 2), tokens_per_s=round(B * S / ms * 1e3, 1),
                   mfu=round(flops / (ms * 1e-3) / (args.peak_tflops * 1e12), 4) if dev.type == "cuda" else None,
                   peak_gib=round(peak, 2), reps_ms=list(LAST_TIMES), **extra)
        if LAST_ACTIVE:
            row["active_peak_gib"] = LAST_ACTIVE[0]
        rows.append(row)
        print(json.dumps(row), flush=True)
        stream.write(json.dumps(row) + "\n")
        stream.flush()
        return row

    def keep_profile(key, impl, prof):  # into the file's meta at the end, and the stream now (a killed run keeps it)
        meta.setdefault("profiles", {}).setdefault(key, {})[impl] = prof
        stream.write(json.dumps({"profile_of": impl, "BxS": key, **prof}) + "\n")
        stream.flush()

    # parity on a small input, bf16 parameters on both sides (diffusers' .to(bf16) casts every module)
    theirs.to(torch.bfloat16)
    ours._cast_params(torch.bfloat16)
    x, t, ctx = inputs(cfg, shapes[0][:1] + (1, 8, 8) if not args.tiny else shapes[0], dev, torch.bfloat16)
    with torch.no_grad():
        b = theirs(hidden_states=x, timestep=t, encoder_hidden_states=ctx, return_dict=False)[0].float()
        for glue in ("torch", "triton" if dev.type == "cuda" else "torch"):
            ours.fused_ops = glue
            a = ours(x, t, ctx).float()
            meta[f"parity_rel_err_bf16_glue_{glue}"] = float((a - b).norm() / b.norm())
        ours.fused_ops = "torch"
    print(f"parity: ours vs diffusers, bf16, relative error {meta}", flush=True)

    theirs.enable_gradient_checkpointing()
    ours.set_activation_checkpointing(True)
    best = args.fast_backend
    if best is None:  # the fastest backend: timed on the middle shape with diffusers' model
        probe = shapes[len(shapes) // 2]
        best, best_ms = "native", math.inf
        for backend in ["native"] + [b for b in args.backends.split(",") if b]:
            try:
                theirs.set_attention_backend(backend)
                run = step_fn(theirs, *inputs(cfg, probe, dev, torch.bfloat16), True, False, dev)
                ms, _ = time_step(run, dev, 1, 1)
            except Exception as e:  # noqa: BLE001 - a backend this machine lacks is reported, not fatal
                print(f"backend {backend}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
                continue
            print(f"backend {backend}: {ms:.1f} ms at S={probe[1] * probe[2] * probe[3] // 4}", flush=True)
            if ms < best_ms:
                best, best_ms = backend, ms
    meta["fast_backend"] = best
    glue = "triton" if dev.type == "cuda" else "torch"

    def ours_run(shape, recompute, fused_ops="torch", compiled=False, dtype=torch.bfloat16, autocast=False,
                 offload=False, keep=0, recompute_norms=True):
        ours.set_activation_checkpointing(recompute, keep_attention=keep)
        ours.fused_ops = fused_ops
        for block in ours.blocks:
            block.recompute_norms = recompute_norms
        ours.offload_checkpoints = offload
        for block in ours.blocks:
            if compiled and getattr(block, "_compiled_call_impl", None) is None:
                block.compile()
            elif not compiled:
                block._compiled_call_impl = None
        return step_fn(ours, *inputs(cfg, shape, dev, dtype), False, autocast, dev)

    def column(impl, shape, timed, options, knobs):
        """One OURS_COLUMNS entry at this shape: its setting, its knobs patched, one row."""
        with contextlib.ExitStack() as stack:
            for knob, value in knobs.items():
                stack.enter_context(patch.object(KNOB_MODULES[knob], knob, value))
            record(impl, shape, *timed(ours_run(shape, True, glue if options.get("fused") else "torch",
                                                offload=options.get("offload", False),
                                                recompute_norms=options.get("recompute_norms", True))))

    def retained(label, shape, before):
        """meta["retained_gib"][label B×S]: what stays allocated after a graph column (or ours@graph's search) has
        released its graphs, against before it (None on a CPU): memory a column leaves behind raises every later
        column's peak, so each is accounted for (results/attention_h100.md)."""
        B, F, H, W = shape
        now = allocated_gib(dev)
        meta.setdefault("retained_gib", {})[f"{label} {B}x{F * (H // 2) * (W // 2)}"] = (
            None if before is None else round(now - before, 3))

    def graph_column(model, impl, shape, args_, diffusers, warmup, reps, compile_blocks=False, **extra):
        drop_grads(model)  # an eager column's gradients would read as memory the graph column freed
        before = allocated_gib(dev)
        try:
            return _graph_column(model, impl, shape, args_, diffusers, warmup, reps, compile_blocks, **extra)
        finally:
            retained(impl, shape, before)

    def _graph_column(model, impl, shape, args_, diffusers, warmup, reps, compile_blocks=False, **extra):
        """One graph column's row: warm-up and capture untimed, then `reps` replays; its peak is the replays' peak
        plus the graph's pool (what the trainer's graphs hold; the pool counts reserved segments, the eager columns
        allocated bytes, so the graph columns' peaks lean high). A capture that fails with compiled blocks is tried
        again uncompiled (train.py never captures compiled blocks); one that still fails is recorded, and the table
        leaves it out (the column then timed eager steps: graph_failed > 0)."""
        for compiled in ([True, False] if compile_blocks else [False]):
            for block in model.blocks:
                if compiled:
                    block.compile()
                else:
                    block._compiled_call_impl = None
            run, graphs = graph_step(model, *args_, diffusers, dev)
            try:
                ms, peak = time_step(run, dev, max(warmup, 1) + graphs.warmup, reps)
                pool = graphs.pool_gib() if dev.type == "cuda" else 0.0
                failed = graphs.stats.failed
                if failed and compiled:
                    print(f"{impl} at {shape}: the capture of compiled blocks failed; again uncompiled", flush=True)
                    continue
                return record(impl, shape, ms, peak + pool, pool_gib=round(pool, 2), replays=graphs.stats.replays,
                              graph_failed=failed, compiled=compiled,
                              fits=bool(not peak + pool > diff_peak[shape]) if dev.type == "cuda" else None, **extra)
            except Exception as e:  # noqa: BLE001 - where a capture or compile breaks is a result
                print(f"{impl} at {shape}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                meta.setdefault("graph_errors", {})[f"{impl} {shape}"] = f"{type(e).__name__}: {str(e)[:300]}"
            finally:
                release(model, graphs)
                for block in model.blocks:
                    block._compiled_call_impl = None
        return None

    def graph_peak(model, shape, k):
        """(ms, peak GiB + pool) of one captured replay of ours with k leading blocks recomputed: ours@graph's
        recompute choice is searched as train.py plans it, beside the graph's pool."""
        ours_run(shape, k, glue)  # the setting
        run, graphs = graph_step(model, *inputs(cfg, shape, dev, torch.bfloat16), False, dev)
        try:
            ms, peak = time_step(run, dev, 1 + graphs.warmup, 1)
            if graphs.stats.failed:  # no graph at this setting (a capture out of memory among the causes)
                return math.inf, math.inf
            return ms, peak + (graphs.pool_gib() if dev.type == "cuda" else 0.0)
        finally:
            release(model, graphs)

    def park(model):  # the model not being timed leaves the GPU, so each peak is one model's own
        drop_grads(model)
        model.to("cpu")

    def unpark(model):
        model.to(dev)

    diff_peak = {}  # the memory-bounded columns' limit (--peak-limit)
    fast_peak = {}  # diffusers@fast's peak: the longest-sequence search's limit
    park(ours)
    for shape in shapes:
        B, F_, H, W = shape
        warmup, reps = (1, 1) if B * F_ * H * W // 4 > args.long_tokens else (args.warmup, args.reps)
        timed = lambda run: time_step(run, dev, warmup, reps)  # noqa: E731
        args_ = inputs(cfg, shape, dev, torch.bfloat16)
        unpark(theirs)
        if "diffusers@default" in impls:
            theirs.set_attention_backend("native")
            ms, peak = timed(step_fn(theirs, *args_, True, False, dev))
            record("diffusers@default", shape, ms, peak)
        if best != "native" or "diffusers@default" not in impls:
            theirs.set_attention_backend(best)
            ms, peak = timed(step_fn(theirs, *args_, True, False, dev))
            record("diffusers@fast", shape, ms, peak)
        else:  # the default backend is the fastest: one measurement, both columns
            record("diffusers@fast", shape, ms, peak, same_as="diffusers@default")
        diff_peak[shape] = fast_peak[shape] = round(peak, 2)
        if "diffusers@compile" in impls:  # diffusers at its best: its fastest backend and its blocks compiled
            try:
                for block in theirs.blocks:
                    block.compile()
                t0 = time.perf_counter()
                step_fn(theirs, *args_, True, False, dev)()  # compile (not timed)
                compile_s = round(time.perf_counter() - t0, 1)
                row = record("diffusers@compile", shape, *timed(step_fn(theirs, *args_, True, False, dev)),
                             compile_s=compile_s)
                if args.peak_limit == "lowest":  # ours' memory-bounded columns within compiled diffusers' peak too
                    diff_peak[shape] = min(diff_peak[shape], row["peak_gib"])
                if args.profile and shape == shapes[0]:  # where compiling moves diffusers' time (attention, GEMMs?)
                    meta.setdefault("profile", {})["diffusers@compile"] = profile(step_fn(theirs, *args_, True, False,
                                                                                           dev))
            except Exception as e:  # noqa: BLE001 - where compile breaks is a result
                print(f"diffusers@compile at {shape}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                meta.setdefault("compile_errors", {})[f"diffusers {shape}"] = f"{type(e).__name__}: {str(e)[:300]}"
            for block in theirs.blocks:
                block._compiled_call_impl = None
        if "diffusers@graph" in impls:  # diffusers@compile captured whole: its host overhead gone as ours@graph's
            graph_column(theirs, "diffusers@graph", shape, args_, True, warmup, reps, compile_blocks=dev.type == "cuda")
        if args.profile and shape == shapes[0]:
            meta.setdefault("profile", {})["diffusers@fast"] = profile(step_fn(theirs, *args_, True, False, dev))
        park(theirs)
        unpark(ours)
        with sdpa_context(ours, best):
            for impl, (options, knobs) in OURS_COLUMNS.items():
                if impl in impls:
                    column(impl, shape, timed, options, knobs)
            if "ours@compile" in impls:  # block.compile() on the torch glue (inductor fuses it instead)
                try:
                    t0 = time.perf_counter()
                    ours_run(shape, True, compiled=True)()  # compile (not timed)
                    compile_s = round(time.perf_counter() - t0, 1)
                    record("ours@compile", shape, *timed(ours_run(shape, True, compiled=True)), compile_s=compile_s)
                except Exception as e:  # noqa: BLE001 - where compile breaks is a result
                    print(f"ours@compile at {shape}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    meta.setdefault("compile_errors", {})[str(shape)] = f"{type(e).__name__}: {str(e)[:300]}"
                ours_run(shape, True)  # back to eager
            if args.profile and shape == shapes[0]:
                meta.setdefault("profile", {})["ours@glue"] = profile(ours_run(shape, True, glue))
                if "ours@saved" in impls:
                    meta["profile"]["ours@saved"] = profile(ours_run(shape, True, glue, recompute_norms=False))
            if args.memtrace and shape == shapes[0] and dev.type == "cuda":
                # ours@offload only: under torch.utils.checkpoint (diffusers, ours@glue) torch 2.11's Python-stack
                # recording failed with "SystemError: ... returned NULL without setting an exception"
                meta.setdefault("memtrace", {})["ours@offload"] = memory_at_peak(ours_run(shape, True, glue,
                                                                                          offload=True))
            for impl, (options, knobs) in OURS_COLUMNS_LATE.items():
                if impl in impls:
                    column(impl, shape, timed, options, knobs)
            limit = diff_peak[shape] if dev.type == "cuda" else math.inf
            if "ours@policy" in impls:  # (b): recompute the fewest leading blocks that fit diffusers' peak
                off = "ours@offload" in impls
                k, _, _ = peak_search(lambda k: time_step(ours_run(shape, k, glue, offload=off), dev, 0, 1), layers,
                                      limit)  # one step a probe
                record("ours@policy", shape, *timed(ours_run(shape, k, glue, offload=off)), recompute_blocks=k,
                       offload=off, limit_gib=diff_peak[shape])
            if "ours@graph" in impls:  # the fewest recomputed blocks whose graph, pool included, fits (no offload)
                drop_grads(ours)
                before = allocated_gib(dev)
                k, _, _ = peak_search(lambda k: graph_peak(ours, shape, k), layers, limit)
                retained("ours@graph search", shape, before)
                ours_run(shape, k, glue)  # the setting; the graph column runs the step itself
                graph_column(ours, "ours@graph", shape, args_, False, warmup, reps, recompute_blocks=k,
                             limit_gib=diff_peak[shape])
            for impl in [i for i in impls if i in ("ours@keep", "ours@keep+unchunked")]:
                # (b): every block recomputed, the most of them keeping their attention (+ the MLP unchunked)
                off = "ours@offload" in impls
                chunk = 1 << 62 if impl.endswith("+unchunked") else gelu_ffn.CHUNK_BYTES
                with patch.object(gelu_ffn, "CHUNK_BYTES", chunk):
                    j = keep_search(lambda j: time_step(ours_run(shape, True, glue, offload=off, keep=j), dev, 0, 1),
                                    layers, diff_peak[shape] if dev.type == "cuda" else math.inf)
                    ms, peak = timed(ours_run(shape, True, glue, offload=off, keep=j))
                record(impl, shape, ms, peak, keep_attention_blocks=j, offload=off, limit_gib=diff_peak[shape],
                       fits=bool(not peak > diff_peak[shape]) if dev.type == "cuda" else None)
            S_ = F_ * (H // 2) * (W // 2)
            if "ours@none" in impls:  # no recompute at all: the step the memory model allows where it fits
                try:
                    record("ours@none", shape, *timed(ours_run(shape, False, glue)))
                    if args.profile_every:
                        prof = profile(ours_run(shape, False, glue))
                        keep_profile(f"{B}x{S_}", "ours@none", prof)
                except torch.OutOfMemoryError as e:
                    print(f"ours@none at {shape}: out of memory", flush=True)
                    meta.setdefault("oom", {})[f"ours@none {shape}"] = str(e).splitlines()[0][:200]
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            if args.profile_every and "ours@glue" in impls:
                prof = profile(ours_run(shape, True, glue))
                keep_profile(f"{B}x{S_}", "ours@glue", prof)
            for impl in [i for i in impls if i == "ours@unchunked" or i.startswith("ours@chunk")]:
                # ours@offload with the MLP's ffn-sized temporaries in other chunks (ops/gelu_ffn.py; default 128 MiB)
                mib = None if impl == "ours@unchunked" else int(impl[len("ours@chunk"):])
                with patch.object(gelu_ffn, "CHUNK_BYTES", (mib or 1 << 22) << 20):
                    record(impl, shape, *timed(ours_run(shape, True, glue, offload=True)), chunk_mib=mib)
            ours.set_activation_checkpointing(True)
            ours.offload_checkpoints = False
        park(ours)
        if "diffusers@again" in impls:  # diffusers once more after ours: a drift (clocks, heat) shows as a change
            unpark(theirs)
            ms, peak = timed(step_fn(theirs, *args_, True, False, dev))
            record("diffusers@again", shape, ms, peak)
            park(theirs)
    unpark(ours)
    ours.set_activation_checkpointing(True)
    ours.fused_ops = "torch"
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    if "ours@trainer" in impls:  # fp32 master weights, bf16 autocast (a third column, not held to memory targets)
        ours._cast_params(torch.float32)
        with sdpa_context(ours, best):
            for shape in shapes:
                B, F_, H, W = shape
                warmup, reps = (1, 1) if B * F_ * H * W // 4 > args.long_tokens else (args.warmup, args.reps)
                record("ours@trainer", shape, *time_step(ours_run(shape, True, dtype=torch.float32, autocast=True),
                                                         dev, warmup, reps))
        ours._cast_params(torch.bfloat16)

    # the longest sequence under diffusers@fast's peak at S = 32760 (B = 1, 480p): the peak grows linearly in S,
    # so two measured lengths predict the crossing, which is then checked frame by frame
    if args.longest and ref_shape in fast_peak and dev.type == "cuda":
        limit = fast_peak[ref_shape]
        fused_ops = glue if args.longest in ("ours@glue", "ours@offload") else "torch"
        offload = args.longest == "ours@offload"

        def measure(frames):
            with sdpa_context(ours, best):
                peak = time_step(ours_run((1, frames, ref_shape[2], ref_shape[3]), True, fused_ops,
                                          offload=offload), dev, 0, 1)[1]
            print(f"longest: {frames} frames → {peak:.2f} GiB (limit {limit})", flush=True)
            return math.nan, peak

        probe = Probe(measure, limit)  # memoised; out of memory reads as an infinite peak
        peak_at = lambda frames: probe(frames)[1]  # noqa: E731

        f0, f1 = ref_shape[1], 2 * ref_shape[1]
        p0, p1 = peak_at(f0), peak_at(f1)
        guess = f0 + int((limit - p0) / ((p1 - p0) / (f1 - f0))) if p1 > p0 and p1 < math.inf else f0
        f = max(guess, f0)
        while peak_at(f) > limit and f > 1:
            f -= 1
        while peak_at(f + 1) <= limit:
            f += 1
        S = f * ref_shape[2] * ref_shape[3] // 4
        meta["longest"] = {"impl": args.longest, "limit_gib": limit,
                           "at_diffusers_S": ref_shape[1] * ref_shape[2] * ref_shape[3] // 4,
                           "frames": f, "S": S, "peak_gib": round(peak_at(f), 2),
                           "peaks": {fr: p for fr, (_, p) in probe.tried.items()}}
        print(f"longest: {meta['longest']}", flush=True)
    with open(os.path.join(args.out, "bench_step.json"), "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    print(table(rows))


def table(rows) -> str:
    by = {}
    for r in rows:  # one line per micro-batch shape: 1 × 1560 and 4 × 1560 are two
        if not r.get("graph_failed"):  # a graph column whose capture failed timed eager steps: not its column
            by.setdefault((r["B"], r["S"]), {})[r["impl"]] = r
    impls = list(TABLE_COLUMNS)
    chunks = sorted({i for d in by.values() for i in d if i.startswith("ours@chunk")}, key=lambda i: int(i[10:]))
    at = impls.index("ours@unchunked") + 1  # the chunk columns beside the unchunked one
    impls = impls[:at] + chunks + impls[at:]
    impls = [i for i in impls if any(i in d for d in by.values())]  # the columns this run measured
    lines = ["| B × S | " + " | ".join(f"{i} ms (tok/s, GiB)" for i in impls)
             + " | ours@glue ÷ diffusers' best | ours' best within diffusers' peak ÷ diffusers' best |",
             "|---|" + "---|" * (len(impls) + 2)]
    for (B, S), d in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        cells = [f"{d[i]['ms']:.0f} ({d[i]['tokens_per_s']:.0f}, {d[i]['peak_gib']})" if i in d else "—"
                 for i in impls]
        theirs = max((d[i]["tokens_per_s"] for i in ("diffusers@fast", "diffusers@compile", "diffusers@graph")
                      if i in d), default=None)
        like = d["ours@glue"]["tokens_per_s"] / theirs if theirs and "ours@glue" in d else float("nan")
        limits = [r["limit_gib"] for r in d.values() if "limit_gib" in r]  # the memory-bounded columns' limit
        limit = min(limits) if limits else d["diffusers@fast"]["peak_gib"]
        fit = [d[i]["tokens_per_s"] for i in ("ours@glue", "ours@policy", "ours@keep", "ours@graph") if i in d
               and d[i].get("fits", True) and (i != "ours@glue" or d[i]["peak_gib"] <= limit)]
        best = max(fit) / theirs if theirs and fit else float("nan")
        lines.append(f"| {B} × {S} | " + " | ".join(cells) + f" | {like:.2f}× | {best:.2f}× |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

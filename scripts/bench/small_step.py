"""Small micro-batches: where the host's time goes, and what CUDA graphs of whole micro-batches give (a script).

    python scripts/bench/small_step.py --out DIR                 (one H200: Wan 1.3B, ~5 minutes)
    python scripts/bench/small_step.py --tiny --out /tmp/small   (a tiny config on the CPU: checks the script)
    python scripts/bench/small_step.py --model mmdit --out DIR   (the MMDiT at HunyuanVideo width, 2 + 4 blocks)

Columns, side by side in one process (forward + backward, random weights, bf16 parameters and gradients, every
block recomputed, as scripts/bench/step.py's like-for-like columns):
  diffusers      diffusers' WanTransformer3DModel with gradient checkpointing, its default attention
  eager          our model with the fused ops (fused_ops=triton), eager
  graph          the same micro-batch captured once as a CUDA graph and replayed (training/cuda_graphs.py)
  compile        eager with every block compiled (block.compile(), inductor), where --compile asks for it
Per shape and column: wall ms (CUDA events, median), device ms (the profiler's kernel time in one rep), GPU busy
(device ÷ wall), tokens/s, peak GiB. Also: graph vs eager gradients after one micro-batch (relative error per
parameter, the worst), the graphs' memory pool, and at the first shape the host profile of one eager micro-batch
by category (Python, autograd, recompute, Triton's launcher, our launchers, aten dispatch, kernel launches,
allocator, syncs) and the optimizer step (AdamW foreach vs fused over fp32 master weights of the same model).
Rows go to OUT/bench_small_step.json; the table is printed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

import torch  # noqa: E402

import harness  # noqa: E402
from harness import sync  # noqa: E402

from training.cuda_graphs import FakeGraphs, MicroBatchGraphs  # noqa: E402

WAN_1P3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
TINY = dict(WAN_1P3B, num_attention_heads=2, attention_head_dim=16, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2)
# (B, latent frames, latent H, latent W): S = F·H/2·W/2
SHAPES = {"1x1560": (1, 1, 60, 104), "4x1560": (4, 1, 60, 104), "1x7800": (1, 5, 60, 104),
          "16x1560": (16, 1, 60, 104), "4x7800": (4, 5, 60, 104), "2x14040": (2, 9, 60, 104),
          "1x32760": (1, 21, 60, 104), "1x75600": (1, 21, 90, 160)}
TINY_SHAPES = {"1x16": (1, 1, 8, 8), "4x16": (4, 1, 8, 8), "1x48": (1, 3, 8, 8)}
TEXT_LEN = 512

# host-profile categories: (category, predicate on (trace category, event name)), first match wins
def _py(pattern: str):
    rx = re.compile(pattern)
    return lambda c, n: c == "python_function" and rx.search(n) is not None


HOST_KINDS = (
    ("host syncs", lambda c, n: c == "cuda_runtime" and "Synchronize" in n),
    ("kernel launches (driver)", lambda c, n: c == "cuda_runtime" and "Launch" in n),
    ("allocator (driver)", lambda c, n: c == "cuda_runtime" and any(k in n for k in ("Malloc", "Free", "HostAlloc"))),
    ("copies", lambda c, n: c == "cuda_runtime" and "Memcpy" in n),
    ("CUDA runtime, other", lambda c, n: c == "cuda_runtime"),
    ("main thread waiting for the backward", _py(r"run_backward")),
    ("Triton's launcher", _py(r"(^|/)triton/|^<string>\(\d+\): dynamic_func|native_specialize_impl|"
                              r"<built-in function launch>")),
    ("our ops' host code (Python)", _py(r"(^|/)ops/\w+\.py")),
    ("model Python", _py(r"(^|/)models/\w+\.py")),
    ("checkpoint recompute (Python)", _py(r"torch/utils/checkpoint\.py")),
    ("autograd (Python)", _py(r"torch/autograd/|torch/_tensor\.py")),
    ("nn.Module calls", _py(r"torch/nn/modules/")),
    ("custom-op dispatch (Python)", _py(r"torch/_ops\.py|torch/_library/")),
    ("calls into C++ (bindings)", _py(r"^<built-in")),
    ("other Python", lambda c, n: c == "python_function"),
    ("autograd engine (C++)", lambda c, n: c == "cpu_op" and n.startswith("autograd::")),
    ("aten dispatch (C++)", lambda c, n: c == "cpu_op"),
)


def inputs(cfg, shape, dev, dtype, seed=0):
    x, t, ctx = harness.wan_inputs(cfg, shape, dev, dtype, TEXT_LEN, seed)
    return {"x": x, "t": t, "ctx": ctx}


def timed(run, dev, warmup, reps) -> dict:
    times, peak = harness.time_reps(run, dev, warmup, reps)
    reserved = torch.cuda.memory_reserved(dev) / 2**30 if dev.type == "cuda" else float("nan")
    return {"ms": round(harness.median(times), 2), "reps_ms": [round(t, 1) for t in times],
            "peak_gib": round(peak, 2), "reserved_gib": round(reserved, 2)}


def device_ms(run, dev) -> float:
    """Kernel time of one run (the profiler's CUDA activity), ms."""
    if dev.type != "cuda":
        return float("nan")
    from torch.profiler import ProfilerActivity, profile

    run()
    sync(dev)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        sync(dev)
    return round(sum(e.device_time_total for e in prof.key_averages()
                     if not e.key.startswith(("cudaDeviceSynchronize", "ProfilerStep"))) / 1e3, 2)


def host_profile(run, dev, out_dir) -> dict:
    """Self time per host category in one eager micro-batch, by thread (main, autograd's device thread), from a
    profiler trace with Python's tracer on (which inflates Python: compare `profiled_wall_ms` with the column's)."""
    from torch.profiler import ProfilerActivity, profile

    run()
    sync(dev)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=acts, with_stack=True) as prof:
        run()
        sync(dev)
    wall = (time.perf_counter() - t0) * 1e3
    path = os.path.join(out_dir, "host_trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    os.remove(path)
    by_thread = defaultdict(list)
    for e in events:
        if e.get("cat") in ("python_function", "cpu_op", "cuda_runtime", "user_annotation"):
            by_thread[(e["pid"], e["tid"])].append(e)
    cats, launches, names = defaultdict(float), 0, defaultdict(float)
    per_thread = {}  # thread → {category: ms}
    for tid, evs in by_thread.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        self_us = [e["dur"] for e in evs]
        stack = []
        for i, e in enumerate(evs):  # subtract each event's duration from its innermost enclosing event
            while stack and evs[stack[-1]]["ts"] + evs[stack[-1]]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                self_us[stack[-1]] -= e["dur"]
            stack.append(i)
        mine = defaultdict(float)
        for e, us in zip(evs, self_us):
            c, n = e.get("cat"), e.get("name", "")
            kind = next((k for k, match in HOST_KINDS if match(c, n)), "other")
            cats[kind] += max(us, 0) / 1e3
            mine[kind] += max(us, 0) / 1e3
            names[f"{kind} | {n[:100]}"] += max(us, 0) / 1e3
            launches += c == "cuda_runtime" and "Launch" in n
        per_thread[str(tid[1])] = {k: round(v, 1) for k, v in sorted(mine.items(), key=lambda kv: -kv[1]) if v >= 0.5}
    return {"profiled_wall_ms": round(wall, 1), "kernel_launches": launches,
            "by_category_ms": {k: round(v, 1) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            "by_thread_ms": per_thread,
            "top_self_ms": {k: round(v, 1) for k, v in sorted(names.items(), key=lambda kv: -kv[1])[:25]}}


def kernels(run, dev, top=12) -> dict:
    """The run's kernels by device time: {name: [ms, launches]}, the largest first."""
    if dev.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    run()
    sync(dev)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        sync(dev)
    rows = sorted(((e.key[:80], e.device_time_total / 1e3, e.count) for e in prof.key_averages()
                   if e.device_time_total and not e.key.startswith("cudaDeviceSynchronize")), key=lambda r: -r[1])
    return {k: [round(ms, 2), n] for k, ms, n in rows[:top]}


def optimizer_ms(model, dev, reps=5) -> dict:
    """AdamW over fp32 copies of the model's parameters with random gradients: foreach (the default) vs fused."""
    if dev.type != "cuda":
        return {}
    out = {}
    params = [torch.nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    for kind in ("foreach", "fused"):
        opt = torch.optim.AdamW(params, lr=1e-4, **{kind: True})
        out[kind] = timed(opt.step, dev, 2, reps)["ms"]
        del opt
    shadow = [p.detach().clone() for p in params]
    out["ema_loop"] = timed(lambda: [s.lerp_(p, 1e-4) for s, p in zip(shadow, params)], dev, 1, reps)["ms"]
    out["ema_foreach"] = timed(lambda: torch._foreach_lerp_(shadow, list(params), 1e-4), dev, 1, reps)["ms"]
    out["zero_grad_foreach"] = timed(lambda: torch._foreach_zero_([p.grad for p in params]), dev, 1, reps)["ms"]
    del params, shadow
    torch.cuda.empty_cache()
    return out


MMDIT = dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=2,
             num_single_layers=4, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
             rope_axes_dim=(16, 56, 56), text_embed_dim=4096, pooled_projection_dim=768, guidance_embeds=True)
MMDIT_TINY = dict(MMDIT, num_attention_heads=2, attention_head_dim=16, rope_axes_dim=(4, 6, 6), text_embed_dim=32,
                  pooled_projection_dim=16, num_layers=1, num_single_layers=1, num_refiner_layers=1)
MMDIT_TEXT, MMDIT_VALID = 256, 120  # padded text positions, of which each sample's caption fills the first 120


def build_wan(tiny: bool, dev, diffusers: bool, trainer: bool = False):
    """(ours, theirs or None, ours_fn, theirs_fn, make_inputs): Wan at bf16 parameters, every block recomputed;
    trainer=True: ours in the trainer's precision instead (fp32 master weights under bf16 autocast)."""
    from models.wan import WanTransformer

    cfg = TINY if tiny else WAN_1P3B
    torch.manual_seed(0)
    ours = WanTransformer(**cfg, adaln_backend="auto")
    theirs = None
    if diffusers:
        from diffusers import WanTransformer3DModel

        theirs = WanTransformer3DModel(**cfg)
        theirs.load_state_dict(ours.state_dict(), strict=True)
        theirs.to(dev, torch.bfloat16).enable_gradient_checkpointing()
    ours.to(dev)
    if not trainer:
        ours._cast_params(torch.bfloat16)
    ours.fused_ops = "triton" if dev.type == "cuda" else "torch"
    ours.set_activation_checkpointing(True)
    cast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)) \
        if trainer and dev.type == "cuda" else contextlib.nullcontext

    def ours_fn(x):
        with cast():
            y = ours(x["x"], x["t"], x["ctx"])
        y.float().pow(2).mean().backward()

    def theirs_fn(x):
        out = theirs(hidden_states=x["x"], timestep=x["t"], encoder_hidden_states=x["ctx"], return_dict=False)[0]
        out.float().pow(2).mean().backward()

    dtype = torch.float32 if trainer else torch.bfloat16
    return ours, theirs, ours_fn, theirs_fn, lambda shape: inputs(cfg, shape, dev, dtype), cfg


def build_mmdit(tiny: bool, dev, diffusers: bool):
    """The same for the MMDiT at HunyuanVideo width (2 dual + 4 single blocks), fp32 master weights under bf16
    autocast (weight-cast cache off, as graphs need), no recompute; the caption's span is found on the host."""
    from models.mmdit import MMDiT, text_span

    cfg = MMDIT_TINY if tiny else MMDIT
    torch.manual_seed(0)
    ours = MMDiT(**cfg).to(dev)
    theirs = None
    if diffusers:
        from diffusers import HunyuanVideoTransformer3DModel

        theirs = HunyuanVideoTransformer3DModel(**cfg)
        theirs.load_state_dict(ours.state_dict())
        theirs.to(dev)
    cast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)) if dev.type == "cuda" \
        else contextlib.nullcontext
    span = {}

    def make(shape):
        B, F, H, W = shape
        g = torch.Generator().manual_seed(0)
        mask = (torch.arange(MMDIT_TEXT)[None] < MMDIT_VALID).expand(B, -1).contiguous()
        span["now"] = text_span(mask)
        x = {"x": torch.randn(B, 16, F, H, W, generator=g), "t": torch.full((B,), 500.0),
             "ctx": torch.randn(B, MMDIT_TEXT, cfg["text_embed_dim"], generator=g), "mask": mask,
             "pooled": torch.randn(B, cfg["pooled_projection_dim"], generator=g), "g": torch.full((B,), 6000.0)}
        return {k: v.to(dev) for k, v in x.items()}

    def ours_fn(x):
        with cast():
            y = ours(x["x"], x["t"], x["ctx"], encoder_attention_mask=x["mask"], pooled_projections=x["pooled"],
                     guidance=x["g"], text_span=span["now"])
        y.float().pow(2).mean().backward()

    def theirs_fn(x):
        with cast():
            y = theirs(x["x"], x["t"], x["ctx"], x["mask"], x["pooled"], guidance=x["g"], return_dict=False)[0]
        y.float().pow(2).mean().backward()

    return ours, theirs, ours_fn, theirs_fn, make, cfg


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_out(ap, "small_step")
    ap.add_argument("--model", default="wan", choices=("wan", "mmdit", "wan-trainer"),
                    help="wan-trainer: our Wan in the trainer's precision (fp32 master weights, bf16 autocast)")
    ap.add_argument("--tiny", action="store_true", help="tiny config and shapes (checks the script on a CPU)")
    ap.add_argument("--shapes", default=None, help="comma-separated shape names (default: the three small ones)")
    ap.add_argument("--columns", default="diffusers,eager,graph", help="diffusers,eager,graph,compile")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--no-profile", action="store_true", help="skip the host profile and the optimizer timing")
    ap.add_argument("--kernels", default="4x1560", help="shapes whose kernels are listed, eager and graph")
    ap.add_argument("--quick-over", type=int, default=20000, help="micro-batches of more tokens: warm-up 1, "
                    "2 reps, no kernel profile, no gradient check")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    table = TINY_SHAPES if args.tiny else SHAPES
    names = args.shapes.split(",") if args.shapes else list(table)[:3]
    columns = args.columns.split(",")
    os.makedirs(args.out, exist_ok=True)
    build = {"wan": build_wan, "mmdit": build_mmdit,
             "wan-trainer": lambda *a: build_wan(*a, trainer=True)}[args.model]
    ours, theirs, ours_fn, theirs_fn, make_inputs, cfg = build(args.tiny, dev, "diffusers" in columns)
    params = [p for p in ours.parameters()]
    for p in params:  # graphs accumulate into gradients that exist before capture; eager does the same here
        p.grad = torch.zeros_like(p)
    meta = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "model": args.model,
            "config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()}}
    rows = []
    attention = contextlib.nullcontext
    if args.model == "mmdit" and dev.type == "cuda":  # cuDNN's SDPA backward fails on this model (mmdit_h200.md)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        attention = lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,  # noqa: E731
                                         SDPBackend.MATH])
    attention().__enter__()

    graphs = (MicroBatchGraphs if dev.type == "cuda" else FakeGraphs)(dev)
    for name in names:
        shape = table[name]
        B, F, H, W = shape
        S = F * H * W // 4
        x = make_inputs(shape)
        runs = {}
        if theirs is not None:
            theirs.to(dev)
            runs["diffusers"] = lambda: theirs_fn(x)
        runs["eager"] = lambda: ours_fn(x)
        runs["graph"] = lambda: graphs.run(name, B * S, ours_fn, x)
        if "compile" in columns:
            runs["compile"] = lambda: ours_fn(x)
        for col in columns:
            if col == "compile":
                for block in ours.blocks:
                    block.compile()
            big = B * S > args.quick_over  # long micro-batches: fewer reps, no kernel-time profile
            try:
                row = {"shape": name, "B": B, "S": S, "column": col,
                       **timed(runs[col], dev, 1 if big else args.warmup, 2 if big else args.reps)}
                row["device_ms"] = float("nan") if big else device_ms(runs[col], dev)
                row["gpu_busy"] = round(row["device_ms"] / row["ms"], 3) if dev.type == "cuda" and not big else None
                row["tokens_per_s"] = round(B * S / row["ms"] * 1e3, 1)
                if col == "graph":
                    row["pool_gib"] = round(graphs.stats.pool_bytes.get(name, 0) / 2**30, 2)
            except Exception as e:  # noqa: BLE001 - a column that fails is a result
                row = {"shape": name, "column": col, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            if col == "compile":
                for block in ours.blocks:
                    block._compiled_call_impl = None
            rows.append(row)
            print(json.dumps(row), flush=True)
        if theirs is not None:
            theirs.to("cpu")
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        if B * S > args.quick_over:
            continue
        # gradients of one micro-batch, graph replay against eager (both start from zero), and eager against
        # itself: the run-to-run spread of bf16 kernels whose reductions are not ordered (atomics)
        grads = {}
        for col in ("eager", "graph", "eager_again"):
            torch._foreach_zero_([p.grad for p in params])
            runs[col.replace("_again", "")]()
            sync(dev)
            grads[col] = [p.grad.float().clone() for p in params]
        for other in ("graph", "eager_again"):
            err = [((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(grads[other], grads["eager"])]
            meta.setdefault(f"{other}_vs_eager_grad_rel_err", {})[name] = {
                "worst": max(err), "median": sorted(err)[len(err) // 2]}
        print(f"{name}: relative gradient error against eager: graph {meta['graph_vs_eager_grad_rel_err'][name]}, "
              f"eager again {meta['eager_again_vs_eager_grad_rel_err'][name]}", flush=True)
        del grads
        if dev.type == "cuda" and name in (args.kernels or "").split(","):
            meta.setdefault("kernels", {})[name] = {col: kernels(runs[col], dev) for col in ("eager", "graph")}
            print(f"kernels {name}: {json.dumps(meta['kernels'][name])}", flush=True)
        if name == names[0] and not args.no_profile:
            meta["host_profile"] = {name: host_profile(runs["eager"], dev, args.out)}
            print(f"host profile {name}: {json.dumps(meta['host_profile'][name])}", flush=True)
    meta["graph_pool_gib_total"] = round(graphs.pool_gib(), 2)
    if dev.type == "cuda":  # what the graphs hold beside the model: their pool over every captured shape
        sync(dev)
        base = torch.cuda.memory_allocated(dev) / 2**30
        eager_peak = max((r["peak_gib"] for r in rows if r.get("column") == "eager" and "peak_gib" in r), default=0)
        meta["memory"] = {"base_gib": round(base, 2), "graphs_total_gib": round(base + graphs.pool_gib(), 2),
                          "eager_peak_gib": eager_peak, "graph_pool_gib_by_shape":
                          {str(k): round(v / 2**30, 2) for k, v in graphs.stats.pool_bytes.items()}}
        print(f"memory: {meta['memory']}", flush=True)
    meta["graph_stats"] = {"captured": graphs.stats.captured, "replays": graphs.stats.replays,
                           "failed": graphs.stats.failed}
    if not args.no_profile:
        meta["optimizer_ms"] = optimizer_ms(ours, dev)
        print(f"optimizer: {meta['optimizer_ms']}", flush=True)
    with open(os.path.join(args.out, "bench_small_step.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(render(rows))


def render(rows) -> str:
    by = defaultdict(dict)
    for r in rows:
        if "error" not in r:
            by[r["shape"]][r["column"]] = r
    cols = [c for c in ("diffusers", "eager", "graph", "compile") if any(c in d for d in by.values())]
    lines = ["| shape | " + " | ".join(f"{c} ms (device ms, busy, GiB)" for c in cols) + " | graph ÷ diffusers |",
             "|---|" + "---|" * (len(cols) + 1)]
    for shape, d in by.items():
        cells = [f"{d[c]['ms']:.1f} ({d[c]['device_ms']}, {d[c]['gpu_busy']}, {d[c]['peak_gib']})" if c in d else "—"
                 for c in cols]
        ratio = d["diffusers"]["ms"] / d["graph"]["ms"] if "diffusers" in d and "graph" in d else float("nan")
        lines.append(f"| {shape} | " + " | ".join(cells) + f" | {ratio:.2f}× |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

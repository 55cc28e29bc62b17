"""Wan 2.1 training step, ours against diffusers' WanTransformer3DModel, at the shapes of issue 9 (a script, not a test).

    python scripts/bench_step.py --out results/step_h200            (one H200: 1.3B config, ~6 minutes)
    python scripts/bench_step.py --tiny --out /tmp/step_cpu          (a tiny config on the CPU: checks the script)

Side by side in one run, forward + backward, no optimizer, random weights (the same in both models):
  diffusers@default   diffusers' model, bf16 parameters and gradients, gradient checkpointing, its default attention
  diffusers@fast      the same at the fastest attention backend found (`set_attention_backend`)
  ours@fast           our model, bf16 parameters and gradients (the fp32 modules of diffusers' list kept fp32), full
                      checkpointing, the same attention backend (torch's sdpa_kernel)
  ours@glue           the same with model.glue_backend=triton (fused gated residual, q/k RMSNorm-RoPE)
  ours@trainer        our trainer's precision: fp32 master weights under bf16 autocast (not held to memory targets)
  ours@policy         (b): no recompute where the step fits under diffusers@fast's peak memory at that shape, else full
Reported per shape: ms (median), tokens/s, model-FLOPs utilisation (CONTRACTS §9), peak GiB. Then the longest
sequence: B = 1 at 480p (latent 60×104), latent frames raised until ours@fast's peak exceeds diffusers@fast's peak
at S = 32760. Before timing, the two models' outputs are compared on one small input (bf16 tolerance).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from scheduling.metrics import model_flops  # noqa: E402

WAN_1P3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
TINY = dict(WAN_1P3B, num_attention_heads=2, attention_head_dim=16, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2)
# (B, latent frames, latent H, latent W): S = F·H/2·W/2 → 1560, 7800, 14040, 32760, 75600
SHAPES = ((16, 1, 60, 104), (4, 5, 60, 104), (2, 9, 60, 104), (1, 21, 60, 104), (1, 21, 90, 160))
TINY_SHAPES = ((4, 1, 8, 8), (2, 3, 8, 8), (1, 5, 8, 12))
SDPA = {"native": None, "_native_flash": "FLASH_ATTENTION", "_native_efficient": "EFFICIENT_ATTENTION",
        "_native_cudnn": "CUDNN_ATTENTION", "_native_math": "MATH"}
TEXT_LEN = 512


def sdpa_context(backend: str):
    """Our model calls torch's SDPA: pin it to the kernel diffusers' backend of the same name uses."""
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    name = SDPA[backend]
    return nullcontext() if name is None else sdpa_kernel([getattr(SDPBackend, name)])


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_step(run, dev, warmup: int, reps: int) -> tuple[float, float]:
    """(median ms, peak GiB) of run() = one forward + backward."""
    for _ in range(warmup):
        run()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for _ in range(reps):
        sync(dev)
        t0 = time.perf_counter()
        run()
        sync(dev)
        times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else float("nan")
    return sorted(times)[len(times) // 2], peak


def inputs(cfg, shape, dev, dtype, seed=0):
    B, F, H, W = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, cfg["in_channels"], F, H, W, generator=g).to(dev, dtype)
    t = (torch.rand(B, generator=g) * 1000).to(dev)
    ctx = torch.randn(B, TEXT_LEN, cfg["text_dim"], generator=g).to(dev, dtype)
    return x, t, ctx


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


def step_fn(model, x, t, ctx, diffusers: bool, autocast: bool, dev):
    def run():
        for p in model.parameters():
            p.grad = None
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            if diffusers:
                out = model(hidden_states=x, timestep=t, encoder_hidden_states=ctx, return_dict=False)[0]
            else:
                out = model(x, t, ctx)
        out.float().pow(2).mean().backward()
    return run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny config and shapes (checks the script on a CPU)")
    ap.add_argument("--backends", default="_native_flash,_native_cudnn,_native_efficient",
                    help="candidates for the fastest attention backend (the first shape decides)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--max-frames", type=int, default=41, help="upper bound of the longest-sequence search")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg, shapes = (TINY, TINY_SHAPES) if args.tiny else (WAN_1P3B, SHAPES)
    if dev.type == "cpu":
        torch.set_num_threads(max(1, os.cpu_count() // 2))
    theirs, ours = build(cfg, dev)
    p_matmul, layers, dim = ours.num_matmul_params(), cfg["num_layers"], cfg["num_attention_heads"] * cfg["attention_head_dim"]
    rows, meta = [], {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                      "torch": torch.__version__, "config": {k: list(v) if isinstance(v, tuple) else v
                                                             for k, v in cfg.items()},
                      "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}

    def record(impl, shape, ms, peak, **extra):
        B, F, H, W = shape
        S = F * (H // 2) * (W // 2)
        flops = model_flops(B, S, TEXT_LEN, p_matmul, layers, dim)
        row = dict(impl=impl, B=B, S=S, ms=round(ms, 2), tokens_per_s=round(B * S / ms * 1e3, 1),
                   mfu=round(flops / (ms * 1e-3) / (args.peak_tflops * 1e12), 4) if dev.type == "cuda" else None,
                   peak_gib=round(peak, 2), **extra)
        rows.append(row)
        print(json.dumps(row), flush=True)
        return row

    # parity on a small input, bf16 parameters on both sides (diffusers' .to(bf16) casts every module)
    theirs.to(torch.bfloat16)
    ours._cast_params(torch.bfloat16)
    x, t, ctx = inputs(cfg, shapes[0][:1] + (1, 8, 8) if not args.tiny else shapes[0], dev, torch.bfloat16)
    with torch.no_grad():
        a = ours(x, t, ctx).float()
        b = theirs(hidden_states=x, timestep=t, encoder_hidden_states=ctx, return_dict=False)[0].float()
    meta["parity_rel_err_bf16"] = float((a - b).norm() / b.norm())
    print(f"parity: ours vs diffusers, bf16, relative error {meta['parity_rel_err_bf16']:.2e}", flush=True)

    theirs.enable_gradient_checkpointing()
    ours.set_activation_checkpointing(True)
    # the fastest backend: timed on the middle shape with diffusers' model
    probe = shapes[len(shapes) // 2]
    best, best_ms = "native", math.inf
    for backend in ["native"] + [b for b in args.backends.split(",") if b]:
        try:
            theirs.set_attention_backend(backend)
            ms, _ = time_step(step_fn(theirs, *inputs(cfg, probe, dev, torch.bfloat16), True, False, dev), dev, 1, 1)
        except Exception as e:  # noqa: BLE001 - a backend this machine lacks is reported, not fatal
            print(f"backend {backend}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
            continue
        print(f"backend {backend}: {ms:.1f} ms at S={probe[1] * probe[2] * probe[3] // 4}", flush=True)
        if ms < best_ms:
            best, best_ms = backend, ms
    meta["fast_backend"] = best

    diff_peak = {}
    for shape in shapes:
        args_ = inputs(cfg, shape, dev, torch.bfloat16)
        theirs.set_attention_backend("native")
        record("diffusers@default", shape, *time_step(step_fn(theirs, *args_, True, False, dev), dev,
                                                      args.warmup, args.reps))
        theirs.set_attention_backend(best)
        r = record("diffusers@fast", shape, *time_step(step_fn(theirs, *args_, True, False, dev), dev,
                                                       args.warmup, args.reps))
        diff_peak[shape] = r["peak_gib"]
        with sdpa_context(best):
            ours.set_activation_checkpointing(True)
            record("ours@fast", shape, *time_step(step_fn(ours, *args_, False, False, dev), dev, args.warmup,
                                                  args.reps))
            ours.glue_backend = "triton" if dev.type == "cuda" else "torch"  # + fused residual, q/k norm-RoPE
            record("ours@glue", shape, *time_step(step_fn(ours, *args_, False, False, dev), dev, args.warmup,
                                                  args.reps))
            ours.glue_backend = "torch"
            ours.set_activation_checkpointing(False)  # (b): recompute only where memory demands it
            try:
                ms, peak = time_step(step_fn(ours, *args_, False, False, dev), dev, args.warmup, args.reps)
                fits = dev.type != "cuda" or peak <= diff_peak[shape]
            except torch.OutOfMemoryError:
                fits = False
            if not fits:
                ours.set_activation_checkpointing(True)
                ms, peak = time_step(step_fn(ours, *args_, False, False, dev), dev, args.warmup, args.reps)
            record("ours@policy", shape, ms, peak, recompute=not fits)
    theirs.to("cpu")
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    # ours@trainer: fp32 master weights, bf16 autocast (a third column, not held to the memory targets)
    ours.float()
    ours._cast_params(torch.float32)
    ours.set_activation_checkpointing(True)
    with sdpa_context(best):
        for shape in shapes:
            record("ours@trainer", shape, *time_step(step_fn(ours, *inputs(cfg, shape, dev, torch.float32), False,
                                                             True, dev), dev, args.warmup, args.reps))
    # the longest sequence under diffusers@fast's peak at S = 32760 (B = 1, 480p)
    ours._cast_params(torch.bfloat16)
    ref_shape = shapes[3] if not args.tiny else shapes[-1]
    limit = diff_peak[ref_shape]
    longest = None
    if dev.type == "cuda":
        with sdpa_context(best):
            for frames in range(ref_shape[1], args.max_frames + 1, 2):
                shape = (1, frames, ref_shape[2], ref_shape[3])
                try:
                    _, peak = time_step(step_fn(ours, *inputs(cfg, shape, dev, torch.bfloat16), False, False, dev),
                                        dev, 0, 1)
                except torch.OutOfMemoryError:
                    break
                if peak > limit:
                    break
                longest = dict(frames=frames, S=frames * ref_shape[2] * ref_shape[3] // 4, peak_gib=round(peak, 2))
                print(f"longest so far: {longest}", flush=True)
    meta["longest"] = {"limit_gib": limit, "at_diffusers_S": ref_shape[1] * ref_shape[2] * ref_shape[3] // 4,
                       "ours": longest}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_step.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(table(rows))


def table(rows) -> str:
    by = {}
    for r in rows:
        by.setdefault(r["S"], {})[r["impl"]] = r
    impls = ["diffusers@default", "diffusers@fast", "ours@fast", "ours@glue", "ours@policy", "ours@trainer"]
    lines = ["| S | " + " | ".join(f"{i} ms (tok/s, GiB)" for i in impls) + " | ours@fast / diffusers@fast |",
             "|---|" + "---|" * (len(impls) + 1)]
    for S, d in sorted(by.items()):
        cells = [f"{d[i]['ms']:.0f} ({d[i]['tokens_per_s']:.0f}, {d[i]['peak_gib']})" if i in d else "—"
                 for i in impls]
        ratio = (d["ours@fast"]["tokens_per_s"] / d["diffusers@fast"]["tokens_per_s"]
                 if "ours@fast" in d and "diffusers@fast" in d else float("nan"))
        lines.append(f"| {S} | " + " | ".join(cells) + f" | {ratio:.2f}× |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

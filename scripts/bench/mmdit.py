"""Ours vs diffusers at HunyuanVideo width (D 3072, 24×128, mlp 4, text 4096/pooled 768), 2 dual + 4 single blocks,
fwd+bwd under bf16 autocast with fp32 master weights, 480p 33f latent (N 14040) + 256 padded text tokens.

    python scripts/bench/mmdit.py [--out DIR]      (GPU: results/mmdit_h200.md)

Columns: ours@flash and ours@auto (model.attention_backend: auto is cuDNN on Hopper; padded text whose valid tokens
are a prefix runs as key lengths, without a mask: models/layers.py KeyLengths); diffusers@default (its native
backend: torch's choice) and diffusers@cudnn (set_attention_backend("_native_cudnn"); diffusers always passes a mask,
so cuDNN gets one: a failure or a non-finite loss is recorded, not fatal). The text lengths are the same at every
repetition, so cuDNN's plan for each shape is built once, in the untimed steps: a run whose lengths change step by
step also pays a plan build at each new length.

A benchmark script, never a test: prints rows and writes bench_mmdit.json into --out (default runs/bench/mmdit).
Each row: the median of 3 timed steps after 2 untimed ones, and the peak GiB over all five.

    python scripts/bench/mmdit.py --vary-text 24 [--impls ours@auto,diffusers@cudnn]    (bench_mmdit_vary_text.json)

Text lengths that change every step, as captions do in training: B = 1, the same video, one prompt length a step
drawn (seeded) from 16 … 256 of the 256 padded positions. Ours trims the text to its valid tokens, so each new
length is a new joint length N + r (and refiner length r): a new shape for cuDNN, which builds and caches a plan
per shape (torch keeps them for the process). diffusers always runs the 256 positions with a mask: one shape. Each
impl runs the draws twice in the same order after one warm-up step at length 256: the first pass meets every length
for the first time, the second finds every plan built. first − second, per length new to the first pass, is what a
new length costs. `TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1` in the environment (torch's experimental ragged path, read
once per process) is recorded in the rows' meta; run the script once with it and once without to compare.
`--device cpu --tiny` runs the same steps on a two-block model of small width (a dry run of the code path).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

import harness  # noqa: E402

CFG = dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=2,
           num_single_layers=4, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
           rope_axes_dim=(16, 56, 56), text_embed_dim=4096, pooled_projection_dim=768, guidance_embeds=True)
TINY = dict(CFG, num_attention_heads=2, attention_head_dim=16, num_layers=1, num_single_layers=1, num_refiner_layers=1,
            rope_axes_dim=(4, 6, 6), text_embed_dim=32, pooled_projection_dim=8)
CASES = ((1, [120], "B1 text 120/256"), (2, [200, 90], "B2 ragged 200,90/256"))  # (B, valid text tokens, label)
VARY_IMPLS = ("ours@auto", "ours@flash", "diffusers@cudnn", "diffusers@default")
dev = "cuda"


def inputs(B, lengths, frames=9, h=60, w=104, L=256, cfg=CFG):
    import torch

    g = torch.Generator().manual_seed(0)
    kw = dict(timestep=torch.full((B,), 500.0),
              encoder_hidden_states=torch.randn(B, L, cfg["text_embed_dim"], generator=g),
              encoder_attention_mask=torch.arange(L)[None] < torch.tensor(lengths)[:, None],
              pooled_projections=torch.randn(B, cfg["pooled_projection_dim"], generator=g),
              guidance=torch.full((B,), 1000.0))
    x = torch.randn(B, 16, frames, h, w, generator=g)
    return x.to(dev), {k: v.to(dev) for k, v in kw.items()}


def bench(model, x, kw, reps=3, **extra):
    import torch

    torch.cuda.reset_peak_memory_stats()
    times = [step_ms(model, x, kw, **extra) for _ in range(reps + 2)][2:]
    return harness.median(times), torch.cuda.max_memory_allocated() / 2**30


def step_ms(model, x, kw, **extra) -> float:
    """One forward + backward (bf16 autocast, grads cleared first), the device synchronised around it: wall ms."""
    import torch

    for p in model.parameters():
        p.grad = None
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        y = model(x, **kw, **extra)
    loss = (y[0] if isinstance(y, tuple) else y).float().square().mean()
    loss.backward()
    if not torch.isfinite(loss):
        raise FloatingPointError("non-finite loss")
    sync()
    return (time.perf_counter() - t0) * 1e3


def text_draws(n: int, seed: int = 0, lo: int = 16, hi: int = 256) -> list[int]:
    """n prompt lengths, seeded, uniform over lo … hi (repeats allowed, as in a corpus)."""
    import random

    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


def vary_text(model, lengths: list[int], video: dict, cfg: dict, **extra) -> dict:
    """Both passes of the draws (module docstring): per-step ms of each, and what a new length costs. One input,
    its text mask cut to each length (the inputs are made before the timing)."""
    import torch

    x, kw = inputs(1, [256], cfg=cfg, **video)
    masks = {r: kw["encoder_attention_mask"] & (torch.arange(256, device=x.device) < r) for r in set(lengths)}
    step_ms(model, x, kw, **extra)  # warm-up: the CUDA context, cuBLAS, length 256
    passes = [[step_ms(model, x, dict(kw, encoder_attention_mask=masks[r]), **extra) for r in lengths]
              for _ in range(2)]
    new = [i for i, r in enumerate(lengths) if r != 256 and r not in lengths[:i]]  # first sight in the first pass
    first, second = passes
    extra_ms = [first[i] - second[i] for i in new]
    return dict(lengths=lengths, first_ms=[round(t, 2) for t in first], second_ms=[round(t, 2) for t in second],
                new_lengths=len(new), first_total_ms=round(sum(first), 1), second_total_ms=round(sum(second), 1),
                ms_per_new_length=round(harness.median(extra_ms), 2) if extra_ms else 0.0,
                median_second_ms=round(harness.median(second), 2))


def main_vary_text(args) -> None:
    import torch
    from diffusers import HunyuanVideoTransformer3DModel

    from models.layers import apply_attention_backend
    from models.mmdit import MMDiT

    cfg = TINY if args.tiny else CFG
    video = dict(frames=3, h=8, w=8) if args.tiny else {}
    lengths = text_draws(args.vary_text)
    impls = args.impls.split(",")
    for impl in impls:
        if impl not in VARY_IMPLS:
            raise SystemExit(f"--impls: {impl!r} is not one of {VARY_IMPLS}")
    avoid = os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE")
    meta = dict(harness.run_meta(torch.device(dev)), TORCH_CUDNN_SDPA_AVOID_RECOMPILE=avoid, tiny=args.tiny)
    name = "bench_mmdit_vary_text" + ("_avoid_recompile" if avoid == "1" else "")
    torch.manual_seed(0)
    ours = MMDiT(**cfg).to(dev)
    rows = []

    def row(impl, run):
        try:
            rows.append(dict(impl=impl, case=f"B1 text varying 16-256, {len(lengths)} steps", **run()))
        except (RuntimeError, FloatingPointError) as e:  # a backend that fails here is a result
            rows.append(dict(impl=impl, error=f"{type(e).__name__}: {str(e)[:160]}"))
        print({k: v for k, v in rows[-1].items() if k not in ("lengths", "first_ms", "second_ms")}, flush=True)
        harness.write_rows(args.out, name, meta, rows, csv_too=False)  # after each impl: a run cut short keeps it

    for impl in (i for i in impls if i.startswith("ours@")):
        apply_attention_backend(ours, impl.split("@")[1])
        row(impl, lambda: vary_text(ours, lengths, video, cfg))
    if any(i.startswith("diffusers@") for i in impls):
        sd = {k: v.detach().cpu() for k, v in ours.state_dict().items()}
        del ours
        ref = HunyuanVideoTransformer3DModel(**cfg)
        ref.load_state_dict(sd)
        ref = ref.to(dev)
        for impl in (i for i in impls if i.startswith("diffusers@")):
            ref.set_attention_backend("_native_cudnn" if impl == "diffusers@cudnn" else "native")
            row(impl, lambda: vary_text(ref, lengths, video, cfg, return_dict=False))
    print(f"wrote {os.path.join(args.out, name)}.json")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    harness.add_out(ap, "mmdit")
    ap.add_argument("--vary-text", type=int, default=0, metavar="N",
                    help="N steps of text lengths that change every step (module docstring), instead of the cases")
    ap.add_argument("--impls", default=",".join(VARY_IMPLS), help=f"--vary-text: which of {','.join(VARY_IMPLS)}")
    ap.add_argument("--device", default="cuda", help="cuda (default), or cpu for a dry run with --tiny")
    ap.add_argument("--tiny", action="store_true", help="a small model and video: a dry run of the code path")
    args = ap.parse_args(argv)
    global dev
    dev = args.device
    if args.vary_text:
        return main_vary_text(args)

    import torch
    from diffusers import HunyuanVideoTransformer3DModel

    from models.mmdit import MMDiT

    rows = []
    torch.manual_seed(0)
    ours = MMDiT(**CFG).to(dev)
    print("params", sum(p.numel() for p in ours.parameters()) / 1e9, "B; matmul/token",
          ours.num_matmul_params() / 1e9)
    from models.layers import apply_attention_backend

    def row(impl, label, run):
        try:
            ms, gib = run()
            rows.append(dict(impl=impl, case=label, ckpt=False, ms=round(ms, 1), peak_gib=round(gib, 2)))
        except (RuntimeError, FloatingPointError) as e:  # a backend that fails here is a result
            rows.append(dict(impl=impl, case=label, ckpt=False, error=f"{type(e).__name__}: {str(e)[:160]}"))
            torch.cuda.empty_cache()
        print(rows[-1], flush=True)

    for B, lengths, label in CASES:
        x, kw = inputs(B, lengths)
        ours.set_activation_checkpointing(False)
        for backend in ("flash", "auto"):
            apply_attention_backend(ours, backend)
            row(f"ours@{backend}", label, lambda: bench(ours, x, kw))
    sd = {k: v.detach().cpu() for k, v in ours.state_dict().items()}
    del ours
    torch.cuda.empty_cache()

    ref = HunyuanVideoTransformer3DModel(**CFG)
    ref.load_state_dict(sd)
    ref = ref.to(dev)
    for B, lengths, label in CASES:
        x, kw = inputs(B, lengths)
        ref.disable_gradient_checkpointing()
        for impl, backend in (("diffusers@default", "native"), ("diffusers@cudnn", "_native_cudnn")):
            ref.set_attention_backend(backend)
            row(impl, label, lambda: bench(ref, x, kw, return_dict=False))
    meta = dict(harness.run_meta(torch.device(dev)), gpu=torch.cuda.get_device_name())
    print(f"wrote {harness.write_rows(args.out, 'bench_mmdit', meta, rows, csv_too=False)}.json")


if __name__ == "__main__":
    main()

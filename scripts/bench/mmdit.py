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
CASES = ((1, [120], "B1 text 120/256"), (2, [200, 90], "B2 ragged 200,90/256"))  # (B, valid text tokens, label)
dev = "cuda"


def inputs(B, lengths, frames=9, h=60, w=104, L=256):
    import torch

    g = torch.Generator().manual_seed(0)
    kw = dict(timestep=torch.full((B,), 500.0), encoder_hidden_states=torch.randn(B, L, 4096, generator=g),
              encoder_attention_mask=torch.arange(L)[None] < torch.tensor(lengths)[:, None],
              pooled_projections=torch.randn(B, 768, generator=g), guidance=torch.full((B,), 1000.0))
    x = torch.randn(B, 16, frames, h, w, generator=g)
    return x.to(dev), {k: v.to(dev) for k, v in kw.items()}


def bench(model, x, kw, reps=3, **extra):
    import torch

    params = [p for p in model.parameters()]
    times = []
    torch.cuda.reset_peak_memory_stats()
    for i in range(reps + 2):
        for p in params:
            p.grad = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = model(x, **kw, **extra)
        y = y[0] if isinstance(y, tuple) else y
        loss = y.float().square().mean()
        loss.backward()
        if not torch.isfinite(loss):
            raise FloatingPointError("non-finite loss")
        torch.cuda.synchronize()
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    return harness.median(times), torch.cuda.max_memory_allocated() / 2**30


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    harness.add_out(ap, "mmdit")
    args = ap.parse_args(argv)

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

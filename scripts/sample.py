"""Generate clips with a model and write them as mp4: validation samples during training, and a command-line tool.

    python scripts/sample.py runs/NAME --out samples/NAME [--step N] [--ema] [--prompt "a red fox" ...]
                             [--seeds 0 1] [--steps 30] [--guidance 5] [--shift 3] [--bucket v480_33f] [KEY=VALUE ...]
    python scripts/sample.py /models/Wan2.1-T2V-1.3B-Diffusers --out samples/base conf=wan21_1p3b \
        data.encoders.vae=/models/Wan2.1-T2V-1.3B-Diffusers data.encoders.text_encoder=/models/... --prompt "..."
    python scripts/sample.py /models/Wan2.1-T2V-1.3B-Diffusers --lora runs/NAME/lora --out ... conf=wan21_1p3b ...

SOURCE is a training checkpoint (`step_N/`, or a run folder: its newest checkpoint, or `--step N`) whose stored
config names the model, LoRA, VAE, text encoder, buckets and corpus; or a diffusers folder (a transformer folder or
a pipeline root holding transformer/), with the config composed from conf/ and the KEY=VALUE overrides (as train.py
takes them; `conf=NAME` picks a preset). For a checkpoint the overrides apply on top of its stored config.

Prompts: `--prompt` captions are encoded with `data.encoders`' text encoder (tiny when no folder is given) and
guided against its empty caption; without captions the text of `sample.val_prompts` held-out corpus samples is
used with the corpus' stored empty-prompt embedding. One clip per (prompt, seed), decoded with `data.encoders`' VAE
(which must be the one that made the corpus' latents), written as OUT/p{i}_s{seed}.mp4 with OUT/samples.json.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import torch  # noqa: E402

from models.sampler import SampleConfig  # noqa: E402
from training.cli import run_main  # noqa: E402
from training.sampling import (encode_prompts, held_out_prompts, load_source, pick_bucket, render,  # noqa: E402
                               run_vae)
from training.step import autocast_for  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("source", help="a step_N checkpoint, a run folder (its newest checkpoint) or a diffusers folder")
    ap.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides (conf=NAME picks a preset)")
    ap.add_argument("--out", required=True, help="folder for the mp4 files and samples.json")
    ap.add_argument("--step", type=int, default=None, help="with a run folder: this checkpoint, not the newest")
    ap.add_argument("--ema", action="store_true", help="sample with the checkpoint's EMA weights")
    ap.add_argument("--lora", default=None, help="a LoRA adapter (folder or .safetensors) to add to the model")
    ap.add_argument("--prompt", action="append", default=None, help="a caption (repeatable)")
    ap.add_argument("--val-prompts", type=int, default=None, help="without --prompt: this many held-out texts")
    ap.add_argument("--seeds", type=int, nargs="+", default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--guidance", type=float, default=None)
    ap.add_argument("--shift", type=float, default=None)
    ap.add_argument("--bucket", default=None, help="a data.buckets name: frames × height × width of the clips")
    ap.add_argument("--fps", type=float, default=None)
    ap.add_argument("--device", default="auto", help="auto (cuda when present) | cpu | cuda:N")
    args = ap.parse_args(argv)

    model, cfg = load_source(args.source, args.overrides, args.step, args.ema, args.lora)
    given = {"prompts": args.prompt, "val_prompts": args.val_prompts, "seeds": args.seeds, "steps": args.steps,
             "guidance": args.guidance, "shift": args.shift, "bucket": args.bucket, "fps": args.fps}
    scfg = replace(getattr(cfg, "sample", None) or SampleConfig(), **{k: v for k, v in given.items() if v is not None})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else \
        torch.device(args.device)
    model.to(device)
    shape = pick_bucket(cfg, scfg.bucket).latent_shape(cfg.model.in_channels)
    if scfg.prompts:
        texts, empty = encode_prompts(cfg, scfg.prompts, device)
    else:
        texts, empty = held_out_prompts(cfg, scfg.val_prompts)
    vae = run_vae(cfg, device)  # data.encoders.vae, or the shapes corpus' PCA VAE
    paths = render(model, vae, texts, empty, scfg, shape, args.out, autocast_for(device, cfg.model.precision), device,
                   scfg.prompts or None)
    for path in paths.values():
        print(path)


if __name__ == "__main__":
    run_main(main)

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
import contextlib
import json
import os
import sys
from dataclasses import asdict, replace
from typing import Callable, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------ prompts and shape
def pick_bucket(cfg, name: Optional[str]):
    """The data.buckets entry clips are generated at: `name`, or the video bucket with the fewest tokens."""
    from data.buckets import bucket_table

    table = bucket_table(cfg.data.buckets, patch=cfg.model.patch)
    if name is not None:
        if name not in table:
            raise ValueError(f"sample.bucket={name!r} is not in data.buckets ({sorted(table)})")
        return table[name]
    videos = [b for b in table.values() if not b.is_image] or list(table.values())
    return min(videos, key=lambda b: b.tokens)


def encode_prompts(cfg, prompts: Sequence[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(texts [B, text_len, C], empty [text_len, C]) from captions, with data.encoders' text encoder (then freed)."""
    from data.batch import pad_text
    from data.encoders import TEXT_ENCODERS

    enc = TEXT_ENCODERS[cfg.data.encoders.text](cfg.data.encoders, cfg.model.text_dim, device)
    embeds = enc.encode(list(prompts) + [""]).per_sample()
    del enc
    padded = [pad_text(e.float().cpu(), cfg.model.text_len)[0] for e in embeds]
    return torch.stack(padded[:-1]), padded[-1]


def val_texts(val_batches, n: int) -> torch.Tensor:
    """The text [n, text_len, C] of the first n held-out samples (already padded by the loader)."""
    texts = torch.cat([b.text for b in val_batches])[:n]
    if len(texts) < n:
        raise ValueError(f"sample.val_prompts={n} but the corpus holds only {len(texts)} held-out samples")
    return texts


# ---------------------------------------------------------------------------------------------- rendering
def render(model, vae, texts: torch.Tensor, empty: torch.Tensor, scfg, latent_shape: Sequence[int], out_dir: str,
           autocast: Callable = contextlib.nullcontext, device: Optional[torch.device] = None,
           captions: Optional[Sequence[str]] = None) -> dict[str, str]:
    """One clip per (text, seed) → `out_dir/p{i}_s{seed}.mp4`; {name: path}. With vae=None (FSDP ranks other than
    0) the latents are computed — every rank must run each forward — and nothing is written."""
    from data.video_io import write_mp4
    from models.sampler import decode_latents, sample_latents

    jobs = [(i, seed) for i in range(len(texts)) for seed in scfg.seeds]
    z = sample_latents(model, texts[[i for i, _ in jobs]], empty, latent_shape, [s for _, s in jobs], scfg.steps,
                       scfg.guidance, scfg.shift, autocast, device)
    if vae is None:
        return {}
    os.makedirs(out_dir, exist_ok=True)
    paths, record = {}, {}
    for k, (i, seed) in enumerate(jobs):
        name = f"p{i}_s{seed}"
        paths[name] = write_mp4(os.path.join(out_dir, name + ".mp4"), decode_latents(vae, z[k:k + 1])[0], scfg.fps)
        record[name] = {"prompt": captions[i] if captions else f"val text {i}", "seed": seed}
    with open(os.path.join(out_dir, "samples.json"), "w") as f:
        json.dump({"clips": record, "sample": asdict(scfg), "latent_shape": list(latent_shape)}, f, indent=1)
    return paths


class ValidationSampler:
    """What train.py calls every `train.sample_every` steps: fixed prompts and seeds → run_dir/samples/step_N/*.mp4.

    Built once: the prompts' text embeddings (captions encoded on every rank, or held-out texts), the latent shape
    of `sample.bucket`, and the VAE (rank 0 only). Calling it runs the sampler on every rank (FSDP2 forwards are
    collective) and returns {"samples/<name>": mp4 path} on rank 0, {} elsewhere.
    """

    def __init__(self, cfg, ctx, val_batches, empty_text: torch.Tensor, scfg=None):
        from data.batch import pad_text
        from data.encoders import build_vae

        self.scfg = scfg or cfg.sample
        self.run_dir, self.device = cfg.run_dir, ctx.device
        self.shape = pick_bucket(cfg, self.scfg.bucket).latent_shape(cfg.model.in_channels)
        if self.scfg.prompts:
            self.texts, self.empty = encode_prompts(cfg, self.scfg.prompts, ctx.device)
        else:
            self.texts = val_texts(val_batches, self.scfg.val_prompts)
            self.empty = pad_text(empty_text.float(), cfg.model.text_len)[0]
        self.vae = build_vae(cfg.data.encoders, cfg.model.in_channels, ctx.device).model if ctx.is_main else None

    def __call__(self, model, step: int, autocast: Callable = contextlib.nullcontext) -> dict[str, str]:
        out = os.path.join(self.run_dir, "samples", f"step_{step:06d}")
        paths = render(model, self.vae, self.texts, self.empty, self.scfg, self.shape, out, autocast, self.device,
                       self.scfg.prompts or None)
        return {f"samples/{name}": path for name, path in paths.items()}


# ------------------------------------------------------------------------------------------------ loading
def compose(overrides: Sequence[str] = ()):
    """The typed config from conf/ and Hydra-style overrides, as train.py composes it."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from omegaconf import OmegaConf

    from training.config import load_config

    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base=None):
        raw = OmegaConf.to_container(hydra_compose(config_name="train", overrides=list(overrides)), resolve=True)
    raw.pop("hydra", None)
    return load_config(raw)


def checkpoint_config(path: str, overrides: Sequence[str] = ()):
    """The typed config stored with a checkpoint, with dotted KEY=VALUE overrides merged on top."""
    import yaml
    from omegaconf import OmegaConf

    from training.config import load_config

    if any(o.split("=", 1)[0] in ("conf", "+conf") for o in overrides):
        raise ValueError("conf=NAME selects a preset when composing; a checkpoint brings its own config "
                         "(override single keys instead)")
    with open(os.path.join(path, "config.yaml")) as f:
        raw = OmegaConf.create(yaml.safe_load(f))
    if overrides:
        raw = OmegaConf.merge(raw, OmegaConf.from_dotlist([o.lstrip("+") for o in overrides]))
    return load_config(OmegaConf.to_container(raw, resolve=True))


def find_checkpoint(source: str, step: Optional[int] = None) -> Optional[str]:
    """A checkpoint folder for `source` (a step_N folder or a run folder), or None when it is not one."""
    from training.checkpoint import latest_checkpoint, list_checkpoints

    if os.path.exists(os.path.join(source, "meta.json")):
        return source
    if step is not None:
        found = dict(list_checkpoints(source)).get(step)
        if found is None:
            raise FileNotFoundError(f"{source} holds no complete checkpoint step_{step}")
        return found
    return latest_checkpoint(source)


def load_checkpoint_model(path: str, cfg, ema: bool = False) -> torch.nn.Module:
    """The model a checkpoint holds: built from its config (with its LoRA), then every tensor the checkpoint has.

    A checkpoint that lacks the base weights (adapter-only) takes them from `model.pretrained`. `ema` loads the EMA
    weights (of the trainable parameters) instead of the raw ones.
    """
    from models.build import build_model
    from models.lora import apply_finetune
    from training.checkpoint import read_metadata, safe_load

    stored = set(read_metadata(path).state_dict_metadata)
    has_base = any(k.startswith("model.") and "lora_" not in k for k in stored)  # else adapter-only
    if not has_base and not cfg.model.pretrained:
        raise ValueError(f"{path} holds no base weights and its config names no model.pretrained folder")
    model = apply_finetune(build_model(cfg.model if not has_base else replace(cfg.model, pretrained=None)), cfg.model)
    params = dict(model.named_parameters())
    state = {"model": {n: p.detach() for n, p in params.items() if f"model.{n}" in stored}}  # loads in place
    if ema:  # EMA covers the trainable parameters only (the adapter, under LoRA): overlay it on the raw weights
        state["ema"] = {n: torch.empty_like(p) for n, p in params.items() if f"ema.{n}" in stored}
        if not state["ema"]:
            raise ValueError(f"{path} holds no EMA weights (train with optim.ema_decay set)")
    safe_load(state, path)
    with torch.no_grad():
        for n, t in state.get("ema", {}).items():
            params[n].copy_(t)
    return model


def load_diffusers_model(folder: str, cfg):
    """(model, cfg with its model.* taken from the folder's config.json) from a diffusers transformer folder."""
    from models.wan import WanTransformer

    sub = "transformer" if os.path.isdir(os.path.join(folder, "transformer")) else None
    model = WanTransformer.from_pretrained(folder, subfolder=sub, adaln_backend=cfg.model.adaln_backend)
    fields = {k: v for k, v in model.config.items() if k in cfg.model.diffusers_kwargs()}
    return model, replace(cfg, model=replace(cfg.model, **fields, pretrained=None))


def load_source(source: str, overrides: Sequence[str] = (), step: Optional[int] = None, ema: bool = False,
                lora: Optional[str] = None):
    """(model on the CPU in eval mode, typed config) for a checkpoint, run folder or diffusers folder."""
    from models.lora import has_lora, load_lora

    ckpt = find_checkpoint(source, step) if os.path.isdir(source) else None
    if ckpt is not None:
        cfg = checkpoint_config(ckpt, overrides)
        model = load_checkpoint_model(ckpt, cfg, ema)
    elif os.path.exists(os.path.join(source, "config.json")) or os.path.isdir(os.path.join(source, "transformer")):
        if ema:
            raise ValueError("--ema needs a training checkpoint; a diffusers folder holds one set of weights")
        model, cfg = load_diffusers_model(source, compose(overrides))
    else:
        raise FileNotFoundError(f"{source} is neither a checkpoint, a run folder holding one, nor a diffusers folder")
    if lora:
        if has_lora(model):
            raise ValueError(f"{source} already carries a LoRA adapter; --lora adds one only to a model without")
        load_lora(model, lora)
    return model.eval(), cfg


def main(argv=None) -> None:
    from models.sampler import SampleConfig
    from training.step import autocast_for

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
    from data.encoders import build_vae

    vae = build_vae(cfg.data.encoders, cfg.model.in_channels, device).model
    paths = render(model, vae, texts, empty, scfg, shape, args.out, autocast_for(device, cfg.model.precision), device,
                   scfg.prompts or None)
    for path in paths.values():
        print(path)


def held_out_prompts(cfg, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(texts, empty) of the first n held-out samples of the corpus the config names, as training reads them."""
    from data.batch import pad_text
    from data.buckets import bucket_table
    from data.loader import Loader, open_corpus

    corpus = open_corpus(cfg.data, bucket_table(cfg.data.buckets, patch=cfg.model.patch), cfg.model.in_channels, cfg.model.text_dim,
                         cfg.train.seed)
    loader = Loader(corpus, cfg.model.text_len, 0.0, cfg.train.seed, 0)
    try:
        return val_texts(loader.val_batches(), n), pad_text(corpus.empty_text.float(), cfg.model.text_len)[0]
    finally:
        loader.close()


if __name__ == "__main__":
    main()

"""Generating clips with a model and writing them as mp4: validation samples during training, and the sampler
behind scripts/sample.py.

A source is a training checkpoint (`step_N/`, or a run folder: its newest checkpoint, or a given step) whose stored
config names the model, LoRA, VAE, text encoder, buckets and corpus; or a diffusers folder (a transformer folder or
a pipeline root holding transformer/), with the config composed from conf/ and KEY=VALUE overrides.

Prompts: captions are encoded with `data.encoders`' text encoder and guided against its empty caption; without
captions the text of `sample.val_prompts` held-out corpus samples is used with the corpus' stored empty-prompt
embedding. One clip per (prompt, seed), decoded with `data.encoders`' VAE (which must be the one that made the
corpus' latents), written as OUT/p{i}_s{seed}.mp4 with OUT/samples.json.
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, replace
from typing import Callable, Optional, Sequence

import torch

from training.config import compose_config
from training.load import checkpoint_config, find_checkpoint, load_checkpoint_model


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
        model, cfg = load_diffusers_model(source, compose_config(overrides))
    else:
        raise FileNotFoundError(f"{source} is neither a checkpoint, a run folder holding one, nor a diffusers folder")
    if lora:
        if has_lora(model):
            raise ValueError(f"{source} already carries a LoRA adapter; --lora adds one only to a model without")
        load_lora(model, lora)
    return model.eval(), cfg


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

"""Generating clips with a model and writing them as mp4: validation samples during training, and the sampler
behind scripts/sample.py.

A source is a training checkpoint (`step_N/`, or a run folder: its newest checkpoint, or a given step) whose stored
config names the model, LoRA, VAE, text encoder, buckets and corpus; or a diffusers folder (a transformer folder or
a pipeline root holding transformer/), with the config composed from conf/ and KEY=VALUE overrides.

Prompts: captions are encoded with `data.encoders`' text encoder and guided against its empty caption; without
captions the text of `sample.val_prompts` held-out corpus samples is used with the corpus' stored empty-prompt
embedding. One clip per (prompt, seed), decoded with the run's VAE (`run_vae`: `data.encoders.vae`, or the shapes
corpus' own PCA VAE; it must be the one that made the corpus' latents), written as OUT/p{i}_s{seed}.mp4 with
OUT/samples.json. During training the first and the latest sampled steps are set side by side in
run_dir/samples/contact_sheet.png (`contact_sheet`): a row per clip, evenly spaced frames of each step.

`describe_encoders` says which VAE and text encoder a run uses and for what, and warns when random ones (the tiny
encoders of `data.encoders.vae/text_encoder: null`) meet raw media or a model too large to be a test.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import re
from dataclasses import asdict, replace
from typing import Callable, Optional, Sequence

import torch

from data.pca_vae import is_pca_vae
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


# ---------------------------------------------------------------------------------------------- encoders
LARGE_MODEL_PARAMS = 50e6  # above this a model is no test: random encoders with it are a mistake


def shapes_corpus_root(cfg) -> Optional[str]:
    """The shapes corpus folder when the config trains on it (no data.index/urls/sources, data.synthetic.kind
    shapes), else None."""
    d = cfg.data
    if d.synthetic.kind != "shapes" or d.index or d.urls is not None or d.sources:
        return None
    from data.buckets import bucket_table
    from data.shapes import shapes_root

    return shapes_root(d, bucket_table(d.buckets, patch=cfg.model.patch), cfg.model.in_channels, cfg.model.text_dim)


def run_vae(cfg, device: torch.device):
    """The VAE that decodes this run's latents: `data.encoders.vae`, else the shapes corpus' PCA VAE, else the tiny
    Wan VAE with seeded random weights."""
    from data.encoders import build_vae

    root = None if cfg.data.encoders.vae else shapes_corpus_root(cfg)
    if root is not None:
        from data.pca_vae import PCAVAE

        return PCAVAE.load(os.path.join(root, "vae"), device)
    return build_vae(cfg.data.encoders, cfg.model.in_channels, device)


def describe_encoders(cfg, corpus, num_params: int) -> tuple[str, Optional[str]]:
    """(the log line naming the VAE and text encoder and what each does in this run, a warning or None).

    Random encoders — the tiny ones that `data.encoders.vae: null` and `text_encoder: null` build with seeded random
    weights — are fine for tests, but raw media encoded by them train a model on noise, and a large model (over
    LARGE_MODEL_PARAMS) trained or sampled with them is a mistake: both get one warning line."""
    enc = cfg.data.encoders
    shapes = shapes_corpus_root(cfg)
    if enc.vae:
        vae, vae_random = f"{'PCA' if is_pca_vae(enc.vae) else 'Wan'} VAE {enc.vae}", False
    elif shapes:
        vae, vae_random = f"PCA VAE fitted to the shapes corpus ({shapes}/vae)", False
    else:
        vae, vae_random = "tiny Wan VAE with random weights (data.encoders.vae=null)", True
    if enc.text == "words":
        text, text_random = "bag of words (data.encoders.text=words, no weights)", False
    elif enc.text_encoder and (enc.text != "llama_clip" or enc.text_encoder_2):
        text, text_random = f"{enc.text} {enc.text_encoder}", False
    else:
        text, text_random = f"tiny {enc.text} with random weights (data.encoders.text_encoder=null)", True
    raw = any(ix.meta.get("kind") == "raw" for ix in corpus.indexes)
    made = [ix.meta.get("encoders") for ix in corpus.indexes if ix.meta.get("kind") != "raw"]
    made_random = any(isinstance(m, dict) and any(isinstance(m.get(k), dict) and "tiny" in m[k]
                                                  for k in ("vae", "text_encoder")) for m in made)
    uses = (["encode the raw media"] if raw else []) + (["decode samples"] if cfg.train.sample_every else [])
    line = f"encoders: VAE {vae}; text {text}; " + (
        f"they {' and '.join(uses)}" if uses else "unused (the corpus holds latents and text embeddings)")
    random = [n for n, r in (("VAE", vae_random), ("text encoder", text_random)) if r]
    warning = None
    if random and raw:
        warning = f"raw media are encoded by a random {' and a random '.join(random)}"
    elif num_params > LARGE_MODEL_PARAMS and made_random:
        warning = f"a {num_params / 1e6:.0f}M-parameter model trains on latents that a random VAE or text encoder made"
    elif num_params > LARGE_MODEL_PARAMS and random and cfg.train.sample_every:
        warning = f"a {num_params / 1e6:.0f}M-parameter model is sampled with a random {' and a random '.join(random)}"
    if warning:
        warning += (": the model learns noise and its samples are noise. Set data.encoders.vae and "
                    "data.encoders.text_encoder to a Wan 2.1 diffusers folder (docs/gpu.md, 'Real weights')")
    return line, warning


def log_encoders(cfg, corpus, num_params: int, log) -> None:
    line, warning = describe_encoders(cfg, corpus, num_params)
    log.info(line)
    if warning:
        log.warning("RANDOM ENCODERS: %s", warning)


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

        self.scfg = scfg or cfg.sample
        self.run_dir, self.device = cfg.run_dir, ctx.device
        self.shape = pick_bucket(cfg, self.scfg.bucket).latent_shape(cfg.model.in_channels)
        if self.scfg.prompts:
            self.texts, self.empty = encode_prompts(cfg, self.scfg.prompts, ctx.device)
        else:
            self.texts = val_texts(val_batches, self.scfg.val_prompts)
            self.empty = pad_text(empty_text.float(), cfg.model.text_len)[0]
        self.vae = run_vae(cfg, ctx.device) if ctx.is_main else None

    def __call__(self, model, step: int, autocast: Callable = contextlib.nullcontext) -> dict[str, str]:
        """Clips of this step; on rank 0 also the contact sheet of the first sampled step against this one."""
        root = os.path.join(self.run_dir, "samples")
        paths = render(model, self.vae, self.texts, self.empty, self.scfg, self.shape,
                       os.path.join(root, f"step_{step:06d}"), autocast, self.device, self.scfg.prompts or None)
        out = {f"samples/{name}": path for name, path in paths.items()}
        steps = sorted(glob.glob(os.path.join(root, "step_*", "samples.json")))
        if paths and len(steps) > 1:
            out["samples/contact_sheet"] = contact_sheet([os.path.dirname(steps[0]), os.path.dirname(steps[-1])],
                                                         os.path.join(root, "contact_sheet.png"))
        return out


def contact_sheet(step_dirs: Sequence[str], out_png: str, frames: int = 5, scale: int = 2) -> str:
    """A PNG setting the clips of sampled steps side by side: a row per clip (its prompt on the left), for each
    step `frames` evenly spaced frames (first to last), each pixel `scale`× wide and tall; 256 colours, so that
    noise compresses (a sheet stays well under 500 KB). Reads the mp4s and samples.json that `render` wrote; a clip
    missing from a step is left grey. Returns out_png."""
    import numpy as np
    from PIL import Image, ImageDraw

    from data.video_io import read_mp4

    runs = []
    for d in step_dirs:
        with open(os.path.join(d, "samples.json")) as f:
            runs.append(json.load(f)["clips"])
    names = list(runs[-1])
    clips = [[read_mp4(os.path.join(d, n + ".mp4"))[0] if n in r else None for n in names]
             for d, r in zip(step_dirs, runs)]
    F, H, W, _ = next(c for row in clips for c in row if c is not None).shape
    pick = np.linspace(0, F - 1, min(frames, F)).round().astype(int)
    tile_w, tile_h, label_w, head_h, gap, sep = W * scale, H * scale, 200, 24, 16, 4
    block_w = len(pick) * (tile_w + sep)
    sheet = Image.new("RGB", (label_w + len(step_dirs) * (block_w + gap), head_h + len(names) * (tile_h + sep)),
                      (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for b, d in enumerate(step_dirs):
        x0 = label_w + b * (block_w + gap)
        base = os.path.basename(os.path.normpath(d))
        title = f"step {int(base[5:])}" if re.fullmatch(r"step_\d+", base) else base
        draw.text((x0 + 4, 6), f"{title}: frames {', '.join(map(str, pick))}", fill=(0, 0, 0))
        for r, clip in enumerate(clips[b]):
            y0 = head_h + r * (tile_h + sep)
            for k, f in enumerate(pick):
                tile = (np.full((H, W, 3), 128, np.uint8) if clip is None or f >= len(clip) else clip[f])
                tile = Image.fromarray(tile).resize((tile_w, tile_h), Image.NEAREST)
                sheet.paste(tile, (x0 + k * (tile_w + sep), y0))
    for r, n in enumerate(names):
        draw.text((6, head_h + r * (tile_h + sep) + tile_h // 2 - 6), runs[-1][n]["prompt"][:36], fill=(0, 0, 0))
    tmp = out_png + ".tmp.png"
    sheet.quantize(256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE).save(tmp, optimize=True)
    os.replace(tmp, out_png)
    return out_png


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

"""The demo corpus: coloured shapes moving on a plain background, with captions that say what moves where, encoded
by a PCA VAE fitted to its own pixels (data/pca_vae.py) — a corpus a CPU model learns visibly in minutes
(`python train.py conf=demo`, `data.synthetic.kind: shapes`).

Each sample is one shape (COLOURS × SHAPES) of half-size r = RADIUS·min(H, W): a square of side 2r, or a triangle
pointing up in the same 2r × 2r box (apex at the top centre, base along the bottom). Their silhouettes differ at the
scale the model draws at (the VAE's 8×8 patches, the model's 16×16-pixel tokens): the triangle has half the square's
area and a point on top. A square and a circle do not: after a 1000-step CPU run they were alike blobs. A clip moves
the shape in one of DIRECTIONS across half the frame at a constant speed, starting where the direction puts it (a
shape moving right starts left of centre) with a jitter of up to JITTER across the motion and 0.3·JITTER along it; an
image holds it still at a jittered spot near the centre. Edges are anti-aliased (pixel coverage), so the PCA sees
smooth patches. Captions: "a red square moving right" (clips), "a red triangle" (images). Every colour, shape and
direction is thus fixed by a word of the caption, and the position nearly so: what a small model has to learn is the
drawing and the motion.

Written in the latent shard schema of data/synthetic.py (contracts §4): the pixels are drawn, the PCA VAE is fitted
to all of them (channels = the model's in_channels) and saved in `vae/` beside the index, the latents are its
normalised encoding, the text the configured text encoder's (`data.encoders.text`; `words` is learnable from few
samples). The corpus is generated into data.cache_dir on first use, keyed by a hash of its spec.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Mapping

import numpy as np

from data.buckets import Bucket
from data.config import synthetic_mix

COLOURS = {"red": (225, 45, 45), "green": (50, 190, 70), "blue": (55, 105, 235), "yellow": (235, 210, 40)}
SHAPES = ("square", "triangle")
DIRECTIONS = {"right": (1, 0), "left": (-1, 0), "down": (0, 1), "up": (0, -1)}
BACKGROUND = (24, 24, 32)
RADIUS, TRAVEL = 0.24, 0.5   # of min(H, W); of the frame's extent along the motion
JITTER = 0.06                # of the frame's extent: how far a start may lie from where its direction puts it
VERSION = 4                  # bump when the drawing or captions change: the cache key changes with it


def caption(colour: str, shape: str, direction: str | None) -> str:
    return f"a {colour} {shape}" + (f" moving {direction}" if direction else "")


def draw(colour: str, shape: str, direction: str | None, frames: int, height: int, width: int,
         rng: np.random.Generator) -> np.ndarray:
    """uint8 [frames, height, width, 3]: the shape at its jittered start, moved along `direction` (None: still)."""
    r = RADIUS * min(height, width)
    d = np.array(DIRECTIONS[direction] if direction else (0, 0), np.float64)  # (x, y)
    jitter = rng.uniform(-JITTER, JITTER, 2)
    jitter[d != 0] *= 0.3                                  # smaller along the motion than across it
    start = 0.5 + jitter - d * TRAVEL / 2                  # the centre at t = 0, in fractions of (W, H)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32) + 0.5
    out = np.empty((frames, height, width, 3), np.uint8)
    fg, bg = np.array(COLOURS[colour], np.float32), np.array(BACKGROUND, np.float32)
    for f in range(frames):
        t = f / max(1, frames - 1)
        cx, cy = (start + d * TRAVEL * t) * (width, height)
        if shape == "square":
            cover = np.clip(r - np.abs(xx - cx) + 0.5, 0, 1) * np.clip(r - np.abs(yy - cy) + 0.5, 0, 1)
        else:  # the triangle: apex (cx, cy − r), base from (cx − r, cy + r) to (cx + r, cy + r)
            side = ((yy - cy + r) / 2 - np.abs(xx - cx)) * (2 / np.sqrt(5))  # signed distance to a slanted side
            cover = np.clip(np.minimum(side, r - (yy - cy)) + 0.5, 0, 1)
        out[f] = np.round(bg + (fg - bg) * cover[..., None]).astype(np.uint8)
    return out


def draw_sample(bucket: Bucket, rng: np.random.Generator) -> tuple[np.ndarray, str]:
    """(pixels, caption) of one random sample for the bucket: a clip moves, an image is still."""
    colour = list(COLOURS)[rng.integers(len(COLOURS))]
    shape = SHAPES[rng.integers(len(SHAPES))]
    direction = None if bucket.is_image else list(DIRECTIONS)[rng.integers(len(DIRECTIONS))]
    return draw(colour, shape, direction, bucket.frames, bucket.height, bucket.width, rng), \
        caption(colour, shape, direction)


def parse_caption(text: str) -> tuple[str, str, str | None]:
    """(colour, shape, direction or None) from a caption this module wrote (the inverse of `caption`)."""
    words = text.split()
    return words[1], words[2], " ".join(words[4:]) or None


def _counts(shares, total: int) -> np.ndarray:
    """Samples per bucket proportional to the shares, by largest remainder (so small corpora keep the mix)."""
    p = np.asarray(shares, np.float64) / np.sum(shares) * total
    counts = np.floor(p).astype(int)
    counts[np.argsort(-(p - counts))[: total - counts.sum()]] += 1
    return counts


def write_shapes_corpus(root: str, buckets: Mapping[str, Bucket], mix: Mapping[str, float], num_samples: int,
                        num_val: int, latent_channels: int, text_dim: int, encoders, seed: int = 0,
                        samples_per_shard: int = 64, dtype: str = "float32") -> str:
    """Draw the samples, fit and save the PCA VAE (root/vae/), write the latent shards and the index."""
    import torch

    from data.encoders import TEXT_ENCODERS
    from data.index import EMPTY_TEXT_FILE, SampleIndex, npy_bytes
    from data.pca_vae import fit_pca_vae
    from data.precompute import _write_shard
    names = [n for n in mix if mix[n] > 0]
    rng = np.random.default_rng(seed)
    order = rng.permutation(np.repeat(np.arange(len(names)), _counts([mix[n] for n in names], num_samples + num_val)))
    samples = [draw_sample(buckets[names[b]], np.random.default_rng([seed, i])) for i, b in enumerate(order)]
    vae = fit_pca_vae((px for px, _ in samples), latent_channels)
    vae.save(os.path.join(root, "vae"))
    text = TEXT_ENCODERS[encoders.text](encoders, text_dim, torch.device("cpu"))
    records, shards = [], []
    for j in range(0, len(samples), samples_per_shard):
        chunk, members = samples[j:j + samples_per_shard], []
        embeds = text.encode([c for _, c in chunk]).per_sample()
        for n, ((px, cap), emb) in enumerate(zip(chunk, embeds)):
            i = j + n
            bucket = buckets[names[order[i]]]
            z = vae.encode_u8(torch.from_numpy(px)[None])[0].numpy().astype(dtype)
            key = f"s{i:07d}"
            members.append((key, {"latent.npy": npy_bytes(z), "text.npy": npy_bytes(emb.numpy()),
                                  "json": json.dumps({"caption": cap, "bucket": bucket.name}).encode()}))
            records.append({"key": key, "latent": list(z.shape), "kind": "latent", "bucket": bucket.name,
                            "S": bucket.tokens, "L_text": int(emb.shape[0]),
                            "split": "val" if i >= num_samples else "train"})
        shards.append(f"shard-{len(shards):05d}.tar")
        offsets = _write_shard(os.path.join(root, shards[-1]), members)
        for rec in records[j:]:
            rec["shard"], rec["members"] = shards[-1], {e: list(v) for e, v in offsets[rec["key"]].items()}
    torch.save(text.encode([""]).per_sample()[0], os.path.join(root, EMPTY_TEXT_FILE))
    meta = {"kind": "latent", "latent_channels": latent_channels, "text_dim": text_dim, "writer": "data/shapes.py",
            "vae": "vae", "text_encoder": encoders.text,
            "buckets": {n: {"frames": b.frames, "height": b.height, "width": b.width} for n, b in buckets.items()}}
    SampleIndex(root, meta, records).save()
    return root


def shapes_spec(data_cfg, buckets: Mapping[str, Bucket], latent_channels: int, text_dim: int) -> dict:
    """What fixes the corpus (its cache key): the synthetic settings, the buckets, the widths and the text encoder."""
    from dataclasses import asdict

    syn, enc = data_cfg.synthetic, data_cfg.encoders
    mix = synthetic_mix(dict(syn.mix), list(buckets))  # the shares every synthetic corpus takes, leftovers included
    return {"mix": {n: float(v) for n, v in mix.items()}, "num_samples": syn.num_samples, "num_val": syn.num_val,
            "seed": syn.seed, "samples_per_shard": syn.samples_per_shard, "dtype": syn.dtype,
            "latent_channels": latent_channels, "text_dim": text_dim, "version": VERSION,
            "text": {k: v for k, v in asdict(enc).items() if k in ("text", "text_encoder", "tokenizer", "seed",
                                                                    "tiny_text", "max_text_len", "text_dtype")},
            "buckets": {n: [b.frames, b.height, b.width] for n, b in buckets.items()}}


def shapes_root(data_cfg, buckets: Mapping[str, Bucket], latent_channels: int, text_dim: int) -> str:
    desc = json.dumps(shapes_spec(data_cfg, buckets, latent_channels, text_dim), sort_keys=True, default=str)
    return os.path.join(data_cfg.cache_dir, "shapes-" + hashlib.sha1(desc.encode()).hexdigest()[:12])


def ensure_shapes_corpus(data_cfg, buckets: Mapping[str, Bucket], latent_channels: int, text_dim: int) -> str:
    """The corpus folder for this config under data.cache_dir, written on first use (aside, then renamed)."""
    from data.index import SampleIndex

    root = shapes_root(data_cfg, buckets, latent_channels, text_dim)
    try:
        SampleIndex.load(root)
        return root
    except FileNotFoundError:
        pass
    spec = shapes_spec(data_cfg, buckets, latent_channels, text_dim)
    unknown = set(spec["mix"]) - set(buckets)
    if unknown:
        raise ValueError(f"data.synthetic.mix names buckets {sorted(unknown)} that data.buckets does not define")
    if not any(spec["mix"].values()):
        raise ValueError("data.synthetic.mix gives every bucket a zero share")
    tmp = f"{root}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    write_shapes_corpus(tmp, buckets, {n: spec["mix"][n] for n in spec["mix"]}, spec["num_samples"],
                        spec["num_val"], latent_channels, text_dim, data_cfg.encoders, spec["seed"],
                        spec["samples_per_shard"], spec["dtype"])
    try:
        os.rename(tmp, root)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return root

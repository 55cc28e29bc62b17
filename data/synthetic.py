"""A synthetic corpus of precomputed, normalised latents and text embeddings in WebDataset shards.

The spine trains on it and tests use it; the precompute path of real corpora writes the same schema:
    {key}.latent.npy   [C, F', H', W'] latents, already normalised with the VAE's latents_mean/std
    {key}.text.npy     [L_text, C_text] text-encoder output, unpadded (the Batch pads to the model's text_len)
    {key}.json         {"caption": ..., "bucket": ...}

The samples are learnable on purpose: each belongs to one of `num_classes` classes; a class fixes per-channel
travelling waves (spatial frequency, direction, speed over latent frames) and its caption embedding, and a sample
adds a small phase and amplitude jitter. A model that reads the text can therefore predict x0 well, so the
flow-matching validation loss falls clearly within a few dozen CPU steps.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
import shutil
import tarfile
from typing import Mapping, Optional

import numpy as np
import torch

from data.buckets import Bucket
from data.index import EMPTY_POOLED_FILE, EMPTY_TEXT_FILE, SampleIndex, npy_bytes, tar_members


def _class_params(rng: np.random.Generator, num_classes: int, channels: int, text_dim: int):
    freq = rng.uniform(0.5, 2.5, size=(num_classes, channels, 2)) * rng.choice([-1, 1], size=(num_classes, channels, 2))
    speed = rng.uniform(-0.6, 0.6, size=(num_classes, channels))
    phase = rng.uniform(0, 2 * math.pi, size=(num_classes, channels))
    text = rng.standard_normal((num_classes, text_dim)).astype(np.float32)
    return freq, speed, phase, text


def make_latent(bucket: Bucket, channels: int, cls: int, params, rng: np.random.Generator) -> np.ndarray:
    freq, speed, phase, _ = params
    c, f, h, w = bucket.latent_shape(channels)
    t = np.arange(f)[:, None, None]
    y = np.arange(h)[None, :, None] / h
    x = np.arange(w)[None, None, :] / w
    out = np.empty((c, f, h, w), np.float32)
    jitter = rng.normal(0, 0.3, size=c)
    amp = 1 + rng.normal(0, 0.1, size=c)
    for ch in range(c):
        arg = 2 * math.pi * (freq[cls, ch, 0] * x + freq[cls, ch, 1] * y) + speed[cls, ch] * t + phase[cls, ch]
        out[ch] = math.sqrt(2) * amp[ch] * np.sin(arg + jitter[ch])
    out += rng.normal(0, 0.1, size=out.shape).astype(np.float32)
    return out


def make_text(cls: int, params, rng: np.random.Generator, length: int) -> np.ndarray:
    text = params[3][cls]
    pos = np.sin(np.arange(length)[:, None] * (1 + np.arange(text.shape[0]))[None, :] / text.shape[0])
    return (text[None, :] + 0.3 * pos + 0.05 * rng.standard_normal((length, text.shape[0]))).astype(np.float32)


def write_synthetic_corpus(root: str, buckets: Mapping[str, Bucket], mix: Mapping[str, float], num_samples: int,
                           num_val: int, latent_channels: int, text_dim: int, seed: int = 0,
                           num_classes: int = 8, samples_per_shard: int = 64, text_tokens: tuple[int, int] = (4, 24),
                           dtype: str = "float32", pooled_dim: Optional[int] = None) -> SampleIndex:
    """Write `num_samples` training and `num_val` validation samples, bucket shares given by `mix`.

    pooled_dim: also write a pooled text embedding per sample ({key}.pooled.npy, a fixed projection of the class's
    caption vector) and the empty prompt's (empty_pooled.pt), for models that take one (the MMDiT).
    """
    unknown = set(mix) - set(buckets)
    if unknown:
        raise ValueError(f"data.synthetic.mix names buckets {sorted(unknown)} that data.buckets does not define")
    names = [n for n in mix if mix[n] > 0]
    if not names:
        raise ValueError("data.synthetic.mix gives every bucket a zero share")
    shares = np.array([mix[n] for n in names], dtype=np.float64)
    shares /= shares.sum()
    rng = np.random.default_rng(seed)
    params = _class_params(rng, num_classes, latent_channels, text_dim)
    if pooled_dim:  # drawn from its own generator so corpora without pooled text stay byte-identical
        proj = np.random.default_rng([seed, 3]).standard_normal((text_dim, pooled_dim)) / np.sqrt(text_dim)
    os.makedirs(root, exist_ok=True)
    records, shard_files = [], []
    total = num_samples + num_val
    # bucket counts proportional to shares (largest remainder), so small corpora keep the mix
    counts = np.floor(shares * total).astype(int)
    counts[np.argsort(-(shares * total - counts))[: total - counts.sum()]] += 1
    order = rng.permutation(np.repeat(np.arange(len(names)), counts))
    tar = None
    for i, b_idx in enumerate(order):
        if i % samples_per_shard == 0:
            if tar is not None:
                tar.close()
            shard_files.append(f"shard-{len(shard_files):05d}.tar")
            tar = tarfile.open(os.path.join(root, shard_files[-1]), "w")
        bucket = buckets[names[b_idx]]
        cls = int(rng.integers(num_classes))
        key = f"s{i:07d}"
        latent = make_latent(bucket, latent_channels, cls, params, rng).astype(dtype)
        text = make_text(cls, params, rng, int(rng.integers(text_tokens[0], text_tokens[1] + 1)))
        caption = f"class {cls} {'image' if bucket.is_image else 'video'} {bucket.name}"
        split = "val" if i >= num_samples else "train"
        members = [("latent.npy", npy_bytes(latent)), ("text.npy", npy_bytes(text)),
                   ("json", json.dumps({"caption": caption, "bucket": bucket.name}).encode())]
        if pooled_dim:
            members.append(("pooled.npy", npy_bytes((params[3][cls] @ proj).astype(np.float32))))
        for ext, payload in members:
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
        records.append({"key": key, "shard": shard_files[-1], "kind": "latent", "latent": list(latent.shape),
                        "bucket": bucket.name, "S": bucket.tokens, "L_text": int(text.shape[0]), "split": split})
    tar.close()
    offsets = {}
    for shard in shard_files:
        offsets.update({(shard, k): v for k, v in tar_members(os.path.join(root, shard)).items()})
    for r in records:
        r["members"] = {ext: list(v) for ext, v in offsets[(r["shard"], r["key"])].items()}
    torch.save(torch.from_numpy(0.05 * rng.standard_normal((1, text_dim)).astype(np.float32)),
               os.path.join(root, EMPTY_TEXT_FILE))
    if pooled_dim:
        torch.save(torch.zeros(pooled_dim), os.path.join(root, EMPTY_POOLED_FILE))
    meta = {"kind": "latent", "latent_channels": latent_channels, "text_dim": text_dim, "writer": "data/synthetic.py",
            "buckets": {n: {"frames": b.frames, "height": b.height, "width": b.width} for n, b in buckets.items()}}
    index = SampleIndex(root, meta, records)
    index.save()
    return index


def ensure_synthetic_corpus(cache_dir: str, buckets: Mapping[str, Bucket], **spec) -> SampleIndex:
    """The corpus for this spec under cache_dir, generated on first use (keyed by a hash of the spec)."""
    desc = json.dumps({"buckets": {n: [b.frames, b.height, b.width] for n, b in buckets.items()}, **spec},
                      sort_keys=True, default=str)
    root = os.path.join(cache_dir, "synthetic-" + hashlib.sha1(desc.encode()).hexdigest()[:12])
    try:
        return SampleIndex.load(root)
    except FileNotFoundError:
        pass
    tmp = f"{root}.tmp{os.getpid()}"  # written aside and renamed, so a killed run never leaves half a corpus
    shutil.rmtree(tmp, ignore_errors=True)
    write_synthetic_corpus(tmp, buckets, **spec)
    try:
        os.rename(tmp, root)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return SampleIndex.load(root)

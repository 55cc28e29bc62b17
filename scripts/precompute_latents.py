"""Encode a raw corpus into latent shards of the shared schema (data/synthetic.py, contracts §4), with its index.

    python scripts/precompute_latents.py --out /data/latents -- data.urls='/data/raw/shard-{000..099}.tar' \\
        conf=wan21_8gpu data.encoders.vae=/models/Wan2.1-T2V-1.3B-Diffusers \\
        data.encoders.text_encoder=/models/Wan2.1-T2V-1.3B-Diffusers
    torchrun --nproc_per_node 8 scripts/precompute_latents.py --out /data/latents -- ...   (split across ranks)

Each sample is decoded for its bucket as training decodes it in epoch 0, encoded by the configured VAE and text
encoder, and written with its index; a rerun resumes, on any number of ranks, and samples that fail are counted in
corpus.json's "skipped". The rules (file layout, split across ranks, resumption, what a rerun rewrites):
data/precompute.py.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import json  # noqa: E402
import logging  # noqa: E402

from data.buckets import bucket_table  # noqa: E402
from data.precompute import precompute  # noqa: E402
from training.cli import run_main  # noqa: E402
from training.config import compose_config  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)))
    p.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)))
    p.add_argument("--samples-per-shard", type=int, default=64)
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32", help="stored latent dtype")
    p.add_argument("overrides", nargs="*", help="Hydra overrides: data.urls=..., data=..., model=..., data.encoders.*")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = compose_config(a.overrides)
    if cfg.data.urls is None and cfg.data.index is None:
        print("error: name the raw corpus with data.urls=... (or data.index=<raw index folder>)", file=sys.stderr)
        return 2
    res = precompute(cfg.data, bucket_table(cfg.data.buckets), cfg.model.in_channels, cfg.model.text_dim, cfg.train.seed, a.out, a.rank,
                     a.world_size, a.samples_per_shard, a.dtype)
    print(json.dumps(res))
    return 0

if __name__ == "__main__":
    run_main(main)

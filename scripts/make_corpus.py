"""Write a realistic synthetic raw corpus — mp4 (libx264) videos and jpg images with captions — and its index.

    python scripts/make_corpus.py --out .cache/raw-tiny --images 40 --videos 60
    python scripts/make_corpus.py --out /data/bench480 --images 0 --videos 16 --size 480p --seconds 3 5 \\
        --fps 30 --preset veryfast -- data=wan
    python scripts/make_corpus.py --out .cache/raw-bad --images 8 --videos 8 --bad all

Each sample is a scene: a background gradient between two named colours that drifts, a panning texture (the
"camera"), one to three coloured shapes moving in named directions, and film grain (so the encoder has real work,
as in footage). Its caption says so ("a large red circle moving left and a small blue square moving up over a
green to purple gradient, the camera panning right"). Aspect ratios, durations and frame rates vary per sample;
captions are `txt` or `json` (with fps/size metadata). Videos carry a keyframe every 2 s, as web video does.

`--bad KIND,...` (or `all`) adds one broken sample of each kind, for tests of the skip paths:
    seen by the indexer: corrupt_mp4, zero_frame_video, one_frame_video, undecodable_image, missing_caption,
                         tiny_image, extreme_aspect_image, corrupt_member, truncated_shard, unreadable_shard
    seen at load:        truncated_mp4 (moov in front, data cut), truncated_image
Trailing Hydra overrides (after `--`) choose the bucket table the index is made for (default: conf/data/tiny.yaml).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import time  # noqa: E402

from data.synthetic_raw import ASPECTS, BAD_KINDS, SIZES, write_raw_corpus  # noqa: E402
from training.cli import run_main  # noqa: E402
from training.config import compose_config  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for the shards and their index")
    p.add_argument("--images", type=int, default=40)
    p.add_argument("--videos", type=int, default=60)
    p.add_argument("--size", default="tiny", help=f"short side: {', '.join(SIZES)} or LO-HI pixels")
    p.add_argument("--seconds", type=float, nargs=2, default=(0.6, 2.5), metavar=("MIN", "MAX"))
    p.add_argument("--fps", type=float, nargs="+", default=[12, 15, 24, 25, 30])
    p.add_argument("--samples-per-shard", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default="ultrafast", help="libx264 preset (veryfast for realistic decode cost)")
    p.add_argument("--aspect", nargs="+", default=None, metavar="W:H", help="aspect ratios to draw from "
                   "(default: 16:9 9:16 4:3 3:4 1:1 3:2 2:3 2:1)")
    p.add_argument("--bad", default="", help=f"comma-separated kinds or 'all': {', '.join(BAD_KINDS)}")
    p.add_argument("--workers", type=int, default=1, help="processes for indexing")
    p.add_argument("--no-index", action="store_true")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for the bucket table (e.g. data=wan)")
    a = p.parse_args(argv)
    size = a.size if a.size in SIZES else tuple(int(x) for x in a.size.split("-"))
    bad = BAD_KINDS if a.bad == "all" else tuple(k for k in a.bad.split(",") if k)
    t0 = time.time()
    paths = write_raw_corpus(a.out, a.images, a.videos, size, tuple(a.seconds), tuple(a.fps), a.samples_per_shard,
                             a.seed, bad, a.preset,
                             tuple(tuple(int(x) for x in r.split(":")) for r in a.aspect) if a.aspect else ASPECTS,
                             progress=lambda i, n: print(f"\r{i}/{n} samples", end="", file=sys.stderr))
    total = sum(os.path.getsize(x) for x in paths)
    print(f"\nwrote {len(paths)} shards, {total / 2**20:.1f} MiB, in {time.time() - t0:.1f} s → {a.out}")
    if not a.no_index:
        import logging

        from data.buckets import bucket_table
        from data.raw import index_corpus

        logging.basicConfig(level=logging.INFO, format="%(message)s")
        cfg = compose_config(a.overrides)
        index = index_corpus(paths, a.out, bucket_table(cfg.data.buckets), cfg.data.raw, a.workers)
        print(f"indexed {sum(r['bucket'] is not None for r in index.records)} usable samples "
              f"(skipped: {index.meta['skipped'] or 'none'})")

if __name__ == "__main__":
    run_main(main)

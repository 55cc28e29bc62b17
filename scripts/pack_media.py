"""Pack a folder of images and videos with captions beside them into WebDataset shards that train.py reads.

    python scripts/pack_media.py ~/my_clips --out /data/my_clips
    python scripts/pack_media.py ~/my_clips --out /data/my_clips --maxcount 500 --maxsize-mb 2000 --index -- data=wan
    python train.py data.urls='/data/my_clips/shard-*.tar'

Every image (jpg/jpeg/png/webp) or video (mp4/webm/mkv/mov) under FOLDER, at any depth, becomes one sample with
the caption file of the same name beside it: `trip/beach.mp4` + `trip/beach.txt` (the caption as plain text) or
`trip/beach.json` (an object with a "caption", "text" or "prompt" field). Files are copied byte for byte into
DIR/shard-00000.tar, shard-00001.tar, … (nothing is decoded: it runs at disk speed). Files that make no sample — a
video without a caption, a blank or binary caption, a caption without a video, other files, hidden files, links
leading out of FOLDER — are skipped and counted by reason, each listed in DIR/pack_skipped.jsonl (rules:
data/pack.py). A DIR that already holds shards is refused unless --overwrite (which replaces them).

--index also indexes the shards (data/raw.py: container headers only, in parallel) for the bucket table that the
Hydra overrides after `--` choose (default: conf/data/tiny.yaml), and prints how many samples fit a bucket;
without it, train.py indexes them on first use. Prints the command that trains on the result.
"""
from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from training.cli import run_main  # noqa: E402


def urls_override(out: str) -> str:
    """`data.urls=…` naming DIR/shard-*.tar, quoted for the shell and, where the path needs it, for Hydra (a path
    holding a comma or brackets would otherwise be read as a sweep or a list)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    urls = os.path.join(out, "shard-*.tar")
    try:
        plain = OverridesParser.create().parse_override(f"data.urls={urls}").value() == urls
    except Exception:  # Hydra's grammar refuses the unquoted path
        plain = False
    if plain:
        return "data.urls=" + shlex.quote(urls)
    arg = "data.urls='" + urls.replace("'", "\\'") + "'"  # in Hydra's quotes a backslash escapes only a quote
    return f'"{arg}"' if not any(c in arg for c in '"$`\\!') else shlex.quote(arg)  # "…" reads best where it is safe


def print_summary(result, folder: str, seconds: float) -> None:
    kinds = ", ".join(f"{n} {k}{'s' if n != 1 else ''}" for k, n in sorted(result.kinds.items(), key=lambda kv: kv[0]))
    print(f"packed {result.samples} samples ({kinds or 'none'}) from {folder} into {len(result.shards)} shard(s), "
          f"{result.bytes / 1e6:.1f} MB, in {seconds:.1f} s → {result.out}")
    counts = result.skip_counts
    if not counts:
        print("skipped: none")
        return
    print(f"skipped {sum(counts.values())} file(s), each with its reason in "
          f"{os.path.join(result.out, 'pack_skipped.jsonl')}:")
    first = {}
    for k in result.skipped:
        first.setdefault(k["reason"], k)
    for reason, n in counts.most_common():
        print(f"  {reason:<20}{n:>6}   e.g. {first[reason]['path']} ({first[reason]['why']})")


def index_shards(shards, out: str, overrides, workers: int) -> int:
    """Index the shards into `out` for the configured bucket table; prints what fits; the number of usable samples."""
    from data.buckets import bucket_table
    from data.raw import index_corpus
    from training.config import compose_config

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = compose_config(overrides)
    index = index_corpus(shards, out, bucket_table(cfg.data.buckets), cfg.data.raw, workers)
    usable = Counter(r["bucket"] for r in index.records if r["bucket"] is not None)
    no_bucket = Counter(r["kind"] for r in index.records if r["bucket"] is None)
    print(f"indexed {len(index.records)} samples: {sum(usable.values())} fit a bucket of this table "
          f"({', '.join(f'{b} {n}' for b, n in usable.most_common()) or 'none'}), {sum(no_bucket.values())} fit none; "
          f"unreadable at probe: {index.meta['skipped'] or 'none'} (details in {os.path.join(out, 'skipped.jsonl')})")
    return sum(usable.values())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", metavar="FOLDER", help="folder of media files with captions beside them")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the shards (created if missing)")
    p.add_argument("--maxcount", type=int, default=10_000, metavar="N", help="samples per shard at most (10000)")
    p.add_argument("--maxsize-mb", type=float, default=1000.0, metavar="M",
                   help="a shard is closed once its members reach M MB (10^6 bytes; default 1000)")
    p.add_argument("--index", action="store_true", help="index the shards now, so that training starts at once")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes for --index")
    p.add_argument("--overwrite", action="store_true", help="replace the shards (and their index) already in DIR")
    p.add_argument("overrides", nargs="*", help="after --: Hydra overrides for --index and training (e.g. data=wan)")
    a = p.parse_args(argv)

    from data.pack import pack_folder

    t0 = time.time()
    progress = (lambda i, n: print(f"\r{i}/{n} media files", end="", file=sys.stderr)) if sys.stderr.isatty() else None
    try:
        result = pack_folder(a.folder, a.out, a.maxcount, a.maxsize_mb * 1e6, a.overwrite, progress)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if progress:
        print(file=sys.stderr)
    print_summary(result, a.folder, time.time() - t0)
    if not result.shards:
        print(f"error: no sample in {a.folder}: no media file has a usable caption beside it (see above)",
              file=sys.stderr)
        return 1
    if a.index and index_shards(result.shards, a.out, a.overrides, a.workers) == 0:
        print("error: no packed sample fits a bucket of this table (data.buckets; see skipped.jsonl)", file=sys.stderr)
        return 1
    print("train on it:\n  " + shlex.join(["python", "train.py", *a.overrides]) + " " + urls_override(a.out))
    return 0


if __name__ == "__main__":
    run_main(main)

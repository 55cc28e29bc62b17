"""Index raw WebDataset shards (images/videos + captions): tar headers and container headers, nothing decoded.

    python scripts/index_corpus.py '/data/raw/shard-{00000..00999}.tar' --workers 16 -- data=wan
    python scripts/index_corpus.py shards.txt --out /data/raw-index            (a list file, one shard a line)

Writes index.jsonl, corpus.json and skipped.jsonl into --out (default: the shards' common folder). Parallel over
shards (processes); resumable: each shard's results are kept in .index_parts/ and reused while the shard is unchanged,
so a killed run, or a run over more shards, probes only what is new. Buckets come from the config's data group
(Hydra overrides after `--`; default conf/data/tiny.yaml); training re-buckets from the stored native metadata, so
a corpus need not be re-indexed for another bucket table. Exits non-zero when no sample is usable. Every skipped
sample (and every shard that is not a readable tar) is listed in skipped.jsonl with its reason, and the counts by
reason are printed; images and video frames over data.raw.max_pixels count as too_large.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from training.cli import run_main  # noqa: E402
from training.config import compose_config  # noqa: E402

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("urls", nargs="+", help="shard paths, brace patterns, globs or list files; Hydra overrides "
                                          "(key=value) may follow")
    p.add_argument("--out", default=None, help="index folder (default: the shards' common folder)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    a = p.parse_args(argv)
    overrides = [u for u in a.urls if "=" in u and not os.path.exists(u)]
    urls = [u for u in a.urls if u not in overrides]
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from data.buckets import bucket_table
    from data.raw import bucket_records, common_dir, expand_urls, index_corpus

    cfg = compose_config(overrides)
    try:
        shards = expand_urls(urls, "urls")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = a.out or common_dir(shards)
    t0, done = time.time(), [0]

    def progress(d):
        done[0] += 1
        print(f"\r{done[0]} shards probed", end="", file=sys.stderr)

    buckets = bucket_table(cfg.data.buckets)
    index = index_corpus(shards, out, buckets, cfg.data.raw, a.workers, progress)
    usable = [r for r in index.records if r["bucket"] is not None]
    by_bucket = Counter(r["bucket"] for r in usable)
    kinds = Counter(r["kind"] for r in usable)
    print(f"\n{len(shards)} shards → {out}: {len(usable)} usable samples ({dict(kinds)}) in {time.time() - t0:.1f} s")
    for name, n in sorted(by_bucket.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<16}{n:>8}")
    _, no_bucket = bucket_records(index.records, buckets, cfg.data.raw)
    print(f"skipped at probe: {index.meta['skipped'] or 'none'}; without a bucket in this table: "
          f"{dict(Counter(k['reason'] for k in no_bucket)) or 'none'} "
          f"(details in {os.path.join(out, 'skipped.jsonl')})")
    if not usable:
        print(f"error: no usable sample in {len(shards)} shards", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    run_main(main)

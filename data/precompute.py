"""Encoding a raw corpus into latent shards of the shared schema (data/synthetic.py, contracts §4), with its index.
(the command line: scripts/precompute_latents.py)

Each sample is decoded for its bucket exactly as training decodes it in epoch 0 (same clip, keyed by train.seed and
the key), encoded by the configured VAE and text encoder, and written as {key}.latent.npy [C, F', H', W'] (normalised),
{key}.text.npy [L, C_text] (unpadded), {key}.pooled.npy (only where the text encoder pools) and {key}.json. So a run
on the precomputed corpus sees, in epoch 0, the batches an on-the-fly run would; later epochs reuse the one clip.

Split: rank r of R takes the samples i ≡ r (mod R) of the raw index order that are not done yet. Resumable: each
finished shard is listed in .precompute_parts/; a rerun (on any number of ranks) skips what the parts hold and
overwrites any shard a killed run left unlisted. Rank 0 waits for every part, then writes index.jsonl (in the raw
order, so the planner sees the same table), corpus.json and empty_text.pt (empty_pooled.pt where the text encoder
pools); a rerun over a finished --out only rewrites those, which is how a lost empty_text.pt is made again. Samples
that fail to read or decode (any exception, by the reasons of data/loader.py), or encode to NaN/Inf, are left out
and counted in corpus.json's "skipped".

Member names. A raw key is a tar member's path, which another tool may have written as `../../x` or `/etc/x`: a
latent shard stores a sample under `member_key(key)`, the key itself when every `/`-separated part is a plain name
(letters, digits, `_`, `-`), else the key with each other run of characters replaced by `_` and 8 hex digits of its
SHA-1 appended; a key already in the shard gets the digest too. So no member of a latent shard climbs out of the
folder it is extracted into, and two raw samples of one key (from two shards) stay two samples. The record's `json`
member keeps the raw shard and key (`source`).
"""
from __future__ import annotations

import glob
import hashlib
import io
import json
import logging
import os
import re
import tarfile
import time
from collections import Counter

import numpy as np

PARTS = ".precompute_parts"
log = logging.getLogger("precompute")
_NOT_NAME = re.compile(r"[^\w\-]+")


def member_key(key: str, taken: set[str]) -> str:
    """The key a latent shard stores raw `key` under (rule in the module docstring); adds it to `taken`."""
    parts = key.split("/")
    if all(p and not _NOT_NAME.search(p) for p in parts) and key not in taken:
        taken.add(key)
        return key
    digest = hashlib.sha1(key.encode("utf-8", "surrogateescape")).hexdigest()[:8]
    base, out, n = _NOT_NAME.sub("_", key).strip("_") or "_", None, 1
    while out is None or out in taken:
        out = f"{base}_{digest}" + (f"_{n}" if n > 1 else "")
        n += 1
    taken.add(out)
    return out


def _parts(out: str) -> list[dict]:
    from data.index import read_json

    return [read_json(path) for path in sorted(glob.glob(os.path.join(out, PARTS, "*.json")))]


def _write_shard(path: str, samples: list[tuple[str, dict]]) -> dict:
    from data.index import tar_members

    if os.path.lexists(path + ".tmp"):  # a killed run's, or a link planted there: never written through
        os.remove(path + ".tmp")
    with tarfile.open(path + ".tmp", "x") as tar:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    os.replace(path + ".tmp", path)
    return tar_members(path)


def precompute(data_cfg, buckets: dict, latent_channels: int, text_dim: int, seed: int, out: str, rank: int = 0,
               world_size: int = 1, samples_per_shard: int = 64, dtype: str = "float32",
               wait_s: float = 3600.0) -> dict:
    """Encode this rank's share into shards in `out`; rank 0 then writes the index. Returns counts."""
    import torch

    from data.index import EMPTY_POOLED_FILE, EMPTY_TEXT_FILE, SampleIndex, npy_bytes, write_file
    from data.loader import open_corpus, skip_reason

    deadline = time.time() + wait_s
    while True:  # rank 0 indexes the raw shards if no index covers them yet; the others wait for it
        try:
            corpus = open_corpus(data_cfg, buckets, latent_channels, text_dim, seed, is_main=rank == 0)
            break
        except FileNotFoundError:
            if rank == 0 or time.time() > deadline:
                raise
            time.sleep(2.0)
    if len(corpus.indexes) != 1 or corpus.indexes[0].meta.get("kind") != "raw":
        raise ValueError("precompute_latents encodes one raw corpus: set data.urls (or data.index to a raw index)")
    enc = corpus.encoders
    os.makedirs(os.path.join(out, PARTS), exist_ok=True)
    done = set()
    for p in _parts(out):
        done.update(r["order"] for r in p["records"])
        done.update(s["order"] for s in p["skipped"])
    n_all = len(corpus.bucket_of)
    mine = [g for g in range(n_all) if g % world_size == rank and g not in done]
    shard_no = len(glob.glob(os.path.join(out, PARTS, f"w{world_size}-r{rank}-*.json")))
    t0, written, skipped = time.time(), 0, Counter()
    pending: list[tuple[str, dict]] = []
    pending_recs: list[dict] = []
    pending_skips: list[dict] = []
    taken: set[str] = set()  # the member keys of the shard being filled

    def flush():
        nonlocal shard_no, pending, pending_recs, pending_skips, taken
        if not pending and not pending_skips:
            return
        name = f"latents-w{world_size}-r{rank}-{shard_no:05d}.tar"
        members = _write_shard(os.path.join(out, name), pending) if pending else {}
        for r in pending_recs:
            r["shard"] = name
            r["members"] = {e: list(v) for e, v in members[r["key"]].items()}
        part = os.path.join(out, PARTS, f"w{world_size}-r{rank}-{shard_no:05d}.json")
        write_file(part, json.dumps({"records": pending_recs, "skipped": pending_skips}).encode())  # then it is done
        shard_no += 1
        pending, pending_recs, pending_skips, taken = [], [], [], set()

    by_bucket: dict[int, list[int]] = {}
    for g in mine:
        by_bucket.setdefault(int(corpus.bucket_of[g]), []).append(g)
    np_dtype = {"float32": np.float32, "float16": np.float16}[dtype]
    for b, gids in by_bucket.items():
        for i in range(0, len(gids), enc.batch_size):
            loaded = []
            for g in gids[i:i + enc.batch_size]:
                try:
                    pixels, caption = corpus.load(g, epoch=0)
                except Exception as e:  # any failure of one sample is a counted skip (data/loader.py lists them)
                    reason = skip_reason(e)
                    skipped[reason] += 1
                    pending_skips.append({"order": g, "key": corpus.key(g), "reason": reason, "why": str(e)})
                    log.warning("skipping %s (%s): %s", corpus.key(g), reason, e)
                    continue
                loaded.append((g, pixels, caption))
            if not loaded:
                continue
            z = enc.encode_pixels(torch.stack([torch.from_numpy(p) for _, p, _ in loaded]))
            text = enc.encode_text([c for _, _, c in loaded])
            for n, ((g, _, caption), e) in enumerate(zip(loaded, text.per_sample())):
                rec_raw = corpus.record(g)
                if not (torch.isfinite(z[n]).all() and torch.isfinite(e).all()
                        and (text.pooled is None or torch.isfinite(text.pooled[n]).all())):
                    skipped["nonfinite"] += 1
                    pending_skips.append({"order": g, "key": rec_raw["key"], "reason": "nonfinite"})
                    continue
                latent = z[n].numpy().astype(np_dtype)
                members = {"latent.npy": npy_bytes(latent), "text.npy": npy_bytes(e.numpy()),
                           "json": json.dumps({"caption": caption, "bucket": rec_raw["bucket"],
                                               "source": f"{rec_raw['shard']}:{rec_raw['key']}"}).encode()}
                if text.pooled is not None:
                    members["pooled.npy"] = npy_bytes(text.pooled[n].numpy())
                key = member_key(rec_raw["key"], taken)
                pending.append((key, members))
                pending_recs.append({"key": key, "kind": "latent", "latent": list(latent.shape),
                                     "bucket": rec_raw["bucket"], "S": rec_raw["S"], "L_text": int(e.shape[0]),
                                     "split": rec_raw.get("split", "train"), "order": g})
                written += 1
                if len(pending) >= samples_per_shard:
                    flush()
            log.info("rank %d: %d/%d samples, %.2f samples/s", rank, written + sum(skipped.values()), len(mine),
                     written / max(1e-9, time.time() - t0))
    flush()
    result = {"written": written, "skipped": dict(skipped), "rank": rank}
    if rank != 0:
        return result
    deadline = time.time() + wait_s
    while True:  # rank 0 merges once every rank's parts cover the corpus
        parts = _parts(out)
        records = [r for p in parts for r in p["records"]]
        skips = [s for p in parts for s in p["skipped"]]
        if len({r["order"] for r in records} | {s["order"] for s in skips}) >= n_all:
            break
        if time.time() > deadline:
            raise TimeoutError(f"{out}: parts cover {len(records) + len(skips)} of {n_all} samples after "
                               f"{wait_s:.0f} s; rerun to finish the missing ranks")
        time.sleep(2.0)
    first = {}
    for r in records:
        first.setdefault(r["order"], r)
    records = [first[g] for g in sorted(first)]
    for name, t in ((EMPTY_TEXT_FILE, enc.empty_text), (EMPTY_POOLED_FILE, enc.empty_pooled)):
        if t is not None:
            buf = io.BytesIO()
            torch.save(t.clone(), buf)
            write_file(os.path.join(out, name), buf.getvalue())
    raw_index = corpus.indexes[0]
    meta = {"kind": "latent", "latent_channels": latent_channels, "text_dim": text_dim, "dtype": dtype,
            "writer": "scripts/precompute_latents.py", "source": raw_index.root, "seed": seed,
            "encoders": data_cfg.encoders.describe(latent_channels, text_dim),
            "skipped": dict(Counter(s["reason"] for s in skips) + Counter(corpus.skipped)),
            "buckets": {n: {"frames": b.frames, "height": b.height, "width": b.width} for n, b in buckets.items()}}
    SampleIndex(out, meta, records).save()
    result["index"] = len(records)
    return result

"""Reading the samples a plan names: corpora addressed by global id, weighted epochs, a prefetching loader.

    LatentCorpus   one or more sample indexes (data.index, data.urls or data.sources) in one id space; a record is
                   precomputed latents (kind latent) or a raw image/video (kind image | video, encoded on the fly by
                   data/encoders.py); the planner's SampleTable (a source of weight w contributes round(w·N) entries
                   per epoch, cycled when it runs out, contracts §2), the held-out validation ids, and `load(id)` — a
                   seek into the tar
    Loader         turns this rank's share of a StepPlan into Batches: worker threads read and decode the planned
                   samples ahead (PyAV and PIL release the GIL, so threads scale without copying frames between
                   processes); the VAE and text encoder run on the calling thread when the batch is taken, so
                   `data_wait_s` includes on-the-fly encoding. Every random choice (caption dropout, where a clip
                   starts) is keyed by (seed, epoch, key), so workers, resumes and world sizes draw the same.

Bad samples. A sample that fails in any way while it is read (any exception: a decode error, PIL's bomb error, a
short read, an .npy that does not parse, a shape that does not match) is replaced by the next good sample of its
bucket and split in id order (at most SEARCH candidates), counted once as data/skipped_<reason>, logged with its key
(the first LOG_KEYS_PER_REASON per reason) and never read again. Goodness is a property of the files (and of the
epoch's clip of a video), so every rank and every resumed run makes the same choice; `bad_state` / `restore_bad`
carry the bad set across a resume. A sample is named by (source, shard, key) — `sample_id` — in the bad set: keys
repeat across shards when two corpora share a folder. When no replacement is found, a zero placeholder of the bucket's shape with loss
weight 0 goes in its place: a run never stops on data. At open, buckets of at most CHECK_AT_OPEN training samples are
read in id order until one proves good; a bucket with none is left out of the plan, with a warning.

Reasons (data/skipped_<reason>; one count per sample unless noted):
    at indexing (data/raw.py; listed in skipped.jsonl, counted when the corpus is opened)
    unreadable_shard    a shard with no readable tar member (not a tar, empty, no permission): counts shards
    link_outside        a shard that is a link leading out of its folder, never opened: counts shards at indexing,
                        samples when a shard is swapped for such a link after indexing
    not_regular         a shard that is not a regular file (a device, fifo, socket, broken link), never opened: counted
                        as link_outside is
    duplicate_key       a later sample of one tar with the key of an earlier one (the first is kept)
    corrupt_member      a member whose tar header is damaged
    truncated_shard     a member cut off by the end of its shard
    no_media            no image or video member
    corrupt_image       an image header PIL cannot read, or not a JPEG, PNG or WebP
    corrupt_video       a container FFmpeg cannot open (or not mp4/mov/mkv/webm)
    no_frames           a video with no frame
    unreadable          (indexing) a probe failure none of these names
    at indexing (bucket rules, data/raw.py assign_bucket; re-applied for each bucket table)
    too_large           an image or video frame over data.raw.max_pixels pixels (also at load)
    too_short           a video shorter than every video bucket at data.raw.fps
    too_small           smaller than every bucket of its kind by more than data.raw.max_upscale
    extreme_aspect      no bucket within data.raw.max_crop of its aspect ratio
    no_image_bucket     an image, and the table has no 1-frame bucket (no_video_bucket: the reverse)
    at indexing or at load
    missing_caption     no txt/json member, or an empty caption
    unreadable_caption  a caption that is not text (the rule: data/raw.py module docstring)
    caption_too_large   a caption member over data/raw.py's MAX_CAPTION_BYTES (1 MiB), never read
    at load (here, and in scripts/precompute_latents.py)
    decode_error        media whose header reads but whose data does not decode (a truncated mp4 or jpg)
    unreadable          a member that cannot be read or parsed (a short read from a shard cut after indexing, not an
                        .npy, an object array), or any other failure
    bad_shape           a stored latent, text or pooled array whose shape or dtype does not match its record and the
                        corpus: latent [C, F', H', W'] of its bucket, text [L_text, text_dim], pooled [pooled width],
                        a float dtype (the corpus' dtype where corpus.json names one)
    nonfinite           NaN/Inf in stored latents, text or pooled text, or in on-the-fly encoded latents or text
    events
    placeholder         a planned sample trained as a zero placeholder (loss weight 0): counts occurrences
    empty_bucket        a bucket left out of the plan at open (no readable training sample): counts buckets
    empty_val_bucket    a bucket whose held-out samples all fail to read, left out of val/loss: counts buckets (per
                        process that builds the validation batches)
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np
import torch

from data.batch import Batch, collate
from data.buckets import Bucket
from data.config import VAL_CAP, VAL_SHARE, auto_val_samples, synthetic_mix
from data.decode import DecodeError
from data.index import (EMPTY_POOLED_FILE, EMPTY_TEXT_FILE, InputRefused, SampleIndex, index_path, load_npy,
                        read_meta)
from data.keys import keyed_generator
from data.raw import RawConfig, clip_start, common_dir, ensure_raw_index, expand_urls, load_raw, select_raw
from scheduling.planner import MicroBatch, SampleTable, StepPlan

log = logging.getLogger(__name__)
LOG_KEYS_PER_REASON = 20  # bad keys logged one by one per reason; the rest are counted only
SEARCH = 64               # candidates tried for a replacement before a placeholder goes in
CHECK_AT_OPEN = 8         # buckets with at most this many training samples are checked at open: few samples is
                          # where all of them may be bad, and reading a handful per small bucket costs little
FLOAT_DTYPES = ("float16", "float32", "float64")


class BadSample(ValueError):
    """A stored sample that does not match its record (bad_shape) or holds NaN/Inf (nonfinite)."""

    def __init__(self, reason: str, why: str):
        super().__init__(why)
        self.reason = reason


def skip_reason(e: BaseException) -> str:
    """The data/skipped_<reason> an exception raised while reading a sample counts as (a shard swapped for a link
    out of its folder, or for a device, after indexing: link_outside, not_regular)."""
    return e.reason if isinstance(e, (DecodeError, BadSample, InputRefused)) else "unreadable"


class Item(NamedTuple):
    """One read sample: latents and text (precomputed), or pixels and caption (raw); a placeholder is zeros."""
    gid: int
    a: Any                                  # latent [C, F, H, W] float32, or pixels [F, H, W, 3] uint8
    b: Any                                  # text [L, C_text] float32, or the caption
    pooled: Optional[torch.Tensor] = None   # stored pooled text [C_pool] (precomputed, where the corpus has it)
    placeholder: bool = False               # zeros of the bucket's shape, trained with loss weight 0


def _saved_tensor(path: str, ndim: int, width: Optional[int]) -> torch.Tensor:
    """A float tensor saved with torch.save, loaded without unpickling code (weights_only) and checked."""
    fix = ("rerun scripts/precompute_latents.py with the same --out and overrides (finished shards are kept; only "
           "the index and the empty prompt are rewritten), or regenerate the synthetic corpus")
    try:
        t = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"{path} cannot be read as a tensor ({type(e).__name__}: {e}): {fix}") from None
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.ndim != ndim or 0 in t.shape \
            or (width is not None and t.shape[-1] != width):
        what = f"{type(t).__name__} {tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        want = "[L, text_dim]" if ndim == 2 else "[pooled width]"
        raise ValueError(f"{path} holds {what}, expected a float tensor {want}"
                         f"{f' with width {width}' if width is not None else ''}: {fix}")
    if not torch.isfinite(t).all():
        raise ValueError(f"{path} holds NaN/Inf: {fix}")
    return t.float()


def load_empty_prompt(root: str, text_dim: Optional[int] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(empty_text [L, C_text], empty_pooled [C_pool] or None) of a latent corpus; ValueError naming the file and how
    to write it when it is missing or is not a finite float tensor of that shape."""
    path = os.path.join(root, EMPTY_TEXT_FILE)
    if not os.path.exists(path):
        raise ValueError(f"{path} is missing: a latent corpus needs the empty prompt's text embedding (caption "
                         f"dropout, guidance). scripts/precompute_latents.py writes it when it finishes: rerun it with "
                         f"the same --out and overrides (finished shards are kept, so only the index, corpus.json and "
                         f"{EMPTY_TEXT_FILE} are rewritten); data/synthetic.py writes it for synthetic corpora")
    text = _saved_tensor(path, 2, text_dim)
    pooled = os.path.join(root, EMPTY_POOLED_FILE)
    return text, _saved_tensor(pooled, 1, None) if os.path.exists(pooled) else None


class LatentCorpus:
    def __init__(self, indexes: Sequence[SampleIndex], weights: Sequence[float], buckets: dict[str, Bucket],
                 val_samples: int, seed: int, raw: Optional[RawConfig] = None, encoders=None,
                 skipped: Optional[Counter] = None, latent_channels: Optional[int] = None,
                 text_dim: Optional[int] = None):
        self.indexes = list(indexes)
        self.buckets = buckets
        self.bucket_names = list(buckets)
        self.seed, self.raw, self.encoders = seed, raw or RawConfig(), encoders
        bucket_no = {n: i for i, n in enumerate(self.bucket_names)}
        self._where: list[tuple[int, int]] = []  # global id → (index number, row)
        rows_by_source, val = [], []
        for s, index in enumerate(self.indexes):
            ids = []
            for row, rec in enumerate(index.records):
                if rec["bucket"] not in bucket_no:
                    raise ValueError(f"{index.root}: sample {rec['key']} is in bucket {rec['bucket']!r}, which "
                                     f"data.buckets does not define (defined: {self.bucket_names})")
                if rec["kind"] != "latent" and encoders is None:
                    raise ValueError(f"{index.root} holds raw {rec['kind']}s: they need encoders (open_corpus builds "
                                     f"them from data.encoders)")
                gid = len(self._where)
                self._where.append((s, row))
                (val if rec.get("split", "train") == "val" else ids).append(gid)
            rows_by_source.append(ids)
        if not val:  # no held-out split: hold out a deterministic few from training
            pool = rows_by_source[0]
            n = auto_val_samples(len(pool)) if val_samples is None else val_samples
            if n >= len(pool):
                raise ValueError(f"corpus {self.indexes[0].root} has {len(pool)} usable sample(s) and data.val_samples"
                                 f"={val_samples if val_samples is not None else 'null'} holds {n} out for val/loss, "
                                 f"leaving none to train on: lower data.val_samples (null holds out "
                                 f"{VAL_SHARE:.0%}, at most {VAL_CAP}, at least 1) or add samples (2 at the least)")
            take = set(np.random.default_rng([seed, 7]).permutation(pool)[:n].tolist())
            rows_by_source[0] = [i for i in pool if i not in take]
            val, where = sorted(take), "drawn from the training samples"
        else:
            where = f"from the corpus' val split of {len(val)}"
        self.val_ids = val[:min(VAL_CAP, len(val)) if val_samples is None else val_samples]
        log.info("held out %d of %d for val/loss (%s; data.val_samples=%s)", len(self.val_ids), len(self._where),
                 where, f"null: {VAL_SHARE:.0%}, at most {VAL_CAP}" if val_samples is None else val_samples)
        for s, ids in enumerate(rows_by_source):
            if not ids:
                raise ValueError(f"corpus {self.indexes[s].root} has no training samples")
        self.bucket_of = np.array([bucket_no[self.record(i)["bucket"]] for i in range(len(self._where))], np.int32)
        self.S_of = np.array([buckets[self.record(i)["bucket"]].tokens for i in range(len(self._where))], np.int64)
        # replacements for a bad sample come from its own split: a held-out sample must never enter training
        self.is_train = np.zeros(len(self._where), dtype=bool)
        self.is_train[[i for ids in rows_by_source for i in ids]] = True
        self._peers: dict[tuple[int, bool], np.ndarray] = {}
        first = lambda k: next((ix.meta[k] for ix in self.indexes if ix.meta.get(k) is not None), None)  # noqa: E731
        self.latent_channels = latent_channels if latent_channels is not None else (
            encoders.vae.latent_channels if encoders is not None else first("latent_channels"))
        self.text_dim = text_dim if text_dim is not None else (
            encoders.text.dim if encoders is not None else first("text_dim"))
        self._dtype = [np.dtype(ix.meta["dtype"]) if ix.meta.get("dtype") in FLOAT_DTYPES else None
                       for ix in self.indexes]  # the stored latent dtype, where corpus.json names it
        if encoders is not None:  # the empty prompt of the encoder in use (precompute stores the same one)
            self.empty_text, self.empty_pooled = encoders.empty_text, encoders.empty_pooled
        else:
            self.empty_text, self.empty_pooled = load_empty_prompt(self.indexes[0].root, self.text_dim)
        self._index_skipped: Counter = Counter(skipped or {})  # what indexing skipped: not in this corpus' ids
        self._bad: dict[int, str] = {}                         # id → reason, found by this process or restored
        self._events: Counter = Counter()                      # placeholder, empty_bucket
        self._logged: Counter = Counter()
        self._lock = threading.Lock()
        self.dropped_buckets = self._unreadable_buckets(rows_by_source)
        if self.dropped_buckets:
            gone = {bucket_no[n] for n in self.dropped_buckets}
            rows_by_source = [[i for i in ids if self.bucket_of[i] not in gone] for ids in rows_by_source]
            for s, ids in enumerate(rows_by_source):
                if not ids:
                    raise ValueError(f"corpus {self.indexes[s].root}: every training sample is in buckets that hold no "
                                     f"readable sample ({self.dropped_buckets}); skipped so far: {dict(self.skipped)}")
        self.table = self._epoch_table(rows_by_source, weights, seed)
        counts = np.bincount(self.table.bucket, minlength=len(self.bucket_names))
        unplanned = [n for n, c in zip(self.bucket_names, counts) if not c and n not in self.dropped_buckets]
        if unplanned:  # a bucket in the table that trains nothing is a config mistake more often than a choice
            log.warning("bucket(s) %s get no sample in the first epoch's plan (of %d): the corpus holds no training "
                        "sample that fits them (or a source's weight leaves them out); data.synthetic.mix.NAME=0 "
                        "does this on purpose", unplanned, len(self.table.ids))

    def _unreadable_buckets(self, rows_by_source) -> list[str]:
        """Names of the buckets of at most CHECK_AT_OPEN training samples none of which reads (epoch 0), each warned
        about and counted; ValueError when that is every bucket with training samples."""
        by_bucket: dict[int, list[int]] = {}
        for gid in sorted(i for ids in rows_by_source for i in ids):
            by_bucket.setdefault(int(self.bucket_of[gid]), []).append(gid)
        dropped = []
        for b, gids in sorted(by_bucket.items()):
            # any(): reading stops at the first good sample; the bucket then has a replacement for every bad one
            if len(gids) > CHECK_AT_OPEN or any(self._try(g, 0) is not None for g in gids):
                continue
            name = self.bucket_names[b]
            dropped.append(name)
            self._events["empty_bucket"] += 1
            log.warning("bucket %s is left out of the plan: none of its %d training samples is readable (%s)", name,
                        len(gids), dict(Counter(self._bad[g] for g in gids)))
        if dropped and len(dropped) == len(by_bucket):
            raise ValueError(f"no bucket has a readable training sample: {dropped} (every sample of each was read "
                             f"and skipped: {dict(self.skipped)}; the keys are in the warnings above)")
        return dropped

    def _epoch_table(self, rows_by_source, weights, seed) -> SampleTable:
        w = np.asarray(weights, dtype=np.float64)
        w = w / w.sum()
        total = sum(len(r) for r in rows_by_source)
        entries = []
        for s, (ids, ws) in enumerate(zip(rows_by_source, w)):
            count = max(1, int(round(ws * total)))
            order = np.random.default_rng([seed, 11, s]).permutation(ids)
            entries.append(order[np.arange(count) % len(order)])  # cycled when the source runs out
        ids = np.concatenate(entries).astype(np.int64)
        return SampleTable(ids, self.bucket_of[ids], self.S_of[ids])

    def record(self, gid: int) -> dict:
        s, row = self._where[gid]
        return self.indexes[s].records[row]

    def key(self, gid: int) -> str:
        s, row = self._where[gid]
        return f"{s}/{self.indexes[s].records[row]['key']}" if len(self.indexes) > 1 else self.indexes[s].records[row]["key"]

    def sample_id(self, gid: int) -> tuple[int, str, str]:
        """(source number, shard, key): what names a sample uniquely. A key alone does not: two corpora written into
        one folder repeat keys across shards, so bad sets and counts go by this."""
        s, row = self._where[gid]
        rec = self.indexes[s].records[row]
        return s, rec["shard"], rec["key"]

    def is_raw(self, gid: int) -> bool:
        return self.record(gid)["kind"] != "latent"

    @property
    def skipped(self) -> Counter:
        """Counts by reason: what indexing skipped, each sample known bad (once), and the events."""
        with self._lock:
            return self._index_skipped + Counter(self._bad.values()) + self._events

    def load(self, gid: int, epoch: int = 0):
        """(latent [C, F, H, W], text [L, C_text]) for precomputed samples, checked (BadSample: bad_shape,
        nonfinite); (pixels [F, H, W, 3] uint8, caption) for raw ones, the clip placed by a draw keyed by
        (seed, epoch, key)."""
        s, row = self._where[gid]
        index = self.indexes[s]
        rec = index.records[row]
        if rec["kind"] != "latent":
            u = 0.0
            if self.raw.clip == "random" and rec["kind"] == "video":
                u = float(torch.rand((), generator=keyed_generator(self.seed, epoch, self.key(gid), "clip")))
            return load_raw(index, row, self.buckets[rec["bucket"]], self.raw, clip_start(self.raw, u))
        shape = self.buckets[rec["bucket"]].latent_shape(self.latent_channels)
        latent = self._array(s, row, "latent.npy", shape, self._dtype[s])
        text = self._array(s, row, "text.npy", (rec.get("L_text"), self.text_dim))
        return latent, text

    def pooled(self, gid: int) -> Optional[torch.Tensor]:
        """The stored pooled text embedding of a precomputed sample, where the corpus has pooled text (an
        empty_pooled.pt gives its width), checked as `load` checks."""
        s, row = self._where[gid]
        if self.empty_pooled is None or "pooled.npy" not in self.indexes[s].records[row]["members"]:
            return None
        return self._array(s, row, "pooled.npy", (int(self.empty_pooled.shape[-1]),))

    def _array(self, s: int, row: int, ext: str, shape: tuple, dtype: Optional[np.dtype] = None) -> torch.Tensor:
        """A stored array as float32, checked: a float dtype (`dtype` where given), `shape` (None: any length)."""
        a = load_npy(self.indexes[s].read(row, ext))
        if a.dtype.kind != "f" or a.dtype.name not in FLOAT_DTYPES or (dtype is not None and a.dtype != dtype):
            raise BadSample("bad_shape", f"{ext} holds {a.dtype}, expected {dtype or 'float16/32/64'}")
        if a.ndim != len(shape) or 0 in a.shape or any(w is not None and n != w for n, w in zip(a.shape, shape)):
            want = "[" + ", ".join("L" if w is None else str(w) for w in shape) + "]"
            raise BadSample("bad_shape", f"{ext} has shape {list(a.shape)}, expected {want}")
        t = torch.from_numpy(a.astype(np.float32, copy=False))
        if not torch.isfinite(t).all():
            raise BadSample("nonfinite", f"NaN/Inf in {ext}")
        return t

    def _try(self, gid: int, epoch: int) -> Optional[Item]:
        """gid read and checked, or None when it is (or now proves) bad."""
        if gid in self._bad:
            return None
        try:
            a, b = self.load(gid, epoch)
            pooled = self.pooled(gid)
        except Exception as e:  # whatever reading this sample raised: the run goes on without it
            self._skip(skip_reason(e), gid, f"{type(e).__name__}: {e}")
            return None
        return Item(gid, a, b, pooled)

    def _same(self, gid: int) -> np.ndarray:
        """The ids of gid's bucket and split, ascending: where its replacement comes from."""
        k = (int(self.bucket_of[gid]), bool(self.is_train[gid]))
        if k not in self._peers:
            self._peers[k] = np.flatnonzero((self.bucket_of == k[0]) & (self.is_train == k[1]))
        return self._peers[k]

    def read_checked(self, gid: int, epoch: int = 0) -> Item:
        """gid's Item or, when it is bad, the next good sample of its bucket and split in id order (SEARCH tried);
        when none reads, a placeholder. Never raises on data."""
        item = self.find_readable(gid, epoch)
        return item if item is not None else self.placeholder(gid)

    def find_readable(self, gid: int, epoch: int = 0) -> Optional[Item]:
        """gid's Item, or the next good sample's of its bucket and split in id order (SEARCH tried); None if none."""
        same = self._same(gid)
        start = int(np.searchsorted(same, gid))
        for k in range(min(len(same), SEARCH)):
            item = self._try(int(same[(start + k) % len(same)]), epoch)
            if item is not None:
                return item
        return None

    def load_checked(self, gid: int, epoch: int = 0):
        """(id, *load(id)) of read_checked: gid or its replacement."""
        item = self.read_checked(gid, epoch)
        return item.gid, item.a, item.b

    def placeholder(self, gid: int) -> Item:
        """Zeros of gid's bucket's latent shape with the empty prompt, to be trained with loss weight 0 (counted)."""
        name = self.bucket_names[self.bucket_of[gid]]
        self._note("placeholder", gid, f"no readable sample of bucket {name} found in its place: zeros with loss "
                                       f"weight 0 go in")
        return Item(gid, torch.zeros(self.buckets[name].latent_shape(self.latent_channels)), self.empty_text,
                    self.empty_pooled, placeholder=True)

    def _skip(self, reason: str, gid: int, why) -> None:
        with self._lock:
            if gid in self._bad:
                return
            self._bad[gid] = reason
        self._log(reason, gid, why)

    def _note(self, event: str, gid: int, why) -> None:
        with self._lock:
            self._events[event] += 1
        self._log(event, gid, why)

    def _log(self, reason: str, gid: int, why) -> None:
        with self._lock:
            self._logged[reason] += 1
            n = self._logged[reason]
        if n <= LOG_KEYS_PER_REASON:
            log.warning("skipping sample %s (%s): %s%s", self.key(gid), reason, why,
                        "; further samples skipped for this reason are only counted" if n == LOG_KEYS_PER_REASON
                        else "")

    @functools.cached_property
    def content_hash(self) -> str:
        """SHA-256 of every source's records in order — shard, key, kind, bucket, split and member offsets — which
        the epoch's table, the held-out split and every read are functions of (with the config, which the resume
        check compares apart). Not the glob or folder that named them: shards added under the same data.urls
        pattern change it."""
        h = hashlib.sha256()
        for index in self.indexes:
            recs = index.records
            for i in range(0, len(recs), 4096):  # in chunks: one string of a 10 M-sample index would take GBs
                h.update(json.dumps([[r["shard"], r["key"], r["kind"], r["bucket"], r.get("split", "train"),
                                      r["members"]] for r in recs[i:i + 4096]], sort_keys=True).encode())
            h.update(b"\n")
        return h.hexdigest()

    def bad_state(self) -> dict:
        """What a resumed run needs to neither recount nor retry known-bad samples, and to know it reads the same
        corpus (JSON-serialisable): {"skipped": counts by reason, "bad": [[source, shard, key, reason], ...] sorted,
        "corpus": content_hash}."""
        with self._lock:
            bad = sorted([*self.sample_id(g), r] for g, r in self._bad.items())
        return {"skipped": {r: int(n) for r, n in self.skipped.items()}, "bad": bad, "corpus": self.content_hash}

    def restore_bad(self, state: dict) -> None:
        """Take back a bad_state: its bad samples are known bad here too (samples this corpus lacks are ignored),
        and its placeholder count continues. The other counts follow from the bad set and this corpus' index, so a
        sample is never counted twice; empty_bucket stays this open's. A sample is matched by (source, shard, key);
        an entry of an older checkpoint, [key, reason], only where that key names one sample here (a key that two
        shards share is retried rather than risk banning its good twin)."""
        gid_of = {self.sample_id(g): g for g in range(len(self._where))}
        by_key: dict[str, list[int]] = {}
        for g in range(len(self._where)):
            by_key.setdefault(self.key(g), []).append(g)
        with self._lock:
            for entry in state.get("bad", []):
                *ident, reason = entry
                if len(ident) == 1:
                    gids = by_key.get(ident[0], [])
                    gid = gids[0] if len(gids) == 1 else None
                else:
                    gid = gid_of.get(tuple(ident))
                if gid is not None:
                    self._bad.setdefault(gid, reason)
            self._events["placeholder"] += int(state.get("skipped", {}).get("placeholder", 0))


def merge_bad_states(states: Sequence[dict]) -> dict:
    """One bad_state from every rank's: the union of their bad samples (each rank reads other samples) and the sum
    of their placeholders; restore_bad rebuilds the other counts from the union, so nothing is counted twice."""
    bad: dict[tuple, str] = {}
    for st in states:
        for *ident, reason in st.get("bad", []):
            bad.setdefault(tuple(ident), reason)
    placeholders = sum(int(st.get("skipped", {}).get("placeholder", 0)) for st in states)
    out = {"skipped": {"placeholder": placeholders} if placeholders else {},
           "bad": sorted([*ident, reason] for ident, reason in bad.items())}
    hashes = {st["corpus"] for st in states if st.get("corpus")}
    assert len(hashes) <= 1, f"the ranks read different corpora: {sorted(hashes)}"
    if hashes:
        out["corpus"] = hashes.pop()
    return out


def corpus_changed(corpus: LatentCorpus, state: dict, force: bool) -> bool:
    """Whether a resume reads another corpus than the checkpoint's `state` (its bad_state) was written on: False
    when the content hashes agree, or the checkpoint predates them. A different corpus — shards added, removed or
    re-indexed, even under the same data.urls pattern — is refused (ValueError: the saved plan position indexes
    another permutation, so the epoch would no longer cover each sample once) unless `force`; then True, with a
    warning: the caller starts a new epoch."""
    saved = state.get("corpus")
    if not saved or saved == corpus.content_hash:
        return False
    what = (f"the checkpoint was trained on a corpus whose index hashes to {saved[:16]}, this one hashes to "
            f"{corpus.content_hash[:16]} ({sum(len(ix.records) for ix in corpus.indexes)} samples): shards were added, "
            f"removed or re-indexed since")
    if not force:
        raise ValueError(f"resume refused: {what}. Its saved position indexes another permutation, so the epoch would "
                         f"not cover each sample once. Resume on the corpus it was trained on, start a new run "
                         f"(another name), or set resume_force=true to go on with this corpus from a new epoch.")
    log.warning("resume_force: %s; starting a new epoch on this corpus", what)
    return True


def _sources(data_cfg) -> Optional[list[tuple[str, dict]]]:
    """[(config path, {index?, urls?, weight})] of the corpora the config names; None: the synthetic corpus."""
    if data_cfg.sources:
        return [(f"data.sources[{i}]", dict(s)) for i, s in enumerate(data_cfg.sources)]
    if data_cfg.urls is not None:
        return [("data.urls", {"urls": data_cfg.urls, "index": data_cfg.index})]
    if data_cfg.index:
        return [("data.index", {"index": data_cfg.index})]
    return None


def _synthetic_mix(data_cfg, bucket_names) -> dict:
    """The synthetic corpus' mix as its generator draws it (data/config.py's synthetic_mix)."""
    return synthetic_mix(dict(data_cfg.synthetic.mix), list(bucket_names))


def synthetic_shares(data_cfg, bucket_names) -> Optional[dict[str, float]]:
    """The synthetic corpus' bucket shares ({name: share}) when the config names no corpus; None when it names one
    (its shares are its samples' counts)."""
    if _sources(data_cfg) is not None:
        return None
    return {n: float(v) for n, v in _synthetic_mix(data_cfg, bucket_names).items() if n in bucket_names}


def _check_latent_meta(root: str, meta: dict, latent_channels: Optional[int], text_dim: Optional[int]) -> None:
    c, d = meta.get("latent_channels"), meta.get("text_dim")
    if latent_channels is not None and text_dim is not None and (c, d) != (latent_channels, text_dim):
        raise ValueError(f"corpus {root} holds latents with {c} channels and text of dim {d}, but the "
                         f"model takes in_channels={latent_channels}, text_dim={text_dim}")


def check_corpus(data_cfg, latent_channels: Optional[int] = None, text_dim: Optional[int] = None) -> None:
    """Cheap checks of the corpora the config names, for before the model is built (open_corpus runs them first):
    shard patterns match files; each index folder has a corpus.json that parses; a latent corpus has the model's
    channels and text width (when given); and where the empty prompt comes from a file (no raw source), the first
    corpus' empty_text.pt (and empty_pooled.pt) is a finite float tensor of that width. ValueError naming the file
    and the fix; FileNotFoundError for an index folder without an index. Nothing is read per sample, nothing is
    indexed; the synthetic corpus (no data.index/urls/sources) passes, as it is generated to fit."""
    sources = _sources(data_cfg)
    if sources is None:
        return
    raw, latent_roots = False, []
    for where, src in sources:
        if src.get("urls") is not None:
            expand_urls(src["urls"], f"{where}.urls" if where.startswith("data.sources") else where)
            raw = True
            continue
        index_path(src["index"])
        meta = read_meta(src["index"])
        if meta.get("kind") == "raw":
            raw = True
            continue
        _check_latent_meta(src["index"], meta, latent_channels, text_dim)
        latent_roots.append(src["index"])
    if not raw and latent_roots:
        load_empty_prompt(latent_roots[0], text_dim)


def open_corpus(data_cfg, buckets: dict[str, Bucket], latent_channels: int, text_dim: int, seed: int,
                is_main: bool = True, barrier=lambda: None, pooled_dim: Optional[int] = None) -> LatentCorpus:
    """The training corpus the config names. Raw shards are indexed on first use (by rank 0, resumably); the
    synthetic latent corpus is generated on first use (with pooled text of `pooled_dim` when the model takes it).
    Everything that can be checked without decoding — check_corpus, a corpus with no usable sample — fails here,
    before training; so does a corpus whose small buckets all prove unreadable (LatentCorpus)."""
    check_corpus(data_cfg, latent_channels, text_dim)
    sources = _sources(data_cfg)
    if sources is None and data_cfg.synthetic.kind == "shapes":
        from data.shapes import ensure_shapes_corpus

        if is_main:
            ensure_shapes_corpus(data_cfg, buckets, latent_channels, text_dim)
        barrier()
        sources = [("synthetic", {"index": ensure_shapes_corpus(data_cfg, buckets, latent_channels, text_dim)})]
    if sources is None:
        from data.synthetic import ensure_synthetic_corpus

        syn = data_cfg.synthetic
        spec = dict(mix=_synthetic_mix(data_cfg, buckets), num_samples=syn.num_samples,
                    num_val=syn.num_val, latent_channels=latent_channels, text_dim=text_dim, seed=syn.seed,
                    num_classes=syn.num_classes, samples_per_shard=syn.samples_per_shard, dtype=syn.dtype)
        if pooled_dim:  # only then: the spec hash (the cache key) of other corpora stays as it was
            spec["pooled_dim"] = pooled_dim
        if is_main:
            ensure_synthetic_corpus(data_cfg.cache_dir, buckets, **spec)
        barrier()
        sources = [("synthetic", {"index": ensure_synthetic_corpus(data_cfg.cache_dir, buckets, **spec).root})]
    indexes, weights, skipped = [], [], Counter()
    for where, src in sources:
        shards = None
        if src.get("urls") is not None:
            shards = expand_urls(src["urls"], f"{where}.urls" if where.startswith("data.sources") else where)
            root = src.get("index") or common_dir(shards)
            if is_main:
                ensure_raw_index(shards, root, buckets, data_cfg.raw, workers=max(1, data_cfg.num_workers))
            barrier()
        else:
            root = src["index"]
        index = SampleIndex.load(root)
        if index.meta.get("kind") == "raw":
            index, counts = select_raw(index, buckets, data_cfg.raw, shards)
            skipped.update(counts)
            if not index.records:
                raise ValueError(f"{where}: no usable sample in {root} — every one was skipped "
                                 f"({dict(counts) or 'the corpus is empty'}); the list is in {root}/skipped.jsonl")
        else:
            _check_latent_meta(index.root, index.meta, latent_channels, text_dim)
            skipped.update(index.meta.get("skipped", {}))
        indexes.append(index)
        weights.append(float(src.get("weight", 1.0)))
    encoders = None
    if any(ix.meta.get("kind") == "raw" for ix in indexes):
        from data.encoders import build_encoders

        encoders = build_encoders(data_cfg.encoders, latent_channels, text_dim)
    corpus = LatentCorpus(indexes, weights, buckets, data_cfg.val_samples, seed, data_cfg.raw, encoders, skipped,
                          latent_channels, text_dim)
    if pooled_dim:  # a model that takes pooled text (MMDiT): the corpus must supply it at that width, or the model
        have = None if corpus.empty_pooled is None else int(corpus.empty_pooled.shape[-1])  # pools the tokens
        if have is None and pooled_dim != text_dim:
            raise ValueError(f"the model takes pooled text of width {pooled_dim} but the corpus has none: use a text "
                             f"encoder with a pooled output (data.encoders.text=llama_clip) or precompute one")
        if have is not None and have != pooled_dim:
            raise ValueError(f"the corpus' pooled text has width {have} but the model takes {pooled_dim} "
                             f"(model.pooled_projection_dim)")
    return corpus


class Loader:
    def __init__(self, corpus: LatentCorpus, text_len: int, caption_dropout: float, seed: int, rank: int,
                 num_workers: int = 0):
        self.corpus, self.text_len, self.p_drop, self.seed, self.rank = corpus, text_len, caption_dropout, seed, rank
        self._pool = ThreadPoolExecutor(num_workers) if num_workers > 0 else None
        self._ahead: dict[tuple[int, int], list[Future]] = {}

    def _read(self, mb: MicroBatch, epoch: int) -> list[Item]:
        """An Item per sample of the micro-batch: latents and text, or pixels and caption (worker side)."""
        return [self.corpus.read_checked(gid, epoch) for gid in mb.ids]

    def _assemble(self, mb: MicroBatch, items: list[Item], epoch: int, drop: bool = True) -> Batch:
        """Encode what is raw, apply caption dropout, pad and stack (calling thread: the encoders live here).
        Placeholders, and raw samples that encode to NaN/Inf (then known bad), go in with loss weight 0."""
        corpus, enc = self.corpus, self.corpus.encoders
        items = list(items)
        keys = [corpus.key(it.gid) for it in items]
        dropped = [drop and self.p_drop > 0 and bool(torch.rand((), generator=keyed_generator(
            self.seed, epoch, key, "caption")) < self.p_drop) for key in keys]
        latents, texts, pooled = [it.a for it in items], [it.b for it in items], [it.pooled for it in items]
        raw = [j for j, it in enumerate(items) if not it.placeholder and corpus.is_raw(it.gid)]
        if raw:
            z = enc.encode_pixels(torch.stack([torch.from_numpy(latents[j]) for j in raw]))
            for n, j in enumerate(raw):
                latents[j] = z[n]
            say = [j for j in raw if not dropped[j]]
            if say:
                out = enc.encode_text([texts[j] for j in say])
                for n, (j, e) in enumerate(zip(say, out.per_sample())):
                    texts[j] = e
                    pooled[j] = None if out.pooled is None else out.pooled[n]
            for j in raw:
                if not all(torch.isfinite(t).all() for t in (latents[j], texts[j], pooled[j])
                           if isinstance(t, torch.Tensor)):
                    corpus._skip("nonfinite", items[j].gid, "NaN/Inf in its encoded latents or text")
                    items[j] = corpus.placeholder(items[j].gid)
                    latents[j], texts[j], pooled[j] = items[j].a, items[j].b, items[j].pooled
        for j in range(len(items)):
            if dropped[j]:
                texts[j], pooled[j] = corpus.empty_text, corpus.empty_pooled
        weights = [0.0 if it.placeholder else w for it, w in zip(items, mb.weights)]
        batch = collate(latents, texts, keys, corpus.bucket_names[mb.bucket], mb.S, weights, self.text_len)
        if all(p is not None for p in pooled):
            batch.pooled = torch.stack(pooled)
        return batch

    def _submit(self, plan: StepPlan) -> list[Future]:
        key = (plan.epoch, plan.pos)
        if key not in self._ahead:
            mbs = plan.ranks[self.rank]
            if self._pool is None:
                futs = []
                for mb in mbs:
                    f: Future = Future()
                    f.set_result(None)  # read lazily in step(): no worker
                    futs.append(f)
            else:
                futs = [self._pool.submit(self._read, mb, plan.epoch) for mb in mbs]
            self._ahead[key] = futs
        return self._ahead[key]

    def prefetch(self, plan: Optional[StepPlan]) -> None:
        if plan is not None and self._pool is not None:
            self._submit(plan)

    def step(self, plan: StepPlan):
        """Yield this rank's Batches of `plan`, slot by slot, each with its data_wait_s."""
        futs = self._submit(plan)
        try:
            for mb, fut in zip(plan.ranks[self.rank], futs):
                t0 = time.perf_counter()
                items = fut.result()
                batch = self._assemble(mb, items if items is not None else self._read(mb, plan.epoch), plan.epoch)
                batch.data_wait_s = time.perf_counter() - t0
                yield batch
        finally:
            self._ahead.pop((plan.epoch, plan.pos), None)

    def val_batches(self, max_B: int = 8) -> list[Batch]:
        """The fixed held-out samples, grouped by bucket (no caption dropout; clips placed as in epoch 0). A held-out
        sample with no readable replacement is left out (validation averages every sample it is given); a bucket
        none of whose held-out samples reads is warned about and counted (data/skipped_empty_val_bucket), and when
        no held-out sample reads at all, a warning says that no val/loss will be logged (never a 0.0)."""
        by_bucket: dict[int, list[int]] = {}
        for gid in self.corpus.val_ids:
            by_bucket.setdefault(int(self.corpus.bucket_of[gid]), []).append(gid)
        out = []
        for b, gids in sorted(by_bucket.items()):
            n_before = len(out)
            for i in range(0, len(gids), max_B):
                chunk = tuple(gids[i:i + max_B])
                S = int(self.corpus.S_of[chunk[0]])
                # no placeholder here: validation leaves an unreadable sample out and trains nothing in its place
                items = [it for it in map(self.corpus.find_readable, chunk) if it is not None]
                if items:
                    mb = MicroBatch(b, tuple(it.gid for it in items), (1.0,) * len(items), S, 0.0)
                    out.append(self._assemble(mb, items, 0, drop=False))
            if len(out) == n_before:
                self.corpus._note("empty_val_bucket", gids[0], f"none of the {len(gids)} held-out samples of bucket "
                                  f"{self.corpus.bucket_names[b]} reads: val/loss leaves the bucket out")
        if not out:
            log.warning("no held-out sample is readable (%d tried; skipped so far: %s): val/loss is not logged",
                        len(self.corpus.val_ids), dict(self.corpus.skipped))
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

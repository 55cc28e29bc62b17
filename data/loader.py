"""Reading the samples a plan names: latent corpora addressed by global id, weighted epochs, a prefetching loader.

    LatentCorpus   one or more sample indexes (data.index or data.sources) in one id space; the planner's
                   SampleTable (a source of weight w contributes round(w·N) entries per epoch, cycled when it runs
                   out, CONTRACTS §2), the held-out validation ids, and `load(id)` — a seek into the tar
    Loader         turns this rank's share of a StepPlan into Batches, decoding ahead in worker threads; caption
                   dropout is keyed by (seed, epoch, key) like the noise; a sample that fails to read or holds
                   NaN/Inf is replaced by a sample of the same bucket and counted as data/skipped_<reason>
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Sequence

import numpy as np
import torch

from data.batch import Batch, collate
from data.buckets import Bucket
from data.index import EMPTY_TEXT_FILE, SampleIndex, load_npy
from models.flow_matching import keyed_generator
from scheduling.balance import MicroBatch, SampleTable, StepPlan

log = logging.getLogger(__name__)


class LatentCorpus:
    def __init__(self, indexes: Sequence[SampleIndex], weights: Sequence[float], buckets: dict[str, Bucket],
                 val_samples: int, seed: int):
        self.indexes = list(indexes)
        self.buckets = buckets
        self.bucket_names = list(buckets)
        bucket_no = {n: i for i, n in enumerate(self.bucket_names)}
        self._where: list[tuple[int, int]] = []  # global id → (index number, row)
        rows_by_source, val = [], []
        for s, index in enumerate(self.indexes):
            ids = []
            for row, rec in enumerate(index.records):
                if rec["bucket"] not in bucket_no:
                    raise ValueError(f"{index.root}: sample {rec['key']} is in bucket {rec['bucket']!r}, which "
                                     f"data.buckets does not define (defined: {self.bucket_names})")
                gid = len(self._where)
                self._where.append((s, row))
                (val if rec.get("split", "train") == "val" else ids).append(gid)
            rows_by_source.append(ids)
        if not val:  # no held-out split: hold out a deterministic few from training
            pool = rows_by_source[0]
            take = set(np.random.default_rng([seed, 7]).permutation(pool)[:val_samples].tolist())
            rows_by_source[0] = [i for i in pool if i not in take]
            val = sorted(take)
        self.val_ids = val[:val_samples]
        for s, ids in enumerate(rows_by_source):
            if not ids:
                raise ValueError(f"corpus {self.indexes[s].root} has no training samples")
        self.bucket_of = np.array([bucket_no[self.record(i)["bucket"]] for i in range(len(self._where))], np.int32)
        self.S_of = np.array([buckets[self.record(i)["bucket"]].tokens for i in range(len(self._where))], np.int64)
        self.table = self._epoch_table(rows_by_source, weights, seed)
        self.empty_text = torch.load(os.path.join(self.indexes[0].root, EMPTY_TEXT_FILE)).float()
        self.skipped: Counter = Counter()
        self._lock = threading.Lock()

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

    def load(self, gid: int) -> tuple[torch.Tensor, torch.Tensor]:
        s, row = self._where[gid]
        index = self.indexes[s]
        latent = torch.from_numpy(load_npy(index.read(row, "latent.npy")).astype(np.float32, copy=False))
        text = torch.from_numpy(load_npy(index.read(row, "text.npy")).astype(np.float32, copy=False))
        return latent, text

    def load_checked(self, gid: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Load gid; on failure try the next samples of its bucket, counting why (never fails mid-run)."""
        same = np.flatnonzero(self.bucket_of == self.bucket_of[gid])
        start = int(np.searchsorted(same, gid))
        for k in range(min(len(same), 64)):
            cand = int(same[(start + k) % len(same)])
            try:
                latent, text = self.load(cand)
            except Exception as e:  # a corrupt member or truncated shard
                self._skip("unreadable", cand, e)
                continue
            if not (torch.isfinite(latent).all() and torch.isfinite(text).all()):
                self._skip("nonfinite", cand, "NaN/Inf in latents or text")
                continue
            return cand, latent, text
        raise RuntimeError(f"no readable sample left in bucket {self.bucket_names[self.bucket_of[gid]]}")

    def _skip(self, reason: str, gid: int, why) -> None:
        with self._lock:
            self.skipped[reason] += 1
            first = self.skipped[reason] == 1
        if first:
            log.warning("skipping sample %s (%s): %s", self.key(gid), reason, why)


def open_corpus(data_cfg, buckets: dict[str, Bucket], latent_channels: int, text_dim: int, seed: int,
                is_main: bool = True, barrier=lambda: None) -> LatentCorpus:
    """The training corpus the config names; the synthetic one is generated on first use (by rank 0)."""
    if data_cfg.sources:
        indexes = [SampleIndex.load(s["index"]) for s in data_cfg.sources]
        weights = [float(s.get("weight", 1.0)) for s in data_cfg.sources]
    elif data_cfg.index:
        indexes, weights = [SampleIndex.load(data_cfg.index)], [1.0]
    else:
        from data.synthetic import ensure_synthetic_corpus

        syn = data_cfg.synthetic
        spec = dict(mix=dict(syn.mix) or {n: 1.0 for n in buckets}, num_samples=syn.num_samples,
                    num_val=syn.num_val, latent_channels=latent_channels, text_dim=text_dim, seed=syn.seed,
                    num_classes=syn.num_classes, samples_per_shard=syn.samples_per_shard, dtype=syn.dtype)
        if is_main:
            ensure_synthetic_corpus(data_cfg.cache_dir, buckets, **spec)
        barrier()
        indexes, weights = [ensure_synthetic_corpus(data_cfg.cache_dir, buckets, **spec)], [1.0]
    for index in indexes:
        c, d = index.meta.get("latent_channels"), index.meta.get("text_dim")
        if (c, d) != (latent_channels, text_dim):
            raise ValueError(f"corpus {index.root} holds latents with {c} channels and text of dim {d}, but the "
                             f"model takes in_channels={latent_channels}, text_dim={text_dim}")
    return LatentCorpus(indexes, weights, buckets, data_cfg.val_samples, seed)


class Loader:
    def __init__(self, corpus: LatentCorpus, text_len: int, caption_dropout: float, seed: int, rank: int,
                 num_workers: int = 0):
        self.corpus, self.text_len, self.p_drop, self.seed, self.rank = corpus, text_len, caption_dropout, seed, rank
        self._pool = ThreadPoolExecutor(num_workers) if num_workers > 0 else None
        self._ahead: dict[tuple[int, int], list[Future]] = {}

    def _batch(self, mb: MicroBatch, epoch: int) -> Batch:
        lat, txt, keys = [], [], []
        for gid in mb.ids:
            gid, latent, text = self.corpus.load_checked(gid)
            key = self.corpus.key(gid)
            if self.p_drop > 0 and torch.rand((), generator=keyed_generator(self.seed, epoch, key, "caption")) < self.p_drop:
                text = self.corpus.empty_text
            lat.append(latent)
            txt.append(text)
            keys.append(key)
        return collate(lat, txt, keys, self.corpus.bucket_names[mb.bucket], mb.S, mb.weights, self.text_len)

    def _submit(self, plan: StepPlan) -> list[Future]:
        key = (plan.epoch, plan.pos)
        if key not in self._ahead:
            mbs = plan.ranks[self.rank]
            if self._pool is None:
                futs = []
                for mb in mbs:
                    f: Future = Future()
                    f.set_result(mb)  # decoded lazily in step(): no worker
                    futs.append(f)
            else:
                futs = [self._pool.submit(self._batch, mb, plan.epoch) for mb in mbs]
            self._ahead[key] = futs
        return self._ahead[key]

    def prefetch(self, plan: Optional[StepPlan]) -> None:
        if plan is not None and self._pool is not None:
            self._submit(plan)

    def step(self, plan: StepPlan):
        """Yield this rank's Batches of `plan`, slot by slot, each with its data_wait_s."""
        futs = self._submit(plan)
        try:
            for fut in futs:
                t0 = time.perf_counter()
                out = fut.result()
                batch = self._batch(out, plan.epoch) if isinstance(out, MicroBatch) else out
                batch.data_wait_s = time.perf_counter() - t0
                yield batch
        finally:
            self._ahead.pop((plan.epoch, plan.pos), None)

    def val_batches(self, max_B: int = 8) -> list[Batch]:
        """The fixed held-out samples, grouped by bucket (no caption dropout)."""
        by_bucket: dict[int, list[int]] = {}
        for gid in self.corpus.val_ids:
            by_bucket.setdefault(int(self.corpus.bucket_of[gid]), []).append(gid)
        out = []
        for b, gids in sorted(by_bucket.items()):
            for i in range(0, len(gids), max_B):
                chunk = gids[i:i + max_B]
                loaded = [self.corpus.load_checked(g) for g in chunk]
                out.append(collate([l[1] for l in loaded], [l[2] for l in loaded],
                                   [self.corpus.key(l[0]) for l in loaded], self.corpus.bucket_names[b],
                                   int(self.corpus.S_of[chunk[0]]), [1.0] * len(chunk), self.text_len))
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

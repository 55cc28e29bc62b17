"""Reading the samples a plan names: corpora addressed by global id, weighted epochs, a prefetching loader.

    LatentCorpus   one or more sample indexes (data.index, data.urls or data.sources) in one id space; a record is
                   precomputed latents (kind latent) or a raw image/video (kind image | video, encoded on the fly by
                   data/encoders.py); the planner's SampleTable (a source of weight w contributes round(w·N) entries
                   per epoch, cycled when it runs out, CONTRACTS §2), the held-out validation ids, and `load(id)` — a
                   seek into the tar
    Loader         turns this rank's share of a StepPlan into Batches: worker threads read and decode the planned
                   samples ahead (PyAV and PIL release the GIL, so threads scale without copying frames between
                   processes); the VAE and text encoder run on the calling thread when the batch is taken, so
                   `data_wait_s` includes on-the-fly encoding. Every random choice (caption dropout, where a clip
                   starts) is keyed by (seed, epoch, key), so workers, resumes and world sizes draw the same. A sample
                   that fails to read or decode, or holds NaN/Inf, is replaced by the next good sample of its bucket,
                   counted as data/skipped_<reason> and logged once with its key; it is not tried again.
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
from data.index import EMPTY_POOLED_FILE, EMPTY_TEXT_FILE, SampleIndex, load_npy
from data.raw import RawConfig, clip_start, common_dir, ensure_raw_index, expand_urls, load_raw, select_raw
from models.flow_matching import keyed_generator
from scheduling.balance import MicroBatch, SampleTable, StepPlan

log = logging.getLogger(__name__)
LOG_KEYS_PER_REASON = 20  # bad keys logged one by one per reason; the rest are counted only


class LatentCorpus:
    def __init__(self, indexes: Sequence[SampleIndex], weights: Sequence[float], buckets: dict[str, Bucket],
                 val_samples: int, seed: int, raw: Optional[RawConfig] = None, encoders=None,
                 skipped: Optional[Counter] = None):
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
        # replacements for a bad sample come from its own split: a held-out sample must never enter training
        self.is_train = np.zeros(len(self._where), dtype=bool)
        self.is_train[[i for ids in rows_by_source for i in ids]] = True
        if encoders is not None:  # the empty prompt of the encoder in use (precompute stores the same one)
            self.empty_text, self.empty_pooled = encoders.empty_text, encoders.empty_pooled
        else:
            root = self.indexes[0].root
            self.empty_text = torch.load(os.path.join(root, EMPTY_TEXT_FILE)).float()
            pooled = os.path.join(root, EMPTY_POOLED_FILE)
            self.empty_pooled = torch.load(pooled).float() if os.path.exists(pooled) else None
        self.skipped: Counter = Counter(skipped or {})
        self._bad: set[int] = set()
        self._logged: Counter = Counter()
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

    def is_raw(self, gid: int) -> bool:
        return self.record(gid)["kind"] != "latent"

    def load(self, gid: int, epoch: int = 0):
        """(latent [C, F, H, W], text [L, C_text]) for precomputed samples; (pixels [F, H, W, 3] uint8, caption)
        for raw ones, the clip placed by a draw keyed by (seed, epoch, key)."""
        s, row = self._where[gid]
        index = self.indexes[s]
        rec = index.records[row]
        if rec["kind"] != "latent":
            u = 0.0
            if self.raw.clip == "random" and rec["kind"] == "video":
                u = float(torch.rand((), generator=keyed_generator(self.seed, epoch, self.key(gid), "clip")))
            return load_raw(index, row, self.buckets[rec["bucket"]], self.raw, clip_start(self.raw, u))
        latent = torch.from_numpy(load_npy(index.read(row, "latent.npy")).astype(np.float32, copy=False))
        text = torch.from_numpy(load_npy(index.read(row, "text.npy")).astype(np.float32, copy=False))
        return latent, text

    def pooled(self, gid: int) -> Optional[torch.Tensor]:
        """The stored pooled text embedding of a precomputed sample, where its encoder has one."""
        s, row = self._where[gid]
        if "pooled.npy" not in self.indexes[s].records[row]["members"]:
            return None
        return torch.from_numpy(load_npy(self.indexes[s].read(row, "pooled.npy")).astype(np.float32, copy=False))

    def load_checked(self, gid: int, epoch: int = 0):
        """(id, *load(id)) for gid or, when it is bad, the next good sample of its bucket (never fails mid-run)."""
        same = np.flatnonzero((self.bucket_of == self.bucket_of[gid]) & (self.is_train == self.is_train[gid]))
        start = int(np.searchsorted(same, gid))
        for k in range(min(len(same), 64)):
            cand = int(same[(start + k) % len(same)])
            if cand in self._bad:
                continue
            try:
                a, b = self.load(cand, epoch)
            except Exception as e:  # a corrupt member, truncated shard or undecodable media
                self._skip(getattr(e, "reason", "unreadable"), cand, e)
                continue
            if isinstance(a, torch.Tensor) and not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                self._skip("nonfinite", cand, "NaN/Inf in latents or text")
                continue
            return cand, a, b
        raise RuntimeError(f"no readable sample found in bucket {self.bucket_names[self.bucket_of[gid]]} near "
                           f"{self.key(gid)} (skipped so far: {dict(self.skipped)}): is the corpus all bad?")

    def _skip(self, reason: str, gid: int, why) -> None:
        with self._lock:
            if gid in self._bad:
                return
            self._bad.add(gid)
            self.skipped[reason] += 1
            self._logged[reason] += 1
            n = self._logged[reason]
        if n <= LOG_KEYS_PER_REASON:
            log.warning("skipping sample %s (%s): %s%s", self.key(gid), reason, why,
                        "; further samples skipped for this reason are only counted" if n == LOG_KEYS_PER_REASON
                        else "")


def _sources(data_cfg) -> Optional[list[tuple[str, dict]]]:
    """[(config path, {index?, urls?, weight})] of the corpora the config names; None: the synthetic corpus."""
    if data_cfg.sources:
        return [(f"data.sources[{i}]", dict(s)) for i, s in enumerate(data_cfg.sources)]
    if data_cfg.urls is not None:
        return [("data.urls", {"urls": data_cfg.urls, "index": data_cfg.index})]
    if data_cfg.index:
        return [("data.index", {"index": data_cfg.index})]
    return None


def open_corpus(data_cfg, buckets: dict[str, Bucket], latent_channels: int, text_dim: int, seed: int,
                is_main: bool = True, barrier=lambda: None, pooled_dim: Optional[int] = None) -> LatentCorpus:
    """The training corpus the config names. Raw shards are indexed on first use (by rank 0, resumably); the
    synthetic latent corpus is generated on first use (with pooled text of `pooled_dim` when the model takes it). Everything that can be checked without decoding — a pattern
    that matches nothing, a corpus with no usable sample, a mismatched latent corpus — fails here, before training."""
    sources = _sources(data_cfg)
    if sources is None:
        from data.synthetic import ensure_synthetic_corpus

        syn = data_cfg.synthetic
        spec = dict(mix=dict(syn.mix) or {n: 1.0 for n in buckets}, num_samples=syn.num_samples,
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
            c, d = index.meta.get("latent_channels"), index.meta.get("text_dim")
            if (c, d) != (latent_channels, text_dim):
                raise ValueError(f"corpus {index.root} holds latents with {c} channels and text of dim {d}, but the "
                                 f"model takes in_channels={latent_channels}, text_dim={text_dim}")
            skipped.update(index.meta.get("skipped", {}))
        indexes.append(index)
        weights.append(float(src.get("weight", 1.0)))
    encoders = None
    if any(ix.meta.get("kind") == "raw" for ix in indexes):
        from data.encoders import build_encoders

        encoders = build_encoders(data_cfg.encoders, latent_channels, text_dim)
    corpus = LatentCorpus(indexes, weights, buckets, data_cfg.val_samples, seed, data_cfg.raw, encoders, skipped)
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

    def _read(self, mb: MicroBatch, epoch: int) -> list[tuple]:
        """(id, a, b) per sample of the micro-batch: latents and text, or pixels and caption (worker side)."""
        return [self.corpus.load_checked(gid, epoch) for gid in mb.ids]

    def _assemble(self, mb: MicroBatch, items: list[tuple], epoch: int, drop: bool = True) -> Batch:
        """Encode what is raw, apply caption dropout, pad and stack (calling thread: the encoders live here)."""
        corpus, enc = self.corpus, self.corpus.encoders
        keys = [corpus.key(gid) for gid, _, _ in items]
        dropped = [drop and self.p_drop > 0 and bool(torch.rand((), generator=keyed_generator(
            self.seed, epoch, key, "caption")) < self.p_drop) for key in keys]
        latents, texts = [a for _, a, _ in items], [b for _, _, b in items]
        pooled: list[Optional[torch.Tensor]] = [corpus.pooled(gid) if not corpus.is_raw(gid) else None
                                                for gid, _, _ in items]
        raw = [j for j, (gid, _, _) in enumerate(items) if corpus.is_raw(gid)]
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
        for j in range(len(items)):
            if dropped[j]:
                texts[j], pooled[j] = corpus.empty_text, corpus.empty_pooled
        batch = collate(latents, texts, keys, corpus.bucket_names[mb.bucket], mb.S, mb.weights, self.text_len)
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
        """The fixed held-out samples, grouped by bucket (no caption dropout; clips placed as in epoch 0)."""
        by_bucket: dict[int, list[int]] = {}
        for gid in self.corpus.val_ids:
            by_bucket.setdefault(int(self.corpus.bucket_of[gid]), []).append(gid)
        out = []
        for b, gids in sorted(by_bucket.items()):
            for i in range(0, len(gids), max_B):
                chunk = tuple(gids[i:i + max_B])
                mb = MicroBatch(b, chunk, (1.0,) * len(chunk), int(self.corpus.S_of[chunk[0]]), 0.0)
                out.append(self._assemble(mb, self._read(mb, 0), 0, drop=False))
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

"""The sample index: one metadata record per sample, written beside the shards; reading a sample is a seek.

Files in a corpus folder:
    corpus.json      what the corpus holds (kind, latent channels, text dim, bucket table it was made for)
    index.jsonl      one record per sample: key, shard (relative path), members {ext: [offset, size]} inside the
                     tar, kind (image | video | latent), frames/height/width (raw) or latent [C, F, H, W],
                     bucket, S, L_text, split (train | val)
    empty_text.pt    the empty prompt's text embedding [L, C_text], for caption dropout and guidance
    *.tar            WebDataset shards

The planner never sees records, only the (id, bucket, S) arrays of `SampleTable`.
"""
from __future__ import annotations

import io
import json
import os
import tarfile
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

INDEX_FILE = "index.jsonl"
CORPUS_FILE = "corpus.json"
EMPTY_TEXT_FILE = "empty_text.pt"
FORMAT = "adaptiveload-index/1"


@dataclass
class SampleIndex:
    root: str
    meta: dict
    records: list[dict] = field(default_factory=list)

    @classmethod
    def load(cls, root: str) -> "SampleIndex":
        path = os.path.join(root, INDEX_FILE)
        if not os.path.exists(path):
            raise FileNotFoundError(f"no sample index at {path}: write one with data/synthetic.py, "
                                    f"scripts/make_corpus.py or scripts/index_corpus.py")
        with open(os.path.join(root, CORPUS_FILE)) as f:
            meta = json.load(f)
        if meta.get("format") != FORMAT:
            raise ValueError(f"{root}/{CORPUS_FILE}: format {meta.get('format')!r}, expected {FORMAT!r}")
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
        return cls(root, meta, records)

    def save(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        tmp = os.path.join(self.root, INDEX_FILE + ".tmp")
        with open(tmp, "w") as f:
            for r in self.records:
                f.write(json.dumps(r, separators=(",", ":")) + "\n")
        with open(os.path.join(self.root, CORPUS_FILE), "w") as f:
            json.dump({"format": FORMAT, **self.meta}, f, indent=1)
        os.replace(tmp, os.path.join(self.root, INDEX_FILE))  # the index appears last: its presence means complete

    def split(self, name: str) -> list[int]:
        return [i for i, r in enumerate(self.records) if r.get("split", "train") == name]

    def read(self, i: int, ext: str) -> bytes:
        r = self.records[i]
        offset, size = r["members"][ext]
        return read_range(os.path.join(self.root, r["shard"]), offset, size)


@lru_cache(maxsize=256)
def _fd(path: str) -> int:
    return os.open(path, os.O_RDONLY)


def read_range(path: str, offset: int, size: int) -> bytes:
    """`size` bytes at `offset`: one pread on a cached descriptor (safe across loader threads, no stale buffer)."""
    data = os.pread(_fd(path), size, offset)
    if len(data) != size:
        raise IOError(f"{path}: short read at offset {offset} ({len(data)} of {size} bytes): truncated shard?")
    return data


def tar_members(path: str) -> dict[str, dict[str, tuple[int, int]]]:
    """{key: {ext: (data offset, size)}} for a WebDataset tar, from its headers alone (no member is read)."""
    out: dict[str, dict[str, tuple[int, int]]] = {}
    with tarfile.open(path, "r:") as tar:
        for m in tar:
            if not m.isfile():
                continue
            base = os.path.basename(m.name)
            key, _, ext = base.partition(".")
            key = os.path.join(os.path.dirname(m.name), key)
            out.setdefault(key, {})[ext] = (m.offset_data, m.size)
    return out


def npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def load_npy(b: bytes) -> np.ndarray:
    return np.load(io.BytesIO(b), allow_pickle=False)

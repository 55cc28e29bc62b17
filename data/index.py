"""The sample index: one metadata record per sample, written beside the shards; reading a sample is a seek.

Files in a corpus folder:
    corpus.json      what the corpus holds (kind, latent channels, text dim, bucket table it was made for)
    index.jsonl      one record per sample: key, shard (relative path), members {ext: [offset, size]} inside the
                     tar, kind (image | video | latent), frames/height/width (raw) or latent [C, F, H, W],
                     bucket, S, L_text, split (train | val); raw records also media/caption (which members),
                     fps, and have L_text null (known once the caption is tokenised) and bucket null when no
                     bucket of the indexing table fits (data/raw.py re-buckets on load)
    empty_text.pt    the empty prompt's text embedding [L, C_text], for caption dropout and guidance (latent corpora;
                     a raw corpus gets it from the text encoder in use)
    skipped.jsonl    raw corpora: every sample the indexer skipped, with its reason
    *.tar            WebDataset shards

The planner never sees records, only the (id, bucket, S) arrays of `SampleTable`.
"""
from __future__ import annotations

import io
import json
import os
import tarfile
import threading
from dataclasses import dataclass, field
from collections import OrderedDict
from typing import Optional

import numpy as np

INDEX_FILE = "index.jsonl"
CORPUS_FILE = "corpus.json"
EMPTY_TEXT_FILE = "empty_text.pt"
EMPTY_POOLED_FILE = "empty_pooled.pt"  # only where the text encoder has a pooled output
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


class _FdCache(OrderedDict):
    """One thread's open shard descriptors, least recently used first; evicted ones are closed by their owner only."""
    size = 64

    def get_fd(self, path: str) -> int:
        fd = self.pop(path, None)
        if fd is None:
            fd = os.open(path, os.O_RDONLY)
            while len(self) >= self.size:
                os.close(self.popitem(last=False)[1])
        self[path] = fd
        return fd

    def __del__(self):
        for fd in self.values():
            try:
                os.close(fd)
            except OSError:
                pass


_local = threading.local()


def _fd(path: str) -> int:
    # per thread, so that no thread closes a descriptor another is reading (a corpus has more shards than fds)
    cache = getattr(_local, "fds", None)
    if cache is None:
        cache = _local.fds = _FdCache()
    return cache.get_fd(path)


def read_range(path: str, offset: int, size: int) -> bytes:
    """`size` bytes at `offset`: one pread on this thread's cached descriptor (no shared file position or buffer)."""
    data = os.pread(_fd(path), size, offset)
    if len(data) != size:
        raise IOError(f"{path}: short read at offset {offset} ({len(data)} of {size} bytes): truncated shard?")
    return data


@dataclass
class TarScan:
    """What the headers of one tar say: members by key, and the keys they already show to be broken."""
    members: dict[str, dict[str, tuple[int, int]]]  # {key: {ext: (data offset, size)}}
    broken: dict[str, str]                          # {key: reason}: corrupt_member | truncated_shard
    error: Optional[str] = None                     # the whole shard is unreadable (not a tar, no permission)


def split_name(name: str) -> tuple[str, str]:
    """WebDataset naming: the key is the path up to the first dot of the base name, the extension the rest."""
    base = os.path.basename(name)
    key, _, ext = base.partition(".")
    return os.path.join(os.path.dirname(name), key), ext


def _header_name(path: str, offset: int) -> Optional[str]:
    """The name field of a (possibly corrupt) tar header block, when it is readable text."""
    try:
        raw = os.pread(_fd(path), 100, offset).split(b"\0", 1)[0].decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return raw if raw and raw.isprintable() else None


def scan_tar(path: str) -> TarScan:
    """Members of a WebDataset tar from its headers alone (no member is read), resynchronising after a corrupt header.

    A header that fails its checksum is skipped block by block until the next valid one (tarfile's ignore_zeros);
    the bytes skipped between the end of one member and the next header are the corrupt member, named by the key its
    damaged header still shows. A shard cut short marks the members it cuts, and the last key, truncated_shard.
    """
    members: dict[str, dict[str, tuple[int, int]]] = {}
    broken: dict[str, str] = {}
    try:
        size = os.path.getsize(path)
        tar = tarfile.open(path, "r:", ignore_zeros=True)
    except (tarfile.TarError, OSError) as e:
        return TarScan({}, {}, f"{type(e).__name__}: {e}")
    end, last_key, truncated = 0, None, False
    with tar:
        it = iter(tar)
        while True:
            try:
                m = next(it)
            except StopIteration:
                break
            except (tarfile.TarError, OSError):  # "unexpected end of data": the shard was cut
                truncated = True
                break
            if m.offset > end:  # bytes no valid header accounts for: a damaged member header
                name = _header_name(path, end)
                key = split_name(name)[0] if name else f"<corrupt member at byte {end}>"
                broken[key] = "corrupt_member"
            end = m.offset_data + -(-m.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
            if not m.isfile():
                continue
            key, ext = split_name(m.name)
            if m.offset_data + m.size > size:
                broken[key], truncated = "truncated_shard", True
            members.setdefault(key, {})[ext] = (m.offset_data, m.size)
            last_key = key
    if truncated and last_key is not None:
        broken.setdefault(last_key, "truncated_shard")
    return TarScan(members, broken)


def tar_members(path: str) -> dict[str, dict[str, tuple[int, int]]]:
    """{key: {ext: (data offset, size)}} for a WebDataset tar, from its headers alone (no member is read)."""
    scan = scan_tar(path)
    if scan.error:
        raise tarfile.ReadError(f"{path}: {scan.error}")
    return scan.members


def npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def load_npy(b: bytes) -> np.ndarray:
    return np.load(io.BytesIO(b), allow_pickle=False)

"""The sample index: one metadata record per sample, written beside the shards; reading a sample is a seek.

Files in a corpus folder:
    corpus.json      what the corpus holds (kind, latent channels, text dim, bucket table it was made for, and
                     num_records: how many lines index.jsonl holds, so that a cut index is found)
    index.jsonl      one record per sample: key, shard (relative path), members {ext: [offset, size]} inside the
                     tar, kind (image | video | latent), frames/height/width (raw) or latent [C, F, H, W],
                     bucket, S, L_text, split (train | val); raw records also media/caption (which members),
                     fps, and have L_text null (known once the caption is tokenised) and bucket null when no
                     bucket of the indexing table fits (data/raw.py re-buckets on load)
    empty_text.pt    the empty prompt's text embedding [L, C_text], for caption dropout and guidance (latent corpora;
                     a raw corpus gets it from the text encoder in use)
    skipped.jsonl    raw corpora: every sample the indexer skipped, with its reason
    *.tar            WebDataset shards

The planner never sees records, only the (id, bucket, S) arrays of `SampleTable`. An index that does not parse
(a line that is not a JSON object with key/shard/members/kind/bucket, fewer lines than corpus.json counts, a
corpus.json that is not a JSON object) raises CorruptIndex, a ValueError naming the file and line. Nothing here
unpickles: arrays are read with allow_pickle=False.

Inputs are opened through `open_input` only: a path that is a link leading out of its folder (link_outside), or that
is not a regular file (not_regular: a device such as /dev/zero, a fifo, a socket, a folder, a broken link) is refused
with InputRefused before a byte of it is read, so that no target of such a link is ever read, logged or trained on,
and no read blocks on a device or a fifo. Files the tools write beside the shards go through `write_file`: whole or
not at all, never through a link.
"""
from __future__ import annotations

import io
import json
import os
import stat
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
RECORD_FIELDS = ("key", "shard", "members", "kind", "bucket")


class CorruptIndex(ValueError):
    """A sample index (or a file beside it) that does not parse: truncated, or written by something else."""


class InputRefused(OSError):
    """An input path that is not read: a link leading out of its folder, or not a regular file (`reason`)."""

    def __init__(self, reason: str, why: str):
        super().__init__(why)
        self.reason = reason


def input_problem(path: str, folder: Optional[str] = None) -> Optional[tuple[str, str]]:
    """(reason, why) when `path` must not be read as an input, else None; nothing of the path's target is read.

    link_outside: the path resolves (through links) outside `folder` (default: the folder that holds the path);
    not_regular: it is not a regular file (a device, a fifo, a socket, a folder, a broken link)."""
    folder = os.path.realpath(folder if folder is not None else os.path.dirname(os.path.abspath(path)))
    real = os.path.realpath(path)
    if os.path.commonpath([real, folder]) != folder:
        return "link_outside", f"{path} is a link that leads out of {folder}: not read"
    try:
        mode = os.stat(real).st_mode
    except OSError as e:
        return "not_regular", f"{path} cannot be opened ({type(e).__name__}; a broken link?)"
    if not stat.S_ISREG(mode):
        return "not_regular", f"{path} is not a regular file (a device, fifo, socket or folder): not read"
    return None


def open_input(path: str, folder: Optional[str] = None) -> int:
    """A read-only descriptor of the regular file `path`, which lies in `folder` (default: its own folder) after
    links are resolved; InputRefused otherwise. The resolved path is opened without following a link and without
    blocking, and checked again on the descriptor, so a file swapped in between is refused too."""
    problem = input_problem(path, folder)
    if problem is not None:
        raise InputRefused(*problem)
    fd = os.open(os.path.realpath(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InputRefused("not_regular", f"{path} is not a regular file: not read")
    os.set_blocking(fd, True)
    return fd


def write_file(path: str, data: bytes) -> None:
    """Write `data` to `path` whole or not at all, never through a link: into a fresh `path.tmp` (any file or link
    already under that name is removed first; O_EXCL | O_NOFOLLOW), then renamed over `path` (a link at `path` is
    replaced, its target untouched)."""
    tmp = path + ".tmp"
    if os.path.lexists(tmp):
        os.remove(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_jsonl(path: str, rows, **dumps) -> None:
    """One JSON object a line, written by write_file."""
    write_file(path, "".join(json.dumps(r, **dumps) + "\n" for r in rows).encode("utf-8", "surrogateescape"))


def read_json(path: str):
    """The JSON value in `path`; CorruptIndex naming the file when it does not parse."""
    try:
        with os.fdopen(open_input(path), "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptIndex(f"{path} is not valid JSON ({e}): the file is truncated or corrupt") from None


def read_jsonl(path: str, fields: tuple[str, ...] = ()) -> list[dict]:
    """One JSON object per non-blank line of `path`, each holding `fields`; CorruptIndex naming the line otherwise."""
    out = []
    with os.fdopen(open_input(path), "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line.decode("utf-8"))
            except (ValueError, UnicodeDecodeError) as e:
                raise CorruptIndex(f"{path} line {n} is not valid JSON ({e}): the file is truncated or "
                                   f"corrupt") from None
            if not isinstance(rec, dict) or any(k not in rec for k in fields):
                raise CorruptIndex(f"{path} line {n} is not a record with fields {list(fields)}: {line[:120]!r}")
            out.append(rec)
    return out


@dataclass
class SampleIndex:
    root: str
    meta: dict
    records: list[dict] = field(default_factory=list)

    @classmethod
    def load(cls, root: str) -> "SampleIndex":
        """The index in `root`: FileNotFoundError when there is none, CorruptIndex when it does not parse."""
        path = index_path(root)
        meta = read_meta(root)
        records = read_jsonl(path, RECORD_FIELDS)
        if meta.get("num_records", len(records)) != len(records):
            raise CorruptIndex(f"{path} holds {len(records)} records but {CORPUS_FILE} counts "
                               f"{meta['num_records']}: the index is truncated")
        return cls(root, meta, records)

    def save(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        write_file(os.path.join(self.root, CORPUS_FILE),
                   json.dumps({"format": FORMAT, **self.meta, "num_records": len(self.records)}, indent=1).encode())
        # the index appears last: its presence means complete
        write_jsonl(os.path.join(self.root, INDEX_FILE), self.records, separators=(",", ":"))

    def split(self, name: str) -> list[int]:
        return [i for i, r in enumerate(self.records) if r.get("split", "train") == name]

    def read(self, i: int, ext: str) -> bytes:
        r = self.records[i]
        offset, size = r["members"][ext]
        return read_range(os.path.join(self.root, r["shard"]), offset, size)


def index_path(root: str) -> str:
    """The index.jsonl of the corpus in `root`; FileNotFoundError saying how to write one when there is none."""
    path = os.path.join(root, INDEX_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no sample index at {path}: write one with data/synthetic.py, "
                                f"scripts/make_corpus.py or scripts/index_corpus.py")
    return path


def read_meta(root: str) -> dict:
    """corpus.json of the corpus in `root`: CorruptIndex when it does not parse, a plain ValueError when it is
    another tool's (a format other than FORMAT: not ours to rewrite)."""
    path = os.path.join(root, CORPUS_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no {CORPUS_FILE} in {root}: write the corpus with data/synthetic.py, "
                                f"scripts/make_corpus.py, scripts/index_corpus.py or scripts/precompute_latents.py")
    meta = read_json(path)
    if not isinstance(meta, dict):
        raise CorruptIndex(f"{path} holds a {type(meta).__name__}, not an object: the file is corrupt")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


class _FdCache(OrderedDict):
    """One thread's open shard descriptors, least recently used first; evicted ones are closed by their owner only."""
    size = 64

    def get_fd(self, path: str) -> int:
        fd = self.pop(path, None)
        if fd is None:
            fd = open_input(path)
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
    reason: str = "unreadable_shard"                # why, when `error`: or link_outside, not_regular
    duplicates: list[str] = field(default_factory=list)  # a key once per later sample that reuses it (skipped)


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
    A file in which no valid header is found at all (not a tar: random bytes, an empty file, an empty archive) is
    unreadable as a whole (`error`): with ignore_zeros tarfile would otherwise read it as a tar of nothing; so is a
    path open_input refuses (`reason` link_outside or not_regular), before anything is read.
    A key that comes back after another key's members, or an extension seen twice in a row, starts a second sample
    of that key: the first is kept and each later one is listed in `duplicates` (counted, never silently merged).
    """
    members: dict[str, dict[str, tuple[int, int]]] = {}
    broken: dict[str, str] = {}
    try:
        f = os.fdopen(open_input(path), "rb")  # never a link out of its folder, a device or a fifo (it would hang)
    except OSError as e:
        return TarScan({}, {}, f"{type(e).__name__}: {e}", getattr(e, "reason", "unreadable_shard"))
    try:
        size = os.fstat(f.fileno()).st_size
        tar = tarfile.open(fileobj=f, mode="r:", ignore_zeros=True)
    except (tarfile.TarError, OSError) as e:
        f.close()
        return TarScan({}, {}, f"{type(e).__name__}: {e}")
    end, last_key, truncated = 0, None, False
    cur, dup, duplicates = None, False, []
    with f, tar:
        it = iter(tar)
        while True:
            try:
                m = next(it)
            except StopIteration:
                break
            except Exception:  # "unexpected end of data": the shard was cut (or damaged past what tarfile resyncs)
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
            if key != cur:  # a sample is a run of consecutive members of one key (WebDataset's grouping)
                cur, dup = key, key in members
                if dup:  # the key of an earlier sample: the first one is kept, this one is counted
                    duplicates.append(key)
            elif not dup and ext in members[key]:  # the same extension twice in a row: a second sample
                dup = True
                duplicates.append(key)
            if dup:
                continue
            if m.offset_data + m.size > size:
                broken[key], truncated = "truncated_shard", True
            members.setdefault(key, {})[ext] = (m.offset_data, m.size)
            last_key = key
    if truncated and last_key is not None:
        broken.setdefault(last_key, "truncated_shard")
    if not members and not broken:
        return TarScan({}, {}, f"no tar member found in its {size} bytes: not a tar file, or an empty archive")
    return TarScan(members, broken, duplicates=duplicates)


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
